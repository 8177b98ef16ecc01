"""How ``comera::linear_cross_entropy`` runs: its paths, the cost model that picks one per shape and the
memory budget. The decisions live here, in a pure package; the kernels in ``comera_compile.kernels`` run
them. The tuning and statistics are in :mod:`comera_compile.cce.tuning`, the observed kept fractions in
:mod:`comera_compile.cce.observed`, the options of a call in :mod:`comera_compile.cce.options`. Pure
Python: no op runs here.

Paths (every one matches ``F.cross_entropy`` over the logits; "filtered" may drop gradient tiles
whose softmax stays below ``filter_eps``, only the sparse path does):

* ``"chunked"``: the gradient is formed in the forward, a chunk of tokens at a time: logits chunk
  ``x_c W^T`` by a library GEMM, loss and gradient rows by a Triton kernel (in place),
  ``dX_c = G_c W`` and ``dW += G_c^T x_c`` by library GEMMs. Three GEMMs, no recompute, the exact
  gradient, memory bounded by the chunk; the backward only scales by ``grad_output``. Only for
  reduction "mean"/"sum" and when the lse is not differentiated.
* ``"sparse"``: the backward recomputes the logits tiles and keeps the ones above the filter in a
  bounded buffer (rounds, one host sync each). Filtered only, never under CUDA-graph capture. The
  rounds may instead run in the forward, for a "chunked" plan chosen by "auto"; there the forward's
  logits tiles bound each column's logits, and the rounds skip (never recompute) the tiles whose
  bound is below the filter (``LogitBounds``; :func:`adaptive_plan` plans an automatic "sparse"
  choice that way where chunked may run). The bounds cost the forward some time; it computes them
  while the observed fraction of tiles they rule out pays for it (:func:`forward_bounds_pay`).
* ``"static"``: the backward recomputes the gradient of whole vocabulary chunks and reduces them
  with library GEMMs; a schedule fixed by the shapes (capture-safe), exact.
* ``"fused"``: the backward recomputes the tiles inside kernels that own their output rows (dX by
  token block, dW by vocabulary block); nothing gradient-sized is written. For small hidden sizes
  (the rank-r activations of a tensor-train head), exact and capture-safe. When D fits one K step
  (``FORWARD_DX_MAX_D``; reduction "mean"/"sum", no label smoothing) the forward pass forms dX
  itself and the backward recomputes only dW: two passes over the logits.

``choose_strategy`` picks the fastest path by the cost model (FLOPs and bytes at the rates of a
:class:`~comera_compile.devices.DeviceProfile`, ``profile=``: the H200's, :data:`comera_compile.devices.H200`,
for the Triton paths on the GPU; the CPU's, :data:`comera_compile.devices.CPU`, where the op runs its
torch reference; :func:`op_profile` gives the one of a call); ``fused_loss_pays`` says whether fusing a head is worth
it against the unfused ``linear`` + ``cross_entropy`` under Inductor, by a policy: "speed" (the best
path is not expected to be slower) or "memory" (the default: also when the logits it avoids,
``logits_bytes``, exceed a threshold and the best path is at most ``MEMORY_POLICY_SLOWDOWN`` times
slower); ``decide_fused_loss`` gives both answers for one head from one run of the model (a
:class:`FusedLossDecision`, what the cce pass uses).

The sparse path's cost depends on the fraction of gradient tiles its filter keeps, a property of the
model's logits, not of the shapes: flat (an untrained head, :func:`estimate_seconds`'s assumption when
it is given none) or peaked (a trained one: far fewer tiles). Every sparse backward reports the
fraction it kept (:func:`observe_kept_fraction`) to the current store (:class:`KeptFractionStore`,
thread-safe) keyed by the shape class (:class:`ShapeClass`: vocabulary, hidden size, dtype,
filter_eps), which keeps a running estimate (:class:`KeptFraction`, an exponential moving average);
:func:`kept_fractions` shows it, :func:`reset_kept_fractions` clears it. The current store is the one
a :func:`use_kept_fraction_store` block made current in the running context (thread), so that one
model's observations do not decide the paths of another's calls; outside every block it is the
default store, which all such calls share, from any thread. An eager backward observes into the store
its forward ran under. :func:`choose_strategy` prices the sparse path at the observed
fraction when there is one. A call planned by ``strategy="auto"`` (the op's ``adaptive`` option: the
public function's "auto", the cce pass unless ``cce_strategy`` pins a path) re-decides at run time,
inside the op and outside any traced graph, by :func:`runtime_strategy`: among the paths whose outputs
are those of the planned one ("chunked" or sparse rounds run in the forward when the plan formed the
gradient there; "static" or sparse rounds in the backward otherwise), at the observed fraction. A
call that does not run sparse measures nothing (counting the kept tiles on another path would need a
host read that path does not make, and the other paths visit the vocabulary in another order), so
the first call of a shape class, and one after ``CCETuning.probe_every`` calls without an
observation, runs sparse rounds: a probe. Neither happens where the sparse path may not run (an
exact backward, ``deterministic``, CUDA-graph capture, softcap with label smoothing, the torch
reference); there the plan runs as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from comera_compile import devices
from comera_compile.cce.observed import bounds_seen_to_pay, current_kept_fraction_store, observed_kept_fraction
from comera_compile.cce.tuning import MIB, CCETuning, current_tuning, default_filter_eps
from comera_compile.devices import DeviceProfile

# the deprecated rate views (DeviceRates, ReferenceRates, H200, CPU) are attributes (module __getattr__, with a
# DeprecationWarning), not listed here: a star import would warn
__all__ = [
    "BACKWARDS", "DEFAULT_MEMORY_THRESHOLD", "FORWARD_DX_MAX_D", "FORWARD_DX_PASS", "MEMORY_POLICY_SLOWDOWN",
    "PATHS", "POLICIES", "REDUCTIONS", "STRATEGIES", "FusedLossDecision", "adaptive_plan", "choose_strategy",
    "chunk_plan", "decide_fused_loss", "default_filter_eps", "default_memory_budget", "describe_logits",
    "estimate_seconds", "format_bytes", "forward_path", "fused_loss_pays", "logits_bytes", "op_profile", "rates_for",
    "recompute_path", "runtime_strategy",
]

REDUCTIONS = ("mean", "sum", "none")
BACKWARDS = ("filtered", "exact")
PATHS = ("chunked", "sparse", "static", "fused")
STRATEGIES = ("auto",) + PATHS
POLICIES = ("memory", "speed")
# The memory policy fuses a head whose logits take more than this: the fused op's least working
# memory (``default_memory_budget``), so smaller logits fit one chunk of it and fusing saves nothing.
DEFAULT_MEMORY_THRESHOLD = 64 * MIB
# ... when its estimate is at most this many times the unfused one. The head's loss is a part of a
# training step (about a third of a small LM's), so 15 % on it costs a step at most ~5 %, for
# memory that grows with tokens x vocabulary: what users pick a fused loss for.
MEMORY_POLICY_SLOWDOWN = 1.15


def default_memory_budget(n_tokens: int, vocab: int) -> int:
    """The working memory the op may use by default: 1/16 of the fp32 logits it replaces, at least
    64 MiB (a chunk of tokens large enough for efficient GEMMs, small next to the logits)."""
    return max(64 * MIB, n_tokens * vocab * 4 // 16)


# ---------------------------------------------------------------------------------------------
# Memory budget and chunking
# ---------------------------------------------------------------------------------------------


def chunk_plan(n_tokens: int, hidden: int, vocab: int, elem: int, budget: int,
               need_dw: bool) -> tuple[int, bool]:
    """(rows per token chunk, whether dW accumulates in an fp32 buffer) for the chunked path.

    The chunk of logits (``rows x vocab`` in the compute dtype, overwritten by its gradient) gets
    the budget. dW accumulates across chunks in fp32 when an fp32 ``[vocab, hidden]`` buffer fits
    in the budget without adding a chunk; otherwise in the weight's dtype (each chunk's product is
    summed in fp32 inside the GEMM, then rounded once per chunk).
    """
    row_bytes = max(1, vocab * elem)

    def rows_for(room: int) -> int:
        rows = max(1, min(n_tokens, room // row_bytes))
        return rows // 64 * 64 if 64 <= rows < n_tokens else rows

    rows = rows_for(budget)
    acc_bytes = vocab * hidden * 4 if need_dw and elem < 4 else 0
    if acc_bytes and budget > acc_bytes:
        rows32 = rows_for(budget - acc_bytes)
        if -(-n_tokens // rows32) <= -(-n_tokens // rows):
            return rows32, True
    return rows, False


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _DeviceRates:
    """Deprecated (use a :class:`~comera_compile.devices.DeviceProfile`): a GPU profile's fused-loss rates
    under their old names, kept for one release as ``DeviceRates``. ``gemm_flops`` is the profile's
    ``lm_head_gemm_flops``, ``tile_flops`` its ``cce_tile_flops``, ``softmax_elems`` its
    ``cce_softmax_elems``, ``bandwidth`` its ``hbm_bandwidth``, ``launch_s`` / ``sync_s`` its
    ``cce_launch_s`` / ``cce_sync_s``, ``bounds_s`` its ``forward_bounds_s``; ``sparse_round_s`` and
    ``sparse_call_s`` keep their names. The defaults are the H200's (what each measured: its profile,
    :data:`comera_compile.devices.H200`); one built with other numbers stands for the H200's profile with
    those replaced (:attr:`profile`), and the cost model's entry points take it as ``profile=`` or
    ``rates=``."""

    gemm_flops: float = devices.H200.lm_head_gemm_flops
    tile_flops: float = devices.H200.cce_tile_flops
    softmax_elems: float = devices.H200.cce_softmax_elems
    bandwidth: float = devices.H200.hbm_bandwidth
    launch_s: float = devices.H200.cce_launch_s
    sync_s: float = devices.H200.cce_sync_s
    sparse_round_s: float = devices.H200.sparse_round_s
    sparse_call_s: float = devices.H200.sparse_call_s
    bounds_s: float = devices.H200.forward_bounds_s

    @functools.cached_property
    def profile(self) -> DeviceProfile:
        """The profile these rates stand for: the H200's with the fused-loss fields replaced (the H200's
        itself when nothing differs)."""
        p = dataclasses.replace(devices.H200, lm_head_gemm_flops=self.gemm_flops, cce_tile_flops=self.tile_flops,
                                cce_softmax_elems=self.softmax_elems, hbm_bandwidth=self.bandwidth,
                                cce_launch_s=self.launch_s, cce_sync_s=self.sync_s,
                                sparse_round_s=self.sparse_round_s, sparse_call_s=self.sparse_call_s,
                                forward_bounds_s=self.bounds_s)
        return devices.H200 if p == devices.H200 else dataclasses.replace(p, name="H200, DeviceRates changed")


# The fused path forms dX in its forward pass when the hidden size fits one K step of this many
# columns (a constant, not a tuning field: the op's output shapes must not depend on tuning).
FORWARD_DX_MAX_D = 128
FORWARD_DX_PASS = 1.8  # that pass's time in plain softmax passes (it adds the dX product)
_DEFAULTS = CCETuning()
_TILE = 128 * 128  # entries per gradient tile of the sparse path


@dataclass(frozen=True)
class _ReferenceRates:
    """Deprecated (use a :class:`~comera_compile.devices.DeviceProfile`): a CPU profile's rates for the
    fused loss's torch reference under their old names, kept for one release as ``ReferenceRates``.
    ``gemm_flops`` / ``bf16_gemm_flops`` are the profile's ``ref_fp32_gemm_flops`` /
    ``ref_bf16_gemm_flops``, ``bandwidth`` its ``ref_memory_bandwidth``, ``rows_s`` / ``rows_forward_s``
    its ``ref_rows_s`` / ``ref_rows_forward_s``, ``unfused_s`` / ``unfused_forward_s`` its
    ``ref_inductor_ce_s`` / ``ref_inductor_ce_forward_s``, ``call_s`` / ``forward_call_s`` its
    ``ref_call_s`` / ``ref_forward_call_s``, ``unfused_call_s`` / ``unfused_forward_call_s`` its
    ``ref_inductor_call_s`` / ``ref_inductor_forward_call_s``, ``chunk_s`` its ``ref_chunk_s``. The
    defaults are the CPU's (:data:`comera_compile.devices.CPU`, which says what each measured)."""

    gemm_flops: float = devices.CPU.ref_fp32_gemm_flops
    bf16_gemm_flops: float = devices.CPU.ref_bf16_gemm_flops
    bandwidth: float = devices.CPU.ref_memory_bandwidth
    rows_s: float = devices.CPU.ref_rows_s
    rows_forward_s: float = devices.CPU.ref_rows_forward_s
    unfused_s: float = devices.CPU.ref_inductor_ce_s
    unfused_forward_s: float = devices.CPU.ref_inductor_ce_forward_s
    call_s: float = devices.CPU.ref_call_s
    forward_call_s: float = devices.CPU.ref_forward_call_s
    unfused_call_s: float = devices.CPU.ref_inductor_call_s
    unfused_forward_call_s: float = devices.CPU.ref_inductor_forward_call_s
    chunk_s: float = devices.CPU.ref_chunk_s

    def gemm_s(self, flops: float, dtype: torch.dtype) -> float:
        """One library GEMM of ``flops`` in ``dtype`` (the logits' traffic is in the per-logit costs)."""
        return _ref_gemm_s(self.profile, flops, dtype)

    @functools.cached_property
    def profile(self) -> DeviceProfile:
        """The profile these rates stand for: the CPU's with the reference's fields replaced (the CPU's
        itself when nothing differs)."""
        p = dataclasses.replace(
            devices.CPU, ref_fp32_gemm_flops=self.gemm_flops, ref_bf16_gemm_flops=self.bf16_gemm_flops,
            ref_memory_bandwidth=self.bandwidth, ref_rows_s=self.rows_s, ref_rows_forward_s=self.rows_forward_s,
            ref_inductor_ce_s=self.unfused_s, ref_inductor_ce_forward_s=self.unfused_forward_s, ref_call_s=self.call_s,
            ref_forward_call_s=self.forward_call_s, ref_inductor_call_s=self.unfused_call_s,
            ref_inductor_forward_call_s=self.unfused_forward_call_s, ref_chunk_s=self.chunk_s)
        return devices.CPU if p == devices.CPU else dataclasses.replace(p, name="CPU, ReferenceRates changed")


