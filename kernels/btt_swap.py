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

from comera_compile.kernels import btt_fused
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


_WIDE = {4: torch.int32, 8: torch.int64}  # bytes -> the integer type of that width


def _widened(x: torch.Tensor) -> torch.Tensor:
    """``x [A, M, B, K]`` (contiguous) read as ``[A, M, B, K']`` of wider integers holding its K
    elements a few at a time (int64 where K x itemsize is a multiple of 8 bytes, else int32 where of 4):
    the swap of rank-4 bf16 blocks is then the swap of one int64 per (A, M, B) position. The same
    tensor when no integer wider than its elements divides K x itemsize."""
    row = x.shape[3] * x.element_size()
    for width in (8, 4):
        if width > x.element_size() and row % width == 0:
            return x.view(_WIDE[width])
    return x


def _swap_triton(x: torch.Tensor, widen: bool = True) -> torch.Tensor:
    src = _widened(x) if widen else x
    A, M, B, K = src.shape
    y = src.new_empty((B, M, A, K))
    if y.numel() == 0:
        return y.view(x.dtype)
    ba, bb, bk = _blocks(K)
    grid = (triton.cdiv(A, ba) * triton.cdiv(B, bb) * M,)
    _swap_kernel[grid](src, y, A, M, B, K, BLOCK_A=ba, BLOCK_B=bb, BLOCK_K=bk)
    return y.view(x.dtype)


def swap_blocks(x: torch.Tensor, impl: str = "auto", widen: bool = True) -> torch.Tensor:
    """``x [A, M, B, K] -> [B, M, A, K]``, contiguous: the Triton kernel (``impl="auto"`` on CUDA,
    ``"triton"``) or ``permute(2, 1, 0, 3).contiguous()`` (``"torch"``, and ``"auto"`` on the CPU). Under
    ``"auto"``, a kernel that fails to build or launch is reported once (a warning on the
    ``comera_compile`` logger) and the permute serves from then on; ``"triton"`` raises. ``widen``
    (default): the kernel moves the ``K`` elements of each position as wider integers where ``K`` x
    the element size is a multiple of 4 or 8 bytes (the same bytes, so the same result)."""
    if x.dim() != 4:
        raise ValueError(f"btt_swap: expected a 4-D tensor [A, M, B, K], got shape {tuple(x.shape)}")
    if use_triton(x, impl, op="btt_swap") and (impl == "triton" or not _BROKEN):
        try:
            return _swap_triton(x.contiguous(), widen)
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


# ------------------------------------------------------------------ the blocks path as one op


def keeps_intermediate(first: torch.Tensor, r: int) -> bool:
    """Whether the batched-GEMM path keeps the regrouped intermediate ``[C, n, b1 r]`` for its backward:
    while it has no more entries than the input (``C r <= b2``: rank 1 with ``C <= b2``); otherwise its
    backward recomputes it (the first product only), so that a rank-r layer saves no r-times-larger
    activation."""
    return first.shape[2] <= first.shape[1]


def fused_applies(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int) -> bool:
    """Whether the fused kernels (``btt_fused``) run this call, by its shapes, dtype and device: every
    second core of one block width, sizes the kernels take (ranks up to 16, blocks up to 256 features,
    up to three outputs), on the GPU (or the interpreter when forced). Decided the same way on fake
    tensors, so that the op's outputs have the same shapes when traced."""
    a = seconds[0].shape[2]
    return all(s.shape[2] == a for s in seconds) and btt_fused.fused_supported(x, r, first.shape[1], a, len(seconds))


def saves_intermediate(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int) -> bool:
    """Whether ``comera::btt_blocks`` returns the regrouped intermediate for its backward: only on the
    batched-GEMM path, where :func:`keeps_intermediate` says so (the fused backward recomputes what it
    needs on chip); otherwise the op returns an empty tensor in its place."""
    return keeps_intermediate(first, r) and not fused_applies(x, first, seconds, r)


def _fused(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int) -> bool:
    """:func:`fused_applies`, unless the kernels failed for this signature earlier."""
    return fused_applies(x, first, seconds, r) and _signature(x, first, seconds) not in _FUSED_BROKEN


def _signature(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor]) -> tuple:
    return (x.dtype, first.shape[1], seconds[0].shape[2], len(seconds))


def _fused_failed(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], exc: Exception) -> None:
    """Record and report a fused launch that failed: its signature (dtype, b2, a, outputs) takes the
    batched GEMMs from now on; other signatures still try the kernels."""
    sig = _signature(x, first, seconds)
    _FUSED_BROKEN.add(sig)
    logger.warning("btt_blocks: the fused Triton kernel failed for (dtype, b2, a, outputs) = %s (%s: %s); using "
                   "batched GEMMs for these shapes (correct, slower)", sig, type(exc).__name__,
                   (str(exc).splitlines() or [""])[0][:300])


