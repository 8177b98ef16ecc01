"""``tensorize_`` / ``densify_``: turn ``nn.Linear`` / ``nn.Embedding`` weights into TT / TT-matrix
cores, and back.

torchao's shape: a small config dataclass and one in-place transform,
``tensorize_(model, TTConfig(rank=30), filter_fn=...)`` (``filter_fn(module, fqn) -> bool``), or a
dict ``{fqn: TTConfig}`` for per-module configs. Call it before the optimizer is built.

Each selected layer keeps its type and name; its ``weight`` becomes a ``torch.nn.utils.parametrize``
parametrization (:class:`~comera_compile.tensorize.parametrization.TTParametrization`). The dense
weight is not kept (the parametrization's ``original`` is a zero-size, non-persistent buffer). The TT
layers of one base class share one parametrized class (``ParametrizedLinear``, a subclass of it), so
blocks compiled one at a time (torchtitan, ``block.compile()``) reuse one compiled graph.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from comera_compile import tt
from comera_compile.fx_utils import unwrap_compiled
from comera_compile.tensorize.checkpoint import keep_layout_on_save
from comera_compile.tensorize.compression import record_skipped
from comera_compile.tensorize.config import TTConfig
from comera_compile.tensorize.optimizer_check import watch_optimizers
from comera_compile.tensorize.parametrization import (
    TTParametrization,
    iter_tt_layers,
    share_parametrized_class,
    tt_parametrization,
)
from comera_compile.tt import TTSpec

log = logging.getLogger(__name__)

__all__ = ["densify_", "tensorize_"]


# ----------------------------------------------------------------------------------------------
# Planning: which layers, which layout (all validated before any module changes)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """How a layer's ``weight`` relates to the TT matrix ``M`` [rows, cols]: ``M.T`` or ``M``."""

    kind: str  # "Linear", "Embedding" or "Conv1D"
    rows: int
    cols: int
    transpose: bool


@dataclass
class _Plan:
    modules: list[tuple[str, nn.Module]]  # one layer, or every module of a tie that shares the TT
    kind: str
    spec: TTSpec
    config: TTConfig
    std: float | None  # random init: std of the reconstructed weight
    untie: bool = False

    @property
    def fqn(self) -> str:
        return self.modules[0][0]


class _Skip(Exception):
    """A layer that cannot be tensorized; the message is the reason the report prints."""


def _hf_conv1d_class() -> type | None:
    """transformers' ``Conv1D`` (GPT-2's projections). A model holding one has imported it, so
    transformers is never imported here."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def _layout(module: nn.Module) -> _Layout | None:
    if isinstance(module, nn.Linear):
        return _Layout("Linear", module.in_features, module.out_features, True)
    if isinstance(module, nn.Embedding):
        return _Layout("Embedding", module.num_embeddings, module.embedding_dim, False)
    conv1d = _hf_conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):  # y = x @ W + b, W [in, out] is M itself
        return _Layout("Conv1D", module.nx, module.nf, False)
    return None


def _is_candidate(module: nn.Module) -> bool:
    """A Linear-like leaf: a supported layer, or a leaf module holding a 2-D (or larger) weight.

    Containers (an MLP block, a ModuleList) and 1-D weights (norms) are not candidates, so they
    are neither tensorized nor reported."""
    if _layout(module) is not None or parametrize.is_parametrized(module, "weight"):
        return True
    weight = module._parameters.get("weight")
    leaf = all(name == "parametrizations" for name, _ in module.named_children())
    return leaf and isinstance(weight, torch.Tensor) and weight.dim() >= 2


def _config_key(config: Mapping, fqn: str) -> str | None:
    if fqn in config:
        return fqn
    for key in config:
        if key.startswith("re:") and re.fullmatch(key[3:], fqn):
            return key
    return "_default" if "_default" in config else None


def _check_config_keys(config: Mapping, modules: dict[str, nn.Module], candidates: list[str]) -> None:
    """Every key of a config dict must select a layer: a typo raises, naming the closest names."""
    for key in config:
        if not isinstance(key, str):
            raise TypeError(f"tensorize_: config keys are module names (str), got {key!r}")
        if key == "_default":
            continue
        if key.startswith("re:"):
            try:
                pattern = re.compile(key[3:])
            except re.error as exc:
                raise ValueError(f"tensorize_: config key {key!r} is not a valid regular expression: {exc}") from None
            if not any(pattern.fullmatch(name) for name in candidates):
                raise ValueError(f"tensorize_: config key {key!r} matches no layer (the pattern must match a "
                                 f"whole name); layer names look like {candidates[:4]}")
        elif key not in candidates:
            raise ValueError(_unknown_key_message(key, modules, candidates))


def _unknown_key_message(key: str, modules: dict[str, nn.Module], candidates: list[str]) -> str:
    if key in modules:
        inside = [c for c in candidates if c.startswith(key + ".") or not key][:4]
        return (f"tensorize_: config key {key!r} names a {type(modules[key]).__name__}, not a Linear, "
                f"Embedding or Conv1D layer; keys name layers (e.g. {inside}), or use "
                f"{'re:' + re.escape(key) + '[.].*'!r} for every layer inside it")
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.0)
    return f"tensorize_: config key {key!r} matches no layer of the model; closest layer names: {close}"


def _selection(config, filter_fn, module: nn.Module, fqn: str) -> tuple[TTConfig | None, str]:
    """The layer's config, or None and why it is not selected."""
    if isinstance(config, TTConfig):
        cfg = config
    else:
        key = _config_key(config, fqn)
        if key is None:
            return None, "no key of the config dict matches it, and there is no '_default'"
        cfg = config[key]
        if cfg is None:
            return None, f"config[{key!r}] is None"
        if not isinstance(cfg, TTConfig):
            raise TypeError(f"tensorize_: config for '{fqn}' must be a TTConfig, got {type(cfg).__name__}")
    if not filter_fn(module, fqn):
        return None, "filter_fn returned False"
    return cfg, ""


