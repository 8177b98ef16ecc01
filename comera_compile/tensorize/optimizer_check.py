"""A warning for an optimizer built before ``tensorize_``, which would never train the TT cores.

``tensorize_`` replaces a layer's dense weight by a parametrization of tensor-train cores; the old
weight ``Parameter`` object is emptied in place (it becomes a tensor with no elements) and is no
longer part of the model. An optimizer built before ``tensorize_`` still holds that empty tensor and
not the cores: its steps update nothing in the tensorized layers, and nothing raises. The check runs
once per optimizer, at its first ``step()``, eager or compiled, through one optimizer step pre-hook
that ``tensorize_`` installs the first time it tensorizes a layer (:func:`watch_optimizers`); a
process that never tensorizes has none.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["stale_parameters", "watch_optimizers"]

_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_handle: Any = None


def stale_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[int, int]]:
    """``(group index, index in the group)`` of every parameter of ``optimizer`` that has no elements
    and no gradient: what an optimizer built before ``tensorize_`` holds in place of each dense weight
    that ``tensorize_`` replaced."""
    return [(g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
            if p.numel() == 0 and p.grad is None]


def _check_on_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling() or optimizer in _checked:
        return
    _checked.add(optimizer)
    stale = stale_parameters(optimizer)
    if stale:
        where = ", ".join(f"param_groups[{g}]['params'][{i}]" for g, i in stale[:4]) + (" ..." if len(stale) > 4 else "")
        warnings.warn(
            f"comera: this {type(optimizer).__name__} holds {len(stale)} parameter(s) with no elements and no "
            f"gradient ({where}): the dense weights that cc.tensorize_ replaced by tensor-train cores. An optimizer "
            "built before tensorize_ does not hold the cores and never trains them; build it after tensorize_, "
            "e.g. torch.optim.AdamW(cc.param_groups(model, lr=...))", UserWarning, stacklevel=3)


def watch_optimizers() -> None:
    """Install the first-step check on every optimizer (once per process; a set lookup per step after)."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_check_on_first_step)