_DeviceRates.__name__ = _DeviceRates.__qualname__ = "DeviceRates"
_ReferenceRates.__name__ = _ReferenceRates.__qualname__ = "ReferenceRates"
_H200_RATES, _CPU_RATES = _DeviceRates(), _ReferenceRates()
_DEPRECATED = {
    "DeviceRates": (lambda: _DeviceRates, "comera_compile.devices.DeviceProfile"),
    "ReferenceRates": (lambda: _ReferenceRates, "comera_compile.devices.DeviceProfile"),
    "H200": (lambda: _H200_RATES, "comera_compile.devices.H200"),
    "CPU": (lambda: _CPU_RATES, "comera_compile.devices.CPU"),
}


def __getattr__(name: str) -> Any:
    """The deprecated names (``DeviceRates``, ``ReferenceRates``, ``H200``, ``CPU``), with a
    DeprecationWarning."""
    if name in _DEPRECATED:
        get, new = _DEPRECATED[name]
        warnings.warn(f"comera_compile.cce.planner.{name} is deprecated and will be removed in the next release: use "
                      f"{new}, passed as profile=", DeprecationWarning, stacklevel=2)
        return get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rates_for(triton: bool) -> "_DeviceRates | _ReferenceRates":
    """Deprecated (use :func:`op_profile`): the rates of what runs the op under their old names: its
    Triton paths (the GPU: the H200's, ``DeviceRates``) or its torch reference (the CPU's,
    ``ReferenceRates``); each stands for its :class:`~comera_compile.devices.DeviceProfile`
    (``.profile``) wherever the cost model takes one. Kept, without a warning, for one release."""
    return _H200_RATES if triton else _CPU_RATES


