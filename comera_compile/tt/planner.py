"""Contraction planner for tensor-train layers: what the compiled graph computes, and why.

A TT layer is a tensor network (:func:`tt_network`): a networkx multigraph whose nodes are the cores
``G1..Gd`` (and the activation ``x`` / output ``y``) and whose edges are indices with their sizes.
For one call site (a token count, a dtype) the planner decides:

1. **Where the chain is cut** into a left and a right half (bond ``split``) and the order in which
   each half's cores are merged: opt_einsum's ``dp`` optimizer over the half's sub-network gives a
   bracketing of the run of cores (:data:`Bracket`). This work is token-independent, and the compiled
   graph runs it once per *group* of layers with the same structure, as batched GEMMs.
2. **The token-sized strategy**, costed forward + backward:

   * linear ``"factored"``: ``(x·L)·R`` through the rank-r bond (the ``"tt"`` format cut between its
     row and column modes, CoMERA's path): two skinny GEMMs forward, four backward, and the core
     gradients are token-independent. Memory-bound: it moves the activations a few times.
   * linear ``"dense"``: the weight ``L·R`` (permuted for ``"ttm"``), then one GEMM forward and two
     backward, exactly like ``nn.Linear``, plus the weight's merge and its gradient's way back into the
     halves. It bounds every layer near its dense time.
   * linear ``"contract"`` (``"ttm"``, whose halves form no low-rank product): the tokens contracted
     through the cores pairwise in opt_einsum's ``dp`` order (:func:`contraction_path`), the weight
     never formed. Its intermediates are token-sized and up to ``r`` times larger than the
     activations, so it wins only where forming the weight dominates (a wide layer at few tokens); at
     rank 32 and thousands of tokens it costs as many FLOPs as the dense GEMM or more.
   * linear ``"blocks"`` / ``"dense"`` for ``"btt"`` (:func:`plan_btt_linear`).
   * embedding ``"tables"``: the halves as gathered tables ``A[I_L, O_L, r]`` and ``B[I_R, O_R, r]``
     (about the square root of the vocabulary each), one ``[O_L, r] x [r, O_R]`` product per lookup;
     no vocabulary-sized tensor ever exists. ``"dense"``: the table ``[rows, cols]``, then a plain
     lookup (its gradient is vocabulary-sized).
3. **Costs** from a :class:`~comera_compile.devices.DeviceProfile` (``profile=``; by default
   :data:`comera_compile.devices.H200`, on every device): each GEMM takes ``max(FLOPs / rate, bytes /
   bandwidth)`` at the rates cuBLAS reaches at such shapes (the profile's ``tt_gemm_flops`` /
   ``tt_fp32_gemm_flops`` and ``tt_skinny_gemm_bandwidth``; ``btt_blocks_bandwidth`` for a btt's blocks),
   plus a launch (``tt_launch_s``; far cheaper inside a CUDA graph, ``tt_graph_launch_s``). The
   cheapest strategy wins; :meth:`TTPlan.describe` prints every step, every candidate's estimate, and
   the FLOPs of ``torch.einsum``'s default left-to-right path for comparison.

The entry points take a :class:`~comera_compile.tt.format.TTSpec`: :func:`plan_linear` ``(spec,
n_tokens)`` and :func:`plan_embedding` ``(spec, n_lookups)``; :func:`plan_tt_linear` /
:func:`plan_tt_embedding` are the same with the chain given as ``(fmt, row_modes, col_modes, ranks)``.
What a format changes here is read off the spec: its chain modes, its ``bottleneck`` (the factored
candidate) and whether it is ``interleaved`` (the dense weight's permutation). Plans are plain frozen
dataclasses, cached on the chain (format, modes, ranks) and the call; token counts may be
``torch.SymInt`` s: the plan reads the size hint and never installs a guard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from typing import Any, Literal, NamedTuple, Sequence, Union

import networkx as nx
import opt_einsum as oe

from comera_compile import devices
from comera_compile.devices import DeviceProfile
from comera_compile.fx_utils import size_hint
from comera_compile.tt.format import TTSpec

__all__ = [
    "Bracket",
    "Cut",
    "GemmStep",
    "Phase",
    "PlanKind",
    "Strategy",
    "TTPlan",
    "clear_plan_cache",
    "contraction_path",
    "cut_at",
    "dense_split",
    "plan_btt_linear",
    "plan_embedding",
    "plan_linear",
    "plan_tt_embedding",
    "plan_tt_linear",
    "size_hint",
    "table_shapes",
    "tt_network",
]

#: A merge order of a run of consecutive cores: a core index, or a pair of brackets merged last.
Bracket = Union[int, tuple["Bracket", "Bracket"]]
#: The token-sized path of a plan: ``"factored"`` / ``"dense"`` for a linear, ``"tables"`` / ``"dense"``
#: for an embedding, ``"blocks"`` / ``"dense"`` for a block tensor-train linear (:func:`plan_btt_linear`).
Strategy = Literal["factored", "dense", "tables", "blocks", "contract"]
PlanKind = Literal["linear", "embedding"]
Phase = Literal["merge", "forward", "backward", "merge_backward"]


class Cut(NamedTuple):
    """The token-independent part of a plan: the bond ``split`` where the chain is cut, and the merge
    orders of its two halves (cores ``[0, split)`` and ``[split, d)``). What the executor's
    ``group_outputs`` reads of a plan (a NamedTuple, so it can stand in an FX graph)."""

    split: int
    left: Bracket
    right: Bracket

_ROW_SYMBOLS = "abcdefghijklm"
_COL_SYMBOLS = "opqrstuvwxyz"
_RANK_SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_TOKEN = "n"


def _structure(spec: TTSpec) -> TTSpec:
    """What a plan depends on: the chain (format, modes, ranks) over the whole padded matrix."""
    if (spec.rows, spec.cols, spec.transpose) == (spec.padded_rows, spec.padded_cols, False):
        return spec
    return TTSpec(spec.fmt, spec.row_modes, spec.col_modes, spec.ranks, spec.padded_rows, spec.padded_cols)


def _chain(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]) -> TTSpec:
    """The spec of a chain given as ``(fmt, row_modes, col_modes, ranks)`` (the positional entry points)."""
    return TTSpec(fmt, row_modes, col_modes, ranks, math.prod(int(m) for m in row_modes),
                  math.prod(int(m) for m in col_modes))


def _check_alphabet(spec: TTSpec) -> None:
    if len(spec.row_modes) > len(_ROW_SYMBOLS) or len(spec.col_modes) > len(_COL_SYMBOLS) or \
            spec.n_cores > len(_RANK_SYMBOLS):
        raise ValueError("too many modes for the planner's index alphabet")


# ----------------------------------------------------------------------------- the network


def _core_indices(spec: TTSpec) -> list[str]:
    """Index symbols of each core (left rank, mode(s), right rank; boundary ranks squeezed)."""
    out = []
    d, n_rows = spec.n_cores, len(spec.row_modes)
    for k in range(d):
        left, right = _RANK_SYMBOLS[k - 1] if k else "", _RANK_SYMBOLS[k] if k < d - 1 else ""
        if spec.fmt == "tt":
            mode = _ROW_SYMBOLS[k] if k < n_rows else _COL_SYMBOLS[k - n_rows]
        else:
            mode = _ROW_SYMBOLS[k] + _COL_SYMBOLS[k]
        out.append(left + mode + right)
    return out


def tt_network(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
               n_tokens: Any = None) -> nx.MultiGraph:
    """The TT layer as a tensor network: tensors are nodes (attribute ``indices``), each index an edge
    (key = index symbol, attributes ``size`` and ``name``: ``i1``, ``o2``, ``r3``, ``tokens``).
    ``y`` is the output; an embedding (``n_tokens=None``) has no ``x`` and its row indices end on ``y``.
    The boundary ranks r_0 = r_d = 1 are squeezed out."""
    return _network(_chain(fmt, row_modes, col_modes, ranks), n_tokens)


def _network(spec: TTSpec, n_tokens: Any = None) -> nx.MultiGraph:
    _check_alphabet(spec)
    row_modes, col_modes, ranks, d = spec.row_modes, spec.col_modes, spec.ranks, spec.n_cores
    sizes: dict[str, int] = {}
    names: dict[str, str] = {}
    for k, m in enumerate(row_modes):
        sizes[_ROW_SYMBOLS[k]], names[_ROW_SYMBOLS[k]] = int(m), f"i{k + 1}"
    for k, m in enumerate(col_modes):
        sizes[_COL_SYMBOLS[k]], names[_COL_SYMBOLS[k]] = int(m), f"o{k + 1}"
    for k in range(1, d):
        sizes[_RANK_SYMBOLS[k - 1]], names[_RANK_SYMBOLS[k - 1]] = int(ranks[k]), f"r{k}"
    rows = "".join(_ROW_SYMBOLS[: len(row_modes)])
    cols = "".join(_COL_SYMBOLS[: len(col_modes)])
    g = nx.MultiGraph()
    if n_tokens is not None:
        sizes[_TOKEN], names[_TOKEN] = size_hint(n_tokens), "tokens"
        g.add_node("x", indices=_TOKEN + rows, kind="input")
        g.add_node("y", indices=_TOKEN + cols, kind="output")
    else:
        g.add_node("y", indices=rows + cols, kind="output")
    for k, idx in enumerate(_core_indices(spec)):
        g.add_node(f"G{k + 1}", indices=idx, kind="core")
    holders: dict[str, list[str]] = {}
    for node, data in g.nodes(data=True):
        for s in data["indices"]:
            holders.setdefault(s, []).append(node)
    for s, nodes in holders.items():
        g.add_edge(nodes[0], nodes[1], key=s, size=sizes[s], name=names[s])
    return g


def _edge_sizes(g: nx.MultiGraph) -> dict[str, int]:
    return {k: data["size"] for _, _, k, data in g.edges(keys=True, data=True)}


# ----------------------------------------------------------------------------- merge orders


def _first_core(b: Bracket) -> int:
    return b if isinstance(b, int) else _first_core(b[0])


def _path_to_bracket(items: list, path) -> Bracket:
    """opt_einsum's path as a bracket whose pairs are (left run, right run) in chain order."""
    ops = list(items)
    for pair in path:
        picked = [ops.pop(i) for i in sorted(pair, reverse=True)]
        ops.append(picked[0] if len(picked) == 1 else tuple(sorted(picked, key=_first_core)))
    (out,) = ops
    return out


