"""The contraction planner's old path: :mod:`comera_compile.tt.planner` re-exported, so that
``from comera_compile.planner import plan_tt_linear`` and ``comera_compile.planner.H200`` keep working."""

from comera_compile.tt.planner import *  # noqa: F401,F403
from comera_compile.tt.planner import __all__  # noqa: F401
