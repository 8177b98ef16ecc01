"""A block tensor-train's two cores as fused Triton kernels: the tokens through both cores with the
intermediate kept on chip (the forward ``y = x M`` and the input gradient ``dx = dy Mᵀ``), and the
cores' gradients as reductions over the tokens that recompute the intermediate on chip. Nothing
activation-sized but the layer's own input, output and their gradients touches memory.

The blocks path of a ``"btt"`` layer (``comera::btt_blocks``) computes, for input blocks ``j`` (of
``b`` features) and output blocks ``c`` (of ``a`` features), rank ``r``::

    t[n, j, c, k] = sum_b x[n, j, b] F[j, b, c, k]          (first core)
    y[n, c, a]    = sum_{j, k} t[n, j, c, k] S[c, j, k, a]   (second core)

Per token, ``t`` has ``J C r`` entries, often several times the input's ``J b`` (a d 2048 Llama block's
Q, K and V at rank 1: 64 x 192 against 2048). As batched library GEMMs it goes to memory and back, and
must be regrouped from ``j``-major to ``c``-major by a copy between them; the backward does the same
for its gradient. The kernels here never store it:

* ``through_cores`` (``_through_kernel``): a program owns ``BLOCK_N`` tokens and ``BLOCK_C`` output
  blocks (``BLOCK_A`` of their features). It walks the input blocks ``BLOCK_J`` at a time:
  ``t = x[:, j-chunk] @ F[j-chunk, :, c-group]`` as a batched dot over the chunk's blocks (the block's
  features ``BLOCK_B`` at a time), rounded to the input dtype as the library path rounds its
  intermediate, regrouped on chip to ``[BLOCK_C, BLOCK_N, BLOCK_J r]``, then contracted with
  ``S[c-group, j-chunk]`` into the fp32 accumulator ``[BLOCK_C, BLOCK_N, BLOCK_A]``. No first-core work
  is repeated (output group ``c`` needs only the columns ``F[:, :, c]``; A tiles beyond the first do
  repeat it); the input is re-read once per output group, from L2 when the groups of one token tile run
  together (the grid puts them next to each other).
* ``second_core_grad`` (``_grad_kernel``): ``dS[c, j, k, a] = sum_n t[n, j, c, k] g[n, c, a]``: a program
  owns ``BLOCK_C`` output blocks, ``BLOCK_J`` input blocks, ``BLOCK_A`` features and a split of the
  tokens; per token tile it forms its ``t`` chunk as above and accumulates ``tᵀ g`` in fp32; the splits
  meet by atomic adds (or, deterministic, one split and plain stores).

``dx = dy Mᵀ`` is ``through_cores`` with the cores' roles exchanged, and the first core's gradient
``dF[j, b, c, k] = sum_n x[n, j, b] u[n, c, j, k]`` (``u``: the intermediate of ``dy Mᵀ``) is
``second_core_grad`` of that transposed layer: every core is addressed through its strides, so the
permuted views cost no copy.

``x`` may come in up to three *input segments* (tensors side by side along ``j``: the gradients of
layers that share an input, whose input gradient sums over all of them) and ``y`` (or ``g``) in up to
three *output segments* (layers that share an input, each output its own tensor); each segment has its
own first core (input) or second core (output) pointer, and the other core is offset along the
segment's blocks.

``tl.dot`` needs every dimension >= 16, so ``BLOCK_C * R_PAD`` and ``BLOCK_J * R_PAD`` are >= 16
(``R_PAD``: ``r`` rounded up to a power of two; padded ranks, blocks and features are masked to zero).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from comera_compile.kernels.dispatch import HAS_TRITON, dot_precision, interpreting, use_triton

__all__ = ["MAX_BLOCK_FEATURES", "MAX_RANK", "MAX_SEGMENTS", "Tiles", "fused_supported", "second_core_grad",
           "through_cores", "tiles_for"]

MAX_RANK = 16  # the kernels' limit on r (BLOCK_J = BLOCK_C = 1 at 16; larger ranks take the library path)
MAX_SEGMENTS = 3  # input or output segments one launch takes
MAX_BLOCK_FEATURES = 256  # b and a up to this; wider blocks take the library path

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _first_core(x_ptr, sx, f_ptr, n_total, n0, j0, nj, c0, coff, nc, B, RANK, sfj, sfb, sfc, sfk,
                    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
                    R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``t[c, n, (j, k)] = sum_b x[n, j0 + j, b] F[j0 + j, b, coff + c0 + c, k]`` for one token tile,
        one chunk of input blocks and one output group: ``[BLOCK_C, BLOCK_N, BLOCK_J R_PAD]`` in the
        input dtype (zero where a block, a rank or a token is padding)."""
        xj = tl.arange(0, BLOCK_J)[:, None, None]
        xn = n0 + tl.arange(0, BLOCK_N)[None, :, None]
        xb = tl.arange(0, BLOCK_B)[None, None, :]
        x_ok = (xn < n_total) & (j0 + xj < nj)
        x_rows = x_ptr + tl.where(xn < n_total, xn, 0).to(tl.int64) * sx + (j0 + xj) * B
        fj = tl.arange(0, BLOCK_J)[:, None, None]
        fb = tl.arange(0, BLOCK_B)[None, :, None]
        fq = tl.arange(0, BLOCK_C * R_PAD)[None, None, :]
        fc, fk = c0 + fq // R_PAD, fq % R_PAD
        f_ok = (j0 + fj < nj) & (fc < nc) & (fk < RANK)
        f_cols = f_ptr + (j0 + fj) * sfj + (coff + fc) * sfc + fk * sfk
        t = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_C * R_PAD), dtype=tl.float32)
        for b0 in range(0, B, BLOCK_B):
            xt = tl.load(x_rows + b0 + xb, mask=x_ok & (b0 + xb < B), other=0.0)
            ft = tl.load(f_cols + (b0 + fb) * sfb, mask=f_ok & (b0 + fb < B), other=0.0)
            t = tl.dot(xt, ft, t, input_precision=DOT_PRECISION)  # [BLOCK_J, BLOCK_N, BLOCK_C R_PAD]
        t = tl.reshape(t.to(x_ptr.dtype.element_ty), (BLOCK_J, BLOCK_N, BLOCK_C, R_PAD))
        return tl.reshape(tl.permute(t, (2, 1, 0, 3)), (BLOCK_C, BLOCK_N, BLOCK_J * R_PAD))

    @triton.jit
    def _output_segment(g, g0, g1, nc0, nc1, nc2, p0, p1, p2, sp0, sp1, sp2, q0, q1, q2,
                        OUT_SEGMENTS: tl.constexpr):
        """The output segment of output group ``g``: ``(g within it, its two pointers, its row stride,
        its blocks, the blocks before it)``."""
        p, sp, q, nc, coff = p0, sp0, q0, nc0, 0
        if OUT_SEGMENTS >= 2:
            if g >= g0:
                g -= g0
                p, sp, q, nc, coff = p1, sp1, q1, nc1, nc0
                if OUT_SEGMENTS >= 3:
                    if g >= g1:
                        g -= g1
                        p, sp, q, nc, coff = p2, sp2, q2, nc2, nc0 + nc1
        return g, p, sp, q, nc, coff

    @triton.jit
    def _output_groups(nc0, nc1, nc2, BLOCK_C: tl.constexpr, OUT_SEGMENTS: tl.constexpr):
        g0 = tl.cdiv(nc0, BLOCK_C)
        g1 = tl.cdiv(nc1, BLOCK_C)
        groups = g0
        if OUT_SEGMENTS >= 2:
            groups += g1
        if OUT_SEGMENTS >= 3:
            groups += tl.cdiv(nc2, BLOCK_C)
        return g0, g1, groups

    @triton.jit
    def _through_segment(acc, x_ptr, sx, f_ptr, s_ptr, nj, joff, coff, n_total, n0, c0, a0, nc, A, B, RANK,
                         sfj, sfb, sfc, sfk, ssc, ssj, ssk, ssa,
                         BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, R_PAD: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
        """One input segment's contribution to ``acc [BLOCK_C, BLOCK_N, BLOCK_A]``."""
        sc = c0 + tl.arange(0, BLOCK_C)[:, None, None]
        sq = tl.arange(0, BLOCK_J * R_PAD)[None, :, None]
        sa = a0 + tl.arange(0, BLOCK_A)[None, None, :]
        sj, sk = sq // R_PAD, sq % R_PAD
        s_ok = (sc < nc) & (sk < RANK) & (sa < A)
        s_cols = s_ptr + sc * ssc + sk * ssk + sa * ssa
        for j0 in range(0, nj, BLOCK_J):
            t = _first_core(x_ptr, sx, f_ptr, n_total, n0, j0, nj, c0, coff, nc, B, RANK, sfj, sfb, sfc, sfk,
                            BLOCK_N, BLOCK_J, BLOCK_C, BLOCK_B, R_PAD, DOT_PRECISION)
            st = tl.load(s_cols + (joff + j0 + sj) * ssj, mask=s_ok & (j0 + sj < nj), other=0.0)
            acc = tl.dot(t, st, acc, input_precision=DOT_PRECISION)  # [BLOCK_C, BLOCK_N, BLOCK_A]
        return acc

    @triton.jit
    def _through_kernel(x0, x1, x2, sx0, sx1, sx2, f0, f1, f2, nj0, nj1, nj2,
                        y0, y1, y2, sy0, sy1, sy2, s0, s1, s2, nc0, nc1, nc2,
                        n_total, A, B, RANK, sfj, sfb, sfc, sfk, ssc, ssj, ssk, ssa,
                        IN_SEGMENTS: tl.constexpr, OUT_SEGMENTS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr,
                        BLOCK_B: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # program -> (token tile, A tile, output group), the output groups of one token tile adjacent
        g0, g1, groups = _output_groups(nc0, nc1, nc2, BLOCK_C, OUT_SEGMENTS)
        pid = tl.program_id(0)
        g = pid % groups
        rest = pid // groups
        n_a = tl.cdiv(A, BLOCK_A)
        a0 = (rest % n_a) * BLOCK_A
        n0 = (rest // n_a) * BLOCK_N
        g, y_ptr, sy, s_ptr, nc, coff = _output_segment(g, g0, g1, nc0, nc1, nc2, y0, y1, y2, sy0, sy1, sy2,
                                                        s0, s1, s2, OUT_SEGMENTS)
        c0 = g * BLOCK_C
        acc = tl.zeros((BLOCK_C, BLOCK_N, BLOCK_A), dtype=tl.float32)
        acc = _through_segment(acc, x0, sx0, f0, s_ptr, nj0, 0, coff, n_total, n0, c0, a0, nc, A, B, RANK,
                               sfj, sfb, sfc, sfk, ssc, ssj, ssk, ssa,
                               BLOCK_N, BLOCK_J, BLOCK_C, BLOCK_A, BLOCK_B, R_PAD, DOT_PRECISION)
        if IN_SEGMENTS >= 2:
            acc = _through_segment(acc, x1, sx1, f1, s_ptr, nj1, nj0, coff, n_total, n0, c0, a0, nc, A, B, RANK,
                                   sfj, sfb, sfc, sfk, ssc, ssj, ssk, ssa,
                                   BLOCK_N, BLOCK_J, BLOCK_C, BLOCK_A, BLOCK_B, R_PAD, DOT_PRECISION)
        if IN_SEGMENTS >= 3:
            acc = _through_segment(acc, x2, sx2, f2, s_ptr, nj2, nj0 + nj1, coff, n_total, n0, c0, a0, nc, A, B,
                                   RANK, sfj, sfb, sfc, sfk, ssc, ssj, ssk, ssa,
                                   BLOCK_N, BLOCK_J, BLOCK_C, BLOCK_A, BLOCK_B, R_PAD, DOT_PRECISION)
        yc = c0 + tl.arange(0, BLOCK_C)[:, None, None]
        yn = n0 + tl.arange(0, BLOCK_N)[None, :, None]
        ya = a0 + tl.arange(0, BLOCK_A)[None, None, :]
        tl.store(y_ptr + yn.to(tl.int64) * sy + yc * A + ya, acc.to(y_ptr.dtype.element_ty),
                 mask=(yc < nc) & (yn < n_total) & (ya < A))

    @triton.jit
    def _grad_kernel(x0, x1, x2, sx0, sx1, sx2, f0, f1, f2, nj0, nj1, nj2,
                     g_0, g_1, g_2, sg0, sg1, sg2, o0, o1, o2, nc0, nc1, nc2,
                     n_total, tiles_per_split, A, B, RANK, sfj, sfb, sfc, sfk, soc, soj, sok, soa,
                     IN_SEGMENTS: tl.constexpr, OUT_SEGMENTS: tl.constexpr, ATOMIC: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr,
                     BLOCK_B: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # program -> (token split, input segment's j chunk, A tile, output group), the groups adjacent
        g0, g1, groups = _output_groups(nc0, nc1, nc2, BLOCK_C, OUT_SEGMENTS)
        chunks0 = tl.cdiv(nj0, BLOCK_J)
        chunks1 = tl.cdiv(nj1, BLOCK_J)
        chunks = chunks0
        if IN_SEGMENTS >= 2:
            chunks += chunks1
        if IN_SEGMENTS >= 3:
            chunks += tl.cdiv(nj2, BLOCK_J)
        n_a = tl.cdiv(A, BLOCK_A)
        pid = tl.program_id(0)
        g = pid % groups
        rest = pid // groups
        a0 = (rest % n_a) * BLOCK_A
        rest = rest // n_a
        ch = rest % chunks
        split = rest // chunks
        g, g_ptr, sg, o_ptr, nc, coff = _output_segment(g, g0, g1, nc0, nc1, nc2, g_0, g_1, g_2, sg0, sg1, sg2,
                                                        o0, o1, o2, OUT_SEGMENTS)
        # the input segment of chunk ch
        x_ptr, sx, f_ptr, nj, joff = x0, sx0, f0, nj0, 0
        if IN_SEGMENTS >= 2:
            if ch >= chunks0:
                ch -= chunks0
                x_ptr, sx, f_ptr, nj, joff = x1, sx1, f1, nj1, nj0
                if IN_SEGMENTS >= 3:
                    if ch >= chunks1:
                        ch -= chunks1
                        x_ptr, sx, f_ptr, nj, joff = x2, sx2, f2, nj2, nj0 + nj1
        c0 = g * BLOCK_C
        j0 = ch * BLOCK_J
        gc = c0 + tl.arange(0, BLOCK_C)[:, None, None]
        gn = tl.arange(0, BLOCK_N)[None, :, None]
        ga = a0 + tl.arange(0, BLOCK_A)[None, None, :]
        g_ok = (gc < nc) & (ga < A)
        acc = tl.zeros((BLOCK_C, BLOCK_J * R_PAD, BLOCK_A), dtype=tl.float32)
        first_tile = split * tiles_per_split
        for tile in range(first_tile, first_tile + tiles_per_split):
            n0 = tile * BLOCK_N
            t = _first_core(x_ptr, sx, f_ptr, n_total, n0, j0, nj, c0, coff, nc, B, RANK, sfj, sfb, sfc, sfk,
                            BLOCK_N, BLOCK_J, BLOCK_C, BLOCK_B, R_PAD, DOT_PRECISION)  # [C, N, J R]
            rows = n0 + gn
            gt = tl.load(g_ptr + tl.where(rows < n_total, rows, 0).to(tl.int64) * sg + gc * A + ga,
                         mask=g_ok & (rows < n_total), other=0.0)  # [C, N, A]
            acc = tl.dot(tl.permute(t, (0, 2, 1)), gt, acc, input_precision=DOT_PRECISION)
        oq = tl.arange(0, BLOCK_J * R_PAD)[None, :, None]
        oj, ok = j0 + oq // R_PAD, oq % R_PAD
        o_ptrs = o_ptr + gc * soc + (joff + oj) * soj + ok * sok + ga * soa
        o_mask = g_ok & (oj < nj) & (ok < RANK)
        if ATOMIC:
            tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
        else:
            tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=o_mask)


class Tiles(NamedTuple):
    """A launch's tile sizes and warps (see the module doc)."""

    block_n: int
    block_j: int
    block_c: int
    block_a: int
    block_b: int
    num_warps: int
    num_stages: int


def _pow2(v: int) -> int:
    return 1 << max(int(v) - 1, 0).bit_length()


def tiles_for(r: int, b: int, a: int, kernel: str = "through") -> Tiles:
    """The tile sizes of ``kernel`` (``"through"`` or ``"grad"``) for rank ``r``, input blocks of ``b`` and
    output blocks of ``a`` features: the smallest chunks of blocks a dot takes (``16 / R_PAD`` blocks),
    the block's features 64 at a time, 16 to 64 tokens."""
    rp = _pow2(r)
    blocks = max(16 // rp, 1)
    block_a = min(max(_pow2(a), 16), 64)
    block_b = min(max(_pow2(b), 16), 64)
    if interpreting():
        return Tiles(16, blocks, blocks, block_a, block_b, 4, 1)
    if kernel == "grad":
        return Tiles(32, blocks, blocks, block_a, block_b, 4, 2)
    return Tiles(32 if block_a <= 32 else 16, blocks, blocks, block_a, block_b, 4, 2)


def fused_supported(x: torch.Tensor, r: int, b: int, a: int, n_segments: int) -> bool:
    """Whether the kernels take this call: a Triton dtype on a device they run on, ``r`` up to
    :data:`MAX_RANK`, blocks up to :data:`MAX_BLOCK_FEATURES` features, at most :data:`MAX_SEGMENTS` segments."""
    return (HAS_TRITON and use_triton(x, "auto", op="btt_blocks") and 1 <= r <= MAX_RANK
            and b <= MAX_BLOCK_FEATURES and a <= MAX_BLOCK_FEATURES and 1 <= n_segments <= MAX_SEGMENTS)


def _pad3(seq, fill) -> list:
    return list(seq) + [fill] * (MAX_SEGMENTS - len(seq))


def _check(xs, firsts, seconds, out_blocks) -> None:
    if len(xs) > 1 and len(out_blocks) > 1:
        raise ValueError("btt kernel: several input segments and several output segments in one launch")
    if not 1 <= max(len(xs), len(out_blocks)) <= MAX_SEGMENTS or len(firsts) not in (1, len(xs)):
        raise ValueError(f"btt kernel: {len(xs)} input and {len(out_blocks)} output segments "
                         f"(at most {MAX_SEGMENTS}), {len(firsts)} first cores")
    if any(f.stride() != firsts[0].stride() for f in firsts) or any(s.stride() != seconds[0].stride()
                                                                    for s in seconds):
        raise ValueError("btt kernel: the segments' cores must have the same strides")


def through_cores(xs: Sequence[torch.Tensor], firsts: Sequence[torch.Tensor], seconds: Sequence[torch.Tensor],
                  ys: Sequence[torch.Tensor], r: int, b: int, a: int, tiles: Tiles | None = None) -> None:
    """``ys[o] = sum_i x_i`` through the cores (see the module doc), written in place.

    * ``xs[i]`` [n, J_i b] (rows of unit stride), ``firsts[i]`` [J_i, b, C, r] (any strides, the same
      for every segment; one per input segment, or one for all output segments: then its ``C`` spans
      them all);
    * ``seconds[o]`` [C_o, J, r, a] (any strides, the same for every segment; ``J`` spans every input
      segment), ``ys[o]`` [n, C_o a] (rows of unit stride).

    Either the inputs or the outputs are one segment; at most :data:`MAX_SEGMENTS` of either."""
    out_blocks = [y.shape[1] // a for y in ys]
    _check(xs, firsts, seconds, out_blocks)
    n = xs[0].shape[0]
    tiles = tiles or tiles_for(r, b, a)
    f, s = firsts[0], seconds[0]
    groups = sum(triton.cdiv(c, tiles.block_c) for c in out_blocks)
    grid = (groups * triton.cdiv(a, tiles.block_a) * triton.cdiv(n, tiles.block_n),)
    if grid[0] == 0:
        return
    _through_kernel[grid](
        *_pad3(xs, xs[0]), *_pad3([x.stride(0) for x in xs], 0), *_pad3(firsts, f),
        *_pad3([x.shape[1] // b for x in xs], 0),
        *_pad3(ys, ys[0]), *_pad3([y.stride(0) for y in ys], 0), *_pad3(seconds, s), *_pad3(out_blocks, 0),
        n, a, b, r, *f.stride(), *s.stride(),
        IN_SEGMENTS=len(xs), OUT_SEGMENTS=len(ys),
        BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j, BLOCK_C=tiles.block_c, BLOCK_A=tiles.block_a,
        BLOCK_B=tiles.block_b, R_PAD=_pow2(r), DOT_PRECISION=dot_precision(xs[0].dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _splits(programs: int, token_tiles: int, device: torch.device) -> int:
    """Token splits that give the grad kernel about four programs per multiprocessor."""
    if device.type != "cuda":
        return min(2, token_tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(token_tiles, -(-4 * sms // max(programs, 1))))


def second_core_grad(xs: Sequence[torch.Tensor], firsts: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                     outs: Sequence[torch.Tensor], r: int, b: int, a: int, *, deterministic: bool = False,
                     tiles: Tiles | None = None) -> None:
    """``outs[o][c, j, k, a] = sum_n t[n, j, c, k] g_o[n, c, a]``, ``t`` the first core's product of the
    input segments ``xs`` (see :func:`through_cores` for ``xs`` and ``firsts``; ``gs[o]`` [n, C_o a],
    rows of unit stride). ``outs[o]`` [C_o, J, r, a] (any strides, the same for every segment) is
    written: fp32 and zeroed first unless ``deterministic`` (then each entry is stored once, by one
    program that walks every token, in the output's dtype)."""
    out_blocks = [g.shape[1] // a for g in gs]
    _check(xs, firsts, outs, out_blocks)
    n = xs[0].shape[0]
    tiles = tiles or tiles_for(r, b, a, "grad")
    f, o = firsts[0], outs[0]
    if not deterministic and any(t.dtype != torch.float32 for t in outs):
        raise ValueError("btt kernel: the cores' gradients accumulate by atomic adds in fp32 outputs")
    groups = sum(triton.cdiv(c, tiles.block_c) for c in out_blocks)
    chunks = sum(triton.cdiv(x.shape[1] // b, tiles.block_j) for x in xs)
    programs = groups * chunks * triton.cdiv(a, tiles.block_a)
    token_tiles = triton.cdiv(n, tiles.block_n)
    splits = 1 if deterministic else _splits(programs, token_tiles, xs[0].device)
    tiles_per_split = triton.cdiv(token_tiles, splits)
    splits = triton.cdiv(token_tiles, tiles_per_split)
    if programs * splits == 0:
        return
    _grad_kernel[(programs * splits,)](
        *_pad3(xs, xs[0]), *_pad3([x.stride(0) for x in xs], 0), *_pad3(firsts, f),
        *_pad3([x.shape[1] // b for x in xs], 0),
        *_pad3(gs, gs[0]), *_pad3([g.stride(0) for g in gs], 0), *_pad3(outs, o), *_pad3(out_blocks, 0),
        n, tiles_per_split, a, b, r, *f.stride(), *o.stride(),
        IN_SEGMENTS=len(xs), OUT_SEGMENTS=len(gs), ATOMIC=not deterministic,
        BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j, BLOCK_C=tiles.block_c, BLOCK_A=tiles.block_a,
        BLOCK_B=tiles.block_b, R_PAD=_pow2(r), DOT_PRECISION=dot_precision(xs[0].dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
