"""``tensorize_``: turn ``nn.Linear`` / ``nn.Embedding`` weights into TT / TT-matrix cores.

torchao's shape: a small config dataclass and one in-place transform,
``tensorize_(model, TTConfig(rank=30), filter_fn=...)`` (``filter_fn(module, fqn) -> bool``), or a
dict ``{fqn: TTConfig}`` for per-module configs. Call it before the optimizer is built.

Each selected layer keeps its type and name; its ``weight`` becomes a ``torch.nn.utils.parametrize``
parametrization (:class:`TTParametrization`) whose forward is exactly one call of
``torch.ops.comera.tt_materialize``, so Dynamo sees ``linear(x, comera.tt_materialize(...))``. The
cores and the rank gates are views of two flat ``nn.Parameter`` s of the parametrization
(``<layer>.parametrizations.weight.0.core_flat`` / ``.gate_flat``); ``state_dict`` holds them one
entry per core and gate (``...weight.0.cores.<k>`` / ``.gates.<k>``). The dense weight is not kept
(the parametrization's ``original`` is a zero-size, non-persistent buffer).
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import sys
import warnings
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
    "require_unsharded",
    "set_parameter_data_",
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
      (TT-matrix / MPO) or ``"auto"`` (default: ``"ttm"`` for every layer). Measured on a GPT (d 768,
      BPE 16k, BENCHMARKS.md section 4) a TT-matrix learns better than ``"tt"`` at equal parameters
      (validation loss 4.0 % / 3.7 % better for the attention / MLP Linears); ``"tt"`` runs faster
      (its rank bottleneck makes two skinny GEMMs of a layer; a TT-matrix has none and runs with its
      weight merged from the cores).
    * ``n_cores``: number of cores (TT: split between rows and columns by their sizes); default:
      modes near 10 (768 -> 3 modes, 30522 -> 4).
    * ``modes``: explicit ``(row_modes, col_modes)``, rows = in_features (Linear) or
      num_embeddings (Embedding), e.g. ``((16, 20, 10, 10), (4, 4, 8, 6))``; products may exceed
      the sizes (padding, cropped away).
    * ``min_size``: layers whose weight has fewer elements are skipped.
    * ``init``: ``"random"`` (CoMERA's variance-matched init) or ``"svd"`` (TT-SVD of the
      current weights); ``svd_tol``: relative-error tolerance that picks the ranks (capped by
      ``rank``: where the cap stops TT-SVD short of the tolerance, ``tensorize_`` warns, naming the
      layers, their reached errors and the capped bonds; every layer's reached error is
      ``compression_report(model).layers[i].init_error``); ``init_std``: target std of the
      reconstructed weight (default: CoMERA's ``sqrt(1 / (in + out))`` for Linear; for Embedding
      the std of the table it replaces, i.e. the model's own embedding init: a GPT's 0.02 table
      started at std 1 trained 24 % worse).
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
    if _is_dtensor(p):
        raise NotImplementedError(_FSDP2_RESIZE.format(
            what=f"resizing a parameter from {tuple(p.shape)} to {tuple(new.shape)}", names="this parameter"))
    other = torch.float64 if new.dtype != torch.float64 else torch.float32
    p.data = new.new_empty(0, dtype=other)
    p.data = new


_FSDP2_RESIZE = ("{what} changes the shapes of tensor-train cores and gates, which FSDP2 (fully_shard) cannot "
                 "follow: it fixes the sharded shape of every parameter when fully_shard is called (sharded: "
                 "{names}). Train rank-adaptively under DistributedDataParallel or on one device, and load "
                 "checkpoints with pruned ranks before calling fully_shard.")


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(t, DTensor)


def require_unsharded(model: nn.Module, what: str) -> None:
    """Raise ``NotImplementedError`` naming the TT layers whose cores or gates FSDP2 has sharded,
    for ``what`` (e.g. ``"RankAdaptation"``) that would change their shapes."""
    names = [layer.fqn for layer in iter_tt_layers(model)
             if any(_is_dtensor(p) for p in (layer.param.core_flat, layer.param.gate_flat))]
    if names:
        raise NotImplementedError(_FSDP2_RESIZE.format(what=what, names=names))


class TTParametrization(nn.Module):
    """A layer's weight as TT cores: ``forward`` is one ``comera::tt_materialize`` call.

    The cores live in one flat Parameter, ``core_flat``, and the rank gates in another,
    ``gate_flat``; ``cores`` and ``gates`` are views of them, shaped as DESIGN.md describes. Two
    Parameters per layer instead of one per core and gate: optimizers, autograd and compiled graphs
    pay a fixed host cost per tensor, and a TT model would otherwise have ~10x as many as its dense
    twin. ``state_dict`` still holds one entry per core and gate (``cores.<k>``, ``gates.<k>``).

    Ranks are read from the core shapes, so rank pruning only re-lays out the flat Parameters
    (:meth:`relayout_`). Loading a state_dict whose ranks differ re-lays them out first. Assigning
    ``module.weight = W`` re-fits the cores to ``W`` by TT-SVD at the current ranks.
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
        svd_tol: float | None = None,
    ) -> None:
        super().__init__()
        self.fmt = spec.fmt
        self.row_modes = tuple(spec.row_modes)
        self.col_modes = tuple(spec.col_modes)
        self.rows, self.cols, self.transpose = spec.rows, spec.cols, spec.transpose
        self.kind = kind
        self.init = init
        self.init_error = init_error  # TT-SVD init: the relative error reached
        self.svd_tol = svd_tol  # the tolerance asked for (TTConfig.svd_tol), or None
        self.core_flat = nn.Parameter(torch.cat([c.reshape(-1) for c in cores]))
        self.gate_flat = nn.Parameter(torch.cat([g.reshape(-1) for g in gates]) if gates else
                                      cores[0].new_zeros(0))
        self.core_shapes = [tuple(c.shape) for c in cores]
        self.gate_sizes = [g.numel() for g in gates]
        self.refit_on_assign = False

    @property
    def cores(self) -> list[torch.Tensor]:
        """The cores, as views of ``core_flat``."""
        parts = self.core_flat.split([math.prod(s) for s in self.core_shapes])
        return [t.view(s) for t, s in zip(parts, self.core_shapes)]

    @property
    def gates(self) -> list[torch.Tensor]:
        """The rank gates, as views of ``gate_flat``."""
        return list(self.gate_flat.split(self.gate_sizes))

    def grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Views of the cores' and gates' gradients (of ``core_flat.grad`` / ``gate_flat.grad``), or
        None before a backward."""
        if self.core_flat.grad is None or self.gate_flat.grad is None:
            return None
        parts = self.core_flat.grad.split([math.prod(s) for s in self.core_shapes])
        return [t.view(s) for t, s in zip(parts, self.core_shapes)], list(self.gate_flat.grad.split(self.gate_sizes))

    @property
    def spec(self) -> TTSpec:
        return tt.spec_from_cores(self.cores, self.fmt, self.row_modes, self.col_modes,
                                  self.rows, self.cols, self.transpose)

    def positions(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Index maps: for every core and gate, the flat positions of its entries (int64, shaped
        like it). Slice them as the cores should be sliced, then hand them to :meth:`relayout_`."""
        flat = torch.arange(self.core_flat.numel(), device=self.core_flat.device)
        cores = [t.view(s) for t, s in zip(flat.split([math.prod(s) for s in self.core_shapes]), self.core_shapes)]
        gflat = torch.arange(self.gate_flat.numel(), device=self.gate_flat.device)
        return cores, list(gflat.split(self.gate_sizes))

    @torch.no_grad()
    def relayout_(self, core_positions: Sequence[torch.Tensor], gate_positions: Sequence[torch.Tensor],
                  optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """New core and gate shapes, each entry taken from the flat position the index maps name
        (see :meth:`positions`): the two Parameters keep their identity and are re-filled by one
        gather each; so are their gradients and every optimizer state tensor shaped like them."""
        for p, positions in ((self.core_flat, core_positions), (self.gate_flat, gate_positions)):
            index = torch.cat([t.reshape(-1) for t in positions]) if positions else p.new_zeros(0, dtype=torch.long)
            old = p.numel()
            states = [opt.state.get(p, {}) for opt in optimizers]
            set_parameter_data_(p, p.data[index])
            if p.grad is not None:
                p.grad = p.grad[index] if p.grad.numel() == old else None
            for state in states:
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == old:
                        state[key] = value[index]
        self.core_shapes = [tuple(t.shape) for t in core_positions]
        self.gate_sizes = [t.numel() for t in gate_positions]

    @torch.no_grad()
    def assign_(self, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> None:
        """Replace every core and gate (shapes may change; the Parameters keep their identity)."""
        set_parameter_data_(self.core_flat, torch.cat([c.reshape(-1) for c in cores]).to(self.core_flat))
        set_parameter_data_(self.gate_flat, torch.cat([g.reshape(-1) for g in gates]).to(self.gate_flat)
                            if gates else self.gate_flat.data.new_zeros(0))
        self.core_shapes = [tuple(c.shape) for c in cores]
        self.gate_sizes = [g.numel() for g in gates]

    @property
    def ranks(self) -> list[int]:
        return [s[0] for s in self.core_shapes] + [self.core_shapes[-1][-1]]

    def forward(self, placeholder: torch.Tensor) -> torch.Tensor:
        return torch.ops.comera.tt_materialize(
            self.core_flat, self.gate_flat, self.fmt, list(self.row_modes), list(self.col_modes),
            self.ranks, self.rows, self.cols, self.transpose,
        )

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        if self.refit_on_assign and value.numel():
            matrix = value.t() if self.transpose else value
            cores, err = tt.tt_svd(matrix.to(self.core_flat.dtype), self.spec)
            self.assign_(cores, [torch.ones_like(g) for g in self.gates])
            self.init, self.init_error, self.svd_tol = "svd", err, None
        return value.new_empty(0)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, tensors in (("cores", self.cores), ("gates", self.gates)):
            for k, t in enumerate(tensors):
                destination[f"{prefix}{name}.{k}"] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # One entry per core and gate, as saved; a checkpoint saved after rank pruning has smaller
        # bonds: the flat Parameters are re-laid out to its shapes before the copy.
        saved = {}
        for name, current in (("cores", self.cores), ("gates", self.gates)):
            saved[name] = []
            for k, t in enumerate(current):
                key = f"{prefix}{name}.{k}"
                value = state_dict.get(key)
                if value is None:
                    missing_keys.append(key)
                elif not isinstance(value, torch.Tensor) or value.dim() != t.dim() or (
                        value.shape != t.shape and value.shape[1:-1] != t.shape[1:-1]):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                      f"{tuple(getattr(value, 'shape', ()))} from checkpoint, the shape in current "
                                      f"model is {tuple(t.shape)}.")
                else:
                    saved[name].append(value)
        known = {f"{prefix}{n}.{k}" for n, ts in (("cores", self.cores), ("gates", self.gates)) for k in range(len(ts))}
        for key in state_dict:
            if key.startswith(prefix) and "." not in key[len(prefix):].split(".", 1)[-1] and key not in known \
                    and key[len(prefix):].split(".")[0] in ("cores", "gates", "core_flat", "gate_flat"):
                unexpected_keys.append(key)
        if len(saved["cores"]) == len(self.core_shapes) and len(saved["gates"]) == len(self.gate_sizes):
            problem = _bond_mismatch(saved["cores"], saved["gates"], prefix)
            if problem is not None:
                error_msgs.append(problem)
                return
            self.assign_([v.to(self.core_flat.dtype) for v in saved["cores"]],
                         [v.to(self.gate_flat.dtype) for v in saved["gates"]])

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.fmt} {s.describe()}, ranks={list(s.ranks)}, {s.rows}x{s.cols}, transpose={s.transpose}"


