"""A value set for the length of a ``with`` block: the seams through which a caller (or a test) swaps an
object the package uses, without a process-wide switch."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """Set ``var`` to ``value`` within the block (this thread and context only) and yield ``value``; on
    exit, even by an exception, the previous value is back."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
