"""Contraction planner for tensor-train nodes (``comera::tt_linear``, ``comera::tt_embedding``).

A TT node is a tensor network (``tt_network``): a networkx multigraph whose nodes are tensors
(the activation ``x``, the cores ``G1..Gd``, the output ``y``) and whose edges are indices carrying
their sizes. Gates are absorbed into the core on their left before planning (an elementwise scale,
token-independent), so the network is the chain of cores plus the activation.

A contraction order is a binary *contraction tree* over ``x`` and the cores. The planner builds
candidate trees:

* ``split@k``: the cores left of bond k merged into one tensor, the cores right of it into another
  (each half merged in its cheapest order: an interval dynamic programme over the chain), and the
  token-sized work is two contractions (``(x·A)·B`` or ``(x·B)·A``). At the bond between
  the row and the column cores of the ``"tt"`` format this is CoMERA's path: A = L [I, r],
  B = R [r, O], forward ``(X L) R``, backward four token-sized GEMMs (dY Rᵀ, ·Lᵀ, T1ᵀ dY, Xᵀ U1),
  every core gradient then token-independent.
* opt_einsum paths over the whole network (``dp`` and ``greedy`` up to 6 cores, ``greedy`` and
  ``branch-1`` beyond, to stay within the 15 ms plan budget), which may interleave ``x`` with
  single cores;
* ``dense`` (merge every core into the weight, then one GEMM), kept for comparison and chosen only
  with ``allow_dense=True``: the compiled graph must never form the dense weight.

Each tree is costed for the forward *and* the backward together: the backward of every pairwise
contraction ``C = P·Q`` is the two contractions ``dP = dC·Q`` and ``dQ = P·dC``; intermediates that
the backward needs are recomputed (the op returns only ``y``), except inside the fused Triton kernels,
which keep the rank-sized intermediate on chip. Costs are FLOPs, bytes moved and kernel launches,
folded into one time estimate ``Σ max(flops / 790 TFLOP/s, bytes / 4.3 TB/s) + launches · 3 µs``
(H200, bf16); a tree whose forward FLOPs exceed 8x the best one's is not costed further. The plan
is plain data: ``print(plan.describe())`` shows every step with its cost, the alternatives and the
baselines; ``Plan.steps`` is what the ops execute (each pairwise step is one GEMM).

Baseline ``torch.einsum`` default: a TT layer written as one ``torch.einsum(eq, x, G1, ..., Gd)``
is contracted by torch left to right (operand 0 with 1, the result with operand 2, ...) when
opt_einsum is not used (``torch.backends.opt_einsum.enabled = False`` or not installed). We cost that
left-to-right path with opt_einsum's ``contract_path`` given the explicit pairwise path, times three
for forward plus autograd backward (each pairwise product's backward is two products of the same
FLOPs). ``Plan.baselines`` also records the fwd+bwd FLOPs of opt_einsum's ``greedy`` and ``auto``
paths (``auto`` is what torch.einsum uses when opt_einsum is installed) for comparison.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import networkx as nx
import opt_einsum as oe

PEAK_FLOPS = 790e12  # measured bf16 GEMM rate on the H200 (ANCHORS.md)
PEAK_BYTES = 4.3e12  # measured device-memory bandwidth on the H200
LAUNCH_S = 3e-6  # one kernel launch (eager); CUDA graphs make it smaller
MAX_FUSED_RANK = 128  # the fused Triton chain keeps a [BLOCK_M, r] tile in registers

_ROW_SYMBOLS = "abcdefghijklm"
_COL_SYMBOLS = "opqrstuvwxyz"
_RANK_SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_TOKEN = "n"
_ORDER = {s: i for i, s in enumerate(_TOKEN + _ROW_SYMBOLS + _COL_SYMBOLS + _RANK_SYMBOLS)}


# ----------------------------------------------------------------------------- size hints


def size_hint(n: Any, fallback: int = 4096) -> int:
    """An int for a token count that may be an int, a ``torch.SymInt`` or a sympy expression.

    Reads the size hint without installing a guard: ``ShapeEnv.optimization_hint`` (torch 2.13),
    ``SymNode.hint_int`` / ``ShapeEnv.size_hint`` (torch 2.11). A free sympy expression without a
    shape environment has no hint: ``fallback`` is used.
    """
    if isinstance(n, bool):
        raise TypeError("n_tokens must be an integer, not bool")
    if isinstance(n, int):
        return n
    node = getattr(n, "node", None)
    if node is not None:  # torch.SymInt
        shape_env = getattr(node, "shape_env", None)
        expr = getattr(node, "expr", None)
        if shape_env is not None and expr is not None:
            for name in ("optimization_hint", "size_hint"):
                fn = getattr(shape_env, name, None)
                if fn is None:
                    continue
                try:
                    return int(fn(expr))
                except Exception:
                    pass
        for name in ("hint_int", "optimization_hint"):
            fn = getattr(node, name, None)
            if fn is not None:
                try:
                    return int(fn())
                except Exception:
                    pass
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        return fallback
    try:
        import sympy

        if isinstance(n, sympy.Expr):
            return int(n) if n.is_number else fallback
    except ImportError:  # pragma: no cover
        pass
    return int(n)


def token_bucket(n: int) -> int:
    """The power of two at or above ``n``: plans keyed on it are shared by nearby token counts."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- the network


