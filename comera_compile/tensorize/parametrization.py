"""A layer's weight as TT cores: ``TTParametrization`` and the tensorized layers of a model.

The cores and the rank gates are views of two flat ``nn.Parameter`` s of the parametrization
(``<layer>.parametrizations.weight.0.core_flat`` / ``.gate_flat``); ``state_dict`` holds them one
entry per core and gate (``...weight.0.cores.<k>`` / ``.gates.<k>``). The parametrization's forward
is exactly one call of ``torch.ops.comera.tt_materialize``, so Dynamo sees
``linear(x, comera.tt_materialize(...))``.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from comera_compile import tt
from comera_compile.fx_utils import unwrap_compiled
from comera_compile.kernels import tt_materialize as _tt_materialize_op  # noqa: F401 (registers the op)
from comera_compile.tt import TTSpec

log = logging.getLogger(__name__)

__all__ = [
    "TTLayer",
    "TTParametrization",
    "bottleneck_forward",
    "iter_tt_layers",
    "require_unsharded",
    "set_parameter_data_",
    "share_parametrized_class",
    "tt_parametrization",
]


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it in the same order), else ``t``."""
    return t.full_tensor() if _is_dtensor(t) else t


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
    ``gate_flat``; ``cores`` and ``gates`` are views of them, shaped as ``spec.core_shapes`` /
    ``spec.gate_sizes`` (core ``k`` is ``[r_{k-1}, n_k, r_k]`` for TT, ``[r_{k-1}, m_k, n_k, r_k]`` for
    TTM; gate ``k`` has ``r_k`` entries). Two
    Parameters per layer instead of one per core and gate: optimizers, autograd and compiled graphs
    pay a fixed host cost per tensor, and a TT model would otherwise have ~10x as many as its dense
    twin. ``state_dict`` still holds one entry per core and gate (``cores.<k>``, ``gates.<k>``).

    Ranks are read from the core shapes, so rank pruning only re-lays out the flat Parameters
    (:meth:`relayout_`). Loading a state_dict whose ranks differ re-lays them out first. Assigning
    ``module.weight = W`` re-fits the cores to ``W`` by TT-SVD at the current ranks (a layer with an
    activation has no dense weight: reading or assigning it raises).
    """

    activation: str | None = None  # the class default: a model pickled before the option existed has none

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
        activation: str | None = None,
    ) -> None:
        super().__init__()
        if activation is not None and (spec.fmt != "tt" or activation not in _ACTIVATIONS):
            raise ValueError(f"TTParametrization: activation={activation!r} needs fmt='tt' and one of "
                             f"{sorted(_ACTIVATIONS)}, got fmt={spec.fmt!r}")
        self.activation = activation  # a nonlinearity at the rank bottleneck ("tt" only), or None
        self.fmt = spec.fmt
        self.row_modes = tuple(spec.row_modes)
        self.col_modes = tuple(spec.col_modes)
        self.rows, self.cols, self.transpose = spec.rows, spec.cols, spec.transpose
        self.kind = kind
        self.init = init
        self.init_error = init_error  # TT-SVD init: the relative error reached
        self.svd_tol = svd_tol  # the tolerance asked for (TTConfig.svd_tol), or None
        core_flat, gate_flat = tt.join_flat(cores, gates)
        self.core_flat, self.gate_flat = nn.Parameter(core_flat), nn.Parameter(gate_flat)
        self._set_shapes([tuple(c.shape) for c in cores], [g.numel() for g in gates])
        self.refit_on_assign = False

    def _set_shapes(self, core_shapes: Sequence[tuple[int, ...]], gate_sizes: Sequence[int]) -> None:
        """The cores' shapes and the gates' sizes, and the spec they make (checked once, here)."""
        self.core_shapes = [tuple(int(v) for v in s) for s in core_shapes]
        self.gate_sizes = [int(n) for n in gate_sizes]
        self._spec = TTSpec(self.fmt, self.row_modes, self.col_modes, tt.ranks_from_shapes(self.fmt, self.core_shapes),
                            self.rows, self.cols, self.transpose)

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
        """The layer's spec, its ranks those of the cores as they are now (rank pruning changes them)."""
        return self._spec

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
        self._set_shapes([tuple(t.shape) for t in core_positions], [t.numel() for t in gate_positions])

    @torch.no_grad()
    def assign_(self, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> None:
        """Replace every core and gate (shapes may change; the Parameters keep their identity). Under
        FSDP2 (the flat Parameters are DTensors) the shapes must stay: the values are copied in place,
        each rank keeping its shard (how a checkpoint of the same ranks loads)."""
        if _is_dtensor(self.core_flat) or _is_dtensor(self.gate_flat):
            same = ([tuple(c.shape) for c in cores] == [tuple(s) for s in self.core_shapes]
                    and [g.numel() for g in gates] == [int(n) for n in self.gate_sizes])
            if same:
                self._copy_into_sharded([_full(c) for c in cores], [_full(g) for g in gates])
                return
        core_flat, gate_flat = tt.join_flat(cores, gates, like=self.gate_flat.data)
        set_parameter_data_(self.core_flat, core_flat.to(self.core_flat))
        set_parameter_data_(self.gate_flat, gate_flat.to(self.gate_flat))
        self._set_shapes([tuple(c.shape) for c in cores], [g.numel() for g in gates])

    def _copy_into_sharded(self, cores: list[torch.Tensor], gates: list[torch.Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor

        local = self.gate_flat.to_local() if _is_dtensor(self.gate_flat) else self.gate_flat.data
        flats = tt.join_flat(cores, gates, like=local)
        with torch.no_grad():
            for param, flat in zip((self.core_flat, self.gate_flat), flats):
                flat = flat.to(device=param.device, dtype=param.dtype)
                if _is_dtensor(param):
                    flat = distribute_tensor(flat, param.device_mesh, param.placements)
                param.copy_(flat)

    @property
    def ranks(self) -> list[int]:
        return list(self._spec.ranks)

    def forward(self, placeholder: torch.Tensor) -> torch.Tensor:
        if self.activation is not None:
            raise RuntimeError(f"this tt layer computes {self.activation}(x L) R with TTConfig(activation="
                               f"{self.activation!r}): it has no dense weight to read (densify_ cannot turn it "
                               "dense either); its factors are tt.bottleneck_factors(cores, gates, spec)")
        return torch.ops.comera.tt_materialize(*self._spec.materialize_args(self.core_flat, self.gate_flat))

    def bottleneck_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``act(x L) R + bias`` for a layer with an activation (``x``: [..., in_features])."""
        left, right = tt.bottleneck_factors(self.cores, self.gates, self._spec)
        return F.linear(_ACTIVATIONS[self.activation](torch.matmul(x, left)), right.t(), bias)

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        """``module.weight = value``: the cores re-fitted to ``value`` by TT-SVD at the current ranks. A
        layer with an activation raises (it computes ``act(x L) R``, which no dense weight sets)."""
        if self.refit_on_assign and self.activation is not None:
            raise RuntimeError(f"this tt layer computes {self.activation}(x L) R with TTConfig(activation="
                               f"{self.activation!r}): a dense weight cannot be assigned to it (it has no dense "
                               "weight: the layer would still compute act(x L) R + b, not x W^T + b); set its "
                               "cores and gates, or tensorize_ it anew without an activation. Nothing was changed.")
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
            problem = _bond_mismatch(saved["cores"], saved["gates"], prefix, self._spec)
            if problem is not None:
                error_msgs.append(problem)
                return
            self.assign_([v.to(self.core_flat.dtype) for v in saved["cores"]],
                         [v.to(self.gate_flat.dtype) for v in saved["gates"]])

    def extra_repr(self) -> str:
        s = self.spec
        act = f", activation={self.activation!r}" if self.activation is not None else ""
        return f"{s.fmt} {s.describe()}, ranks={list(s.ranks)}, {s.rows}x{s.cols}, transpose={s.transpose}{act}"


_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def bottleneck_forward(module: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of a Linear (or ``Conv1D``) whose TT has an activation at its bottleneck: it
    replaces the module class's forward, which would read the (nonexistent) dense weight."""
    return module.parametrizations.weight[0].bottleneck_linear(input, module.bias)


class _SharedProperty(property):
    """A property of a shared parametrized class (made by :func:`_shared_property`)."""


def _shared_property(name: str) -> property:
    """``module.<name>`` for every module of a shared parametrized class: the parametrized value of the
    module it is called on (cached per module inside ``parametrize.cached()``, as torch's own property),
    or the plain attribute for a module whose ``name`` is not parametrized."""

    def get(module: nn.Module):
        params = module._modules.get("parametrizations")
        if params is None or name not in params._modules:
            # not (or no longer) parametrized here: torch's remove_parametrizations put a plain one back
            if name in module.__dict__:
                return module.__dict__[name]
            return nn.Module.__getattr__(module, name)
        plist = params._modules[name]
        if parametrize._cache_enabled:
            key = (id(module), name)
            cached = parametrize._cache.get(key)
            if cached is None:
                cached = parametrize._cache[key] = plist()
            return cached
        return plist()

    def set(module: nn.Module, value) -> None:
        params = module._modules.get("parametrizations")
        if params is not None and name in params._modules:
            params._modules[name].right_inverse(value)
        elif isinstance(value, (nn.Parameter, nn.Module)) or name in module._parameters or name in module._buffers:
            nn.Module.__setattr__(module, name, value)
        else:  # a plain attribute (object.__setattr__ would come back here through this property)
            module.__dict__[name] = value

    return _SharedProperty(get, set, doc=f"the module's {name}: parametrized where it is, else the plain attribute")


class _SharedParametrizedType(type):
    """The metaclass of a shared parametrized class. torch's ``parametrize`` adds and deletes a property on
    the module's class for one module (torch's own classes are per module): here a property it adds
    becomes a :func:`_shared_property` (per module, plain for the modules it does not parametrize), and
    one it deletes stays for the class's other modules."""

    def __setattr__(cls, name: str, value) -> None:
        if isinstance(value, property) and not isinstance(value, _SharedProperty):
            existing = cls.__dict__.get(name)
            value = existing if isinstance(existing, _SharedProperty) else _shared_property(name)
        super().__setattr__(name, value)

    def __delattr__(cls, name: str) -> None:
        if isinstance(cls.__dict__.get(name), _SharedProperty):
            return
        super().__delattr__(name)


_SHARED_CLASSES: dict[tuple[type, bool], type] = {}


def share_parametrized_class(module: nn.Module, bottleneck: bool) -> None:
    """Give a just-parametrized TT layer the class that every TT layer of its base class shares.

    ``register_parametrization`` gives each module a class of its own, so the blocks of a model, each
    compiled on its own from one code object (torchtitan's per-block ``torch.compile``,
    ``block.compile()``), fail Dynamo's type guard in turn: one recompile per block, and past
    ``recompile_limit`` (8) an error under ``fullgraph=True``. With the shared class the blocks reuse
    one graph. ``bottleneck``: the class's forward is :func:`bottleneck_forward`. A module with other
    parametrizations, or whose class is not the one torch just made, keeps its own class.
    """
    cls = type(module)
    base = cls.__bases__[0] if len(cls.__bases__) == 1 else None
    made_by_torch = set(cls.__dict__) <= {"__module__", "__doc__", "__getstate__", "__deepcopy__", "weight",
                                         "__dict__", "__weakref__", "__qualname__", "__firstlineno__",
                                         "__static_attributes__"}
    if (base is None or type(base) is not type or not made_by_torch
            or set(module.parametrizations.keys()) != {"weight"}):
        log.info("TT layer %s keeps a parametrized class of its own (parametrized: %s): compiled one block at "
                 "a time, each such layer's block compiles again", cls.__name__,
                 sorted(module.parametrizations.keys()))
        if bottleneck:
            cls.forward = bottleneck_forward
        return
    shared = _SHARED_CLASSES.get((base, bottleneck))
    if shared is None:
        namespace = {k: v for k, v in cls.__dict__.items() if k not in ("weight", "__dict__", "__weakref__")}
        # __module__ stays torch.nn.utils.parametrize: Dynamo inlines such a module's call
        namespace["weight"] = _shared_property("weight")
        if bottleneck:
            namespace["forward"] = bottleneck_forward
        shared = _SharedParametrizedType(cls.__name__, (base,), namespace)
        _SHARED_CLASSES[(base, bottleneck)] = shared
    module.__class__ = shared


def _bond_mismatch(cores: list, gates: list, prefix: str, spec: TTSpec) -> str | None:
    """Why saved cores and gates do not form one chain (a bond's sizes differ), naming the keys. A
    block tensor-train's cores must have ``spec``'s shapes at the saved gate's rank."""
    if spec.fmt == "btt":
        r = gates[0].numel()
        for k, (core, want) in enumerate(zip(cores, spec.with_ranks((1, r, 1)).core_shapes)):
            if tuple(core.shape) != tuple(want):
                return (f"{prefix}cores.{k} has shape {tuple(core.shape)}; {spec.fmt} {spec.describe()} at rank {r} "
                        f"(the size of {prefix}gates.0) needs {tuple(want)}")
        return None
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
    for fqn, module in unwrap_compiled(model).named_modules():
        p = tt_parametrization(module)
        if p is not None:
            found.setdefault(id(p), []).append((fqn, module))
    for (fqn, module), *others in found.values():
        p = tt_parametrization(module)
        yield TTLayer(fqn, module, p.spec, p.cores, p.gates, tuple(f for f, _ in others), p)

