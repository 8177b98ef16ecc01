"""``RankAdaptation``: the optimizer-step hooks, the two stages and the ranker's state (the
objective is :mod:`~comera_compile.rank_adaptation.objective`'s, the pruning
:mod:`~comera_compile.rank_adaptation.pruning`'s; the overview is the package's docstring)."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn

from comera_compile.rank_adaptation import distributed, pruning, sharded
from comera_compile.rank_adaptation.config import RankConfig
from comera_compile.rank_adaptation.objective import SizeObjective, mean_abs
from comera_compile.rank_adaptation.plot import plot_history
from comera_compile.tensorize import TTParametrization, compression_report, iter_tt_layers

log = logging.getLogger(__name__)

__all__ = ["RankAdaptation"]

_STAGES = ("early", "late")
_AUTO_GATE_LR_SCALE = 10.0  # the gates' lr / the model's in cc.param_groups (CoMERA's ratio)
_OPTIONS = tuple(f.name for f in dataclasses.fields(RankConfig))


class _RankedLayer(NamedTuple):
    """A layer the ranker adapts: its name and its parametrization, whose ``cores``, ``gates`` and
    ``spec`` are read afresh after every pruning event. (The views an ``iter_tt_layers`` entry holds go
    stale at a pruning event, and as non-leaf tensors they would make ``copy.deepcopy(model)`` fail:
    the model's forward hook holds the ranker.)"""

    fqn: str
    param: TTParametrization


def _loss_of(output: Any) -> torch.Tensor | None:
    """The scalar loss in a model's output: the output itself, its ``loss`` attribute (a Hugging Face
    ``ModelOutput``) or its ``"loss"`` entry (a dict); None when there is none."""
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, torch.Tensor):
        loss = output
    else:
        loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def _config_of(target_compression: float | None, config: RankConfig | None, options: dict[str, Any]) -> RankConfig:
    """The options as a :class:`RankConfig`: ``config`` (or the defaults) with ``target_compression``
    and the keyword ``options`` over it."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"RankAdaptation: unknown option(s) {unknown}; the options are {list(_OPTIONS)}")
    if target_compression is not None:
        options = {"target_compression": target_compression, **options}
    if config is None:
        if "target_compression" not in options:
            raise TypeError("RankAdaptation: target_compression is required (or config=RankConfig(...))")
        return RankConfig(**options)
    if not isinstance(config, RankConfig):
        raise TypeError(f"RankAdaptation: config must be a RankConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **options) if options else config


def _lr(group: dict) -> float:
    """A parameter group's learning rate as a float (a tensor lr read once, at setup)."""
    lr = group.get("lr", 0.0)
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