def core_ranks(fmt: str, cores_shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """``(r_0, ..., r_d)`` from the core shapes."""
    return tuple(int(s[0]) for s in cores_shapes) + (int(cores_shapes[-1][-1]),)


def _check(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]) -> int:
    if fmt not in ("tt", "ttm"):
        raise ValueError(f"TT format must be 'tt' or 'ttm', got {fmt!r}")
    d = len(row_modes) + len(col_modes) if fmt == "tt" else len(row_modes)
    if fmt == "ttm" and len(row_modes) != len(col_modes):
        raise ValueError(f"'ttm' needs as many row modes as column modes, got {row_modes} and {col_modes}")
    if len(ranks) != d + 1 or ranks[0] != 1 or ranks[-1] != 1:
        raise ValueError(f"ranks must have {d + 1} entries starting and ending with 1, got {list(ranks)}")
    if len(row_modes) > len(_ROW_SYMBOLS) or len(col_modes) > len(_COL_SYMBOLS):
        raise ValueError("too many modes for the planner's index alphabet")
    return d


def core_indices(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], d: int) -> list[str]:
    """Index symbols of each core with the boundary ranks r_0 = r_d = 1 squeezed out."""
    out = []
    for k in range(d):
        left = _RANK_SYMBOLS[k - 1] if k > 0 else ""
        right = _RANK_SYMBOLS[k] if k < d - 1 else ""
        if fmt == "tt":
            a = len(row_modes)
            mode = _ROW_SYMBOLS[k] if k < a else _COL_SYMBOLS[k - a]
            out.append(left + mode + right)
        else:
            out.append(left + _ROW_SYMBOLS[k] + _COL_SYMBOLS[k] + right)
    return out


def tt_network(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
               n_tokens: Any = None) -> nx.MultiGraph:
    """The TT node as a tensor network: tensors are nodes (attribute ``indices``), each index an edge
    (key = index symbol, attributes ``size`` and ``name``). ``y`` is the output node; an embedding
    network (``n_tokens=None``) has no ``x`` and its row indices end on ``y`` too."""
    d = _check(fmt, row_modes, col_modes, ranks)
    g = nx.MultiGraph()
    sizes = {}
    names = {}
    for k, m in enumerate(row_modes):
        sizes[_ROW_SYMBOLS[k]] = int(m)
        names[_ROW_SYMBOLS[k]] = f"i{k + 1}"
    for k, m in enumerate(col_modes):
        sizes[_COL_SYMBOLS[k]] = int(m)
        names[_COL_SYMBOLS[k]] = f"o{k + 1}"
    for k in range(1, d):
        sizes[_RANK_SYMBOLS[k - 1]] = int(ranks[k])
        names[_RANK_SYMBOLS[k - 1]] = f"r{k}"
    rows = "".join(_ROW_SYMBOLS[: len(row_modes)])
    cols = "".join(_COL_SYMBOLS[: len(col_modes)])
    if n_tokens is not None:
        sizes[_TOKEN] = size_hint(n_tokens)
        names[_TOKEN] = "tokens"
        g.add_node("x", indices=_TOKEN + rows, kind="input")
        g.add_node("y", indices=_TOKEN + cols, kind="output")
    else:
        g.add_node("y", indices=rows + cols, kind="output")
    for k, idx in enumerate(core_indices(fmt, row_modes, col_modes, d)):
        g.add_node(f"G{k + 1}", indices=idx, kind="core")
    holders: dict[str, list[str]] = {}
    for node, data in g.nodes(data=True):
        for s in data["indices"]:
            holders.setdefault(s, []).append(node)
    for s, nodes in holders.items():
        assert len(nodes) == 2, (s, nodes)
        g.add_edge(nodes[0], nodes[1], key=s, size=sizes[s], name=names[s])
    return g


