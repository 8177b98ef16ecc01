"""A block tensor-train's blocks path: ``comera::btt_blocks`` (its two batched GEMMs) and
``comera::btt_swap``, ``x [A, M, B, K] -> [B, M, A, K]`` (the first and third axes swapped), the
regrouping copy between them.

The blocks path of a ``"btt"`` layer (:func:`comera_compile.kernels.tt_runtime.btt_linear`) runs one
batched GEMM per row block and one per column block. The GEMMs read the token-major input and write the
token-major output in place (strided batches); between them the intermediate ``T [b1, n, c, r]`` must
become ``[c, n, b1, r]``. As a plain ``permute().contiguous()`` that copy has a tiny contiguous axis on one side
(``r`` elements, often 1), so every element is its own memory transaction: on an H200 such a copy of
the 64 MiB intermediate of a 4096-wide layer at 8,192 tokens ran at under 0.1 TB/s and took 80 % of the
layer's time. The Triton kernel here copies tiles ``[BLOCK_A, BLOCK_B, BLOCK_K]``: each load reads
rows of ``BLOCK_B * K`` contiguous elements and each store writes rows of ``BLOCK_A * K``, the transpose
done on chip, so both sides are coalesced.

The op is its own inverse (with ``A`` and ``B`` exchanged), so its backward is the same op on the
gradient. CPU tensors (and dtypes Triton does not take) use ``permute(2, 1, 0, 3).contiguous()``;
under ``TRITON_INTERPRET=1`` with ``COMERA_FORCE_TRITON=1`` the kernel runs on the CPU (tests).
"""

from __future__ import annotations

import torch

import logging

from comera_compile.kernels.dispatch import HAS_TRITON, use_triton

