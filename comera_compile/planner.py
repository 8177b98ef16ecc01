"""The contraction planner's old path: :mod:`comera_compile.tt.planner` re-exported, so that
``from comera_compile.planner import plan_tt_linear`` and ``comera_compile.planner.H200`` keep working.
Deprecated: importing it warns; it will be removed in the next release (import :mod:`comera_compile.tt.planner`)."""

import warnings

from comera_compile.tt import planner as _new
from comera_compile.tt.planner import *  # noqa: F401,F403

__all__ = list(_new.__all__)


def __getattr__(name: str):
    """The names the new module keeps only behind its own deprecation (``DeviceModel``, ``H200``)."""
    return getattr(_new, name)


warnings.warn("comera_compile.planner is deprecated and will be removed in the next release: import comera_compile.tt.planner "
              "(the same names)", DeprecationWarning, stacklevel=2)
