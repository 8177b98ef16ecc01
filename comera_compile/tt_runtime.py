"""The TT executor's old path: :mod:`comera_compile.kernels.tt_runtime` re-exported, so that
``from comera_compile import tt_runtime`` and ``comera_compile.tt_runtime.group_outputs`` keep working
(``group_outputs_opaque`` is now in :mod:`comera_compile.kernels.tt_group_merge`).
Deprecated: importing it warns; it will be removed in the next release (import :mod:`comera_compile.kernels.tt_runtime`)."""

import warnings

from comera_compile.kernels import tt_runtime as _new
from comera_compile.kernels.tt_group_merge import group_outputs_opaque  # noqa: F401 (its old place)
from comera_compile.kernels.tt_runtime import *  # noqa: F401,F403

__all__ = [*_new.__all__, "group_outputs_opaque"]

warnings.warn("comera_compile.tt_runtime is deprecated and will be removed in the next release: import comera_compile.kernels.tt_runtime "
              "(the same names)", DeprecationWarning, stacklevel=2)
