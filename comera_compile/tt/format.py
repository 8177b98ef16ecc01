"""Tensor-train (TT), TT-matrix (TTM) and block tensor-train (BTT) formats as pure functions.

A TT layer stores a matrix ``M`` of logical shape ``[rows, cols]`` padded to
``[prod(row_modes), prod(col_modes)]``:

* ``"tt"``: cores ``[r_{k-1}, n_k, r_k]`` with ``n = row_modes + col_modes`` (CoMERA's linear format:
  input modes first, then output modes, so ``M = L @ R`` through the middle bond);
* ``"ttm"``: cores ``[r_{k-1}, m_k, n_k, r_k]``, row index ``(i_1..i_d)`` and column index
  ``(o_1..o_d)`` both row-major;
* one gate vector per internal bond, multiplied between core ``k`` and core ``k+1``.

Both formats are handled here as one *chain* of 3-D cores ``[r_{k-1}, s_k, r_k]`` (``s_k = n_k`` for
TT, ``s_k = m_k * n_k`` for TTM); only the index permutation at the end differs.

* ``"btt"`` (two-core block tensor-train, Qiu et al. 2024; a Monarch matrix at rank 1) is not a
  chain: ``row_modes = (b1, b2)`` (``b1`` row blocks of ``b2``), ``col_modes = (c, a)`` (``c`` column
  blocks of ``a``), cores ``R [b1, b2, c, r]`` and ``L [r, c, b1, a]``, one gate ``g`` on the rank
  bond: ``M[(j, b), (c, a)] = sum_k R[j, b, c, k] g[k] L[k, c, j, a]``. Every ``(j, c)`` block of
  ``M`` is a ``b2 x a`` matrix of rank <= r, while ``M`` itself is full-rank in general. Its rank sits
  last in the first core and first in the second, as a chain's internal bond does, so rank pruning
  slices it like one; ``ranks`` is ``(1, r, 1)``. It has its own contraction (:func:`_btt_materialize`),
  init and SVD (:func:`_btt_svd`, exact: one truncated SVD per block).

:class:`TTSpec` is the one description of a layer (format, modes, ranks, logical matrix): it checks
itself when built, checks cores against itself (:meth:`TTSpec.check_cores`), reads its ranks off
cores (:meth:`TTSpec.from_cores`), and writes and reads the arguments of the marker op
``comera::tt_materialize`` (:meth:`TTSpec.materialize_args`, :meth:`TTSpec.from_materialize_node`).
What depends on the format is here: :func:`n_cores`, :func:`chain_modes`, :func:`core_shapes` and
the spec's ``bottleneck`` and ``interleaved``.

Everything here is shape arithmetic or plain torch; the marker op (``kernels/tt_materialize.py``)
calls :func:`materialize` and :func:`materialize_vjp`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, Sequence, get_args

import sympy
import torch

#: The formats: ``"tt"`` (CoMERA's linear format), ``"ttm"`` (TT-matrix / MPO) and ``"btt"``
#: (two-core block tensor-train).
Format = Literal["tt", "ttm", "btt"]
FORMATS: tuple[str, ...] = get_args(Format)

__all__ = [
    "FORMATS",
    "Format",
    "TTSpec",
    "arrange_modes",
    "bottleneck_factors",
    "cap_ranks",
    "chain_modes",
    "chain_ranks",
    "core_shapes",
    "core_sizes",
    "count_params",
    "default_n_modes",
    "factorize",
    "fit_ranks",
    "materialize",
    "materialize_vjp",
    "n_cores",
    "normalize_ranks",
    "random_cores",
    "rank_bounds",
    "ranks_from_shapes",
    "join_flat",
    "split_flat",
    "tt_svd",
]


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


def _prod(xs: Sequence[int]) -> int:
    return math.prod([int(x) for x in xs])  # a list, not a generator: Dynamo folds math.prod of constants


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_format(fmt: Any) -> None:
    if fmt not in FORMATS:
        names = ", ".join(repr(f) for f in FORMATS[:-1]) + f" or {FORMATS[-1]!r}"
        raise ValueError(f"fmt must be {names}, got {fmt!r}")


def n_cores(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int]) -> int:
    """How many cores the format has: one per mode for TT, one per (row, column) mode pair for TTM,
    two for BTT."""
    if fmt == "btt":
        return 2
    return len(row_modes) + len(col_modes) if fmt == "tt" else len(row_modes)


def chain_modes(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The (row, column) extent of each core's middle index: ``(m, 1)`` / ``(1, n)`` for a ``"tt"``
    row / column core, ``(m, n)`` for a ``"ttm"`` core (the chain mode ``s_k`` is their product).
    ``"btt"``: ``(b1 * b2, c)`` for ``R`` and ``(b1, c * a)`` for ``L`` (the row and column indices each
    core touches), so ``s_k`` is again the core's parameters per unit of rank."""
    if fmt == "btt":
        (b1, b2), (c, a) = row_modes, col_modes
        return ((int(b1) * int(b2), int(c)), (int(b1), int(c) * int(a)))
    if fmt == "tt":
        return tuple((int(m), 1) for m in row_modes) + tuple((1, int(n)) for n in col_modes)
    return tuple((int(m), int(n)) for m, n in zip(row_modes, col_modes))


def core_sizes(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int]) -> tuple[int, ...]:
    """The chain mode ``s_k`` of every core: ``n_k`` for TT, ``m_k * n_k`` for TTM."""
    return tuple(m * n for m, n in chain_modes(fmt, row_modes, col_modes))


