"""``RankConfig``: every option of rank-adaptive training, validated once."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NoReturn

__all__ = ["RankConfig"]

WEIGHTS = ("params", "flops")
SCALES = ("grad", "absolute")
SWITCHES = ("auto", "manual")
LOSS_SOURCES = ("output", "observe")
PRUNE_MODES = ("auto", "slice", "mask")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class RankConfig:
    """The options of :class:`~comera_compile.rank_adaptation.RankAdaptation` (its keyword arguments).

    The objective:
      * ``target_compression``: dense parameters / parameters that the late stage aims for (> 0).
      * ``gamma``: early-stage penalty weight; ``late_gamma`` (default ``gamma``) the late stage's;
        ``augment``: the late stage's weight when the size is not the worse objective (all >= 0).
      * ``scale``: ``"grad"`` (the weights are relative to the gates' loss-gradient scale, a running
        mean with decay ``grad_ema`` in [0, 1)) or ``"absolute"`` (in loss units).
      * ``weight``: ``"params"`` or ``"flops"``: what each gate's penalty is weighted by.

    Pruning:
      * ``prune_every`` (steps, 0: never), ``threshold`` (gate magnitude, >= 0), ``rank_multiple``
        (1, 8, 16, ...: the surviving rank is rounded up to a multiple of it).
      * ``min_rank`` (default 1): the fewest gates a bond keeps, so no layer is deleted; 0 lets a
        bond go and its layer become zero (with a warning).
      * ``gate_lr_scale``: ``"auto"`` (default: 10 for gates sharing a parameter group with other
        parameters, 1 for gates in groups of their own, as ``cc.param_groups`` makes) or a number
        > 0: the gates' optimizer step is multiplied by it (their lr, for torch's first-order
        optimizers).
      * ``recompiles_per_event`` (>= 0): how far the Dynamo recompile limit is raised per shape change.
      * ``prune_mode``: ``"slice"`` (the pruned ranks removed, the cores sliced), ``"mask"`` (the pruned
        gates set to zero and held there after every step; the shapes stay, for FSDP2, whose sharded
        parameters cannot change shape: :func:`~comera_compile.rank_adaptation.shrink_` slices them off
        later, on an unsharded model) or ``"auto"`` (default: ``"mask"`` where FSDP2 holds the TT
        parameters as ``DTensor`` s, else ``"slice"``).

    The stages:
      * ``switch``: ``"auto"``, ``"manual"`` or a step number (>= 0); ``converge_window`` (steps,
        >= 1), ``converge_tol`` (>= 0), ``min_early_steps`` (>= 0): the automatic switch;
        ``loss_ema``: the loss's running-average decay, in [0, 1); ``loss_tolerance`` (>= 0): the
        late stage's loss target above the average.
      * ``loss_from``: ``"output"`` (forward hook on the model's scalar output) or ``"observe"``.

    A bad value raises ``ValueError`` naming the option and what it accepts. Numbers are stored as
    ``float``; ``late_gamma=None`` stays None (it means ``gamma``).
    """

    target_compression: float
    gamma: float = 1.0
    late_gamma: float | None = None
    augment: float = 0.1
    scale: str = "grad"
    grad_ema: float = 0.9
    weight: str = "params"
    prune_every: int = 50
    threshold: float = 1e-2
    rank_multiple: int = 1
    switch: int | str = "auto"
    converge_window: int = 100
    converge_tol: float = 0.01
    min_early_steps: int = 0
    loss_ema: float = 0.95
    loss_tolerance: float = 0.02
    loss_from: str = "output"
    recompiles_per_event: int = 2
    min_rank: int = 1
    gate_lr_scale: float | str = "auto"
    prune_mode: str = "auto"

    def __post_init__(self) -> None:
        def fail(name: str, accepts: str) -> NoReturn:
            raise ValueError(f"RankConfig.{name} must be {accepts}, got {getattr(self, name)!r}")

        if not (_is_number(self.target_compression) and self.target_compression > 0
                and math.isfinite(self.target_compression)):
            fail("target_compression", "a finite number > 0")
        if self.weight not in WEIGHTS:
            fail("weight", f"one of {WEIGHTS}")
        if not (_is_int(self.switch) and self.switch >= 0) and self.switch not in SWITCHES:
            fail("switch", "'auto', 'manual' or a step number >= 0")
        if self.loss_from not in LOSS_SOURCES:
            fail("loss_from", "'output' or 'observe'")
        if not isinstance(self.prune_every, int) or self.prune_every < 0:
            fail("prune_every", "an int >= 0 (0: never)")
        if not isinstance(self.rank_multiple, int) or self.rank_multiple < 1:
            fail("rank_multiple", "a positive int")
        for name in ("gamma", "augment", "threshold", "late_gamma", "converge_tol", "loss_tolerance"):
            value = getattr(self, name)
            if not (value is None and name == "late_gamma") and not (_is_number(value) and value >= 0):
                fail(name, ">= 0")
        for name in ("loss_ema", "grad_ema"):
            if not (_is_number(getattr(self, name)) and 0 <= getattr(self, name) < 1):
                fail(name, "in [0, 1)")
        if self.prune_mode not in PRUNE_MODES:
            fail("prune_mode", f"one of {PRUNE_MODES}")
        if self.scale not in SCALES:
            fail("scale", f"one of {SCALES}")
        if not _is_int(self.min_rank) or self.min_rank < 0:
            fail("min_rank", "an int >= 0 (0: a layer may lose a whole bond and become zero)")
        if self.gate_lr_scale != "auto" and not (_is_number(self.gate_lr_scale) and self.gate_lr_scale > 0
                                                 and math.isfinite(self.gate_lr_scale)):
            fail("gate_lr_scale", "'auto' or a number > 0")
        for name, least in (("converge_window", 1), ("min_early_steps", 0), ("recompiles_per_event", 0)):
            if not _is_int(getattr(self, name)) or getattr(self, name) < least:
                fail(name, f"an int >= {least}")
        for name in ("target_compression", "gamma", "late_gamma", "augment", "grad_ema", "threshold",
                     "converge_tol", "loss_ema", "loss_tolerance"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.gate_lr_scale != "auto":
            object.__setattr__(self, "gate_lr_scale", float(self.gate_lr_scale))
