"""Rank-adaptive training (CoMERA's multi-objective rank control) as optimizer-step hooks.

``RankAdaptation(model, optimizer, target_compression=...)`` registers two hooks on the optimizer;
the user's model, loss and training loop stay as they are:

* **step pre-hook** adds ``d(gamma_t * S(g)) / dg`` to the rank gates' gradients. ``S`` is the size
  of the tensor-train layers as a function of the gates, ``S = sum_layers sum_k c_k * rho_{k-1} * rho_k``
  with ``rho_k = ||g_k||_1`` (the l0 "rank" of bond k relaxed to l1; ``rho_0 = rho_d = 1``), divided
  by ``W_0``, the mean over all gates of ``dS/d|g|`` when the ranker was built, so that ``gamma`` is the
  average gate's penalty gradient at the start in units of ``u``. With ``scale="grad"`` (default)
  ``u`` is the gates' own loss-gradient scale: a running mean (``grad_ema``) of the mean ``|dL/dg|``
  over all gates, taken each step before the penalty is added (so after any gradient clipping). The
  penalty then holds the same ratio to the loss pull whatever the loss, its scale or the model size:
  ``gamma=1`` (default) pushes the average gate as hard as the loss pulls the average gate, and a gate
  whose own loss gradient is weaker than its push drifts to zero. (Under Adam the push's absolute size
  barely matters, only its ratio to the gradient a gate already gets; gate loss gradients are
  ~5e-4 in a small MSE regression and ~3e-3 in examples/train_lm.py, so no absolute weight suits
  both.) ``scale="absolute"``: ``u = 1``, ``gamma`` in loss units.
  ``c_k`` is core k's chain mode ``s_k`` (``weight="params"``:
  ``S`` counts core parameters, so each gate's penalty is weighted by the parameters its rank carries)
  or, with ``weight="flops"``, the per-token multiply-adds of contracting core k when the input
  streams through the cores in order (a proxy: the planner may pick another order). The gradient is
  ``gamma_t * u * sign(g_{k,i}) * (c_k rho_{k-1} + c_{k+1} rho_{k+1}) / W_0``, on every bond that
  holds more than ``min_rank`` gates (a bond at its floor cannot be pruned further: it is not pushed).
* **the gates' pace.** Under Adam a parameter moves by at most about its learning rate per step,
  so the gates' learning rate bounds how soon any gate reaches the threshold. ``cc.param_groups``
  trains them at 10x the model's lr; with ``gate_lr_scale="auto"`` (default) gates that share a
  parameter group with other parameters (``torch.optim.AdamW(model.parameters())``) get the same:
  the post-hook multiplies their step by 10 (``g <- g_before + 10 * (g - g_before)``, for SGD,
  Adam(W), RMSprop, ... exactly the step at 10x their group's lr, weight decay included; the
  optimizer's state is untouched). Gates in a group of their own keep their group's lr; a number
  scales every gate's step by it.
* **step post-hook** prunes every ``prune_every`` steps: per bond, gates with ``|g| < threshold``
  are removed, keeping at least ``min_rank`` (default 1: the largest), and the cores on both sides
  are sliced physically (each layer's flat core and gate Parameters re-laid out by one gather, same
  Parameter objects; see ``TTParametrization.relayout_``); the surviving gates keep their values (no
  rescaling), so the layer computes exactly what it computed with the pruned gates set to zero.
  With ``rank_multiple=8`` the surviving rank is rounded up (largest gates first, never above the
  current rank). Every optimizer state tensor of a parameter's shape (Adam's
  ``exp_avg``/``exp_avg_sq``, ``max_exp_avg_sq``, SGD's ``momentum_buffer``, ...) and the gradient
  are gathered the same way. Only with ``min_rank=0`` can a bond lose every gate; that makes the
  layer's weight zero, with a warning naming the layer: the layer keeps rank 1 on every bond with
  cores, gates and their optimizer state zeroed (the TT kernels need ranks >= 1), so it stays a zero
  (bias-only) layer: all its gradients and Adam updates are exactly zero from then on, and
  :meth:`RankAdaptation.ranks` reports 0 on its bonds (also for the layer loaded from a checkpoint:
  its all-zero gates say so).

**Stages.** Early: linear scalarization, ``gamma_t = gamma``. Late: achievement scalarization
toward the target point ``(L*, S*)``: ``L* = (1 + loss_tolerance) * EMA(loss)`` at the switch,
``S* = dense_params / target_compression`` (the whole model, as ``compression_report`` counts it).
With the relative gaps ``a = (EMA(loss) - L*) / L*`` and ``b = (size - S*) / S*`` (size: the model
with each bond at the rank a pruning event would leave it now, :meth:`RankAdaptation.effective_params`),
the max term is the size term when ``b > max(a, 0)``: ``gamma_t = late_gamma``; otherwise only the
augmentation term pushes the size:
``gamma_t = augment * late_gamma`` (the loss term's gradient is the user's own backward).
The switch happens at step ``switch`` (an int), when the early stage has converged
(``switch="auto"``, from step ``min_early_steps`` on: over the last ``converge_window`` steps the
loss EMA improved by less than ``converge_tol`` of its value, or by less than ``converge_tol`` of
its whole descent so far, from its highest value to now, which also ends the early stage of a loss
that keeps falling toward zero by a constant factor per window; or the size target is already met),
or by :meth:`switch_stage` (``switch="manual"``).

**The loss.** With ``loss_from="output"`` (default) a forward hook on ``model`` records the scalar
loss in its output: the output itself (a model that returns its loss, as ``model(x, labels)`` does in
examples/train_lm.py), its ``loss`` attribute (a Hugging Face ``ModelOutput`` with ``labels=``) or its
``"loss"`` entry (a dict); otherwise call :meth:`observe` with the loss each step (``loss_from="observe"``
turns the hook off). The hook records in training mode only and is ``torch._dynamo.disable``'d,
so it never enters a compiled graph. The penalty is added in the step, i.e. after any gradient
clipping the loop does.

**Compiled models.** Dynamo guards on parameter shapes (parameters are static), so the compiled
model recompiles once after a pruning event that changes shapes and the comera planner re-plans
(its plans are keyed on the ranks). Each such event raises ``torch._dynamo.config.recompile_limit``
by ``recompiles_per_event`` when needed (logged), so the old entries never push the model to eager.

**Distributed.** With ``torch.distributed`` initialized, the observed loss is averaged over the
ranks each step and the gate values that decide a pruning event are broadcast from rank 0, so every
rank makes the same decisions. Changing parameter shapes invalidates a ``DistributedDataParallel``
wrapper's buckets: re-wrap the model in an :meth:`on_prune` callback.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn

from comera_compile import tt
from comera_compile.tensorize import TTParametrization, compression_report, iter_tt_layers

log = logging.getLogger(__name__)

__all__ = ["RankAdaptation", "size_coefficients"]

_WEIGHTS = ("params", "flops")
_SCALES = ("grad", "absolute")
_STAGES = ("early", "late")
_AUTO_GATE_LR_SCALE = 10.0  # the gates' lr / the model's in cc.param_groups (CoMERA's ratio)


def size_coefficients(spec: tt.TTSpec, weight: str = "params") -> list[float]:
    """``c_k`` of every core: the size of a layer is ``sum_k c_k * r_{k-1} * r_k``.

    ``"params"``: the core's chain mode ``s_k`` (its parameters per unit of ``r_{k-1} * r_k``).
    ``"flops"``: 2x the multiply-adds per token of contracting core k when the input streams
    through the cores in order (TT Linear: the input modes one by one, then the output modes grow;
    TT-matrix Linear: input mode k out, output mode k in; Embedding: the left-to-right product of
    the looked-up slices, ``prod(col_modes[:k+1])`` wide).
    """
    if weight not in _WEIGHTS:
        raise ValueError(f"weight must be one of {_WEIGHTS}, got {weight!r}")
    if weight == "params":
        return [float(s) for s in spec.sizes]
    rm, cm, d = spec.row_modes, spec.col_modes, spec.n_cores
    embedding = not spec.transpose  # Linear layers are stored transposed (rows = in_features)
    if embedding:
        if spec.fmt == "tt":
            modes = [1] * len(rm) + list(cm)  # row cores are gathered; column cores spread out
            return [2.0 * math.prod(modes[: k + 1]) for k in range(d)]
        return [2.0 * math.prod(cm[: k + 1]) for k in range(d)]
    if spec.fmt == "tt":
        a = len(rm)
        out = [2.0 * rm[k] * math.prod(rm[k + 1:]) for k in range(a)]
        out += [2.0 * math.prod(cm[: k - a + 1]) for k in range(a, d)]
        return out
    return [2.0 * math.prod(cm[: k + 1]) * rm[k] * math.prod(rm[k + 1:]) for k in range(d)]


class _RankedLayer(NamedTuple):
    """A layer the ranker adapts: its name and its parametrization, whose ``cores``, ``gates`` and
    ``spec`` are read afresh after every pruning event. (The views an ``iter_tt_layers`` entry holds go
    stale at a pruning event, and as non-leaf tensors they would make ``copy.deepcopy(model)`` fail:
    the model's forward hook holds the ranker.)"""

    fqn: str
    param: TTParametrization


class _GateLayout(NamedTuple):
    """Every layer's ``gate_flat`` laid end to end (``key``: their sizes and device): the bond of
    each gate entry, and per bond its coefficients and neighbours, so that the penalty and the
    effective size are a few tensor ops per step whatever the number of layers and bonds."""

    key: tuple
    bond_of: torch.Tensor  # [entries] global bond index of each gate entry
    left: torch.Tensor  # [bonds] position of the left neighbour's l1 norm in [1, rho...] (0: none, rho = 1)
    right: torch.Tensor  # [bonds] the same for the right neighbour
    c_left: torch.Tensor  # [bonds] c_k of the core on the bond's left
    c_right: torch.Tensor  # [bonds] c_{k+1} of the core on its right
    active: torch.Tensor  # [bonds] 1.0 where the bond holds more than min_rank gates (0: nothing to prune)
    entries: list[int]  # gate entries per layer


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


def _collective_device(dist, default: torch.device) -> torch.device:
    """NCCL only reduces CUDA tensors; gloo takes CPU tensors (and CUDA ones)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if default.type != "cuda" else default


def _dist_world():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class RankAdaptation:
    """Rank-adaptive training of every tensor-train layer of ``model`` through ``optimizer``'s step.

    Build it after ``tensorize_`` and the optimizer, before (or after) ``torch.compile``; pass the
    uncompiled module (a compiled one is unwrapped). See the module docstring for the objective.

    Options:
      * ``target_compression``: dense parameters / parameters that the late stage aims for.
      * ``gamma``: early-stage penalty weight; ``late_gamma`` (default ``gamma``) the late stage's;
        ``augment``: the late stage's weight when the size is not the worse objective.
      * ``scale``: ``"grad"`` (the weights are relative to the gates' loss-gradient scale, a running
        mean with decay ``grad_ema``) or ``"absolute"`` (in loss units).
      * ``weight``: ``"params"`` or ``"flops"``: what each gate's penalty is weighted by.
      * ``prune_every`` (steps), ``threshold`` (gate magnitude), ``rank_multiple`` (1, 8, 16, ...).
      * ``min_rank`` (default 1): the fewest gates a bond keeps, so no layer is deleted; 0 lets a
        bond go and its layer become zero (with a warning).
      * ``gate_lr_scale``: ``"auto"`` (default: 10 for gates sharing a parameter group with other
        parameters, 1 for gates in groups of their own, as ``cc.param_groups`` makes) or a number
        > 0: the gates' optimizer step is multiplied by it (their lr, for torch's first-order
        optimizers).
      * ``switch``: ``"auto"``, ``"manual"`` or a step number; ``converge_window`` (steps, >= 1),
        ``converge_tol``, ``min_early_steps``: the automatic switch; ``loss_ema``: the loss's
        running-average decay; ``loss_tolerance``: the late stage's loss target above the average.
      * ``loss_from``: ``"output"`` (forward hook on the model's scalar output) or ``"observe"``.
      * ``recompiles_per_event``: how far the Dynamo recompile limit is raised per shape change.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        target_compression: float,
        *,
        gamma: float = 1.0,
        late_gamma: float | None = None,
        augment: float = 0.1,
        scale: str = "grad",
        grad_ema: float = 0.9,
        weight: str = "params",
        prune_every: int = 50,
        threshold: float = 1e-2,
        rank_multiple: int = 1,
        switch: int | str = "auto",
        converge_window: int = 100,
        converge_tol: float = 0.01,
        min_early_steps: int = 0,
        loss_ema: float = 0.95,
        loss_tolerance: float = 0.02,
        loss_from: str = "output",
        recompiles_per_event: int = 2,
        min_rank: int = 1,
        gate_lr_scale: float | str = "auto",
    ) -> None:
        if not target_compression > 0:
            raise ValueError(f"RankAdaptation: target_compression must be > 0, got {target_compression}")
        if weight not in _WEIGHTS:
            raise ValueError(f"RankAdaptation: weight must be one of {_WEIGHTS}, got {weight!r}")
        if not (isinstance(switch, int) and not isinstance(switch, bool) and switch >= 0) and switch not in (
                "auto", "manual"):
            raise ValueError(f"RankAdaptation: switch must be 'auto', 'manual' or a step number >= 0, got {switch!r}")
        if loss_from not in ("output", "observe"):
            raise ValueError(f"RankAdaptation: loss_from must be 'output' or 'observe', got {loss_from!r}")
        if not isinstance(prune_every, int) or prune_every < 0:
            raise ValueError(f"RankAdaptation: prune_every must be an int >= 0 (0: never), got {prune_every!r}")
        if not isinstance(rank_multiple, int) or rank_multiple < 1:
            raise ValueError(f"RankAdaptation: rank_multiple must be a positive int, got {rank_multiple!r}")
        for name, value in (("gamma", gamma), ("augment", augment), ("threshold", threshold),
                            ("late_gamma", 0.0 if late_gamma is None else late_gamma)):
            if not value >= 0:
                raise ValueError(f"RankAdaptation: {name} must be >= 0, got {value}")
        if not 0 <= loss_ema < 1:
            raise ValueError(f"RankAdaptation: loss_ema must be in [0, 1), got {loss_ema}")
        if scale not in _SCALES:
            raise ValueError(f"RankAdaptation: scale must be one of {_SCALES}, got {scale!r}")
        if not 0 <= grad_ema < 1:
            raise ValueError(f"RankAdaptation: grad_ema must be in [0, 1), got {grad_ema}")
        if not isinstance(min_rank, int) or isinstance(min_rank, bool) or min_rank < 0:
            raise ValueError(f"RankAdaptation: min_rank must be an int >= 0 (0: a layer may lose a whole bond "
                             f"and become zero), got {min_rank!r}")
        if gate_lr_scale != "auto" and not (isinstance(gate_lr_scale, (int, float))
                                            and not isinstance(gate_lr_scale, bool) and gate_lr_scale > 0
                                            and math.isfinite(gate_lr_scale)):
            raise ValueError(f"RankAdaptation: gate_lr_scale must be 'auto' or a number > 0, got {gate_lr_scale!r}")
        for name, value in (("converge_window", converge_window), ("min_early_steps", min_early_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "converge_window" else 0):
                raise ValueError(f"RankAdaptation: {name} must be an int >= "
                                 f"{1 if name == 'converge_window' else 0}, got {value!r}")
        if not converge_tol >= 0:
            raise ValueError(f"RankAdaptation: converge_tol must be >= 0, got {converge_tol}")
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
        self.target_compression = float(target_compression)
        self.gamma = float(gamma)
        self.late_gamma = float(gamma if late_gamma is None else late_gamma)
        self.augment = float(augment)
        self.scale = scale
        self.grad_ema = float(grad_ema)
        self.weight = weight
        self.prune_every = prune_every
        self.threshold = float(threshold)
        self.rank_multiple = rank_multiple
        self.switch = switch
        self.converge_window = int(converge_window)
        self.converge_tol = float(converge_tol)
        self.min_early_steps = int(min_early_steps)
        self.loss_ema_decay = float(loss_ema)
        self.loss_tolerance = float(loss_tolerance)
        self.recompiles_per_event = int(recompiles_per_event)
        self.min_rank = min_rank
        self.gate_lr_scale = gate_lr_scale
        self._gate_scales = self._resolve_gate_scales()

        report = compression_report(self.model)
        self.dense_params = report.dense_params
        self.target_params = self.dense_params / self.target_compression
        if self.target_params <= report.other_params:
            warnings.warn(
                f"RankAdaptation: target_compression={target_compression:g} allows {self.target_params:,.0f} "
                f"parameters, but the layers that are not tensor trains already hold {report.other_params:,}: "
                f"the target is unreachable (the largest reachable compression is below "
                f"{self.dense_params / max(report.other_params, 1):.1f}x); the late stage will keep pruning",
                stacklevel=2)
        self._warn_if_gates_are_slow()
        specs = [lay.param.spec for lay in self.layers]
        self._coeffs = [size_coefficients(spec, weight) for spec in specs]
        self._chain_modes = [spec.sizes for spec in specs]  # core k holds r_{k-1} * s_k * r_k parameters
        self._layout: _GateLayout | None = None
        self._size_ref = max(self._mean_gate_weight(), 1e-30)

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
        if loss_from == "output":
            self._handles.append(self.model.register_forward_hook(self._capture_output))

    def _resolve_gate_scales(self) -> list[float]:
        """Each layer's gate step multiplier (``gate_lr_scale``): ``"auto"`` gives 10 to gates that
        share a parameter group with parameters that are not gates (a ``model.parameters()``
        optimizer: the gates would train at the cores' lr), 1 to gates in groups of their own."""
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
                scales.append(_AUTO_GATE_LR_SCALE if shared else 1.0)
        if self.gate_lr_scale == "auto" and any(s != 1.0 for s in scales):
            log.info("RankAdaptation: the rank gates share a parameter group with other parameters; their "
                     "optimizer steps are scaled by %g (gate_lr_scale='auto'; cc.param_groups gives them a "
                     "group of their own at 10x lr)", _AUTO_GATE_LR_SCALE)
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
                    "learning rate: torch.optim.AdamW(cc.param_groups(model, lr=...)) trains them at 10x lr, "
                    "or raise RankAdaptation's gate_lr_scale.",
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
        dist = _dist_world()
        if dist is not None:
            # Every rank must call: a rank without a loss contributes NaN-free zeros and a count of 0.
            t = torch.zeros(2, dtype=torch.float64, device=_collective_device(dist, self.layers[0].param.gate_flat.device))
            if loss is not None:
                t[0], t[1] = loss.detach().reshape(()).to(t), 1.0
            dist.all_reduce(t)
            loss = None if t[1] == 0 else t[0] / t[1]
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

    def _gate_l1(self, layer: _RankedLayer) -> list[float]:
        return [float(g.detach().abs().sum()) for g in layer.param.gates]

    def relaxed_size(self) -> float:
        """``S(g)``: ``sum c_k * rho_{k-1} * rho_k`` over the layers, ``rho = ||g||_1`` (unnormalized)."""
        total = 0.0
        for layer, coeffs in zip(self.layers, self._coeffs):
            rho = [1.0] + self._gate_l1(layer) + [1.0]
            total += sum(c * rho[k] * rho[k + 1] for k, c in enumerate(coeffs))
        return total

    def _mean_gate_weight(self) -> float:
        """Mean over all gates of ``dS / d|g_{k,i}| = c_k rho_{k-1} + c_{k+1} rho_{k+1}``."""
        layout = self._gate_layout()
        if not layout.bond_of.numel():
            return 0.0
        return float(self._bond_weights(layout, self._all_gates())[layout.bond_of].double().mean())

    def ranks(self) -> dict[str, list[int]]:
        """Current internal ranks of every layer: each bond's number of gates, 0 on every bond of a
        zeroed layer (one whose bond lost every gate with ``min_rank=0``: its cores are kept at
        rank 1, all zero). The same numbers come back from a checkpoint: a zeroed layer is
        recognized by its gates (all zero on a bond), with or without the ranker's state."""
        return {lay.fqn: [0 if lay.fqn in self.dead else n for n in lay.param.gate_sizes] for lay in self.layers}

    def _find_dead(self) -> list[str]:
        """The layers whose weight is zero for good: a bond with every gate exactly zero (what
        :meth:`prune` leaves of a layer that lost a bond)."""
        dead = []
        for lay in self.layers:
            gates = lay.param.gate_flat.detach()
            if gates.numel() and any(not bool(g.any()) for g in gates.split(lay.param.gate_sizes)):
                dead.append(lay.fqn)
        return dead

    def num_params(self) -> int:
        """The model's parameters as they are now (cores and gates included)."""
        return sum(p.numel() for p in self.model.parameters())

    def effective_params(self, params: int | None = None) -> int:
        """The model's parameters (``params``: :meth:`num_params`, if known) with each bond's rank
        counted as the rank :meth:`prune` would leave it now: its gates >= threshold, at least
        ``min_rank``, rounded up to ``rank_multiple`` (a layer that would lose a bond counts 0)."""
        total = self.num_params() if params is None else params
        layout = self._gate_layout()
        above = (self._all_gates().abs() >= self.threshold).long()
        per_bond = above.new_zeros(len(layout.left)).index_add_(0, layout.bond_of, above)
        counts = iter(per_bond.tolist())  # one host sync
        for layer, modes in zip(self.layers, self._chain_modes):
            param = layer.param
            total -= param.core_flat.numel() + param.gate_flat.numel()
            ranks = [1] + [self._kept_rank(next(counts), size) for size in param.gate_sizes] + [1]
            if layer.fqn not in self.dead and all(ranks):  # cores and gates at those ranks
                total += sum(r * s * q for r, s, q in zip(ranks, modes, ranks[1:])) + sum(ranks[1:-1])
        return total

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

    def _gate_layout(self) -> _GateLayout:
        """The index maps over all layers' gates, rebuilt when a pruning event changed the sizes."""
        device = self.layers[0].param.gate_flat.device
        key = (device, tuple(tuple(lay.param.gate_sizes) for lay in self.layers))
        if self._layout is not None and self._layout.key == key:
            return self._layout
        bond_of, left, right, c_left, c_right, active = [], [], [], [], [], []
        for sizes, coeffs in zip(key[1], self._coeffs):
            first = len(left)  # rho of global bond j sits at j + 1 in [1, rho...]
            for k, size in enumerate(sizes):  # gate k sits on bond k + 1, between cores k and k + 1
                bond_of += [first + k] * size
                left.append(first + k if k > 0 else 0)
                right.append(first + k + 2 if k + 1 < len(sizes) else 0)
                c_left.append(coeffs[k])
                c_right.append(coeffs[k + 1])
                active.append(1.0 if size > self.min_rank else 0.0)
        self._layout = _GateLayout(
            key, *(torch.tensor(v, dtype=torch.long, device=device) for v in (bond_of, left, right)),
            *(torch.tensor(v, dtype=torch.float32, device=device) for v in (c_left, c_right, active)),
            [sum(sizes) for sizes in key[1]])
        return self._layout

    def _all_gates(self) -> torch.Tensor:
        return torch.cat([lay.param.gate_flat.detach() for lay in self.layers])

    @staticmethod
    def _bond_weights(layout: _GateLayout, gates: torch.Tensor) -> torch.Tensor:
        """``dS / d|g|`` per bond: ``c_k rho_{k-1} + c_{k+1} rho_{k+1}`` (``rho``: the gates' l1 norms)."""
        mags = gates.abs().float()
        rho = mags.new_zeros(len(layout.left)).index_add_(0, layout.bond_of, mags)
        rho = torch.cat([rho.new_ones(1), rho])
        return layout.c_left * rho[layout.left] + layout.c_right * rho[layout.right]

    def _penalty(self, gamma: float | torch.Tensor) -> list[torch.Tensor]:
        """Each layer's penalty gradient, laid out like its ``gate_flat`` (float32); tensors
        throughout, a fixed number of ops per step: no host synchronization on the GPU."""
        layout = self._gate_layout()
        gates = self._all_gates()
        weights = self._bond_weights(layout, gates) * layout.active * (gamma / self._size_ref)
        return list((torch.sign(gates).float() * weights[layout.bond_of]).split(layout.entries))

    @torch.no_grad()
    def penalty_gradients(self, gamma: float | torch.Tensor) -> list[list[torch.Tensor]]:
        """``d(gamma * S(g) / W_0) / dg`` for every layer's gates (``gamma`` in loss units)."""
        return [list(push.split(layer.param.gate_sizes)) for layer, push in zip(self.layers, self._penalty(gamma))]

    def _update_grad_ref(self) -> None:
        """Fold this step's mean ``|dL/dg|`` over the live gates into the running mean (no host sync)."""
        grads = [lay.param.gate_flat.grad for lay in self.layers
                 if lay.fqn not in self.dead and lay.param.gate_flat.grad is not None]
        if not grads:
            return
        total = torch.stack(torch._foreach_norm(grads, 1)).float().sum()
        mean = total / sum(g.numel() for g in grads)
        d = self.grad_ema
        self._grad_ref = mean if self._grad_ref is None else d * self._grad_ref + (1 - d) * mean

    def _unit(self) -> float | torch.Tensor | None:
        """``u``: what ``gamma`` is measured in (None: no loss gradient seen yet)."""
        return 1.0 if self.scale == "absolute" else self._grad_ref

    @torch.no_grad()
    def _pre_step(self, optimizer, args, kwargs) -> None:
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
        for layer, push in zip(self.layers, self._penalty(self._gamma_t * unit)):
            flat = layer.param.gate_flat
            if layer.fqn in self.dead or not flat.requires_grad or not push.numel():
                continue
            if flat.grad is None:
                flat.grad = push.to(flat.dtype, copy=True)
            else:
                grads.append(flat.grad)
                pushes.append(push.to(flat.grad.dtype))
        if grads:
            torch._foreach_add_(grads, pushes)

    def _snapshot_scaled_gates(self) -> None:
        """The gates whose step ``gate_lr_scale`` multiplies, as they are before the step."""
        chosen = [(lay.param.gate_flat, s) for lay, s in zip(self.layers, self._gate_scales)
                  if s != 1.0 and lay.fqn not in self.dead and lay.param.gate_flat.requires_grad]
        copies = torch._foreach_mul([p.detach() for p, _ in chosen], 1.0) if chosen else []  # one launch
        self._scaled = [(p, s, copy) for (p, s), copy in zip(chosen, copies)]

    def _scale_gate_steps(self) -> None:
        """``g <- g_before + scale * (g - g_before)``: for SGD, Adam(W), RMSprop, ... the step the
        gates would take at ``scale`` times their group's lr."""
        scaled, self._scaled = self._scaled, []
        by_scale: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for param, s, before in scaled:
            if param.shape != before.shape:  # resized by someone inside the step: leave it
                continue
            params, deltas = by_scale.setdefault(s, ([], []))
            params.append(param.data)
            deltas.append(before)
        for s, (params, befores) in by_scale.items():
            torch._foreach_sub_(befores, params)  # before - after = -step
            torch._foreach_add_(params, befores, alpha=-(s - 1.0))

    @torch.no_grad()
    def _post_step(self, optimizer, args, kwargs) -> None:
        self._scale_gate_steps()
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

    def _decision_gates(self) -> list[list[torch.Tensor]]:
        """The gate magnitudes the decision is made on: rank 0's under torch.distributed."""
        mags = [[g.detach().abs().float().cpu() for g in lay.param.gates] for lay in self.layers]
        dist = _dist_world()
        if dist is not None:
            flat = torch.cat([m for lay in mags for m in lay])
            flat = flat.to(_collective_device(dist, self.layers[0].param.gate_flat.device))
            dist.broadcast(flat, src=0)
            flat, i = flat.cpu(), 0
            for lay in mags:
                for k, m in enumerate(lay):
                    lay[k] = flat[i:i + m.numel()]
                    i += m.numel()
        return mags

    def _kept_rank(self, above: int, size: int) -> int:
        """The rank a bond of ``size`` gates keeps when ``above`` of them are >= the threshold: at
        least ``min_rank`` (never more than it has), rounded up to ``rank_multiple``."""
        n = max(above, self.min_rank)
        if n == 0:
            return 0
        m = self.rank_multiple
        return min(size, -(-n // m) * m)

    def _keep(self, mag: torch.Tensor) -> torch.Tensor:
        """Indices (ascending) of the gates of one bond that survive (the largest); empty: the bond
        is gone (only with ``min_rank=0``)."""
        n = self._kept_rank(int((mag >= self.threshold).sum()), mag.numel())
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        order = torch.sort(mag, descending=True, stable=True).indices[:n]
        return torch.sort(order).values

    @staticmethod
    def _keep_bond(positions: tuple[list[torch.Tensor], list[torch.Tensor]], k: int, keep: torch.Tensor) -> None:
        """Keep the ranks ``keep`` of bond ``k + 1`` in the index maps: core k's last dim, gate k, core
        k + 1's first dim."""
        cores, gates = positions
        keep = keep.to(cores[k].device)
        cores[k] = cores[k].index_select(cores[k].dim() - 1, keep)
        gates[k] = gates[k].index_select(0, keep)
        cores[k + 1] = cores[k + 1].index_select(0, keep)

    def _kill(self, layer: _RankedLayer) -> None:
        """Rank 1 on every bond, everything zero: the layer's weight is zero for good."""
        param = layer.param
        positions = param.positions()
        for k in range(len(param.gate_sizes)):
            self._keep_bond(positions, k, torch.zeros(1, dtype=torch.long))
        param.relayout_(*positions, optimizers=[self.optimizer])
        for p in (param.core_flat, param.gate_flat):
            p.data.zero_()
            if p.grad is not None:
                p.grad.zero_()
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    value.zero_()
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
        for k, mag in enumerate(mags):
            if mag.numel() and float(mag.max()) < self.threshold:
                self._floored.add(layer.fqn)
                warnings.warn(f"RankAdaptation: step {self.step}: every rank gate of bond {k + 1} of {layer.fqn} "
                              f"fell below the threshold {self.threshold:g} (largest {float(mag.max()):.3g}); "
                              f"min_rank={self.min_rank} keeps the largest, so the layer stays, at rank "
                              f"{min(self.min_rank, mag.numel())} on that bond (without the floor the layer "
                              "would be zeroed). A weaker penalty (gamma) or a lower threshold prunes less.",
                              stacklevel=3)
                return

    @torch.no_grad()
    def prune(self) -> bool:
        """Remove the gates below the threshold now; returns whether any shape changed."""
        changed = False
        mags = self._decision_gates()
        for layer, layer_mags in zip(self.layers, mags):
            if layer.fqn in self.dead:
                continue
            param = layer.param
            keeps = [self._keep(m) for m in layer_mags]
            if any(k.numel() == 0 for k in keeps):
                before = list(param.core_shapes)
                self._kill(layer)
                changed |= before != param.core_shapes
                continue
            self._warn_if_floored(layer, layer_mags)
            positions = param.positions()
            cut = False
            for k, keep in enumerate(keeps):
                if keep.numel() < param.gate_sizes[k]:
                    self._keep_bond(positions, k, keep)
                    cut = True
            if cut:
                param.relayout_(*positions, optimizers=[self.optimizer])
                changed = True
        if changed:
            self.prune_events += 1
            self._raise_recompile_limit()
            log.info("RankAdaptation: step %d pruned to %s (%d parameters, %.1fx)", self.step, self.ranks(),
                     self.num_params(), self.dense_params / max(self.num_params(), 1))
            for callback in self._callbacks:
                callback(self)
        return changed

    def _raise_recompile_limit(self) -> None:
        config = torch._dynamo.config
        names = [n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)][:1]
        names += [n for n in ("accumulated_recompile_limit", "accumulated_cache_size_limit") if hasattr(config, n)][:1]
        if not names:
            return
        if self._limit_base is None:
            self._limit_base = int(getattr(config, names[0]))
        needed = self._limit_base + self.recompiles_per_event * self.prune_events
        for name in names:
            current = int(getattr(config, name))
            if current < needed:
                setattr(config, name, needed)
                log.info("RankAdaptation: torch._dynamo.config.%s raised %d -> %d (one recompile per pruning "
                         "event)", name, current, needed)

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "stage": self.stage, "switch_step": self.switch_step,
            "loss_avg": self.loss_avg, "loss_target": self.loss_target, "prune_events": self.prune_events,
            "dead": list(self.dead), "loss_trace": list(self._loss_trace), "gamma_t": self._gamma_t,
            "grad_ref": None if self._grad_ref is None else self._grad_ref.item(),
            "history": [dict(h) for h in self.history], "limit_base": self._limit_base,
            "size_ref": self._size_ref, "loss_peak": self._loss_peak,
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
        self._size_ref = float(state["size_ref"])  # W_0 of the model as first built, not as loaded
        if self.prune_events:
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
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("RankAdaptation.plot needs matplotlib: pip install matplotlib") from None
        if not self.history:
            raise ValueError("RankAdaptation.plot: no history yet (no optimizer step was taken)")
        steps = [h["step"] for h in self.history]
        n_panels = 3 if losses is None else 4
        fig, axes = plt.subplots(n_panels, 1, figsize=(8, 2.6 * n_panels), sharex=True)
        for layer in self.layers:
            series = [sum(h["ranks"][layer.fqn]) / max(len(h["ranks"][layer.fqn]), 1) for h in self.history]
            axes[0].plot(steps, series, label=layer.fqn, lw=1)
        axes[0].set_ylabel("mean internal rank")
        if len(self.layers) <= 12:
            axes[0].legend(fontsize=6, ncol=2)
        axes[1].plot(steps, [h["compression"] for h in self.history], label="compression (actual)")
        axes[1].plot(steps, [self.dense_params / max(h["effective_params"], 1) for h in self.history],
                     ls="--", label="compression (gates >= threshold)")
        axes[1].axhline(self.target_compression, color="gray", ls=":", label="target")
        axes[1].set_ylabel("dense / params")
        axes[1].legend(fontsize=7)
        axes[2].semilogy(steps, [max(h["gamma"], 1e-30) for h in self.history])
        axes[2].set_ylabel("penalty weight")
        if self.switch_step is not None:
            for ax in axes:
                ax.axvline(self.switch_step, color="red", ls=":", lw=0.8)
        if losses is not None:
            xs, ys = zip(*losses)
            axes[3].plot(xs, ys, lw=0.8)
            axes[3].set_ylabel("loss")
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
