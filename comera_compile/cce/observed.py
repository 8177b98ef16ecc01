"""The kept fractions the fused loss's sparse path observed (``comera::linear_cross_entropy``).

The sparse path's cost depends on the fraction of gradient tiles its filter keeps, a property of the
model's logits, not of the shapes. Every sparse backward reports the fraction it kept
(:func:`observe_kept_fraction`) to the current store (:class:`KeptFractionStore`, thread-safe) keyed by
the shape class (:class:`ShapeClass`), which keeps a running estimate (:class:`KeptFraction`, an
exponential moving average); the cost model (:mod:`comera_compile.cce.planner`) prices the sparse path
at it. The current store is the process's default one unless a :func:`use_kept_fraction_store` block
makes a caller's own current; an eager backward observes into the store its forward ran under
(:func:`pinned_kept_fraction_store`). Host-side state only: nothing here runs an op."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

import torch

from comera_compile.cce.tuning import CCETuning, current_tuning, default_filter_eps

__all__ = ["KEPT_EMA", "KeptFraction", "KeptFractionStore", "ShapeClass", "bounds_seen_to_pay",
           "current_kept_fraction_store", "default_kept_fraction_store", "forward_bounds_pay", "kept_fractions",
           "observe_kept_fraction", "observed_kept_fraction", "pinned_kept_fraction_store", "reset_kept_fractions",
           "use_kept_fraction_store"]


def _remove(stack: list, item) -> None:
    """Remove the innermost entry that is ``item`` itself (not an equal one: two empty stores are
    distinct; a store current twice, in nested blocks, leaves the inner block first)."""
    with _LOCK:
        del stack[max(i for i, x in enumerate(stack) if x is item)]


# The weight of a new observation in the running estimate, per call: the kept fraction drifts
# slowly as a model trains and varies little between batches, so the estimate follows the last few
# calls. An observation after n calls that observed nothing (a probe) weighs 1 - (1 - KEPT_EMA)**n:
# the estimate is an average over calls, the silent ones holding the value they saw.
KEPT_EMA = 0.5


class ShapeClass(NamedTuple):
    """The key of an observed kept fraction: the head's vocabulary and hidden sizes, the inputs'
    dtype and the filter's threshold (the resolved ``filter_eps``). The token count is not part of
    it: the fraction is a property of the logits' distribution, not of how many rows there are."""

    vocab: int
    hidden: int
    dtype: torch.dtype
    filter_eps: float


@dataclass(frozen=True)
class KeptFraction:
    """What the sparse path observed for one :class:`ShapeClass`: ``fraction``, the running
    estimate (an exponential moving average over calls, see :data:`KEPT_EMA`) of the gradient tiles
    its filter kept over the vocabulary blocks its rounds covered (the densest blocks come first, so
    rounds that stop early overstate it: the safe side); ``last``, the latest observation;
    ``observations``, how many were folded in; ``skipped``, the same kind of estimate of the
    fraction of those tiles that the forward's logit bounds ruled out, from the rounds that had the
    bounds (None before any: see ``CCETuning.bounds_min_skip``)."""

    fraction: float
    last: float
    observations: int
    skipped: Optional[float] = None


def _shape_class(vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float) -> ShapeClass:
    return ShapeClass(int(vocab), int(hidden), dtype, float(filter_eps))


