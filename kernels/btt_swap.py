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

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Optional

import torch

from comera_compile._scope import scoped
from comera_compile.kernels.dispatch import HAS_TRITON, use_triton

__all__ = ["BlocksImpl", "btt_blocks", "btt_blocks_backward", "btt_swap", "current_impl", "swap_blocks", "use_impl", "widened"]

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


def widened(x: torch.Tensor) -> torch.Tensor:
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
    src = widened(x) if widen else x
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
    ``"triton"``) or ``permute(2, 1, 0, 3).contiguous()`` (``"torch"``, and ``"auto"`` on the CPU). A
    kernel that fails to build or launch raises, under ``"auto"`` too: no call changes what a later
    call runs. ``widen``
    (default): the kernel moves the ``K`` elements of each position as wider integers where ``K`` x
    the element size is a multiple of 4 or 8 bytes (the same bytes, so the same result)."""
    if x.dim() != 4:
        raise ValueError(f"btt_swap: expected a 4-D tensor [A, M, B, K], got shape {tuple(x.shape)}")
    if use_triton(x, impl, op="btt_swap"):
        # Whether Triton runs is decided by use_triton (the install, the device, impl=), never by an
        # earlier call's failure: a kernel that fails raises, here and at every call.
        return current_impl().swap_kernel(x.contiguous(), widen)
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


def _blocks_forward(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int):
    """The outputs ``y_i [n, c_i a_i]`` (one per second core ``[c_i, b1 r, a_i]``) and the regrouped
    intermediate ``[C, n, b1 r]`` (``C = sum c_i``; kept for the backward), all contiguous."""
    n = x.shape[0]
    b1, b2 = first.shape[0], first.shape[1]
    cs = [s.shape[0] for s in seconds]
    # the token-major input read in place as [b1, n, b2] (a strided batch; no copy)
    t = torch.bmm(x.contiguous().view(n, b1, b2).transpose(0, 1), first)  # [b1, n, C r]
    ts = swap_blocks(t.view(b1, n, sum(cs), r)).view(sum(cs), n, b1 * r)
    ys, c0 = [], 0
    for second, c in zip(seconds, cs):
        y = x.new_empty((n, c, second.shape[2]))
        torch.bmm(ts[c0:c0 + c], second, out=y.transpose(0, 1))  # written token-major in place ([c, n, a] strided)
        ys.append(y.view(n, c * second.shape[2]))  # sizes spelled out: no -1, which zero tokens leave ambiguous
        c0 += c
    return ys, ts


@dataclasses.dataclass(frozen=True)
class BlocksImpl:
    """The implementations the ops of this module call: ``swap_kernel(x, widen)``, the Triton swap of a
    contiguous ``x [A, M, B, K]`` (what :func:`swap_blocks` runs where it takes the kernel), and
    ``blocks_forward(x, first, seconds, r) -> (ys, ts)``, the body of ``comera::btt_blocks``. The
    default (``BlocksImpl()``) holds this module's own; swap one in for a scope with :func:`use_impl`."""

    swap_kernel: Callable[..., torch.Tensor] = _swap_triton
    blocks_forward: Callable[..., tuple[list[torch.Tensor], torch.Tensor]] = _blocks_forward


_IMPL: contextvars.ContextVar[BlocksImpl] = contextvars.ContextVar("comera_btt_impl", default=BlocksImpl())


def current_impl() -> BlocksImpl:
    """The :class:`BlocksImpl` the ops call now: the default, or the one of the innermost
    :func:`use_impl` block."""
    return _IMPL.get()


