"""The fused LM-head loss for trainers that keep the head apart from the loss (torchtitan's shape).

A trainer such as torchtitan runs the model without its LM head (``_skip_lm_head``) and hands the
hidden states to a loss object, ``loss_fn(pred, labels, global_valid_tokens) -> (loss, metrics)``,
which owns the head (``loss_fn.set_lm_head(model.lm_head)``). The head and the cross-entropy never
meet in one compiled graph, so the comera backend's ``cce`` pass cannot fuse them.
:class:`FusedLinearCrossEntropyLoss` is that loss object built on
:func:`comera_compile.linear_cross_entropy`: the ``[N, V]`` logits are never formed (the op works
a chunk of tokens at a time inside its memory budget, see the op's ``memory_budget``).

It follows torchtitan's ``ChunkedLossWrapper`` (torchtitan 0.3.0) call for call:

* **the loss value**: the sum of the per-token cross-entropies over the tokens whose label is not
  ``ignore_index`` (-100), divided by ``global_valid_tokens`` when it is given (torchtitan passes the
  number of valid labels of the whole step: every microbatch of every data-parallel rank), else the
  sum. The losses of a step's microbatches then add up to the mean over the step's valid tokens, and
  their gradients to the gradient of one batch holding them all.
* **the backward of the head runs inside the call**: the hidden states are detached, the head's
  loss is differentiated right away (the head weight's gradient is accumulated, and reduce-scattered
  by FSDP2), and the returned loss carries the hidden states' gradient into the trainer's own
  ``loss.backward()``, which runs the decoder's backward. Under ``torch.no_grad()`` or for
  hidden states that do not require grad (validation) only the forward runs.
* **FSDP2** (``fully_shard``): the head is called as a module, so FSDP's hooks run as for
  ``lm_head(h)``; reshard-after-forward/backward are turned off around the call (and restored after
  it) and the head is unsharded once before it and resharded after it, as torchtitan's wrapper does
  (one all-gather of the head per call at most, none when the head's FSDP group is still unsharded
  from the forward; such a group is left unsharded for the decoder's backward, see
  ``_unsharded_once``).

The head is any module with a ``weight`` of shape ``[V, D]`` and an optional ``bias`` (``nn.Linear``,
torchtitan's ``Linear``). A head whose weight is a ``DTensor`` once unsharded (tensor parallel,
loss parallel) is not supported: that needs a vocabulary-parallel fused loss.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch
from torch import nn

from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy

__all__ = ["IGNORE_INDEX", "FusedLinearCrossEntropyLoss"]

IGNORE_INDEX = -100  # torch's and torchtitan's default ignore index


def _fsdp_module_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return None
    return FSDPModule


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


class FusedLinearCrossEntropyLoss:
    """``loss_fn(pred, labels, global_valid_tokens=None) -> (loss, {})`` over the LM head, fused.

    ``pred``: the hidden states ``[..., D]`` (the model's output before its head); ``labels``: the
    targets ``[...]`` (int64, ``ignore_index`` for none). ``lm_head`` (or :meth:`set_lm_head`): the
    head module. ``memory_budget``, ``strategy``, ``softcap``, ``label_smoothing``, ``backward``,
    ``filter_eps``, ``deterministic`` and ``impl`` go to :func:`comera_compile.linear_cross_entropy`
    unchanged.

    The returned loss is an fp32 scalar: the summed cross-entropy of the valid tokens divided by
    ``global_valid_tokens`` (a number or a 0-d tensor) when given, else the sum. In training it
    requires grad, and its backward sends ``grad_output`` times the hidden states' gradient into the
    model; the head's gradient is already accumulated when the call returns.
    """

    def __init__(self, lm_head: Optional[nn.Module] = None, *, ignore_index: int = IGNORE_INDEX,
                 **lce_options: Any) -> None:
        allowed = {"softcap", "label_smoothing", "backward", "filter_eps", "deterministic", "strategy",
                   "memory_budget", "impl"}
        unknown = sorted(set(lce_options) - allowed)
        if unknown:
            raise TypeError(f"FusedLinearCrossEntropyLoss: unknown option(s) {unknown}; the options of "
                            f"linear_cross_entropy it passes on are {sorted(allowed)}")
        self.lm_head = lm_head
        self.ignore_index = int(ignore_index)
        self.lce_options = dict(lce_options)

    def set_lm_head(self, lm_head: nn.Module) -> None:
        """Set the head module (torchtitan's trainer calls this with ``model.lm_head``)."""
        self.lm_head = lm_head

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | float | None = None,
                 **loss_inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del loss_inputs  # per-token extras (torchtitan's positions) do not change a cross-entropy
        head = self.lm_head
        if head is None:
            raise RuntimeError("FusedLinearCrossEntropyLoss: no LM head; call set_lm_head(model.lm_head) first "
                               "(torchtitan's trainer does that for a ChunkedLossWrapper subclass)")
        if _is_dtensor(pred) or _is_dtensor(labels):
            raise NotImplementedError("FusedLinearCrossEntropyLoss: hidden states or labels are DTensors (tensor, "
                                      "sequence or context parallel with full DTensors); it supports data parallel "
                                      "(FSDP2, DDP) and one device only")
        if pred.shape[:-1] != labels.shape:
            raise ValueError(f"FusedLinearCrossEntropyLoss: pred {tuple(pred.shape)} must be labels' shape "
                             f"{tuple(labels.shape)} plus the hidden size")
        training = torch.is_grad_enabled() and pred.requires_grad
        hidden = pred.detach().reshape(-1, pred.shape[-1]).requires_grad_(training)
        target = labels.reshape(-1)
        if target.dtype != torch.int64:
            target = target.long()
        fsdp_cls = _fsdp_module_class()
        fsdp = fsdp_cls is not None and isinstance(head, fsdp_cls)
        with _unsharded_once(head, fsdp):
            loss = _call_fused(head, hidden, target, self.ignore_index, self.lce_options)
            if global_valid_tokens is not None:
                loss = loss / global_valid_tokens
            if training:
                loss.backward()
        loss = loss.detach()
        if not training:
            return loss, {}
        grad = hidden.grad
        if grad is None:  # no token was valid and nothing flowed back
            grad = torch.zeros_like(hidden)
        return _HiddenGrad.apply(pred, grad.view(pred.shape).to(pred.dtype), loss), {}


@contextlib.contextmanager
def _unsharded_once(head: nn.Module, fsdp: bool):
    """FSDP2: keep the head unsharded for the whole call (one all-gather at most), then put the head's
    FSDP unit back as it was: its reshard-after-forward/backward settings restored, and resharded
    unless it was already unsharded when the call began.

    An FSDP unit unsharded on entry (one that holds more than the head, e.g. torchtitan's
    ``fully_shard([norm, lm_head], reshard_after_forward=False)``) is left unsharded: the decoder's
    backward still reads the other modules' unsharded weights, and torch 2.11's FSDP2 registers no
    pre-backward unshard for them (its grouped forward hooks run the unit's post-forward only once
    every module of the unit has run, and here the head runs apart from the model's forward;
    torch 2.13's completes such a unit at the root's post-forward). Resharding it would free the
    weight the norm's backward reads ("its data is not allocated yet"). FSDP reshards it at the end
    of that backward, as it would have without the fused loss.
    """
    if not fsdp:
        yield
        return
    restore = _fsdp_settings(head)
    head.set_reshard_after_forward(False, recurse=False)
    head.set_reshard_after_backward(False, recurse=False)
    head.unshard()
    try:
        yield
    finally:
        if restore is None:  # an FSDP2 whose internals are not the ones known here: the defaults
            head.set_reshard_after_forward(True, recurse=False)
            head.set_reshard_after_backward(True, recurse=False)
            head.reshard()
        elif not restore():
            head.reshard()


def _fsdp_settings(head: nn.Module):
    """A function restoring the head's FSDP unit's reshard settings and returning whether the unit
    was unsharded now; ``None`` where FSDP2's (private) state is not the one of torch 2.11-2.13."""
    state = head._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list (one group per mesh)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # torch 2.11
        groups = [] if group is None else [group]
    groups = list(groups)
    try:
        auto = state._auto_reshard_after_forward
        saved = [(g.post_forward_mesh_info, g.reshard_after_backward) for g in groups]
        unsharded = bool(groups) and all(g.is_unsharded for g in groups)
    except AttributeError:
        return None

    def restore() -> bool:
        state._auto_reshard_after_forward = auto
        for g, (mesh_info, after_backward) in zip(groups, saved):
            g.post_forward_mesh_info = mesh_info
            g.reshard_after_backward = after_backward
        return unsharded

    return restore


def _fused_forward(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, ignore_index: int,
                   options: dict) -> torch.Tensor:
    weight = head.weight
    bias = getattr(head, "bias", None)
    if _is_dtensor(weight):
        raise NotImplementedError("FusedLinearCrossEntropyLoss: the LM head's weight is a DTensor after FSDP's "
                                  "unshard (tensor parallel / loss parallel shards the vocabulary); not supported")
    if hidden.dtype != weight.dtype:  # a model whose output dtype differs from its head's (no autocast here)
        hidden = hidden.to(weight.dtype)
    return linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction="sum",
                                **options)


def _call_fused(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, ignore_index: int,
                options: dict) -> torch.Tensor:
    """The head's summed loss. Under FSDP2 the computation runs as the head module's forward (its
    ``forward`` is replaced on the instance for the call), so FSDP's forward hooks unshard the weight
    and register its post-backward (the gradient's reduce-scatter) exactly as for ``head(hidden)``."""
    fsdp_cls = _fsdp_module_class()
    if fsdp_cls is None or not isinstance(head, fsdp_cls):
        return _fused_forward(head, hidden, target, ignore_index, options)
    def forward(module: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _fused_forward(module, h, y, ignore_index, options)

    own = head.__dict__.get("forward")  # a forward set on the instance (torchtitan's SPMD wrapper): kept
    head.forward = types.MethodType(forward, head)
    try:
        return head(hidden, target)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


class _HiddenGrad(torch.autograd.Function):
    """The loss, detached, whose backward gives the hidden states ``grad_output`` times the gradient
    the head's backward already formed (torchtitan's ``_DecoderOutputGradientBackProp``)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None