_FUSED_BROKEN: set[tuple] = set()  # signatures whose fused kernels failed to build or launch


def _cores(first: torch.Tensor, seconds: list[torch.Tensor], r: int):
    """The cores as the kernels read them: ``F [b1, b2, C, r]`` and each ``S_i [c_i, b1, r, a]``."""
    b1, b2 = first.shape[0], first.shape[1]
    first = first.contiguous()
    return first.view(b1, b2, -1, r), [s.contiguous().view(s.shape[0], b1, r, s.shape[2]) for s in seconds]


def _blocks_forward(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int, keep: bool):
    """The outputs ``y_i [n, c_i a_i]`` (one per second core ``[c_i, b1 r, a_i]``) and, with ``keep``, the
    regrouped intermediate ``[C, n, b1 r]`` (``C = sum c_i``; else None)."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    cs = [s.shape[0] for s in seconds]
    if _fused(x, first, seconds, r):
        a = seconds[0].shape[2]
        ys = [x.new_empty((n, c * a)) for c in cs]
        F, Ss = _cores(first, seconds, r)
        try:
            btt_fused.through_cores([x], [F], Ss, ys, r, b2, a)
            return ys, None
        except Exception as exc:  # a Triton build that cannot compile the kernel: stay correct, say so once
            _fused_failed(x, first, seconds, exc)
    # the token-major input read in place as [b1, n, b2] (a strided batch; no copy)
    t = torch.bmm(x.view(n, b1, b2).transpose(0, 1), first)  # [b1, n, C r]
    ts = swap_blocks(t.view(b1, n, sum(cs), r)).view(sum(cs), n, b1 * r)
    ys, c0 = [], 0
    for second, c in zip(seconds, cs):
        y = x.new_empty((n, c, second.shape[2]))
        torch.bmm(ts[c0:c0 + c], second, out=y.transpose(0, 1))  # written token-major in place ([c, n, a] strided)
        ys.append(y.view(n, -1))
        c0 += c
    return ys, ts if keep else None


@torch.library.custom_op("comera::btt_blocks", mutates_args=())
def btt_blocks(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int) -> list[torch.Tensor]:
    """``x [n, b1 b2] -> y_i [n, c_i a_i]`` through block tensor-trains that share their first core
    ``first`` [b1, b2, C r] (row block ``j``: ``x[:, j] @ first[j]``; ``C = sum c_i``) and each have a
    second core ``seconds[i]`` [c_i, b1 r, a_i] (its column blocks; one layer: one second core; layers
    reading one input: their first cores concatenated along the column blocks), as one op. Returns the
    outputs, then the regrouped intermediate ``[C, n, b1 r]`` where :func:`saves_intermediate` says the
    backward (``comera::btt_blocks_backward``) reads it, else an empty tensor; ``x`` must be contiguous.
    Each output is its own tensor, so each output's gradient arrives on its own: a split of one wide
    output made the backward concatenate them, and at d 4096 on an H200 that copy, with the RoPE
    backward fused into it, took 1.16 ms a layer, where the dense model's RoPE-backward kernels take
    0.37 ms.

    Where :func:`fused_applies` (the GPU, up to three outputs of one block width, ranks up to 16) both
    products run as one Triton kernel with the intermediate on chip (``btt_fused``); otherwise two
    batched library GEMMs read the token-major input and write each token-major output in place
    (strided batches, no copy), with :func:`swap_blocks` regrouping between them."""
    ys, ts = _blocks_forward(x, first, seconds, r, saves_intermediate(x, first, seconds, r))
    return ys + [x.new_empty((0,)) if ts is None else ts]


@btt_blocks.register_fake
def _(x, first, seconds, r):
    n, b1 = x.shape[0], first.shape[0]
    cs = sum(s.shape[0] for s in seconds)
    kept = x.new_empty((cs, n, b1 * r)) if saves_intermediate(x, first, seconds, r) else x.new_empty((0,))
    return [x.new_empty((n, s.shape[0] * s.shape[2])) for s in seconds] + [kept]


def _fused_backward(grads: list[torch.Tensor], x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor],
                    r: int) -> list[torch.Tensor]:
    """Every gradient through the fused kernels: ``dx`` through the transposed layer (the cores' roles
    exchanged), ``dS_i`` and ``dF`` as reductions over the tokens (``dF`` being the second core's
    gradient of the transposed layer). The cores' gradients accumulate in fp32 by atomic adds, or,
    under ``torch.use_deterministic_algorithms``, one program per entry stores it."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    a, cs = seconds[0].shape[2], [s.shape[0] for s in seconds]
    F, Ss = _cores(first, seconds, r)
    Ft, Sts = F.permute(0, 2, 3, 1), [S.permute(0, 3, 1, 2) for S in Ss]  # the transposed layer's cores
    gx = x.new_empty((n, b1 * b2))
    btt_fused.through_cores(grads, Sts, [Ft], [gx], r, a, b2)
    deterministic = torch.are_deterministic_algorithms_enabled()
    make = torch.empty if deterministic else torch.zeros
    dtype = x.dtype if deterministic else torch.float32
    g_first = make((b1, b2, sum(cs), r), dtype=dtype, device=x.device)
    g_seconds = [make(S.shape, dtype=dtype, device=x.device) for S in Ss]
    btt_fused.second_core_grad([x], [F], grads, g_seconds, r, b2, a, deterministic=deterministic)
    btt_fused.second_core_grad(grads, Sts, [x], [g_first.permute(0, 2, 3, 1)], r, a, b2, deterministic=deterministic)
    return ([gx, g_first.view(first.shape).to(first.dtype)]
            + [g.view(s.shape).to(s.dtype) for g, s in zip(g_seconds, seconds)])