@functools.lru_cache(maxsize=4096)
def _bracket_cached(spec: TTSpec, lo: int, hi: int):
    g = _network(spec)
    sizes = _edge_sizes(g)
    idx = [g.nodes[f"G{k + 1}"]["indices"] for k in range(lo, hi)]
    if hi - lo == 1:
        return lo, 0
    inner = {_RANK_SYMBOLS[k - 1] for k in range(lo + 1, hi)}  # bonds inside the run are summed
    out = "".join(s for s in dict.fromkeys("".join(idx)) if s not in inner)
    eq = ",".join(idx) + "->" + out
    shapes = [tuple(sizes[s] for s in i) for i in idx]
    path, info = oe.contract_path(eq, *shapes, shapes=True, optimize="dp")
    return _path_to_bracket(list(range(lo, hi)), path), int(info.opt_cost)


def cut_at(spec: TTSpec, split: int) -> Cut:
    """The chain cut at bond ``split`` (``1 <= split <= d - 1``), each half in its cheapest merge order."""
    s = _structure(spec)
    if not 1 <= split < s.n_cores:
        raise ValueError(f"split must be a bond between two cores (1..{s.n_cores - 1}), got {split}")
    return Cut(split, _bracket_cached(s, 0, split)[0], _bracket_cached(s, split, s.n_cores)[0])