class _Net:
    """Index bookkeeping over a ``tt_network``: the boundary indices of any set of tensors."""

    def __init__(self, g: nx.MultiGraph):
        self.g = g
        self.leaf_indices = {n: d["indices"] for n, d in g.nodes(data=True) if n != "y"}
        self.sizes = {k: d["size"] for _, _, k, d in g.edges(keys=True, data=True)}
        self.names = {k: d["name"] for _, _, k, d in g.edges(keys=True, data=True)}
        self.out = g.nodes["y"]["indices"]
        self.pairs: dict = {}
        self._indices: dict = {}
        self._numel: dict = {}
        self.holders: dict[str, set] = {}
        for leaf, idx in self.leaf_indices.items():
            for s in idx:
                self.holders.setdefault(s, set()).add(leaf)

    def indices(self, leaves: frozenset) -> str:
        """Indices of the tensor made by contracting ``leaves``: those with an edge leaving the set."""
        hit = self._indices.get(leaves)
        if hit is not None:
            return hit
        if len(leaves) == 1:
            hit = self.leaf_indices[next(iter(leaves))]
        else:
            # an index stays open unless every tensor holding it is in the set (the output holds
            # the token and column indices, so those always stay open)
            keep = {s for u in leaves for s in self.leaf_indices[u]
                    if s in self.out or not self.holders[s] <= leaves}
            hit = "".join(sorted(keep, key=_ORDER.__getitem__))
        self._indices[leaves] = hit
        return hit

    def numel(self, idx: str) -> int:
        hit = self._numel.get(idx)
        if hit is None:
            hit = self._numel[idx] = math.prod(self.sizes[s] for s in idx)
        return hit


# ----------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class Step:
    """One pairwise contraction ``out = einsum(equation, *inputs)`` (or one fused kernel)."""

    phase: str  # "merge" | "forward" | "recompute" | "backward" | "merge_backward"
    out: str
    inputs: tuple[str, ...]
    equation: str
    flops: int
    bytes: int
    launches: int
    token_sized: bool
    kernel: str = "torch.mm"

    def describe(self) -> str:
        return (f"  {self.phase:<14} {self.out:<10} = {self.equation:<24} ({', '.join(self.inputs)})"
                f"  {_si(self.flops)}FLOP {_si(self.bytes)}B  {self.kernel}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one TT node is contracted, forward and backward, with its costs (plain data)."""

    kind: str  # "linear" | "embedding"
    fmt: str
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]
    n_tokens: int
    strategy: str
    tree: Any  # nested tuples of leaf names
    steps: tuple[Step, ...]
    leaf_indices: tuple[tuple[str, str], ...]
    sizes: tuple[tuple[str, int], ...]
    out_indices: str
    fused: str | None  # "xlr": the (x·L)·R chain runs as fused Triton kernels
    forms_dense_weight: bool
    recomputed: tuple[str, ...]
    flops: int
    bytes: int
    launches: int
    est_time_s: float
    alternatives: tuple[tuple[str, int, int, int, float], ...]
    baselines: tuple[tuple[str, int], ...]  # (name, forward+backward FLOPs)
    plan_time_s: float
    split: int | None = None  # bond of the two-half split (1..d-1), when the tree is one

    @property
    def einsum_default_flops(self) -> int:
        """Forward + backward FLOPs of torch.einsum's default (left-to-right) path; see module doc."""
        return dict(self.baselines)["torch.einsum left-to-right"]

    def steps_in(self, *phases: str) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.phase in phases)

    def summary(self) -> str:
        """One line for ``explain``: the path, its fwd+bwd costs and the ratio to torch.einsum's."""
        tok = sum(1 for s in self.steps if s.token_sized)
        return (f"{self.strategy}{' [fused ' + self.fused + ']' if self.fused else ''}: {tok} token-sized steps, "
                f"{_si(self.flops)}FLOP {_si(self.bytes)}B {self.launches} launches fwd+bwd "
                f"({self.flops / max(1, self.einsum_default_flops):.2f}x torch.einsum's FLOPs)")

    def describe(self) -> str:
        head = (f"{self.kind} {self.fmt} rows={list(self.row_modes)} cols={list(self.col_modes)} "
                f"ranks={list(self.ranks)} tokens={self.n_tokens}: {self.strategy}"
                f"{' [fused ' + self.fused + ']' if self.fused else ''}"
                f"{' [FORMS DENSE WEIGHT]' if self.forms_dense_weight else ''}")
        tot = (f"  total {_si(self.flops)}FLOP {_si(self.bytes)}B {self.launches} launches "
               f"~{self.est_time_s * 1e6:.1f} us (planned in {self.plan_time_s * 1e3:.2f} ms)")
        legend = "  indices: " + " ".join(f"{s}={n}" for s, n in self.sizes)
        alts = ["  alternatives (strategy, FLOP, bytes, launches, est us):"] + [
            f"    {a[0]:<28} {_si(a[1])}FLOP {_si(a[2])}B {a[3]:>3} {a[4] * 1e6:9.1f}" for a in self.alternatives]
        base = ["  baselines fwd+bwd: " + ", ".join(f"{n} {_si(f)}FLOP" for n, f in self.baselines)]
        rec = [f"  recomputed in backward: {', '.join(self.recomputed)}"] if self.recomputed else []
        return "\n".join([head, legend] + [s.describe() for s in self.steps] + [tot] + rec + base + alts)


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


