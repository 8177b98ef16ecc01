"""The fused loss's decisions: the options of a call (:mod:`~comera_compile.cce.options`), the cost model
and the choice of path (:mod:`~comera_compile.cce.planner`), the tuning and statistics
(:mod:`~comera_compile.cce.tuning`) and the observed kept fractions (:mod:`~comera_compile.cce.observed`) of
``comera::linear_cross_entropy``.

A pure floor: it imports :mod:`comera_compile.devices` and nothing else of the package, and runs no op
(no Triton); ``comera_compile.kernels`` runs what it decides. ``comera_compile.kernels.linear_cross_entropy_plan``
re-exports it for one release."""

from __future__ import annotations

from typing import Any

from comera_compile.cce import planner
from comera_compile.cce.observed import (
    KEPT_EMA,
    KeptFraction,
    KeptFractionStore,
    ShapeClass,
    current_kept_fraction_store,
    default_kept_fraction_store,
    forward_bounds_pay,
    kept_fractions,
    observe_kept_fraction,
    observed_kept_fraction,
    pinned_kept_fraction_store,
    reset_kept_fractions,
    use_kept_fraction_store,
)
from comera_compile.cce.options import IMPLS, LCEOptions, set_op_field_orders
from comera_compile.cce.planner import (
    BACKWARDS,
    DEFAULT_MEMORY_THRESHOLD,
    FORWARD_DX_MAX_D,
    MEMORY_POLICY_SLOWDOWN,
    PATHS,
    POLICIES,
    REDUCTIONS,
    STRATEGIES,
    FusedLossDecision,
    adaptive_plan,
    choose_strategy,
    chunk_plan,
    decide_fused_loss,
    default_memory_budget,
    describe_logits,
    estimate_seconds,
    format_bytes,
    forward_path,
    fused_loss_pays,
    logits_bytes,
    op_profile,
    rates_for,
    recompute_path,
    runtime_strategy,
)
from comera_compile.cce.tuning import (
    MIB,
    CCEStats,
    CCETuning,
    cce_tuning,
    current_tuning,
    default_filter_eps,
    record,
    record_cce_stats,
)

__all__ = [
    "BACKWARDS", "DEFAULT_MEMORY_THRESHOLD", "FORWARD_DX_MAX_D", "IMPLS", "KEPT_EMA", "MEMORY_POLICY_SLOWDOWN", "MIB",
    "PATHS", "POLICIES", "REDUCTIONS", "STRATEGIES", "CCEStats", "CCETuning", "FusedLossDecision", "KeptFraction",
    "KeptFractionStore", "LCEOptions", "ShapeClass", "adaptive_plan", "cce_tuning", "choose_strategy", "chunk_plan",
    "current_kept_fraction_store", "current_tuning", "decide_fused_loss", "default_filter_eps",
    "default_kept_fraction_store", "default_memory_budget", "describe_logits", "estimate_seconds", "format_bytes",
    "forward_bounds_pay", "forward_path", "fused_loss_pays", "kept_fractions", "logits_bytes", "observe_kept_fraction",
    "observed_kept_fraction", "op_profile", "pinned_kept_fraction_store", "rates_for", "recompute_path", "record",
    "record_cce_stats", "reset_kept_fractions", "runtime_strategy", "set_op_field_orders", "use_kept_fraction_store",
]


def __getattr__(name: str) -> Any:
    """The deprecated rate views (``DeviceRates``, ``ReferenceRates``, ``H200``, ``CPU``) of the planner,
    with its DeprecationWarning."""
    return planner.__getattr__(name)