def _bond_mismatch(cores: list, gates: list, prefix: str) -> str | None:
    """Why saved cores and gates do not form one chain (a bond's sizes differ), naming the keys."""
    if cores[0].shape[0] != 1 or cores[-1].shape[-1] != 1:
        return f"{prefix}cores.0 / cores.{len(cores) - 1}: the outer ranks must be 1"
    for k, gate in enumerate(gates):
        left, right = cores[k].shape[-1], cores[k + 1].shape[0]
        if not left == gate.numel() == right:
            return (f"bond {k + 1} does not line up: {prefix}cores.{k} ends with rank {left}, {prefix}gates.{k} "
                    f"has {gate.numel()} entries, {prefix}cores.{k + 1} starts with rank {right}")
    return None


class TTLayer(NamedTuple):
    """One tensorized layer, as :func:`iter_tt_layers` yields it: ``cores`` and ``gates`` are views of
    ``param.core_flat`` / ``param.gate_flat`` (its :class:`TTParametrization`). ``shared_with`` names
    the other modules whose weight is the same TT (a tied embedding and LM head, ``tied="share"``)."""

    fqn: str
    module: nn.Module
    spec: TTSpec
    cores: list
    gates: list
    shared_with: tuple[str, ...] = ()
    param: "TTParametrization | None" = None


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # a torch.compile'd module


