"""Hugging Face ``transformers`` models as they are trained: ``model(input_ids, labels=labels).loss``.

A transformers model returns its logits next to the loss, so in the graph the LM head's output has
a second user (the returned ``logits``) and the ``cce`` pass must leave the head alone: fusing would
compute the logits anyway. :func:`fused_loss` makes the model drop the logits in training, as
Liger-Kernel and Cut-Cross-Entropy do, so that Dynamo's graph no longer returns them and the head +
cross-entropy becomes one fused op. :func:`compile` does that and compiles the model in place with
the comera backend, the way to hand a model to transformers' ``Trainer``. Nothing here imports
transformers: :func:`fused_loss` takes a transformers ``PreTrainedModel`` (found through the already
imported module that defines it), and :func:`without_logits` works on any ``ModelOutput``-like
mapping (or ``(loss, logits, ...)`` tuple).
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from comera_compile.fx_utils import unwrap_compiled
from comera_compile.optimizer_check import watch_optimizers
from comera_compile.options import CompileOptions

__all__ = ["compile", "fused_loss", "without_logits"]

_PINNED = "_comera_fused_loss_pinned"


def fused_loss(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make ``model(..., labels=...)`` drop its logits in training, so the loss gets fused.

    While ``model.training`` and grad mode are on and the call computes a loss (``labels=`` given),
    the output's ``logits`` is ``None`` (a ``ModelOutput`` of the same type without logits, or
    ``(loss, None, ...)`` with ``return_dict=False``). Under ``torch.compile(model,
    backend="comera")`` the LM head and its cross-entropy then become one
    ``comera::linear_cross_entropy`` that never forms the logits. Evaluation (``model.eval()`` or
    ``torch.no_grad()``) and calls without labels return the logits as usual. Everything the loss
    function takes is passed through, e.g. ``num_items_in_batch`` for gradient accumulation.

    The model's ``forward`` is replaced on the instance (torch.compile runs a module's hooks
    outside the graph, so a hook could not drop the logits from it); the signature is kept, and
    ``copy.deepcopy`` gives the copy a forward of its own. It also resolves the model's
    ``loss_function`` once: transformers logs a warning from inside it when the model class does
    not name its loss type (GPT-2 for one), and that logging call is a graph break that would put
    the loss in a graph of its own.

    Works before or after ``torch.compile`` (a compiled module is unwrapped); ``enabled=False``
    restores the class's forward. Returns ``model``. Anything but a transformers ``PreTrainedModel``
    raises TypeError naming what was passed (for a wrapper, e.g. PEFT's or DDP's, the
    ``PreTrainedModel`` inside it: apply ``fused_loss`` to that one, whose forward the wrapper calls).
    """
    root = unwrap_compiled(model)  # a torch.compile'd module: the module inside
    _check_pretrained(model, root)
    current = root.__dict__.get("forward")
    if enabled and current is None:
        root.forward = _DroppingForward(root, type(root).forward)
        _pin_loss_function(root)
    elif enabled and not isinstance(current, _DroppingForward):
        raise TypeError(f"fused_loss: {type(root).__name__}.forward is already replaced on the instance "
                        f"(by {current!r}); apply fused_loss before that wrapper")
    elif not enabled and isinstance(current, _DroppingForward):
        del root.forward
        if root.__dict__.pop(_PINNED, False):
            del root._loss_function
    return model


