"""Triton kernels of ``comera::linear_cross_entropy`` (the host code that launches them, and the
torch reference, are in ``linear_cross_entropy_paths.py``).

Notation: x [N, D], W [V, D], logits ``z = softcap(x @ W.T + b)``, ``lse_i = logsumexp_v z_iv``.
The loss these kernels differentiate is ``sum_i pcoef_i lse_i - tcoef_i z_{i,t_i} - scoef_i sum_v z_iv``
(per-token coefficients set by the host from the reduction, ``grad_output``, label smoothing and
an optional gradient of the lse), so ``d loss / d z_iv = pcoef_i p_iv - tcoef_i [v = t_i] - scoef_i``.
In the tile kernels ``TCoef`` already includes ``softcap'`` at the target.

* ``lse_forward_kernel``: online (max, sum-exp) over vocabulary tiles, per token block and
  vocabulary split; the host combines the splits.
* Recompute backward, large D: ``grad_sparse_kernel`` keeps the tiles whose softmax reaches the
  filter threshold in a bounded buffer, reduced by ``dx_sparse_kernel`` / ``dw_sparse_kernel``;
  ``grad_dense_kernel`` writes the gradient of a whole vocabulary chunk for library GEMMs.
* Recompute backward, small D: ``dx_fused_kernel`` / ``dw_fused_kernel`` own their output rows and
  recompute the tiles they need; the gradient never leaves the chip. ``lse_dx_small_d_kernel``
  forms dX in the forward pass itself (the fused path's forward when D fits one K step).
* Gradient in the forward (``chunked``): ``logits_grad_rows_kernel`` turns a chunk of logits rows,
  written by a library GEMM, into the loss and (in place) the gradient of those rows;
  ``scale_kernel`` scales them by ``grad_output`` in the backward.

Every ``tl.dot`` takes ``input_precision=DOT_PRECISION``, which the host sets by the one rule of
``dispatch.dot_precision`` (IEEE fp32 for fp32 inputs unless torch allows TF32).

Triton is optional: without it this module defines nothing and the op runs its torch reference.
"""

from __future__ import annotations