def _layer_error(fqn: str, kind: str, shape, msg: str) -> ValueError:
    return ValueError(f"tensorize_: layer '{fqn}' ({kind} {tuple(shape)}): {msg}")


def _auto_modes(fmt: str, rows: int, cols: int, cfg: TTConfig, error) -> tuple[tuple, tuple]:
    if fmt == "btt":
        if cfg.n_cores not in (None, 2):
            raise error(f"n_cores={cfg.n_cores} is invalid for the 'btt' format: it always has two cores "
                        "(R and L); leave n_cores unset")
        a = b = 2  # (blocks, block size) on each side, near the square root
    elif fmt == "tt":
        if cfg.n_cores is None:
            a, b = tt.default_n_modes(rows), tt.default_n_modes(cols)
        else:
            if cfg.n_cores < 2:
                raise error(f"n_cores={cfg.n_cores} is invalid for the 'tt' format: it needs >= 2 "
                            "cores (at least one row mode and one column mode)")
            share = math.log(max(rows, 2)) / (math.log(max(rows, 2)) + math.log(max(cols, 2)))
            a = min(cfg.n_cores - 1, max(1, round(cfg.n_cores * share)))
            b = cfg.n_cores - a
    else:
        a = b = cfg.n_cores or tt.default_n_modes(max(rows, cols))
    row = tt.factorize(rows, a, max_pad=cfg.max_pad)
    col = tt.factorize(cols, b, max_pad=cfg.max_pad)
    return tt.arrange_modes(fmt, row, col)


def _check_module(module: nn.Module) -> torch.Tensor:
    """Reasons a supported layer cannot hold a TT weight; returns its current (dense) weight."""
    if isinstance(module, nn.Embedding):
        if module.sparse:
            raise _Skip("sparse=True: sparse gradients cannot flow into TT cores")
        if module.max_norm is not None:
            raise _Skip("max_norm renormalizes the weight in place, which a TT weight cannot do")
    if parametrize.is_parametrized(module, "weight") and tt_parametrization(module) is None:
        names = [type(p).__name__ for p in module.parametrizations.weight]
        raise _Skip(f"weight is already parametrized by {names}")
    with torch.no_grad():
        weight = module.weight  # a TT layer: its current weight (it is re-factored)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise _Skip(f"weight dtype {getattr(weight, 'dtype', None)} is not floating point")
    return weight


