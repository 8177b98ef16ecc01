"""``comera::tt_materialize``: the marker op that turns TT / TT-matrix / BTT cores into a dense weight.

A tensorized layer's weight parametrization is exactly one call of this op, so a Dynamo graph shows
``linear(x, comera.tt_materialize(core_flat, gate_flat, ...))`` and the tensor-network pass can replace
the pair with a contraction that never forms the weight. In eager mode (and whenever no pass rewrites
it) the op is simply correct: the body contracts the cores with torch
(:func:`comera_compile.tt.materialize`), the backward uses explicit formulas
(:func:`comera_compile.tt.materialize_vjp`) written in plain torch ops, so AOTAutograd traces them
into the backward graph and double backward works.

Schema (checkpoints and compile caches depend on it)::

    comera::tt_materialize(Tensor core_flat, Tensor gate_flat, str fmt, int[] row_modes,
                           int[] col_modes, int[] ranks, int rows, int cols, bool transpose) -> Tensor

The arguments after the two flat storages are a :class:`~comera_compile.tt.format.TTSpec`'s fields in
order: ``spec.materialize_args(core_flat, gate_flat)`` writes them and ``TTSpec.from_materialize_node``
reads them back from a graph. The cores are stored back to back in ``core_flat`` and the rank gates in
``gate_flat`` (``comera_compile.tt.join_flat`` / ``split_flat`` for ``ranks``). It returns
``M[:rows, :cols]`` (``transpose=False``) or its transpose, contiguous (``transpose=True``, nn.Linear).
"""

from __future__ import annotations

from typing import Sequence

import torch

from comera_compile.tt import TTSpec, join_flat, materialize, materialize_vjp, split_flat

__all__ = ["tt_materialize"]

_NAME = "comera::tt_materialize"


@torch.library.custom_op(_NAME, mutates_args=())
def _tt_materialize(
    core_flat: torch.Tensor,
    gate_flat: torch.Tensor,
    fmt: str,
    row_modes: list[int],
    col_modes: list[int],
    ranks: list[int],
    rows: int,
    cols: int,
    transpose: bool,
) -> torch.Tensor:
    spec = TTSpec(fmt, row_modes, col_modes, ranks, rows, cols, transpose)
    return materialize(*split_flat(core_flat, gate_flat, spec), spec)


@_tt_materialize.register_fake
def _(core_flat, gate_flat, fmt, row_modes, col_modes, ranks, rows, cols, transpose):
    # No shape checks here: under dynamic shapes a comparison would install guards.
    shape = (cols, rows) if transpose else (rows, cols)
    return core_flat.new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    core_flat, gate_flat, *meta = inputs
    ctx.spec = TTSpec(*meta)
    ctx.save_for_backward(core_flat, gate_flat)


def _backward(ctx, grad):
    core_flat, gate_flat = ctx.saved_tensors
    grad_cores, grad_gates = materialize_vjp(*split_flat(core_flat, gate_flat, ctx.spec), ctx.spec, grad)
    flat, gflat = join_flat(grad_cores, grad_gates, like=gate_flat)
    return flat, gflat, None, None, None, None, None, None, None


_tt_materialize.register_autograd(_backward, setup_context=_setup_context)


def tt_materialize(
    cores: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
    fmt: str,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    rows: int,
    cols: int,
    transpose: bool,
) -> torch.Tensor:
    """Python entry point: the weight of the TT given by ``cores`` and ``gates`` (concatenated into the
    op's flat storage; ranks read from the core shapes)."""
    spec = TTSpec.from_cores(cores, fmt, row_modes, col_modes, rows, cols, transpose)
    return torch.ops.comera.tt_materialize(*spec.materialize_args(*join_flat(cores, gates)))