def _merge_gemms(bracket: Bracket, sizes: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, int, int]]:
    """The (m, n, k) of every GEMM of a bracket: merging [r_a, S_left, r_m] with [r_m, S_right, r_b]
    is one [r_a S_left, r_m] x [r_m, S_right r_b] product."""
    out: list[tuple[int, int, int]] = []

    def walk(b) -> tuple[int, int]:  # returns the run (lo, hi) it covers
        if isinstance(b, int):
            return b, b + 1
        (lo, mid), (_, hi) = walk(b[0]), walk(b[1])
        s_left, s_right = math.prod(sizes[lo:mid]), math.prod(sizes[mid:hi])
        out.append((ranks[lo] * s_left, s_right * ranks[hi], ranks[mid]))
        return lo, hi

    walk(bracket)
    return out


# ----------------------------------------------------------------------------- the cost model


@dataclasses.dataclass(frozen=True)
class _DeviceModel:
    """Deprecated (use a :class:`~comera_compile.devices.DeviceProfile`): a profile's tensor-train rates
    under their old names, kept for one release as ``comera_compile.tt.planner.DeviceModel``.

    ``gemm_flops`` is the profile's ``tt_gemm_flops``, ``fp32_flops`` its ``tt_fp32_gemm_flops``,
    ``bandwidth`` its ``tt_skinny_gemm_bandwidth``, ``launch_s`` / ``graph_launch_s`` its ``tt_launch_s`` /
    ``tt_graph_launch_s``, ``block_bandwidth`` its ``btt_blocks_bandwidth``. One built from numbers
    stands for :data:`comera_compile.devices.H200` with these replaced (:attr:`profile`); the planner's
    entry points take it as ``profile=`` (or the deprecated ``model=``)."""

    name: str
    gemm_flops: float
    fp32_flops: float
    bandwidth: float
    launch_s: float
    graph_launch_s: float
    block_bandwidth: float | None = None

    @classmethod
    def from_profile(cls, profile: DeviceProfile) -> "_DeviceModel":
        """The tensor-train rates of ``profile`` under the old names."""
        return cls(profile.name, profile.tt_gemm_flops, profile.tt_fp32_gemm_flops, profile.tt_skinny_gemm_bandwidth,
                   profile.tt_launch_s, profile.tt_graph_launch_s, profile.btt_blocks_bandwidth)

    @functools.cached_property
    def profile(self) -> DeviceProfile:
        """The :class:`~comera_compile.devices.DeviceProfile` these rates stand for: the H200's with the
        tensor-train fields replaced (the H200's itself when nothing differs)."""
        p = dataclasses.replace(devices.H200, name=self.name, tt_gemm_flops=self.gemm_flops,
                                tt_fp32_gemm_flops=self.fp32_flops, tt_skinny_gemm_bandwidth=self.bandwidth,
                                tt_launch_s=self.launch_s, tt_graph_launch_s=self.graph_launch_s,
                                btt_blocks_bandwidth=self.block_bandwidth)
        return devices.H200 if p == devices.H200 else p

    def for_blocks(self) -> "_DeviceModel":
        """This model with ``bandwidth`` at ``block_bandwidth`` (the rates of a btt's blocks path)."""
        if self.block_bandwidth is None:
            return self
        return dataclasses.replace(self, bandwidth=self.block_bandwidth)

    def gemm_s(self, m: int, n: int, k: int, dtype_bytes: int, batch: int = 1) -> float:
        rate = self.gemm_flops if dtype_bytes <= 2 else self.fp32_flops
        flops = 2 * batch * m * n * k
        nbytes = dtype_bytes * batch * (m * k + k * n + m * n)
        return max(flops / rate, nbytes / self.bandwidth)

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.bandwidth


_DeviceModel.__name__ = _DeviceModel.__qualname__ = "DeviceModel"
_H200_MODEL = _DeviceModel.from_profile(devices.H200)
_DEPRECATED = {
    "DeviceModel": (lambda: _DeviceModel, "comera_compile.devices.DeviceProfile (its tt_* fields)"),
    "H200": (lambda: _H200_MODEL, "comera_compile.devices.H200"),
}


def __getattr__(name: str) -> Any:
    """The deprecated names (``DeviceModel``, ``H200``), with a DeprecationWarning."""
    if name in _DEPRECATED:
        get, new = _DEPRECATED[name]
        warnings.warn(f"comera_compile.tt.planner.{name} is deprecated and will be removed in the next release: use "
                      f"{new}, passed as profile=", DeprecationWarning, stacklevel=2)
        return get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _profile(profile: Any, model: Any) -> DeviceProfile:
    """The profile of an entry point's ``profile=`` / deprecated ``model=`` (a legacy ``DeviceModel`` is
    taken for the profile it stands for)."""
    if model is not None:
        warnings.warn("the tensor-train planner's model= is deprecated and will be removed in the next release: "
                      "pass profile= (a comera_compile.devices.DeviceProfile)", DeprecationWarning, stacklevel=3)
        if profile is not devices.H200:
            raise TypeError("pass profile= or the deprecated model=, not both")
        profile = model
    if type(profile) is DeviceProfile:
        return profile
    if isinstance(profile, _DeviceModel):
        return profile.profile
    if isinstance(profile, DeviceProfile):
        return profile
    raise TypeError(f"profile= takes a comera_compile.devices.DeviceProfile, got {type(profile).__name__}")


