"""``TTConfig``: how ``tensorize_`` factors a layer (its rank, format, modes, init)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from comera_compile.tt import FORMATS

__all__ = ["TTConfig"]

FMTS = ("auto",) + FORMATS  # "auto": per layer, TTConfig.resolve
DEFAULT_RANK = {"tt": 32, "ttm": 32, "btt": 1}  # the rank a format gets when TTConfig.rank is None
AUTO_BTT_MIN_WIDTH = 2048  # fmt="auto" picks btt for Linear layers at least this wide on both sides
INITS = ("random", "balanced", "svd")
ACTIVATIONS = (None, "relu", "gelu", "silu")


@dataclass(frozen=True)
class TTConfig:
    """How to tensorize a layer.

    * ``rank``: an int (every internal bond) or a per-bond list (``d - 1`` entries, or ``d + 1``
      with 1 at both ends). Bonds are capped where a larger rank cannot help (the product of the
      modes on either side). With ``init="svd"`` and ``svd_tol`` it is the cap. Default ``None``: the
      format's own, 32 for ``"ttm"`` and ``"tt"`` (in the quality benchmark, a GPT at d 768 with its blocks
      tensorized, TT-matrix rank 32 beat the dense model of its size by 0.3 nats, rank 16 lost to it)
      and 1 for ``"btt"`` (the fastest: at d 2048 rank 1 stepped at 0.70x the dense model's time, rank 2
      at 0.84x).
    * ``fmt``: ``"tt"`` (input modes then output modes, CoMERA's linear format), ``"ttm"``
      (TT-matrix / MPO), ``"btt"`` (below) or ``"auto"`` (default), which picks per layer
      (:meth:`resolve`): ``"btt"`` at rank 1 for a Linear (or ``Conv1D``) layer whose in and out
      features are both at least 2048, ``"ttm"`` for every other layer (embeddings, narrower layers),
      and ``"ttm"`` for every layer when ``rank``, ``n_cores`` or ``modes`` is given or ``init="svd"``
      (those were chosen for TT-matrix bonds, or fit a pretrained weight). The rule follows the width
      study (BENCHMARKS.md section 8): at d 2048 btt r1 stepped faster than TT-matrix r32 (0.70x against
      0.97x dense) and ended lower; at d 768 the two tied. Measured on a GPT (d 768,
      BPE 16k) a TT-matrix learns better than ``"tt"`` at equal parameters
      (validation loss 4.0 % / 3.7 % better for the attention / MLP Linears); ``"tt"`` runs faster
      (its rank bottleneck makes two skinny GEMMs of a layer; a TT-matrix has none and runs with its
      weight merged from the cores). ``"btt"``: a two-core block tensor-train (Monarch at rank 1):
      in = b1 x b2 (b1 blocks), out = c x a (c blocks), each near the square root (padded when a
      size factors badly), ``W[(c, a), (b1, b2)] = sum_k L[k, c, b1, a] R[b1, b2, c, k]``; full-rank
      in general, its one rank bond caps at ``min(b2, a)``; ``modes=((b1, b2), (c, a))``. Its
      weight is formed by the marker op, then used as a dense weight (``2 r in out`` FLOPs), or its
      two cores run on the tokens where that is cheaper. It wants a higher learning rate than a
      TT-matrix layer (``param_groups``).
    * ``n_cores``: number of cores (TT: split between rows and columns by their sizes); default:
      modes near 10 (768 -> 3 modes, 30522 -> 4).
    * ``modes``: explicit ``(row_modes, col_modes)``, rows = in_features (Linear) or
      num_embeddings (Embedding), e.g. ``((16, 20, 10, 10), (4, 4, 8, 6))``; products may exceed
      the sizes (padding, cropped away).
    * ``min_size``: layers whose weight has fewer elements are skipped.
    * ``init``: ``"random"`` (CoMERA's variance-matched init: the last core larger than the
      others), ``"balanced"`` (random, every core at the same std, the same weight variance; in the
      quality benchmark's follow-ups no better than ``"random"``) or ``"svd"`` (TT-SVD of the current
      weights); ``svd_tol``: relative-error tolerance that picks the ranks (capped by
      ``rank``: where the cap stops TT-SVD short of the tolerance, ``tensorize_`` warns, naming the
      layers, their reached errors and the capped bonds; every layer's reached error is
      ``compression_report(model).layers[i].init_error``); ``init_std``: target std of the
      reconstructed weight (default: CoMERA's ``sqrt(1 / (in + out))`` for Linear; for Embedding
      the std of the table it replaces, i.e. the model's own embedding init: a GPT's 0.02 table
      started at std 1 trained 24 % worse).
    * ``max_pad``: largest relative padding the automatic factorization may add (0: never pad).
    * ``activation``: ``None`` (default), ``"relu"``, ``"gelu"`` or ``"silu"``: a nonlinearity at
      the rank bottleneck of a ``"tt"`` Linear, which then computes ``act(x L) R + b`` (CoLA's
      low-rank activation; ``L``: the row cores merged, ``R``: the column cores merged, the
      bottleneck's gate folded into ``L``). Needs ``fmt="tt"`` and random init; Linear and
      ``Conv1D`` layers only. Such a layer has no dense weight: reading or assigning ``module.weight``
      and ``densify_`` raise. Its two GEMMs run as they are, under any backend; the tensor-network pass
      leaves them to Inductor.
    """

    rank: Union[int, Sequence[int], None] = None
    fmt: str = "auto"
    n_cores: int | None = None
    modes: tuple[Sequence[int], Sequence[int]] | None = None
    min_size: int = 16384
    init: str = "random"
    svd_tol: float | None = None
    init_std: float | None = None
    max_pad: float = 0.1
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FMTS:
            raise ValueError(f"TTConfig.fmt must be one of {FMTS}, got {self.fmt!r}")
        if self.init not in INITS:
            raise ValueError(f"TTConfig.init must be one of {INITS}, got {self.init!r}")
        if self.rank is None:
            pass
        elif isinstance(self.rank, (str, bytes)):
            raise ValueError(f"TTConfig.rank must be a positive int, a list of positive ints or None (the format's "
                             f"default), got {self.rank!r}")
        elif isinstance(self.rank, bool) or not isinstance(self.rank, int):
            try:
                ranks = tuple(self.rank)  # type: ignore[arg-type]
            except TypeError:
                raise ValueError(
                    f"TTConfig.rank must be a positive int, a list of positive ints or None (the format's "
                    f"default), got {self.rank!r}"
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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"TTConfig.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if self.activation is not None and self.fmt != "tt":
            raise ValueError(f"TTConfig.activation={self.activation!r} needs fmt='tt' (the format with a rank "
                             f"bottleneck between the row and the column cores), got fmt={self.fmt!r}")
        if self.activation is not None and self.init == "svd":
            raise ValueError(f"TTConfig.activation={self.activation!r} needs init='random' or 'balanced': init='svd' "
                             "fits the dense weight, a linear map that a layer with an activation no longer computes")

    def resolve(self, kind: str, rows: int, cols: int) -> tuple[str, Union[int, Sequence[int]], str]:
        """``(fmt, rank, why)`` for one layer: ``fmt="auto"`` and ``rank=None`` made concrete for a layer of
        ``kind`` (``"Linear"``, ``"Conv1D"`` or ``"Embedding"``) whose matrix is ``rows x cols`` (in x out
        features for a Linear); ``why`` says how ``"auto"`` decided (empty when ``fmt`` was given)."""
        fmt, why = self.fmt, ""
        if fmt == "auto":
            pinned = [name for name in ("rank", "n_cores", "modes") if getattr(self, name) is not None]
            if self.init == "svd":
                pinned.append("init='svd'")
            if pinned:
                fmt, why = "ttm", f"auto: ttm ({', '.join(pinned)} given: chosen for TT-matrix bonds)"
            elif kind == "Embedding":
                fmt, why = "ttm", "auto: ttm (an embedding)"
            elif min(rows, cols) >= AUTO_BTT_MIN_WIDTH:
                fmt, why = "btt", f"auto: btt (in and out features >= {AUTO_BTT_MIN_WIDTH})"
            else:
                fmt, why = "ttm", f"auto: ttm (in or out features < {AUTO_BTT_MIN_WIDTH})"
        rank = DEFAULT_RANK[fmt] if self.rank is None else self.rank
        return fmt, rank, why
