"""`comera::linear_cross_entropy`: the LM-head loss without materializing the logits.

Semantics are exactly ``F.cross_entropy(softcap(x @ W.T + b).float(), target, ...)`` with
``softcap(z) = c * tanh(z / c)`` when ``c > 0``. The loss (and the optional log-sum-exp) is fp32,
as eager gives for ``.float()`` logits; a caller whose model did not upcast casts it back. The bias
is in x's dtype or fp32 (an fp32 bias over 16-bit x and W is added in fp32, as eager adds it after
the upcast; its gradient is fp32).

Precision: the logits are accumulated in fp32 and never rounded to x's dtype on the tile paths. A
per-token loss is never below 0 (the lse and the target logit are formed apart and are clamped so
that their difference cannot round below zero). The gradient's per-element error against float64 is
that of eager fp32 (each recomputed logit rounds by about ``|z| * 2**-24``; every path stays within
1.5x eager's error at logits around 1e2 and 1e4 in the tests).

This module holds the op (``torch.library`` definition, fake, autograd) and the public
``linear_cross_entropy``. Its options (:class:`~comera_compile.cce.options.LCEOptions`, re-exported here)
and how it runs — the paths, the cost model that picks one per shape, the memory budget, tuning and
statistics, the observed kept fractions — are in :mod:`comera_compile.cce` (pure: no op); the drivers of
the paths in ``linear_cross_entropy_paths.py``; the Triton kernels in ``linear_cross_entropy_kernels.py``.
The names of :mod:`comera_compile.cce` this module used to re-export (``choose_strategy``,
``cce_tuning``, ``use_kept_fraction_store``, ...) still resolve here for one release, with a
``DeprecationWarning`` naming their home.

``strategy="auto"``: the public function (or the cce pass) plans a path by the cost model, and the
op, told by its ``adaptive`` option that the plan was automatic, re-decides at run time between that
path and the sparse one from the kept fraction observed on previous calls
(``comera_compile.cce.planner.runtime_strategy``): a compiled graph holds the plan as a constant,
but the decision is made in the op's implementation, outside the traced graph.

CUDA graphs: the op reads no device value on the host except in the sparse path, which is never
taken while a CUDA graph is being captured (the backward then takes a static schedule). Targets
are range-checked on the device (``torch._assert_async``, as eager's CUDA kernel asserts); on the
CPU a bad target raises eager's ``IndexError``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import torch

from comera_compile import cce
from comera_compile.cce import LCEOptions  # its home; re-exported here, where the ops take it
from .dispatch import use_triton
from .linear_cross_entropy_paths import (
    LossInputs,
    chunked,
    forward_dx_small_d,
    grad_coefs,
    recompute_backward,
    scale_,
    triton_forward,
)

__all__ = ["LCEOptions", "linear_cross_entropy"]

OP = "comera::linear_cross_entropy"


# ---------------------------------------------------------------------------------------------
# Tensor checks (shared by the public function, the op and its fake)
# ---------------------------------------------------------------------------------------------


def _check_tensors(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: x must be [N, D] and weight [V, D] with the same D, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if target.dim() != 1 or target.shape[0] != x.shape[0]:
        raise ValueError(f"linear_cross_entropy: Expected input batch_size ({x.shape[0]}) to match target "
                         f"batch_size ({target.numel()}); target must be [N], got {tuple(target.shape)}")
    if target.dtype != torch.int64:
        raise RuntimeError(f"linear_cross_entropy: target must be int64 (Long), got {target.dtype}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype not in (x.dtype, torch.float32)):
        raise RuntimeError(
            f"linear_cross_entropy: x and weight must have the same dtype and bias that dtype or float32, got "
            f"{x.dtype}, {weight.dtype}{', ' + str(bias.dtype) if bias is not None else ''}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"linear_cross_entropy: bias must be [V]={weight.shape[0]}, got {tuple(bias.shape)}")


def _check_target_range(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """A class index outside [0, V) is an error, never garbage. On the device the check is
    ``torch._assert_async`` (no host sync, capture-safe, as eager's CUDA kernel asserts); on the
    CPU the same assert fails at once and becomes eager's ``IndexError``."""
    ok = ((target == ignore_index) | ((target >= 0) & (target < vocab))).all()
    try:
        torch._assert_async(ok, "linear_cross_entropy: a target is out of bounds [0, V)")
    except RuntimeError:
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        value = int(target[bad.nonzero()[0, 0]])
        raise IndexError(f"Target {value} is out of bounds.") from None


def _budget(memory_budget: int, n_tokens: int, vocab: int) -> int:
    return memory_budget if memory_budget >= 0 else cce.default_memory_budget(n_tokens, vocab)


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s stream is being captured into a CUDA graph (where the sparse path, which reads a
    device value on the host each round, cannot run)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _reduce(nll: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    # Every row's loss is >= 0 in exact arithmetic (lse >= max_v z_v >= z_target, and label smoothing
    # only adds a cross-entropy against a distribution). The paths form the lse in a kernel and the
    # target logit apart from it, which round differently: a confident row could come out at -1e-5.
    nll = nll.clamp_min(0.0)
    if reduction == "none":
        return nll
    total = nll.sum()
    return total if reduction == "sum" else total / valid.sum()


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op(OP, mutates_args=())
def _lce_op(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
    softcap: float, ignore_index: int, label_smoothing: float, reduction: str, backward: str,
    filter_eps: float, deterministic: bool, impl: str, strategy: str = "auto", memory_budget: int = -1,
    need_dx: bool = False, need_dw: bool = False, need_db: bool = False, adaptive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32, lse fp32 [N], softcapped target logit fp32 [N], dx, dw, db); the arguments after
    the tensors are the fields of :class:`LCEOptions`, in order.

    With ``strategy="chunked"`` (and reduction "mean"/"sum") the gradients asked for by
    ``need_dx``/``need_dw``/``need_db`` are formed here, for ``grad_output = 1``; with "fused" and a
    small D (no label smoothing) dx is; the other outputs are empty and the backward recomputes.
    With ``adaptive`` (a "chunked" planned by "auto") the gradients may instead be formed here by the
    sparse rounds (:func:`_forward_path`).
    """
    o = LCEOptions.from_op_args((softcap, ignore_index, label_smoothing, reduction, backward, filter_eps,
                                 deterministic, impl, strategy, memory_budget, need_dx, need_dw, need_db,
                                 adaptive))
    _check_tensors(x, weight, target, bias)
    N, V = x.shape[0], weight.shape[0]
    target = target.contiguous()
    _check_target_range(target, V, o.ignore_index)
    triton = use_triton(x, o.impl, op=OP) and N > 0
    valid = target != o.ignore_index
    budget = _budget(o.memory_budget, N, V)
    dx = dw = db = None
    inp = LossInputs(x, weight, target, bias, o.softcap, o.ignore_index, o.label_smoothing)
    forms = o.forms_grads(x.shape[1], bias is not None)
    if any(forms) and triton and _forward_path(o, x, weight, budget) == "sparse":
        # the chunked plan's outputs, formed by sparse rounds over the lse of the forward tiles,
        # which also bound the logits (while they pay): the rounds skip the tiles the filter would drop
        bounded = cce.forward_bounds_pay(V, x.shape[1], x.dtype, o.filter_eps)
        lse, tz, nll, bounds = _triton_loss_terms(inp, o, valid, bounds=bounded)
        coefs = grad_coefs(None, None, valid, o.reduction, o.label_smoothing, V)
        dx, dw, db = recompute_backward("sparse", inp, lse, tz, coefs, o.filter_eps, budget, forms, phase="forward",
                                        bounds=bounds)
    elif o.strategy == "fused" and any(forms) and triton:
        coefs = grad_coefs(None, None, valid, o.reduction, o.label_smoothing, V)
        lse, tz, dx = forward_dx_small_d(inp, coefs)
        nll = torch.where(valid, lse - tz, torch.zeros((), device=x.device, dtype=torch.float32))
        tz = torch.where(valid, tz, 0.0)
    elif any(forms):
        coefs = grad_coefs(None, None, valid, o.reduction, o.label_smoothing, V)
        nll, lse, tz, dx, dw, db = chunked(inp, coefs, budget, triton=triton, need=forms, phase="forward")
    elif triton:
        lse, tz, nll, _ = _triton_loss_terms(inp, o, valid)
    else:
        nll, lse, tz, *_ = chunked(inp, None, budget, triton=False, phase="forward")
    return (_reduce(nll, valid, o.reduction), lse, tz, dx if dx is not None else x.new_empty((0,)),
            dw if dw is not None else weight.new_empty((0,)), db if db is not None else x.new_empty((0,)))


def _triton_loss_terms(inp: LossInputs, o: LCEOptions, valid: torch.Tensor, bounds: bool = False):
    """(lse, target logit, per-token loss) fp32 [N] over Triton logits tiles (0 at ignored rows), and
    with ``bounds`` the tiles' :class:`LogitBounds` at the filter (else None)."""
    x, V = inp.x, inp.weight.shape[0]
    lse, tz, zs, lb = triton_forward(inp, filter_eps=o.filter_eps if bounds and o.filters() else 0.0)
    nll = lse - (1.0 - o.label_smoothing) * tz
    if zs is not None:
        nll = nll - (o.label_smoothing / V) * zs
    nll = torch.where(valid, nll, torch.zeros((), device=x.device, dtype=torch.float32))
    return lse, torch.where(valid, tz, 0.0), nll, lb


def _sparse_may_run(o: LCEOptions, x: torch.Tensor) -> bool:
    """Sparse rounds may run (on the Triton paths): they can filter, need not be deterministic,
    and no CUDA graph is being captured (they sync the host)."""
    return o.filters() and not o.deterministic and not stream_capturing(x)


def _forward_path(o: LCEOptions, x: torch.Tensor, weight: torch.Tensor, budget: int) -> str:
    """:func:`comera_compile.cce.planner.forward_path` for this call, priced at its Triton paths' profile."""
    return cce.forward_path(o.strategy, o.adaptive, _sparse_may_run(o, x), x.shape[0], x.shape[1], weight.shape[0],
                            x.dtype, filter_eps=o.filter_eps, memory_budget=budget,
                            profile=cce.op_profile(x.device, triton=True))


@_lce_op.register_fake
def _lce_fake(x, weight, target, bias, *options):
    o = LCEOptions.from_op_args(options)
    _check_tensors(x, weight, target, bias)
    n = x.shape[0]
    f32 = dict(dtype=torch.float32)
    fx, fw, fb = o.forms_grads(x.shape[1], bias is not None)
    return (x.new_empty((n,) if o.reduction == "none" else (), **f32), x.new_empty((n,), **f32),
            x.new_empty((n,), **f32), x.new_empty(x.shape if fx else (0,)),
            weight.new_empty(weight.shape if fw else (0,)),
            bias.new_empty(bias.shape) if fb else x.new_empty((0,)))


def _recompute_path(o: LCEOptions, x: torch.Tensor, weight: torch.Tensor, budget: int) -> str:
    """:func:`comera_compile.cce.planner.recompute_path` for this call, priced at its Triton paths' profile."""
    return cce.recompute_path(o.strategy, o.adaptive, _sparse_may_run(o, x), x.shape[0], x.shape[1], weight.shape[0],
                              x.dtype, filter_eps=o.filter_eps, memory_budget=budget,
                              profile=cce.op_profile(x.device, triton=True))


@torch.library.custom_op("comera::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(
    grad_loss: torch.Tensor, grad_lse: Optional[torch.Tensor], x: torch.Tensor,
    weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor,
    tz: torch.Tensor, softcap: float, ignore_index: int, label_smoothing: float, reduction: str,
    backward: str, filter_eps: float, deterministic: bool, impl: str,
    need_dx: bool, need_dw: bool, need_db: bool, strategy: str = "auto", memory_budget: int = -1,
    adaptive: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) by recomputing the logits; an output that is not needed comes back empty.
    The arguments after the tensors are the fields of :class:`LCEOptions` in this schema's order
    (:meth:`LCEOptions.backward_op_args`: the gradients to form before strategy and memory_budget)."""
    o = LCEOptions.from_backward_op_args((softcap, ignore_index, label_smoothing, reduction, backward, filter_eps,
                                          deterministic, impl, need_dx, need_dw, need_db, strategy, memory_budget,
                                          adaptive))
    N, V = x.shape[0], weight.shape[0]
    target = target.contiguous()
    need_db = o.need_db and bias is not None
    valid = target != o.ignore_index
    coefs = grad_coefs(grad_loss, grad_lse, valid, o.reduction, o.label_smoothing, V)
    budget = _budget(o.memory_budget, N, V)
    inp = LossInputs(x, weight, target, bias, o.softcap, o.ignore_index, o.label_smoothing)
    need = (o.need_dx, o.need_dw, need_db)
    if use_triton(x, o.impl, op=OP) and N > 0:
        path = _recompute_path(o, x, weight, budget)
        dx, dw, db = recompute_backward(path, inp, lse, tz, coefs, o.filter_eps if o.filters() else 0.0, budget, need)
    else:
        *_, dx, dw, db = chunked(inp, coefs, budget, triton=False, need=need, phase="backward")
    return (dx if dx is not None else x.new_empty((0,)),
            dw if dw is not None else weight.new_empty((0,)),
            db if db is not None else x.new_empty((0,)))


@_lce_backward_op.register_fake
def _lce_backward_fake(grad_loss, grad_lse, x, weight, target, bias, lse, tz, *options):
    o = LCEOptions.from_backward_op_args(options)
    dx = x.new_empty(x.shape) if o.need_dx else x.new_empty((0,))
    dw = weight.new_empty(weight.shape) if o.need_dw else weight.new_empty((0,))
    db = bias.new_empty(bias.shape) if (o.need_db and bias is not None) else x.new_empty((0,))
    return dx, dw, db


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, *options = inputs
    o = LCEOptions.from_op_args(options)
    loss, lse, tz, dx, dw, db = output
    ctx.mark_non_differentiable(tz, dx, dw, db)
    ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
    ctx.save_for_backward(x, weight, target, bias, lse, tz, dx, dw, db)
    ctx.options, ctx.loss_shape = o, loss.shape
    ctx.formed = o.forms_grads(x.shape[1], bias is not None)
    # the kept-fraction store the forward ran under: the backward (which autograd may run after the
    # caller's use_kept_fraction_store block, or on another thread) observes into it. Eager only:
    # under torch.compile this runs while tracing, and the compiled backward reads the store
    # current when it runs.
    ctx.kept_store = cce.current_kept_fraction_store()


def _backward(ctx, grad_loss, grad_lse, *unused):
    with cce.pinned_kept_fraction_store(getattr(ctx, "kept_store", None)):
        return _backward_in_store(ctx, grad_loss, grad_lse)


def _backward_in_store(ctx, grad_loss, grad_lse):
    x, weight, target, bias, lse, tz, dx_f, dw_f, db_f = ctx.saved_tensors
    o: LCEOptions = ctx.options
    need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
    none = (None,) * len(_OP_FIELDS)
    if grad_loss is None and grad_lse is None:
        return (None,) * 4 + none
    needed = (need_dx, need_dw, need_db)
    if grad_lse is None and grad_loss is not None and any(ctx.formed):
        # The forward formed some gradients for grad_output = 1: scale them in place (no second
        # buffer; a second backward through the same graph then fails autograd's version check
        # instead of seeing scaled values) and recompute the others.
        formed = [f and n for f, n in zip(ctx.formed, needed)]
        _scale_op([g for g, f in zip((dx_f, dw_f, db_f), formed) if f], grad_loss, o.impl)
        missing = [n and not f for f, n in zip(formed, needed)]
        out = [g if f else None for g, f in zip((dx_f, dw_f, db_f), formed)]
        if any(missing):
            rec = _lce_backward_op(grad_loss, None, x, weight, target, bias, lse, tz,
                                   *o.with_needs(*missing).backward_op_args())
            out = [r if m else o_ for r, m, o_ in zip(rec, missing, out)]
        return (out[0], out[1], None, out[2]) + none
    if grad_loss is None:
        grad_loss = lse.new_zeros(ctx.loss_shape)
    dx, dw, db = _lce_backward_op(grad_loss, grad_lse, x, weight, target, bias, lse, tz,
                                  *o.with_needs(need_dx, need_dw, need_db).backward_op_args())
    return (dx if need_dx else None, dw if need_dw else None, None, db if need_db else None) + none


@torch.library.custom_op("comera::linear_cross_entropy_scale_", mutates_args=("grads",))
def _scale_op(grads: list[torch.Tensor], scale: torch.Tensor, impl: str) -> None:
    """grads[i] *= scale (the loss's 0-dim gradient) in place, in fp32 arithmetic: the chunked
    forward formed the gradients for grad_output = 1."""
    for g in grads:
        scale_(g, scale, triton=use_triton(g, impl, op=OP))


@_scale_op.register_fake
def _scale_fake(grads, scale, impl):
    return None


_lce_op.register_autograd(_backward, setup_context=_setup_context)


def _option_names(op, tensors: int) -> tuple[str, ...]:
    """The names of ``op``'s arguments after its first ``tensors``: exactly the fields of LCEOptions."""
    names = tuple(arg.name for arg in op._schema.arguments[tensors:])
    fields = {f.name for f in dataclasses.fields(LCEOptions)}
    if set(names) != fields or len(names) != len(fields):
        raise AssertionError(f"{op}: arguments {names} are not the fields of LCEOptions {sorted(fields)}")
    return names


# Each op's option arguments in schema order: read from the registered schemas and handed to
# LCEOptions (its op_args / from_op_args and their backward kin), so that the two cannot disagree on
# an order.
_OP_FIELDS = _option_names(torch.ops.comera.linear_cross_entropy.default, 4)
_BACKWARD_OP_FIELDS = _option_names(torch.ops.comera.linear_cross_entropy_backward.default, 8)
cce.set_op_field_orders(_OP_FIELDS, _BACKWARD_OP_FIELDS)


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
    strategy: str = "auto",
    memory_budget: Optional[int] = None,
    impl: str = "auto",
):
    """``F.cross_entropy(softcap(x @ weight.T + bias).float(), target, ...)`` without the logits.

    x [N, D], weight [V, D] (any strides: a transposed view works), target [N] (int64), bias [V] or
    None. The loss is fp32 (a scalar for ``reduction`` "mean"/"sum", [N] for "none");
    ``return_lse=True`` also returns the fp32 log-sum-exp [N] (differentiable, for z-loss).

    * ``backward``: "filtered" lets the sparse path skip gradient tiles whose softmax stays below
      ``filter_eps`` (default: dtype eps / 32, 2**-12 for bf16); "exact" skips nothing. The other
      paths compute the exact gradient either way.
    * ``strategy``: "auto" (the fastest path by the cost model of what runs, at the profile
      ``comera_compile.cce.op_profile`` gives: the Triton paths at the GPU's,
      ``comera_compile.devices.H200``, the torch reference at the CPU's, ``comera_compile.devices.CPU``),
      "chunked", "sparse", "static" or
      "fused" (see :mod:`comera_compile.cce.planner`); a path that does not apply falls back to one
      that does (e.g. "sparse" under CUDA-graph capture runs "static").
      The sparse path's cost depends on how peaked the logits are: "auto" prices it at the fraction
      of gradient tiles that the sparse path kept on previous calls of the same shape class
      (vocabulary, hidden size, dtype, ``filter_eps``; a running average), or at a flat softmax's
      (an untrained head) before any, and re-decides when the op runs, so a compiled graph follows
      the observations too. Where sparse rounds may run (filtered, not deterministic, not under
      CUDA-graph capture, the Triton paths) "auto" runs them as a probe on the first call of a shape
      class and after ``CCETuning.probe_every`` (default 50) calls without them, to keep the
      observation current. ``comera_compile.cce.kept_fractions()`` shows the observations (a
      ``KeptFraction`` per ``ShapeClass``), ``reset_kept_fractions()`` forgets them (e.g. between two
      models); a pinned strategy neither probes nor follows them (a sparse run still reports what it
      kept). The observations live in the current ``KeptFractionStore``: the caller's own within a
      ``use_kept_fraction_store(store)`` block in its context (thread), one store per model so that
      no call sees another model's; outside any block, the default store, which every such call in
      the process shares.
    * ``memory_budget``: bytes of working memory beyond the inputs and gradients (default: 1/16 of
      the fp32 logits, at least 64 MiB); more memory buys larger chunks.
    * ``deterministic=True``: bitwise repeatable gradients (never the sparse path).
    * ``impl``: "auto" (Triton on CUDA tensors, or under TRITON_INTERPRET=1 with
      COMERA_FORCE_TRITON=1; else the torch reference), "triton", "torch".
    """
    options = LCEOptions(softcap=softcap, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         reduction=reduction, backward=backward, filter_eps=filter_eps,
                         deterministic=deterministic, impl=impl, strategy=strategy, memory_budget=memory_budget)
    _check_tensors(x, weight, target, bias)
    options = options.resolve(x.dtype)
    grad = torch.is_grad_enabled()
    need = (grad and x.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    if options.strategy == "auto":
        # the plan (it fixes the op's outputs); the op re-decides at run time (adaptive)
        options = dataclasses.replace(options, adaptive=True)
        if any(need) and isinstance(x.shape[0], int):
            profile = cce.op_profile(x.device, triton=use_triton(x, options.impl, op=OP))
            best = cce.choose_strategy(x.shape[0], x.shape[1], weight.shape[0], x.dtype, lse_grad=return_lse,
                                       profile=profile, **options.cost_model_args())
            options = dataclasses.replace(options, strategy=cce.adaptive_plan(
                best, x.dtype, reduction=options.reduction, lse_grad=return_lse))
    options = options.with_needs(*need)
    loss, lse, *_ = torch.ops.comera.linear_cross_entropy(x, weight, target, bias, *options.op_args())
    return (loss, lse) if return_lse else loss


# The names of comera_compile.cce this module re-exported before they moved there: each still resolves
# here, to the same object, with a DeprecationWarning (module __getattr__). The module itself reaches
# them as cce.<name>.
_MOVED = frozenset({
    "BACKWARDS", "FORWARD_DX_MAX_D", "REDUCTIONS", "STRATEGIES", "CCEStats", "CCETuning", "FusedLossDecision",
    "KeptFractionStore", "adaptive_plan", "cce_tuning", "choose_strategy", "current_kept_fraction_store",
    "decide_fused_loss", "default_filter_eps", "default_memory_budget", "describe_logits", "forward_bounds_pay",
    "forward_path", "fused_loss_pays", "kept_fractions", "logits_bytes", "pinned_kept_fraction_store", "rates_for",
    "recompute_path", "record_cce_stats", "reset_kept_fractions", "use_kept_fraction_store",
})


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`comera_compile.cce`, with a DeprecationWarning naming their home."""
    if name in _MOVED:
        warnings.warn(f"comera_compile.kernels.linear_cross_entropy.{name} is deprecated and will be removed in the "
                      f"next release: it moved to comera_compile.cce (from comera_compile.cce import {name})",
                      DeprecationWarning, stacklevel=2)
        return getattr(cce, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