@dataclasses.dataclass(frozen=True)
class GemmStep:
    """One product of a plan: ``label`` (e.g. ``"T = X·L"``) is an [m, k] x [k, n] GEMM (``batch`` of
    them for a layer group's merges), or a gather/copy of ``nbytes`` when m = n = k = 0."""

    phase: Phase
    label: str
    m: int
    n: int
    k: int
    batch: int
    flops: int
    nbytes: int
    est_s: float

    def describe(self) -> str:
        shape = f"[{self.m}x{self.k}]·[{self.k}x{self.n}]" if self.m else "copy"
        batch = f" x{self.batch}" if self.batch > 1 else ""
        return (f"  {self.phase:<14} {self.label:<22} {shape:<22}{batch:<5} {_si(self.flops)}FLOP "
                f"{_si(self.nbytes)}B ~{self.est_s * 1e6:.1f} us")


@dataclasses.dataclass(frozen=True)
class TTPlan:
    """How one TT call site runs, forward and backward (plain data; see the module doc)."""

    kind: PlanKind
    spec: TTSpec  # the chain planned for (over the whole padded matrix)
    n_tokens: int
    dtype_bytes: int
    cudagraphs: bool
    strategy: Strategy  # "factored" | "dense" (linear); "tables" | "dense" (embedding)
    split: int  # the bond between the two halves (1..d-1)
    left: Bracket  # merge order of cores[:split]
    right: Bracket  # merge order of cores[split:]
    steps: tuple[GemmStep, ...]
    candidates: tuple[tuple[str, float], ...]  # (strategy, estimated seconds), cheapest first
    einsum_flops: int  # forward+backward FLOPs of torch.einsum's left-to-right order (0: n/a)
    plan_time_s: float
    table_shapes: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None  # embedding "tables"

    @property
    def est_s(self) -> float:
        return dict(self.candidates)[self.strategy]

    @property
    def fmt(self) -> str:
        return self.spec.fmt

    @property
    def row_modes(self) -> tuple[int, ...]:
        return self.spec.row_modes

    @property
    def col_modes(self) -> tuple[int, ...]:
        return self.spec.col_modes

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.spec.ranks

    @property
    def cut(self) -> Cut:
        """The token-independent part: the split and both halves' merge orders."""
        return Cut(self.split, self.left, self.right)

    @property
    def flops(self) -> int:
        return sum(s.flops for s in self.steps)

    @property
    def forms_dense_weight(self) -> bool:
        return self.strategy == "dense"

    def steps_in(self, *phases: Phase) -> tuple[GemmStep, ...]:
        return tuple(s for s in self.steps if s.phase in phases)

    def summary(self) -> str:
        """One line for ``explain``: the strategy, its estimate, and the alternative."""
        alts = ", ".join(f"{n} ~{t * 1e6:.1f} us" for n, t in self.candidates if n != self.strategy)
        ratio = f"; {self.flops / self.einsum_flops:.2f}x torch.einsum's FLOPs" if self.einsum_flops else ""
        return (f"{self.strategy} ~{self.est_s * 1e6:.1f} us fwd+bwd at {self.n_tokens} tokens "
                f"({_si(self.flops)}FLOP{ratio}); other: {alts or 'none'}")

    def describe(self) -> str:
        head = (f"{self.kind} {self.fmt} rows={list(self.row_modes)} cols={list(self.col_modes)} "
                f"ranks={list(self.ranks)} tokens={self.n_tokens}: {self.strategy}"
                f"{' [forms the dense weight]' if self.forms_dense_weight else ''}")
        if self.fmt == "btt":
            halves = "  cores R [b1, b2, c, r] and L [r, c, b1, a]; the gate folded into R"
        elif self.strategy == "contract":
            halves = "  the tokens contracted through the cores pairwise in opt_einsum's order (gates folded in)"
        else:
            halves = f"  halves: cores 1-{self.split} merged as {_show(self.left)}, {self.split + 1}-{len(self.ranks) - 1} " \
                     f"as {_show(self.right)} (token-independent, batched over the layer's group)"
        lines = [head, halves] + [s.describe() for s in self.steps]
        lines.append(f"  total ~{self.est_s * 1e6:.1f} us ({'inside a CUDA graph' if self.cudagraphs else 'no CUDA graph'}"
                     f"; planned in {self.plan_time_s * 1e3:.2f} ms)")
        lines.append("  candidates (est fwd+bwd): " + ", ".join(f"{n} ~{t * 1e6:.1f} us" for n, t in self.candidates))
        if self.einsum_flops:
            lines.append(f"  torch.einsum left-to-right: {_si(self.einsum_flops)}FLOP fwd+bwd")
        return "\n".join(lines)


def _show(b: Bracket) -> str:
    return f"G{b + 1}" if isinstance(b, int) else f"({_show(b[0])}·{_show(b[1])})"


_SI = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0))


def _si(x: float) -> str:
    """``x`` to three significant digits with an SI prefix, never in exponent notation: "16.1G", "999M",
    "1G" for 999.7e6 (which rounds up to the next prefix), "5000T"."""
    for i, (unit, scale) in enumerate(_SI):
        if abs(x) >= scale or not unit:
            v = x / scale
            if abs(v) < 999.5:
                return f"{v:.3g}{unit}"
            return f"{v / 1000:.3g}{_SI[i - 1][0]}" if i > 0 else f"{v:.0f}{unit}"
    raise AssertionError("unreachable")


