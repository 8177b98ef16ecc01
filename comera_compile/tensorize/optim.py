"""Optimizer parameter groups for tensorized models: TT cores, rank gates, and the rest.

A tensor-train weight is a product of cores and rank gates, and the two want different treatment
from the optimizer than a dense matrix does:

* **Rank gates** start at 1 and are pruned when they fall below a small threshold
  (:class:`~comera_compile.RankAdaptation`). Under Adam a parameter moves by at most about its
  learning rate per step, so at the model's learning rate (1e-3) a gate needs ~1000 steps to
  reach the threshold however strong the size penalty is. Gates get their own, larger learning rate
  (CoMERA trains them at 10x the cores' rate) and no weight decay (decay would shrink every rank
  uniformly, which is the size penalty's job, done per rank).
* **Cores** get the model's learning rate. Weight decay on the cores of a ``d``-core product acts on
  the weight roughly ``d`` times over, so it is off by default.
* **Everything else** follows the usual GPT recipe: decay on matrices and embeddings, none on
  biases and norm weights (parameters with fewer than 2 dimensions).

``torch.optim.AdamW(cc.param_groups(model, lr=1e-3))`` builds an optimizer with these groups. Every
trainable parameter appears in exactly one group (parameters shared between modules once).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_compile.tensorize.parametrization import iter_tt_layers

__all__ = ["param_groups"]

GROUP_NAMES = ("tt_cores", "tt_gates", "decay", "no_decay")


def param_groups(
    model: nn.Module,
    lr: float,
    *,
    weight_decay: float = 0.1,
    core_lr: float | None = None,
    gate_lr: float | None = None,
    core_weight_decay: float = 0.0,
    gate_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """The recommended optimizer parameter groups of ``model`` (tensorized or not).

    Groups (empty ones left out), each a dict with ``name``, ``params``, ``lr`` and ``weight_decay``:

    * ``"tt_cores"``: every TT layer's ``core_flat`` (all its cores); ``lr=core_lr`` (default ``lr``),
      ``core_weight_decay``;
    * ``"tt_gates"``: every TT layer's ``gate_flat`` (all its rank gates); ``lr=gate_lr`` (default
      ``lr``: at a fixed rank, gates at 10x the cores' lr trained worse; rank adaptation speeds its gates
      up itself, see below), ``gate_weight_decay``;
    * ``"decay"``: other parameters with 2 or more dimensions (matrices, embeddings); ``weight_decay``;
    * ``"no_decay"``: other parameters (biases, norm weights); no weight decay.

    Frozen parameters (``requires_grad=False``) are left out. Build the optimizer after
    ``tensorize_``: a dense layer tensorized later would not be in it. ``tensorize_`` empties the
    dense weight it replaces in place, so an optimizer built before it holds that empty tensor, not
    the layer's cores, and never trains them; nothing fails (the comera backend warns at such an
    optimizer's first step). A learning-rate schedule should scale each group's own ``lr``.

    The learning rate itself: a model with TT-matrix (or btt) layers trained best at a higher ``lr``
    than its dense twin. In a GPT (d 768, 6 layers, TT-matrix rank 32 on the blocks, 31 M tokens, AdamW)
    the best of a sweep was 4.8e-3 for every group, 8x the dense model's 6e-4; at the dense model's
    ``lr`` the tensorized model lost to a dense model of its size. Sweep it rather than reuse the dense
    value. btt at rank 1 (what ``TTConfig()`` gives Linear layers at least 2048 wide) wanted more: 9.6e-3
    at d 768 (16x dense's) and at d 2048 (32x the dense model's 3e-4), inside sweeps of four; over
    ~100 M tokens at d 2048, 4.8e-3. A higher rank wants less: btt rank 4 at d 2048, 2.4e-3 (8x dense's).
    In the same benchmark, gates at the cores' lr (the default) ended at 2.646 / 2.613 / 2.583
    validation loss over three seeds, against 2.778 / 2.835 over two with the gates at 10x; the dense
    model of the same width (3.5x the parameters) ended at 2.786 / 2.802.

    Rank adaptation (:class:`~comera_compile.RankAdaptation`, ``gate_lr_scale="auto"``) multiplies the
    gates' steps by 10 when their lr is no higher than the cores' (this default), so a pruning run
    keeps its fast gates; pass ``gate_lr`` to set them yourself.
    """
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("core_lr", core_lr), ("gate_lr", gate_lr),
                        ("core_weight_decay", core_weight_decay), ("gate_weight_decay", gate_weight_decay)):
        if value is not None and not value >= 0:
            raise ValueError(f"param_groups: {name} must be >= 0, got {value}")
    cores, gates = _tt_parameter_ids(model)
    buckets: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_NAMES}
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        buckets[_group_of(p, cores, gates)].append(p)
    settings = {
        "tt_cores": (lr if core_lr is None else core_lr, core_weight_decay),
        "tt_gates": (lr if gate_lr is None else gate_lr, gate_weight_decay),
        "decay": (lr, weight_decay),
        "no_decay": (lr, 0.0),
    }
    return [{"name": name, "params": buckets[name], "lr": settings[name][0], "weight_decay": settings[name][1]}
            for name in GROUP_NAMES if buckets[name]]


def _tt_parameter_ids(model: nn.Module) -> tuple[set[int], set[int]]:
    cores: set[int] = set()
    gates: set[int] = set()
    for layer in iter_tt_layers(model):
        cores.add(id(layer.param.core_flat))
        gates.add(id(layer.param.gate_flat))
    return cores, gates


def _group_of(p: nn.Parameter, cores: set[int], gates: set[int]) -> str:
    if id(p) in cores:
        return "tt_cores"
    if id(p) in gates:
        return "tt_gates"
    return "decay" if p.dim() >= 2 else "no_decay"