# ----------------------------------------------------------------------------- trees


@functools.lru_cache(maxsize=65536)
def _leaves(tree) -> frozenset:
    return frozenset([tree]) if isinstance(tree, str) else _leaves(tree[0]) | _leaves(tree[1])


@functools.lru_cache(maxsize=65536)
def _name(leaves: frozenset) -> str:
    if len(leaves) == 1:
        return next(iter(leaves))
    cores = sorted(int(s[1:]) for s in leaves if s != "x")
    rng = f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))
    return ("T" if "x" in leaves else "G") + rng


def _path_to_tree(leaves: Sequence[str], path) -> Any:
    ops = list(leaves)
    for pair in path:
        pair = sorted(pair, reverse=True)
        picked = [ops.pop(i) for i in pair]
        ops.append(picked[1] if len(picked) == 1 else (picked[1], picked[0]))
    assert len(ops) == 1
    return ops[0]


def _subtree(net: _Net, cores: Sequence[str]) -> Any:
    """The cheapest contraction tree merging a run of consecutive ``cores`` (token-independent).

    A chain has no profitable outer products, so the optimum merges contiguous runs: an interval
    dynamic programme over FLOPs (what opt_einsum's ``optimal`` finds on a chain, in microseconds).
    """
    k = len(cores)
    best: dict[tuple[int, int], tuple[int, Any]] = {(i, i): (0, cores[i]) for i in range(k)}
    for span in range(1, k):
        for i in range(k - span):
            j = i + span
            cands = []
            for m in range(i, j):
                fl, tl = best[(i, m)]
                fr, tr = best[(m + 1, j)]
                cands.append((fl + fr + _pair_eq(net, _leaves(tl), _leaves(tr))[3], (tl, tr)))
            best[(i, j)] = min(cands, key=lambda c: c[0])
    return best[(0, k - 1)][1]


@functools.lru_cache(maxsize=4096)
def _cached_path(eq: str, shapes: tuple, optimize) -> tuple[list, int]:
    path, info = oe.contract_path(eq, *shapes, shapes=True, optimize=list(optimize) if isinstance(
        optimize, tuple) else optimize)
    return path, int(info.opt_cost)


def _full_path_tree(net: _Net, leaves: Sequence[str], optimize) -> Any:
    eq = ",".join(net.leaf_indices[c] for c in leaves) + "->" + net.out
    shapes = tuple(tuple(net.sizes[s] for s in net.leaf_indices[c]) for c in leaves)
    path, cost = _cached_path(eq, shapes, tuple(optimize) if isinstance(optimize, list) else optimize)
    return _path_to_tree(leaves, path), cost


def _left_to_right(n: int) -> list[tuple[int, int]]:
    """torch.einsum's own order in opt_einsum path notation (results are appended at the end)."""
    return [(0, 1)] + [(0, n - 2 - j) for j in range(n - 2)]


def _pair_eq(net: _Net, a: frozenset, b: frozenset) -> tuple[str, str, str, int]:
    key = (a, b)
    hit = net.pairs.get(key)
    if hit is None:
        hit = net.pairs[key] = _pair_eq_uncached(net, a, b)
    return hit


def _pair_eq_uncached(net: _Net, a: frozenset, b: frozenset) -> tuple[str, str, str, int]:
    ia, ib, ic = net.indices(a), net.indices(b), net.indices(a | b)
    union = set(ia) | set(ib)
    flops = (2 if (set(ia) & set(ib)) - set(ic) else 1) * math.prod(net.sizes[s] for s in union)
    return ia, ib, ic, flops


def _internal_nodes(tree) -> list:
    """The pairwise contractions of a contraction tree (nested tuples of leaf names), in post-order."""
    if isinstance(tree, str):
        return []
    return _internal_nodes(tree[0]) + _internal_nodes(tree[1]) + [tree]