def _tt_spec(fqn: str, layout: _Layout, weight: torch.Tensor, cfg: TTConfig) -> TTSpec:
    """Format, modes and ranks for one matrix; invalid ranks or modes raise, no gain skips."""
    kind, rows, cols = layout.kind, layout.rows, layout.cols

    def error(msg: str) -> ValueError:
        return _layer_error(fqn, kind, weight.shape, msg)

    fmt, rank, why = cfg.resolve(kind, rows, cols)
    if why:
        log.info("tensorize_: %s: %s", fqn, why)
    if cfg.modes is not None:
        row_modes, col_modes = cfg.modes
        auto = _auto_modes(fmt, rows, cols, cfg, error)
        if math.prod(row_modes) < rows or math.prod(col_modes) < cols:
            raise error(
                f"modes {list(row_modes)} x {list(col_modes)} cover {math.prod(row_modes)} x "
                f"{math.prod(col_modes)}, less than rows x cols = {rows} x {cols} (rows = "
                f"{'num_embeddings' if kind == 'Embedding' else 'in_features'}); valid modes multiply to "
                f"at least that, e.g. {[list(auto[0]), list(auto[1])]}"
            )
        if fmt == "ttm" and len(row_modes) != len(col_modes):
            raise error(f"fmt='ttm' needs as many row modes as column modes, got {list(row_modes)} "
                        f"and {list(col_modes)}; e.g. {[list(auto[0]), list(auto[1])]}")
        if fmt == "btt" and (len(row_modes), len(col_modes)) != (2, 2):
            raise error(f"fmt='btt' needs two row modes (b1 blocks of b2) and two column modes (c blocks of a), "
                        f"got {list(row_modes)} and {list(col_modes)}; e.g. {[list(auto[0]), list(auto[1])]}")
    else:
        row_modes, col_modes = _auto_modes(fmt, rows, cols, cfg, error)
    n = tt.n_cores(fmt, row_modes, col_modes)
    try:
        ranks = tt.normalize_ranks(rank, n)
    except ValueError as e:
        raise error(f"{e}; valid: a positive int, or {n - 1} positive ints (one per internal bond "
                    f"of the {n} cores {fmt} {[list(row_modes), list(col_modes)]})") from None
    spec = TTSpec(fmt, row_modes, col_modes, tt.fit_ranks(fmt, row_modes, col_modes, ranks), rows, cols,
                  layout.transpose)
    if spec.num_params >= spec.dense_params:
        raise _Skip(f"no compression: {fmt} {spec.describe()} at ranks {list(spec.ranks)} has "
                    f"{spec.num_params} parameters >= {spec.dense_params} dense")
    return spec


def _plan_layer(fqn: str, module: nn.Module, cfg: TTConfig, layout: _Layout | None = None) -> _Plan:
    layout = layout or _layout(module)
    if layout is None:
        raise _Skip(f"unsupported module type {type(module).__name__} (nn.Linear, nn.Embedding and "
                    "transformers' Conv1D are supported)")
    weight = _check_module(module)
    if weight.numel() < cfg.min_size:
        raise _Skip(f"{weight.numel()} weight elements < min_size={cfg.min_size}")
    if cfg.init == "svd" and weight.device.type == "meta":
        raise _Skip("init='svd' needs real weights (this one is on the meta device)")
    if cfg.activation is not None and layout.kind == "Embedding":
        raise _layer_error(fqn, layout.kind, weight.shape, f"TTConfig(activation={cfg.activation!r}) applies to Linear "
                           "layers (an embedding's rows are read, not multiplied); leave it out with filter_fn or "
                           "a config dict ({name: TTConfig(...)}, None to skip)")
    spec = _tt_spec(fqn, layout, weight, cfg)
    std = cfg.init_std
    if std is None and layout.kind == "Embedding":  # the model's own embedding scale
        std = float(weight.detach().float().std()) if weight.device.type != "meta" and weight.numel() > 1 else 1.0
    elif std is None:
        std = math.sqrt(1.0 / (spec.rows + spec.cols))
    return _Plan([(fqn, module)], layout.kind, spec, cfg, std)


def _plan_shared(group: list[tuple[str, nn.Module]], selected: dict[str, TTConfig]) -> _Plan:
    """One TT for every module of a tie: M is the weight as stored ([V, D] for an embedding and its
    tied head), so the embedding reads rows of M and the head computes ``linear(x, M)``."""
    unselected = [f for f, _ in group if f not in selected]
    if unselected:
        raise _Skip(f"tied with {unselected}, which {'is' if len(unselected) == 1 else 'are'} not selected; "
                    "tied='share' needs every module of the tie selected")
    unsupported = [f"{f} ({type(m).__name__})" for f, m in group if _layout(m) is None]
    if unsupported:
        raise _Skip(f"tied with unsupported module(s) {unsupported}")
    _check_one_config(group, selected)
    weights = [_check_module(m) for _, m in group]
    lead = next((i for i, (_, m) in enumerate(group) if isinstance(m, nn.Embedding)), 0)
    fqn, module = group[lead]
    weight, cfg = weights[lead], selected[fqn]
    kind = "Embedding" if isinstance(module, nn.Embedding) else _layout(module).kind
    plan = _plan_layer(fqn, module, cfg, _Layout(kind, weight.shape[0], weight.shape[1], False))
    if cfg.init_std is None:  # the model's own scale, chosen to suit both uses of the matrix
        plan.std = float(weight.detach().float().std()) if weight.device.type != "meta" else plan.std
    plan.modules = [group[lead]] + [g for i, g in enumerate(group) if i != lead]
    return plan