class _Costing:
    """Accumulates the steps of one candidate, priced at a profile's tensor-train rates: a GEMM takes
    ``max(FLOPs / rate, bytes / bandwidth)`` plus a launch, a copy ``bytes / bandwidth`` plus a launch
    (``blocks``: at the btt blocks path's bandwidth)."""

    def __init__(self, profile: DeviceProfile, dtype_bytes: int, cudagraphs: bool, blocks: bool = False):
        if not profile.has_tt_rates:
            raise ValueError(f"profile {profile.name!r} has no tensor-train rates (tt_* fields): plan with "
                             "comera_compile.devices.H200, the planner's default on every device")
        self.e, self.steps = dtype_bytes, []
        self.rate = profile.tt_gemm_flops if dtype_bytes <= 2 else profile.tt_fp32_gemm_flops
        self.bandwidth = profile.tt_skinny_gemm_bandwidth
        if blocks and profile.btt_blocks_bandwidth is not None:
            self.bandwidth = profile.btt_blocks_bandwidth
        self.launch = profile.tt_graph_launch_s if cudagraphs else profile.tt_launch_s

    def gemm(self, phase: Phase, label: str, m: int, n: int, k: int, batch: int = 1, share: float = 1.0) -> None:
        flops, nbytes = 2 * batch * m * n * k, self.e * batch * (m * k + k * n + m * n)
        t = max(flops / self.rate, nbytes / self.bandwidth) + self.launch
        self.steps.append(GemmStep(phase, label, m, n, k, batch, flops, nbytes, t * share))

    def copy(self, phase: Phase, label: str, nbytes: int, share: float = 1.0) -> None:
        t = nbytes / self.bandwidth + self.launch
        self.steps.append(GemmStep(phase, label, 0, 0, 0, 1, 0, nbytes, t * share))

    @property
    def total(self) -> float:
        return sum(s.est_s for s in self.steps)


def _add_merges(c: _Costing, spec: TTSpec, cut: Cut) -> None:
    """The halves' merges, forward and backward (two products each), for one layer."""
    for name, br in (("L", cut.left), ("R", cut.right)):
        for m, n, k in _merge_gemms(br, spec.sizes, spec.ranks):
            c.gemm("merge", f"{name}: merge", m, n, k)
            c.gemm("merge_backward", f"d{name}: merge bwd", m, k, n)
            c.gemm("merge_backward", f"d{name}: merge bwd", k, n, m)


def _dense_weight_costing(profile: DeviceProfile, dtype_bytes: int, cudagraphs: bool,
                          spec: TTSpec) -> tuple[_Costing, int]:
    """The costing of a dense-weight candidate so far: the weight merged from its two halves at the best
    split (forward) and the gradient taken back through that product (``dL``, ``dR``); the caller adds
    what uses ``W``. Returns the costing and the split."""
    b = dense_split(spec)
    sizes, ranks = spec.sizes, spec.ranks
    c = _Costing(profile, dtype_bytes, cudagraphs)
    _add_merges(c, spec, cut_at(spec, b))
    sl, sr = math.prod(sizes[:b]), math.prod(sizes[b:])
    c.gemm("merge", "W = L·R", sl, sr, ranks[b])
    if spec.interleaved:
        c.copy("merge", "W: modes to rows x cols", 2 * dtype_bytes * spec.padded_rows * spec.padded_cols)
    c.gemm("merge_backward", "dL = dW·Rᵀ", sl, ranks[b], sr)
    c.gemm("merge_backward", "dR = Lᵀ·dW", ranks[b], sr, sl)
    return c, b


def dense_split(spec: TTSpec) -> int:
    """The bond that makes the dense weight cheapest: both halves' merges plus ``L·R`` (ties: the
    spec's ``natural_split``)."""
    sizes, ranks, d = spec.sizes, spec.ranks, spec.n_cores

    def flops(b: int) -> int:
        cut = cut_at(spec, b)
        gemms = _merge_gemms(cut.left, sizes, ranks) + _merge_gemms(cut.right, sizes, ranks)
        merges = sum(m * n * k for m, n, k in gemms)
        return merges + math.prod(sizes[:b]) * ranks[b] * math.prod(sizes[b:])

    natural = spec.natural_split
    return min(range(1, d), key=lambda b: (flops(b), abs(b - natural)))


def _einsum_flops(spec: TTSpec, n: int) -> int:
    """Forward+backward FLOPs of ``torch.einsum(x, G1, ..., Gd)`` contracted left to right (each
    pairwise product's backward is two products of the same FLOPs)."""
    g = _network(spec, n)
    sizes = _edge_sizes(g)
    leaves = ["x"] + [f"G{k + 1}" for k in range(spec.n_cores)]
    idx = [g.nodes[v]["indices"] for v in leaves]
    eq = ",".join(idx) + "->" + g.nodes["y"]["indices"]
    path = [(0, 1)] + [(0, len(leaves) - 2 - j) for j in range(len(leaves) - 2)]
    _, info = oe.contract_path(eq, *[tuple(sizes[s] for s in i) for i in idx], shapes=True, optimize=path)
    return 3 * int(info.opt_cost)