@contextlib.contextmanager
def use_impl(*, swap_kernel: Optional[Callable[..., torch.Tensor]] = None,
             blocks_forward: Optional[Callable[..., tuple[list[torch.Tensor], torch.Tensor]]] = None
             ) -> Iterator[BlocksImpl]:
    """Within the block, the ops call ``swap_kernel`` / ``blocks_forward`` in place of the current ones
    (those not given stay); yields the :class:`BlocksImpl` in use. Scoped: on exit the previous one
    is back, whatever the block raised. It is a context variable, so it holds for calls made in this
    thread (and context) only: an autograd backward that the engine runs on a device thread (CUDA)
    calls the default. To wrap the current implementation, read it before the block
    (``kernel = current_impl().swap_kernel``) and call that from the wrapper."""
    changes = {k: v for k, v in (("swap_kernel", swap_kernel), ("blocks_forward", blocks_forward)) if v is not None}
    with scoped(_IMPL, dataclasses.replace(current_impl(), **changes)) as impl:
        yield impl


@torch.library.custom_op("comera::btt_blocks", mutates_args=())
def btt_blocks(x: torch.Tensor, first: torch.Tensor, seconds: list[torch.Tensor], r: int) -> list[torch.Tensor]:
    """``x [n, b1 b2] -> y_i [n, c_i a_i]`` through block tensor-trains that share their first core
    ``first`` [b1, b2, C r] (row block ``j``: ``x[:, j] @ first[j]``; ``C = sum c_i``) and each have a
    second core ``seconds[i]`` [c_i, b1 r, a_i] (its column blocks; one layer: one second core; layers
    reading one input: their first cores concatenated along the column blocks), as one op: the GEMMs
    read the token-major input and write each token-major output in place (strided batches, no copy);
    the one regrouping between them is :func:`swap_blocks`. Returns the outputs, then the regrouped
    intermediate ``[C, n, b1 r]``, which the backward (``comera::btt_blocks_backward``, run the same
    way) reads; every result is contiguous, whatever the inputs' strides (``x`` is read contiguous; the
    cores may be any views), and ``n`` may be 0. Each output is its own tensor, so each output's gradient
    arrives on its own: a split of one wide output made the backward concatenate them, and at d 4096 on
    an H200 that copy, with the RoPE backward fused into it, took 1.16 ms a layer, where the dense
    model's RoPE-backward kernels take 0.37 ms."""
    ys, ts = current_impl().blocks_forward(x, first, seconds, r)
    return ys + [ts]


@btt_blocks.register_fake
def _(x, first, seconds, r):
    n, b1 = x.shape[0], first.shape[0]
    cs = sum(s.shape[0] for s in seconds)
    return [x.new_empty((n, s.shape[0] * s.shape[2])) for s in seconds] + [x.new_empty((cs, n, b1 * r))]