def _check_one_config(group: list[tuple[str, nn.Module]], selected: dict[str, TTConfig]) -> None:
    """The modules of a tie that ``tied="share"`` makes one TT must be given one config (equal
    TTConfigs); different ones raise ValueError naming the modules and the fields that differ."""
    configs = [(f, selected[f]) for f, _ in group]
    differ = [name for name in (fld.name for fld in dataclasses.fields(TTConfig))
              if any(getattr(cfg, name) != getattr(configs[0][1], name) for _, cfg in configs)]
    if differ:
        values = "; ".join(f"{name}: " + ", ".join(f"{getattr(cfg, name)!r} for '{f}'" for f, cfg in configs)
                           for name in differ)
        raise ValueError(f"tensorize_(..., tied='share'): {_names([f for f, _ in configs])} share one weight, which "
                         f"becomes one TT with one config, but their configs differ ({values}); give them the same "
                         "TTConfig, or use tied='untie' for a TT of its own config each. Nothing was changed.")


def _weight_key(module: nn.Module) -> int | None:
    """What ties modules: the same weight Parameter, or the same TT parametrization."""
    p = tt_parametrization(module)
    if p is not None:
        return id(p)
    w = module._parameters.get("weight")
    return id(w) if w is not None else None


def _ties(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Modules grouped by the weight they hold; a group of several is a tie."""
    groups: dict[int, list[tuple[str, nn.Module]]] = {}
    for fqn, module in model.named_modules():
        key = _weight_key(module)
        if key is not None:
            groups.setdefault(key, []).append((fqn, module))
    return groups


def _tie_skip_reason(others: list[str]) -> str:
    return (f"weight is shared with {others} (tied weights); tensorize_(..., tied='share') makes the tie "
            "one TT with shared cores, tied='untie' gives each module its own TT")


def _plan_all(model: nn.Module, selected: dict[str, TTConfig], modules: dict[str, nn.Module], tied: str,
              skipped: dict[str, tuple[str, str]]) -> list[_Plan]:
    """Plans for the selected layers; the ones that cannot be tensorized go to ``skipped``."""
    ties = _ties(model)
    plans: list[_Plan] = []
    shared: dict[int, _Plan | _Skip] = {}
    for fqn, cfg in selected.items():
        module = modules[fqn]
        group = ties.get(_weight_key(module), [(fqn, module)])
        try:
            if len(group) == 1 or tied == "untie":
                plans.append(_plan_layer(fqn, module, cfg))
                plans[-1].untie = len(group) > 1
            elif tied == "skip":
                raise _Skip(_tie_skip_reason([f for f, _ in group if f != fqn]))
            else:
                key = _weight_key(module)
                if key not in shared:
                    try:
                        shared[key] = _plan_shared(group, selected)
                        plans.append(shared[key])
                    except _Skip as reason:
                        shared[key] = reason
                if isinstance(shared[key], _Skip):
                    raise shared[key]
        except _Skip as reason:
            skipped[fqn] = (type(module).__name__, str(reason))
            log.info("tensorize_: skipped %s: %s", fqn, reason)
    return plans


# ----------------------------------------------------------------------------------------------
# Applying plans
# ----------------------------------------------------------------------------------------------


def _set_dense(module: nn.Module, weight: nn.Parameter) -> None:
    """Make ``module.weight`` the plain Parameter ``weight`` (removing a TT parametrization)."""
    if parametrize.is_parametrized(module, "weight"):
        # TT layers share their parametrized class (with their siblings, and a deepcopy with its
        # original), and removing the parametrization deletes the property from that class: give
        # this module its own first
        cls = type(module)
        module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        delattr(module, "weight")
    module.weight = weight


def _prepare(plan: _Plan) -> None:
    """Give the plan's modules dense weights to factor: a TT layer that is re-factored gets its
    current weight back, and an untied module its own copy of the tied weight."""
    modules = [m for _, m in plan.modules]
    refactor = any(tt_parametrization(m) is not None for m in modules)
    if not (refactor or plan.untie):
        return
    with torch.no_grad():
        current = modules[0].weight.detach().clone()
    requires_grad = _requires_grad(modules[0])
    shared = nn.Parameter(current, requires_grad=requires_grad)
    for module in modules:
        _set_dense(module, nn.Parameter(current.clone(), requires_grad=requires_grad) if plan.untie else shared)
    if refactor:
        log.info("tensorize_: re-factoring %s (already tensorized) %s", plan.fqn,
                 "from its current weight" if plan.config.init == "svd" else "with new random cores (refactor=True)")


def _requires_grad(module: nn.Module) -> bool:
    p = tt_parametrization(module)
    return p.core_flat.requires_grad if p is not None else module.weight.requires_grad


def _apply(plan: _Plan) -> str | None:
    """Tensorize the plan's modules; returns why ``svd_tol`` was not reached, or None."""
    spec, cfg = plan.spec, plan.config
    weight = plan.modules[0][1].weight
    dtype, device = weight.dtype, weight.device
    error, missed = None, None
    if cfg.init == "svd":
        matrix = weight.detach().t() if spec.transpose else weight.detach()
        cores, error = tt.tt_svd(matrix, spec, tol=cfg.svd_tol)
        cap = spec
        spec = TTSpec.from_cores(cores, spec.fmt, spec.row_modes, spec.col_modes, spec.rows, spec.cols,
                                 spec.transpose)
        log.info("tensorize_: %s %s TT-SVD ranks %s, relative error %.3g", plan.fqn,
                 spec.describe(), list(spec.ranks), error)
        if cfg.svd_tol is not None and error > cfg.svd_tol:
            missed = _svd_tol_missed(plan.fqn, cfg, cap, spec, error)
    else:
        cores = tt.random_cores(spec, plan.std, dtype=dtype, device=device, balanced=cfg.init == "balanced")
    gates = [torch.ones(r, dtype=dtype, device=device) for r in spec.gate_sizes]
    param = TTParametrization(spec, cores, gates, kind=plan.kind, init=cfg.init, init_error=error,
                              svd_tol=cfg.svd_tol, activation=cfg.activation)
    param.core_flat.requires_grad_(weight.requires_grad)
    param.gate_flat.requires_grad_(weight.requires_grad)
    for _, module in plan.modules:
        _register(module, param)
    param.refit_on_assign = True
    return missed


def _svd_tol_missed(fqn: str, cfg: TTConfig, cap: TTSpec, got: TTSpec, error: float) -> str:
    """``'fqn': relative error E > tol, ...`` naming the bonds the rank cap stopped (1-based)."""
    bounds = tt.rank_bounds(cap.sizes)
    capped = [k for k in range(1, len(got.ranks) - 1) if got.ranks[k] == cap.ranks[k] < bounds[k]]
    why = (f"stopped by the rank cap (rank={cfg.rank if cfg.rank is not None else max(cap.ranks)!r}) "
           f"at bond(s) {capped}" if capped else
           "though no bond is at its cap (rounding)")
    return f"'{fqn}': relative error {error:.3g} > {cfg.svd_tol:g}, {why}"


def _register(module: nn.Module, param: TTParametrization) -> None:
    parametrize.register_parametrization(module, "weight", param, unsafe=True)
    # The dense weight was set_() to the zero-size result of right_inverse; keep that placeholder
    # as a non-persistent buffer, so it is neither a parameter (DDP and optimizers would see an
    # unused one) nor a state_dict entry.
    plist = module.parametrizations.weight
    placeholder = plist.original.detach()
    del plist.original
    plist.register_buffer("original", placeholder, persistent=False)
    # one class for all TT layers of a kind (per-block compiles reuse one graph); with an activation
    # its forward computes act(x L) R (the dense forward would read a weight the layer no longer has)
    share_parametrized_class(module, bottleneck=param.activation is not None)


_TIED = ("skip", "share", "untie")


def tensorize_(
    model: nn.Module,
    config: TTConfig | Mapping[str, TTConfig | None] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    *,
    tied: str = "skip",
    refactor: bool = False,
) -> nn.Module:
    """Tensorize ``model``'s Linear, Embedding and transformers ``Conv1D`` weights in place; returns ``model``.

    ``config`` is one :class:`TTConfig` for every selected layer, or a dict from module name to
    config (exact names, ``"re:<regex>"`` keys, ``"_default"``; a None value skips the module). A key
    that selects no layer raises ValueError naming the closest layer names.
    ``filter_fn(module, fqn)`` selects layers (default: all of them); it is asked about the layers
    the config selects, and one that returns False for all of them raises ValueError naming them.
    ``tied`` says what happens to modules sharing one weight (an embedding tied to the LM head):
    ``"skip"`` leaves them dense, ``"share"`` makes them one TT with shared cores (the embedding
    reads rows of the [V, D] matrix, the head contracts with it; the config must be the same for
    each of them, different ones raise ValueError), ``"untie"`` gives each its own TT.
    A layer that is already tensorized is re-factored by the new config from its current weight
    with ``init="svd"`` (TT-SVD to the new ranks). ``init="random"`` would discard its cores (what it
    learned) for new random ones: that raises ValueError naming the layers unless ``refactor=True``.
    A transformers model loaded by ``from_pretrained`` whose layers get ``init="random"`` cores is warned
    about: those cores replace the loaded weights (``init="svd"`` factors them instead).
    With ``svd_tol``, a layer whose rank cap stops TT-SVD short of the tolerance is named in one
    ``UserWarning`` with the error it reached (also in :func:`compression_report`).
    Invalid ranks or modes raise ValueError before any layer changes; every Linear-like layer that
    is not tensorized is listed by :func:`compression_report` with the reason. A model with a
    ``save_pretrained`` (transformers') gets one on the instance that also writes the TT layout
    (:func:`comera_compile.tensorize.checkpoint.keep_layout_on_save`), which
    ``comera_compile.hf.from_pretrained`` reads.
    """
    model = unwrap_compiled(model)
    config = TTConfig() if config is None else config
    if not isinstance(config, (TTConfig, Mapping)):
        raise TypeError(f"config must be a TTConfig or a dict of them, got {type(config).__name__}")
    if tied not in _TIED:
        raise ValueError(f"tensorize_: tied must be one of {list(_TIED)}, got {tied!r}")
    modules = dict(model.named_modules())
    candidates = [fqn for fqn, m in modules.items() if _is_candidate(m)]
    if isinstance(config, Mapping):
        _check_config_keys(config, modules, candidates)
    asked: list[str] = []  # the layers filter_fn was asked about
    chosen = filter_fn or (lambda module, fqn: True)

    def select(module: nn.Module, fqn: str) -> bool:
        asked.append(fqn)
        return bool(chosen(module, fqn))

    selected: dict[str, TTConfig] = {}
    skipped: dict[str, tuple[str, str]] = {}
    for fqn in candidates:
        cfg, why = _selection(config, select, modules[fqn], fqn)
        if cfg is not None:
            selected[fqn] = cfg
        elif tt_parametrization(modules[fqn]) is None:
            skipped[fqn] = (type(modules[fqn]).__name__, f"not selected: {why}")
    if filter_fn is not None and asked and not selected:
        raise ValueError(f"tensorize_: filter_fn returned False for every layer it was asked about ({len(asked)}: "
                         f"{_names(asked)}), so it selects no layer (it gets each layer's module and full name, "
                         "filter_fn(module, fqn))")
    plans = _plan_all(model, selected, modules, tied, skipped)
    discard = [(f, plan.config.init) for plan in plans if plan.config.init != "svd"
               for f, m in plan.modules if tt_parametrization(m) is not None]
    if discard and not refactor:
        inits = "/".join(sorted({repr(init) for _, init in discard}))
        raise ValueError(f"tensorize_: init={inits} would replace the cores of the already tensorized layer(s) "
                         f"{_names([f for f, _ in discard])} (and what they learned) with new random ones; pass "
                         "refactor=True to do that, use init='svd' to re-factor their current weights to the new config, or leave "
                         "them out with filter_fn or the config dict. Nothing was changed.")
    _warn_if_pretrained_weights_are_dropped(model, plans)
    for plan in plans:
        _prepare(plan)
    missed = [m for m in (_apply(plan) for plan in plans) if m is not None]
    record_skipped(model, skipped)
    if not plans and not any(tt_parametrization(modules[f]) is not None for f in candidates):
        reasons = "; ".join(f"'{f}': {why}" for f, (_, why) in list(skipped.items())[:8])
        more = f" and {len(skipped) - 8} more" if len(skipped) > 8 else ""
        warnings.warn(f"tensorize_ tensorized no layer of this {type(model).__name__}"
                      + (f": {reasons}{more}. compression_report(model) lists every layer left dense and why"
                         if skipped else ": it has no Linear, Embedding or Conv1D layer"), UserWarning, stacklevel=2)
    if plans:
        keep_layout_on_save(model)  # a model's own save_pretrained (transformers') writes its TT layout
        watch_optimizers()  # an optimizer built before this call warns at its first step
    if missed:
        tols = sorted({plan.config.svd_tol for plan in plans if plan.config.svd_tol is not None})
        warnings.warn(f"tensorize_: TTConfig(svd_tol={'/'.join(f'{t:g}' for t in tols)}) not reached by "
                      f"{len(missed)} layer(s): {'; '.join(missed)}. A larger rank reaches it, at the cost of "
                      "parameters; compression_report(model) lists every layer's error.", UserWarning, stacklevel=2)
    return model


def _warn_if_pretrained_weights_are_dropped(model: nn.Module, plans: list) -> None:
    """Layers whose weights ``init="random"`` cores would replace while the weights hold something
    learned lose it: say so, and how to keep it (``init="svd"``). Learned: the model was loaded with
    weights (transformers' ``from_pretrained`` records where from), or a weight looks trained
    (:func:`_looks_trained`, checked on the first ``_TRAINED_CHECKS`` of those layers)."""
    random = [plan for plan in plans if plan.config.init != "svd"]
    if not random:
        return
    names = _names([f for plan in random for f, _ in plan.modules])
    dropped = [plan.modules[0] for plan in random]  # a tie's modules share one weight
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if source:
        warnings.warn(f"tensorize_: this model was loaded from {source!r}, and TTConfig(init='random') replaces the "
                      f"loaded weights of {names} with new random cores (what they learned is lost). "
                      "TTConfig(init='svd') factors the loaded weights instead.", UserWarning, stacklevel=3)
        return
    for fqn, module in dropped[:_TRAINED_CHECKS]:
        ratio = _looks_trained(getattr(module, "weight", None))
        if ratio is not None:
            warnings.warn(f"tensorize_: the weight of '{fqn}' looks trained (its largest singular value is "
                          f"{ratio:.2f}x that of a random matrix of its shape and std; a freshly initialized one is "
                          f"near 1x), and TTConfig(init='random') replaces the weights of {names} with new random "
                          "cores (what they learned is lost). TTConfig(init='svd') factors the current weights "
                          "instead.", UserWarning, stacklevel=3)
            return


_TRAINED_CHECKS = 8  # layers checked for a trained look, at most (a few power iterations each)
_TRAINED_RATIO = 1.3  # fresh i.i.d. inits (uniform, normal, any std) measure 0.92-1.09 down to 4 x 4


def _looks_trained(weight: object) -> float | None:
    """``weight``'s largest singular value over ``std * (sqrt(m) + sqrt(n))``, the largest of an
    m x n matrix of i.i.d. entries of that std (the Marchenko-Pastur edge), when it is at least
    ``_TRAINED_RATIO``: training gives weights directions far stronger than that; else None (also for
    weights it cannot read: meta, distributed tensors, constant). Power iteration from below, so it
    never overstates the ratio."""
    if type(weight) not in (torch.Tensor, nn.Parameter) or weight.is_meta or weight.dim() < 2 or weight.numel() < 16:
        return None
    with torch.no_grad():
        w = weight.detach().float().reshape(weight.shape[0], -1)
        std = float(w.std())
        if not std > 0 or not math.isfinite(std):
            return None
        v = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device)
        for _ in range(12):  # no host sync inside: the norm is read once, after
            u = w @ v
            u = u / u.norm().clamp_min(1e-30)
            v = w.T @ u
            top = v.norm()
            v = v / top.clamp_min(1e-30)
        ratio = float(top) / (std * (math.sqrt(w.shape[0]) + math.sqrt(w.shape[1])))
    return ratio if ratio >= _TRAINED_RATIO else None


