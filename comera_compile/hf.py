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

:func:`save_pretrained` / :func:`from_pretrained` save and load a tensorized model: transformers'
own ``from_pretrained`` builds the dense architecture and drops the TT cores (it reports their keys
as unexpected and initializes the weights anew), so the TT layout (every layer's format, modes and
core shapes, i.e. its ranks after any pruning) goes to ``comera_tt.json`` beside ``config.json``
(:mod:`comera_compile.tensorize.checkpoint`, which also makes a tensorized model's own
``save_pretrained`` write it).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from comera_compile.fx_utils import unwrap_compiled
from comera_compile.options import CompileOptions
from comera_compile.tensorize.checkpoint import TT_FILE, TT_MARK, read_layout, save_with_layout

__all__ = ["compile", "from_pretrained", "fused_loss", "save_pretrained", "without_logits"]

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

    ``TrainingArguments(gradient_checkpointing=True)`` works: the model's calls are traced with
    Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (the context variables transformers'
    checkpointed layers set are not set again in their recompute), and the fused-loss forward passes
    ``use_cache=False`` in training, as transformers would; the checkpointed layers then compile with
    the rest, tensor-train layers lowered and the loss fused.

    Leave ``TrainingArguments(torch_compile=...)`` off: accelerate accepts only its own list of
    backend names, so ``torch_compile_backend="comera"`` fails when the ``Trainer`` is built
    (``'COMERA' is not a valid DynamoBackend``), and another backend would compile the model again.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("cc.hf.compile compiles the model in place: pass the model itself, not the wrapper "
                        "torch.compile returned (its ._orig_mod)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"cc.hf.compile expects an nn.Module; got {type(model).__name__}")
    from comera_compile.pass_manager import validated_options

    validated_options(options, mode)  # a bad key or value, or an unknown pass name, raises here
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
    model._compiled_call_impl = _checkpointing_scope(model._compiled_call_impl)
    return model


def _checkpointing_scope(compiled: Any) -> Any:
    """``compiled`` (the module's in-place compiled call) traced with forward side effects inside
    activation-checkpointed layers left out of their recompute: transformers' layers under
    ``gradient_checkpointing`` set context variables there (Hugging Face's hub-kernels layer, output
    capturing), and Dynamo refuses such a side effect unless told not to replay it, running every
    checkpointed layer eagerly: no tensor-train lowering, no fused loss. The setting applies to this
    model's calls only."""

    from comera_compile.inductor import checkpoint_side_effects_scope

    if checkpoint_side_effects_scope() is None:  # a torch without the setting
        return compiled

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        with checkpoint_side_effects_scope():
            return compiled(*args, **kwargs)

    return call


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
    ``copy.deepcopy`` rebinds it to the copy, and module names in ``explain`` stay the user's. Its
    ``__func__`` drops the logits itself: accelerate's mixed precision (``Trainer(bf16=True)``) wraps
    ``model.forward.__func__`` in autocast and an fp32 cast of the outputs, and that wrapper keeps the
    dropping (the fp32 cast would otherwise be one more user of the logits, and nothing fused)."""

    def __init__(self, module: nn.Module, func: Any) -> None:
        self.__self__, self.__func__ = module, _dropping_logits(func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # transformers' Trainer reads forward's parameters
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<fused_loss forward of {type(self.__self__).__name__}>"


def _dropping_logits(func: Any) -> Any:
    """``func`` (a model class's forward), then :func:`without_logits` while training with grad on;
    the signature stays ``func``'s (``functools.wraps``: ``Trainer`` reads it)."""

    takes_use_cache = "use_cache" in inspect.signature(func).parameters

    @functools.wraps(func)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        training = self.training and torch.is_grad_enabled()
        if training and takes_use_cache and "use_cache" not in kwargs and _checkpointing(self):
            # what transformers sets itself under gradient checkpointing, but after a logging call
            # that Dynamo cannot trace (a graph break before every checkpointed layer)
            kwargs["use_cache"] = False
        output = func(self, *args, **kwargs)
        return without_logits(output, kwargs.get("labels") is not None) if training else output

    return forward


def _checkpointing(model: nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on for ``model``: its ``is_activation_checkpointing``
    (``is_gradient_checkpointing`` before transformers 5.x named it so; since then that alias warns, and a
    warning inside a compiled forward breaks the graph)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


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


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` for a tensorized model, reloadable by
    :func:`from_pretrained`.

    Writes ``comera_tt.json`` (every TT layer's name, the modules sharing it, format, modes, core
    shapes and gate sizes: the ranks as they are, after pruning; and a checksum of each of these
    fields, which :func:`from_pretrained` verifies) next to transformers' files. The
    state_dict holds each TT layer's cores and gates once: a TT shared by several modules
    (``tied="share"``) is stored under its first module's name only (safetensors refuses tensors
    shared between modules), and the cores are copied out of their flat Parameter. A model without
    TT layers is saved as by ``model.save_pretrained``. Keyword arguments go to
    ``save_pretrained`` (a ``state_dict=`` of your own is not taken). ``tensorize_`` makes a
    transformers model's own ``save_pretrained`` do the same (what ``Trainer`` calls to save).
    """
    root = unwrap_compiled(model)
    save = getattr(type(root), "save_pretrained", None)
    if not callable(save):
        raise TypeError(f"cc.hf.save_pretrained expects a transformers PreTrainedModel; got {type(root).__name__}")
    if "state_dict" in kwargs:
        raise TypeError("cc.hf.save_pretrained builds the state_dict itself; do not pass state_dict=")
    save_with_layout(root, save, save_directory, **kwargs)


def from_pretrained(cls: Any, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """Load a model :func:`save_pretrained` saved, still tensorized, with the saved ranks.

    ``cls`` is a transformers model class or Auto class (``AutoModelForCausalLM``); the path is a
    local directory. The architecture is built from its ``config.json`` (``cls.from_config``,
    keyword arguments such as ``dtype=`` go there), the TT layers of ``comera_tt.json`` are applied
    with their saved core shapes, and the weights (``model.safetensors``, sharded safetensors, or
    ``pytorch_model.bin``) are loaded strictly: a missing or unexpected key raises RuntimeError.
    Weights transformers ties (an LM head sharing the embedding) and modules sharing one TT are
    filled from the entry they share. The model is returned in eval mode, like transformers'
    ``from_pretrained``. A directory without ``comera_tt.json`` whose weights hold TT cores (saved
    by plain ``model.save_pretrained``) raises ValueError saying how to load it. A ``comera_tt.json``
    that was edited after saving (a field that disagrees with its saved checksum), is truncated, or
    lacks a field raises ValueError naming the file, the layer and the field
    (:func:`comera_compile.tensorize.checkpoint.read_layout`).
    """
    import transformers

    from comera_compile.tensorize.transform import restore_tt_layout_

    path = os.fspath(pretrained_model_name_or_path)
    if not os.path.isdir(path):
        raise ValueError(f"cc.hf.from_pretrained loads a local directory; {path!r} is not one "
                         "(download it first, e.g. huggingface_hub.snapshot_download)")
    state = _load_weights(path)
    tt_path = os.path.join(path, TT_FILE)
    if not os.path.exists(tt_path):
        if any(TT_MARK in k for k in state):
            raise ValueError(f"{path} holds tensor-train cores but no {TT_FILE}: it was saved without its TT "
                             "layout (by a save_pretrained that tensorize_ did not extend: one on the instance "
                             "of your own, or of a module other than the one tensorize_ was given). Load it by "
                             "building the model, cc.tensorize_ with the same config and ranks, then "
                             "model.load_state_dict(safetensors.torch.load_file(...)); save with "
                             "cc.hf.save_pretrained next time")
        layout = []
    else:
        layout = read_layout(tt_path)
    config = transformers.AutoConfig.from_pretrained(path)
    _check_model_class(cls, config, path)
    build = getattr(cls, "from_config", None) or cls._from_config
    model = build(config, **kwargs)
    try:
        restore_tt_layout_(model, layout)
    except ValueError as e:  # a layer the model lacks, or of another shape: the file says so
        raise ValueError(f"{tt_path}: {e}") from None
    _load_strict(model, state, layout, path)
    return model.eval()


def _check_model_class(cls: Any, config: Any, path: str) -> None:
    """A model class for another architecture than the saved config's raises, naming both."""
    expected = getattr(cls, "config_class", None)  # a model class; Auto classes pick theirs from the config
    if isinstance(expected, type) and not isinstance(config, expected):
        saved = ", ".join(getattr(config, "architectures", None) or []) or type(config).__name__
        raise ValueError(f"cc.hf.from_pretrained({getattr(cls, '__name__', cls)}, {path!r}): the checkpoint is a "
                         f"{type(config).__name__} model ({saved}), and {getattr(cls, '__name__', cls)} builds from a "
                         f"{expected.__name__}; pass the saved architecture's class, or an Auto class such as "
                         "transformers.AutoModelForCausalLM")


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    files = os.listdir(path)
    if "model.safetensors" in files or "model.safetensors.index.json" in files:
        from safetensors.torch import load_file

        if "model.safetensors" in files:
            return load_file(os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(path, shard)))
        return state
    if "pytorch_model.bin" in files:
        return torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], layout: list[dict], path: str) -> None:
    """``model.load_state_dict(state, strict=True)``, first filling the keys of shared TTs and tied
    weights from the entry they share."""
    state = dict(state)
    for entry in layout:
        lead = f"{entry['fqn']}{TT_MARK}"
        for other in entry["shared_with"]:
            for key in [k for k in state if k.startswith(lead)]:
                state.setdefault(f"{other}{TT_MARK}{key[len(lead):]}", state[key])
    expected = model.state_dict(keep_vars=True)
    by_storage: dict[tuple, list[str]] = {}
    for key, t in expected.items():
        if isinstance(t, torch.Tensor) and t.numel() and TT_MARK not in key:
            by_storage.setdefault((t.data_ptr(), tuple(t.shape), t.stride()), []).append(key)
    for keys in by_storage.values():  # tied dense weights: transformers saves one of them
        present = [k for k in keys if k in state]
        for key in keys:
            if key not in state and present:
                state[key] = state[present[0]]
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise RuntimeError(f"cc.hf.from_pretrained({path!r}): the checkpoint does not match the model built from "
                           f"its config and {TT_FILE}: missing keys {missing[:8]}"
                           f"{f' and {len(missing) - 8} more' if len(missing) > 8 else ''}, unexpected keys "
                           f"{unexpected[:8]}{f' and {len(unexpected) - 8} more' if len(unexpected) > 8 else ''}")
    model.load_state_dict(state, strict=True)