def compile(model: nn.Module, *, options: Mapping[str, Any] | CompileOptions | None = None,
            mode: str | None = None, fused_loss: bool = True, **compile_kwargs: Any) -> nn.Module:
    """Compile ``model`` in place with the comera backend, for transformers' ``Trainer``; returns ``model``.

    ``cc.hf.compile(model, options=...)`` validates ``options`` (:class:`~comera_compile.CompileOptions`),
    applies :func:`fused_loss` (``fused_loss=False`` leaves the logits in the outputs, and then the
    LM head's loss is not fused), and calls ``model.compile(backend="comera", ...)``, which compiles
    the module's call in place: ``model`` stays the same object, with its own ``forward`` signature
    (``Trainer`` reads it to keep the dataset columns the model takes; ``torch.compile(model)``'s
    wrapper shows ``(*args, **kwargs)``, so ``Trainer`` drops every column and fails with "The batch
    received was empty"), its parameter names and its ``state_dict`` keys. Keyword arguments
    (``dynamic=``, ``fullgraph=``) go to ``torch.compile``.

    Leave ``TrainingArguments(torch_compile=...)`` off: accelerate accepts only its own list of
    backend names, so ``torch_compile_backend="comera"`` fails when the ``Trainer`` is built
    (``'COMERA' is not a valid DynamoBackend``), and another backend would compile the model again.

    It also installs the check that warns at an optimizer's first step when the optimizer was
    built before ``cc.tensorize_`` (it then holds the emptied dense weights, not the TT cores).
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("cc.hf.compile compiles the model in place: pass the model itself, not the wrapper "
                        "torch.compile returned (its ._orig_mod)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"cc.hf.compile expects an nn.Module; got {type(model).__name__}")
    CompileOptions.from_user(options, mode)  # a bad key or value raises here, not at the first step
    if fused_loss:
        try:
            _check_pretrained(model, model)
        except TypeError as exc:
            raise TypeError(f"cc.hf.compile: {exc} (or pass fused_loss=False to compile it without dropping "
                            "the logits)") from None
        _fused_loss(model)
    if options is not None:
        compile_kwargs["options"] = options
    if mode is not None:
        compile_kwargs["mode"] = mode
    model.compile(backend="comera", **compile_kwargs)
    watch_optimizers()
    return model


_fused_loss = fused_loss  # compile's parameter of the same name shadows the function there


def _pretrained_model_class() -> type | None:
    """transformers' ``PreTrainedModel``; a model that is one has imported it, so transformers is
    never imported here."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def _check_pretrained(model: Any, root: Any) -> None:
    base = _pretrained_model_class()
    if base is not None and isinstance(root, base):
        return
    expected = ("fused_loss expects a transformers PreTrainedModel (e.g. AutoModelForCausalLM.from_pretrained(...)), "
                "whose forward takes labels= and returns its loss next to the logits")
    got = type(root).__name__ + (f" (compiled, {type(model).__name__})" if root is not model else "")
    if base is None:
        raise TypeError(f"{expected}; got {got} (transformers is not imported, so it cannot be one)")
    inside = next(((name, m) for name, m in root.named_modules() if name and isinstance(m, base)), None) \
        if isinstance(root, nn.Module) else None
    if inside is None:
        raise TypeError(f"{expected}; got {got}")
    name = ("_orig_mod." if root is not model else "") + inside[0]
    raise TypeError(f"{expected}; got {got}, a wrapper of the {type(inside[1]).__name__} at '{inside[0]}': apply "
                    f"cc.hf.fused_loss(model.get_submodule('{name}')), whose forward the wrapper calls")


class _DroppingForward:
    """``model.forward`` under :func:`fused_loss`: the class's forward, then :func:`without_logits`
    in training. It holds the module the way a bound method does (``__self__``, ``__func__``), so
    ``copy.deepcopy`` rebinds it to the copy, and module names in ``explain`` stay the user's."""

    def __init__(self, module: nn.Module, func: Any) -> None:
        self.__self__, self.__func__ = module, func

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.__func__(self.__self__, *args, **kwargs)
        if self.__self__.training and torch.is_grad_enabled():
            return without_logits(output, kwargs.get("labels") is not None)
        return output

    @property
    def __signature__(self) -> inspect.Signature:  # transformers' Trainer reads forward's parameters
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<fused_loss forward of {type(self.__self__).__name__}>"


def without_logits(output: Any, has_loss: bool = True) -> Any:
    """``output`` with its logits set to ``None`` when it carries a loss; anything else unchanged.

    A ``ModelOutput`` is rebuilt as the same type from its other fields (setting the attribute to
    None would keep the logits in its dict, and so in the compiled graph's outputs).
    """
    if isinstance(output, Mapping):
        if output.get("loss") is None or output.get("logits") is None:
            return output
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})
    if isinstance(output, tuple) and has_loss and len(output) >= 2:
        return (output[0], None, *output[2:])
    return output


def _pin_loss_function(root: nn.Module) -> None:
    """Store the loss function transformers' ``loss_function`` property resolves to, so that the
    property (and its warning) is not evaluated inside the compiled forward."""
    if "_loss_function" in root.__dict__ or not isinstance(getattr(type(root), "loss_function", None), property):
        return
    try:
        resolved = root.loss_function
        root.loss_function = resolved
    except (AttributeError, KeyError):
        return
    root.__dict__[_PINNED] = True
