"""``comera::btt_swap``, ``x [A, M, B, K] -> [B, M, A, K]`` (the first and third axes swapped): the
regrouping copy between the two batched GEMMs of a block tensor-train's blocks path
(``comera::btt_blocks``, :mod:`comera_compile.kernels.btt_blocks`).

Between those GEMMs the intermediate ``T [b1, n, c, r]`` must become ``[c, n, b1, r]``. As a plain
``permute().contiguous()`` that copy has a tiny contiguous axis on one side (``r`` elements, often 1), so
every element is its own memory transaction. The Triton kernel here copies tiles
``[BLOCK_A, BLOCK_B, BLOCK_K]``: each load reads rows of ``BLOCK_B * K`` contiguous elements and each
store writes rows of ``BLOCK_A * K``, the transpose done on chip, so both sides are coalesced. Where the
moved rows are single elements (rank 1, or ranks whose ``K`` elements widen to one integer), a second
kernel takes tiles of several consecutive positions ``m`` (``COMERA_BTT_SWAP_TILE`` bytes, :func:`default_tile`),
so that its loads and stores run over ``BLOCK_M * B`` and ``BLOCK_M * A`` contiguous elements.

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
from comera_compile.kernels.dispatch import HAS_TRITON, env_number, use_triton

__all__ = ["SwapImpl", "btt_swap", "current_impl", "default_tile", "swap_blocks", "token_tiles", "use_impl",
           "widened"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _program_tile(A, B, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        # this program's (A, B) tile, A-major, and the index over the third dimension (positions or tiles of them)
        n_b = tl.cdiv(B, BLOCK_B)
        tiles = tl.cdiv(A, BLOCK_A) * n_b
        pid = tl.program_id(0).to(tl.int64)
        outer = pid // tiles
        pid = pid % tiles
        oa = ((pid // n_b) * BLOCK_A + tl.arange(0, BLOCK_A)).to(tl.int64)
        ob = ((pid % n_b) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
        return outer, oa, ob


    @triton.jit
    def _swap_kernel(x_ptr, y_ptr, A, M, B, K, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        m, oa, ob = _program_tile(A, B, BLOCK_A, BLOCK_B)
        a3 = oa[:, None, None]
        b3 = ob[None, :, None]
        for k0 in range(0, K, BLOCK_K):
            k3 = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)[None, None, :]
            mask = (a3 < A) & (b3 < B) & (k3 < K)
            tile = tl.load(x_ptr + ((a3 * M + m) * B + b3) * K + k3, mask=mask)
            tl.store(y_ptr + ((b3 * M + m) * A + a3) * K + k3, tile, mask=mask)


    @triton.jit
    def _swap_tokens_kernel(x_ptr, y_ptr, A, M, B, BLOCK_A: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_B: tl.constexpr):
        # K = 1: x [A, M, B] -> y [B, M, A], a tile of BLOCK_M consecutive positions m per program, so that
        # where the tile spans all of B (of A) each load (store) row is BLOCK_M x B (x A) contiguous elements
        pm, oa, ob = _program_tile(A, B, BLOCK_A, BLOCK_B)
        om = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        a3 = oa[:, None, None]
        m3 = om[None, :, None]
        b3 = ob[None, None, :]
        mask = (a3 < A) & (m3 < M) & (b3 < B)
        tile = tl.load(x_ptr + (a3 * M + m3) * B + b3, mask=mask)
        tl.store(y_ptr + (b3 * M + m3) * A + a3, tile, mask=mask)


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


def token_tiles(a: int, b: int, tile: int, itemsize: int = 2) -> tuple[int, int, int]:
    """``(BLOCK_A, BLOCK_M, BLOCK_B)`` of the token-tiled swap (``K = 1``): ``A`` and ``B`` whole up to 128
    (padded to a power of two), then as many positions ``m`` as keep the tile at about ``tile`` bytes of
    ``itemsize``-byte elements."""
    ba = min(triton.next_power_of_2(max(a, 1)), 128)
    bb = min(triton.next_power_of_2(max(b, 1)), 128)
    return ba, max(1, triton.next_power_of_2(max(tile // (itemsize * ba * bb), 1))), bb


TILE_ENV = "COMERA_BTT_SWAP_TILE"
DEFAULT_TILE = 0  # 0: one position m a program


def default_tile() -> int:
    """The swap's tile when the call names none: ``COMERA_BTT_SWAP_TILE`` (bytes; 0: one position ``m`` a
    program, the ``[BLOCK_A, BLOCK_B, BLOCK_K]`` kernel), else :data:`DEFAULT_TILE`. Read at each call."""
    return env_number(TILE_ENV, DEFAULT_TILE, "bytes; 0: one position a program, e.g. 32768: tiles of about "
                      "that many bytes", cast=int)


def token_warps(tile: int) -> int:
    """The token-tiled kernel's warps where the call names none: 4 up to 16 KiB a tile, 8 above."""
    return 4 if tile <= 16384 else 8


