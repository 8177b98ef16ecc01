"""`comera::linear_cross_entropy`: the LM-head loss without materializing the logits.

Semantics are exactly ``F.cross_entropy(softcap(x @ W.T + b).float(), target, ...)`` with
``softcap(z) = c * tanh(z / c)`` when ``c > 0``. The loss (and the optional log-sum-exp) is fp32,
as eager gives for ``.float()`` logits; a caller whose model did not upcast casts it back.

How it runs on the GPU (Triton), two logits GEMMs plus the gradient products:

* forward: ``_lse_fwd_kernel`` walks vocabulary tiles per token block and keeps an online
  (max, sum-exp) in fp32, the correct-token logit and (for label smoothing) the logit sum.
  Vocabulary splits are combined on the host from ``[splits, N]`` partials. Target range is checked
  on the host first (one reduction and one sync), so a bad target raises eager's IndexError.
* backward, filtered (default): ``_grad_sparse_kernel`` recomputes each (token block, vocabulary
  block) tile of the softmax and keeps only the tiles where some ``softmax * softcap'`` reaches
  ``filter_eps`` (CCE-style filtering; dtype eps / 32, 2**-12 for bf16). Kept tiles go to a bounded
  buffer (``tile_budget_bytes``); ``_dx_kernel`` and ``_dw_kernel`` own their output rows and reduce
  the kept tiles in fp32 in a fixed order (no atomics on the gradients). The one-hot (target) part
  and, without softcap, the uniform label-smoothing part of the gradient are exact rank-one terms
  added by those kernels, so filtering only ever drops softmax entries below ``filter_eps``.
  The vocabulary is visited in order of decreasing mean logit (``W @ sum(x)``), so the words whose
  tiles are kept cluster. When the buffer fills, the rest of the vocabulary is done in further
  rounds (dX accumulates in its own dtype, at most ``dense_after_rounds`` times).
* backward, dense chunks (``backward="exact"``, ``deterministic=True``, softcap with label
  smoothing, or when two sparse rounds in a row keep more than ``dense_density`` of their tiles):
  ``_grad_dense_kernel`` writes the whole gradient of a vocabulary chunk (``dense_budget_bytes``)
  and two library GEMMs reduce it (dW rows written once, dX accumulated in an fp32 buffer).
  This path is deterministic; with ``deterministic=True`` filtered tiles are zeroed, not skipped.

On the CPU (or ``impl="torch"``) a chunked torch reference computes the same thing in fp32
(float64 for float64 inputs) and never holds more than a chunk of logits; its backward is exact.
"""

from __future__ import annotations

import math
import os
import warnings
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

try:  # Triton is optional on CPU-only installs.
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

__all__ = ["linear_cross_entropy", "default_filter_eps", "fused_loss_pays", "MIN_FUSED_VOCAB"]

_REDUCTIONS = ("mean", "sum", "none")
_BACKWARDS = ("filtered", "exact")
_IMPLS = ("auto", "triton", "torch")


@dataclass
class _Tuning:
    """Tile shapes, launch parameters and memory budgets (H200 defaults, measured in
    benchmarks/results_cce.md). Tests shrink them to exercise every path on small problems."""

    fwd_block_m: int = 128
    fwd_block_n: int = 256
    fwd_block_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    fwd_group_m: int = 16
    bwd_block_m: int = 128
    bwd_block_n: int = 128
    bwd_block_k: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 3
    group_v: int = 16
    cons_block_d: int = 128
    cons_warps: int = 8
    cons_stages: int = 3
    tgt_block: int = 16
    tile_budget_bytes: int = 44 << 20
    dense_budget_bytes: int = 64 << 20
    dense_block_n: int = 256
    dense_after_rounds: int = 4
    dense_density: float = 0.3
    ref_chunk_bytes: int = 64 << 20


_TUNING = _Tuning()


def _fit(cfg: _Tuning, x: torch.Tensor) -> _Tuning:
    """Tiles that fit in shared memory for ``x``'s dtype.

    The defaults are tuned for 2-byte inputs; 4-byte (fp32) tiles at the same shapes and stages
    need up to ~390 KB of shared memory (the H200 has 227 KB), so fp32 on a GPU gets tiles of a
    quarter of the size (at most ~64 KB per kernel). The interpreter has no such limit.
    """
    if not x.is_cuda or x.element_size() <= 2:
        return cfg
    return dataclasses.replace(
        cfg, fwd_block_m=min(cfg.fwd_block_m, 64), fwd_block_n=min(cfg.fwd_block_n, 128),
        fwd_block_k=min(cfg.fwd_block_k, 32), fwd_stages=min(cfg.fwd_stages, 2),
        bwd_block_m=min(cfg.bwd_block_m, 64), bwd_block_n=min(cfg.bwd_block_n, 64),
        bwd_block_k=min(cfg.bwd_block_k, 32), bwd_stages=min(cfg.bwd_stages, 2),
        cons_block_d=min(cfg.cons_block_d, 64), cons_stages=min(cfg.cons_stages, 2),
        dense_block_n=min(cfg.dense_block_n, 128))

# Bookkeeping of the last Triton backward: sparse_rounds, dense_chunks, tiles (all tiles),
# kept_sparse (tiles kept by the sparse rounds), sparse_blocks (vocabulary blocks they covered).
_LAST_STATS: dict = {}
_SPARSE_BROKEN: list = []  # set (with the reason) when the sparse kernel failed to build here


MIN_FUSED_VOCAB = 4096


def fused_loss_pays(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device_type: str) -> tuple[bool, str]:
    """Whether fusing a ``[n_tokens, hidden] x [vocab, hidden]`` head with its cross-entropy is
    expected to pay; ``(False, reason)`` when it is not (the cce pass then leaves the loss alone).

    Below ``MIN_FUSED_VOCAB`` classes the logits are no larger than the hidden states, so the fused
    op saves no memory, and its extra launches and logits recompute only cost time."""
    if vocab < MIN_FUSED_VOCAB:
        return False, (f"vocabulary {vocab} < {MIN_FUSED_VOCAB}: the logits [{n_tokens}, {vocab}] are small, "
                       "so the fused loss saves no memory and its recompute costs time")
    return True, ""