@torch.library.custom_op("comera::btt_blocks_backward", mutates_args=())
def btt_blocks_backward(grads: list[torch.Tensor], x: torch.Tensor, ts: torch.Tensor, first: torch.Tensor,
                        seconds: list[torch.Tensor], r: int) -> list[torch.Tensor]:
    """The gradients of :func:`btt_blocks` (``grads``: one per output ``y_i``; ``ts``: what the forward
    returned after the outputs) for ``x``, ``first`` and each of ``seconds``, in that order: through the
    fused kernels where the forward's ran, else by batched GEMMs (``dT = dY_i Sᵢᵀ`` per column block,
    regrouped by a swap, ``dx = dT Fᵀ`` per row block; ``dS_i = Tᵀ dY_i``, ``dF = Xᵀ dT``), with the
    intermediate ``T`` recomputed when ``ts`` is empty."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    cs = [s.shape[0] for s in seconds]
    grads = [g.contiguous() for g in grads]
    if _fused(x, first, seconds, r):
        try:
            return _fused_backward(grads, x, first, seconds, r)
        except Exception as exc:
            _fused_failed(x, first, seconds, exc)
    if ts.numel() == 0:
        t = torch.bmm(x.view(n, b1, b2).transpose(0, 1), first)  # [b1, n, C r]
        ts = swap_blocks(t.view(b1, n, sum(cs), r)).view(sum(cs), n, b1 * r)
    gts, g_seconds, c0 = x.new_empty((sum(cs), n, b1 * r)), [], 0
    for grad, second, c in zip(grads, seconds, cs):
        gy = grad.view(n, c, second.shape[2]).transpose(0, 1)  # [c, n, a] strided
        g_seconds.append(torch.bmm(ts[c0:c0 + c].transpose(1, 2), gy))  # [c, b1 r, a]
        torch.bmm(gy, second.transpose(1, 2), out=gts[c0:c0 + c])  # [c, n, b1 r]
        c0 += c
    gt = swap_blocks(gts.view(sum(cs), n, b1, r)).view(b1, n, sum(cs) * r)
    gx = x.new_empty((n, b1, b2))
    torch.bmm(gt, first.transpose(1, 2), out=gx.transpose(0, 1))
    g_first = torch.bmm(x.view(n, b1, b2).permute(1, 2, 0), gt)  # [b1, b2, C r]
    return [gx.view(n, b1 * b2), g_first] + g_seconds


@btt_blocks_backward.register_fake
def _(grads, x, ts, first, seconds, r):
    return [torch.empty_like(x), torch.empty_like(first)] + [torch.empty_like(s) for s in seconds]


def _blocks_setup(ctx, inputs, output) -> None:
    x, first, seconds, r = inputs
    ctx.r, ctx.k = r, len(seconds)
    ctx.save_for_backward(x, output[-1], first, *seconds)  # the intermediate, or an empty tensor


def _blocks_backward(ctx, grads):
    x, ts, first, *seconds = ctx.saved_tensors
    # an output the loss does not reach may come as None: its gradient is zero
    ys = [torch.zeros(x.shape[0], s.shape[0] * s.shape[2], dtype=x.dtype, device=x.device) if g is None else g
          for g, s in zip(grads[:ctx.k], seconds)]
    gx, g_first, *g_seconds = torch.ops.comera.btt_blocks_backward(ys, x, ts, first, seconds, ctx.r)
    return gx, g_first, g_seconds, None


btt_blocks.register_autograd(_blocks_backward, setup_context=_blocks_setup)