class KeptFractionStore:
    """The observed kept fractions of the sparse path, by :class:`ShapeClass`, with the call counters
    that ``strategy="auto"`` keeps between observations, behind a lock of its own (thread-safe).

    The fused loss reads and writes the current store (:func:`current_kept_fraction_store`): the
    process's default one unless a :func:`use_kept_fraction_store` block makes another current, so
    that a caller (a model, a benchmark, a test) owns its observations and the calls under another
    store neither see nor change them. The module functions (:func:`observe_kept_fraction`,
    :func:`observed_kept_fraction`, :func:`kept_fractions`, :func:`reset_kept_fractions`,
    :func:`runtime_strategy`, :func:`forward_bounds_pay`) act on the current store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[ShapeClass, KeptFraction] = {}
        self._calls: dict[ShapeClass, int] = {}  # calls planned by "auto" since the last observation
        self._unbounded: dict[ShapeClass, int] = {}  # forward rounds without the bounds since the last with them

    def observe(self, vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float,
                kept_tiles: int, tiles: int, skipped_tiles: Optional[int] = None) -> None:
        """Fold one sparse pass's count into the estimate of its shape class (see
        :func:`observe_kept_fraction`; no-op for ``tiles`` 0)."""
        if tiles <= 0:
            return
        key = _shape_class(vocab, hidden, dtype, filter_eps)
        seen = min(1.0, max(0.0, kept_tiles / tiles))
        with self._lock:
            old = self._kept.get(key)
            fraction = _fold(old.fraction if old else None, seen, self._calls.pop(key, 0))
            skipped = old.skipped if old else None
            if skipped_tiles is not None:
                skipped = _fold(skipped, min(1.0, max(0.0, skipped_tiles / tiles)), self._unbounded.pop(key, 0))
            self._kept[key] = KeptFraction(fraction, seen, (old.observations if old else 0) + 1, skipped)

    def get(self, vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float) -> Optional[KeptFraction]:
        """What was observed for this shape class, or None."""
        with self._lock:
            return self._kept.get(_shape_class(vocab, hidden, dtype, filter_eps))

    def estimate(self, vocab: int, hidden: int, dtype: torch.dtype,
                 filter_eps: Optional[float] = None) -> Optional[float]:
        """The running estimate of the kept fraction for this shape class (``filter_eps`` None: the
        dtype's default), or None when none was observed."""
        eps = filter_eps if filter_eps is not None else default_filter_eps(dtype)
        seen = self.get(vocab, hidden, dtype, eps)
        return seen.fraction if seen is not None else None

    def snapshot(self) -> dict[ShapeClass, KeptFraction]:
        """A copy of every observed kept fraction, by shape class."""
        with self._lock:
            return dict(self._kept)

    def reset(self) -> None:
        """Forget every observation and every call count."""
        with self._lock:
            self._kept.clear()
            self._calls.clear()
            self._unbounded.clear()

    def count_auto_call(self, vocab: int, hidden: int, dtype: torch.dtype,
                        filter_eps: float) -> tuple[Optional[KeptFraction], int]:
        """Count a call planned by "auto" that decides at run time (:func:`runtime_strategy`): what
        was observed for its shape class (or None) and the calls counted since the last observation,
        this one included."""
        key = _shape_class(vocab, hidden, dtype, filter_eps)
        with self._lock:
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            return self._kept.get(key), calls

    def forward_bounds_pay(self, vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float,
                           tuning: Optional[CCETuning] = None) -> bool:
        """:func:`forward_bounds_pay` on this store (``tuning``: the current one when None); counts
        the calls it answers False."""
        tun = tuning if tuning is not None else current_tuning()
        if not tun.forward_bounds:
            return False
        key = _shape_class(vocab, hidden, dtype, filter_eps)
        with self._lock:
            seen = self._kept.get(key)
            if seen is None or seen.skipped is None or bounds_seen_to_pay(seen, tun):
                return True
            calls = self._unbounded[key] = self._unbounded.get(key, 0) + 1
        return calls >= max(1, tun.probe_every)


_LOCK = threading.Lock()  # guards the stack of current stores
_DEFAULT_STORE = KeptFractionStore()  # the store of a caller that chose none
_STORE_STACK: list[KeptFractionStore] = []
_PINNED = threading.local()  # per thread: a backward's store, its forward's (pinned_kept_fraction_store)


def default_kept_fraction_store() -> KeptFractionStore:
    """The process's default store: the current one outside any :func:`use_kept_fraction_store` block."""
    return _DEFAULT_STORE


def current_kept_fraction_store() -> KeptFractionStore:
    """The store the fused loss observes into and decides from now: within a backward of the op, the
    store that was current when its forward ran; else the innermost :func:`use_kept_fraction_store`
    block's; else the default one."""
    pinned = getattr(_PINNED, "stores", None)
    if pinned:
        return pinned[-1]
    with _LOCK:
        return _STORE_STACK[-1] if _STORE_STACK else _DEFAULT_STORE


@contextlib.contextmanager
def use_kept_fraction_store(store: Optional[KeptFractionStore] = None) -> Iterator[KeptFractionStore]:
    """Make ``store`` (None: a new, empty one) the current :class:`KeptFractionStore` while the
    block runs; yields it. Like :func:`cce_tuning` the setting is process-wide while the block runs
    (a forward's sparse rounds, and the decisions of every call, read it from any thread), so use it
    from one thread at a time. A backward that autograd runs after the block exited (eager mode)
    still observes into the store that was current when its forward ran: the op's autograd keeps it
    for the backward. Under ``torch.compile`` no Python object travels from the compiled forward to
    the compiled backward (the op's arguments are primitives), so there a backward observes into
    the store current when it runs."""
    if store is None:
        store = KeptFractionStore()
    if not isinstance(store, KeptFractionStore):
        raise TypeError(f"use_kept_fraction_store: expected a KeptFractionStore, got {type(store).__name__}")
    with _LOCK:
        _STORE_STACK.append(store)
    try:
        yield store
    finally:
        _remove(_STORE_STACK, store)


@contextlib.contextmanager
def pinned_kept_fraction_store(store: Optional[KeptFractionStore]) -> Iterator[None]:
    """Within the block, on this thread only, ``store`` is the current one whatever
    :func:`use_kept_fraction_store` block is active (None: no change): the op's eager backward runs
    under the store of its forward this way."""
    if store is None:
        yield
        return
    stores = getattr(_PINNED, "stores", None)
    if stores is None:
        stores = _PINNED.stores = []
    stores.append(store)
    try:
        yield
    finally:
        stores.pop()


def observe_kept_fraction(vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float,
                          kept_tiles: int, tiles: int, skipped_tiles: Optional[int] = None) -> None:
    """Fold one sparse pass's count into the estimate of its shape class in the current store: ``kept_tiles`` of the
    ``tiles`` of the vocabulary blocks its rounds covered, and where the rounds had the forward's
    logit bounds, ``skipped_tiles`` of them ruled out (the sparse path calls it; no-op for 0)."""
    current_kept_fraction_store().observe(vocab, hidden, dtype, filter_eps, kept_tiles, tiles, skipped_tiles)


def _fold(estimate: Optional[float], value: float, silent_calls: int) -> float:
    """A running estimate with a new observation folded in, weighed 1 - (1 - KEPT_EMA)**n after
    n calls that observed nothing (at least one); the observation itself when there is none yet."""
    if estimate is None:
        return value
    weight = 1.0 - (1.0 - KEPT_EMA) ** max(1, silent_calls)
    return (1.0 - weight) * estimate + weight * value


def bounds_seen_to_pay(seen: Optional[KeptFraction], tun: CCETuning) -> bool:
    """The bounds are on and the running estimate of what they rule out reaches ``bounds_min_skip``."""
    return (tun.forward_bounds and seen is not None and seen.skipped is not None
            and seen.skipped >= tun.bounds_min_skip)


def forward_bounds_pay(vocab: int, hidden: int, dtype: torch.dtype, filter_eps: float) -> bool:
    """Whether sparse rounds about to run in a forward should have that forward compute its logit
    bounds: ``CCETuning.forward_bounds`` is on and either no call of this shape class has measured
    what they rule out, or the running estimate (``KeptFraction.skipped``) is at least
    ``CCETuning.bounds_min_skip``, or ``probe_every`` calls have passed without them (a probe, to
    keep the estimate current). Counts the calls it answers False (host-side state only, in the
    current store)."""
    return current_kept_fraction_store().forward_bounds_pay(vocab, hidden, dtype, filter_eps)


def observed_kept_fraction(vocab: int, hidden: int, dtype: torch.dtype,
                           filter_eps: Optional[float] = None) -> Optional[float]:
    """The running estimate of the kept fraction for this shape class in the current store
    (``filter_eps`` None: the dtype's default), or None when none was observed, or while Dynamo
    traces: a traced graph is planned from the shapes alone and the op re-decides at run time
    (:func:`runtime_strategy`)."""
    if torch.compiler.is_compiling():
        return None
    return current_kept_fraction_store().estimate(vocab, hidden, dtype, filter_eps)


def kept_fractions() -> dict[ShapeClass, KeptFraction]:
    """A snapshot of every observed kept fraction of the current store, by shape class."""
    return current_kept_fraction_store().snapshot()


def reset_kept_fractions() -> None:
    """Forget every observation of the current store (e.g. before benchmarking another model):
    ``strategy="auto"`` then prices the sparse path at the flat-softmax assumption again, and probes
    it on its next call."""
    current_kept_fraction_store().reset()