def default_filter_eps(dtype: torch.dtype) -> float:
    """CCE's threshold: the dtype's machine epsilon / 32 (2**-12 for bf16)."""
    return torch.finfo(dtype).eps / 32


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if _HAS_TRITON:

    @triton.jit
    def _tanh(u):
        # 1 - 2 / (exp(2u) + 1): saturates to +-1 without inf/inf.
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def _logits_tile(
        X, W, rows, cols, D, sxn, sxd, swv, swd,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """fp32 [BLOCK_M, BLOCK_N] tile of x[rows] @ W[cols].T; rows/cols are int64 and in range."""
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + rows[:, None] * sxn + offs_k[None, :] * sxd
        w_ptrs = W + cols[None, :] * swv + offs_k[:, None] * swd
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(D, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                kmask = offs_k < D - k * BLOCK_K
                a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * sxd
            w_ptrs += BLOCK_K * swd
        return acc

    @triton.jit
    def _lse_fwd_kernel(
        X, W, Bias, T, M_out, S_out, TZ_out, ZS_out,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, vb_per_split, num_tb, splits,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
    ):
        # Programs that run together share GROUP_M token blocks (x stays in L2) and a few
        # vocabulary splits (each W tile is read by GROUP_M programs at about the same time).
        pid = tl.program_id(0)
        per_group = GROUP_M * splits
        group = pid // per_group
        first_m = group * GROUP_M
        gsize = tl.minimum(num_tb - first_m, GROUP_M)
        r = pid % per_group
        pid_m = first_m + r % gsize
        pid_s = r // gsize
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        rows = tl.where(mask_m, offs_m, 0).to(tl.int64)
        tgt = tl.load(T + rows, mask=mask_m, other=-1)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        tz = tl.zeros((BLOCK_M,), tl.float32)
        zs = tl.zeros((BLOCK_M,), tl.float32)
        nvb = tl.cdiv(V, BLOCK_N)
        vb0 = pid_s * vb_per_split
        vb1 = tl.minimum(vb0 + vb_per_split, nvb)
        for vb in range(vb0, vb1):
            offs_n = vb * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < V
            cols = tl.where(mask_n, offs_n, 0).to(tl.int64)
            z = _logits_tile(X, W, rows, cols, D, sxn, sxd, swv, swd,
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
            if HAS_BIAS:
                z += tl.load(Bias + cols * sb).to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            z = tl.where(mask_n[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new[:, None]))
            s = s * alpha + tl.sum(e, 1)
            m = m_new
            tz += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], z, 0.0), 1)
            if HAS_SMOOTH:
                zs += tl.sum(tl.where(mask_n[None, :], z, 0.0), 1)
        out = pid_s.to(tl.int64) * N + offs_m
        tl.store(M_out + out, m, mask=mask_m)
        tl.store(S_out + out, s, mask=mask_m)
        tl.store(TZ_out + out, tz, mask=mask_m)
        if HAS_SMOOTH:
            tl.store(ZS_out + out, zs, mask=mask_m)

    @triton.jit
    def _tile_coords(t, nvb_range, num_tb, GROUP_V: tl.constexpr):
        """Tile t -> (token block, vocabulary block): GROUP_V vocabulary blocks at a time, so
        that the tiles in flight share a few W tiles and a few x blocks (both stay in L2)."""
        per_group = GROUP_V * num_tb
        group = t // per_group
        first_vb = group * GROUP_V
        gsize = tl.minimum(nvb_range - first_vb, GROUP_V)
        r = t % per_group
        return r // gsize, first_vb + r % gsize

    @triton.jit
    def _grad_values(
        X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
        N, V, D, sxn, sxd, swv, swd, sb, softcap,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        HAS_ORDER: tl.constexpr,
    ):
        """(g, p): the softmax part of d loss / d logits on one tile (no one-hot term), and the
        unscaled softmax * softcap' that the filter looks at."""
        offs_m = tb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        rows = tl.where(mask_m, offs_m, 0).to(tl.int64)
        pos = col_start + vbl * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = pos < V
        pos_c = tl.where(mask_n, pos, 0)
        if HAS_ORDER:
            cols = tl.load(Order + pos_c).to(tl.int64)
        else:
            cols = pos_c.to(tl.int64)
        z = _logits_tile(X, W, rows, cols, D, sxn, sxd, swv, swd,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        if HAS_BIAS:
            z += tl.load(Bias + cols * sb).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        lse = tl.load(LSE + rows)
        pc = tl.load(PCoef + rows)
        live = mask_m & (pc != 0.0)
        keep = live[:, None] & mask_n[None, :]
        p = tl.where(keep, tl.exp(z - lse[:, None]), 0.0)
        if HAS_SOFTCAP:
            zc = z / softcap
            dcap = 1.0 - zc * zc
            p = p * dcap
        g = p * pc[:, None]
        if SMOOTH_IN_TILE:
            sc = tl.load(SCoef + rows)
            sm = tl.where(mask_m & (sc != 0.0), sc, 0.0)
            if HAS_SOFTCAP:
                g -= tl.where(keep, sm[:, None] * dcap, 0.0)
            else:
                g -= tl.where(keep, sm[:, None], 0.0)
        return g, p

    @triton.jit
    def _is_filtered(g, p, filter_eps):
        # NaN/inf must not be filtered away: they propagate as in eager.
        small = tl.max(tl.abs(p)) < filter_eps
        bad = tl.sum((g != g).to(tl.int32) + (tl.abs(g) == float("inf")).to(tl.int32))
        return small & (bad == 0)

    @triton.jit
    def _grad_sparse_kernel(
        X, W, Bias, Order, LSE, PCoef, SCoef, G, GCol, Slot, Counter,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, filter_eps,
        capacity, col_start, nvb_range, num_tb,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_V: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        FILTER: tl.constexpr, HAS_ORDER: tl.constexpr,
    ):
        """One tile per program. A kept tile goes to slot = atomic counter; Slot[tb, vbl] = slot,
        -1 when filtered out, -2 when the slot buffer was full (the tile is redone next round)."""
        tb, vbl = _tile_coords(tl.program_id(0), nvb_range, num_tb, GROUP_V)
        slot_ptr = Slot + tb.to(tl.int64) * nvb_range + vbl
        if tl.atomic_add(Counter, 0) >= capacity:
            tl.store(slot_ptr, -2)
            return
        g, p = _grad_values(X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
                            N, V, D, sxn, sxd, swv, swd, sb, softcap,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                            HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, HAS_ORDER)
        if FILTER:
            if _is_filtered(g, p, filter_eps):
                tl.store(slot_ptr, -1)
                return
        slot = tl.atomic_add(Counter, 1)
        if slot >= capacity:
            tl.store(slot_ptr, -2)
            return
        offs_bm = tl.arange(0, BLOCK_M)
        offs_bn = tl.arange(0, BLOCK_N)
        base = slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
        tl.store(G + base + offs_bm[:, None] * BLOCK_N + offs_bn[None, :], g.to(G.dtype.element_ty))
        tl.store(GCol + slot.to(tl.int64) * BLOCK_N + offs_bn, tl.sum(g, 0))
        tl.store(slot_ptr, slot)

    @triton.jit
    def _grad_dense_kernel(
        X, W, Bias, Order, LSE, PCoef, SCoef, TPos, TCoef, G,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, filter_eps,
        col_start, nvb_range, num_tb, ld_g,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_V: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        FILTER: tl.constexpr, HAS_ORDER: tl.constexpr,
    ):
        """The whole gradient (one-hot term included) of one tile into row-major G [N, ld_g];
        filtered tiles keep only their one-hot term."""
        tb, vbl = _tile_coords(tl.program_id(0), nvb_range, num_tb, GROUP_V)
        g, p = _grad_values(X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
                            N, V, D, sxn, sxd, swv, swd, sb, softcap,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                            HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, HAS_ORDER)
        if FILTER:
            g = tl.where(_is_filtered(g, p, filter_eps), 0.0, g)
        offs_m = tb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        rows = tl.where(mask_m, offs_m, 0).to(tl.int64)
        pos = col_start + vbl * BLOCK_N + tl.arange(0, BLOCK_N)
        tp = tl.load(TPos + rows, mask=mask_m, other=-1)
        tc = tl.load(TCoef + rows, mask=mask_m, other=0.0)
        hit = (pos[None, :] == tp[:, None]) & (pos < V)[None, :]
        g -= tl.where(hit, tc[:, None], 0.0)  # tcoef already holds softcap' at the target
        offs_bn = tl.arange(0, BLOCK_N)
        tl.store(G + rows[:, None] * ld_g + (vbl * BLOCK_N + offs_bn)[None, :],
                 g.to(G.dtype.element_ty), mask=mask_m[:, None])

    @triton.jit
    def _dx_kernel(
        G, W, Order, RowPtr, TileVb, TileSlot, T, TPos, TCoef, SCoef, WColSum, DX,
        N, V, D, swv, swd, sdn, sdd, vb_start, tgt_lo, tgt_hi,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_ORDER: tl.constexpr, SMOOTH_TERMS: tl.constexpr, LOAD_PREV: tl.constexpr,
    ):
        """dX[token block, D chunk] (+)= sum over kept tiles G @ W[cols], minus the one-hot term of
        the targets whose visiting position is in [tgt_lo, tgt_hi) (and the smoothing term)."""
        tb = tl.program_id(0)
        pid_d = tl.program_id(1)
        offs_m = tb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        rows = tl.where(mask_m, offs_m, 0).to(tl.int64)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        offs_bm = tl.arange(0, BLOCK_M)
        offs_bn = tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        start = tl.load(RowPtr + tb)
        end = tl.load(RowPtr + tb + 1)
        for i in range(start, end):
            slot = tl.load(TileSlot + i)
            vb = vb_start + tl.load(TileVb + i)
            pos = vb * BLOCK_N + offs_bn
            pos = tl.where(pos < V, pos, 0)
            if HAS_ORDER:
                cols = tl.load(Order + pos).to(tl.int64)
            else:
                cols = pos.to(tl.int64)
            g = tl.load(G + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
                        + offs_bm[:, None] * BLOCK_N + offs_bn[None, :])
            w = tl.load(W + cols[:, None] * swv + offs_d[None, :] * swd,
                        mask=mask_d[None, :], other=0.0)
            acc = tl.dot(g, w.to(g.dtype), acc)
        tp = tl.load(TPos + rows, mask=mask_m, other=-1)
        tc = tl.load(TCoef + rows, mask=mask_m, other=0.0)
        hit = (tp >= tgt_lo) & (tp < tgt_hi) & (tc != 0.0) & mask_m
        t = tl.load(T + rows, mask=hit, other=0)
        wt = tl.load(W + t[:, None] * swv + offs_d[None, :] * swd,
                     mask=hit[:, None] & mask_d[None, :], other=0.0)
        acc -= tl.where(hit, tc, 0.0)[:, None] * wt.to(tl.float32)
        if SMOOTH_TERMS:
            sc = tl.load(SCoef + rows, mask=mask_m, other=0.0)
            wcs = tl.load(WColSum + offs_d, mask=mask_d, other=0.0)
            acc -= sc[:, None] * wcs[None, :]
        out = rows[:, None] * sdn + offs_d[None, :] * sdd
        omask = mask_m[:, None] & mask_d[None, :]
        if LOAD_PREV:
            acc += tl.load(DX + out, mask=omask, other=0.0).to(tl.float32)
        tl.store(DX + out, acc.to(DX.dtype.element_ty), mask=omask)

    @triton.jit
    def _dw_kernel(
        G, GCol, X, Order, ColPtr, TileTb, TileSlot, TokPtr, Toks, TokPos, TCoef,
        XSmooth, DW, DB, N, V, D, sxn, sxd, sdv, sdd, sdb, b_smooth, vb_start,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SMOOTH_VEC: tl.constexpr,
        HAS_DW: tl.constexpr, TGT_PRECISION: tl.constexpr,
    ):
        """dW[vocab block, D chunk] = sum over kept tiles G.T @ x[rows] (+ target, smoothing terms)."""
        vbl = tl.program_id(0)
        pid_d = tl.program_id(1)
        vb = vb_start + vbl
        offs_bn = tl.arange(0, BLOCK_N)
        offs_bm = tl.arange(0, BLOCK_M)
        pos = vb * BLOCK_N + offs_bn
        mask_n = pos < V
        pos = tl.where(mask_n, pos, 0)
        if HAS_ORDER:
            cols = tl.load(Order + pos).to(tl.int64)
        else:
            cols = pos.to(tl.int64)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        bacc = tl.zeros((BLOCK_N,), tl.float32)
        start = tl.load(ColPtr + vbl)
        end = tl.load(ColPtr + vbl + 1)
        for i in range(start, end):
            slot = tl.load(TileSlot + i)
            if slot >= 0:
                tb = tl.load(TileTb + i)
                offs_m = tb * BLOCK_M + offs_bm
                rows = tl.where(offs_m < N, offs_m, 0).to(tl.int64)
                g = tl.load(G + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
                            + offs_bm[:, None] * BLOCK_N + offs_bn[None, :])
                if HAS_DW:
                    xr = tl.load(X + rows[:, None] * sxn + offs_d[None, :] * sxd,
                                 mask=mask_d[None, :], other=0.0)
                    acc = tl.dot(tl.trans(g), xr.to(g.dtype), acc)
                if HAS_BIAS:
                    bacc += tl.load(GCol + slot.to(tl.int64) * BLOCK_N + offs_bn)
        # one-hot term: rows of W hit by a target get -tcoef * x of those tokens
        t0 = tl.load(TokPtr + vb)
        t1 = tl.load(TokPtr + vb + 1)
        offs_t = tl.arange(0, BLOCK_T)
        for j in range(t0, t1, BLOCK_T):
            idx = j + offs_t
            tmask = idx < t1
            tok = tl.load(Toks + idx, mask=tmask, other=0).to(tl.int64)
            tp = tl.load(TokPos + idx, mask=tmask, other=-1) - vb * BLOCK_N
            tc = tl.load(TCoef + tok, mask=tmask, other=0.0)
            onehot = tl.where((offs_bn[:, None] == tp[None, :]) & tmask[None, :], -tc[None, :], 0.0)
            if HAS_DW:
                xt = tl.load(X + tok[:, None] * sxn + offs_d[None, :] * sxd,
                             mask=tmask[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
                acc = tl.dot(onehot, xt, acc, input_precision=TGT_PRECISION)
            if HAS_BIAS:
                bacc += tl.sum(onehot, 1)
        if HAS_SMOOTH_VEC:
            if HAS_DW:
                acc -= tl.load(XSmooth + offs_d, mask=mask_d, other=0.0)[None, :]
            bacc -= b_smooth
        if HAS_DW:
            tl.store(DW + cols[:, None] * sdv + offs_d[None, :] * sdd,
                     acc.to(DW.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
        if HAS_BIAS:
            if pid_d == 0:
                tl.store(DB + cols * sdb, bacc.to(DB.dtype.element_ty), mask=mask_n)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _triton_forward(x, weight, target, bias, softcap, label_smoothing):
    """Returns lse, softcapped target logit, logit sum (or None), all fp32 [N]."""
    cfg = _fit(_TUNING, x)
    N, D = x.shape
    V = weight.shape[0]
    BM, BN, BK = cfg.fwd_block_m, cfg.fwd_block_n, cfg.fwd_block_k
    num_tb, nvb = _cdiv(N, BM), _cdiv(V, BN)
    sms = _num_sms(x.device)
    want = max(1, _cdiv(4 * sms, num_tb))
    step = sms // math.gcd(num_tb, sms)  # num_tb * splits a multiple of the SM count when possible
    splits = min(nvb, _cdiv(want, step) * step)
    vb_per_split = _cdiv(nvb, splits)
    splits = _cdiv(nvb, vb_per_split)
    f32 = dict(device=x.device, dtype=torch.float32)
    m_part = torch.empty((splits, N), **f32)
    s_part = torch.empty((splits, N), **f32)
    tz_part = torch.empty((splits, N), **f32)
    smooth = label_smoothing > 0.0
    zs_part = torch.empty((splits, N), **f32) if smooth else m_part
    _lse_fwd_kernel[(num_tb * splits,)](
        x, weight, bias if bias is not None else x, target, m_part, s_part, tz_part, zs_part,
        N, V, D, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        bias.stride(0) if bias is not None else 0, float(softcap), vb_per_split, num_tb, splits,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.fwd_group_m, EVEN_K=D % BK == 0,
        DOT_PRECISION=_dot_precision(x.dtype), HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap > 0.0, HAS_SMOOTH=smooth,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )
    lse = _combine_lse(m_part, s_part)
    return lse, tz_part.sum(0), zs_part.sum(0) if smooth else None


def _combine_lse(m_part: torch.Tensor, s_part: torch.Tensor) -> torch.Tensor:
    m = m_part.amax(0)
    w = torch.where(m_part == float("-inf"), torch.zeros_like(m_part), torch.exp(m_part - m))
    return m + torch.log((s_part * w).sum(0))


def _vocab_order(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Vocabulary positions by decreasing mean logit: sum_i z_iv = W_v . sum_i x_i + N b_v."""
    xsum = x.sum(0, dtype=torch.float32)
    key = torch.mv(weight, xsum.to(weight.dtype)).float()
    if bias is not None:
        key = key + x.shape[0] * bias.float()
    key = torch.nan_to_num(key, nan=0.0)
    return torch.argsort(key, descending=True, stable=True).to(torch.int32)


def _weighted_row_sum(coef: torch.Tensor, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """sum_i coef_i * x_i in fp32, a few thousand rows at a time (no [N, D] fp32 copy)."""
    out = torch.zeros((x.shape[1],), device=x.device, dtype=torch.float32)
    for i in range(0, x.shape[0], chunk):
        out += coef[i:i + chunk] @ x[i:i + chunk].float()
    return out


_ADDMM_DTYPE_OK = [True]


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b half precision, without a half-precision partial."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if _ADDMM_DTYPE_OK[0] and acc.is_cuda:
        try:
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
            return
        except (RuntimeError, NotImplementedError):
            _ADDMM_DTYPE_OK[0] = False
    acc += torch.mm(a, b).float()


def _triton_backward(x, weight, target, bias, lse, pcoef, tcoef, scoef, softcap, label_smoothing,
                     filter_eps, exact, deterministic, need_dx, need_dw, need_db):
    """Gradients of sum_i [pcoef_i lse_i - tcoef_i z_{i,t_i} / softcap'_i - scoef_i sum_v z_iv].

    Sparse rounds (filtered, not deterministic): kept tiles go to a bounded buffer and are reduced
    by _dx_kernel/_dw_kernel. When a round shows that filtering keeps most tiles, or after
    `dense_after_rounds` rounds, the rest of the vocabulary goes through dense chunks: the gradient
    of a vocabulary chunk is written whole and reduced with two library GEMMs (dX in fp32).
    """
    cfg = _fit(_TUNING, x)
    N, D = x.shape
    V = weight.shape[0]
    dev = x.device
    BM, BN, BK, BD, BT = (cfg.bwd_block_m, cfg.bwd_block_n, cfg.bwd_block_k,
                          cfg.cons_block_d, cfg.tgt_block)
    num_tb, nvb = _cdiv(N, BM), _cdiv(V, BN)
    has_softcap = softcap > 0.0
    smooth = label_smoothing > 0.0
    smooth_in_tile = smooth and has_softcap  # not a rank-one term then: keep it in the tiles
    filt = not exact and not smooth_in_tile and filter_eps > 0.0
    sparse = filt and not deterministic and len(_SPARSE_BROKEN) == 0
    order = _vocab_order(x, weight, bias) if sparse else None
    gdtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
    elem = torch.finfo(gdtype).bits // 8
    i32 = dict(device=dev, dtype=torch.int32)
    f32 = dict(device=dev, dtype=torch.float32)

    valid_t = tcoef != 0
    tgt_safe = torch.where(valid_t, target, torch.zeros_like(target))
    if order is not None:
        inv = torch.empty((V,), **i32)
        inv[order.long()] = torch.arange(V, **i32)
        tpos = inv[tgt_safe]
    else:
        tpos = tgt_safe.to(torch.int32)
    tpos = torch.where(valid_t, tpos, torch.full_like(tpos, V)).contiguous()
    smooth_vec = smooth and not smooth_in_tile
    wcolsum = weight.sum(0, dtype=torch.float32) if smooth_vec and need_dx else None
    xsmooth = _weighted_row_sum(scoef, x) if smooth_vec and need_dw else None
    b_smooth = float(scoef.sum()) if smooth_vec and need_db else 0.0

    dx = torch.empty((N, D), device=dev, dtype=x.dtype) if need_dx else None
    dw = torch.empty((V, D), device=dev, dtype=weight.dtype) if need_dw else None
    db = torch.empty((V,), device=dev, dtype=bias.dtype) if need_db else None
    dummy = lse
    order_arg = order if order is not None else tpos
    common = dict(BLOCK_M=BM, BLOCK_K=BK, GROUP_V=cfg.group_v, EVEN_K=D % BK == 0,
                  DOT_PRECISION=_dot_precision(x.dtype), HAS_BIAS=bias is not None,
                  HAS_SOFTCAP=has_softcap, SMOOTH_IN_TILE=smooth_in_tile, FILTER=filt,
                  HAS_ORDER=order is not None, num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    strides = (x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
               bias.stride(0) if bias is not None else 0)
    bias_arg = bias if bias is not None else x
    kept_total = 0
    rounds = 0
    vb_start = 0

    if sparse:
        capacity = max(num_tb, cfg.tile_budget_bytes // (BM * BN * elem))
        G = torch.empty((capacity, BM, BN), device=dev, dtype=gdtype)
        gcol = torch.empty((capacity, BN), **f32)
        slot_map = torch.empty((num_tb * nvb,), **i32)
        counter = torch.zeros((1,), **i32)
        if need_dw or need_db:  # tokens grouped by the vocabulary block of their target
            toks = torch.argsort(tpos, stable=True).to(torch.int32)
            tok_pos = tpos[toks.long()].contiguous()
            tok_ptr = torch.searchsorted(tok_pos, torch.arange(nvb + 1, **i32) * BN).to(torch.int32)
        cons = dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, HAS_ORDER=True,
                    num_warps=cfg.cons_warps, num_stages=cfg.cons_stages)
        dense_streak = 0
        while vb_start < nvb:
            nvr = nvb - vb_start
            counter.zero_()
            try:
                _grad_sparse_kernel[(num_tb * nvr,)](
                    x, weight, bias_arg, order, lse, pcoef, dummy, G, gcol, slot_map,
                    counter, N, V, D, *strides, float(softcap), float(filter_eps),
                    capacity, vb_start * BN, nvr, num_tb, BLOCK_N=BN, **common)
            except Exception as err:  # a Triton that cannot build it: the dense path is exact
                if rounds:
                    raise
                _SPARSE_BROKEN.append(repr(err)[:300])
                warnings.warn(f"comera::linear_cross_entropy: sparse gradient kernel unavailable "
                              f"({_SPARSE_BROKEN[0]}); using dense chunks", RuntimeWarning)
                break
            sm = slot_map[: num_tb * nvr].view(num_tb, nvr)
            unresolved = (sm == -2).any(0)
            done_t = torch.where(unresolved.any(), unresolved.int().argmax(), nvr)
            kept_cum = torch.cumsum((sm >= 0).sum(0), 0)
            done, n_kept = torch.stack(  # the one host sync of a round
                [done_t, torch.where(done_t > 0, kept_cum[(done_t - 1).clamp_min(0)], 0)]).tolist()
            if done == 0:  # not even one block column fitted: the rest goes dense
                break
            rounds += 1
            kept_total += n_kept
            kept = sm[:, :done] >= 0
            if need_dx:
                # kept tiles first, in row-major (token block, vocabulary block) order
                rm = torch.argsort((~kept).view(-1).to(torch.int8), stable=True)
                row_ptr = torch.zeros((num_tb + 1,), **i32)
                row_ptr[1:] = torch.cumsum(kept.sum(1), 0)
                tile_vb = (rm % done).to(torch.int32)
                tile_slot = sm[:, :done].reshape(-1)[rm]
                _dx_kernel[(num_tb, _cdiv(D, BD))](
                    G, weight, order, row_ptr, tile_vb, tile_slot, tgt_safe, tpos, tcoef, scoef,
                    wcolsum if wcolsum is not None else dummy, dx,
                    N, V, D, weight.stride(0), weight.stride(1), dx.stride(0), dx.stride(1),
                    vb_start, vb_start * BN, (vb_start + done) * BN,
                    SMOOTH_TERMS=smooth_vec and rounds == 1, LOAD_PREV=rounds > 1, **cons)
            if need_dw or need_db:
                kept_t = kept.t().contiguous()
                cm = torch.argsort((~kept_t).view(-1).to(torch.int8), stable=True)
                col_ptr = torch.zeros((done + 1,), **i32)
                col_ptr[1:] = torch.cumsum(kept_t.sum(1), 0)
                tile_tb = (cm % num_tb).to(torch.int32)
                tile_slot_t = sm[:, :done].t().reshape(-1)[cm]
                _dw_kernel[(done, _cdiv(D, BD) if need_dw else 1)](
                    G, gcol, x, order, col_ptr, tile_tb, tile_slot_t, tok_ptr, toks, tok_pos,
                    tcoef, xsmooth if xsmooth is not None else dummy,
                    dw if dw is not None else G, db if db is not None else G,
                    N, V, D, x.stride(0), x.stride(1),
                    dw.stride(0) if dw is not None else 0, dw.stride(1) if dw is not None else 0,
                    db.stride(0) if db is not None else 0, b_smooth, vb_start,
                    BLOCK_T=BT, HAS_BIAS=need_db, HAS_SMOOTH_VEC=smooth_vec, HAS_DW=need_dw,
                    TGT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **cons)
            vb_start += done
            # Filtering does not pay when rounds keep most tiles: finish with dense chunks. The
            # first blocks (the most frequent words) are often dense, so one dense round is not
            # enough to give up.
            dense_streak = dense_streak + 1 if n_kept > cfg.dense_density * num_tb * done else 0
            if dense_streak >= 2 or rounds >= cfg.dense_after_rounds:
                break
        del G, gcol

    dense_rounds = 0
    if vb_start < nvb:  # dense chunks of the vocabulary
        p0 = vb_start * BN
        acc = None
        if need_dx:
            if vb_start == 0:
                acc = torch.zeros((N, D), **f32)
                if smooth_vec:
                    acc.addr_(scoef, wcolsum, alpha=-1.0)
            else:
                acc = dx.float()
        BND = cfg.dense_block_n
        width = max(BND, cfg.dense_budget_bytes // max(1, N * elem) // BND * BND)
        width = min(width, _cdiv(V - p0, BND) * BND)
        Gd = torch.empty((N, width), device=dev, dtype=gdtype)
        for c0 in range(p0, V, width):
            c1 = min(c0 + width, V)
            nvr = _cdiv(c1 - c0, BND)
            dense_rounds += 1
            _grad_dense_kernel[(num_tb * nvr,)](
                x, weight, bias_arg, order_arg, lse, pcoef, scoef, tpos, tcoef, Gd,
                N, V, D, *strides, float(softcap), float(filter_eps),
                c0, nvr, num_tb, width, BLOCK_N=BND, **common)
            gc = Gd[:, : c1 - c0]
            cols = order[c0:c1].long() if order is not None else None
            if need_dx:
                wc = weight.index_select(0, cols) if cols is not None else weight[c0:c1]
                _addmm_f32_(acc, gc, wc)
            if need_dw:
                if cols is None:
                    torch.mm(gc.t(), x, out=dw[c0:c1])
                    if smooth_vec:
                        dw[c0:c1] -= xsmooth
                else:
                    part = torch.mm(gc.t(), x)
                    if smooth_vec:
                        part -= xsmooth
                    dw.index_copy_(0, cols, part)
            if need_db:
                part = gc.sum(0, dtype=torch.float32) - b_smooth
                if cols is None:
                    db[c0:c1] = part
                else:
                    db.index_copy_(0, cols, part.to(db.dtype))
        if need_dx:
            dx.copy_(acc)
    _LAST_STATS.clear()
    _LAST_STATS.update(sparse_rounds=rounds, dense_chunks=dense_rounds, tiles=num_tb * nvb,
                       kept_sparse=kept_total, sparse_blocks=vb_start)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# Chunked torch reference (CPU path and checking): never more than a chunk of logits alive
# ---------------------------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ref_chunk(n_rows: int, V: int) -> int:
    return max(1, min(n_rows, _TUNING.ref_chunk_bytes // max(1, 8 * V)))


def _ref_logits(xc, w, b, softcap):
    z = torch.nn.functional.linear(xc, w, b)
    return softcap * torch.tanh(z / softcap) if softcap > 0.0 else z


def _torch_forward(x, weight, target, bias, softcap, ignore_index, label_smoothing):
    """Per-token loss (fp32, 0 where ignored), lse and softcapped target logit, chunk by chunk."""
    N = x.shape[0]
    V = weight.shape[0]
    cdt = _compute_dtype(x)
    w = weight.to(cdt)
    b = bias.to(cdt) if bias is not None else None
    nll = torch.empty((N,), device=x.device, dtype=torch.float32)
    lse = torch.empty_like(nll)
    tz = torch.empty_like(nll)
    step = _ref_chunk(N, V)
    for i in range(0, N, step):
        z = _ref_logits(x[i:i + step].to(cdt), w, b, softcap)
        t = target[i:i + step]
        nll[i:i + step] = torch.nn.functional.cross_entropy(
            z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
        lse[i:i + step] = torch.logsumexp(z, 1)
        valid = t != ignore_index
        tz[i:i + step] = torch.where(
            valid, z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0], 0.0)
    return nll, lse, tz


def _torch_backward(x, weight, target, bias, pcoef, tscale, scoef, softcap, label_smoothing,
                    need_dx, need_dw, need_db):
    """Exact gradients of sum_i [pcoef_i lse_i - tscale_i (1-eps) z_{i,t_i} - scoef_i sum_v z_iv]."""
    N, D = x.shape
    V = weight.shape[0]
    cdt = _compute_dtype(x)
    w = weight.to(cdt)
    b = bias.to(cdt) if bias is not None else None
    dx = torch.empty((N, D), device=x.device, dtype=x.dtype) if need_dx else None
    dw = torch.zeros((V, D), device=x.device, dtype=cdt) if need_dw else None
    db = torch.zeros((V,), device=x.device, dtype=cdt) if need_db else None
    valid_t = tscale != 0
    step = _ref_chunk(N, V)
    for i in range(0, N, step):
        xc = x[i:i + step].to(cdt)
        zlin = torch.nn.functional.linear(xc, w, b)
        z = softcap * torch.tanh(zlin / softcap) if softcap > 0.0 else zlin
        pc = pcoef[i:i + step].to(cdt)[:, None]
        g = torch.where(pc != 0, torch.softmax(z, 1) * pc, torch.zeros((), dtype=cdt))
        g = g - scoef[i:i + step].to(cdt)[:, None]
        tv = valid_t[i:i + step]
        t = torch.where(tv, target[i:i + step], 0)
        g.scatter_add_(1, t[:, None], -((1.0 - label_smoothing) * tscale[i:i + step].to(cdt))[:, None])
        if softcap > 0.0:
            g = g * (1.0 - (z / softcap) ** 2)
        if need_dx:
            dx[i:i + step] = (g @ w).to(x.dtype)
        if need_dw:
            dw += g.t() @ xc
        if need_db:
            db += g.sum(0)
    return (dx,
            dw.to(weight.dtype) if need_dw else None,
            db.to(bias.dtype) if need_db else None)


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


def _use_triton(impl: str, x: torch.Tensor) -> bool:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "torch":
        return False
    if impl == "triton":
        if not _HAS_TRITON or not (x.is_cuda or interpret):
            raise RuntimeError(
                "comera::linear_cross_entropy: impl='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        if x.dtype == torch.float64:
            raise TypeError("comera::linear_cross_entropy: impl='triton' supports fp32/fp16/bf16, "
                            "not float64 (use impl='torch')")
        return True
    if not _HAS_TRITON or x.dtype == torch.float64 or x.shape[0] == 0:
        return False
    return x.is_cuda or (interpret and os.environ.get("COMERA_FORCE_TRITON") == "1")


def _check_targets(target: torch.Tensor, V: int, ignore_index: int) -> None:
    """Eager's error for a class index outside [0, V) (never garbage); one reduction + sync."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        value = int(target[bad.nonzero()[0, 0]])
        raise IndexError(f"Target {value} is out of bounds.")


def _reduce(nll: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / valid.sum()


# The op validates targets on the host and syncs once per sparse round, which CUDA-graph capture
# forbids: the tag makes Inductor keep it out of captured graphs (mode="reduce-overhead").
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("comera::linear_cross_entropy", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _lce_op(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
    softcap: float, ignore_index: int, label_smoothing: float, reduction: str, backward: str,
    filter_eps: float, deterministic: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss fp32, lse fp32 [N], softcapped target logit fp32 [N], saved for backward)."""
    V = weight.shape[0]
    target = target.contiguous()
    _check_targets(target, V, ignore_index)
    valid = target != ignore_index
    if _use_triton(impl, x):
        lse, tz, zs = _triton_forward(x, weight, target, bias, softcap, label_smoothing)
        nll = lse - (1.0 - label_smoothing) * tz
        if zs is not None:
            nll = nll - (label_smoothing / V) * zs
        nll = torch.where(valid, nll, torch.zeros((), device=x.device, dtype=torch.float32))
        tz = torch.where(valid, tz, 0.0)
    else:
        nll, lse, tz = _torch_forward(x, weight, target, bias, softcap, ignore_index, label_smoothing)
    return _reduce(nll, valid, reduction), lse, tz


@_lce_op.register_fake
def _lce_fake(x, weight, target, bias, softcap, ignore_index, label_smoothing, reduction, backward,
              filter_eps, deterministic, impl):
    n = x.shape[0]
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
    return loss, x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("comera::linear_cross_entropy_backward", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _lce_backward_op(
    grad_loss: torch.Tensor, grad_lse: Optional[torch.Tensor], x: torch.Tensor,
    weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
    tz: torch.Tensor, softcap: float, ignore_index: int, label_smoothing: float, reduction: str,
    backward: str, filter_eps: float, deterministic: bool, impl: str,
    need_dx: bool, need_dw: bool, need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); an output that is not needed comes back empty."""
    V = weight.shape[0]
    target = target.contiguous()
    need_db = need_db and bias is not None
    valid = target != ignore_index
    zero = torch.zeros((), device=x.device, dtype=torch.float32)
    g = grad_loss.float()
    if reduction == "mean":
        g = g / valid.sum()
    scale = torch.where(valid, g.expand(valid.shape), zero)  # d loss / d nll_i
    pcoef = scale if grad_lse is None else scale + grad_lse.float()
    scoef = scale * (label_smoothing / V)
    if _use_triton(impl, x):
        tcoef = scale * (1.0 - label_smoothing)
        if softcap > 0.0:
            tcoef = tcoef * (1.0 - (tz / softcap) ** 2)
        dx, dw, db = _triton_backward(
            x, weight, target, bias, lse, pcoef.contiguous(), tcoef.contiguous(),
            scoef.contiguous(), softcap, label_smoothing, filter_eps, backward == "exact",
            deterministic, need_dx, need_dw, need_db)
    else:
        dx, dw, db = _torch_backward(x, weight, target, bias, pcoef, scale, scoef, softcap,
                                     label_smoothing, need_dx, need_dw, need_db)
    empty = x.new_empty((0,))
    return (dx if dx is not None else empty,
            dw if dw is not None else weight.new_empty((0,)),
            db if db is not None else empty)


@_lce_backward_op.register_fake
def _lce_backward_fake(grad_loss, grad_lse, x, weight, target, bias, lse, tz, softcap,
                       ignore_index, label_smoothing, reduction, backward, filter_eps,
                       deterministic, impl, need_dx, need_dw, need_db):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty((0,))
    db = bias.new_empty(bias.shape) if (need_db and bias is not None) else x.new_empty((0,))
    return dx, dw, db


def _setup_context(ctx, inputs, output):
    (x, weight, target, bias, softcap, ignore_index, label_smoothing, reduction, backward,
     filter_eps, deterministic, impl) = inputs
    _, lse, tz = output
    ctx.save_for_backward(x, weight, target, bias, lse, tz)
    ctx.params = (softcap, ignore_index, label_smoothing, reduction, backward, filter_eps,
                  deterministic, impl)


def _backward(ctx, grad_loss, grad_lse, grad_tz):
    x, weight, target, bias, lse, tz = ctx.saved_tensors
    need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
    dx, dw, db = _lce_backward_op(grad_loss, grad_lse, x, weight, target, bias, lse, tz,
                                  *ctx.params, need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, None,
            db if need_db else None) + (None,) * 8


_lce_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    softcap: Optional[float] = 0.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    return_lse: bool = False,
    backward: str = "filtered",
    filter_eps: Optional[float] = None,
    deterministic: bool = False,
    impl: str = "auto",
):
    """``F.cross_entropy(softcap(x @ weight.T + bias).float(), target, ...)`` without the logits.

    x [N, D], weight [V, D], target [N] (int64), bias [V] or None. The loss is fp32 (a scalar for
    ``reduction`` "mean"/"sum", [N] for "none"); ``return_lse=True`` also returns the fp32
    log-sum-exp [N] (differentiable, for z-loss). ``backward="filtered"`` skips gradient tiles whose
    softmax stays below ``filter_eps`` (default: dtype eps / 32, 2**-12 for bf16); "exact" skips
    nothing. ``deterministic=True`` fixes the tile bookkeeping so that repeated runs give bitwise
    equal gradients (the reductions never use atomics). ``impl``: "auto" (Triton on CUDA tensors,
    or under TRITON_INTERPRET=1 with COMERA_FORCE_TRITON=1; else the torch reference), "triton",
    "torch".
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: x must be [N, D] and weight [V, D], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}")
    if target.shape != (x.shape[0],):
        raise ValueError(f"linear_cross_entropy: target must be [N]={x.shape[0]}, "
                         f"got {tuple(target.shape)}")
    if target.dtype != torch.int64:
        raise RuntimeError(f"linear_cross_entropy: target must be int64 (Long), got {target.dtype}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise RuntimeError(
            f"linear_cross_entropy: x, weight and bias must have the same dtype, got {x.dtype}, "
            f"{weight.dtype}{', ' + str(bias.dtype) if bias is not None else ''}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_cross_entropy: bias must be [V]={weight.shape[0]}, "
                         f"got {tuple(bias.shape)}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}, expected one of {_REDUCTIONS}")
    if backward not in _BACKWARDS:
        raise ValueError(f"linear_cross_entropy: backward={backward!r}, expected one of {_BACKWARDS}")
    if impl not in _IMPLS:
        raise ValueError(f"linear_cross_entropy: impl={impl!r}, expected one of {_IMPLS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing={label_smoothing} not in [0, 1]")
    softcap = float(softcap or 0.0)
    if softcap < 0.0:
        raise ValueError(f"linear_cross_entropy: softcap={softcap} must be >= 0")
    if filter_eps is None:
        filter_eps = default_filter_eps(x.dtype)
    loss, lse, _ = torch.ops.comera.linear_cross_entropy(
        x, weight, target, bias, softcap, int(ignore_index), float(label_smoothing), reduction,
        backward, float(filter_eps), bool(deterministic), impl)
    return (loss, lse) if return_lse else loss