def op_profile(device: Any, *, triton: bool) -> DeviceProfile:
    """The profile the cost model prices a call of the op at, by what runs it on ``device`` (a
    ``torch.device`` or its type).

    * ``triton`` (its Triton paths): the device's GPU profile, :func:`comera_compile.devices.profile_for`
      (:data:`~comera_compile.devices.H200` for every CUDA device); on a device without one (the
      Triton interpreter runs the GPU kernels on the CPU) :data:`~comera_compile.devices.H200`, the GPU
      the kernels stand for.
    * otherwise (its torch reference): :data:`~comera_compile.devices.CPU`, wherever it runs (also on a
      CUDA tensor with ``impl="torch"``).

    The entry points take it as ``profile=``."""
    if not triton:
        return devices.CPU
    profile = devices.profile_for(device)
    return profile if profile.kind == "gpu" else devices.H200


def _as_profile(profile: Any, rates: Any, default: DeviceProfile) -> DeviceProfile:
    """The profile of an entry point's ``profile=`` or its older name ``rates=`` (a ``DeviceRates`` /
    ``ReferenceRates`` is taken for the profile it stands for)."""
    if profile is None:
        profile = default if rates is None else rates
    elif rates is not None:
        raise TypeError("pass profile= or its older name rates=, not both")
    if type(profile) is DeviceProfile:
        return profile
    if isinstance(profile, (_DeviceRates, _ReferenceRates)):
        return profile.profile
    if isinstance(profile, DeviceProfile):
        return profile
    raise TypeError(f"profile= takes a comera_compile.devices.DeviceProfile, got {type(profile).__name__}")


