"""The TT executor's old path: :mod:`comera_compile.kernels.tt_runtime` re-exported, so that
``from comera_compile import tt_runtime`` and ``comera_compile.tt_runtime.group_outputs`` keep working."""

from comera_compile.kernels import tt_runtime as _new
from comera_compile.kernels.tt_runtime import *  # noqa: F401,F403

__all__ = list(_new.__all__)