def chain_ranks(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """``(r_0, ..., r_d)`` read off the core shapes (core ``k`` is ``[r_{k-1}, ..., r_k]``)."""
    return tuple(int(s[0]) for s in shapes) + (int(shapes[-1][-1]),)


def ranks_from_shapes(fmt: str, shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The ranks ``(1, ..., 1)`` of a layer of format ``fmt`` read off its core shapes: the chain's
    (:func:`chain_ranks`), or ``(1, r, 1)`` for ``"btt"`` (``R``'s last dimension)."""
    if fmt == "btt":
        return (1, int(shapes[0][-1]), 1)
    return chain_ranks(shapes)


def fit_ranks(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int],
              ranks: Sequence[int]) -> tuple[int, ...]:
    """``ranks`` capped where a larger rank cannot help: :func:`cap_ranks` of the chain, or for
    ``"btt"`` the block rank ``min(b2, a)`` (each ``b2 x a`` block has no higher rank)."""
    if fmt == "btt":
        return (1, min(int(ranks[1]), int(row_modes[1]), int(col_modes[1])), 1)
    return cap_ranks(core_sizes(fmt, row_modes, col_modes), ranks)


def rank_bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    """Largest useful rank of each bond (ends included): a bond never exceeds the product of the
    chain modes on either side of it, since a larger rank adds parameters but no expressiveness."""
    d = len(sizes)
    return tuple(min(_prod(sizes[:k]), _prod(sizes[k:])) for k in range(d + 1))


def normalize_ranks(rank: int | Sequence[int], n_cores: int) -> tuple[int, ...]:
    """Full rank tuple ``(1, r_1, ..., r_{d-1}, 1)`` from an int or a per-bond list.

    A list has either ``d - 1`` entries (one per internal bond) or ``d + 1`` entries with 1 at both
    ends (CoMERA's spelling, e.g. ``[1, 12, 30, 30, 30, 12, 1]``). Raises ValueError otherwise.
    """
    inner = n_cores - 1
    if _is_int(rank):
        if rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank}")
        return (1,) + (rank,) * inner + (1,)
    try:
        values = list(rank)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"rank must be a positive int or a list of ints, got {type(rank).__name__}"
        ) from None
    if not all(_is_int(v) for v in values):
        raise ValueError(f"rank list must hold ints, got {values}")
    if len(values) == inner + 2:
        if values[0] != 1 or values[-1] != 1:
            raise ValueError(
                f"a rank list of length {inner + 2} must start and end with 1, got {values}"
            )
        values = values[1:-1]
    elif len(values) != inner:
        raise ValueError(
            f"rank list must have {inner} entries (one per internal bond of {n_cores} cores) "
            f"or {inner + 2} with 1 at both ends; got {len(values)}: {values}"
        )
    if any(v < 1 for v in values):
        raise ValueError(f"ranks must be positive, got {values}")
    return (1,) + tuple(values) + (1,)


def cap_ranks(sizes: Sequence[int], ranks: Sequence[int]) -> tuple[int, ...]:
    """Clip each bond rank to :func:`rank_bounds`, then to what its neighbours allow
    (``r_k <= r_{k-1} * s_k`` and ``r_k <= s_{k+1} * r_{k+1}``): beyond either, the extra rank
    spans nothing new (and TT-SVD could not fill it)."""
    r = [min(int(v), b) for v, b in zip(ranks, rank_bounds(sizes))]
    for k in range(1, len(r)):
        r[k] = min(r[k], r[k - 1] * sizes[k - 1])
    for k in range(len(r) - 2, -1, -1):
        r[k] = min(r[k], sizes[k] * r[k + 1])
    return tuple(r)