def _choose(kind: PlanKind, spec: TTSpec, n: int, dtype_bytes: int, cudagraphs: bool,
            cands: dict[str, tuple[_Costing, int]], t0: float, einsum_flops: int = 0,
            tables: dict[int, Any] | None = None, force: str | None = None, cut: Cut | None = None) -> TTPlan:
    """The plan of the cheapest candidate (``(costing, split)`` by strategy), with every candidate's
    estimate, cheapest first."""
    best = force if force in cands else min(cands, key=lambda k: cands[k][0].total)
    order = tuple(sorted(((k, v[0].total) for k, v in cands.items()), key=lambda kv: kv[1]))
    chosen, split = cands[best]
    cut = cut or cut_at(spec, split)
    return TTPlan(kind=kind, spec=spec, n_tokens=n, dtype_bytes=dtype_bytes, cudagraphs=cudagraphs, strategy=best,
                  split=split, left=cut.left, right=cut.right, steps=tuple(chosen.steps), candidates=order,
                  einsum_flops=einsum_flops, plan_time_s=time.perf_counter() - t0,
                  table_shapes=tables[split] if best == "tables" else None)


# ----------------------------------------------------------------------------- linear


@functools.lru_cache(maxsize=4096)
def _plan_linear_cached(spec: TTSpec, n: int, dtype_bytes: int, cudagraphs: bool, profile: DeviceProfile,
                        force: str | None = None) -> TTPlan:
    t0 = time.perf_counter()
    P, Q = spec.padded_rows, spec.padded_cols
    cands: dict[str, tuple[_Costing, int]] = {}
    a = spec.bottleneck
    if a is not None:  # the low-rank bottleneck between the row and the column modes
        r = spec.ranks[a]
        c = _Costing(profile, dtype_bytes, cudagraphs)
        _add_merges(c, spec, cut_at(spec, a))
        c.gemm("forward", "T = X·L", n, r, P)
        c.gemm("forward", "Y = T·R", n, Q, r)
        c.gemm("backward", "dT = dY·Rᵀ", n, r, Q)
        c.gemm("backward", "dX = dT·Lᵀ", n, P, r)
        c.gemm("backward", "dL = Xᵀ·dT", P, r, n)
        c.gemm("backward", "dR = Tᵀ·dY", r, Q, n)
        cands["factored"] = (c, a)
    c, b = _dense_weight_costing(profile, dtype_bytes, cudagraphs, spec)
    if spec.interleaved:
        c.copy("merge_backward", "dW: back to chain order", 2 * dtype_bytes * P * Q)
    c.gemm("forward", "Y = X·W", n, Q, P)
    c.gemm("backward", "dX = dY·Wᵀ", n, P, Q)
    c.gemm("backward", "dW = Xᵀ·dY", P, Q, n)
    cands["dense"] = (c, b)
    if spec.interleaved:  # a TT-matrix: the tokens contracted through the cores, the weight never formed
        cands["contract"] = (_contract_costing(profile, dtype_bytes, cudagraphs, spec, n), spec.natural_split)
    return _choose("linear", spec, n, dtype_bytes, cudagraphs, cands, t0, einsum_flops=_einsum_flops(spec, n),
                   force=force)


def _gemm_dims(step: str, sizes: dict[str, int]) -> tuple[int, int, int, int]:
    """``(m, n, k, batch)`` of one pairwise einsum ``"ab,bc->ac"``: k the contracted indices, batch the
    indices of both operands kept in the output, m / n the rest of each operand."""
    (a, b), out = step.split("->")[0].split(","), step.split("->")[1]
    prod = lambda chars: math.prod(sizes[ch] for ch in chars)  # noqa: E731
    shared = set(a) & set(b)
    batch = "".join(ch for ch in shared if ch in out)
    k = "".join(ch for ch in shared if ch not in out)
    return prod(set(a) - shared), prod(set(b) - shared), prod(k), prod(batch)


@functools.lru_cache(maxsize=1024)
def _contraction_cached(spec: TTSpec, n: int) -> tuple[str, tuple, tuple[str, ...], dict[str, int]]:
    """The equation, opt_einsum's path, its pairwise steps and the index sizes."""
    g = _network(spec, n)
    sizes = _edge_sizes(g)
    leaves = ["x"] + [f"G{k + 1}" for k in range(spec.n_cores)]
    idx = [g.nodes[v]["indices"] for v in leaves]
    eq = ",".join(idx) + "->" + g.nodes["y"]["indices"]
    path, info = oe.contract_path(eq, *[tuple(sizes[ch] for ch in i) for i in idx], shapes=True, optimize="dp")
    return eq, tuple(tuple(p) for p in path), tuple(step[2] for step in info.contraction_list), sizes


def contraction_path(spec: TTSpec, n_tokens: Any) -> tuple[str, tuple]:
    """``(equation, path)``: the einsum of ``x [n, i1..id]`` with the cores (boundary ranks squeezed)
    giving ``y [n, o1..od]``, and opt_einsum's (``dp``) pairwise order for ``n_tokens`` tokens: the
    ``"contract"`` strategy of a TT-matrix linear (executed by ``tt_runtime.ttm_contract``)."""
    eq, path, _, _ = _contraction_cached(_structure(spec), size_hint(n_tokens))
    return eq, path


def _contract_costing(profile: DeviceProfile, dtype_bytes: int, cudagraphs: bool, spec: TTSpec, n: int) -> _Costing:
    """The ``"contract"`` candidate: each pairwise product of the path as a GEMM forward and two
    backward, each output regrouped (a copy) forward and its gradient backward."""
    c = _Costing(profile, dtype_bytes, cudagraphs)
    _, _, steps, sizes = _contraction_cached(spec, n)
    for step in steps:
        m, nn_, k, batch = _gemm_dims(step, sizes)
        c.gemm("forward", f"contract {step}", m, nn_, k, batch)
        c.copy("forward", "regroup", 2 * dtype_bytes * batch * m * nn_)
        c.copy("backward", "regroup", 2 * dtype_bytes * batch * m * nn_)
        c.gemm("backward", f"d(left) of {step}", m, k, nn_, batch)
        c.gemm("backward", f"d(right) of {step}", k, nn_, m, batch)
    return c