def _cost_tree(net: _Net, tree, dtype_bytes: int, fused_ok: bool) -> dict:
    """Steps and totals of forward + backward for one contraction tree."""
    steps: list[Step] = []
    internal = _internal_nodes(tree)
    root = _leaves(tree)
    names = {}
    for t in internal:
        names[_leaves(t)] = _name(_leaves(t))
    names[root] = "y"

    def nm(s: frozenset) -> str:
        return names.get(s) or _name(s)

    # the fused (x·L)·R chain: root = (x, A)·B with a [n, r] intermediate
    fused = None
    if fused_ok and not isinstance(tree, str):
        left, right = tree
        for first, second in ((left, right), (right, left)):
            if isinstance(first, tuple) and "x" in _leaves(first) and "x" not in _leaves(second):
                a, b = first
                xa = a if a == "x" else b if b == "x" else None
                other = b if xa is a else a
                t_idx = net.indices(_leaves(first))
                if (xa == "x" and "x" not in _leaves(other) and len(t_idx) == 2 and t_idx[0] == _TOKEN
                        and net.sizes[t_idx[1]] <= MAX_FUSED_RANK):
                    fused = (other, second, first)
                break

    for t in internal:
        a, b = _leaves(t[0]), _leaves(t[1])
        ia, ib, ic, flops = _pair_eq(net, a, b)
        tok = _TOKEN in ic or _TOKEN in ia or _TOKEN in ib
        nbytes = dtype_bytes * (net.numel(ia) + net.numel(ib) + net.numel(ic))
        eq = f"{ia},{ib}->{ic}"
        phase = "forward" if tok else "merge"
        steps.append(Step(phase, nm(_leaves(t)), (nm(a), nm(b)), eq, flops, nbytes, 1, tok))
    # backward: reverse post-order, two contractions per step; a forward intermediate that the
    # backward reads is recomputed (the op returns only y)
    needed = set()
    bwd = []
    for t in reversed(internal):
        a, b = _leaves(t[0]), _leaves(t[1])
        ia, ib, ic, flops = _pair_eq(net, a, b)
        tok = _TOKEN in ic or _TOKEN in ia or _TOKEN in ib
        phase = "backward" if tok else "merge_backward"
        for tgt, other, it, io in ((a, b, ia, ib), (b, a, ib, ia)):
            nbytes = dtype_bytes * (net.numel(ic) + net.numel(io) + net.numel(it))
            bwd.append(Step(phase, "d" + nm(tgt), ("d" + nm(_leaves(t)), nm(other)),
                            f"{ic},{io}->{it}", flops, nbytes, 1, tok))
            if len(other) > 1:
                needed.add(other)
    # the backward re-runs the token-independent merges (cheap) and the forward steps whose
    # outputs it reads (the op returns only y)
    merge_steps = [s for s in steps if s.phase == "merge"]
    needed_names = {nm(x) for x in needed}
    rec = [dataclasses.replace(s, phase="recompute") for s in steps
           if s.phase == "merge" or (s.phase == "forward" and s.out in needed_names)]
    recomputed = [s.out for s in rec]
    all_steps = list(steps) + rec + bwd

    if fused is not None:
        other, second, first = fused
        xa, ab, ay = nm(frozenset(["x"])), nm(_leaves(other)), nm(_leaves(second))
        t_name = nm(_leaves(first))
        ix, iA, iB, iy = net.indices(frozenset(["x"])), net.indices(_leaves(other)), net.indices(
            _leaves(second)), net.out
        it = net.indices(_leaves(first))
        n = net.sizes[_TOKEN]
        f1 = _pair_eq(net, frozenset(["x"]), _leaves(other))[3]
        f2 = _pair_eq(net, _leaves(first), _leaves(second))[3]
        bx, bA, bB, by, bt = (dtype_bytes * net.numel(i) for i in (ix, iA, iB, iy, it))
        keep = [s for s in all_steps if not s.token_sized]
        fwd = Step("forward", "y", (xa, ab, ay), f"{ix},{iA},{iB}->{iy}", f1 + f2, bx + bA + bB + by, 1, True,
                   "triton:tt_xlr_fwd")
        bwd_f = Step("backward", f"{t_name},d{t_name},dx", ("x", "dy", ab, ay),
                     f"{ix},{iA}->{it}; {iy},{iB}->{it}; {it},{iA}->{ix}", f1 + f2 + f1,
                     bx + by + bA + bB + bx + 2 * bt, 1, True, "triton:tt_xlr_bwd")
        dA = Step("backward", "d" + ab, ("x", "d" + t_name), f"{ix},{it}->{iA}", f1, bx + bt + bA, 1, True,
                  "torch.matmul")
        dB = Step("backward", "d" + ay, (t_name, "dy"), f"{it},{iy}->{iB}", f2, bt + by + bB, 1, True,
                  "torch.matmul")
        merges = [s for s in keep if s.phase == "merge"]
        rec_m = [s for s in keep if s.phase == "recompute"]
        mb = [s for s in keep if s.phase == "merge_backward"]
        all_steps = merges + [fwd] + rec_m + [bwd_f, dA, dB] + mb
        recomputed = [s.out for s in rec_m] + [f"{t_name} (inside triton:tt_xlr_bwd)"]
        fused_tag = "xlr"
    else:
        fused_tag = None

    flops = sum(s.flops for s in all_steps)
    nbytes = sum(s.bytes for s in all_steps)
    launches = sum(s.launches for s in all_steps)
    est = sum(max(s.flops / PEAK_FLOPS, s.bytes / PEAK_BYTES) for s in all_steps) + launches * LAUNCH_S
    cores = frozenset(n for n in net.leaf_indices if n != "x")
    dense = any(_leaves(t) == cores for t in internal) and len(cores) > 1
    return dict(steps=tuple(all_steps), flops=flops, bytes=nbytes, launches=launches, est=est, fused=fused_tag,
                dense=dense, recomputed=tuple(recomputed))