def _names(fqns: list[str], limit: int = 8) -> str:
    """``['a', 'b', ...]`` (the first ``limit`` names, then how many more)."""
    more = f" and {len(fqns) - limit} more" if len(fqns) > limit else ""
    return f"{[f or '<the model itself>' for f in fqns[:limit]]}{more}"


def densify_(model: nn.Module) -> nn.Module:
    """Turn every tensorized layer back into a plain dense ``weight`` Parameter (in place); modules
    sharing one TT get one shared Parameter again."""
    root = unwrap_compiled(model)
    layers = list(iter_tt_layers(root))
    nonlinear = [layer.fqn for layer in layers if layer.param.activation is not None]
    if nonlinear:
        raise ValueError(f"densify_: the tt layer(s) {_names(nonlinear)} have an activation at their rank bottleneck "
                         "(TTConfig(activation=...)): act(x L) R is no dense matrix. Nothing was changed.")
    for layer in layers:
        with torch.no_grad():
            weight = layer.module.weight.detach().clone()
        dense = nn.Parameter(weight, requires_grad=layer.param.core_flat.requires_grad)
        for module in [layer.module] + [root.get_submodule(f) for f in layer.shared_with]:
            _set_dense(module, dense)
    return model



# ----------------------------------------------------------------------------------------------
# The TT layout of a model, for checkpoints (cc.hf.save_pretrained / from_pretrained)
# ----------------------------------------------------------------------------------------------