def _plannable(spec: TTSpec, what: str) -> TTSpec:
    """The structure to plan for ``spec`` (a ValueError when there is nothing to plan)."""
    if spec.fmt == "btt":
        raise ValueError(f"a 'btt' {what} is not a chain: plan a linear with plan_btt_linear; an embedding's "
                         f"table is formed by the marker op ({2 * spec.ranks[1] * spec.padded_rows * spec.padded_cols:,} "
                         "FLOPs, one batched GEMM), then looked up")
    s = _structure(spec)
    _check_alphabet(s)
    if s.n_cores < 2:
        raise ValueError(f"a TT {what} needs at least two cores to plan a "
                         f"{'contraction' if what == 'layer' else 'lookup'}")
    return s


def plan_linear(spec: TTSpec, n_tokens: Any, dtype_bytes: int = 2, *, cudagraphs: bool = False,
                profile: DeviceProfile = devices.H200, strategy: str | None = None, model: Any = None) -> TTPlan:
    """Plan ``x @ M`` (forward and backward) for the TT layer ``spec`` at ``n_tokens`` tokens (see the
    module doc).

    ``n_tokens`` may be an int, a ``torch.SymInt`` or a sympy expression (its size hint is used; no
    guard). ``cudagraphs`` costs launches as inside a CUDA graph. Plans are cached on the chain
    (format, modes, ranks) and the other arguments; ``rows``, ``cols`` and ``transpose`` do not
    change a plan. ``strategy`` pins a candidate when the layer has it (else the cheapest wins); every
    candidate is costed either way. ``profile``: the device's rates (its ``tt_`` fields; the H200's by
    default, on every device; a profile without them raises a ValueError); ``model``: its deprecated
    predecessor (a ``DeviceModel``, with a DeprecationWarning).
    """
    return _plan_linear_cached(_plannable(spec, "layer"), size_hint(n_tokens), int(dtype_bytes), bool(cudagraphs),
                               _profile(profile, model), strategy)


@functools.lru_cache(maxsize=1024)
def _plan_btt_cached(spec: TTSpec, n: int, dtype_bytes: int, cudagraphs: bool, profile: DeviceProfile,
                     force: str | None = None) -> TTPlan:
    t0 = time.perf_counter()
    (b1, b2), (c, a), r = spec.row_modes, spec.col_modes, spec.ranks[1]
    P, Q, e = spec.padded_rows, spec.padded_cols, dtype_bytes
    blocks = _Costing(profile, dtype_bytes, cudagraphs, blocks=True)
    blocks.copy("forward", "X: tokens to j-major", 2 * e * n * P)
    blocks.gemm("forward", "T = X·(R g), per j", n, c * r, b2, batch=b1)
    blocks.copy("forward", "T: j-major to c-major", 2 * e * n * b1 * c * r)
    blocks.gemm("forward", "Y = T·L, per c", n, a, b1 * r, batch=c)
    blocks.copy("forward", "Y: c-major to tokens", 2 * e * n * Q)
    blocks.copy("backward", "dY: tokens to c-major", 2 * e * n * Q)
    blocks.gemm("backward", "dT = dY·Lᵀ, per c", n, b1 * r, a, batch=c)
    blocks.gemm("backward", "dL = Tᵀ·dY, per c", b1 * r, a, n, batch=c)
    blocks.copy("backward", "dT: c-major to j-major", 2 * e * n * b1 * c * r)
    blocks.gemm("backward", "dX = dT·(R g)ᵀ, per j", n, b2, c * r, batch=b1)
    blocks.gemm("backward", "d(R g) = Xᵀ·dT, per j", b2, c * r, n, batch=b1)
    blocks.copy("backward", "dX: j-major to tokens", 2 * e * n * P)
    dense = _Costing(profile, dtype_bytes, cudagraphs)
    dense.gemm("merge", "W = (R g)·L, per block", b2, a, r, batch=b1 * c)
    dense.copy("merge", "W: blocks to rows x cols", 2 * e * P * Q)
    dense.gemm("forward", "Y = X·W", n, Q, P)
    dense.gemm("backward", "dX = dY·Wᵀ", n, P, Q)
    dense.gemm("backward", "dW = Xᵀ·dY", P, Q, n)
    dense.gemm("merge_backward", "d(R g) = dW·Lᵀ, per block", b2, r, a, batch=b1 * c)
    dense.gemm("merge_backward", "dL = (R g)ᵀ·dW, per block", r, a, b2, batch=b1 * c)
    return _choose("linear", spec, n, dtype_bytes, cudagraphs, {"blocks": (blocks, 1), "dense": (dense, 1)}, t0,
                   force=force, cut=Cut(1, 0, 1))  # no chain to cut: R and L as they are