def _has_subtree(tree, leaves: frozenset) -> bool:
    if isinstance(tree, str):
        return len(leaves) == 1 and tree in leaves
    return _leaves(tree) == leaves or _has_subtree(tree[0], leaves) or _has_subtree(tree[1], leaves)


def _forward_flops(net: _Net, tree) -> int:
    if isinstance(tree, str):
        return 0
    return (_forward_flops(net, tree[0]) + _forward_flops(net, tree[1])
            + _pair_eq(net, _leaves(tree[0]), _leaves(tree[1]))[3])


def _tree_key(tree) -> Any:
    if isinstance(tree, str):
        return tree
    a, b = _tree_key(tree[0]), _tree_key(tree[1])
    return tuple(sorted((a, b), key=repr))


@functools.lru_cache(maxsize=4096)
def _plan_linear_cached(fmt: str, row_modes: tuple, col_modes: tuple, ranks: tuple, n: int, dtype_bytes: int,
                        allow_dense: bool, fused_ok: bool) -> Plan:
    t0 = time.perf_counter()
    g = tt_network(fmt, row_modes, col_modes, ranks, n)
    net = _Net(g)
    d = len(ranks) - 1
    cores = [f"G{k + 1}" for k in range(d)]
    cands: dict[Any, tuple[str, Any]] = {}

    def add(name, tree, split=None):
        key = _tree_key(tree)
        if key not in cands:
            cands[key] = (name, tree, split)

    for k in range(1, d):
        A, B = _subtree(net, cores[:k]), _subtree(net, cores[k:])
        add(f"split@{k} (x·G1-{k})·G{k + 1}-{d}", (("x", A), B), k)
        add(f"split@{k} (x·G{k + 1}-{d})·G1-{k}", (("x", B), A), k)
    leaves = ["x"] + cores
    # opt_einsum over the whole network: exact dynamic programming while it stays fast
    for opt in (("dp", "greedy") if d <= 6 else ("greedy", "branch-1")):
        tree, _ = _full_path_tree(net, leaves, opt)
        add(f"opt_einsum:{opt}", tree)
    lr_tree, _ = _full_path_tree(net, leaves, _left_to_right(len(leaves)))
    add("torch.einsum left-to-right", lr_tree)
    add("dense (merge all cores)", ("x", _subtree(net, cores)))

    # prune: a tree whose forward FLOPs are far above the best one's cannot win (the backward
    # roughly doubles every token-sized step); the dense tree is always costed, for the record
    all_cores = frozenset(cores)
    fwd = {key: _forward_flops(net, tree) for key, (_, tree, _) in cands.items()}
    dense = {key: _has_subtree(tree, all_cores) for key, (_, tree, _) in cands.items()}
    floor = min(f for key, f in fwd.items() if allow_dense or not dense[key])
    costed = []
    for key, (name, tree, split) in cands.items():
        if fwd[key] > 8 * floor and not dense[key]:
            continue
        costed.append((name, tree, split, _cost_tree(net, tree, dtype_bytes, fused_ok)))
    allowed = [x for x in costed if allow_dense or not x[3]["dense"]]
    name, tree, split, c = min(allowed, key=lambda x: (x[3]["est"], x[3]["flops"]))

    baselines = []
    for label, opt in (("torch.einsum left-to-right", _left_to_right(len(leaves))),
                       ("opt_einsum greedy", "greedy"), ("opt_einsum auto (torch.einsum with opt_einsum)", "auto")):
        _, fwd = _full_path_tree(net, leaves, opt)
        baselines.append((label, 3 * fwd))
    alts = tuple(sorted(((nm_, x["flops"], x["bytes"], x["launches"], x["est"]) for nm_, _, _, x in costed),
                        key=lambda a: a[4]))
    return Plan(kind="linear", fmt=fmt, row_modes=row_modes, col_modes=col_modes, ranks=ranks, n_tokens=n,
                strategy=name, tree=tree, steps=c["steps"], leaf_indices=tuple(net.leaf_indices.items()),
                sizes=tuple((net.names[s] + ":" + s, v) for s, v in sorted(net.sizes.items(),
                                                                            key=lambda kv: _ORDER[kv[0]])),
                out_indices=net.out, fused=c["fused"], forms_dense_weight=c["dense"], recomputed=c["recomputed"],
                flops=c["flops"], bytes=c["bytes"], launches=c["launches"], est_time_s=c["est"], alternatives=alts,
                baselines=tuple(baselines), plan_time_s=time.perf_counter() - t0, split=split)


