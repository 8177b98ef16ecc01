"""``comera::tt_embedding``: ``M[indices, :cols]`` for a tensor-train matrix M.

For ``nn.Embedding(V, D)``: rows = V, cols = D and the weight is ``M``. ``tt_embedding`` runs the plan
of :func:`comera_compile.tt.planner.plan_embedding` with the shared executor
:mod:`comera_compile.kernels.tt_runtime`: either two gathered tables (each about the square root of
the vocabulary; row ``i = iL * I_R + iR`` is ``A[iL] · B[iR]ᵀ``, so no vocabulary-sized tensor exists,
forward or backward), or the dense table for small vocabularies. Indices are checked the way
``nn.Embedding`` checks them (``comera::tt_index_split``, in the executor). Like ``comera::tt_linear``
it is an opaque custom op whose backward is the executor's ``torch.func.vjp``; tensorized models
compiled with ``backend="comera"`` get the executor's calls in their graph instead.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from comera_compile.kernels import tt_runtime
from comera_compile.tt.format import TTSpec
from comera_compile.tt.planner import plan_embedding

__all__ = ["tt_embedding"]

_NAME = "comera::tt_embedding"


def _forward(indices, cores, gates, spec: TTSpec):
    dtype = cores[0].dtype
    plan = plan_embedding(spec, max(indices.numel(), 1), cores[0].element_size())
    if plan.strategy == "tables":
        A, B = tt_runtime.layer_outputs(cores, gates, spec, plan, "tables", dtype)
        return tt_runtime.lookup(indices, A, B, spec.rows, spec.cols)
    (w,) = tt_runtime.layer_outputs(cores, gates, spec, plan, "dense", dtype)
    return F.embedding(indices, w)


@torch.library.custom_op("comera::tt_embedding", mutates_args=())
def _tt_embedding_op(indices: torch.Tensor, cores: list[torch.Tensor], gates: list[torch.Tensor], fmt: str,
                     row_modes: list[int], col_modes: list[int], rows: int, cols: int) -> torch.Tensor:
    spec = tt_runtime.layer_spec(_NAME, cores, gates, fmt, row_modes, col_modes, rows, cols)
    return _forward(indices, cores, gates, spec).contiguous()


@_tt_embedding_op.register_fake
def _(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    return cores[0].new_empty((*indices.shape, cols))


def _setup_context(ctx, inputs, output):
    indices, cores, gates, *meta = inputs
    ctx.save_for_backward(indices, *cores, *gates)
    ctx.n_cores = len(cores)
    ctx.spec = TTSpec.from_cores(cores, *meta)  # (checked by the forward)


def _backward(ctx, grad):
    indices, *params = ctx.saved_tensors
    d = ctx.n_cores

    def f(cores, gates):
        return _forward(indices, cores, gates, ctx.spec)

    _, vjp = torch.func.vjp(f, params[:d], params[d:])
    dcores, dgates = vjp(grad)
    return (None, list(dcores), list(dgates)) + (None,) * 5


_tt_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def tt_embedding(indices: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], fmt: str,
                 row_modes: Sequence[int], col_modes: Sequence[int], rows: int, cols: int) -> torch.Tensor:
    """``M[indices, :cols]`` for the TT matrix given by ``cores``/``gates`` (ranks read off the cores'
    shapes)."""
    return torch.ops.comera.tt_embedding(indices, list(cores), list(gates), fmt, [int(m) for m in row_modes],
                                         [int(m) for m in col_modes], int(rows), int(cols))