def core_shapes(
    fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Shape of every core: ``[r, n, r]`` for TT, ``[r, m, n, r]`` for TTM, ``R [b1, b2, c, r]`` and
    ``L [r, c, b1, a]`` for BTT."""
    if fmt == "btt":
        (b1, b2), (c, a), r = row_modes, col_modes, ranks[1]
        return ((b1, b2, c, r), (r, c, b1, a))
    if fmt == "tt":
        modes = tuple(row_modes) + tuple(col_modes)
        return tuple((ranks[k], modes[k], ranks[k + 1]) for k in range(len(modes)))
    return tuple(
        (ranks[k], row_modes[k], col_modes[k], ranks[k + 1]) for k in range(len(row_modes))
    )


def count_params(shapes: Sequence[Sequence[int]], include_gates: bool = True) -> int:
    """Parameters of a TT layer: every core's full volume (3-D and 4-D alike), plus the gates
    (one per internal bond, as long as the bond) when ``include_gates``."""
    total = sum(_prod(s) for s in shapes)
    if include_gates:
        total += sum(s[-1] for s in shapes[:-1])
    return total


class _SpecFields(NamedTuple):
    fmt: str
    row_modes: tuple[int, ...]
    col_modes: tuple[int, ...]
    ranks: tuple[int, ...]
    rows: int
    cols: int
    transpose: bool = False


#: The arguments of ``comera::tt_materialize`` (its schema): the flat storages, then a spec's fields.
MATERIALIZE_ARGS = ("core_flat", "gate_flat") + _SpecFields._fields


class TTSpec(_SpecFields):
    """The one description of a TT layer: format, modes, ranks and the logical matrix.

    ``ranks`` has ``n_cores + 1`` entries with 1 at both ends. ``rows``/``cols`` is the logical
    matrix; ``transpose`` says the layer's weight is ``M.T`` (nn.Linear: rows = in, cols = out).
    Built once, checked once (a ValueError names what does not fit). Its fields are, in order, the
    arguments of ``comera::tt_materialize`` after the two flat storages. A NamedTuple: immutable,
    hashable (plans are cached on it) and written into an FX graph as ``TTSpec(...)``.
    """

    __slots__ = ()

    def __new__(cls, fmt: str, row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int],
                rows: int, cols: int, transpose: bool = False) -> "TTSpec":
        _check_format(fmt)
        self = super().__new__(cls, fmt, tuple(int(v) for v in row_modes), tuple(int(v) for v in col_modes),
                               tuple(int(v) for v in ranks), int(rows), int(cols), bool(transpose))
        self._validate()
        return self

    def _validate(self) -> None:
        if not self.row_modes or not self.col_modes:
            raise ValueError("row_modes and col_modes must each have at least one mode")
        if any(m < 1 for m in self.row_modes + self.col_modes):
            raise ValueError(f"modes must be positive: {list(self.row_modes)}, {list(self.col_modes)}")
        if self.fmt == "btt" and (len(self.row_modes), len(self.col_modes)) != (2, 2):
            raise ValueError(
                "the block tensor-train format needs two row modes (b1 blocks of b2) and two column modes "
                f"(c blocks of a), got {list(self.row_modes)} and {list(self.col_modes)}"
            )
        if self.fmt == "ttm" and len(self.row_modes) != len(self.col_modes):
            raise ValueError(
                "the TT-matrix format needs as many row modes as column modes, got "
                f"{list(self.row_modes)} and {list(self.col_modes)}"
            )
        P, Q = self.padded_rows, self.padded_cols
        if P < self.rows or Q < self.cols:
            raise ValueError(
                f"rows={self.rows}, cols={self.cols} exceed the padded shape {P}x{Q}: modes "
                f"{list(self.row_modes)} x {list(self.col_modes)} cover {P} x {Q}, less than the matrix "
                f"{self.rows} x {self.cols}"
            )
        d = self.n_cores
        if len(self.ranks) != d + 1 or self.ranks[0] != 1 or self.ranks[-1] != 1:
            raise ValueError(
                f"ranks must have {d + 1} entries with 1 at both ends, got {list(self.ranks)}"
            )
        if any(r < 0 for r in self.ranks):
            raise ValueError(f"ranks must be non-negative, got {list(self.ranks)}")

    @classmethod
    def from_cores(cls, cores: Sequence[torch.Tensor], fmt: str, row_modes: Sequence[int],
                   col_modes: Sequence[int], rows: int, cols: int, transpose: bool = False, *,
                   gates: Sequence[torch.Tensor] | None = None) -> "TTSpec":
        """The spec of these cores, its ranks read off their shapes (ranks change under rank
        pruning). Checks the format, the number of cores, the spec itself and, with ``gates``, every
        core's and gate's shape."""
        _check_format(fmt)
        d = n_cores(fmt, row_modes, col_modes)
        if len(cores) != d:
            raise ValueError(f"{fmt!r} with row_modes {list(row_modes)} and col_modes {list(col_modes)} needs "
                             f"{d} cores, got {len(cores)}")
        if not cores:
            raise ValueError("at least one core is required")
        spec = cls(fmt, row_modes, col_modes, ranks_from_shapes(fmt, [c.shape for c in cores]), rows, cols,
                   transpose)
        if gates is not None:
            spec.check_cores(cores, gates)
        return spec

    @classmethod
    def from_materialize_node(cls, node: Any) -> "TTSpec":
        """The spec of a ``comera::tt_materialize`` call in an FX graph: its arguments after the two
        flat storages (``node.args``, as :meth:`materialize_args` writes them). Raises ValueError for
        a call that does not pass them so."""
        if node.kwargs or len(node.args) != len(MATERIALIZE_ARGS):
            raise ValueError(f"tt_materialize called with {len(node.args)} positional arguments and keywords "
                             f"{sorted(node.kwargs)}; expected the {len(MATERIALIZE_ARGS)} of its schema by position")
        return cls(*node.args[2:])

    def materialize_args(self, core_flat: Any, gate_flat: Any) -> tuple:
        """The arguments of ``comera::tt_materialize`` for this layer, in the order of its schema:
        ``(core_flat, gate_flat, fmt, row_modes, col_modes, ranks, rows, cols, transpose)``."""
        return (core_flat, gate_flat, self.fmt, list(self.row_modes), list(self.col_modes), list(self.ranks),
                self.rows, self.cols, self.transpose)

    def op_args(self) -> tuple:
        """The metadata arguments of :func:`comera_compile.tt_materialize` after ``cores, gates``
        (the spec less its ranks, which that function reads off the cores)."""
        return (self.fmt, list(self.row_modes), list(self.col_modes), self.rows, self.cols,
                self.transpose)

    def check_cores(self, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> None:
        """Raise ValueError unless ``cores`` and ``gates`` have this spec's counts and shapes."""
        d = self.n_cores
        if len(cores) != d:
            raise ValueError(f"expected {d} cores for {self.describe()} ({self.fmt}), got {len(cores)}")
        if len(gates) != d - 1:
            raise ValueError(f"expected {d - 1} gates (one per internal bond), got {len(gates)}")
        for k, (c, shape) in enumerate(zip(cores, self.core_shapes)):
            if tuple(c.shape) != tuple(shape):
                raise ValueError(f"core {k} has shape {tuple(c.shape)}, expected {tuple(shape)}")
        for k, g in enumerate(gates):
            if tuple(g.shape) != (self.ranks[k + 1],):
                raise ValueError(f"gate {k} has shape {tuple(g.shape)}, expected ({self.ranks[k + 1]},)")

    @property
    def n_cores(self) -> int:
        return n_cores(self.fmt, self.row_modes, self.col_modes)

    @property
    def padded_rows(self) -> int:
        return _prod(self.row_modes)

    @property
    def padded_cols(self) -> int:
        return _prod(self.col_modes)

    @property
    def chain_modes(self) -> tuple[tuple[int, int], ...]:
        """Each core's (row, column) extent (:func:`chain_modes`)."""
        return chain_modes(self.fmt, self.row_modes, self.col_modes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return core_sizes(self.fmt, self.row_modes, self.col_modes)

    @property
    def core_shapes(self) -> tuple[tuple[int, ...], ...]:
        return core_shapes(self.fmt, self.row_modes, self.col_modes, self.ranks)

    @property
    def gate_sizes(self) -> tuple[int, ...]:
        return tuple(self.ranks[1:-1])

    @property
    def bottleneck(self) -> int | None:
        """The bond between the row and the column modes, through which ``M = L @ R`` is a product of
        rank ``ranks[bottleneck]`` (``"tt"``); None where no bond separates them (``"ttm"``: every
        core holds a row and a column mode; ``"btt"``: both cores hold the row block index ``b1`` and
        the column block index ``c``)."""
        return len(self.row_modes) if self.fmt == "tt" else None

    @property
    def interleaved(self) -> bool:
        """Whether the chain's index order interleaves row and column indices (``"ttm"``:
        ``i_1 o_1 i_2 o_2 ...``), so that the matrix is the chain's product permuted."""
        return self.fmt == "ttm"

    @property
    def natural_split(self) -> int:
        """The bond a cut of the chain prefers on equal cost: the bottleneck, else the middle."""
        return self.bottleneck if self.bottleneck is not None else self.n_cores // 2

    @property
    def num_params(self) -> int:
        """Cores and gates."""
        return count_params(self.core_shapes, include_gates=True)

    @property
    def dense_params(self) -> int:
        return self.rows * self.cols

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transpose else (self.rows, self.cols)

    def with_ranks(self, ranks: Sequence[int]) -> "TTSpec":
        return TTSpec(self.fmt, self.row_modes, self.col_modes, tuple(ranks), self.rows,
                      self.cols, self.transpose)

    def describe(self) -> str:
        """Factorization as CoMERA writes it: ``[12,8,8]||[8,8,12]`` or ``[[16,20,10,10],[4,4,8,6]]``;
        a block tensor-train as its blocks, ``[32x24]|[32x24]`` (row blocks x size, column blocks x size)."""
        if self.fmt == "btt":
            return "[{}x{}]|[{}x{}]".format(*self.row_modes, *self.col_modes)
        rm = ",".join(map(str, self.row_modes))
        cm = ",".join(map(str, self.col_modes))
        return f"[{rm}]||[{cm}]" if self.fmt == "tt" else f"[[{rm}],[{cm}]]"


# ----------------------------------------------------------------------------------------------
# Factorization
# ----------------------------------------------------------------------------------------------


def default_n_modes(n: int, base: float = 10.0) -> int:
    """How many modes to split a dimension into: factors near ``base`` (CoMERA: 768 and 3072 into
    three, 30522 into four)."""
    if n < 2:
        return 1
    return max(1, round(math.log(n) / math.log(base)))


def _best_exact(n: int, k: int) -> tuple[int, ...] | None:
    """Nondecreasing ``k`` factors with product exactly ``n`` and the smallest sum."""
    divisors = sympy.divisors(n)
    best: list = [None, math.inf]

    def rec(rest: int, k: int, lo: int, acc: tuple, acc_sum: int) -> None:
        if acc_sum + k * rest ** (1.0 / k) >= best[1] + 1e-9:
            return
        if k == 1:
            if rest >= lo:
                best[0], best[1] = acc + (rest,), acc_sum + rest
            return
        hi = rest ** (1.0 / k) + 1e-9
        for f in divisors:
            if f < lo or rest % f:
                continue
            if f > hi:
                break
            rec(rest // f, k - 1, f, acc + (f,), acc_sum + f)

    rec(n, k, 1, (), 0)
    return best[0]


def _best_padded(lo_n: int, hi_n: int, k: int) -> tuple[int, ...] | None:
    """Nondecreasing ``k`` factors with product in ``[lo_n, hi_n]``: smallest sum, then smallest product."""
    best: list = [None, (math.inf, math.inf)]

    def rec(prod: int, k: int, lo: int, acc: tuple, acc_sum: int) -> None:
        need = -(-lo_n // prod)  # ceil
        if acc_sum + k * need ** (1.0 / k) > best[1][0] + 1e-9:
            return
        if k == 1:
            f = max(lo, need)
            if f * prod <= hi_n:
                key = (acc_sum + f, f * prod)
                if key < best[1]:
                    best[0], best[1] = acc + (f,), key
            return
        f = lo
        while f ** k * prod <= hi_n:
            rec(prod * f, k - 1, f, acc + (f,), acc_sum + f)
            f += 1

    rec(1, k, 2 if lo_n >= 2**k else 1, (), 0)
    return best[0]


def factorize(n: int, n_modes: int, *, max_pad: float = 0.1, slack: float = 0.25) -> tuple[int, ...]:
    """Balanced factors of ``n`` (ascending), padding ``n`` when it factorizes badly.

    "Balanced" means a small sum of modes, which is what TT parameter counts grow with
    (the ideal is ``n_modes * n ** (1 / n_modes)``). An exact factorization within ``slack`` of the
    ideal is used as is; otherwise sizes up to ``n * (1 + max_pad)`` are searched for the smallest
    sum, then the smallest padding. 30522 = 2 * 3 * 5087 into four modes becomes 30576 = 12*13*14*14
    (0.2 % padding; CoMERA's hand-picked 32000 = 16*20*10*10 pads 4.8 %).
    """
    if not _is_int(n) or n < 1:
        raise ValueError(f"size must be a positive int, got {n!r}")
    if not _is_int(n_modes) or n_modes < 1:
        raise ValueError(f"number of modes must be a positive int, got {n_modes!r}")
    if n_modes == 1:
        return (n,)
    exact = _best_exact(n, n_modes)
    ideal = n_modes * n ** (1.0 / n_modes)
    if exact is not None and sum(exact) <= (1 + slack) * ideal or max_pad <= 0:
        return exact
    padded = _best_padded(n, int(n * (1 + max_pad)), n_modes)
    if padded is None or sum(padded) >= sum(exact):
        return exact
    return padded


def arrange_modes(fmt: str, row_modes: Sequence[int], col_modes: Sequence[int]):
    """Order modes so the largest sit at the ends of the chain, where one bond is 1 and the bound
    on the other bond is the mode itself. TT: rows descending, columns ascending (CoMERA's
    ``[12,8,8]||[8,8,12]``); TTM: both alternately from the outside in; BTT: both descending, more
    blocks than block size (the prototype's choice of ``b1`` and ``c``)."""
    if fmt == "btt":
        return tuple(sorted(row_modes, reverse=True)), tuple(sorted(col_modes, reverse=True))
    if fmt == "tt":
        return tuple(sorted(row_modes, reverse=True)), tuple(sorted(col_modes))

    def outside_in(modes):
        desc = sorted(modes, reverse=True)
        out = [0] * len(desc)
        left, right = 0, len(desc) - 1
        for i, m in enumerate(desc):
            if i % 2 == 0:
                out[left] = m
                left += 1
            else:
                out[right] = m
                right -= 1
        return tuple(out)

    return outside_in(row_modes), outside_in(col_modes)


# ----------------------------------------------------------------------------------------------
# Contraction (the torch reference of comera::tt_materialize) and its vector-Jacobian product
# ----------------------------------------------------------------------------------------------


def join_flat(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], *,
              like: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(core_flat, gate_flat)``: the cores back to back and the gates back to back, each flattened
    row-major (the inverse of :func:`split_flat`). Without gates (one core) the gate storage is empty,
    of ``like``'s dtype and device (default: the cores')."""
    core_flat = torch.cat([c.reshape(-1) for c in cores])
    empty = core_flat if like is None else like
    gate_flat = torch.cat([g.reshape(-1) for g in gates]) if gates else empty.new_zeros(0)
    return core_flat, gate_flat


def split_flat(core_flat: torch.Tensor, gate_flat: torch.Tensor, spec: TTSpec) -> tuple[list, list]:
    """The cores and gates of ``spec`` as views of their flat storage (cores back to back in order,
    then, in ``gate_flat``, the gates)."""
    shapes = spec.core_shapes
    if core_flat.numel() != count_params(shapes, include_gates=False) or gate_flat.numel() != sum(spec.gate_sizes):
        raise ValueError(f"flat storage of {core_flat.numel()} core and {gate_flat.numel()} gate entries does not "
                         f"match ranks {list(spec.ranks)} of {spec.describe()}")
    parts = core_flat.split([_prod(s) for s in shapes])
    return [t.view(s) for t, s in zip(parts, shapes)], list(gate_flat.split(list(spec.gate_sizes)))


def _chain(cores, gates, spec: TTSpec, dtype) -> list[torch.Tensor]:
    """3-D chain cores ``[r, s, r]`` with each gate folded into its left core's right bond."""
    out = []
    for k, c in enumerate(cores):
        c = c.to(dtype).reshape(spec.ranks[k], spec.sizes[k], spec.ranks[k + 1])
        if k < len(gates):
            c = c * gates[k].to(dtype)
        out.append(c)
    return out


def _split(spec: TTSpec) -> int:
    """Bond at which the chain is cut into a left and a right product (``1 <= b <= d-1``), chosen
    by FLOPs; ties go to the row/column boundary of the TT format (CoMERA's ``L @ R``)."""
    s, r, d = spec.sizes, spec.ranks, spec.n_cores
    total = _prod(s)
    natural = spec.natural_split

    def cost(b: int) -> int:
        left = sum(_prod(s[: k - 1]) * r[k - 1] * s[k - 1] * r[k] for k in range(2, b + 1))
        right = sum(r[k - 1] * s[k - 1] * r[k] * _prod(s[k:]) for k in range(b + 1, d))
        return left + right + total * r[b]

    return min(range(1, d), key=lambda b: (cost(b), abs(b - natural)))


def _prefixes(chain: Sequence[torch.Tensor], spec: TTSpec, b: int) -> list[torch.Tensor]:
    """``L_k = chain[0] ... chain[k-1]`` as ``[S_<=k, r_k]`` for ``k = 0..b`` (``L_0 = [[1]]``)."""
    s, r = spec.sizes, spec.ranks
    acc = chain[0].new_ones(1, 1)
    out = [acc]
    rows = 1
    for k in range(b):
        acc = (acc @ chain[k].reshape(r[k], s[k] * r[k + 1])).reshape(rows * s[k], r[k + 1])
        rows *= s[k]
        out.append(acc)
    return out


def _suffixes(chain: Sequence[torch.Tensor], spec: TTSpec, b: int) -> list[torch.Tensor]:
    """``R_k = chain[k] ... chain[d-1]`` as ``[r_k, S_>k]`` for ``k = b..d`` (``R_d = [[1]]``),
    returned indexed by ``k - b``."""
    s, r, d = spec.sizes, spec.ranks, spec.n_cores
    acc = chain[0].new_ones(1, 1)
    out = [acc]
    cols = 1
    for k in range(d - 1, b - 1, -1):
        acc = (chain[k].reshape(r[k] * s[k], r[k + 1]) @ acc).reshape(r[k], s[k] * cols)
        cols *= s[k]
        out.append(acc)
    return out[::-1]


def _dtype(cores: Sequence[torch.Tensor]) -> torch.dtype:
    return cores[0].dtype


def materialize(
    cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec
) -> torch.Tensor:
    """The layer's weight: ``M[:rows, :cols]`` (or its transpose), contiguous.

    Builds ``L`` (left cores) and ``R`` (right cores) then one GEMM ``L @ R`` (CoMERA's order for
    TT; for TTM the row/column indices are interleaved and permuted at the end). BTT: one batched
    GEMM over the blocks (:func:`_btt_materialize`).
    """
    spec.check_cores(cores, gates)
    if spec.fmt == "btt":
        return _btt_materialize(cores, gates, spec)
    dtype = _dtype(cores)
    d, P, Q = spec.n_cores, spec.padded_rows, spec.padded_cols
    chain = _chain(cores, gates, spec, dtype)
    if d == 1:
        full = chain[0].reshape(P * Q).clone()  # a fresh tensor: the op's output may not alias
        b = None
    else:
        b = _split(spec)
        left = _prefixes(chain, spec, b)[-1]
        right = _suffixes(chain, spec, b)[0]
    if b is not None and b == spec.bottleneck:
        m = right.t() @ left.t() if spec.transpose else left @ right
    else:
        full = full if b is None else left @ right
        if not spec.interleaved:
            m = full.reshape(P, Q)
        else:
            n = len(spec.row_modes)
            interleaved = [v for pair in zip(spec.row_modes, spec.col_modes) for v in pair]
            rows_first = list(range(0, 2 * n, 2)) + list(range(1, 2 * n, 2))
            m = full.reshape(interleaved).permute(rows_first).reshape(P, Q)
        if spec.transpose:
            m = m.t()
    out = m[: spec.cols, : spec.rows] if spec.transpose else m[: spec.rows, : spec.cols]
    return out.contiguous()


def bottleneck_factors(
    cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``"tt"`` layer's two factors at its rank bottleneck: ``L`` [rows, r] (the row cores
    merged, every gate up to and including the bottleneck's folded in) and ``R`` [r, cols] (the
    column cores merged), padding cropped, so that ``M = L @ R`` (:func:`materialize`, untransposed).
    Differentiable in the cores and gates; for ``fmt != "tt"`` (no bottleneck) ValueError."""
    if spec.bottleneck is None:
        raise ValueError(f"bottleneck_factors: fmt={spec.fmt!r} has no rank bottleneck between its row and column "
                         "cores (only 'tt' does)")
    spec.check_cores(cores, gates)
    chain = _chain(cores, gates, spec, _dtype(cores))
    b = spec.bottleneck
    left = _prefixes(chain, spec, b)[-1]
    right = _suffixes(chain, spec, b)[0]
    return left[: spec.rows], right[:, : spec.cols]


def _grad_matrix(grad: torch.Tensor, spec: TTSpec, b: int | None) -> torch.Tensor:
    """The output gradient in chain layout: ``[S_<=b, S_>b]`` (``[S]`` when ``b`` is None),
    zero over the padding."""
    P, Q = spec.padded_rows, spec.padded_cols
    if spec.transpose:
        padded = grad.new_zeros(Q, P)
        padded[: spec.cols, : spec.rows] = grad
        g = padded.t()
    elif (P, Q) != (spec.rows, spec.cols):
        g = grad.new_zeros(P, Q)
        g[: spec.rows, : spec.cols] = grad
    else:
        g = grad
    if spec.interleaved:
        n = len(spec.row_modes)
        interleave = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
        g = g.reshape(list(spec.row_modes) + list(spec.col_modes)).permute(interleave)
    elif b is not None and b == spec.bottleneck:
        return g
    if b is None:
        return g.reshape(P * Q)
    left = _prod(spec.sizes[:b])
    return g.reshape(left, P * Q // left)


def materialize_vjp(
    cores: Sequence[torch.Tensor],
    gates: Sequence[torch.Tensor],
    spec: TTSpec,
    grad: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of :func:`materialize` w.r.t. the cores and the gates, given the output gradient.

    With the chain cut at bond ``b`` (as in the forward), only two GEMMs touch the full matrix:
    ``Y = G @ R^T`` and ``Z = L^T @ G``; every core gradient then follows from small sweeps:
    ``dC_k = L_{k-1}^T Y_k`` going left and ``dC_k = Z_k R_{k+1}^T`` going right.
    """
    spec.check_cores(cores, gates)
    if spec.fmt == "btt":
        return _btt_materialize_vjp(cores, gates, spec, grad)
    dtype = _dtype(cores)
    s, r, d = spec.sizes, spec.ranks, spec.n_cores
    chain = _chain(cores, gates, spec, dtype)
    grad = grad.to(dtype)
    dchain: list[torch.Tensor | None] = [None] * d
    if d == 1:
        dchain[0] = _grad_matrix(grad, spec, None).reshape(1, s[0], 1).clone()
    else:
        b = _split(spec)
        g = _grad_matrix(grad, spec, b)
        lefts = _prefixes(chain, spec, b)
        rights = _suffixes(chain, spec, b)
        # Left part, cores 0..b-1: Y_k = G contracted with everything right of core k-1.
        y = g @ rights[0].t()  # [S_<=b, r_b]
        for k in range(b - 1, -1, -1):
            rows = _prod(s[:k])
            y = y.reshape(rows, s[k] * r[k + 1])
            dchain[k] = (lefts[k].t() @ y).reshape(r[k], s[k], r[k + 1])
            y = y @ chain[k].reshape(r[k], s[k] * r[k + 1]).t()  # [S_<k, r_k]
        # Right part, cores b..d-1: Z_k = G contracted with everything left of core k.
        z = lefts[b].t() @ g  # [r_b, S_>b]
        for k in range(b, d):
            cols = _prod(s[k + 1:])
            z = z.reshape(r[k] * s[k], cols)
            dchain[k] = (z @ rights[k + 1 - b].t()).reshape(r[k], s[k], r[k + 1])
            z = chain[k].reshape(r[k] * s[k], r[k + 1]).t() @ z  # [r_{k+1}, S_>k]
    grad_cores, grad_gates = [], []
    for k, (c, dc) in enumerate(zip(cores, dchain)):
        if k < len(gates):
            gk = gates[k].to(dtype)
            grad_gates.append(
                (c.to(dtype).reshape(r[k], s[k], r[k + 1]) * dc).sum(dim=(0, 1)).to(gates[k].dtype)
            )
            dc = dc * gk
        grad_cores.append(dc.reshape(c.shape).to(c.dtype))
    return grad_cores, grad_gates


# The block tensor-train: M[(j, b), (c, a)] = sum_k R[j, b, c, k] g[k] L[k, c, j, a]. The einsum
# strings name j = b1 (row block), b = b2, c (column block), a, k (rank); "W" is the transposed layout.
_BTT_M, _BTT_W = "jbca", "cajb"


def _btt_layout(spec: TTSpec) -> str:
    """The einsum indices of the padded output: ``M`` [(j, b), (c, a)] or, transposed, ``W``."""
    return _BTT_W if spec.transpose else _BTT_M


def _btt_materialize(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec) -> torch.Tensor:
    """The BTT weight: for every block ``(j, c)``, ``R[j, :, c, :] diag(g) L[:, c, j, :]``, a batched
    GEMM of ``2 * r * P * Q`` FLOPs (``P x Q`` the padded matrix), cropped and contiguous."""
    R, L = cores
    rg = R * gates[0].to(R.dtype)
    full = torch.einsum(f"jbck,kcja->{_btt_layout(spec)}", rg, L.to(R.dtype))
    P, Q = spec.padded_rows, spec.padded_cols
    if spec.transpose:
        return full.reshape(Q, P)[: spec.cols, : spec.rows].contiguous()
    return full.reshape(P, Q)[: spec.rows, : spec.cols].contiguous()


def _btt_materialize_vjp(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec,
                         grad: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of :func:`_btt_materialize`: with ``G`` the output gradient zero-padded,
    ``dL = einsum(G, R g)``, ``d(R g) = einsum(G, L)``, ``dR = d(R g) g`` and
    ``dg = sum d(R g) * R`` (plain einsums, so the backward is itself differentiable)."""
    R, L = cores
    dtype = R.dtype
    g = gates[0].to(dtype)
    P, Q = spec.padded_rows, spec.padded_cols
    (b1, b2), (c, a) = spec.row_modes, spec.col_modes
    shape = (Q, P) if spec.transpose else (P, Q)
    padded = grad.to(dtype)
    if tuple(padded.shape) != shape:
        padded = padded.new_zeros(shape)
        padded[: grad.shape[0], : grad.shape[1]] = grad
    padded = padded.reshape((c, a, b1, b2) if spec.transpose else (b1, b2, c, a))
    out = _btt_layout(spec)
    d_rg = torch.einsum(f"{out},kcja->jbck", padded, L.to(dtype))
    d_l = torch.einsum(f"{out},jbck->kcja", padded, R * g)
    d_g = (d_rg * R).sum(dim=(0, 1, 2))
    return [(d_rg * g).to(R.dtype), d_l.to(L.dtype)], [d_g.to(gates[0].dtype)]


def _btt_random_cores(spec: TTSpec, std: float, *, dtype, device, generator) -> list[torch.Tensor]:
    """Each core N(0, s^2 / fan_in), fan-in ``b2`` for ``R`` and ``b1 * r`` for ``L``, with
    ``s = (std^2 * b1 * b2) ** 0.25``: every entry of ``M`` sums ``r`` products of independent
    entries, so its variance is ``r * s^2 / b2 * s^2 / (b1 r) = std^2`` (gates at 1)."""
    (b1, b2), r = spec.row_modes, spec.ranks[1]
    scale = (float(std) ** 2 * b1 * b2) ** 0.25
    fans = (b2, b1 * max(r, 1))
    return [torch.randn(shape, dtype=dtype, device=device, generator=generator) * (scale / math.sqrt(fan))
            for shape, fan in zip(spec.core_shapes, fans)]


def _btt_svd(m: torch.Tensor, spec: TTSpec, tol: float | None) -> list[torch.Tensor]:
    """The optimal BTT of ``m`` (logical ``[rows, cols]``, float32/64) at rank <= ``spec.ranks[1]``:
    the blocks ``M[(j, :), (c, :)]`` are independent ``b2 x a`` matrices, each of rank <= r, so one
    truncated SVD per block is optimal in Frobenius norm (Eckart-Young per block). With ``tol``, the
    rank is the smallest whose discarded energy over all blocks stays within ``(tol * ||M||)^2``.
    Returns the cores, ``sqrt`` of the singular values on each side (balanced norms, gate 1)."""
    P, Q = spec.padded_rows, spec.padded_cols
    (b1, b2), (c, a) = spec.row_modes, spec.col_modes
    padded = m.new_zeros(P, Q)
    padded[: spec.rows, : spec.cols] = m
    blocks = padded.reshape(b1, b2, c, a).permute(0, 2, 1, 3)  # [j, c, b, a]
    u, sv, vh = torch.linalg.svd(blocks, full_matrices=False)  # u [j, c, b, q], vh [j, c, q, a]
    r = min(spec.ranks[1], sv.shape[-1])
    if tol is not None:
        energy = (sv.double() ** 2).sum(dim=(0, 1))  # per rank position, over every block
        tail = torch.flip(torch.cumsum(torch.flip(energy, [0]), 0), [0])  # tail[k] = discarded at rank k
        budget = (tol * torch.linalg.vector_norm(m.double())) ** 2
        ok = (tail <= budget).nonzero()
        needed = int(ok[0].item()) if ok.numel() else sv.shape[-1]
        r = max(1, min(r, needed))
    root = sv[..., :r].sqrt()
    R = (u[..., :r] * root[:, :, None, :]).permute(0, 2, 1, 3)  # [j, b, c, k]
    L = (vh[:, :, :r, :] * root[..., None]).permute(2, 1, 0, 3)  # [k, c, j, a]
    return [R.contiguous(), L.contiguous()]


# ----------------------------------------------------------------------------------------------
# Initialization and decomposition
# ----------------------------------------------------------------------------------------------


def random_cores(
    spec: TTSpec,
    std: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    balanced: bool = False,
) -> list[torch.Tensor]:
    """CoMERA's initialization: ``core_k = randn / sqrt(r_k) * std ** (1 / d)`` (``r_k`` the core's
    right rank). With gates at 1, every entry of the materialized matrix then has variance
    ``std ** 2`` exactly in expectation: each entry sums ``prod(internal ranks)`` products of ``d``
    independent core entries. The last core (right rank 1) is therefore larger than the others
    (a GPT's d 768 TT-matrix r32: stds 0.052, 0.052, 0.29).

    ``balanced=True``: every core at the same std, ``(std ** 2 / prod(internal ranks)) ** (1 / (2 d))``,
    the same entry variance ``std ** 2``. BTT: the prototype's fan-in init with the same entry variance
    (:func:`_btt_random_cores`), balanced or not."""
    if spec.fmt == "btt":
        return _btt_random_cores(spec, std, dtype=dtype, device=device, generator=generator)
    d = spec.n_cores
    shapes = spec.core_shapes
    if balanced:
        inner = math.prod(int(shape[-1]) for shape in shapes[:-1])
        core_std = (float(std) ** 2 / inner) ** (1.0 / (2 * d))
        stds = [core_std] * d
    else:
        scale = float(std) ** (1.0 / d)
        stds = [scale / math.sqrt(max(shape[-1], 1)) for shape in shapes]
    return [torch.randn(shape, dtype=dtype, device=device, generator=generator) * s for shape, s in zip(shapes, stds)]


def _to_chain_tensor(matrix: torch.Tensor, spec: TTSpec) -> torch.Tensor:
    """Logical ``[rows, cols]`` matrix -> zero-padded tensor in chain index order ``[s_1..s_d]``."""
    P, Q = spec.padded_rows, spec.padded_cols
    padded = matrix.new_zeros(P, Q)
    padded[: spec.rows, : spec.cols] = matrix
    if not spec.interleaved:
        return padded.reshape(spec.sizes)
    n = len(spec.row_modes)
    interleave = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    t = padded.reshape(list(spec.row_modes) + list(spec.col_modes)).permute(interleave)
    return t.reshape(spec.sizes)


def tt_svd(
    matrix: torch.Tensor,
    spec: TTSpec,
    *,
    tol: float | None = None,
) -> tuple[list[torch.Tensor], float]:
    """TT-SVD of a logical ``[rows, cols]`` matrix into ``spec``'s layout.

    Ranks are capped by ``spec.ranks``; with ``tol`` each bond keeps the fewest singular values
    whose discarded tail stays below ``tol * ||M|| / sqrt(d - 1)`` (Oseledets' bound, so the total
    relative error is at most ``tol`` unless the cap binds: the cap wins, and the error says so).
    Runs on ``matrix.device`` in at least float32; the cores come back in ``matrix.dtype`` with
    balanced norms (gates at 1). Returns ``(cores, rel_error)`` where
    ``rel_error = ||M_tt - M|| / ||M||`` on the logical matrix (the padding cropped away).
    BTT: exact block-wise SVD (:func:`_btt_svd`); ``tol`` bounds its total relative error directly.
    """
    if tuple(matrix.shape) != (spec.rows, spec.cols):
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}, expected {(spec.rows, spec.cols)}")
    if tol is not None and not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    work = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    m = matrix.detach().to(work)
    if spec.fmt == "btt":
        return _tt_svd_btt(matrix, m, spec, tol)
    s, d = spec.sizes, spec.n_cores
    norm = torch.linalg.vector_norm(m).item()
    delta = 0.0 if tol is None or d == 1 else tol * norm / math.sqrt(d - 1)
    rest = _to_chain_tensor(m, spec).reshape(s[0], -1)
    cores: list[torch.Tensor] = []
    r_prev = 1
    for k in range(d - 1):
        rest = rest.reshape(r_prev * s[k], -1)
        u, sv, vh = torch.linalg.svd(rest, full_matrices=False)
        r = min(spec.ranks[k + 1], sv.numel())
        if tol is not None:
            # tail[j] = sqrt(sum_{i >= j} sv_i^2): keep the fewest j with tail[j] <= delta.
            tail = torch.flip(torch.cumsum(torch.flip(sv.double() ** 2, [0]), 0), [0]).sqrt()
            ok = (tail <= delta).nonzero()
            needed = int(ok[0].item()) if ok.numel() else sv.numel()
            r = max(1, min(r, needed))
        cores.append(u[:, :r].reshape(r_prev, s[k], r))
        rest = sv[:r, None] * vh[:r]
        r_prev = r
    cores.append(rest.reshape(r_prev, s[-1], 1))
    # Balance the norms (the product is unchanged) so no core carries the whole scale.
    norms = [torch.linalg.vector_norm(c).item() for c in cores]
    if all(n > 0 for n in norms):
        geo = math.exp(sum(math.log(n) for n in norms) / d)
        cores = [c * (geo / n) for c, n in zip(cores, norms)]
    ranks = tuple(c.shape[0] for c in cores) + (1,)
    out_spec = spec.with_ranks(ranks)
    shaped = [c.reshape(shape) for c, shape in zip(cores, out_spec.core_shapes)]
    gates = [c.new_ones(r) for c, r in zip(shaped, ranks[1:-1])]
    approx = materialize(shaped, gates, TTSpec(out_spec.fmt, out_spec.row_modes, out_spec.col_modes,
                                               ranks, spec.rows, spec.cols, False))
    err = torch.linalg.vector_norm(approx - m).item()
    rel = err / norm if norm > 0 else err
    return [c.to(matrix.dtype).contiguous() for c in shaped], rel


def _tt_svd_btt(matrix: torch.Tensor, m: torch.Tensor, spec: TTSpec, tol: float | None):
    """:func:`tt_svd` for ``"btt"``: the cores of :func:`_btt_svd` and their relative error."""
    cores = _btt_svd(m, spec, tol)
    out_spec = TTSpec(spec.fmt, spec.row_modes, spec.col_modes, ranks_from_shapes(spec.fmt, [c.shape for c in cores]),
                      spec.rows, spec.cols, False)
    approx = materialize(cores, [cores[0].new_ones(out_spec.ranks[1])], out_spec)
    norm = torch.linalg.vector_norm(m).item()
    err = torch.linalg.vector_norm(approx - m).item()
    return [c.to(matrix.dtype).contiguous() for c in cores], (err / norm if norm > 0 else err)
