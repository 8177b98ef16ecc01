"""The contraction planner's old path: :mod:`comera_compile.tt.planner` re-exported, so that
``from comera_compile.planner import plan_tt_linear`` and ``comera_compile.planner.H200`` keep working."""

from comera_compile.tt import planner as _new
from comera_compile.tt.planner import *  # noqa: F401,F403

__all__ = list(_new.__all__)