def _ref_gemm_s(p: DeviceProfile, flops: float, dtype: torch.dtype) -> float:
    """One library GEMM of ``flops`` in ``dtype`` where the torch reference runs (the logits' traffic is
    in the per-logit costs)."""
    return flops / (p.ref_bf16_gemm_flops if dtype == torch.bfloat16 else p.ref_fp32_gemm_flops)


def _flat_kept_fraction(vocab: int, filter_eps: float) -> float:
    """Fraction of the sparse path's gradient tiles the filter keeps when the logits are N(0, 1)
    (an untrained head: the softmax is flattest, the filter keeps the most). An entry is kept
    when exp(z) / (V e^{1/2}) >= eps."""
    if filter_eps <= 0.0:
        return 1.0
    threshold = math.log(filter_eps * vocab) + 0.5
    q = 0.5 * math.erfc(threshold / math.sqrt(2.0))
    return 1.0 - (1.0 - q) ** _TILE


def _reference_seconds(N: int, D: int, V: int, dtype: torch.dtype, budget: int, p: DeviceProfile,
                       training: bool) -> dict[str, float]:
    """:func:`estimate_seconds` where the op runs its torch reference: "chunked" forms the gradient
    in the forward (three fp32 GEMMs, one rows step with the gradient); every other path runs there
    as an exact recompute (keyed "static": the forward's GEMM and loss step, then the backward's
    three GEMMs and gradient step)."""
    F, NV = 2.0 * N * D * V, float(N * V)
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 2
    ref, unfused = _ref_gemm_s(p, F, torch.float32), _ref_gemm_s(p, F, dtype)
    rows, _ = chunk_plan(N, D, V, 4, budget, training)
    chunks = math.ceil(N / rows)
    moved = NV * elem / 4  # Inductor's passes move the logits in their own dtype
    if not training:
        return {"unfused": unfused + moved * p.ref_inductor_ce_forward_s + p.ref_inductor_forward_call_s,
                "static": ref + NV * p.ref_rows_forward_s + chunks * p.ref_chunk_s + p.ref_forward_call_s}
    rmw = (chunks - 1) * 2 * V * D * 4 / p.ref_memory_bandwidth  # dW accumulated in fp32 across chunks
    return {"unfused": 3 * unfused + moved * p.ref_inductor_ce_s + p.ref_inductor_call_s,
            "chunked": 3 * ref + NV * p.ref_rows_s + chunks * p.ref_chunk_s + rmw + p.ref_call_s,
            "static": (4 * ref + NV * (p.ref_rows_forward_s + p.ref_rows_s) + 2 * chunks * p.ref_chunk_s
                       + rmw + p.ref_call_s)}


