"""The TT executor's old path: :mod:`comera_compile.kernels.tt_runtime` re-exported, so that
``from comera_compile import tt_runtime`` and ``comera_compile.tt_runtime.group_outputs`` keep working."""

from comera_compile.kernels.tt_runtime import *  # noqa: F401,F403
from comera_compile.kernels.tt_runtime import __all__  # noqa: F401