def plan_tt_linear(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                   n_tokens: Any, dtype_bytes: int = 2, *, allow_dense: bool = False, fused: bool = True) -> Plan:
    """Plan forward and backward of ``x @ M`` for a TT layer (see the module doc).

    ``n_tokens`` may be an int, a ``torch.SymInt`` or a sympy expression: the plan uses its size
    hint and never guards. Plans are cached on the static tuple (ranks included, so a rank change
    re-plans). ``fused=False`` costs the plan for the torch path (no fused Triton chain).
    """
    return _plan_linear_cached(fmt, tuple(int(m) for m in row_modes), tuple(int(m) for m in col_modes),
                               tuple(int(r) for r in ranks), size_hint(n_tokens), int(dtype_bytes),
                               bool(allow_dense), bool(fused))


# ----------------------------------------------------------------------------- embedding


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """How a TT embedding lookup is computed: the cores left of bond ``split`` are merged into a table
    A [I_L, O_L, r], the rest into B [I_R, O_R, r]; row i = (iL, iR) gives out = A[iL] · B[iR]ᵀ
    ([O_L, O_R], flattened row-major). Both tables are ~sqrt of the vocabulary, so neither the weight
    nor a vocabulary-sized gradient is ever formed; the backward scatter-adds into the tables and
    then runs the merges backward into the cores."""

    fmt: str
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]
    n_lookups: int
    strategy: str
    split: int
    steps: tuple[Step, ...]  # merges of the two tables and their backward (token-independent)
    leaf_indices: tuple[tuple[str, str], ...]
    tables: tuple[str, str]  # names of A and B in ``steps``
    sizes: tuple[tuple[str, int], ...]  # ("name:symbol", size) of every index
    table_shapes: tuple[tuple[int, int, int], tuple[int, int, int]]  # (I_L, O_L, r), (I_R, O_R, r)
    flops: int
    bytes: int
    launches: int
    est_time_s: float
    alternatives: tuple[tuple[str, int, int, int, float], ...]
    plan_time_s: float

    def steps_in(self, *phases: str) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.phase in phases)

    def describe(self) -> str:
        (il, ol, r), (ir, orr, _) = self.table_shapes
        lines = [f"embedding {self.fmt} rows={list(self.row_modes)} cols={list(self.col_modes)} "
                 f"ranks={list(self.ranks)} lookups={self.n_lookups}: {self.strategy}",
                 f"  tables A[{il}, {ol}, {r}] ({self.tables[0]}) and B[{ir}, {orr}, {r}] ({self.tables[1]}); "
                 f"per lookup out[{ol}, {orr}] = A[iL] · B[iR]^T (triton:tt_emb_fwd)"]
        lines += [s.describe() for s in self.steps]
        lines += [f"  total {_si(self.flops)}FLOP {_si(self.bytes)}B {self.launches} launches "
                  f"~{self.est_time_s * 1e6:.1f} us (planned in {self.plan_time_s * 1e3:.2f} ms)",
                  "  alternatives (strategy, FLOP, bytes, launches, est us):"]
        lines += [f"    {a[0]:<28} {_si(a[1])}FLOP {_si(a[2])}B {a[3]:>3} {a[4] * 1e6:9.1f}"
                  for a in self.alternatives]
        return "\n".join(lines)


