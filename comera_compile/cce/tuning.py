"""The fused loss's tuning and statistics (``comera::linear_cross_entropy``): the tile shapes
and launch parameters of its Triton paths (:class:`CCETuning`, changed for a block by :func:`cce_tuning`),
the filter's default threshold (:func:`default_filter_eps`), and what each call of the op did
(:class:`CCEStats`, collected by :func:`record_cce_stats`). Pure Python: the kernels read them, nothing
here runs an op."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["MIB", "CCEStats", "CCETuning", "cce_tuning", "current_tuning", "default_filter_eps", "record",
           "record_cce_stats"]

MIB = 1 << 20


def default_filter_eps(dtype: torch.dtype) -> float:
    """CCE's threshold: the dtype's machine epsilon / 32 (2**-12 for bf16)."""
    return torch.finfo(dtype).eps / 32


@dataclass(frozen=True)
class CCETuning:
    """Tile shapes, launch parameters and buffer caps of the Triton paths (defaults tuned on the
    H200 for 2-byte inputs; fp32 inputs on a GPU get tiles that fit in shared memory).

    Use :func:`cce_tuning` to change them for a block of code (tile sweeps, tests that make small
    problems take every multi-tile path). Results never depend on them, only speed does.
    """

    fwd_block_m: int = 128
    fwd_block_n: int = 256
    fwd_block_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    fwd_group_m: int = 16
    fwd_small_d_block_n: int = 128
    fwd_small_d_warps: int = 4
    bwd_block_m: int = 128
    bwd_block_n: int = 128
    bwd_block_k: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 3
    group_v: int = 16
    cons_block_d: int = 128
    cons_warps: int = 8
    cons_stages: int = 3
    tgt_block: int = 16
    tile_budget_bytes: int = 44 * MIB
    dense_budget_bytes: int = 64 * MIB
    dense_block_n: int = 256
    dense_after_rounds: int = 4
    dense_density: float = 0.3
    fused_block_m: int = 128
    fused_block_n: int = 64
    fused_max_d: int = 128
    fused_warps: int = 8
    fused_stages: int = 3
    fused_dx_waves: int = 8
    rows_block_v: int = 4096
    rows_warps: int = 8
    # Calls planned by strategy="auto" run the sparse path (a probe, to measure the kept fraction:
    # see comera_compile.cce.planner) when this many calls of their shape class passed without it:
    # where it does not pay, its extra time lands on one call in probe_every.
    probe_every: int = 50
    # Sparse rounds run in the forward (a "chunked" plan the op switched to sparse) skip the tiles
    # whose logits the forward's tiles bound below the filter (``LogitBounds``). False: every tile
    # is recomputed, as the sparse rounds of a backward do.
    forward_bounds: bool = True
    # The bounds cost the forward a column maximum per tile, wasted when they rule out nothing. So the
    # forward computes them only while the observed fraction of tiles they rule out
    # (``KeptFraction.skipped``) is at least this; with none observed, and after ``probe_every``
    # calls without them, it computes them (a probe).
    bounds_min_skip: float = 0.3

    def fit(self, dtype: torch.dtype, on_gpu: bool, hidden: int) -> "CCETuning":
        """Tiles for this dtype and hidden size.

        The reduction dimension of the logits tiles never exceeds the hidden size rounded up to a
        power of two (>= 16), so small D (tensor-train ranks) takes one K step. The defaults are
        tuned for 2-byte inputs; 4-byte (fp32) tiles at the same shapes need up to ~390 KB of
        shared memory (the H200 has 227 KB), so fp32 on a GPU gets tiles of a quarter of the size.
        """
        k = max(16, 1 << max(0, hidden - 1).bit_length())
        cfg = dataclasses.replace(self, fwd_block_k=min(self.fwd_block_k, k),
                                  bwd_block_k=min(self.bwd_block_k, k))
        if hidden <= cfg.fwd_block_k:
            # One K step: the forward loop is bound by the softmax, not the product, and takes its
            # own tile width and warp count (fwd_small_d_block_n, fwd_small_d_warps).
            cfg = dataclasses.replace(cfg, fwd_block_n=min(cfg.fwd_block_n, cfg.fwd_small_d_block_n),
                                      fwd_warps=cfg.fwd_small_d_warps)
        if not on_gpu or torch.finfo(dtype).bits <= 16:
            return cfg
        return dataclasses.replace(
            cfg, fwd_block_m=min(cfg.fwd_block_m, 64), fwd_block_n=min(cfg.fwd_block_n, 128),
            fwd_block_k=min(cfg.fwd_block_k, 32), fwd_stages=min(cfg.fwd_stages, 2),
            bwd_block_m=min(cfg.bwd_block_m, 64), bwd_block_n=min(cfg.bwd_block_n, 64),
            bwd_block_k=min(cfg.bwd_block_k, 32), bwd_stages=min(cfg.bwd_stages, 2),
            cons_block_d=min(cfg.cons_block_d, 64), cons_stages=min(cfg.cons_stages, 2),
            dense_block_n=min(cfg.dense_block_n, 128), fused_block_m=min(cfg.fused_block_m, 32),
            fused_stages=min(cfg.fused_stages, 2),
            fused_block_n=min(cfg.fused_block_n, 32))


@dataclass
class CCEStats:
    """What one forward or backward call of the op did (see :func:`record_cce_stats`).

    ``path``: "chunked", "sparse", "static", "fused", "triton" (forward-only logits tiles) or
    "torch" (the reference). ``chunks``: token chunks (chunked, torch) or vocabulary chunks
    (static, and the dense tail of sparse). ``tiles``/``kept_tiles``: gradient tiles in all and
    kept by the sparse rounds; ``sparse_blocks``: vocabulary blocks the sparse rounds covered;
    ``skipped_tiles``: tiles of those blocks that the sparse rounds did not recompute, because the
    forward's logit bounds showed the filter drops them (sparse rounds in the forward only);
    ``bounded``: the rounds had the forward's bounds (else ``skipped_tiles`` is 0 by construction).
    """

    phase: str
    path: str
    chunks: int = 0
    sparse_rounds: int = 0
    tiles: int = 0
    kept_tiles: int = 0
    sparse_blocks: int = 0
    skipped_tiles: int = 0
    bounded: bool = False


_LOCK = threading.Lock()  # guards the tuning stack and the recorders
_TUNING_STACK: list[CCETuning] = []
_RECORDERS: list[list[CCEStats]] = []


def _remove(stack: list, item) -> None:
    """Remove ``item`` itself (not an equal one: two empty records lists are equal)."""
    with _LOCK:
        del stack[next(i for i, x in enumerate(stack) if x is item)]


def current_tuning() -> CCETuning:
    """The tuning in effect: the innermost :func:`cce_tuning` block, else the defaults."""
    with _LOCK:
        return _TUNING_STACK[-1] if _TUNING_STACK else CCETuning()


@contextlib.contextmanager
def cce_tuning(**fields) -> Iterator[CCETuning]:
    """Run the block with some :class:`CCETuning` fields changed, e.g. ``cce_tuning(bwd_block_n=64)``.

    The setting is process-wide while the block runs (the backward may run on autograd's device
    thread, which a thread-local setting would not reach), so use it from one thread at a time.
    """
    valid = {f.name for f in dataclasses.fields(CCETuning)}
    unknown = sorted(set(fields) - valid)
    if unknown:
        raise TypeError(f"cce_tuning: unknown field(s) {unknown}; valid fields: {sorted(valid)}")
    tuning = dataclasses.replace(current_tuning(), **fields)
    with _LOCK:
        _TUNING_STACK.append(tuning)
    try:
        yield tuning
    finally:
        _remove(_TUNING_STACK, tuning)


@contextlib.contextmanager
def record_cce_stats() -> Iterator[list[CCEStats]]:
    """Collect a :class:`CCEStats` for every forward and backward call of the op while the block
    runs (from any thread); yields the list that fills up."""
    records: list[CCEStats] = []
    with _LOCK:
        _RECORDERS.append(records)
    try:
        yield records
    finally:
        _remove(_RECORDERS, records)


def record(stats: CCEStats) -> None:
    """Hand ``stats`` to every active :func:`record_cce_stats` block (a no-op without one)."""
    with _LOCK:
        for records in _RECORDERS:
            records.append(stats)