def estimate_seconds(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *,
                     backward: str = "filtered", memory_budget: Optional[int] = None,
                     filter_eps: Optional[float] = None, rates: Any = None,
                     training: bool = True, upcast: bool = False,
                     kept_fraction: Optional[float] = None, skipped_fraction: float = 0.0,
                     profile: Optional[DeviceProfile] = None) -> dict[str, float]:
    """Estimated seconds of one forward (+ backward when ``training``) per path, and of the
    unfused ``linear`` + ``cross_entropy`` under Inductor (key ``"unfused"``). ``upcast``: the
    unfused loss casts half-precision logits to fp32 first (``logits.float()``), which costs
    Inductor fp32 logits traffic on the GPU (counted as two more passes over the half logits; on
    the CPU its kernels compute in fp32 either way). ``kept_fraction``: the fraction of gradient
    tiles the sparse path's filter keeps (e.g. :func:`observed_kept_fraction`); None assumes a
    flat softmax (N(0, 1) logits, an untrained head: the most tiles kept). ``skipped_fraction``:
    the fraction of tiles the forward's logit bounds rule out, which sparse rounds run in the
    forward do not recompute (0: every tile is recomputed, as in a backward). ``profile``: the
    :class:`~comera_compile.devices.DeviceProfile` to price at (``rates``: its older name; default
    :data:`comera_compile.devices.H200`): a ``"gpu"`` one prices the Triton paths, a ``"cpu"`` one the
    torch reference, which has no sparse path and ignores both fractions."""
    p = _as_profile(profile, rates, devices.H200)
    N, D, V = max(1, n_tokens), max(1, hidden), max(1, vocab)
    budget = memory_budget if memory_budget is not None else default_memory_budget(N, V)
    if p.kind == "cpu":
        return _reference_seconds(N, D, V, dtype, budget, p, training)
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 2
    tun = _DEFAULTS
    F = 2.0 * N * D * V
    L = float(N * V * elem)
    bw, launch = p.hbm_bandwidth, p.cce_launch_s
    tile_pass = max(F / p.cce_tile_flops, N * V / p.cce_softmax_elems)
    if not training:
        return {"unfused": F / p.lm_head_gemm_flops + 2 * L / bw + 3 * launch,
                "static": tile_pass + 4 * launch}
    extra = 2 * L / bw if upcast and elem < 4 else 0.0
    # a GEMM with a logits-sized operand or result: bound by its FLOPs, or for small D by the bytes
    gemm = max(F / p.lm_head_gemm_flops, L / bw)
    out = {"unfused": 3 * gemm + 4 * L / bw + extra + 6 * launch}
    rows, fp32_acc = chunk_plan(N, D, V, elem, budget, True)
    chunks = math.ceil(N / rows)
    rmw = (chunks - 1) * 2 * V * D * (4 if fp32_acc else elem) / bw
    out["chunked"] = 3 * gemm + 3 * L / bw + rmw + (5 * chunks + 10) * launch
    width = max(tun.dense_block_n, min(tun.dense_budget_bytes, budget) // max(1, N * elem))
    vchunks = math.ceil(V / width)
    # static: the gradient of each vocabulary chunk is written once and read by the dX and dW GEMMs
    out["static"] = (2 * tile_pass + 2 * F / p.lm_head_gemm_flops + 3 * L / bw
                     + vchunks * (2 * N * D * 4 / bw + 4 * launch) + 10 * launch)
    # fused: for D <= FORWARD_DX_MAX_D the forward pass forms dX too (FORWARD_DX_PASS of a plain
    # pass), then one dW pass; larger D: forward, then dX and dW per chunk of fused_max_d columns
    if D <= FORWARD_DX_MAX_D:
        out["fused"] = (FORWARD_DX_PASS + 1) * tile_pass + 10 * launch
    else:
        out["fused"] = (1 + 2 * math.ceil(D / tun.fused_max_d)) * tile_pass + 10 * launch
    if backward == "filtered":
        eps = filter_eps if filter_eps is not None else default_filter_eps(dtype)
        kept = (min(1.0, max(0.0, float(kept_fraction))) if kept_fraction is not None
                else _flat_kept_fraction(V, eps))
        if kept > tun.dense_density:  # two dense rounds, then the rest as static
            out["sparse"] = out["static"] + 2 * p.cce_sync_s + 2 * tile_pass * tun.dense_density
        else:
            tiles = kept * (N * V / _TILE)
            rounds = max(1, math.ceil(tiles * _TILE * elem / min(tun.tile_budget_bytes, budget)))
            skipped = min(1.0 - kept, max(0.0, float(skipped_fraction)))
            out["sparse"] = ((2 - skipped) * tile_pass + 2 * kept * F / p.cce_tile_flops + 3 * V * D * elem / bw
                             + rounds * p.sparse_round_s + p.sparse_call_s
                             + (p.forward_bounds_s if skipped > 0.0 else 0.0) + 10 * launch)
    return out


def _allowed(costs: dict[str, float], dtype: torch.dtype, *, reduction: str, backward: str,
             deterministic: bool, capture: bool, lse_grad: bool) -> dict[str, float]:
    allowed = {p: c for p, c in costs.items() if p in PATHS}
    # The chunked path stores the gradient before grad_output's scale is known: in fp16 the small
    # entries a GradScaler would have kept underflow, so it is never the automatic choice there.
    if reduction == "none" or lse_grad or dtype == torch.float16:
        allowed.pop("chunked", None)
    # Under CUDA graphs the chunked path's gradients would be outputs of the captured forward that the
    # backward scales in place, a combination not validated under cudagraph trees: the captured step
    # takes a recomputing path.
    if capture:
        allowed.pop("chunked", None)
    if backward != "filtered" or deterministic or capture:
        allowed.pop("sparse", None)
    return allowed


def choose_strategy(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *,
                    reduction: str = "mean", backward: str = "filtered", deterministic: bool = False,
                    memory_budget: Optional[int] = None, filter_eps: Optional[float] = None,
                    capture: bool = False, lse_grad: bool = False, rates: Any = None,
                    kept_fraction: Optional[float] = None, profile: Optional[DeviceProfile] = None) -> str:
    """The fastest path for a training step by the cost model, among those that apply.

    ``capture``: the step runs under CUDA graphs (no sparse rounds); ``lse_grad``: the caller may
    differentiate the lse (no chunked path). ``n_tokens`` may be a size hint. ``kept_fraction``:
    the sparse path's kept fraction; None takes the one observed on previous calls of this shape
    class (:func:`observed_kept_fraction`) when there is one, else the flat-softmax assumption.
    ``profile``: as for :func:`estimate_seconds` (``rates``: its older name).
    """
    rates = _as_profile(profile, rates, devices.H200)
    if kept_fraction is None and backward == "filtered":
        kept_fraction = observed_kept_fraction(vocab, hidden, dtype, filter_eps)
    costs = estimate_seconds(n_tokens, hidden, vocab, dtype, backward=backward,
                             memory_budget=memory_budget, filter_eps=filter_eps, rates=rates,
                             kept_fraction=kept_fraction)
    allowed = _allowed(costs, dtype, reduction=reduction, backward=backward, deterministic=deterministic,
                       capture=capture, lse_grad=lse_grad)
    return min(allowed, key=allowed.get)


def adaptive_plan(strategy: str, dtype: torch.dtype, *, reduction: str = "mean", lse_grad: bool = False) -> str:
    """The plan of a call that re-decides at run time (``strategy="auto"``) for the cost model's
    choice ``strategy``: a "sparse" choice becomes "chunked" where the chunked path may run
    (reduction "mean"/"sum", the lse not differentiated, not fp16). The op then runs sparse rounds
    in the forward (:func:`runtime_strategy` picks them at the same observed fraction), where the
    forward's logit bounds skip the tiles the filter drops; a backward's rounds recompute every
    tile. With ``CCETuning.forward_bounds`` off the choice stays as it is."""
    if (strategy == "sparse" and current_tuning().forward_bounds and reduction != "none" and not lse_grad
            and dtype != torch.float16):
        return "chunked"
    return strategy


def runtime_strategy(planned: str, n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *,
                     filter_eps: float, memory_budget: Optional[int] = None, rates: Any = None,
                     profile: Optional[DeviceProfile] = None) -> str:
    """The path a call planned by ``strategy="auto"`` runs, decided when it runs (inside the op,
    after any tracing), where the sparse path may run (the caller checks: a filtered backward that
    can filter, not deterministic, not under CUDA-graph capture, the Triton paths).

    The choice is between "sparse" and the path with the planned one's outputs: "chunked" when
    ``planned`` is "chunked" (the gradient formed in the forward: sparse rounds then run in the
    forward, for ``grad_output = 1``, as chunked does), "static" otherwise (the backward
    recomputes). It is the cheaper one by :func:`estimate_seconds` at the kept fraction observed
    for this shape class; with no observation yet, or when ``CCETuning.probe_every`` calls have
    passed without one, "sparse" (a probe: only the sparse path measures the fraction). Reads and
    counts host-side Python state only (no device value). Rounds in the forward are priced with
    the tiles the forward's bounds are expected to rule out (``KeptFraction.skipped``, where
    :func:`forward_bounds_pay` would compute them). ``profile``: as for :func:`estimate_seconds`
    (``rates``: its older name); the op passes :func:`op_profile` of its Triton paths.
    """
    rates = _as_profile(profile, rates, devices.H200)
    other = "chunked" if planned == "chunked" else "static"
    tun = current_tuning()
    seen, calls = current_kept_fraction_store().count_auto_call(vocab, hidden, dtype, filter_eps)
    if seen is None or calls >= max(1, tun.probe_every):
        return "sparse"
    skipped = seen.skipped if other == "chunked" and bounds_seen_to_pay(seen, tun) else 0.0
    costs = estimate_seconds(n_tokens, hidden, vocab, dtype, memory_budget=memory_budget,
                             filter_eps=filter_eps, rates=rates, kept_fraction=seen.fraction,
                             skipped_fraction=skipped)
    return "sparse" if costs["sparse"] < costs[other] else other


def forward_path(strategy: str, adaptive: bool, sparse_may_run: bool, n_tokens: int, hidden: int, vocab: int,
                 dtype: torch.dtype, *, filter_eps: float, memory_budget: Optional[int] = None,
                 rates: Any = None, profile: Optional[DeviceProfile] = None) -> str:
    """Who forms the gradients of a forward that forms them on the Triton paths: "sparse" for a "chunked"
    planned by "auto" (``adaptive``) when the observed kept fraction (or a probe) says so and sparse rounds
    may run (``sparse_may_run``: they can filter, need not be deterministic, no CUDA graph is being
    captured), else the planned ``strategy``. ``profile``: the Triton paths' (default
    :data:`comera_compile.devices.H200`; ``rates``: its older name)."""
    if strategy != "chunked" or not adaptive or not sparse_may_run:
        return strategy
    return runtime_strategy("chunked", n_tokens, hidden, vocab, dtype, filter_eps=filter_eps,
                            memory_budget=memory_budget, profile=_as_profile(profile, rates, devices.H200))


def recompute_path(strategy: str, adaptive: bool, sparse_may_run: bool, n_tokens: int, hidden: int, vocab: int,
                   dtype: torch.dtype, *, filter_eps: float, memory_budget: Optional[int] = None,
                   rates: Any = None, profile: Optional[DeviceProfile] = None) -> str:
    """The Triton recompute path of a backward: the one asked for, or for "auto" (and "chunked", when the
    forward did not form the gradient) the fused kernels for small D (``CCETuning.fused_max_d``), sparse
    rounds when filtering can skip tiles, static chunks otherwise. Sparse rounds sync the host: where they
    may not run (``sparse_may_run`` false: under CUDA-graph capture, or when they cannot filter or must be
    deterministic) static runs instead. A "sparse" or "static" planned by "auto" (``adaptive``) takes the
    one of the two that the observed kept fraction (or a probe) picks (:func:`runtime_strategy`, at
    ``profile``: default :data:`comera_compile.devices.H200`; ``rates``: its older name)."""
    if strategy in ("auto", "chunked"):
        if hidden <= current_tuning().fused_max_d:
            return "fused"
        strategy = "sparse"
    if strategy not in ("sparse", "static"):
        return strategy
    if not sparse_may_run:
        return "static"
    if adaptive:
        return runtime_strategy(strategy, n_tokens, hidden, vocab, dtype, filter_eps=filter_eps,
                                memory_budget=memory_budget, profile=_as_profile(profile, rates, devices.H200))
    return strategy


def logits_bytes(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """The memory the unfused loss holds for the logits, which the fused loss avoids: ``N x V``
    entries of the logits' dtype. In training Inductor's forward saves them for the backward, which
    writes their gradient over them; 16-bit logits are saved as they are, the fp32 of a ``.float()``
    upcast is recomputed inside its kernels (torch 2.13: the saved tensors and the backward's buffer
    reuse). An fp32 head of 2048 tokens x 128k vocabulary: 1 GiB."""
    elem = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 2
    return max(0, n_tokens) * max(0, vocab) * elem


def format_bytes(n: int) -> str:
    """``n`` bytes as explain prints them: "1 GiB", "1.96 GiB", "62.5 MiB", "1000 MiB", "7 KiB" (three
    significant digits, never in exponent notation)."""
    if n >= 1 << 30:
        return f"{_digits(n / (1 << 30))} GiB"
    if n >= MIB:
        return f"{_digits(n / MIB)} MiB"
    return f"{-(-n // 1024)} KiB"


def _digits(x: float) -> str:
    """``x`` to three significant digits, whole numbers from 100 on ("62.5", "1.96", "1000", "1234")."""
    return f"{x:.3g}" if x < 99.95 else f"{x:.0f}"


@dataclass(frozen=True)
class FusedLossDecision:
    """What the cost model says about fusing one LM head, formed once per head.

    ``pays``: fusing is worth it by the policy (see :func:`decide_fused_loss`); else ``reason``
    says why (the logits' memory, the two estimates). ``strategy``: the op's ``strategy`` argument:
    in training the fastest path that applies, otherwise "auto" (the op picks at run time).
    ``logits_bytes``: the logits the unfused loss would hold (:func:`logits_bytes`);
    ``slowdown``: the best path's estimate over the unfused one (0 when not estimated).
    """

    pays: bool
    reason: str = ""
    strategy: str = "auto"
    logits_bytes: int = 0
    slowdown: float = 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe_logits(nbytes: int, dtype: torch.dtype) -> str:
    """The logits' memory as explain states it: "logits 1 GiB float32"."""
    return f"logits {format_bytes(nbytes)} {_dtype_name(dtype)}"


def decide_fused_loss(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *,
                      reduction: str = "mean", backward: str = "filtered", deterministic: bool = False,
                      memory_budget: Optional[int] = None, filter_eps: Optional[float] = None,
                      capture: bool = False, training: bool = True, upcast: bool = False,
                      policy: str = "memory", memory_threshold: int = DEFAULT_MEMORY_THRESHOLD,
                      rates: Any = None, profile: Optional[DeviceProfile] = None) -> FusedLossDecision:
    """:func:`fused_loss_pays` and, in training, :func:`choose_strategy`'s path, from one run of
    the cost model (:func:`estimate_seconds` at ``profile``: small vocabularies lose on fixed costs,
    mid-size hidden sizes with flat logits lose on the GPU's recompute, large heads with a budget
    for big chunks or a filter that skips tiles pay).

    ``policy="speed"``: fuse when the best path's estimate is at most the unfused one.
    ``policy="memory"`` (the default): also when the logits (:func:`logits_bytes`) take more than
    ``memory_threshold`` bytes and the best path's estimate is at most ``MEMORY_POLICY_SLOWDOWN``
    (1.15) times the unfused one. ``profile``: as for :func:`estimate_seconds` (``rates``: its older
    name); the cce pass passes :func:`op_profile` of what will run the op."""
    if policy not in POLICIES:
        raise ValueError(f"decide_fused_loss: policy={policy!r}; valid values: {list(POLICIES)}")
    rates = _as_profile(profile, rates, devices.H200)
    costs = estimate_seconds(n_tokens, hidden, vocab, dtype, backward=backward,
                             memory_budget=memory_budget, filter_eps=filter_eps, rates=rates,
                             training=training, upcast=upcast)
    allowed = _allowed(costs, dtype, reduction=reduction, backward=backward, deterministic=deterministic,
                       capture=capture, lse_grad=False)
    best = min(allowed, key=allowed.get)
    strategy = best if training else "auto"
    nbytes, slowdown = logits_bytes(n_tokens, vocab, dtype), allowed[best] / costs["unfused"]
    large = policy == "memory" and nbytes > memory_threshold
    if slowdown <= (MEMORY_POLICY_SLOWDOWN if large else 1.0):
        return FusedLossDecision(True, "", strategy, nbytes, slowdown)
    logits = describe_logits(nbytes, dtype)
    estimate = (f"the fused loss is estimated at {allowed[best] * 1e3:.3g} ms (best path: {best}) "
                f"against {costs['unfused'] * 1e3:.3g} ms for linear + cross_entropy"
                f"{' (fp32 upcast)' if upcast else ''} under Inductor "
                f"(N={n_tokens}, D={hidden}, V={vocab}, {_dtype_name(dtype)})")
    if large:
        reason = (f"{logits} would be avoided, but {estimate}: {slowdown:.2f}x, more than the "
                  f"{MEMORY_POLICY_SLOWDOWN}x the memory policy allows")
    elif policy == "memory":
        reason = f"{logits}: below cce_memory_threshold {format_bytes(memory_threshold)}, and {estimate}"
    else:
        reason = f"{estimate}; {logits} (cce_policy='speed')"
    return FusedLossDecision(False, reason, strategy, nbytes, slowdown)


def fused_loss_pays(n_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device_type: str,
                    *, reduction: str = "mean", backward: str = "filtered",
                    deterministic: bool = False, memory_budget: Optional[int] = None,
                    filter_eps: Optional[float] = None, capture: bool = False,
                    training: bool = True, upcast: bool = False, policy: str = "memory",
                    memory_threshold: int = DEFAULT_MEMORY_THRESHOLD,
                    rates: Any = None, profile: Optional[DeviceProfile] = None) -> tuple[bool, str]:
    """Whether fusing the head is worth it by ``policy`` against the unfused ``linear`` +
    ``cross_entropy`` under Inductor; ``(False, reason)`` when it is not (see
    :func:`decide_fused_loss`, which also gives the path). ``profile`` (``rates``: its older name): by
    default the device's, :func:`comera_compile.devices.profile_for` ``(device_type)``: the H200's on
    ``"cuda"`` (the Triton paths; on any GPU), the CPU's reference elsewhere."""
    decision = decide_fused_loss(n_tokens, hidden, vocab, dtype, reduction=reduction, backward=backward,
                                 deterministic=deterministic, memory_budget=memory_budget,
                                 filter_eps=filter_eps, capture=capture, training=training, upcast=upcast,
                                 policy=policy, memory_threshold=memory_threshold,
                                 rates=_as_profile(profile, rates, devices.profile_for(device_type)))
    return decision.pays, decision.reason