def plan_btt_linear(spec: TTSpec, n_tokens: Any, dtype_bytes: int = 2, *, cudagraphs: bool = False,
                    profile: DeviceProfile = devices.H200, strategy: str | None = None, model: Any = None) -> TTPlan:
    """Plan ``x @ M`` (forward and backward) for the block tensor-train layer ``spec`` (``fmt="btt"``) at
    ``n_tokens`` tokens. Two candidates:

    * ``"blocks"``: the tokens contracted through the cores, two batched GEMMs forward
      (``T = X·(R g)`` over the ``b1`` row blocks, ``Y = T·L`` over the ``c`` column blocks), four
      backward, ``2 * n * r * (P * c + Q * b1)`` FLOPs forward, plus the copies that regroup ``X``, ``T``
      and ``Y`` (and their gradients) between token-major and block-major order (``comera::btt_swap``);
      the weight is never formed;
    * ``"dense"``: the weight formed (one batched GEMM over the blocks), then ``nn.Linear``'s GEMMs.

    ``P x Q`` is the padded matrix. The cheaper estimate wins (:meth:`TTPlan.describe` lists both), or
    ``strategy`` when it names one of the two. ``profile`` / ``model``: as for :func:`plan_linear` (the
    blocks path at the profile's ``btt_blocks_bandwidth``)."""
    if spec.fmt != "btt":
        raise ValueError(f"plan_btt_linear plans a 'btt' layer; got fmt={spec.fmt!r} (use plan_linear)")
    padded = TTSpec("btt", spec.row_modes, spec.col_modes, spec.ranks, spec.padded_rows, spec.padded_cols, False)
    return _plan_btt_cached(padded, size_hint(n_tokens), int(dtype_bytes), bool(cudagraphs), _profile(profile, model),
                            strategy)


def plan_tt_linear(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                   n_tokens: Any, dtype_bytes: int = 2, *, cudagraphs: bool = False,
                   profile: DeviceProfile = devices.H200, model: Any = None) -> TTPlan:
    """:func:`plan_linear` for the chain ``(fmt, row_modes, col_modes, ranks)``."""
    return plan_linear(_chain(fmt, row_modes, col_modes, ranks), n_tokens, dtype_bytes, cudagraphs=cudagraphs,
                       profile=_profile(profile, model))


# ----------------------------------------------------------------------------- embedding


def _table_shapes(spec: TTSpec, split: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    modes = spec.chain_modes
    left, right = modes[:split], modes[split:]
    r = spec.ranks[split]
    return ((math.prod(m for m, _ in left), math.prod(n for _, n in left), r),
            (math.prod(m for m, _ in right), math.prod(n for _, n in right), r))


def table_shapes(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                 split: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(I_L, O_L, r), (I_R, O_R, r)``: the row and column extents of the two halves at ``split``."""
    return _table_shapes(_chain(fmt, row_modes, col_modes, ranks), split)


@functools.lru_cache(maxsize=1024)
def _plan_embedding_cached(spec: TTSpec, n: int, dtype_bytes: int, cudagraphs: bool, profile: DeviceProfile,
                           force: str | None = None) -> TTPlan:
    t0 = time.perf_counter()
    P, Q = spec.padded_rows, spec.padded_cols
    e = dtype_bytes
    cands: dict[str, tuple[_Costing, int]] = {}
    tables: dict[int, Any] = {}
    for b in range(1, spec.n_cores):
        (il, ol, r), (ir, orr, _) = tables[b] = _table_shapes(spec, b)
        c = _Costing(profile, dtype_bytes, cudagraphs)
        _add_merges(c, spec, cut_at(spec, b))
        c.copy("forward", "gather A[iL], B[iR]", e * n * (ol + orr) * r * 2)
        c.gemm("forward", "out = A[iL]·B[iR]ᵀ", ol, orr, r, batch=n)
        c.gemm("backward", "dA[iL] = dout·B[iR]", ol, r, orr, batch=n)
        c.gemm("backward", "dB[iR] = doutᵀ·A[iL]", orr, r, ol, batch=n)
        c.copy("backward", "scatter-add into dA, dB", 4 * (n * (ol + orr) * r * 2 + (il * ol + ir * orr) * r))
        if "tables" not in cands or c.total < cands["tables"][0].total:
            cands["tables"] = (c, b)
    c, b = _dense_weight_costing(profile, dtype_bytes, cudagraphs, spec)
    c.copy("forward", "lookup W[idx]", 2 * e * n * Q)
    c.copy("backward", "dW: zero + scatter-add", 4 * (P * Q + 2 * n * Q))
    cands["dense"] = (c, b)
    return _choose("embedding", spec, n, dtype_bytes, cudagraphs, cands, t0, tables=tables, force=force)


def plan_embedding(spec: TTSpec, n_lookups: Any, dtype_bytes: int = 2, *, cudagraphs: bool = False,
                   profile: DeviceProfile = devices.H200, strategy: str | None = None, model: Any = None) -> TTPlan:
    """Plan a lookup of the TT embedding ``spec`` (forward + backward): gathered tables at the best
    bond, or the dense table when that is cheaper (small vocabularies); ``strategy`` pins one.
    ``profile`` / ``model``: as for :func:`plan_linear`."""
    return _plan_embedding_cached(_plannable(spec, "embedding"), size_hint(n_lookups), int(dtype_bytes),
                                  bool(cudagraphs), _profile(profile, model), strategy)


def plan_tt_embedding(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                      n_lookups: Any, dtype_bytes: int = 2, *, cudagraphs: bool = False,
                      profile: DeviceProfile = devices.H200, model: Any = None) -> TTPlan:
    """:func:`plan_embedding` for the chain ``(fmt, row_modes, col_modes, ranks)``."""
    return plan_embedding(_chain(fmt, row_modes, col_modes, ranks), n_lookups, dtype_bytes, cudagraphs=cudagraphs,
                          profile=_profile(profile, model))


def clear_plan_cache() -> None:
    _plan_linear_cached.cache_clear()
    _plan_embedding_cached.cache_clear()
    _plan_btt_cached.cache_clear()
    _bracket_cached.cache_clear()