class RankAdaptation:
    """Rank-adaptive training of every tensor-train layer of ``model`` through ``optimizer``'s step.

    Build it after ``tensorize_`` and the optimizer, before (or after) ``torch.compile``; pass the
    uncompiled module (a compiled one is unwrapped). The objective, the pruning and the stages are
    described in the :mod:`comera_compile.rank_adaptation` docstring.

    Options: ``target_compression`` (dense parameters / parameters that the late stage aims for) and
    the keyword options, the fields of :class:`~comera_compile.rank_adaptation.RankConfig` (``gamma``,
    ``late_gamma``, ``augment``, ``scale``, ``grad_ema``, ``weight``, ``prune_every``, ``threshold``,
    ``rank_multiple``, ``switch``, ``converge_window``, ``converge_tol``, ``min_early_steps``,
    ``loss_ema``, ``loss_tolerance``, ``loss_from``, ``recompiles_per_event``, ``min_rank``,
    ``gate_lr_scale``; see its docstring), or ``config=RankConfig(...)``: the keywords given beside
    it replace its fields. ``self.config`` is the resolved ``RankConfig``.
    """

    def _check_prunable(self) -> None:
        """Layers whose every internal bond is at ``min_rank`` have nothing to prune (a ``"btt"`` layer at
        rank 1, what ``TTConfig()`` gives a Linear layer at least 2048 wide, or a model already pruned to the floor
        and resumed): named in a warning."""
        stuck = [lay.fqn for lay in self.layers
                 if all(r <= self.min_rank for r in lay.param.spec.ranks[1:-1])]
        if not stuck:
            return
        how = (f"every internal bond is at min_rank={self.min_rank}, so rank adaptation cannot shrink them "
               "(TTConfig() gives a Linear layer at least 2048 wide the 'btt' format at rank 1); tensorize them with "
               "a larger rank to prune, e.g. TTConfig(fmt='btt', rank=4) or TTConfig(fmt='ttm', rank=64)")
        which = "no tensor-train layer can" if len(stuck) == len(self.layers) else \
            f"{len(stuck)} of {len(self.layers)} tensor-train layers cannot"
        warnings.warn(f"RankAdaptation: {which} be pruned ({stuck[:4]}{' ...' if len(stuck) > 4 else ''}): "
                      f"{how}", stacklevel=3)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, target_compression: float | None = None,
                 *, config: RankConfig | None = None, **options: Any) -> None:
        self.config = config = _config_of(target_compression, config, options)
        self.model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: the module inside
        self.optimizer = optimizer
        self.layers = [_RankedLayer(lay.fqn, lay.param) for lay in iter_tt_layers(self.model)]
        if not self.layers:
            raise ValueError("RankAdaptation: the model has no tensor-train layers; call cc.tensorize_ first")
        in_opt = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [lay.fqn for lay in self.layers
                   if any(id(p) not in in_opt for p in (lay.param.core_flat, lay.param.gate_flat) if p.requires_grad)]
        if missing:
            raise ValueError(f"RankAdaptation: the optimizer does not hold the cores/gates of {missing}; "
                             "build the optimizer after tensorize_")
        self.target_compression = config.target_compression
        self.gamma = config.gamma
        self.late_gamma = config.gamma if config.late_gamma is None else config.late_gamma
        self.augment = config.augment
        self.scale = config.scale
        self.grad_ema = config.grad_ema
        self.weight = config.weight
        self.prune_every = config.prune_every
        self.threshold = config.threshold
        self.rank_multiple = config.rank_multiple
        self.switch = config.switch
        self.converge_window = config.converge_window
        self.converge_tol = config.converge_tol
        self.min_early_steps = config.min_early_steps
        self.loss_ema_decay = config.loss_ema
        self.loss_tolerance = config.loss_tolerance
        self.recompiles_per_event = config.recompiles_per_event
        self.min_rank = config.min_rank
        self.gate_lr_scale = config.gate_lr_scale
        self.prune_mode = self._resolve_prune_mode(config.prune_mode)
        self._masks: dict[str, torch.Tensor] = {}  # prune_mode "mask": each masked layer's gate_flat mask (CPU)
        self._device_masks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kept positions, this shard's mask
        self._masks_read = False  # the masks of gates already zero (a checkpoint's) are read at the first step
        self._gate_scales = self._resolve_gate_scales()
        self._check_prunable()

        report = compression_report(self.model)
        self.dense_params = report.dense_params
        self.target_params = self.dense_params / self.target_compression
        if self.target_params <= report.other_params:
            warnings.warn(
                f"RankAdaptation: target_compression={self.target_compression:g} allows {self.target_params:,.0f} "
                f"parameters, but the layers that are not tensor trains already hold {report.other_params:,}: "
                f"the target is unreachable (the largest reachable compression is below "
                f"{self.dense_params / max(report.other_params, 1):.1f}x); the late stage will keep pruning",
                stacklevel=2)
        self._warn_if_gates_are_slow()
        self.objective = SizeObjective([lay.param for lay in self.layers], self.weight, self.min_rank)

        self.step = 0
        self.stage = "early"
        self.switch_step: int | None = None
        self.loss_avg: float | None = None
        self._loss_peak: float | None = None  # the highest loss EMA seen (the progress of the early stage)
        self.loss_target: float | None = None
        self.prune_events = 0  # pruning events that changed shapes
        self.dead: list[str] = self._find_dead()  # zeroed layers (a checkpoint's are recognized by their gates)
        self.history: list[dict[str, Any]] = []
        self._loss_trace: list[float] = []  # loss EMA per step, the last converge_window + 1
        self._pending_loss: torch.Tensor | None = None
        self._gamma_t = self.gamma
        self._grad_ref: torch.Tensor | None = None  # scale="grad": running mean |dL/dg| (a 0-d tensor)
        self._callbacks: list[Callable[["RankAdaptation"], None]] = []
        self._warned_no_loss = False
        self._limit_base: int | None = None
        self._scaled: list[tuple[torch.Tensor, float, torch.Tensor]] = []  # gates before the step
        self._floored: set[str] = set()  # layers warned about a bond kept only by min_rank

        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]
        if config.loss_from == "output":
            self._handles.append(self.model.register_forward_hook(self._capture_output))

    def _resolve_prune_mode(self, mode: str) -> str:
        """``"auto"``: ``"mask"`` where FSDP2 holds the TT parameters (``DTensor`` s, whose shapes are fixed),
        else ``"slice"``; ``"slice"`` over such parameters raises, naming the layers."""
        sharded_layers = [lay.fqn for lay in self.layers
                          if any(sharded.is_dtensor(p) for p in (lay.param.core_flat, lay.param.gate_flat))]
        if mode == "auto":
            mode = "mask" if sharded_layers else "slice"
            if sharded_layers:
                log.info("RankAdaptation: FSDP2 holds the TT parameters: pruning masks the gates (prune_mode='mask'); "
                         "rank_adaptation.shrink_ slices them off an unsharded model")
        elif mode == "slice" and sharded_layers:
            raise NotImplementedError(
                f"RankAdaptation(prune_mode='slice'): FSDP2 (fully_shard) holds the TT parameters of "
                f"{sharded_layers[:4]}{' ...' if len(sharded_layers) > 4 else ''} as DTensors of fixed shapes, which "
                "slicing cannot change; use prune_mode='mask' (or 'auto'), then rank_adaptation.shrink_ on the "
                "unsharded model")
        return mode

    def _resolve_gate_scales(self) -> list[float]:
        """Each layer's gate step multiplier (``gate_lr_scale``): ``"auto"`` gives 10 to gates that would
        otherwise step at the cores' lr (in a parameter group with parameters that are not gates, as a
        ``model.parameters()`` optimizer has them, or in a group of their own whose lr is no higher than
        the group of the layer's cores, as ``cc.param_groups`` makes by default), 1 to gates whose own
        group is faster than the cores'."""
        gate_ids = {id(lay.param.gate_flat) for lay in self.layers}
        group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        scales = []
        for lay in self.layers:
            group = group_of.get(id(lay.param.gate_flat))
            if group is None:  # frozen gates: not in the optimizer
                scales.append(1.0)
            elif self.gate_lr_scale != "auto":
                scales.append(float(self.gate_lr_scale))
            else:
                shared = any(id(p) not in gate_ids for p in group["params"])
                cores = group_of.get(id(lay.param.core_flat))
                slow = cores is not None and _lr(group) <= _lr(cores)
                scales.append(_AUTO_GATE_LR_SCALE if shared or slow else 1.0)
        if self.gate_lr_scale == "auto" and any(s != 1.0 for s in scales):
            log.info("RankAdaptation: the rank gates would step at the cores' lr; their optimizer steps are "
                     "scaled by %g (gate_lr_scale='auto'; a gate group faster than the cores' keeps its own lr)",
                     _AUTO_GATE_LR_SCALE)
        return scales

    def _warn_if_gates_are_slow(self, slow_steps: int = 500) -> None:
        """Under Adam-type optimizers a parameter moves by at most about its learning rate per step,
        so the gates' learning rate (times ``gate_lr_scale``) bounds how soon any gate can reach the
        threshold."""
        scale_of = {id(lay.param.gate_flat): s for lay, s in zip(self.layers, self._gate_scales)}
        for group in self.optimizer.param_groups:
            lr = group.get("initial_lr", group.get("lr"))
            if "betas" not in group or not isinstance(lr, (int, float)) or lr <= 0:
                continue
            gates = [p for p in group["params"] if id(p) in scale_of]
            if not gates:
                continue
            scale = min(scale_of[id(g)] for g in gates)
            start = max(float(g.detach().abs().max()) for g in gates if g.numel())
            steps = (start - self.threshold) / (lr * scale)
            if steps > slow_steps:
                at = f"lr {lr * scale:g}" + (f" (lr {lr:g} x gate_lr_scale {scale:g})" if scale != 1 else "")
                warnings.warn(
                    f"RankAdaptation: the rank gates train at {at}; an Adam-type optimizer moves a "
                    f"parameter by at most ~lr per step, so no gate can fall from {start:g} to the pruning "
                    f"threshold {self.threshold:g} in fewer than {steps:,.0f} steps. Give the gates a larger "
                    "learning rate (cc.param_groups(model, lr=..., gate_lr=...)) or raise RankAdaptation's "
                    "gate_lr_scale.",
                    stacklevel=3)
                return

    # ------------------------------------------------------------------------------ the loss

    def observe(self, loss: torch.Tensor | float) -> None:
        """Record this step's training loss (needed for the late stage and the automatic switch
        when the model does not return its loss)."""
        self._pending_loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))

    @torch._dynamo.disable
    def _capture_output(self, module, args, output) -> None:
        loss = _loss_of(output)
        if loss is not None and module.training:
            self._pending_loss = loss.detach()

    def _consume_loss(self) -> None:
        loss, self._pending_loss = self._pending_loss, None
        dist = distributed.world()
        if dist is not None:
            loss = distributed.mean_over_processes(dist, loss, self.layers[0].param.gate_flat.device)
        if loss is None:
            return
        value = float(loss)
        if not math.isfinite(value):
            return
        d = self.loss_ema_decay
        self.loss_avg = value if self.loss_avg is None else d * self.loss_avg + (1 - d) * value
        self._loss_peak = self.loss_avg if self._loss_peak is None else max(self._loss_peak, self.loss_avg)
        self._loss_trace.append(self.loss_avg)
        del self._loss_trace[: -(self.converge_window + 1)]

    # ------------------------------------------------------------------------------ sizes

    def relaxed_size(self) -> float:
        """``S(g)``: ``sum c_k * rho_{k-1} * rho_k`` over the layers, ``rho = ||g||_1`` (unnormalized)."""
        return self.objective.relaxed_size()

    def ranks(self) -> dict[str, list[int]]:
        """Current internal ranks of every layer: each bond's number of gates, 0 on every bond of a
        zeroed layer (one whose bond lost every gate with ``min_rank=0``: its cores are kept at
        rank 1, all zero). The same numbers come back from a checkpoint: a zeroed layer is
        recognized by its gates (all zero on a bond), with or without the ranker's state."""
        out = {}
        for lay in self.layers:
            sizes = list(lay.param.gate_sizes)
            mask = self._masks.get(lay.fqn)
            if mask is not None:  # prune_mode "mask": the gates not masked
                sizes = [int(m.sum()) for m in mask.split(lay.param.gate_sizes)]
            out[lay.fqn] = [0 if lay.fqn in self.dead else n for n in sizes]
        return out

    def _find_dead(self) -> list[str]:
        """The layers whose weight is zero for good (a bond with every gate exactly zero)."""
        return [lay.fqn for lay in self.layers if pruning.is_zeroed(lay.param)]

    def _stored_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _zeroed(self) -> set[int]:
        dead = set(self.dead)
        return {i for i, lay in enumerate(self.layers) if lay.fqn in dead}

    def num_params(self) -> int:
        """The model's parameters as they are now (cores and gates included); with ``prune_mode="mask"``
        each bond counted at its gates that are not masked (what :func:`shrink_` leaves)."""
        stored = self._stored_params()
        if self.prune_mode != "mask" or not self._masks:
            return stored
        return self.objective.effective_params(stored, threshold=torch.finfo(torch.float32).tiny, min_rank=0,
                                               rank_multiple=1, zeroed=self._zeroed())

    def effective_params(self, params: int | None = None) -> int:
        """The model's parameters (``params``: :meth:`num_params`, if known) with each bond's rank
        counted as the rank :meth:`prune` would leave it now: its gates >= threshold, at least
        ``min_rank``, rounded up to ``rank_multiple`` (a layer that would lose a bond counts 0)."""
        if self.prune_mode == "mask" or params is None:
            params = self._stored_params()  # the layers' own counts are replaced, from their stored size
        return self.objective.effective_params(params, threshold=self.threshold, min_rank=self.min_rank,
                                               rank_multiple=self.rank_multiple, zeroed=self._zeroed())

    # ------------------------------------------------------------------------------ stages

    def switch_stage(self) -> None:
        """Switch to the late stage now (the loss target is taken from the loss average)."""
        if self.stage == "late":
            return
        self.stage = "late"
        self.switch_step = self.step
        if self.loss_avg is not None:
            self.loss_target = self.loss_avg * (1 + self.loss_tolerance)
        elif not self._warned_no_loss:
            self._warned_no_loss = True
            warnings.warn("RankAdaptation: late stage without an observed loss (the model's output is not a "
                          "scalar loss and observe() was not called): the loss side of the target point is "
                          "ignored", stacklevel=2)
        log.info("RankAdaptation: late stage from step %d (loss target %s, size target %.0f parameters)",
                 self.step, "n/a" if self.loss_target is None else f"{self.loss_target:.4f}", self.target_params)

    def _maybe_switch(self) -> None:
        if self.stage != "early" or self.switch == "manual":
            return
        if isinstance(self.switch, int):
            if self.step >= self.switch:
                self.switch_stage()
            return
        if self.step < self.min_early_steps:
            return
        if self.step > 0 and self.effective_params() <= self.target_params:
            self.switch_stage()
            return
        if self._converged():
            self.switch_stage()

    def _converged(self) -> bool:
        """The loss EMA improved over the last ``converge_window`` steps by less than ``converge_tol``
        of its value then, or by less than ``converge_tol`` of all its progress so far (from its
        highest value to now): the second holds too for a loss that keeps falling by a constant
        factor toward zero, which the first never sees as converged."""
        trace = self._loss_trace
        if len(trace) <= self.converge_window:
            return False
        old, new = trace[0], trace[-1]
        progress = max(self._loss_peak - new, 0.0) if self._loss_peak is not None else 0.0
        return old - new < self.converge_tol * max(abs(old), progress)

    def _penalty_weight(self) -> float:
        if self.stage == "early":
            return self.gamma
        b = (self.effective_params() - self.target_params) / self.target_params
        a = 0.0
        if self.loss_target is not None and self.loss_avg is not None:
            a = (self.loss_avg - self.loss_target) / abs(self.loss_target)
        return self.late_gamma if b > max(a, 0.0) else self.augment * self.late_gamma

    # ------------------------------------------------------------------------------ hooks

    @torch.no_grad()
    def penalty_gradients(self, gamma: float | torch.Tensor) -> list[list[torch.Tensor]]:
        """``d(gamma * S(g) / W_0) / dg`` for every layer's gates (``gamma`` in loss units)."""
        pushes = self.objective.penalty(gamma, self.min_rank, self._live())
        return [list(push.split(layer.param.gate_sizes)) for layer, push in zip(self.layers, pushes)]

    def _live(self) -> tuple | None:
        """``prune_mode="mask"``: per layer, per bond, the gates not masked (None: every gate is live)."""
        if not self._masks:
            return None
        ranks = self.ranks()
        return tuple(tuple(ranks[lay.fqn]) if lay.fqn in self._masks else tuple(lay.param.gate_sizes)
                     for lay in self.layers)

    def _update_grad_ref(self) -> None:
        """Fold this step's mean ``|dL/dg|`` over the live gates into the running mean (no host sync;
        masked gates left out)."""
        live = [lay for lay in self.layers if lay.fqn not in self.dead and lay.param.gate_flat.grad is not None]
        if not live:
            return
        grads = [lay.param.gate_flat.grad for lay in live]
        if any(lay.fqn in self._masks for lay in live):  # the gates not masked, as slicing would leave them
            grads = [sharded.full(g).index_select(0, self._device_masks[lay.fqn][0]) if lay.fqn in self._masks
                     else g for lay, g in zip(live, grads)]
        mean = mean_abs(grads)
        d = self.grad_ema
        self._grad_ref = mean if self._grad_ref is None else d * self._grad_ref + (1 - d) * mean

    def _unit(self) -> float | torch.Tensor | None:
        """``u``: what ``gamma`` is measured in (None: no loss gradient seen yet)."""
        return 1.0 if self.scale == "absolute" else self._grad_ref

    @torch.no_grad()
    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self.prune_mode == "mask" and not self._masks_read:
            self._read_masks()
        self._consume_loss()
        self._maybe_switch()
        if self.scale == "grad":
            self._update_grad_ref()
        self._gamma_t = self._penalty_weight()
        self._snapshot_scaled_gates()
        unit = self._unit()
        if self._gamma_t == 0 or unit is None:
            return
        grads, pushes = [], []
        for layer, push in zip(self.layers, self.objective.penalty(self._gamma_t * unit, self.min_rank, self._live())):
            flat = layer.param.gate_flat
            if layer.fqn in self.dead or not flat.requires_grad or not push.numel():
                continue
            if flat.grad is None:
                flat.grad = sharded.like(push.to(flat.dtype, copy=True), flat)
            else:
                grads.append(sharded.local(flat.grad))
                pushes.append(sharded.local(sharded.like(push.to(flat.grad.dtype), flat.grad)))
        if grads:
            torch._foreach_add_(grads, pushes)

    def _snapshot_scaled_gates(self) -> None:
        """The gates whose step ``gate_lr_scale`` multiplies, as they are before the step."""
        chosen = [(lay.param.gate_flat, s) for lay, s in zip(self.layers, self._gate_scales)
                  if s != 1.0 and lay.fqn not in self.dead and lay.param.gate_flat.requires_grad]
        copies = torch._foreach_mul([sharded.local(p.detach()) for p, _ in chosen], 1.0) if chosen else []  # 1 launch
        self._scaled = [(p, s, copy) for (p, s), copy in zip(chosen, copies)]

    def _scale_gate_steps(self) -> None:
        """``g <- g_before + scale * (g - g_before)``: for SGD, Adam(W), RMSprop, ... the step the
        gates would take at ``scale`` times their group's lr."""
        scaled, self._scaled = self._scaled, []
        by_scale: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for param, s, before in scaled:
            data = sharded.local(param.data)
            if data.shape != before.shape:  # resized by someone inside the step: leave it
                continue
            params, deltas = by_scale.setdefault(s, ([], []))
            params.append(data)
            deltas.append(before)
        for s, (params, befores) in by_scale.items():
            torch._foreach_sub_(befores, params)  # before - after = -step
            torch._foreach_add_(params, befores, alpha=-(s - 1.0))

    @torch.no_grad()
    def _post_step(self, optimizer, args, kwargs) -> None:
        self._scale_gate_steps()
        self._apply_masks()
        self.step += 1
        if self.prune_every and self.step % self.prune_every == 0:
            self.prune()
        self._record()

    def _record(self) -> None:
        params = self.num_params()
        self.history.append({
            "step": self.step, "stage": self.stage, "gamma": self._gamma_t, "ranks": self.ranks(),
            "params": params, "effective_params": self.effective_params(params),
            "compression": self.dense_params / max(params, 1), "loss_avg": self.loss_avg,
        })

    # ------------------------------------------------------------------------------ pruning

    def on_prune(self, callback: Callable[["RankAdaptation"], None]) -> None:
        """Call ``callback(ranker)`` after every pruning event that changed parameter shapes
        (e.g. to re-wrap a DistributedDataParallel model)."""
        self._callbacks.append(callback)

    def _read_masks(self) -> None:
        """``prune_mode="mask"``: the layers whose gates are already partly exactly zero (masked before a
        checkpoint was saved) keep them zero."""
        self._masks_read = True
        for layer in self.layers:
            gates = sharded.full(layer.param.gate_flat.detach()).float().cpu()
            if layer.fqn not in self._masks and bool((gates == 0).any()):
                self._set_mask(layer, (gates != 0).float())

    def _set_mask(self, layer: _RankedLayer, mask: torch.Tensor) -> None:
        """``mask`` (CPU, 1: kept) for ``layer``'s gates, and on the device: the kept positions (for the
        gradient scale) and the mask laid out as this process's shard of ``gate_flat`` (for the step)."""
        flat = layer.param.gate_flat
        self._masks[layer.fqn] = mask
        kept = mask.nonzero().flatten().to(flat.device)
        self._device_masks[layer.fqn] = (kept, sharded.local(sharded.like(mask.to(flat.device, flat.dtype), flat)))

    def _apply_masks(self) -> None:
        """Hold the masked gates at zero (the optimizer's step moved them): one launch."""
        pairs = [(sharded.local(lay.param.gate_flat.data), self._device_masks[lay.fqn][1])
                 for lay in self.layers if lay.fqn in self._masks]
        if pairs:
            torch._foreach_mul_([p for p, _ in pairs], [m for _, m in pairs])

    def _kill(self, layer: _RankedLayer) -> None:
        """Rank 1 on every bond, everything zero: the layer's weight is zero for good (``prune_mode=
        "mask"``: every gate masked)."""
        if self.prune_mode == "mask":
            self._set_mask(layer, torch.zeros(layer.param.gate_flat.numel()))
            self._apply_masks()
        else:
            pruning.zero_layer(layer.param, self.optimizer)
        self.dead.append(layer.fqn)
        warnings.warn(f"RankAdaptation: step {self.step}: every rank gate of a bond of {layer.fqn} fell below "
                      f"the threshold {self.threshold:g} and min_rank=0 lets the bond go: the layer's weight is "
                      "zero from now on (only its bias is left). Set min_rank >= 1 to keep every layer.",
                      stacklevel=2)

    def _warn_if_floored(self, layer: _RankedLayer, mags: list[torch.Tensor]) -> None:
        """A bond whose every gate fell below the threshold keeps its largest ``min_rank`` gates
        instead of zeroing the layer: say so, once per layer."""
        if layer.fqn in self._floored:
            return
        k = pruning.floored_bond(mags, self.threshold)
        if k is not None:
            self._floored.add(layer.fqn)
            warnings.warn(f"RankAdaptation: step {self.step}: every rank gate of bond {k + 1} of {layer.fqn} "
                          f"fell below the threshold {self.threshold:g} (largest {float(mags[k].max()):.3g}); "
                          f"min_rank={self.min_rank} keeps the largest, so the layer stays, at rank "
                          f"{min(self.min_rank, mags[k].numel())} on that bond (without the floor the layer "
                          "would be zeroed). A weaker penalty (gamma) or a lower threshold prunes less.",
                          stacklevel=3)

    @torch.no_grad()
    def prune(self) -> bool:
        """Remove the gates below the threshold now (``prune_mode="mask"``: set them to zero and hold them
        there); returns whether any shape changed (masked: whether any gate was newly masked)."""
        masking = self.prune_mode == "mask"
        if masking and not self._masks_read:
            self._read_masks()
        changed = False
        mags = pruning.decision_magnitudes([lay.param for lay in self.layers])
        for layer, layer_mags in zip(self.layers, mags):
            if layer.fqn in self.dead:
                continue
            param = layer.param
            keeps = [pruning.surviving(m, self.threshold, self.min_rank, self.rank_multiple) for m in layer_mags]
            if any(k.numel() == 0 for k in keeps):
                before = list(param.core_shapes)
                self._kill(layer)
                changed |= masking or before != param.core_shapes
                continue
            self._warn_if_floored(layer, layer_mags)
            changed |= self._mask_bonds(layer, keeps) if masking else pruning.slice_bonds(param, keeps, self.optimizer)
        if changed:
            self.prune_events += 1
            if masking:
                self._apply_masks()
            else:
                self._raise_recompile_limit()
            log.info("RankAdaptation: step %d %s to %s (%d parameters, %.1fx)", self.step,
                     "masked" if masking else "pruned", self.ranks(), self.num_params(),
                     self.dense_params / max(self.num_params(), 1))
            if not masking:  # the shapes changed
                for callback in self._callbacks:
                    callback(self)
        return changed

    def _mask_bonds(self, layer: _RankedLayer, keeps: list[torch.Tensor]) -> bool:
        """Mask every gate of ``layer`` outside ``keeps`` (and keep those masked before masked); returns
        whether any gate was newly masked."""
        mask = pruning.keep_mask(layer.param, keeps)
        previous = self._masks.get(layer.fqn)
        if previous is not None:
            mask = mask * previous
        if not bool((mask < (1.0 if previous is None else previous)).any()):
            return False
        self._set_mask(layer, mask)
        return True

    def _raise_recompile_limit(self) -> None:
        self._limit_base = pruning.raise_recompile_limit(self._limit_base,
                                                         self.recompiles_per_event * self.prune_events)

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "stage": self.stage, "switch_step": self.switch_step,
            "loss_avg": self.loss_avg, "loss_target": self.loss_target, "prune_events": self.prune_events,
            "dead": list(self.dead), "loss_trace": list(self._loss_trace), "gamma_t": self._gamma_t,
            "grad_ref": None if self._grad_ref is None else self._grad_ref.item(),
            "history": [dict(h) for h in self.history], "limit_base": self._limit_base,
            "size_ref": self.objective.size_ref, "loss_peak": self._loss_peak,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ranker (load the model's and the optimizer's state dicts too: the model's
        resizes the cores to the saved ranks)."""
        self.step = int(state["step"])
        if state["stage"] not in _STAGES:
            raise ValueError(f"RankAdaptation.load_state_dict: unknown stage {state['stage']!r}")
        self.stage = state["stage"]
        self.switch_step = state["switch_step"]
        self.loss_avg = state["loss_avg"]
        self.loss_target = state["loss_target"]
        self.prune_events = int(state["prune_events"])
        dead = set(state["dead"]) | set(self._find_dead())
        self.dead = [lay.fqn for lay in self.layers if lay.fqn in dead]
        self._loss_trace = list(state["loss_trace"])
        self._loss_peak = state.get("loss_peak", max(self._loss_trace, default=None))
        self._gamma_t = state["gamma_t"]
        ref = state.get("grad_ref")
        device = self.layers[0].param.gate_flat.device
        self._grad_ref = None if ref is None else torch.tensor(ref, dtype=torch.float32, device=device)
        self.history = [dict(h) for h in state["history"]]
        self._limit_base = state.get("limit_base")
        self._masks, self._device_masks, self._masks_read = {}, {}, False  # re-read from the loaded gates next step
        self.objective.size_ref = float(state["size_ref"])  # W_0 of the model as first built, not as loaded
        if self.prune_events and self.prune_mode == "slice":
            self._raise_recompile_limit()

    def remove(self) -> None:
        """Unregister the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------------------ plot

    def plot(self, path: str, *, losses: Iterable[tuple[int, float]] | None = None) -> None:
        """Ranks per layer, model size / compression and the penalty weight over the steps
        (matplotlib, an optional dependency). ``losses``: optional ``(step, loss)`` pairs to add."""
        plot_history(path, self.history, [lay.fqn for lay in self.layers], dense_params=self.dense_params,
                     target_compression=self.target_compression, switch_step=self.switch_step, losses=losses)
