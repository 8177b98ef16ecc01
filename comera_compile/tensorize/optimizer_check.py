"""A warning for an optimizer built before ``tensorize_``, which would never train the TT cores.

``tensorize_`` replaces a layer's dense weight by a parametrization of tensor-train cores; the old
weight ``Parameter`` object is emptied in place (it becomes a tensor with no elements) and is no
longer part of the model. An optimizer built before ``tensorize_`` still holds that empty tensor and
not the cores: its steps update nothing in the tensorized layers, and nothing raises. The check runs
once per optimizer, at its first ``step()``, eager or compiled, through one optimizer step pre-hook
that ``tensorize_`` installs the first time it tensorizes a layer (:func:`watch_optimizers`); a
process that never tensorizes has none. Whether it is installed is held by an :class:`OptimizerWatch`: the
process's default, or the one of the innermost :func:`use_watch` block (one the caller owns).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from comera_compile._scope import scoped

__all__ = ["OptimizerWatch", "current_watch", "stale_parameters", "use_watch", "watch_optimizers"]

_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


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


class OptimizerWatch:
    """Installs the first-step check at most once: ``install()`` calls ``register(hook)`` (default
    ``torch.optim.optimizer.register_optimizer_step_pre_hook``, a global optimizer step pre-hook) the
    first time and keeps what it returns as ``handle``; ``remove()`` removes it (``handle.remove()``)
    and the next ``install()`` installs it again."""

    def __init__(self, register: Optional[Callable[[Callable[..., Any]], Any]] = None) -> None:
        self.register = register_optimizer_step_pre_hook if register is None else register
        self.handle: Any = None

    def install(self) -> None:
        if self.handle is None:
            self.handle = self.register(_check_on_first_step)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


_WATCH: contextvars.ContextVar[OptimizerWatch] = contextvars.ContextVar("comera_optimizer_watch",
                                                                        default=OptimizerWatch())


def current_watch() -> OptimizerWatch:
    """The :class:`OptimizerWatch` that :func:`watch_optimizers` uses now: the process's default, or the
    one of the innermost :func:`use_watch` block."""
    return _WATCH.get()


@contextlib.contextmanager
def use_watch(watch: Optional[OptimizerWatch] = None) -> Iterator[OptimizerWatch]:
    """Within the block, :func:`watch_optimizers` (what ``tensorize_`` calls) uses ``watch`` (a new
    :class:`OptimizerWatch` when None), which it yields; on exit the previous one is back. A hook it
    installed stays installed (call its ``remove()``). A context variable: it holds for this thread
    (and context) only."""
    with scoped(_WATCH, OptimizerWatch() if watch is None else watch) as current:
        yield current


def watch_optimizers() -> None:
    """Install the first-step check on every optimizer (once per process, through the current
    :class:`OptimizerWatch`; a set lookup per step after)."""
    current_watch().install()
