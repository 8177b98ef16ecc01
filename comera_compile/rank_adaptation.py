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
  ``gamma_t * u * sign(g_{k,i}) * (c_k rho_{k-1} + c_{k+1} rho_{k+1}) / W_0``.
* **step post-hook** prunes every ``prune_every`` steps: per bond, gates with ``|g| < threshold``
  are removed and the cores on both sides are sliced physically (each layer's flat core and gate
  Parameters re-laid out by one gather, same Parameter objects; see
  ``TTParametrization.relayout_``); the surviving gates keep their values (no rescaling), so the layer computes
  exactly what it computed with the pruned gates set to zero. With ``rank_multiple=8`` the surviving
  rank is rounded up (largest gates first, never above the current rank). Every optimizer state
  tensor of a parameter's shape (Adam's ``exp_avg``/``exp_avg_sq``, ``max_exp_avg_sq``, SGD's
  ``momentum_buffer``, ...) and the gradient are gathered the same way. A bond with no surviving gate
  makes the layer's weight zero: the layer keeps rank 1 on every bond with cores, gates and their
  optimizer state zeroed (the TT kernels need ranks >= 1), so it stays a zero (bias-only) layer:
  all its gradients and Adam updates are exactly zero from then on.

**Stages.** Early: linear scalarization, ``gamma_t = gamma``. Late: achievement scalarization
toward the target point ``(L*, S*)``: ``L* = (1 + loss_tolerance) * EMA(loss)`` at the switch,
``S* = dense_params / target_compression`` (the whole model, as ``compression_report`` counts it).
With the relative gaps ``a = (EMA(loss) - L*) / L*`` and ``b = (size - S*) / S*`` (size: the model
with each bond's rank counted as its gates at or above the threshold), the max term is the size term
when ``b > max(a, 0)``: ``gamma_t = late_gamma``; otherwise only the augmentation term pushes the size:
``gamma_t = augment * late_gamma`` (the loss term's gradient is the user's own backward).
The switch happens at step ``switch`` (an int), when the early stage has converged
(``switch="auto"``: the loss EMA improved by less than ``converge_tol`` relatively over
``converge_window`` steps, or the size target is already met), or by :meth:`switch_stage`
(``switch="manual"``).

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
      * ``switch``: ``"auto"``, ``"manual"`` or a step number; ``converge_window``,
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
        self.loss_target: float | None = None
        self.prune_events = 0  # pruning events that changed shapes
        self.dead: list[str] = []
        self.history: list[dict[str, Any]] = []
        self._loss_trace: list[float] = []  # loss EMA per step, the last converge_window + 1
        self._pending_loss: torch.Tensor | None = None
        self._gamma_t = self.gamma
        self._grad_ref: torch.Tensor | None = None  # scale="grad": running mean |dL/dg| (a 0-d tensor)
        self._callbacks: list[Callable[["RankAdaptation"], None]] = []
        self._warned_no_loss = False
        self._limit_base: int | None = None

        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]
        if loss_from == "output":
            self._handles.append(self.model.register_forward_hook(self._capture_output))

    def _warn_if_gates_are_slow(self, slow_steps: int = 500) -> None:
        """Under Adam-type optimizers a parameter moves by at most about its learning rate per step,
        so the gates' learning rate bounds how soon any gate can reach the threshold."""
        gate_ids = {id(lay.param.gate_flat) for lay in self.layers}
        for group in self.optimizer.param_groups:
            lr = group.get("initial_lr", group.get("lr"))
            if "betas" not in group or not isinstance(lr, (int, float)) or lr <= 0:
                continue
            gates = [p for p in group["params"] if id(p) in gate_ids]
            if not gates:
                continue
            start = max(float(g.detach().abs().max()) for g in gates if g.numel())
            steps = (start - self.threshold) / lr
            if steps > slow_steps:
                warnings.warn(
                    f"RankAdaptation: the rank gates train at lr {lr:g}; an Adam-type optimizer moves a "
                    f"parameter by at most ~lr per step, so no gate can fall from {start:g} to the pruning "
                    f"threshold {self.threshold:g} in fewer than {steps:,.0f} steps. Give the gates a larger "
                    "learning rate: torch.optim.AdamW(cc.param_groups(model, lr=...)) trains them at 10x lr.",
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
        """Current internal ranks of every layer (0 on every bond of a zeroed layer)."""
        return {lay.fqn: [0 if lay.fqn in self.dead else n for n in lay.param.gate_sizes] for lay in self.layers}

    def num_params(self) -> int:
        """The model's parameters as they are now (cores and gates included)."""
        return sum(p.numel() for p in self.model.parameters())

    def effective_params(self, params: int | None = None) -> int:
        """The model's parameters (``params``: :meth:`num_params`, if known) with each bond's rank
        counted as its gates >= threshold."""
        total = self.num_params() if params is None else params
        layout = self._gate_layout()
        above = (self._all_gates().abs() >= self.threshold).long()
        per_bond = above.new_zeros(len(layout.left)).index_add_(0, layout.bond_of, above)
        counts = iter(per_bond.tolist())  # one host sync
        for layer, modes in zip(self.layers, self._chain_modes):
            param = layer.param
            total -= param.core_flat.numel() + param.gate_flat.numel()
            ranks = [1] + [next(counts) for _ in param.gate_sizes] + [1]
            if layer.fqn not in self.dead:  # cores and gates at those ranks
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
        trace = self._loss_trace
        if len(trace) > self.converge_window:
            old, new = trace[0], trace[-1]
            if old - new < self.converge_tol * abs(old):
                self.switch_stage()

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
        bond_of, left, right, c_left, c_right = [], [], [], [], []
        for sizes, coeffs in zip(key[1], self._coeffs):
            first = len(left)  # rho of global bond j sits at j + 1 in [1, rho...]
            for k, size in enumerate(sizes):  # gate k sits on bond k + 1, between cores k and k + 1
                bond_of += [first + k] * size
                left.append(first + k if k > 0 else 0)
                right.append(first + k + 2 if k + 1 < len(sizes) else 0)
                c_left.append(coeffs[k])
                c_right.append(coeffs[k + 1])
        self._layout = _GateLayout(
            key, *(torch.tensor(v, dtype=torch.long, device=device) for v in (bond_of, left, right)),
            *(torch.tensor(v, dtype=torch.float32, device=device) for v in (c_left, c_right)),
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
        weights = self._bond_weights(layout, gates) * (gamma / self._size_ref)
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

    @torch.no_grad()
    def _post_step(self, optimizer, args, kwargs) -> None:
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

    def _keep(self, mag: torch.Tensor) -> torch.Tensor:
        """Indices (ascending) of the gates of one bond that survive; empty: the bond is gone."""
        n = int((mag >= self.threshold).sum())
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        m = self.rank_multiple
        n = min(mag.numel(), -(-n // m) * m)
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
        log.info("RankAdaptation: %s lost a whole bond; its weight is zero from now on", layer.fqn)

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
            "size_ref": self._size_ref,
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
        self.dead = list(state["dead"])
        self._loss_trace = list(state["loss_trace"])
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
