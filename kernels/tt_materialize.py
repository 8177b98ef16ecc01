"""``comera::tt_materialize``: the marker op that turns TT / TT-matrix cores into a dense weight.

A tensorized layer's weight parametrization is exactly one call of this op, so a Dynamo graph shows
``linear(x, comera.tt_materialize(cores, gates, ...))`` and the tensor-network pass can replace the
pair with a contraction that never forms the weight. In eager mode (and whenever no pass rewrites
it) the op is simply correct: the body contracts the cores with torch
(:func:`comera_compile.tt.materialize`), the backward uses explicit formulas
(:func:`comera_compile.tt.materialize_vjp`) written in plain torch ops, so AOTAutograd traces them
into the backward graph and double backward works.

Schema (DESIGN.md)::

    comera::tt_materialize(Tensor[] cores, Tensor[] gates, str fmt, int[] row_modes,
                           int[] col_modes, int rows, int cols, bool transpose) -> Tensor

It returns ``M[:rows, :cols]`` (``transpose=False``) or its transpose (``transpose=True``, nn.Linear),
contiguous. Ranks are read from the cores' shapes, so pruned cores need no new metadata.
"""

from __future__ import annotations

from typing import Sequence

import torch

from comera_compile.tt import materialize, materialize_vjp, spec_from_cores

__all__ = ["tt_materialize"]

_NAME = "comera::tt_materialize"


@torch.library.custom_op(_NAME, mutates_args=())
def _tt_materialize(
    cores: list[torch.Tensor],
    gates: list[torch.Tensor],
    fmt: str,
    row_modes: list[int],
    col_modes: list[int],
    rows: int,
    cols: int,
    transpose: bool,
) -> torch.Tensor:
    spec = spec_from_cores(cores, fmt, row_modes, col_modes, rows, cols, transpose)
    return materialize(cores, gates, spec)


@_tt_materialize.register_fake
def _(cores, gates, fmt, row_modes, col_modes, rows, cols, transpose):
    # No shape checks on the cores here: under dynamic shapes a comparison would install guards.
    shape = (cols, rows) if transpose else (rows, cols)
    return cores[0].new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    cores, gates, fmt, row_modes, col_modes, rows, cols, transpose = inputs
    ctx.n_cores = len(cores)
    ctx.meta = (fmt, list(row_modes), list(col_modes), rows, cols, transpose)
    ctx.save_for_backward(*cores, *gates)


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    cores, gates = list(saved[: ctx.n_cores]), list(saved[ctx.n_cores:])
    spec = spec_from_cores(cores, *ctx.meta)
    grad_cores, grad_gates = materialize_vjp(cores, gates, spec, grad)
    return grad_cores, grad_gates, None, None, None, None, None, None


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
    """Python entry point: ``torch.ops.comera.tt_materialize`` with lists coerced."""
    return torch.ops.comera.tt_materialize(
        list(cores), list(gates), fmt, [int(m) for m in row_modes], [int(m) for m in col_modes],
        int(rows), int(cols), bool(transpose),
    )
