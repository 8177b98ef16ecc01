"""``comera::tt_embedding``: ``M[indices, :cols]`` for a tensor-train matrix M; ``comera::tt_index_split``.

For ``nn.Embedding(V, D)``: rows = V, cols = D and the weight is ``M`` (DESIGN.md). ``tt_embedding``
runs the plan of :func:`comera_compile.planner.plan_tt_embedding` with the shared executor
:mod:`comera_compile.tt_runtime`: either two gathered tables (each about the square root of the
vocabulary; row ``i = iL * I_R + iR`` is ``A[iL] · B[iR]ᵀ``, so no vocabulary-sized tensor exists,
forward or backward), or the dense table for small vocabularies. Like ``comera::tt_linear`` it is an
opaque custom op whose backward is the executor's ``torch.func.vjp``; tensorized models compiled with
``backend="comera"`` get the executor's calls in their graph instead.

``comera::tt_index_split(indices, rows, ir)`` splits row indices into ``(i // ir, i % ir)`` after
checking them the way ``nn.Embedding`` does: an index outside ``[0, rows)`` raises IndexError on the
CPU and fails a device-side assert on the GPU (no host sync, so it is safe inside a CUDA graph). The
rows of the padding (``rows <= i < prod(row_modes)``) are out of range too.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from comera_compile.kernels import tt_runtime
from comera_compile.kernels.tt_linear import check_meta
from comera_compile.tt.planner import core_ranks, plan_tt_embedding

__all__ = ["tt_embedding"]

_MESSAGE = "index out of range in self"


@torch.library.custom_op("comera::tt_index_split", mutates_args=())
def _tt_index_split(indices: torch.Tensor, rows: int, ir: int) -> tuple[torch.Tensor, torch.Tensor]:
    if indices.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"Expected tensor for argument #1 'indices' to have one of the following scalar "
                           f"types: Long, Int; but got {indices.dtype} instead")
    ok = (indices >= 0) & (indices < rows)
    if indices.is_cuda:
        torch._assert_async(ok.all(), _MESSAGE)
    elif indices.numel() and not bool(ok.all()):
        raise IndexError(_MESSAGE)
    idx = indices.long()
    return torch.div(idx, ir, rounding_mode="floor"), torch.remainder(idx, ir)


@_tt_index_split.register_fake
def _(indices, rows, ir):
    return indices.new_empty(indices.shape, dtype=torch.int64), indices.new_empty(indices.shape, dtype=torch.int64)


def _forward(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    ranks = core_ranks(fmt, [c.shape for c in cores])
    dtype = cores[0].dtype
    plan = plan_tt_embedding(fmt, row_modes, col_modes, ranks, max(indices.numel(), 1), cores[0].element_size())
    if plan.strategy == "tables":
        A, B = tt_runtime.layer_outputs(cores, gates, fmt, row_modes, col_modes, rows, cols, plan, "tables", dtype)
        return tt_runtime.lookup(indices, A, B, rows, cols)
    (w,) = tt_runtime.layer_outputs(cores, gates, fmt, row_modes, col_modes, rows, cols, plan, "dense", dtype)
    return F.embedding(indices, w)


@torch.library.custom_op("comera::tt_embedding", mutates_args=())
def _tt_embedding_op(indices: torch.Tensor, cores: list[torch.Tensor], gates: list[torch.Tensor], fmt: str,
                     row_modes: list[int], col_modes: list[int], rows: int, cols: int) -> torch.Tensor:
    check_meta("comera::tt_embedding", cores, gates, fmt, row_modes, col_modes, rows, cols)
    return _forward(indices, cores, gates, fmt, row_modes, col_modes, rows, cols).contiguous()


@_tt_embedding_op.register_fake
def _(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    return cores[0].new_empty((*indices.shape, cols))


def _setup_context(ctx, inputs, output):
    indices, cores, gates, *meta = inputs
    ctx.save_for_backward(indices, *cores, *gates)
    ctx.n_cores, ctx.meta = len(cores), meta


def _backward(ctx, grad):
    indices, *params = ctx.saved_tensors
    d = ctx.n_cores

    def f(cores, gates):
        return _forward(indices, cores, gates, *ctx.meta)

    _, vjp = torch.func.vjp(f, params[:d], params[d:])
    dcores, dgates = vjp(grad)
    return (None, list(dcores), list(dgates)) + (None,) * 5


_tt_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def tt_embedding(indices: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], fmt: str,
                 row_modes: Sequence[int], col_modes: Sequence[int], rows: int, cols: int) -> torch.Tensor:
    """``M[indices, :cols]`` for the TT matrix given by ``cores``/``gates`` (DESIGN.md)."""
    return torch.ops.comera.tt_embedding(indices, list(cores), list(gates), fmt, [int(m) for m in row_modes],
                                         [int(m) for m in col_modes], int(rows), int(cols))