def tt_parametrization(module: nn.Module) -> TTParametrization | None:
    """The layer's :class:`TTParametrization`, or None if its weight is not tensorized."""
    if not parametrize.is_parametrized(module, "weight"):
        return None
    found = [p for p in module.parametrizations.weight if isinstance(p, TTParametrization)]
    return found[0] if found else None


def iter_tt_layers(model: nn.Module) -> Iterator[TTLayer]:
    """Every tensorized layer of ``model`` (a compiled model is unwrapped), each TT once: modules
    sharing one TT come as one layer with ``shared_with``."""
    found: dict[int, list[tuple[str, nn.Module]]] = {}
    for fqn, module in _unwrap(model).named_modules():
        p = tt_parametrization(module)
        if p is not None:
            found.setdefault(id(p), []).append((fqn, module))
    for (fqn, module), *others in found.values():
        p = tt_parametrization(module)
        yield TTLayer(fqn, module, p.spec, p.cores, p.gates, tuple(f for f, _ in others), p)


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

    fmt = cfg.fmt if cfg.fmt != "auto" else "ttm"
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
    else:
        row_modes, col_modes = _auto_modes(fmt, rows, cols, cfg, error)
    n = len(row_modes) + len(col_modes) if fmt == "tt" else len(row_modes)
    try:
        ranks = tt.normalize_ranks(cfg.rank, n)
    except ValueError as e:
        raise error(f"{e}; valid: a positive int, or {n - 1} positive ints (one per internal bond "
                    f"of the {n} cores {fmt} {[list(row_modes), list(col_modes)]})") from None
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    spec = TTSpec(fmt, row_modes, col_modes, tt.cap_ranks(sizes, ranks), rows, cols, layout.transpose)
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
        # a deepcopy shares the parametrized class with its original, and removing the
        # parametrization deletes the property from that class: give this module its own first
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
        spec = tt.spec_from_cores(cores, spec.fmt, spec.row_modes, spec.col_modes, spec.rows,
                                  spec.cols, spec.transpose)
        log.info("tensorize_: %s %s TT-SVD ranks %s, relative error %.3g", plan.fqn,
                 spec.describe(), list(spec.ranks), error)
        if cfg.svd_tol is not None and error > cfg.svd_tol:
            missed = _svd_tol_missed(plan.fqn, cfg, cap, spec, error)
    else:
        cores = tt.random_cores(spec, plan.std, dtype=dtype, device=device)
    gates = [torch.ones(r, dtype=dtype, device=device) for r in spec.gate_sizes]
    param = TTParametrization(spec, cores, gates, kind=plan.kind, init=cfg.init, init_error=error,
                              svd_tol=cfg.svd_tol)
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
    why = (f"stopped by the rank cap (rank={cfg.rank!r}) at bond(s) {capped}" if capped else
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
    reads rows of the [V, D] matrix, the head contracts with it), ``"untie"`` gives each its own TT.
    A layer that is already tensorized is re-factored by the new config from its current weight
    with ``init="svd"`` (TT-SVD to the new ranks). ``init="random"`` would discard its cores (what it
    learned) for new random ones: that raises ValueError naming the layers unless ``refactor=True``.
    With ``svd_tol``, a layer whose rank cap stops TT-SVD short of the tolerance is named in one
    ``UserWarning`` with the error it reached (also in :func:`compression_report`).
    Invalid ranks or modes raise ValueError before any layer changes; every Linear-like layer that
    is not tensorized is listed by :func:`compression_report` with the reason.
    """
    model = _unwrap(model)
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
    discard = [f for plan in plans if plan.config.init == "random"
               for f, m in plan.modules if tt_parametrization(m) is not None]
    if discard and not refactor:
        raise ValueError(f"tensorize_: init='random' would replace the cores of the already tensorized layer(s) "
                         f"{_names(discard)} (and what they learned) with new random ones; pass refactor=True to "
                         "do that, use init='svd' to re-factor their current weights to the new config, or leave "
                         "them out with filter_fn or the config dict. Nothing was changed.")
    for plan in plans:
        _prepare(plan)
    missed = [m for m in (_apply(plan) for plan in plans) if m is not None]
    model.__dict__[_SKIP_ATTR] = skipped
    if missed:
        tols = sorted({plan.config.svd_tol for plan in plans if plan.config.svd_tol is not None})
        warnings.warn(f"tensorize_: TTConfig(svd_tol={'/'.join(f'{t:g}' for t in tols)}) not reached by "
                      f"{len(missed)} layer(s): {'; '.join(missed)}. A larger rank reaches it, at the cost of "
                      "parameters; compression_report(model) lists every layer's error.", UserWarning, stacklevel=2)
    return model


def _names(fqns: list[str], limit: int = 8) -> str:
    """``['a', 'b', ...]`` (the first ``limit`` names, then how many more)."""
    more = f" and {len(fqns) - limit} more" if len(fqns) > limit else ""
    return f"{[f or '<the model itself>' for f in fqns[:limit]]}{more}"


def densify_(model: nn.Module) -> nn.Module:
    """Turn every tensorized layer back into a plain dense ``weight`` Parameter (in place); modules
    sharing one TT get one shared Parameter again."""
    root = _unwrap(model)
    for layer in list(iter_tt_layers(root)):
        with torch.no_grad():
            weight = layer.module.weight.detach().clone()
        dense = nn.Parameter(weight, requires_grad=layer.param.core_flat.requires_grad)
        for module in [layer.module] + [root.get_submodule(f) for f in layer.shared_with]:
            _set_dense(module, dense)
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
    init_error: float | None  # init="svd": the relative error TT-SVD reached
    matrix_shape: tuple[int, int] = (0, 0)  # the TT matrix [rows, cols] (Linear: [in, out])
    shared_with: tuple[str, ...] = ()  # other modules whose weight is this TT (tied="share")
    svd_tol: float | None = None  # the tolerance asked for (TTConfig.svd_tol); not reached if init_error > it

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
            if lay.init_error is not None and lay.svd_tol is not None and lay.init_error > lay.svd_tol:
                note[-1] += f" > svd_tol {lay.svd_tol:g}"
            if lay.shared_with:
                note.append(f"shared with {', '.join(lay.shared_with)}")
            w, logical = lay.weight_shape, lay.matrix_shape
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
        tt_param_ids.update((id(layer.param.core_flat), id(layer.param.gate_flat)))
        layers.append(LayerReport(
            fqn=layer.fqn, kind=p.kind, weight_shape=spec.weight_shape, fmt=spec.fmt,
            factorization=spec.describe(), padded_shape=(spec.padded_rows, spec.padded_cols),
            ranks=spec.ranks, dense_params=spec.dense_params,
            tt_params=sum(t.numel() for t in list(layer.cores) + list(layer.gates)),
            init=p.init, init_error=p.init_error, matrix_shape=(spec.rows, spec.cols),
            shared_with=layer.shared_with, svd_tol=p.svd_tol,
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
