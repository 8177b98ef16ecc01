"""The TT executor's old path: :mod:`comera_compile.kernels.tt_runtime` re-exported, so that
``from comera_compile import tt_runtime`` and ``comera_compile.tt_runtime.group_outputs`` keep working.
Deprecated: importing it warns; it will be removed in the next release (import :mod:`comera_compile.kernels.tt_runtime`)."""

import warnings

from comera_compile.kernels import tt_runtime as _new
from comera_compile.kernels.tt_runtime import *  # noqa: F401,F403

__all__ = list(_new.__all__)

warnings.warn("comera_compile.tt_runtime is deprecated and will be removed in the next release: import comera_compile.kernels.tt_runtime "
              "(the same names)", DeprecationWarning, stacklevel=2)