__all__ = ["btt_blocks", "btt_blocks_backward", "btt_swap", "swap_blocks"]
logger = logging.getLogger("comera_compile")
_BROKEN: list[str] = []  # why the kernel could not run here (then the permute serves every later call)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swap_kernel(x_ptr, y_ptr, A, M, B, K, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        n_b = tl.cdiv(B, BLOCK_B)
        tiles = tl.cdiv(A, BLOCK_A) * n_b
        pid = tl.program_id(0).to(tl.int64)
        m = pid // tiles
        pid = pid % tiles
        oa = ((pid // n_b) * BLOCK_A + tl.arange(0, BLOCK_A)).to(tl.int64)
        ob = ((pid % n_b) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        a3 = oa[:, None, None]
        b3 = ob[None, :, None]
        for k0 in range(0, K, BLOCK_K):
            k3 = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)[None, None, :]
            mask = (a3 < A) & (b3 < B) & (k3 < K)
            tile = tl.load(x_ptr + ((a3 * M + m) * B + b3) * K + k3, mask=mask)
            tl.store(y_ptr + ((b3 * M + m) * A + a3) * K + k3, tile, mask=mask)


def _blocks(k: int) -> tuple[int, int, int]:
    """Tile sizes: ``BLOCK_K`` covers ``K`` up to 64; ``BLOCK_A = BLOCK_B`` keeps a tile at 4,096 elements."""
    bk = min(triton.next_power_of_2(max(k, 1)), 64)
    side = {1: 64, 2: 32, 4: 32, 8: 16, 16: 16, 32: 8, 64: 8}[bk]
    return side, side, bk


def _swap_triton(x: torch.Tensor) -> torch.Tensor:
    A, M, B, K = x.shape
    y = x.new_empty((B, M, A, K))
    if y.numel() == 0:
        return y
    ba, bb, bk = _blocks(K)
    grid = (triton.cdiv(A, ba) * triton.cdiv(B, bb) * M,)
    _swap_kernel[grid](x, y, A, M, B, K, BLOCK_A=ba, BLOCK_B=bb, BLOCK_K=bk)
    return y


def swap_blocks(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``x [A, M, B, K] -> [B, M, A, K]``, contiguous: the Triton kernel (``impl="auto"`` on CUDA,
    ``"triton"``) or ``permute(2, 1, 0, 3).contiguous()`` (``"torch"``, and ``"auto"`` on the CPU). Under
    ``"auto"``, a kernel that fails to build or launch is reported once (a warning on the
    ``comera_compile`` logger) and the permute serves from then on; ``"triton"`` raises."""
    if x.dim() != 4:
        raise ValueError(f"btt_swap: expected a 4-D tensor [A, M, B, K], got shape {tuple(x.shape)}")
    if use_triton(x, impl, op="btt_swap") and (impl == "triton" or not _BROKEN):
        try:
            return _swap_triton(x.contiguous())
        except Exception as exc:  # a Triton build that cannot compile the kernel: stay correct, say so once
            if impl == "triton":
                raise
            _BROKEN.append(f"{type(exc).__name__}: {exc}")
            logger.warning("btt_swap: the Triton kernel failed (%s); using permute().contiguous() from now on "
                           "(correct, slower)", _BROKEN[0].splitlines()[0][:300])
    return x.permute(2, 1, 0, 3).clone(memory_format=torch.contiguous_format)  # a copy, never a view


@torch.library.custom_op("comera::btt_swap", mutates_args=())
def btt_swap(x: torch.Tensor) -> torch.Tensor:
    """The op form of :func:`swap_blocks` (opaque to Inductor; differentiable: its backward swaps back)."""
    return swap_blocks(x)


@btt_swap.register_fake
def _(x):
    A, M, B, K = x.shape
    return x.new_empty((B, M, A, K))


def _backward(ctx, grad):
    return btt_swap(grad)


btt_swap.register_autograd(_backward)


# ------------------------------------------------------------------ the blocks path as one op (strided GEMMs)


def _blocks_forward(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, c: int, r: int):
    """``y [n, c a]`` and the regrouped intermediate ``[c, n, b1 r]`` (kept for the backward)."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    a = second.shape[2]
    # the token-major input read in place as [b1, n, b2] (a strided batch; no copy)
    t = torch.bmm(x.view(n, b1, b2).transpose(0, 1), first)  # [b1, n, c r]
    ts = swap_blocks(t.view(b1, n, c, r)).view(c, n, b1 * r)
    y = x.new_empty((n, c, a))
    torch.bmm(ts, second, out=y.transpose(0, 1))  # written token-major in place ([c, n, a] strided)
    return y.view(n, c * a), ts


@torch.library.custom_op("comera::btt_blocks", mutates_args=())
def btt_blocks(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, c: int,
               r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, b1 b2] -> y [n, c a]`` through a block tensor-train's two batched cores, ``first``
    [b1, b2, c r] (row block ``j``: ``x[:, j] @ first[j]``) and ``second`` [c, b1 r, a] (column block
    ``c``), as one op: the GEMMs read the token-major input and write the token-major output in place
    (strided batches, no copy); the one regrouping between them is :func:`swap_blocks`. Returns ``y``
    and the regrouped intermediate ``[c, n, b1 r]``, which the backward
    (``comera::btt_blocks_backward``, run the same way) reads; ``x`` must be contiguous."""
    return _blocks_forward(x, first, second, c, r)


@btt_blocks.register_fake
def _(x, first, second, c, r):
    n, b1 = x.shape[0], first.shape[0]
    return x.new_empty((n, c * second.shape[2])), x.new_empty((c, n, b1 * r))


@torch.library.custom_op("comera::btt_blocks_backward", mutates_args=())
def btt_blocks_backward(grad: torch.Tensor, x: torch.Tensor, ts: torch.Tensor, first: torch.Tensor,
                        second: torch.Tensor, c: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`btt_blocks` for ``x``, ``first`` and ``second``."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    a = second.shape[2]
    gy = grad.contiguous().view(n, c, a).transpose(0, 1)  # [c, n, a] strided
    g_second = torch.bmm(ts.transpose(1, 2), gy)  # [c, b1 r, a]
    gts = torch.bmm(gy, second.transpose(1, 2))  # [c, n, b1 r]
    gt = swap_blocks(gts.view(c, n, b1, r)).view(b1, n, c * r)
    gx = x.new_empty((n, b1, b2))
    torch.bmm(gt, first.transpose(1, 2), out=gx.transpose(0, 1))
    g_first = torch.bmm(x.view(n, b1, b2).permute(1, 2, 0), gt)  # [b1, b2, c r]
    return gx.view(n, b1 * b2), g_first, g_second


@btt_blocks_backward.register_fake
def _(grad, x, ts, first, second, c, r):
    return torch.empty_like(x), torch.empty_like(first), torch.empty_like(second)


def _blocks_setup(ctx, inputs, output) -> None:
    x, first, second, c, r = inputs
    ctx.c, ctx.r = c, r
    # The intermediate has c r / b2 times the input's entries: kept for the backward while no larger
    # than the input (rank 1 with c <= b2), else recomputed there (one batched GEMM and one swap), so
    # that a rank-r layer saves no r-times-larger activation.
    ctx.keep = output[1].numel() <= x.numel()
    ctx.save_for_backward(x, output[1] if ctx.keep else None, first, second)


def _blocks_backward(ctx, grad, _grad_ts):
    x, ts, first, second = ctx.saved_tensors
    if not ctx.keep:
        ts = torch.ops.comera.btt_blocks(x, first, second, ctx.c, ctx.r)[1]
    gx, g_first, g_second = torch.ops.comera.btt_blocks_backward(grad, x, ts, first, second, ctx.c, ctx.r)
    return gx, g_first, g_second, None, None


btt_blocks.register_autograd(_blocks_backward, setup_context=_blocks_setup)
