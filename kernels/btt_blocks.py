"""``comera::btt_blocks``: a block tensor-train's blocks path, its two batched GEMMs and the regrouping
between them as one op, with its backward op ``comera::btt_blocks_backward``.

The blocks path of a ``"btt"`` layer (:func:`comera_compile.kernels.tt_runtime.btt_linear`) runs one
batched GEMM per row block and one per column block. The GEMMs read the token-major input and write each
token-major output in place (strided batches, no copy); between them the intermediate ``T [b1, n, C, r]``
becomes ``[C, n, b1, r]`` through :func:`~comera_compile.kernels.btt_swap.swap_blocks` (the op
``comera::btt_swap``, in its own module). Layers that read one input run as one call, their first cores
concatenated along the column blocks, each output its own tensor. The backward saves only what the
gradients asked for read; in eager mode the intermediate is kept while it is no larger than the input
(times ``COMERA_BTT_KEEP``, default 1: :func:`keep_ratio`) and recomputed otherwise. Under
``torch.compile`` it is always kept: AOTAutograd's common-subexpression elimination merges the backward's
recomputing call with the forward's (the same op on the same inputs), and the partitioner then saves its
output.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Iterator, Optional

import torch

from comera_compile._scope import scoped
from comera_compile.kernels.btt_swap import swap_blocks
from comera_compile.kernels.dispatch import env_number

__all__ = ["BlocksImpl", "btt_blocks", "btt_blocks_backward", "current_impl", "keep_ratio", "use_impl"]

KEEP_ENV = "COMERA_BTT_KEEP"
DEFAULT_KEEP = 1.0


def keep_ratio() -> float:
    """How large an intermediate the op keeps for its backward, as a multiple of its input's entries:
    ``COMERA_BTT_KEEP`` (a number >= 0, or ``inf``: always; ``0``: never), else :data:`DEFAULT_KEEP` (1: no
    activation larger than the input is saved). Read where the op's autograd is set up, at each call. It
    bounds eager mode's saved activations only: under ``torch.compile`` the backward's recompute is merged
    with the forward's op and the intermediate is saved whatever the setting (the same step time and peak
    memory at d 2048 with 1 and ``inf``)."""
    return env_number(KEEP_ENV, DEFAULT_KEEP, "the kept intermediate's size as a multiple of the input's; 0: "
                      "never kept, inf: always")


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
    """The implementation ``comera::btt_blocks`` calls: ``blocks_forward(x, first, seconds, r) -> (ys,
    ts)``, the op's body. The default (``BlocksImpl()``) holds this module's own; swap one in for a scope
    with :func:`use_impl`. (The swap kernel the body runs between its GEMMs is
    :mod:`comera_compile.kernels.btt_swap`'s seam.)"""

    blocks_forward: Callable[..., tuple[list[torch.Tensor], torch.Tensor]] = _blocks_forward


_IMPL: contextvars.ContextVar[BlocksImpl] = contextvars.ContextVar("comera_btt_blocks_impl", default=BlocksImpl())


def current_impl() -> BlocksImpl:
    """The :class:`BlocksImpl` the op calls now: the default, or the one of the innermost
    :func:`use_impl` block."""
    return _IMPL.get()


@contextlib.contextmanager
def use_impl(*, blocks_forward: Optional[Callable[..., tuple[list[torch.Tensor], torch.Tensor]]] = None
             ) -> Iterator[BlocksImpl]:
    """Within the block, ``comera::btt_blocks`` calls ``blocks_forward`` in place of the current one (not
    given: it stays); yields the :class:`BlocksImpl` in use. Scoped: on exit the previous one is back,
    whatever the block raised. It is a context variable, so it holds for calls made in this thread (and
    context) only: an autograd backward that the engine runs on a device thread (CUDA) calls the default.
    To wrap the current implementation, read it before the block (``forward =
    current_impl().blocks_forward``) and call that from the wrapper."""
    changes = {"blocks_forward": blocks_forward} if blocks_forward is not None else {}
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
    arrives on its own (a split of one wide output would make the backward concatenate them, a copy)."""
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
    larger activation in eager mode (``COMERA_BTT_KEEP`` moves the bound: :func:`keep_ratio`; under
    ``torch.compile`` the recompute is merged with the forward's op, so the intermediate is saved). The
    second cores are saved whenever any gradient is asked for."""
    x, first, seconds, r = inputs
    ts = output[-1]
    ctx.r, ctx.n = r, x.shape[0]
    ratio = keep_ratio()
    ctx.keep = math.isinf(ratio) or ts.numel() <= ratio * x.numel()
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