def _restorable(modules: dict[str, nn.Module], name: str, field: str, seen: set[str]) -> nn.Module:
    """The module ``name`` that a layout's ``field`` names: a supported layer, not yet tensorized,
    named once in the layout."""
    module = modules.get(name)
    if module is None or _layout(module) is None:
        raise ValueError(f"restore TT layers: the checkpoint tensorized '{name}' (field {field}), which this model "
                         f"{'lacks' if module is None else f'has as a {type(module).__name__}'}")
    if name in seen:
        raise ValueError(f"restore TT layers: '{name}' is named by two layers (field {field}); a module holds one TT")
    if tt_parametrization(module) is not None:
        raise ValueError(f"restore TT layers: '{name}' (field {field}) is already tensorized")
    seen.add(name)
    return module


def restore_tt_layout_(model: nn.Module, layout: list[dict]) -> nn.Module:
    """Re-apply the TT layers :func:`~comera_compile.tensorize.checkpoint.tt_layout` described to a freshly built ``model`` (same
    architecture), with the saved shapes; the cores are placeholders (zeros) until a state_dict is
    loaded. Modules that do not match the description raise ValueError before any layer changes."""
    model = unwrap_compiled(model)
    modules = dict(model.named_modules())
    plans, seen = [], set()
    for entry in layout:
        names = [entry["fqn"], *entry.get("shared_with", [])]
        group = [_restorable(modules, name, "'fqn'" if i == 0 else "'shared_with'", seen)
                 for i, name in enumerate(names)]
        spec = TTSpec(entry["fmt"], tuple(entry["row_modes"]), tuple(entry["col_modes"]),
                      tt.ranks_from_shapes(entry["fmt"], entry["core_shapes"]), int(entry["rows"]), int(entry["cols"]),
                      bool(entry["transpose"]))
        want = (spec.cols, spec.rows) if spec.transpose else (spec.rows, spec.cols)
        shape = tuple(group[0].weight.shape)
        if shape != want:
            raise ValueError(f"restore TT layers: '{names[0]}' has a weight of shape {shape}; the checkpoint's TT "
                             f"layer has {want} (fields 'rows' {spec.rows}, 'cols' {spec.cols}, 'transpose' "
                             f"{spec.transpose})")
        other = next((n for n, m in zip(names, group) if tuple(m.weight.shape) != shape), None)
        if other is not None:
            raise ValueError(f"restore TT layers: '{other}' (field 'shared_with' of '{names[0]}') has a weight of "
                             f"shape {tuple(modules[other].weight.shape)}; the TT it shares has {shape}")
        embeddings = [n for n, m in zip(names, group) if isinstance(m, nn.Embedding)]
        if entry.get("activation") is not None and embeddings:
            raise ValueError(f"restore TT layers: '{names[0]}' has field 'activation' {entry['activation']!r}, which "
                             f"applies to Linear layers; {embeddings} are embeddings")
        plans.append((entry, spec, group))
    for entry, spec, group in plans:
        weight = group[0].weight
        dtype, device = weight.dtype, weight.device
        cores = [torch.zeros(s, dtype=dtype, device=device) for s in entry["core_shapes"]]
        gates = [torch.ones(n, dtype=dtype, device=device) for n in entry["gate_sizes"]]
        param = TTParametrization(spec, cores, gates, kind=entry["kind"], init=entry["init"],
                                  init_error=entry.get("init_error"), svd_tol=entry.get("svd_tol"),
                                  activation=entry.get("activation"))
        param.core_flat.requires_grad_(entry.get("requires_grad", True))
        param.gate_flat.requires_grad_(entry.get("requires_grad", True))
        for module in group:
            _register(module, param)
        param.refit_on_assign = True
    if plans:
        keep_layout_on_save(model)  # a model's own save_pretrained (transformers') writes its TT layout
        watch_optimizers()  # an optimizer built before this call warns at its first step
    return model