@torch.library.custom_op("comera::btt_blocks_backward", mutates_args=())
def btt_blocks_backward(grads: list[torch.Tensor], x: Optional[torch.Tensor], ts: Optional[torch.Tensor],
                        first: Optional[torch.Tensor], seconds: list[torch.Tensor], r: int) -> list[torch.Tensor]:
    """The gradients of :func:`btt_blocks` (``grads``: one per output ``y_i``), each computed only where
    the tensor it reads is given: ``x``'s (it reads ``first``), then ``first``'s (it reads ``x``), then
    one per second core (they read the intermediate ``ts``), in that order; all contiguous."""
    n, cs = grads[0].shape[0], [s.shape[0] for s in seconds]
    gys = [g.contiguous().view(n, c, s.shape[2]).transpose(0, 1) for g, s, c in zip(grads, seconds, cs)]  # [c, n, a]
    out = []
    if x is not None or first is not None:
        gt = _grad_intermediate(gys, seconds, r)  # [b1, n, C r]
        if first is not None:
            b1, b2 = first.shape[0], first.shape[1]
            gx = gt.new_empty((n, b1, b2))
            torch.bmm(gt, first.transpose(1, 2), out=gx.transpose(0, 1))
            out.append(gx.view(n, b1 * b2))
        if x is not None:
            b1 = gt.shape[0]
            out.append(torch.bmm(x.reshape(n, b1, x.shape[1] // b1).permute(1, 2, 0), gt))  # [b1, b2, C r]
    if ts is not None:
        out += [torch.bmm(t.transpose(1, 2), gy) for t, gy in zip(ts.split(cs), gys)]  # [c, b1 r, a]
    return out


def _grad_intermediate(gys: list[torch.Tensor], seconds: list[torch.Tensor], r: int) -> torch.Tensor:
    """The gradient of the intermediate before its regrouping, ``[b1, n, C r]``, from the outputs'
    gradients ``gys[i]`` [c_i, n, a_i] (strided views) through the second cores."""
    c_all, n, b1 = sum(s.shape[0] for s in seconds), gys[0].shape[1], seconds[0].shape[1] // r
    gts, c0 = gys[0].new_empty((c_all, n, b1 * r)), 0
    for gy, second in zip(gys, seconds):
        torch.bmm(gy, second.transpose(1, 2), out=gts[c0:c0 + second.shape[0]])  # [c, n, b1 r]
        c0 += second.shape[0]
    return swap_blocks(gts.view(c_all, n, b1, r)).view(b1, n, c_all * r)


@btt_blocks_backward.register_fake
def _(grads, x, ts, first, seconds, r):
    n, c_all, b1 = grads[0].shape[0], sum(s.shape[0] for s in seconds), seconds[0].shape[1] // r
    out = []
    if first is not None:
        out.append(grads[0].new_empty((n, first.shape[0] * first.shape[1])))
    if x is not None:
        out.append(grads[0].new_empty((b1, x.shape[1] // b1, c_all * r)))
    if ts is not None:
        out += [grads[0].new_empty(s.shape) for s in seconds]  # contiguous, as the real op's: never empty_like
    return out


def _blocks_setup(ctx, inputs, output) -> None:
    """Save only what the gradients asked for read (an input not saved may be written in place after
    the op, as after eager's Linear): ``x`` for the first core's gradient, the first core for ``x``'s,
    the intermediate for the second cores'. The intermediate has C r / b2 times the input's entries:
    kept while no larger than the input (rank 1 with C <= b2), else recomputed in the backward from
    ``x`` and the first core (one batched GEMM and one swap), so that a rank-r layer saves no r-times-
    larger activation. The second cores are saved whenever any gradient is asked for."""
    x, first, seconds, r = inputs
    ts = output[-1]
    ctx.r, ctx.n = r, x.shape[0]
    ctx.keep = ts.numel() <= x.numel()
    want_x, want_first, want_seconds = x.requires_grad, first.requires_grad, any(s.requires_grad for s in seconds)
    recompute = want_seconds and not ctx.keep
    ctx.save_for_backward(x if want_first or recompute else None, ts if want_seconds and ctx.keep else None,
                          first if want_x or recompute else None, *seconds)


def _blocks_backward(ctx, grads):
    x, ts, first, *seconds = ctx.saved_tensors
    want_x, want_first, want_seconds = ctx.needs_input_grad[:3]
    if any(want_seconds) and ts is None:
        ts = torch.ops.comera.btt_blocks(x, first, seconds, ctx.r)[-1]
    # an output the loss does not reach may come as None: its gradient is zero
    ys = [seconds[0].new_zeros((ctx.n, s.shape[0] * s.shape[2])) if g is None else g
          for g, s in zip(grads[:len(seconds)], seconds)]
    out = iter(torch.ops.comera.btt_blocks_backward(ys, x if want_first else None, ts if any(want_seconds) else None,
                                                    first if want_x else None, seconds, ctx.r))
    gx = next(out) if want_x else None
    g_first = next(out) if want_first else None
    g_seconds = [next(out) if any(want_seconds) else None for _ in seconds]
    return gx, g_first, [g if want else None for g, want in zip(g_seconds, want_seconds)], None


btt_blocks.register_autograd(_blocks_backward, setup_context=_blocks_setup)