from .dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def stable_tanh(u):
        """tanh as 1 - 2 / (exp(2u) + 1): saturates to +-1 without inf/inf."""
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def block_range(block, n, BLOCK: tl.constexpr):
        """(offsets, offsets < n, the offsets as int64 with 0 past n) of block ``block`` of BLOCK."""
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        return offs, mask, tl.where(mask, offs, 0).to(tl.int64)

    @triton.jit
    def vocab_cols(pos, V, Order, HAS_ORDER: tl.constexpr):
        """(pos < V, the vocabulary ids at visiting positions pos as int64): Order[pos] with
        HAS_ORDER, else pos itself; position 0 past V."""
        mask = pos < V
        safe = tl.where(mask, pos, 0)
        if HAS_ORDER:
            cols = tl.load(Order + safe).to(tl.int64)
        else:
            cols = safe.to(tl.int64)
        return mask, cols

    @triton.jit
    def logits_tile(
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
    def x_block(X, rows, D, sxn, sxd, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """x[rows, :BLOCK_K] (zero past D): the whole reduction dimension when D <= BLOCK_K."""
        offs_k = tl.arange(0, BLOCK_K)
        ptrs = X + rows[:, None] * sxn + offs_k[None, :] * sxd
        if EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=(offs_k < D)[None, :], other=0.0)

    @triton.jit
    def w_block_t(W, cols, D, swv, swd, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """W[cols, :BLOCK_K].T as a [BLOCK_K, BLOCK_N] tile (zero past D)."""
        offs_k = tl.arange(0, BLOCK_K)
        ptrs = W + cols[None, :] * swv + offs_k[:, None] * swd
        if EVEN_K:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=(offs_k < D)[:, None], other=0.0)

    @triton.jit
    def lse_forward_kernel(
        X, W, Bias, T, M_out, S_out, TZ_out, ZS_out, ColMax,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, vb_per_split, num_tb, splits,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
        ONE_K: tl.constexpr, HAS_TZ: tl.constexpr, HAS_COLMAX: tl.constexpr = False,
    ):
        """Per (token block, vocabulary split): max, sum-exp, target logit (HAS_TZ; else the host
        computes it) and logit sum [splits, N]. ONE_K (D <= BLOCK_K): the x block is loaded once,
        the loop over vocabulary blocks only streams W (and is software-pipelined). HAS_COLMAX: also
        each column's largest (softcapped) logit over the block's rows, ColMax [token blocks, V]."""
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
        offs_m, mask_m, rows = block_range(pid_m, N, BLOCK_M)
        tgt = tl.load(T + rows, mask=mask_m, other=-1)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        tz = tl.zeros((BLOCK_M,), tl.float32)
        zs = tl.zeros((BLOCK_M,), tl.float32)
        nvb = tl.cdiv(V, BLOCK_N)
        vb0 = pid_s * vb_per_split
        vb1 = tl.minimum(vb0 + vb_per_split, nvb)
        if ONE_K:
            xa = x_block(X, rows, D, sxn, sxd, BLOCK_K, EVEN_K)
        for vb in range(vb0, vb1):
            offs_n, mask_n, cols = block_range(vb, V, BLOCK_N)
            if ONE_K:
                wt = w_block_t(W, cols, D, swv, swd, BLOCK_K, EVEN_K)
                z = tl.dot(xa, wt.to(xa.dtype), input_precision=DOT_PRECISION)
            else:
                z = logits_tile(X, W, rows, cols, D, sxn, sxd, swv, swd,
                                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
            if HAS_BIAS:
                z += tl.load(Bias + cols * sb).to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                z = softcap * stable_tanh(z / softcap)
            z = tl.where(mask_n[None, :], z, float("-inf"))
            if HAS_COLMAX:
                cm = tl.max(tl.where(mask_m[:, None], z, float("-inf")), 0)
                tl.store(ColMax + pid_m.to(tl.int64) * V + offs_n, cm, mask=mask_n)
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new[:, None]))
            s = s * alpha + tl.sum(e, 1)
            m = m_new
            if HAS_TZ:
                tz += tl.sum(tl.where(offs_n[None, :] == tgt[:, None], z, 0.0), 1)
            if HAS_SMOOTH:
                zs += tl.sum(tl.where(mask_n[None, :], z, 0.0), 1)
        out = pid_s.to(tl.int64) * N + offs_m
        tl.store(M_out + out, m, mask=mask_m)
        tl.store(S_out + out, s, mask=mask_m)
        if HAS_TZ:
            tl.store(TZ_out + out, tz, mask=mask_m)
        if HAS_SMOOTH:
            tl.store(ZS_out + out, zs, mask=mask_m)

    @triton.jit
    def tile_coords(t, nvb_range, num_tb, GROUP_V: tl.constexpr):
        """Tile t -> (token block, vocabulary block): GROUP_V vocabulary blocks at a time, so
        that the tiles in flight share a few W tiles and a few x blocks (both stay in L2)."""
        per_group = GROUP_V * num_tb
        group = t // per_group
        first_vb = group * GROUP_V
        gsize = tl.minimum(nvb_range - first_vb, GROUP_V)
        r = t % per_group
        return r // gsize, first_vb + r % gsize

    @triton.jit
    def grad_tile(
        X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
        N, V, D, sxn, sxd, swv, swd, sb, softcap,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        HAS_ORDER: tl.constexpr,
    ):
        """(g, p): the softmax part of d loss / d logits on one tile (no one-hot term), and the
        unscaled softmax * softcap' that the filter looks at."""
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
        mask_n, cols = vocab_cols(col_start + vbl * BLOCK_N + tl.arange(0, BLOCK_N), V, Order, HAS_ORDER)
        z = logits_tile(X, W, rows, cols, D, sxn, sxd, swv, swd,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        return grad_epilogue(z, rows, mask_m, cols, mask_n, Bias, LSE, PCoef, SCoef, sb, softcap,
                             HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE)

    @triton.jit
    def grad_epilogue(
        z, rows, mask_m, cols, mask_n, Bias, LSE, PCoef, SCoef, sb, softcap,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
    ):
        """(g, p) of ``grad_tile`` from the raw logits tile z = x[rows] @ W[cols].T."""
        lse = tl.load(LSE + rows)
        pc = tl.load(PCoef + rows)
        sc = tl.load(SCoef + rows) if SMOOTH_IN_TILE else pc
        return softmax_grad(z, mask_m, cols, mask_n, Bias, sb, softcap, lse, pc, sc,
                            HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE)

    @triton.jit
    def softmax_grad(
        z, mask_m, cols, mask_n, Bias, sb, softcap, lse, pc, sc,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
    ):
        """(g, p) from the raw logits tile z and the rows' lse, pcoef and (SMOOTH_IN_TILE) scoef."""
        if HAS_BIAS:
            z += tl.load(Bias + cols * sb).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = softcap * stable_tanh(z / softcap)
        live = mask_m & (pc != 0.0)
        keep = live[:, None] & mask_n[None, :]
        p = tl.where(keep, tl.exp(z - lse[:, None]), 0.0)
        if HAS_SOFTCAP:
            zc = z / softcap
            dcap = 1.0 - zc * zc
            p = p * dcap
        g = p * pc[:, None]
        if SMOOTH_IN_TILE:
            sm = tl.where(mask_m & (sc != 0.0), sc, 0.0)
            if HAS_SOFTCAP:
                g -= tl.where(keep, sm[:, None] * dcap, 0.0)
            else:
                g -= tl.where(keep, sm[:, None], 0.0)
        return g, p

    @triton.jit
    def target_rows(tb, N, TPos, TCoef, BLOCK_M: tl.constexpr):
        """Target visiting positions (-1 past N) and coefficients (0 past N) of token block tb."""
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
        tp = tl.load(TPos + rows, mask=mask_m, other=-1)
        tc = tl.load(TCoef + rows, mask=mask_m, other=0.0)
        return tp, tc

    @triton.jit
    def minus_target(g, pos, V, tp, tc):
        """g minus the one-hot term: tcoef_i at the column whose visiting position is the target's."""
        hit = (pos[None, :] == tp[:, None]) & (pos < V)[None, :]
        return g - tl.where(hit, tc[:, None], 0.0)

    @triton.jit
    def minus_target_term(g, tb, pos, N, V, TPos, TCoef, BLOCK_M: tl.constexpr):
        """``minus_target`` with the targets of token block tb loaded here."""
        tp, tc = target_rows(tb, N, TPos, TCoef, BLOCK_M)
        return minus_target(g, pos, V, tp, tc)

    @triton.jit
    def is_filtered(g, p, filter_eps):
        # NaN/inf must not be filtered away: they propagate as in eager.
        small = tl.max(tl.abs(p)) < filter_eps
        bad = tl.sum((g != g).to(tl.int32) + (tl.abs(g) == float("inf")).to(tl.int32))
        return small & (bad == 0)

    @triton.jit
    def grad_sparse_kernel(
        X, W, Bias, Order, LSE, PCoef, SCoef, G, GCol, Slot, Counter, Maybe,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, filter_eps,
        capacity, col_start, nvb_range, num_tb, nvb_all,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_V: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        HAS_ORDER: tl.constexpr, HAS_MAYBE: tl.constexpr = False,
    ):
        """One tile per program. A kept tile goes to slot = atomic counter; Slot[tb, vbl] = slot,
        -1 when filtered out, -2 when the slot buffer was full (the tile is redone next round).
        HAS_MAYBE: Maybe [token blocks, all vocabulary blocks] (uint8) is 0 where the forward's
        logit bounds show that the filter drops the tile: it is not recomputed."""
        tb, vbl = tile_coords(tl.program_id(0), nvb_range, num_tb, GROUP_V)
        slot_ptr = Slot + tb.to(tl.int64) * nvb_range + vbl
        if HAS_MAYBE:
            if tl.load(Maybe + tb.to(tl.int64) * nvb_all + col_start // BLOCK_N + vbl) == 0:
                tl.store(slot_ptr, -1)
                return
        if tl.atomic_add(Counter, 0) >= capacity:
            tl.store(slot_ptr, -2)
            return
        g, p = grad_tile(X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
                         N, V, D, sxn, sxd, swv, swd, sb, softcap,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                         HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, HAS_ORDER)
        if is_filtered(g, p, filter_eps):
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
    def grad_dense_kernel(
        X, W, Bias, Order, LSE, PCoef, SCoef, TPos, TCoef, G,
        N, V, D, sxn, sxd, swv, swd, sb, softcap,
        col_start, nvb_range, num_tb, ld_g,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_V: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        HAS_ORDER: tl.constexpr,
    ):
        """The whole gradient (one-hot term included) of one tile into row-major G [N, ld_g]."""
        tb, vbl = tile_coords(tl.program_id(0), nvb_range, num_tb, GROUP_V)
        g, p = grad_tile(X, W, Bias, Order, LSE, PCoef, SCoef, tb, vbl, col_start,
                         N, V, D, sxn, sxd, swv, swd, sb, softcap,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                         HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, HAS_ORDER)
        pos = col_start + vbl * BLOCK_N + tl.arange(0, BLOCK_N)
        g = minus_target_term(g, tb, pos, N, V, TPos, TCoef, BLOCK_M)
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
        offs_bn = tl.arange(0, BLOCK_N)
        tl.store(G + rows[:, None] * ld_g + (vbl * BLOCK_N + offs_bn)[None, :],
                 g.to(G.dtype.element_ty), mask=mask_m[:, None])

    @triton.jit
    def dx_sparse_kernel(
        G, W, Order, RowPtr, TileVb, TileSlot, T, TPos, TCoef, SCoef, WColSum, DX,
        N, V, D, swv, swd, sdn, sdd, vb_start, tgt_lo, tgt_hi,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        HAS_ORDER: tl.constexpr, SMOOTH_TERMS: tl.constexpr, LOAD_PREV: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """dX[token block, D chunk] (+)= sum over kept tiles G @ W[cols], minus the one-hot term of
        the targets whose visiting position is in [tgt_lo, tgt_hi) (and the smoothing term)."""
        tb = tl.program_id(0)
        pid_d = tl.program_id(1)
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
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
            in_range, cols = vocab_cols(vb * BLOCK_N + offs_bn, V, Order, HAS_ORDER)
            g = tl.load(G + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
                        + offs_bm[:, None] * BLOCK_N + offs_bn[None, :])
            w = tl.load(W + cols[:, None] * swv + offs_d[None, :] * swd,
                        mask=mask_d[None, :], other=0.0)
            acc = tl.dot(g, w.to(g.dtype), acc, input_precision=DOT_PRECISION)
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
    def dw_sparse_kernel(
        G, GCol, X, Order, ColPtr, TileTb, TileSlot, TokPtr, Toks, TokPos, TCoef,
        XSmooth, BSmooth, DW, DB, N, V, D, sxn, sxd, sdv, sdd, sdb, vb_start,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SMOOTH_VEC: tl.constexpr,
        HAS_DW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """dW[vocab block, D chunk] = sum over kept tiles G.T @ x[rows] (+ target, smoothing terms)."""
        vbl = tl.program_id(0)
        pid_d = tl.program_id(1)
        vb = vb_start + vbl
        offs_bn = tl.arange(0, BLOCK_N)
        offs_bm = tl.arange(0, BLOCK_M)
        mask_n, cols = vocab_cols(vb * BLOCK_N + offs_bn, V, Order, HAS_ORDER)
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
                    acc = tl.dot(tl.trans(g), xr.to(g.dtype), acc, input_precision=DOT_PRECISION)
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
                acc = tl.dot(onehot, xt, acc, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                bacc += tl.sum(onehot, 1)
        if HAS_SMOOTH_VEC:
            if HAS_DW:
                acc -= tl.load(XSmooth + offs_d, mask=mask_d, other=0.0)[None, :]
            bacc -= tl.load(BSmooth)
        if HAS_DW:
            tl.store(DW + cols[:, None] * sdv + offs_d[None, :] * sdd,
                     acc.to(DW.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
        if HAS_BIAS:
            if pid_d == 0:
                tl.store(DB + cols * sdb, bacc.to(DB.dtype.element_ty), mask=mask_n)

    @triton.jit
    def dx_fused_kernel(
        X, W, Bias, LSE, PCoef, SCoef, TPos, TCoef, DXP,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, vb_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        ONE_K: tl.constexpr,
    ):
        """Partial dX of one (token block, vocabulary split, D chunk): sum over the split's vocabulary
        blocks of (recomputed gradient tile) @ W[cols], into the fp32 DXP [splits, N, D].

        ONE_K (D <= BLOCK_K == BLOCK_D, one D chunk): the x block is loaded once and each W tile once,
        serving both the logits and the dX product; the loop streams W only."""
        tb = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_d = tl.program_id(2)
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        vb0 = pid_s * vb_per_split
        vb1 = tl.minimum(vb0 + vb_per_split, tl.cdiv(V, BLOCK_N))
        if ONE_K:  # everything about the rows is loaded once
            xa = x_block(X, rows, D, sxn, sxd, BLOCK_K, EVEN_K)
            lse = tl.load(LSE + rows)
            pc = tl.load(PCoef + rows)
            sc = tl.load(SCoef + rows) if SMOOTH_IN_TILE else pc
            tp, tc = target_rows(tb, N, TPos, TCoef, BLOCK_M)
        for vb in range(vb0, vb1):
            pos, mask_n, cols = block_range(vb, V, BLOCK_N)
            if ONE_K:
                wt = w_block_t(W, cols, D, swv, swd, BLOCK_K, EVEN_K)
                z = tl.dot(xa, wt.to(xa.dtype), input_precision=DOT_PRECISION)
                g, p = softmax_grad(z, mask_m, cols, mask_n, Bias, sb, softcap, lse, pc, sc,
                                    HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE)
                g = minus_target(g, pos, V, tp, tc)
                acc = tl.dot(g.to(wt.dtype), tl.trans(wt), acc, input_precision=DOT_PRECISION)
            else:
                g, p = grad_tile(X, W, Bias, TPos, LSE, PCoef, SCoef, tb, vb, 0,
                                 N, V, D, sxn, sxd, swv, swd, sb, softcap,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                                 HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, False)
                g = minus_target_term(g, tb, pos, N, V, TPos, TCoef, BLOCK_M)
                w = tl.load(W + cols[:, None] * swv + offs_d[None, :] * swd,
                            mask=mask_n[:, None] & mask_d[None, :], other=0.0)
                acc = tl.dot(g.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
        out = (pid_s.to(tl.int64) * N + rows)[:, None] * D + offs_d[None, :]
        tl.store(DXP + out, acc, mask=mask_m[:, None] & mask_d[None, :])

    @triton.jit
    def dw_fused_kernel(
        X, W, Bias, LSE, PCoef, SCoef, TPos, TCoef, XSmooth, DW, DB,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, sdv, sdd,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTH_IN_TILE: tl.constexpr,
        HAS_SMOOTH_VEC: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, ONE_K: tl.constexpr,
    ):
        """dW[vocabulary block, D chunk] over all token blocks from recomputed gradient tiles, written
        once (no atomics), and the fp32 column sums of the gradient into DB [V] (for the bias).

        ONE_K (D <= BLOCK_K == BLOCK_D, one D chunk): the W tile is loaded once and each x block once,
        serving both the logits and the dW product; the loop streams x only."""
        vb = tl.program_id(0)
        pid_d = tl.program_id(1)
        pos, mask_n, cols = block_range(vb, V, BLOCK_N)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        bacc = tl.zeros((BLOCK_N,), tl.float32)
        if ONE_K:
            wt = w_block_t(W, cols, D, swv, swd, BLOCK_K, EVEN_K)
        for tb in range(0, tl.cdiv(N, BLOCK_M)):
            offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
            if ONE_K:
                xa = x_block(X, rows, D, sxn, sxd, BLOCK_K, EVEN_K)
                z = tl.dot(xa, wt.to(xa.dtype), input_precision=DOT_PRECISION)
                g, p = grad_epilogue(z, rows, mask_m, cols, mask_n, Bias, LSE, PCoef, SCoef, sb, softcap,
                                     HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE)
                g = minus_target_term(g, tb, pos, N, V, TPos, TCoef, BLOCK_M)
                if HAS_DW:
                    acc = tl.dot(tl.trans(g.to(xa.dtype)), xa, acc, input_precision=DOT_PRECISION)
            else:
                g, p = grad_tile(X, W, Bias, TPos, LSE, PCoef, SCoef, tb, vb, 0,
                                 N, V, D, sxn, sxd, swv, swd, sb, softcap,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                                 HAS_BIAS, HAS_SOFTCAP, SMOOTH_IN_TILE, False)
                g = minus_target_term(g, tb, pos, N, V, TPos, TCoef, BLOCK_M)
                if HAS_DW:
                    xr = tl.load(X + rows[:, None] * sxn + offs_d[None, :] * sxd,
                                 mask=mask_m[:, None] & mask_d[None, :], other=0.0)
                    acc = tl.dot(tl.trans(g.to(xr.dtype)), xr, acc, input_precision=DOT_PRECISION)
            if HAS_DB:
                bacc += tl.sum(g, 0)
        if HAS_DW:
            if HAS_SMOOTH_VEC:
                acc -= tl.load(XSmooth + offs_d, mask=mask_d, other=0.0)[None, :]
            tl.store(DW + cols[:, None] * sdv + offs_d[None, :] * sdd,
                     acc.to(DW.dtype.element_ty), mask=mask_n[:, None] & mask_d[None, :])
        if HAS_DB:
            if pid_d == 0:
                tl.store(DB + cols, bacc, mask=mask_n)

    @triton.jit
    def lse_dx_small_d_kernel(
        X, W, Bias, M_out, S_out, ACC_out,
        N, V, D, sxn, sxd, swv, swd, sb, softcap, vb_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ):
        """Forward and dX in one pass, for D <= BLOCK_K (one K step). Per (token block, vocabulary
        split): the running max m and sum-exp s of the softcapped logits, and
        acc = sum_v exp(z_v - m) softcap'(z_v) W_v [BLOCK_M, BLOCK_K]: the softmax-weighted rows of
        W (FlashAttention's output with W as both keys and values), rescaled as m grows. The host
        combines the splits into the lse and sum_v p_v softcap'(z_v) W_v."""
        tb = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m, mask_m, rows = block_range(tb, N, BLOCK_M)
        xa = x_block(X, rows, D, sxn, sxd, BLOCK_K, EVEN_K)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        vb0 = pid_s * vb_per_split
        vb1 = tl.minimum(vb0 + vb_per_split, tl.cdiv(V, BLOCK_N))
        for vb in range(vb0, vb1):
            pos, mask_n, cols = block_range(vb, V, BLOCK_N)
            wt = w_block_t(W, cols, D, swv, swd, BLOCK_K, EVEN_K)
            z = tl.dot(xa, wt.to(xa.dtype), input_precision=DOT_PRECISION)
            if HAS_BIAS:
                z += tl.load(Bias + cols * sb).to(tl.float32)[None, :]
            if HAS_SOFTCAP:
                zc = stable_tanh(z / softcap)
                z = softcap * zc
            z = tl.where(mask_n[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(mask_n[None, :], tl.exp(z - m_new[:, None]), 0.0)
            s = s * alpha + tl.sum(e, 1)
            if HAS_SOFTCAP:
                e = e * (1.0 - zc * zc)
            acc = acc * alpha[:, None]
            acc = tl.dot(e.to(wt.dtype), tl.trans(wt), acc, input_precision=DOT_PRECISION)
            m = m_new
        out = pid_s.to(tl.int64) * N + rows
        tl.store(M_out + out, m, mask=mask_m)
        tl.store(S_out + out, s, mask=mask_m)
        offs_k = tl.arange(0, BLOCK_K)
        tl.store(ACC_out + out[:, None] * BLOCK_K + offs_k[None, :], acc, mask=mask_m[:, None])

    @triton.jit
    def row_chunk(zrow, Bias, sb, v0, V, BLOCK_V: tl.constexpr, HAS_BIAS: tl.constexpr):
        """(offsets, offsets < V, fp32 raw logits) of entries [v0, v0 + BLOCK_V) of a logits row,
        with the bias added in fp32 (HAS_BIAS); 0 past V."""
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(zrow + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(Bias + offs * sb, mask=mask, other=0.0).to(tl.float32)
        return offs, mask, z

    @triton.jit
    def logits_grad_rows_kernel(
        Z, T, PCoef, TCoef, SCoef, NLL, LSE, TZ, Bias,
        V, szn, sb, ignore_index, softcap, label_smoothing,
        BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
        WRITE_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        """One row of a logits chunk Z (raw x @ W.T + b; with HAS_BIAS, raw x @ W.T and b is added
        here in fp32): its loss, lse and softcapped target logit (fp32), then, with WRITE_GRAD,
        d loss / d raw logits written over the row in Z's dtype.
        Here TCoef excludes softcap': the whole row's gradient is multiplied by it."""
        row = tl.program_id(0).to(tl.int64)
        zrow = Z + row * szn
        t = tl.load(T + row)
        valid = t != ignore_index
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_V,), tl.float32)
        zs = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs, mask, z = row_chunk(zrow, Bias, sb, v0, V, BLOCK_V, HAS_BIAS)
            if HAS_SOFTCAP:
                z = softcap * stable_tanh(z / softcap)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, z)
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
            s = s * alpha + tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
            m = m_new
            if HAS_SMOOTH:
                zs += tl.where(mask, z, 0.0)
        m_row = tl.max(m, 0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_row))
        lse = m_row + tl.log(tl.sum(s * scale, 0))
        t_ok = valid & (t >= 0) & (t < V)
        zt = tl.load(zrow + tl.where(t_ok, t, 0)).to(tl.float32)
        if HAS_BIAS:
            zt += tl.load(Bias + tl.where(t_ok, t, 0) * sb).to(tl.float32)
        if HAS_SOFTCAP:
            zt = softcap * stable_tanh(zt / softcap)
        zsum = tl.sum(zs, 0)
        nll = lse - (1.0 - label_smoothing) * zt
        if HAS_SMOOTH:
            nll -= (label_smoothing / V) * zsum
        tl.store(NLL + row, tl.where(valid, nll, 0.0))
        tl.store(LSE + row, lse)
        tl.store(TZ + row, tl.where(valid, zt, 0.0))
        if WRITE_GRAD:
            pc = tl.load(PCoef + row)
            tc = tl.load(TCoef + row)
            sc = tl.load(SCoef + row)
            for v0 in range(0, V, BLOCK_V):
                offs, mask, z = row_chunk(zrow, Bias, sb, v0, V, BLOCK_V, HAS_BIAS)
                if HAS_SOFTCAP:
                    zc = stable_tanh(z / softcap)
                    z = softcap * zc
                p = tl.where(pc != 0.0, tl.exp(z - lse) * pc, 0.0)
                g = p - sc - tl.where(offs == t, tc, 0.0)
                if HAS_SOFTCAP:
                    g = g * (1.0 - zc * zc)
                tl.store(zrow + offs, g.to(Z.dtype.element_ty), mask=mask)

    @triton.jit
    def scale_kernel(X, S, n, BLOCK: tl.constexpr):
        """X[:n] *= S[0] in fp32 arithmetic, in place (X contiguous)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(S)
        x = tl.load(X + offs, mask=mask)
        tl.store(X + offs, (x.to(tl.float32) * s).to(X.dtype.element_ty), mask=mask)
