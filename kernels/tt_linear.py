"""``comera::tt_linear``: ``x @ M[:rows, :cols] + bias`` for a tensor-train matrix M, as one op.

``M`` is stored as TT cores and rank gates (``"tt"`` or ``"ttm"``, the layouts of
:mod:`comera_compile.tt.format`); for ``nn.Linear(in, out)`` rows = in, cols = out and the weight is
``M.T``, so this equals ``F.linear(x, M[:rows, :cols].T, bias)``.

It runs the plan of :func:`comera_compile.tt.planner.plan_linear` for ``x``'s token count with the
shared executor :mod:`comera_compile.kernels.tt_runtime` (the same functions the compiled graph calls,
where the ``tensor_network`` pass also batches the token-independent merges across layers):

* ``"factored"`` (the ``"tt"`` format's rank bottleneck): ``linear(x @ L, Rᵀ, bias)``, never forming M;
* ``"dense"``: ``linear(x, Mᵀ, bias)`` with M merged from the cores (small token counts, ``"ttm"``).

The op is opaque to ``torch.compile`` (a ``torch.library`` custom op), so it can be called inside any
compiled function; its backward is the vector-Jacobian product of the same executor (``torch.func.vjp``:
four token-sized GEMMs for the factored path, as CoMERA's, after recomputing the forward). Nothing
reads device values on the host (CUDA-graph safe). Tensorized models compiled with
``backend="comera"`` do not go through this op: the ``tensor_network`` pass puts the executor's calls
into the graph itself, batched across layers.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from comera_compile.kernels import tt_runtime
from comera_compile.tt.format import TTSpec
from comera_compile.tt.planner import plan_linear

__all__ = ["tt_linear"]

_NAME = "comera::tt_linear"


def _forward(x, cores, gates, bias, spec: TTSpec):
    n = math.prod(x.shape[:-1])
    plan = plan_linear(spec, max(n, 1), x.element_size())
    dtype = x.dtype
    b = bias.to(dtype) if bias is not None else None
    if plan.strategy == "factored":
        f1, f2 = tt_runtime.layer_outputs(cores, gates, spec, plan, "factors", dtype)
        return F.linear(tt_runtime.project(x, f1, dtype), f2, b)
    (w,) = tt_runtime.layer_outputs(cores, gates, spec, plan, "dense_t", dtype)
    return F.linear(x, w, b)


@torch.library.custom_op("comera::tt_linear", mutates_args=())
def _tt_linear_op(x: torch.Tensor, cores: list[torch.Tensor], gates: list[torch.Tensor], bias: Optional[torch.Tensor],
                  fmt: str, row_modes: list[int], col_modes: list[int], rows: int, cols: int) -> torch.Tensor:
    spec = tt_runtime.layer_spec(_NAME, cores, gates, fmt, row_modes, col_modes, rows, cols)
    if x.shape[-1] != rows:
        raise ValueError(f"{_NAME}: x has {x.shape[-1]} features, the TT matrix has rows={rows}")
    return _forward(x, cores, gates, bias, spec)


@_tt_linear_op.register_fake
def _(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols):
    return x.new_empty((*x.shape[:-1], cols))


def _setup_context(ctx, inputs, output):
    x, cores, gates, bias, *meta = inputs
    ctx.save_for_backward(x, *cores, *gates, *([bias] if bias is not None else []))
    ctx.n_cores, ctx.has_bias = len(cores), bias is not None
    ctx.spec = TTSpec.from_cores(cores, *meta)  # (checked by the forward)


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    d = ctx.n_cores
    x, cores, gates = saved[0], saved[1:1 + d], saved[1 + d:2 * d]
    bias = saved[2 * d] if ctx.has_bias else None

    def f(x, cores, gates, *bias):
        return _forward(x, cores, gates, bias[0] if bias else None, ctx.spec)

    _, vjp = torch.func.vjp(f, x, cores, gates, *([bias] if bias is not None else []))
    dx, dcores, dgates, *dbias = vjp(grad)
    return (dx, list(dcores), list(dgates), dbias[0] if dbias else None) + (None,) * 5


_tt_linear_op.register_autograd(_backward, setup_context=_setup_context)


def tt_linear(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], fmt: str, row_modes: Sequence[int], col_modes: Sequence[int],
              rows: int, cols: int) -> torch.Tensor:
    """``x @ M[:rows, :cols] + bias`` for the TT matrix given by ``cores``/``gates`` (ranks read off the
    cores' shapes)."""
    return torch.ops.comera.tt_linear(x, list(cores), list(gates), bias, fmt, [int(m) for m in row_modes],
                                      [int(m) for m in col_modes], int(rows), int(cols))
