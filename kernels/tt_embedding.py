"""`comera::tt_embedding`: ``M[indices, :cols]`` for a tensor-train matrix M, never forming M.

For ``nn.Embedding(V, D)``: rows = V, cols = D and the weight is ``M`` (DESIGN.md). Both formats
(``"ttm"``, ``"tt"``) run the plan of ``comera_compile.planner.plan_tt_embedding``: the cores left of
one bond are merged into a table ``A [I_L, O_L, r]``, the rest into ``B [I_R, O_R, r]`` (each about
the square root of the vocabulary); a row index splits as ``i = iL * I_R + iR`` and its embedding is
``A[iL] · B[iR]ᵀ`` (``[O_L, O_R]``, flattened row-major, cut to ``cols``).

* forward: de-duplicate the indices (``torch.unique``, inverse), then ``_emb_fwd_kernel`` gathers
  the two table slices of each unique row and runs its small GEMM (all rows in one launch), then the
  inverse gathers the rows back to the lookups;
* backward: the output gradient is summed per unique row (``index_add_``), ``_emb_bwd_kernel`` forms
  the two per-row slice gradients and scatter-adds them (fp32 atomics) into the table gradients;
  then the table merges run backward into the cores and gates. No vocabulary-sized tensor exists.
* ``torch.unique`` syncs with the host (its output size is data-dependent). While a CUDA graph is
  being captured (``torch.cuda.is_current_stream_capturing()``), or with ``dedup=False`` through
  ``use_dedup(False)``, every lookup is computed directly instead: same results, no sync.
* the torch reference (CPU, float64 too) runs the same algorithm with einsum / index_add_.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Sequence

import torch

from comera_compile.planner import EmbeddingPlan, core_ranks, plan_tt_embedding, token_bucket

from .tt_linear import _SYMBOL_ORDER, _check_meta, _einsum, _program_for, _program_inputs, _run_program, unpack_grads, _uncanonical, _use_triton, canonical, gated_core_grads, gated_core_views, merge_dtype

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

__all__ = ["tt_embedding", "use_dedup"]

_DEDUP = [True]


@contextlib.contextmanager
def use_dedup(enabled: bool):
    """De-duplicate indices before computing rows (default True; never while capturing a CUDA graph)."""
    old = _DEDUP[0]
    _DEDUP[0] = bool(enabled)
    try:
        yield
    finally:
        _DEDUP[0] = old


def _dedup_now(indices: torch.Tensor) -> bool:
    if not _DEDUP[0]:
        return False
    if indices.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


# ----------------------------------------------------------------------------- Triton kernels

if _HAS_TRITON:

    @triton.jit
    def _emb_fwd_kernel(IDX, A, B, OUT, N, IR, OL, OR, RANK, COLS,
                        sa0, sa1, sa2, sb0, sb1, sb2, so0,
                        BLOCK_OL: tl.constexpr, BLOCK_OR: tl.constexpr, BLOCK_R: tl.constexpr,
                        ROWS_PER_PROG: tl.constexpr, PRECISION: tl.constexpr):
        """OUT[u, ol * OR + or] = sum_r A[iL(u), ol, r] B[iR(u), or, r] for ROWS_PER_PROG lookups."""
        pid = tl.program_id(0)
        rl = tl.arange(0, BLOCK_OL)
        ro = tl.arange(0, BLOCK_OR)
        rr = tl.arange(0, BLOCK_R)
        a_mask = (rl[:, None] < OL) & (rr[None, :] < RANK)
        b_mask = (rr[:, None] < RANK) & (ro[None, :] < OR)
        col = rl[:, None] * OR + ro[None, :]
        o_mask = (rl[:, None] < OL) & (ro[None, :] < OR) & (col < COLS)
        for j in range(ROWS_PER_PROG):
            u = pid * ROWS_PER_PROG + j
            ok = (u + tl.zeros((1, 1), dtype=tl.int32)) < N
            idx = tl.load(IDX + tl.minimum(u, N - 1)).to(tl.int64)
            il = idx // IR
            ir = idx % IR
            a = tl.load(A + il * sa0 + rl[:, None] * sa1 + rr[None, :] * sa2, mask=a_mask, other=0.0)
            b = tl.load(B + ir * sb0 + ro[None, :] * sb1 + rr[:, None] * sb2, mask=b_mask, other=0.0)
            out = tl.dot(a, b, input_precision=PRECISION)
            tl.store(OUT + u.to(tl.int64) * so0 + col, out.to(OUT.dtype.element_ty), mask=o_mask & ok)

    @triton.jit
    def _emb_bwd_kernel(IDX, G, A, B, DA, DB, N, IR, OL, OR, RANK, COLS,
                        sa0, sa1, sa2, sb0, sb1, sb2, sg0,
                        BLOCK_OL: tl.constexpr, BLOCK_OR: tl.constexpr, BLOCK_R: tl.constexpr,
                        ROWS_PER_PROG: tl.constexpr, PRECISION: tl.constexpr):
        """DA[iL] += G_u · B[iR] and DB[iR] += G_uᵀ · A[iL] (fp32 atomics; DA/DB contiguous like A/B)."""
        pid = tl.program_id(0)
        rl = tl.arange(0, BLOCK_OL)
        ro = tl.arange(0, BLOCK_OR)
        rr = tl.arange(0, BLOCK_R)
        a_mask = (rl[:, None] < OL) & (rr[None, :] < RANK)
        bt_mask = (ro[:, None] < OR) & (rr[None, :] < RANK)
        col = rl[:, None] * OR + ro[None, :]
        g_mask = (rl[:, None] < OL) & (ro[None, :] < OR) & (col < COLS)
        for j in range(ROWS_PER_PROG):
            u = pid * ROWS_PER_PROG + j
            ok = (u + tl.zeros((1, 1), dtype=tl.int32)) < N
            idx = tl.load(IDX + tl.minimum(u, N - 1)).to(tl.int64)
            il = idx // IR
            ir = idx % IR
            g = tl.load(G + u.to(tl.int64) * sg0 + col, mask=g_mask & ok, other=0.0).to(A.dtype.element_ty)
            a = tl.load(A + il * sa0 + rl[:, None] * sa1 + rr[None, :] * sa2, mask=a_mask, other=0.0)
            bt = tl.load(B + ir * sb0 + ro[:, None] * sb1 + rr[None, :] * sb2, mask=bt_mask, other=0.0)
            da = tl.dot(g, bt, input_precision=PRECISION)  # [OL, R]
            db = tl.dot(tl.trans(g), a, input_precision=PRECISION)  # [OR, R]
            tl.atomic_add(DA + il * sa0 + rl[:, None] * sa1 + rr[None, :] * sa2, da, mask=a_mask & ok)
            tl.atomic_add(DB + ir * sb0 + ro[:, None] * sb1 + rr[None, :] * sb2, db, mask=bt_mask & ok)


def _emb_blocks(ol: int, orr: int, r: int):
    return (max(16, triton.next_power_of_2(ol)), max(16, triton.next_power_of_2(orr)),
            max(16, triton.next_power_of_2(r)))


_ROWS_PER_PROG = 4


def _fwd_triton(idx, A, B, cols, out_dtype):
    n = idx.numel()
    il_, ol, r = A.shape
    ir_, orr, _ = B.shape
    out = torch.empty((n, cols), device=idx.device, dtype=out_dtype)
    if n == 0:
        return out
    bol, bor, br = _emb_blocks(ol, orr, r)
    grid = (triton.cdiv(n, _ROWS_PER_PROG),)
    _emb_fwd_kernel[grid](idx, A, B, out, n, ir_, ol, orr, r, cols, A.stride(0), A.stride(1), A.stride(2),
                          B.stride(0), B.stride(1), B.stride(2), out.stride(0), BLOCK_OL=bol, BLOCK_OR=bor,
                          BLOCK_R=br, ROWS_PER_PROG=_ROWS_PER_PROG,
                          PRECISION="ieee" if out_dtype == torch.float32 else "tf32", num_warps=4)
    return out


def _bwd_triton(idx, g, A, B, cols):
    n = idx.numel()
    il_, ol, r = A.shape
    ir_, orr, _ = B.shape
    dA = torch.zeros_like(A, dtype=torch.float32)
    dB = torch.zeros_like(B, dtype=torch.float32)
    if n == 0:
        return dA, dB
    bol, bor, br = _emb_blocks(ol, orr, r)
    grid = (triton.cdiv(n, _ROWS_PER_PROG),)
    _emb_bwd_kernel[grid](idx, g, A, B, dA, dB, n, ir_, ol, orr, r, cols, A.stride(0), A.stride(1), A.stride(2),
                          B.stride(0), B.stride(1), B.stride(2), g.stride(0), BLOCK_OL=bol, BLOCK_OR=bor,
                          BLOCK_R=br, ROWS_PER_PROG=_ROWS_PER_PROG,
                          PRECISION="ieee" if A.dtype == torch.float32 else "tf32", num_warps=4)
    return dA, dB


# ----------------------------------------------------------------------------- plan execution


def _plan(indices, cores, fmt, row_modes, col_modes) -> EmbeddingPlan:
    ranks = core_ranks(fmt, [c.shape for c in cores])
    return plan_tt_embedding(fmt, row_modes, col_modes, ranks, token_bucket(indices.numel()), cores[0].element_size())


def _region(prog, plan, S, name: str) -> torch.Tensor:
    """A tensor of the token-independent program, viewed in canonical index order."""
    size = {k.split(":")[1]: v for k, v in plan.sizes}
    off, lay = prog.layout[name]
    t = S[off:off + math.prod(size[c] for c in lay)].view([size[c] for c in lay])
    return t.permute(sorted(range(len(lay)), key=lambda i: _SYMBOL_ORDER[lay[i]]))


def _tables(plan: EmbeddingPlan, cores, gates, mdtype, prog=None):
    if prog is not None:
        S = _program_inputs(prog, cores, gates)
        _run_program(prog, S, "fwd", "ieee" if cores[0].dtype == torch.float32 else "tf32")
        a, b = plan.tables
        A = _region(prog, plan, S, a).reshape(plan.table_shapes[0])
        B = _region(prog, plan, S, b).reshape(plan.table_shapes[1])
        return S, A, B
    views, converted = gated_core_views(cores, gates, mdtype, return_converted=True)
    env = {f"G{k + 1}": v for k, v in enumerate(views)}
    env["converted"] = converted
    for s in plan.steps_in("merge"):
        env[s.out] = _einsum(s.equation, env[s.inputs[0]], env[s.inputs[1]], mdtype)
    a, b = plan.tables
    A = canonical(plan, a, env[a]).reshape(plan.table_shapes[0])
    B = canonical(plan, b, env[b]).reshape(plan.table_shapes[1])
    return env, A, B


def _rows_torch(idx, A, B, cols):
    ir_ = B.shape[0]
    a, b = A[idx // ir_], B[idx % ir_]
    return torch.einsum("uor,upr->uop", a, b).reshape(idx.numel(), A.shape[1] * B.shape[1])[:, :cols]


def _forward_impl(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    plan = _plan(indices, cores, fmt, row_modes, col_modes)
    mdtype = merge_dtype(cores)
    out_dtype = cores[0].dtype
    prog = _program_for(plan, cores, *plan.tables) if _use_triton(cores[0]) else None
    _, A, B = _tables(plan, cores, gates, mdtype, prog)
    flat = indices.reshape(-1)
    if _dedup_now(flat):
        uniq, inverse = torch.unique(flat, return_inverse=True)
    else:
        uniq, inverse = flat, None
    if _use_triton(A):
        out = _fwd_triton(uniq.contiguous(), A.contiguous(), B.contiguous(), cols, out_dtype)
    else:
        out = _rows_torch(uniq, A, B, cols).to(out_dtype)
    if inverse is not None:
        out = out.index_select(0, inverse)
    return out.reshape(*indices.shape, cols)


def _backward_impl(grad, indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    plan = _plan(indices, cores, fmt, row_modes, col_modes)
    mdtype = merge_dtype(cores)
    prog = _program_for(plan, cores, *plan.tables) if _use_triton(cores[0]) else None
    env, A, B = _tables(plan, cores, gates, mdtype, prog)
    flat = indices.reshape(-1)
    g = grad.reshape(-1, cols)
    if _dedup_now(flat):
        uniq, inverse = torch.unique(flat, return_inverse=True)
        g = torch.zeros((uniq.numel(), cols), device=g.device, dtype=mdtype).index_add_(0, inverse, g.to(mdtype))
    else:
        uniq = flat
    if _use_triton(A):
        dA, dB = _bwd_triton(uniq.contiguous(), g.contiguous(), A.contiguous(), B.contiguous(), cols)
    else:
        ir_ = B.shape[0]
        il_idx, ir_idx = uniq // ir_, uniq % ir_
        o_pad = A.shape[1] * B.shape[1]
        gp = torch.nn.functional.pad(g.to(mdtype), (0, o_pad - cols)).reshape(-1, A.shape[1], B.shape[1])
        dA = torch.zeros_like(A).index_add_(0, il_idx, torch.einsum("uop,upr->uor", gp, B[ir_idx]))
        dB = torch.zeros_like(B).index_add_(0, ir_idx, torch.einsum("uop,uor->upr", gp, A[il_idx]))
    a, b = plan.tables
    if prog is not None:
        S = env
        for nm, grad in ((a, dA), (b, dB)):
            region = _region(prog, plan, S, "d" + nm)
            region.copy_(grad.reshape(region.shape))
        _run_program(prog, S, "bwd", "ieee" if cores[0].dtype == torch.float32 else "tf32")
        flat = S[prog.grad_base:prog.grad_base + prog.n_in].to(cores[0].dtype, copy=True)
        return flat
    env["d" + a] = _uncanonical(plan, a, dA.to(mdtype).reshape(canonical(plan, a, env[a]).shape))
    env["d" + b] = _uncanonical(plan, b, dB.to(mdtype).reshape(canonical(plan, b, env[b]).shape))
    for s in plan.steps_in("merge_backward"):
        env[s.out] = _einsum(s.equation, env[s.inputs[0]], env[s.inputs[1]], mdtype)
    dcores, dgates = gated_core_grads(cores, gates, [env[f"dG{k + 1}"] for k in range(len(cores))],
                                      env["converted"])
    return torch.cat([t.reshape(-1).to(cores[0].dtype) for t in dcores + dgates])


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("comera::tt_embedding", mutates_args=())
def _tt_embedding_op(indices: torch.Tensor, cores: list[torch.Tensor], gates: list[torch.Tensor], fmt: str,
                     row_modes: list[int], col_modes: list[int], rows: int, cols: int) -> torch.Tensor:
    _check_meta("comera::tt_embedding", cores, gates, fmt, row_modes, col_modes, rows, cols)
    return _forward_impl(indices, cores, gates, fmt, row_modes, col_modes, rows, cols)


@_tt_embedding_op.register_fake
def _(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    return cores[0].new_empty((*indices.shape, cols))


@torch.library.custom_op("comera::tt_embedding_backward", mutates_args=())
def _tt_embedding_backward_op(grad: torch.Tensor, indices: torch.Tensor, cores: list[torch.Tensor],
                              gates: list[torch.Tensor], fmt: str, row_modes: list[int], col_modes: list[int],
                              rows: int, cols: int) -> torch.Tensor:
    """Every core and gate gradient packed flat like ``torch.cat(cores + gates)`` (cores' dtype)."""
    return _backward_impl(grad, indices, cores, gates, fmt, row_modes, col_modes, rows, cols)


@_tt_embedding_backward_op.register_fake
def _(grad, indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    return cores[0].new_empty((sum(c.numel() for c in cores) + sum(g.numel() for g in gates),))


def _setup_context(ctx, inputs, output):
    indices, cores, gates, fmt, row_modes, col_modes, rows, cols = inputs
    ctx.save_for_backward(indices, *cores, *gates)
    ctx.meta = (len(cores), fmt, list(row_modes), list(col_modes), rows, cols)


def _backward(ctx, grad):
    d, fmt, row_modes, col_modes, rows, cols = ctx.meta
    saved = ctx.saved_tensors
    indices, cores, gates = saved[0], list(saved[1:1 + d]), list(saved[1 + d:])
    flat = _tt_embedding_backward_op(grad, indices, cores, gates, fmt, row_modes, col_modes, rows, cols)
    dcores, dgates = unpack_grads(flat, cores, gates)
    return None, dcores, dgates, None, None, None, None, None


_tt_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def tt_embedding(indices: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], fmt: str,
                 row_modes: Sequence[int], col_modes: Sequence[int], rows: int, cols: int) -> torch.Tensor:
    """``M[indices, :cols]`` for the TT matrix given by ``cores``/``gates`` (DESIGN.md)."""
    return torch.ops.comera.tt_embedding(indices, list(cores), list(gates), fmt, list(row_modes), list(col_modes),
                                         int(rows), int(cols))
