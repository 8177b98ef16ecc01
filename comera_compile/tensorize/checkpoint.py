"""Saving a tensorized model the way ``save_pretrained`` does, with its TT layout beside the weights.

A ``save_pretrained``-style method (transformers' ``PreTrainedModel.save_pretrained``) writes the
state_dict, which holds a tensorized layer's cores and gates, but nothing records which layers are
tensor trains, in which format and at which ranks. :func:`save_with_layout` writes ``comera_tt.json``
(:func:`~comera_compile.tensorize.transform.tt_layout`: every layer's name, the modules sharing it,
format, modes, core shapes and gate sizes, so ranks after pruning) next to the method's files, and
stores a TT that several modules share once, under its first module (safetensors refuses tensors
shared between modules). :func:`keep_layout_on_save` makes the model's own ``save_pretrained`` do
that, so whatever calls it (transformers' ``Trainer`` saving a checkpoint or ``trainer.save_model()``)
writes a directory that ``comera_compile.hf.from_pretrained`` reloads, still tensorized.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Callable

from torch import nn

from comera_compile.tensorize.transform import tt_layout

TT_FILE = "comera_tt.json"
TT_FORMAT = 1
TT_MARK = ".parametrizations.weight.0."  # in the state_dict key of every core and gate


def save_with_layout(root: nn.Module, save: Callable[..., Any], save_directory: str | os.PathLike,
                     state_dict: dict | None = None, **kwargs: Any) -> None:
    """``save(root, save_directory, state_dict=..., **kwargs)`` (an unbound ``save_pretrained``), then
    ``comera_tt.json`` where ``root`` has TT layers. ``state_dict`` defaults to ``root.state_dict()``;
    the entries of a TT's other modules are dropped, its cores copied out of their flat Parameter. A
    model without TT layers is saved as ``save`` saves it, and a stale ``comera_tt.json`` in the
    directory is removed. With ``is_main_process=False`` no file is written here."""
    main = kwargs.get("is_main_process", True)
    layout = tt_layout(root)
    if not layout:
        save(root, save_directory, **({} if state_dict is None else {"state_dict": state_dict}), **kwargs)
        path = os.path.join(save_directory, TT_FILE)
        if main and os.path.exists(path):  # a layout from an earlier tensorized save into this directory
            os.remove(path)
        return
    state = root.state_dict() if state_dict is None else state_dict
    drop = tuple(f"{other}{TT_MARK}" for entry in layout for other in entry["shared_with"])
    prefixes = tuple(f"{entry['fqn']}{TT_MARK}" for entry in layout)
    state = {k: (v.detach().clone() if k.startswith(prefixes) else v)
             for k, v in state.items() if not k.startswith(drop)}
    save(root, save_directory, state_dict=state, **kwargs)
    if main:
        with open(os.path.join(save_directory, TT_FILE), "w") as f:
            json.dump({"format_version": TT_FORMAT, "layers": layout}, f, indent=1)


class LayoutSaving:
    """``model.save_pretrained`` after :func:`keep_layout_on_save`: the class's method through
    :func:`save_with_layout`. It holds the module the way a bound method does (``__self__``,
    ``__func__``), so ``copy.deepcopy`` rebinds it to the copy."""

    def __init__(self, module: nn.Module, func: Callable[..., Any]) -> None:
        self.__self__, self.__func__ = module, func

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        if args:  # positional arguments after the directory, by the method's own parameter names
            names = [p.name for p in list(inspect.signature(self.__func__).parameters.values())[2:]
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(args) > len(names):
                raise TypeError(f"{type(self.__self__).__name__}.save_pretrained takes at most {len(names) + 1} "
                                f"positional arguments after self; got {len(args) + 1}")
            kwargs.update(zip(names, args))
        save_with_layout(self.__self__, self.__func__, save_directory, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__func__.__get__(self.__self__))

    def __repr__(self) -> str:
        return f"<save_pretrained of {type(self.__self__).__name__}, with its TT layout>"


def keep_layout_on_save(root: nn.Module) -> None:
    """Make ``root.save_pretrained(...)`` write the TT layout too (:class:`LayoutSaving` on the
    instance); nothing for a module whose class has no ``save_pretrained`` or that already has one
    on the instance (ours, or a user's own, which is left as it is)."""
    func = getattr(type(root), "save_pretrained", None)
    if callable(func) and "save_pretrained" not in root.__dict__:
        root.save_pretrained = LayoutSaving(root, func)