def _swap_triton(x: torch.Tensor, widen: bool = True, tile: Optional[int] = None,
                 num_warps: Optional[int] = None) -> torch.Tensor:
    """The Triton swap of a contiguous ``x``. ``tile`` (bytes, e.g. 32768; not given:
    :func:`default_tile`), where the moved rows are single elements (``K = 1`` after widening): the
    token-tiled kernel, each program a tile of several positions ``m`` (:func:`token_tiles`); ``0`` (and
    ``K > 1``): the ``[BLOCK_A, BLOCK_B, BLOCK_K]`` kernel, one ``m`` a program. ``num_warps``: Triton's
    launch option (default: Triton's 4, and :func:`token_warps` for the token-tiled kernel)."""
    tile = default_tile() if tile is None else tile
    src = widened(x) if widen else x
    A, M, B, K = src.shape
    y = src.new_empty((B, M, A, K))
    if y.numel() == 0:
        return y.view(x.dtype)
    launch = {} if num_warps is None else {"num_warps": num_warps}
    if tile > 0 and K == 1:
        launch.setdefault("num_warps", token_warps(tile))
        ba, bm, bb = token_tiles(A, B, tile, src.element_size())
        grid = (triton.cdiv(A, ba) * triton.cdiv(B, bb) * triton.cdiv(M, bm),)
        _swap_tokens_kernel[grid](src, y, A, M, B, BLOCK_A=ba, BLOCK_M=bm, BLOCK_B=bb, **launch)
        return y.view(x.dtype)
    ba, bb, bk = _blocks(K)
    grid = (triton.cdiv(A, ba) * triton.cdiv(B, bb) * M,)
    _swap_kernel[grid](src, y, A, M, B, K, BLOCK_A=ba, BLOCK_B=bb, BLOCK_K=bk, **launch)
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


@dataclasses.dataclass(frozen=True)
class SwapImpl:
    """The implementation :func:`swap_blocks` calls where it takes the kernel: ``swap_kernel(x, widen)``,
    the Triton swap of a contiguous ``x [A, M, B, K]``. The default (``SwapImpl()``) holds this module's
    own; swap one in for a scope with :func:`use_impl`."""

    swap_kernel: Callable[..., torch.Tensor] = _swap_triton


_IMPL: contextvars.ContextVar[SwapImpl] = contextvars.ContextVar("comera_btt_swap_impl", default=SwapImpl())


def current_impl() -> SwapImpl:
    """The :class:`SwapImpl` the op calls now: the default, or the one of the innermost :func:`use_impl`
    block."""
    return _IMPL.get()


@contextlib.contextmanager
def use_impl(*, swap_kernel: Optional[Callable[..., torch.Tensor]] = None) -> Iterator[SwapImpl]:
    """Within the block, :func:`swap_blocks` calls ``swap_kernel`` in place of the current one (not given:
    it stays); yields the :class:`SwapImpl` in use. Scoped: on exit the previous one is back, whatever
    the block raised. It is a context variable, so it holds for calls made in this thread (and context)
    only: an autograd backward that the engine runs on a device thread (CUDA) calls the default. To wrap
    the current implementation, read it before the block (``kernel = current_impl().swap_kernel``) and
    call that from the wrapper."""
    changes = {"swap_kernel": swap_kernel} if swap_kernel is not None else {}
    with scoped(_IMPL, dataclasses.replace(current_impl(), **changes)) as impl:
        yield impl