def _merge_steps(net: _Net, tree, dtype_bytes: int) -> tuple[list[Step], list[Step]]:
    """Forward and backward steps of merging a subtree of cores (token-independent)."""
    fwd: list[Step] = []
    internal = _internal_nodes(tree)
    for t in internal:
        a, b = _leaves(t[0]), _leaves(t[1])
        ia, ib, ic, flops = _pair_eq(net, a, b)
        nbytes = dtype_bytes * (net.numel(ia) + net.numel(ib) + net.numel(ic))
        fwd.append(Step("merge", _name(_leaves(t)), (_name(a), _name(b)), f"{ia},{ib}->{ic}", flops, nbytes, 1,
                        False))
    bwd = []
    for t in reversed(internal):
        a, b = _leaves(t[0]), _leaves(t[1])
        ia, ib, ic, flops = _pair_eq(net, a, b)
        for tgt, other, it, io in ((a, b, ia, ib), (b, a, ib, ia)):
            nbytes = dtype_bytes * (net.numel(ic) + net.numel(io) + net.numel(it))
            bwd.append(Step("merge_backward", "d" + _name(tgt), ("d" + _name(_leaves(t)), _name(other)),
                            f"{ic},{io}->{it}", flops, nbytes, 1, False))
    return fwd, bwd


@functools.lru_cache(maxsize=1024)
def _plan_embedding_cached(fmt, row_modes, col_modes, ranks, n, dtype_bytes) -> EmbeddingPlan:
    t0 = time.perf_counter()
    net = _Net(tt_network(fmt, row_modes, col_modes, ranks, None))
    d = len(ranks) - 1
    cores = [f"G{k + 1}" for k in range(d)]
    rows_p = math.prod(row_modes)
    costed = []
    for k in range(1, d):
        A, B = frozenset(cores[:k]), frozenset(cores[k:])
        ia, ib = net.indices(A), net.indices(B)
        shp = []
        for idx in (ia, ib):
            il = math.prod(net.sizes[s] for s in idx if s in _ROW_SYMBOLS)
            ol = math.prod(net.sizes[s] for s in idx if s in _COL_SYMBOLS)
            shp.append((il, ol, ranks[k]))
        (il, ol, r), (ir, orr, _) = shp
        vocab_sized = il >= rows_p or ir >= rows_p
        fa, ba = _merge_steps(net, _subtree(net, cores[:k]), dtype_bytes)
        fb, bb = _merge_steps(net, _subtree(net, cores[k:]), dtype_bytes)
        steps = fa + fb + bb + ba
        per = 2 * ol * r * orr
        # forward: two gathered slices and one small GEMM per lookup; backward: two GEMMs per lookup
        # and scatter-adds into the tables; the merges run again for the backward
        flops = sum(s.flops for s in steps) + sum(s.flops for s in fa + fb) + 3 * n * per
        nbytes = (sum(s.bytes for s in steps) + sum(s.bytes for s in fa + fb)
                  + dtype_bytes * n * 2 * ol * orr + 4 * n * 3 * r * (ol + orr) + 4 * 2 * (il * ol + ir * orr) * r)
        launches = len(steps) + len(fa + fb) + 4
        est = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) + launches * LAUNCH_S
        name = f"tables@{k} A[iL]·B[iR]" + (" (vocabulary-sized table)" if vocab_sized else "")
        costed.append((vocab_sized, est, name, k, tuple(steps), (_name(A), _name(B)), tuple(shp), flops, nbytes,
                       launches))
    best = min(costed, key=lambda c: (c[0], c[1]))
    alts = tuple(sorted(((c[2], c[7], c[8], c[9], c[1]) for c in costed), key=lambda a: a[4]))
    return EmbeddingPlan(fmt=fmt, row_modes=row_modes, col_modes=col_modes, ranks=ranks, n_lookups=n,
                         strategy=best[2], split=best[3], steps=best[4], leaf_indices=tuple(net.leaf_indices.items()),
                         sizes=tuple((net.names[s] + ":" + s, v) for s, v in sorted(net.sizes.items(),
                                                                                     key=lambda kv: _ORDER[kv[0]])),
                         tables=best[5], table_shapes=best[6], flops=best[7], bytes=best[8], launches=best[9],
                         est_time_s=best[1], alternatives=alts, plan_time_s=time.perf_counter() - t0)


def plan_tt_embedding(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                      n_lookups: Any, dtype_bytes: int = 2) -> EmbeddingPlan:
    """Plan a TT embedding lookup (forward + backward) for either format: choose the bond that splits
    the cores into two gathered tables, preferring splits where neither table is vocabulary-sized."""
    return _plan_embedding_cached(fmt, tuple(int(m) for m in row_modes), tuple(int(m) for m in col_modes),
                                  tuple(int(r) for r in ranks), size_hint(n_lookups), int(dtype_bytes))


def clear_plan_cache() -> None:
    _plan_linear_cached.cache_clear()
    _plan_embedding_cached.cache_clear()
