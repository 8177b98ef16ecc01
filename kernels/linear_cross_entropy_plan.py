"""Deprecated: the fused loss's decisions moved to :mod:`comera_compile.cce` (the cost model and the
choice of path in :mod:`comera_compile.cce.planner`, the tuning and statistics in
:mod:`comera_compile.cce.tuning`, the observed kept fractions in :mod:`comera_compile.cce.observed`, the
options of a call in :mod:`comera_compile.cce.options`).

This module re-exports the same objects for one release (``comera_compile.cce.X is
comera_compile.kernels.linear_cross_entropy_plan.X``; the state, the tuning stack and the default store,
lives there once) and warns on import. Nothing in the package imports it."""

from __future__ import annotations

import warnings
from typing import Any

import comera_compile.cce as _cce
from comera_compile.cce import *  # noqa: F401,F403
from comera_compile.cce import planner as _planner

__all__ = list(_cce.__all__)

warnings.warn("comera_compile.kernels.linear_cross_entropy_plan is deprecated and will be removed in the next "
              "release: use comera_compile.cce", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """The planner's deprecated rate views (``DeviceRates``, ``ReferenceRates``, ``H200``, ``CPU``) and its
    other names (``FORWARD_DX_PASS``, ...), the deprecated ones with their DeprecationWarning."""
    return getattr(_planner, name)
