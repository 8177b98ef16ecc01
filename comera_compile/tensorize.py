"""``tensorize_``: turn ``nn.Linear`` / ``nn.Embedding`` weights into TT / TT-matrix cores.

torchao's shape: a small config dataclass and one in-place transform,
``tensorize_(model, TTConfig(rank=30), filter_fn=...)`` (``filter_fn(module, fqn) -> bool``), or a
dict ``{fqn: TTConfig}`` for per-module configs. Call it before the optimizer is built.

Each selected layer keeps its type and name; its ``weight`` becomes a ``torch.nn.utils.parametrize``
parametrization (:class:`TTParametrization`) whose forward is exactly one call of
``torch.ops.comera.tt_materialize``, so Dynamo sees ``linear(x, comera.tt_materialize(...))``. The
cores and the rank gates are ``nn.Parameter`` s of the parametrization
(``<layer>.parametrizations.weight.0.cores.<k>`` / ``.gates.<k>``); the dense weight is not kept
(the parametrization's ``original`` is a zero-size, non-persistent buffer).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from comera_compile import tt
from comera_compile.kernels import tt_materialize as _tt_materialize_op  # noqa: F401 (registers the op)
from comera_compile.tt import TTSpec

log = logging.getLogger(__name__)

__all__ = [
    "CompressionReport",
    "LayerReport",
    "SkippedLayer",
    "TTConfig",
    "TTLayer",
    "TTParametrization",
    "compression_report",
    "densify_",
    "iter_tt_layers",
    "tensorize_",
]

_FMTS = ("auto", "tt", "ttm")
_INITS = ("random", "svd")
_SKIP_ATTR = "_comera_tensorize_skipped"


@dataclass(frozen=True)
class TTConfig:
    """How to tensorize a layer.

    * ``rank``: an int (every internal bond) or a per-bond list (``d - 1`` entries, or ``d + 1``
      with 1 at both ends). Bonds are capped where a larger rank cannot help (the product of the
      modes on either side). With ``init="svd"`` and ``svd_tol`` it is the cap.
    * ``fmt``: ``"tt"`` (input modes then output modes, CoMERA's linear format), ``"ttm"``
      (TT-matrix / MPO) or ``"auto"`` (``"tt"`` for Linear, ``"ttm"`` for Embedding, as CoMERA).
    * ``n_cores``: number of cores (TT: split between rows and columns by their sizes); default:
      modes near 10 (768 -> 3 modes, 30522 -> 4).
    * ``modes``: explicit ``(row_modes, col_modes)``, rows = in_features (Linear) or
      num_embeddings (Embedding), e.g. ``((16, 20, 10, 10), (4, 4, 8, 6))``; products may exceed
      the sizes (padding, cropped away).
    * ``min_size``: layers whose weight has fewer elements are skipped.
    * ``init``: ``"random"`` (CoMERA's variance-matched init) or ``"svd"`` (TT-SVD of the
      current weights); ``svd_tol``: relative-error tolerance that picks the ranks (capped by
      ``rank``); ``init_std``: target std of the reconstructed weight (default: CoMERA's
      ``sqrt(1 / (in + out))`` for Linear, 1 for Embedding, like ``nn.Embedding``'s N(0, 1)).
    * ``max_pad``: largest relative padding the automatic factorization may add (0: never pad).
    """

    rank: Union[int, Sequence[int]] = 16
    fmt: str = "auto"
    n_cores: int | None = None
    modes: tuple[Sequence[int], Sequence[int]] | None = None
    min_size: int = 16384
    init: str = "random"
    svd_tol: float | None = None
    init_std: float | None = None
    max_pad: float = 0.1

    def __post_init__(self) -> None:
        if self.fmt not in _FMTS:
            raise ValueError(f"TTConfig.fmt must be one of {_FMTS}, got {self.fmt!r}")
        if self.init not in _INITS:
            raise ValueError(f"TTConfig.init must be one of {_INITS}, got {self.init!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            try:
                ranks = tuple(self.rank)  # type: ignore[arg-type]
            except TypeError:
                raise ValueError(
                    f"TTConfig.rank must be a positive int or a list of positive ints, got {self.rank!r}"
                ) from None
            if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                    for r in ranks):
                raise ValueError(f"TTConfig.rank list must hold positive ints, got {list(ranks)}")
            object.__setattr__(self, "rank", ranks)
        elif self.rank < 1:
            raise ValueError(f"TTConfig.rank must be >= 1, got {self.rank}")
        if self.n_cores is not None and (not isinstance(self.n_cores, int) or self.n_cores < 1):
            raise ValueError(f"TTConfig.n_cores must be a positive int or None, got {self.n_cores!r}")
        if self.modes is not None:
            try:
                row, col = self.modes
                row, col = tuple(int(m) for m in row), tuple(int(m) for m in col)
            except (TypeError, ValueError):
                raise ValueError(
                    "TTConfig.modes must be (row_modes, col_modes), e.g. ((16, 20, 10, 10), (4, 4, 8, 6)); "
                    f"got {self.modes!r}"
                ) from None
            if not row or not col or min(row + col) < 1:
                raise ValueError(f"TTConfig.modes must be non-empty lists of positive ints, got {self.modes!r}")
            object.__setattr__(self, "modes", (row, col))
        if not isinstance(self.min_size, int) or self.min_size < 0:
            raise ValueError(f"TTConfig.min_size must be an int >= 0, got {self.min_size!r}")
        if self.svd_tol is not None:
            if self.init != "svd":
                raise ValueError("TTConfig.svd_tol applies to init='svd' only")
            if not self.svd_tol >= 0:
                raise ValueError(f"TTConfig.svd_tol must be >= 0, got {self.svd_tol}")
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"TTConfig.init_std must be > 0, got {self.init_std}")
        if not self.max_pad >= 0:
            raise ValueError(f"TTConfig.max_pad must be >= 0, got {self.max_pad}")


def set_parameter_data_(p: nn.Parameter, new: torch.Tensor) -> None:
    """``p.data = new`` with a new shape, for good.

    Autograd caches a leaf's gradient accumulator (with the leaf's shape) while any graph holds it,
    e.g. the previous step's ``loss`` still alive in the user's loop; ``.data = `` only drops that
    cache when the dtype or device changes. Passing through another dtype drops it, so the next
    forward builds an accumulator of the new shape.
    """
    other = torch.float64 if new.dtype != torch.float64 else torch.float32
    p.data = new.new_empty(0, dtype=other)
    p.data = new


class TTParametrization(nn.Module):
    """A layer's weight as TT cores: ``forward`` is one ``comera::tt_materialize`` call.

    Ranks are not stored: they are read from the cores, so rank pruning only slices the cores and
    gates. Loading a state_dict whose ranks differ resizes the cores first (see
    ``_load_from_state_dict``). Assigning ``module.weight = W`` re-fits the cores to ``W`` by
    TT-SVD at the current ranks.
    """

    def __init__(
        self,
        spec: TTSpec,
        cores: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        *,
        kind: str,
        init: str,
        init_error: float | None = None,
    ) -> None:
        super().__init__()
        self.fmt = spec.fmt
        self.row_modes = tuple(spec.row_modes)
        self.col_modes = tuple(spec.col_modes)
        self.rows, self.cols, self.transpose = spec.rows, spec.cols, spec.transpose
        self.kind = kind
        self.init = init
        self.init_error = init_error
        self.cores = nn.ParameterList([nn.Parameter(c) for c in cores])
        self.gates = nn.ParameterList([nn.Parameter(g) for g in gates])
        self.refit_on_assign = False

    @property
    def spec(self) -> TTSpec:
        return tt.spec_from_cores(list(self.cores), self.fmt, self.row_modes, self.col_modes,
                                  self.rows, self.cols, self.transpose)

    def forward(self, placeholder: torch.Tensor) -> torch.Tensor:
        return torch.ops.comera.tt_materialize(
            list(self.cores), list(self.gates), self.fmt, list(self.row_modes),
            list(self.col_modes), self.rows, self.cols, self.transpose,
        )

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        if self.refit_on_assign and value.numel():
            matrix = value.t() if self.transpose else value
            cores, err = tt.tt_svd(matrix.to(self.cores[0].dtype), self.spec)
            with torch.no_grad():
                for p, c in zip(self.cores, cores):
                    p.copy_(c)
                for g in self.gates:
                    g.fill_(1)
            self.init, self.init_error = "svd", err
        return value.new_empty(0)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Checkpoints saved after rank pruning have smaller bonds: resize cores/gates to them
        # (same Parameter objects) before the usual copy. Other mismatches are left for
        # load_state_dict to report.
        for name, params in (("cores", self.cores), ("gates", self.gates)):
            for i, p in enumerate(params):
                saved = state_dict.get(f"{prefix}{name}.{i}")
                if (isinstance(saved, torch.Tensor) and saved.dim() == p.dim()
                        and saved.shape != p.shape and saved.shape[1:-1] == p.shape[1:-1]):
                    set_parameter_data_(p, p.data.new_empty(saved.shape))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.fmt} {s.describe()}, ranks={list(s.ranks)}, {s.rows}x{s.cols}, transpose={s.transpose}"


class TTLayer(NamedTuple):
    """One tensorized layer, as :func:`iter_tt_layers` yields it."""

    fqn: str
    module: nn.Module
    spec: TTSpec
    cores: nn.ParameterList
    gates: nn.ParameterList


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # a torch.compile'd module


def tt_parametrization(module: nn.Module) -> TTParametrization | None:
    """The layer's :class:`TTParametrization`, or None if its weight is not tensorized."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    found = [p for p in module.parametrizations.weight if isinstance(p, TTParametrization)]
    return found[0] if found else None


def iter_tt_layers(model: nn.Module) -> Iterator[TTLayer]:
    """Every tensorized layer of ``model`` (a compiled model is unwrapped)."""
    for fqn, module in _unwrap(model).named_modules():
        p = tt_parametrization(module)
        if p is not None:
            yield TTLayer(fqn, module, p.spec, p.cores, p.gates)


# ----------------------------------------------------------------------------------------------
# Planning: which layers, which layout (all validated before any module changes)
# ----------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    fqn: str
    module: nn.Module
    kind: str
    spec: TTSpec
    config: TTConfig


class _Skip(Exception):
    """A layer that cannot be tensorized; the message is the reason the report prints."""


def _config_for(config, fqn: str) -> TTConfig | None:
    if isinstance(config, TTConfig):
        return config
    if fqn in config:
        return config[fqn]
    for key, value in config.items():
        if key.startswith("re:") and re.fullmatch(key[3:], fqn):
            return value
    return config.get("_default")


def _layer_error(fqn: str, kind: str, shape, msg: str) -> ValueError:
    return ValueError(f"tensorize_: layer '{fqn}' ({kind} {tuple(shape)}): {msg}")


def _auto_modes(fmt: str, rows: int, cols: int, cfg: TTConfig, error) -> tuple[tuple, tuple]:
    if fmt == "tt":
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


def _plan_layer(fqn: str, module: nn.Module, cfg: TTConfig, owners: dict) -> _Plan:
    if isinstance(module, nn.Linear):
        kind, rows, cols, transpose = "Linear", module.in_features, module.out_features, True
    elif isinstance(module, nn.Embedding):
        kind, rows, cols, transpose = "Embedding", module.num_embeddings, module.embedding_dim, False
        if module.sparse:
            raise _Skip("sparse=True: sparse gradients cannot flow into TT cores")
        if module.max_norm is not None:
            raise _Skip("max_norm renormalizes the weight in place, which a TT weight cannot do")
    else:
        raise _Skip(f"unsupported module type {type(module).__name__} (nn.Linear and nn.Embedding only)")
    if parametrize.is_parametrized(module, "weight"):
        raise _Skip("weight is already parametrized (already tensorized?)")
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise _Skip(f"weight dtype {getattr(weight, 'dtype', None)} is not floating point")
    shared = [o for o in owners.get(id(weight), ()) if o != fqn]
    if shared:
        raise _Skip(f"weight is shared with {shared} (tied weights)")
    if weight.numel() < cfg.min_size:
        raise _Skip(f"{weight.numel()} weight elements < min_size={cfg.min_size}")
    if cfg.init == "svd" and weight.device.type == "meta":
        raise _Skip("init='svd' needs real weights (this one is on the meta device)")

    def error(msg: str) -> ValueError:
        return _layer_error(fqn, kind, weight.shape, msg)

    fmt = cfg.fmt if cfg.fmt != "auto" else ("tt" if kind == "Linear" else "ttm")
    if cfg.modes is not None:
        row_modes, col_modes = cfg.modes
        auto = _auto_modes(fmt, rows, cols, cfg, error)
        if math.prod(row_modes) < rows or math.prod(col_modes) < cols:
            raise error(
                f"modes {list(row_modes)} x {list(col_modes)} cover {math.prod(row_modes)} x "
                f"{math.prod(col_modes)}, less than rows x cols = {rows} x {cols} (rows = "
                f"{'in_features' if kind == 'Linear' else 'num_embeddings'}); valid modes multiply to "
                f"at least that, e.g. {[list(auto[0]), list(auto[1])]}"
            )
        if fmt == "ttm" and len(row_modes) != len(col_modes):
            raise error(f"fmt='ttm' needs as many row modes as column modes, got {list(row_modes)} "
                        f"and {list(col_modes)}; e.g. {[list(auto[0]), list(auto[1])]}")
    else:
        row_modes, col_modes = _auto_modes(fmt, rows, cols, cfg, error)
    n = len(row_modes) + len(col_modes) if fmt == "tt" else len(row_modes)
    try:
        ranks = tt.normalize_ranks(cfg.rank, n)
    except ValueError as e:
        raise error(f"{e}; valid: a positive int, or {n - 1} positive ints (one per internal bond "
                    f"of the {n} cores {fmt} {[list(row_modes), list(col_modes)]})") from None
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    spec = TTSpec(fmt, row_modes, col_modes, tt.cap_ranks(sizes, ranks), rows, cols, transpose)
    if spec.num_params >= spec.dense_params:
        raise _Skip(f"no compression: {fmt} {spec.describe()} at ranks {list(spec.ranks)} has "
                    f"{spec.num_params} parameters >= {spec.dense_params} dense")
    return _Plan(fqn, module, kind, spec, cfg)


def _apply(plan: _Plan) -> None:
    module, spec, cfg = plan.module, plan.spec, plan.config
    weight = module.weight
    dtype, device = weight.dtype, weight.device
    error = None
    if cfg.init == "svd":
        matrix = weight.detach().t() if spec.transpose else weight.detach()
        cores, error = tt.tt_svd(matrix, spec, tol=cfg.svd_tol)
        spec = tt.spec_from_cores(cores, spec.fmt, spec.row_modes, spec.col_modes, spec.rows,
                                  spec.cols, spec.transpose)
        log.info("tensorize_: %s %s TT-SVD ranks %s, relative error %.3g", plan.fqn,
                 spec.describe(), list(spec.ranks), error)
    else:
        std = cfg.init_std
        if std is None:
            std = math.sqrt(1.0 / (spec.rows + spec.cols)) if plan.kind == "Linear" else 1.0
        cores = tt.random_cores(spec, std, dtype=dtype, device=device)
    gates = [torch.ones(r, dtype=dtype, device=device) for r in spec.gate_sizes]
    param = TTParametrization(spec, cores, gates, kind=plan.kind, init=cfg.init, init_error=error)
    param.cores.requires_grad_(weight.requires_grad)
    param.gates.requires_grad_(weight.requires_grad)
    parametrize.register_parametrization(module, "weight", param, unsafe=True)
    # The dense weight was set_() to the zero-size result of right_inverse; keep that placeholder
    # as a non-persistent buffer, so it is neither a parameter (DDP and optimizers would see an
    # unused one) nor a state_dict entry.
    plist = module.parametrizations.weight
    placeholder = plist.original.detach()
    del plist.original
    plist.register_buffer("original", placeholder, persistent=False)
    param.refit_on_assign = True


def tensorize_(
    model: nn.Module,
    config: TTConfig | Mapping[str, TTConfig | None] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Tensorize ``model``'s Linear and Embedding weights in place; returns ``model``.

    ``config`` is one :class:`TTConfig` for every selected layer, or a dict from module name to
    config (exact names, ``"re:<regex>"`` keys, ``"_default"``; a None value skips the module).
    ``filter_fn(module, fqn)`` selects layers (default: every nn.Linear and nn.Embedding).
    Invalid ranks or modes raise ValueError before any layer changes; layers that cannot be
    tensorized are skipped, and :func:`compression_report` lists them with the reason.
    """
    model = _unwrap(model)
    config = TTConfig() if config is None else config
    if not isinstance(config, (TTConfig, Mapping)):
        raise TypeError(f"config must be a TTConfig or a dict of them, got {type(config).__name__}")
    if filter_fn is None:
        def filter_fn(module, fqn):
            return isinstance(module, (nn.Linear, nn.Embedding))

    owners: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        w = module._parameters.get("weight")
        if w is not None:
            owners.setdefault(id(w), [])
            if fqn not in owners[id(w)]:
                owners[id(w)].append(fqn)

    plans: list[_Plan] = []
    skipped: dict[str, tuple[str, str]] = getattr(model, _SKIP_ATTR, {})
    for fqn, module in model.named_modules():
        if tt_parametrization(module) is not None:
            continue
        cfg = _config_for(config, fqn)
        if cfg is None or not filter_fn(module, fqn):
            continue
        if not isinstance(cfg, TTConfig):
            raise TypeError(f"tensorize_: config for '{fqn}' must be a TTConfig, got {type(cfg).__name__}")
        try:
            plans.append(_plan_layer(fqn, module, cfg, owners))
        except _Skip as reason:
            skipped[fqn] = (type(module).__name__, str(reason))
            log.info("tensorize_: skipped %s: %s", fqn, reason)
    for plan in plans:
        _apply(plan)
        skipped.pop(plan.fqn, None)
    model.__dict__[_SKIP_ATTR] = skipped
    return model


def densify_(model: nn.Module) -> nn.Module:
    """Turn every tensorized layer back into a plain dense ``weight`` Parameter (in place)."""
    for layer in list(iter_tt_layers(model)):
        module = layer.module
        with torch.no_grad():
            weight = module.weight.detach().clone()
        requires_grad = layer.cores[0].requires_grad
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        delattr(module, "weight")
        module.weight = nn.Parameter(weight, requires_grad=requires_grad)
    return model


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    fqn: str
    kind: str
    weight_shape: tuple[int, int]
    fmt: str
    factorization: str
    padded_shape: tuple[int, int]
    ranks: tuple[int, ...]
    dense_params: int
    tt_params: int  # cores + gates
    init: str
    init_error: float | None

    @property
    def ratio(self) -> float:
        return self.dense_params / max(self.tt_params, 1)


@dataclass(frozen=True)
class SkippedLayer:
    fqn: str
    kind: str
    reason: str


@dataclass(frozen=True)
class CompressionReport:
    """Per-layer and total parameter counts; ``print`` it for a table."""

    layers: tuple[LayerReport, ...]
    skipped: tuple[SkippedLayer, ...]
    dense_params: int  # the whole model with dense weights in place of the TT layers
    params: int  # the whole model as it is (cores and gates included)
    other_params: int = field(default=0)  # parameters outside the TT layers' weights

    @property
    def ratio(self) -> float:
        return self.dense_params / max(self.params, 1)

    def __str__(self) -> str:
        head = ("layer", "type", "weight", "fmt", "factorization", "ranks", "dense", "tt", "ratio", "note")
        rows = []
        for lay in self.layers:
            note = [] if lay.init_error is None else [f"svd err {lay.init_error:.3g}"]
            w = lay.weight_shape
            logical = (w[1], w[0]) if lay.kind == "Linear" else w
            if tuple(lay.padded_shape) != tuple(logical):
                note.append(f"padded {logical[0]}x{logical[1]}->{lay.padded_shape[0]}x{lay.padded_shape[1]}")
            rows.append((lay.fqn, lay.kind, "x".join(map(str, w)), lay.fmt, lay.factorization,
                         ",".join(map(str, lay.ranks)), f"{lay.dense_params:,}", f"{lay.tt_params:,}",
                         f"{lay.ratio:.1f}x", "; ".join(note)))
        widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]

        def fmt_row(r):
            return "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()

        lines = [fmt_row(head), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]
        lines.append(
            f"total: {self.dense_params:,} -> {self.params:,} parameters ({self.ratio:.1f}x); "
            f"{len(self.layers)} TT layers, other parameters {self.other_params:,}"
        )
        if self.skipped:
            lines.append("skipped:")
            lines += [f"  {s.fqn} ({s.kind}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def compression_report(model: nn.Module) -> CompressionReport:
    """Shapes, factorization, format, ranks and parameters before/after of every TT layer,
    the model totals, and the layers ``tensorize_`` skipped with the reason."""
    model = _unwrap(model)
    layers = []
    tt_param_ids = set()
    for layer in iter_tt_layers(model):
        p = tt_parametrization(layer.module)
        spec = layer.spec
        tt_param_ids.update(id(t) for t in list(layer.cores) + list(layer.gates))
        layers.append(LayerReport(
            fqn=layer.fqn, kind=p.kind, weight_shape=spec.weight_shape, fmt=spec.fmt,
            factorization=spec.describe(), padded_shape=(spec.padded_rows, spec.padded_cols),
            ranks=spec.ranks, dense_params=spec.dense_params,
            tt_params=sum(t.numel() for t in list(layer.cores) + list(layer.gates)),
            init=p.init, init_error=p.init_error,
        ))
    params = {id(t): t.numel() for t in model.parameters()}
    other = sum(n for i, n in params.items() if i not in tt_param_ids)
    skipped = []
    for prefix, module in model.named_modules():
        for fqn, (kind, reason) in getattr(module, _SKIP_ATTR, {}).items():
            name = f"{prefix}.{fqn}" if prefix and fqn else (prefix or fqn)
            skipped.append(SkippedLayer(name, kind, reason))
    return CompressionReport(
        layers=tuple(layers), skipped=tuple(skipped),
        dense_params=other + sum(lay.dense_params for lay in layers),
        params=sum(params.values()), other_params=other,
    )
