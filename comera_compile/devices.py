"""The devices the cost models know: one :class:`DeviceProfile` per device, every calibration in it named
by what it measured.

Two planners decide before anything runs, from estimated seconds: the tensor-train planner
(:mod:`comera_compile.tt.planner`: a layer's contraction order and strategy) and the fused loss's
(``comera_compile.cce.planner``: whether fusing an LM head pays, and its path).
They price different work on the same GPU (a tensor-train layer's skinny GEMMs; an LM head's large ones
and the loss's Triton tiles), so a device has several rates for what looks like one quantity: the H200
runs cuBLAS GEMMs at 600 TFLOP/s at tensor-train shapes (:attr:`DeviceProfile.tt_gemm_flops`) and at
690 at LM-head shapes (:attr:`DeviceProfile.lm_head_gemm_flops`). A profile keeps them apart by name;
a field is None where the device was not measured for it.

* :data:`H200`: the project's GPU machine (one NVIDIA H200, torch 2.11). Both planners' default.
* :data:`CPU`: the 2-core x86-64 machine (AVX-512, AMX; torch 2.13) the fused loss's torch reference
  was fitted on. It has no tensor-train calibration: the tensor-train planner prices every device at
  :data:`H200` (its default).
* :func:`profile_for`: the profile the fused loss prices a device at: every CUDA device gets
  :data:`H200`, whatever its model (it is the only GPU measured, so on an A100 or a B200 the decisions
  are the ones an H200 would make); any other device gets :data:`CPU` (the torch reference runs there).
  Nothing says so at run time: ``explain`` shows the estimates, not the profile they came from.

Another device is ``dataclasses.replace(H200, name="...", field=value, ...)`` passed as ``profile=``
to the planners' entry points. Profiles are frozen and hashable (the tensor-train planner caches plans on
them). This module imports nothing from the package: it is the floor both planners stand on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

__all__ = ["CPU", "H200", "IMPLS", "DeviceProfile", "profile_for"]

#: How every comera op may run (its ``impl=``): ``"auto"`` (Triton where it can run, else torch), ``"triton"``
#: or ``"torch"``. The ops (``kernels.dispatch``) and the fused loss's options (``cce.options``) read this one.
IMPLS = ("auto", "triton", "torch")

#: What the fused loss runs on a device: its Triton paths ("gpu") or its torch reference ("cpu").
Kind = Literal["gpu", "cpu"]

_TT = ("tt_gemm_flops", "tt_fp32_gemm_flops", "tt_skinny_gemm_bandwidth", "tt_launch_s", "tt_graph_launch_s")
_TRITON = ("lm_head_gemm_flops", "cce_tile_flops", "cce_softmax_elems", "hbm_bandwidth", "cce_launch_s",
           "cce_sync_s", "sparse_round_s", "sparse_call_s", "forward_bounds_s")
_REFERENCE = ("ref_fp32_gemm_flops", "ref_bf16_gemm_flops", "ref_memory_bandwidth", "ref_rows_s",
              "ref_rows_forward_s", "ref_inductor_ce_s", "ref_inductor_ce_forward_s", "ref_call_s",
              "ref_forward_call_s", "ref_inductor_call_s", "ref_inductor_forward_call_s", "ref_chunk_s")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """The measured rates of one device, by what was measured (rates per second, times in seconds).

    ``kind`` says what the fused loss runs there: ``"gpu"``, its Triton paths, priced at the
    ``lm_head_`` / ``cce_`` / ``hbm_`` / ``sparse_`` / ``forward_bounds_`` fields; ``"cpu"``, its torch
    reference, priced at the ``ref_`` fields. The profile must have the fields of its kind (checked when
    it is built). The ``tt_`` / ``btt_`` fields price tensor-train layers (the tensor-train planner
    refuses a profile without them).
    """

    name: str
    kind: Kind

    # --- tensor-train layers (comera_compile.tt.planner): cuBLAS products at a TT layer's shapes ---------
    #: bf16/fp16 cuBLAS GEMMs at a TT layer's shapes (layer-sized products measured 390-680 TFLOP/s; an
    #: 8192³ product reaches 690): the rate of a compute-bound product of a TT plan.
    tt_gemm_flops: Optional[float] = None
    #: The same products with fp32 operands (TF32 where allowed).
    tt_fp32_gemm_flops: Optional[float] = None
    #: Effective device-memory bytes per second of a TT layer's memory-bound skinny products (rank-32
    #: GEMMs measured 1.2-2.8 TB/s, a rank of 30 half that; the copy engine's 4.3 TB/s is out of their reach). The
    #: planner prices its copies (regrouping, gathers, scatter-adds) at it too.
    tt_skinny_gemm_bandwidth: Optional[float] = None
    #: What a block tensor-train's ``"blocks"`` path reaches (its batched block GEMMs and the copies that
    #: regroup between them), fitted to whole training steps; None: ``tt_skinny_gemm_bandwidth``.
    btt_blocks_bandwidth: Optional[float] = None
    #: Per kernel (a GEMM with its setup) dispatched from Python, outside a CUDA graph.
    tt_launch_s: Optional[float] = None
    #: Per kernel (a GEMM with its setup) replayed inside a CUDA graph.
    tt_graph_launch_s: Optional[float] = None

    # --- the fused loss's Triton paths (kind "gpu"; comera_compile.cce.planner) ----------------------------
    #: Library GEMMs at LM-head shapes, sustained (below the peak: the figure that reproduces measured
    #: torch.compile times): the unfused loss's GEMMs and the chunked/static paths' dX, dW products.
    lm_head_gemm_flops: Optional[float] = None
    #: The fused loss's Triton logits tiles (the product inside its recompute kernels).
    cce_tile_flops: Optional[float] = None
    #: Logits entries per second of one pass of the tile kernels when the product is cheap (small hidden
    #: size): where a pass is bound by its softmax, not its product.
    cce_softmax_elems: Optional[float] = None
    #: HBM bytes per second: logits-sized traffic (Inductor's passes, the chunked path's gradient, dW).
    hbm_bandwidth: Optional[float] = None
    #: Per kernel launch of the fused loss's paths and of the unfused loss under Inductor.
    cce_launch_s: Optional[float] = None
    #: Per host synchronisation (the sparse path's dense rounds read a count).
    cce_sync_s: Optional[float] = None
    #: Per round of the sparse path (the host reads the round's tile count, then builds and launches it).
    sparse_round_s: Optional[float] = None
    #: Per call of the sparse path (its fixed cost beyond rounds and passes).
    sparse_call_s: Optional[float] = None
    #: The forward's logit bounds, where it computes them for sparse rounds in the forward.
    forward_bounds_s: Optional[float] = None

    # --- the fused loss's torch reference (kind "cpu"), and the unfused loss beside it --------------------
    #: Library GEMMs with fp32 operands (the reference's products are fp32 whatever the inputs; fp16 ones
    #: run at this rate too).
    ref_fp32_gemm_flops: Optional[float] = None
    #: Library GEMMs with bf16 operands (Inductor's unfused products in bf16).
    ref_bf16_gemm_flops: Optional[float] = None
    #: Bytes per second of the fp32 dW accumulation across chunks (a [V, D] read-modify-write per chunk).
    ref_memory_bandwidth: Optional[float] = None
    #: Per logit: the reference's loss-and-gradient rows step (counting its memory traffic).
    ref_rows_s: Optional[float] = None
    #: Per logit: the reference's loss-only rows step (a forward without the gradient).
    ref_rows_forward_s: Optional[float] = None
    #: Per fp32 logit: Inductor's softmax + cross-entropy, forward and backward (half per 16-bit logit).
    ref_inductor_ce_s: Optional[float] = None
    #: Per fp32 logit: Inductor's softmax + cross-entropy forward.
    ref_inductor_ce_forward_s: Optional[float] = None
    #: Fixed cost of a training step of the reference (per call).
    ref_call_s: Optional[float] = None
    #: Fixed cost of a forward of the reference (per call).
    ref_forward_call_s: Optional[float] = None
    #: Fixed cost of a training step of the unfused loss under Inductor.
    ref_inductor_call_s: Optional[float] = None
    #: Fixed cost of a forward of the unfused loss under Inductor.
    ref_inductor_forward_call_s: Optional[float] = None
    #: Per chunk of rows of the reference (~15 torch ops).
    ref_chunk_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"DeviceProfile {self.name!r}: kind={self.kind!r}; valid values: ['gpu', 'cpu']")
        missing = [f for f in (_TRITON if self.kind == "gpu" else _REFERENCE) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"DeviceProfile {self.name!r} (kind {self.kind!r}) lacks {missing}: the fused loss's "
                             f"cost model on a {self.kind} reads them")

    @property
    def has_tt_rates(self) -> bool:
        """Whether the tensor-train planner can price layers on this profile (its ``tt_`` fields are set)."""
        return all(getattr(self, f) is not None for f in _TT)

    def calibrations(self) -> dict[str, float]:
        """The fields set on this profile, by name (the measured rates and costs)."""
        return {f.name: v for f in dataclasses.fields(self) if f.name not in ("name", "kind")
                and (v := getattr(self, f.name)) is not None}


#: The project's GPU machine: one NVIDIA H200, torch 2.11.0+cu130, triton 3.6.
#:
#: Tensor-train layers, fitted to cuBLAS GEMMs (``benchmarks/bench_tt.py --calibrate``, 2026-12-01): bf16
#: ``torch.mm`` replayed from a CUDA graph reached 688 TFLOP/s on 8192³ and 390-680 at layer sizes
#: (``tt_gemm_flops`` 600e12); skinny rank-32 products 1.2-2.8 TB/s at 4096-8192 tokens
#: (``tt_skinny_gemm_bandwidth`` 1.5e12; a rank of 30 halves it, hence the rank padding); 1.1 µs per
#: kernel inside a CUDA graph plus a GEMM's own setup (``tt_graph_launch_s`` 3e-6) and 7.7 µs dispatched
#: from Python (``tt_launch_s`` 8e-6). ``tt_fp32_gemm_flops`` (45e12) has no measurement recorded with it.
#: A btt's blocks path (batched GEMMs over 32-128 blocks and the copies between them) runs faster than
#: the skinny products: fitted to the width sweep's whole training steps (bench_e2e, lm-d1024/2048/4096,
#: 8,192 tokens, ranks 1 and 4, the blocks path pinned against the dense weight), its estimates at 1.5
#: TB/s came out 1.5-2.3x the measured step-time differences; at 2.8 TB/s (``btt_blocks_bandwidth``)
#: all five planner choices match the faster of the two measured.
#:
#: The fused loss, in bf16: library GEMMs sustain ~690 TFLOP/s at LM-head shapes (790 peak; 690 is the
#: figure that reproduces the measured torch.compile times), the op's Triton logits tiles ~560 TFLOP/s,
#: HBM 4.3 TB/s; ``cce_softmax_elems``: the fused path's three passes took 4.5 ms at (N, D, V) = (8192,
#: 32, 128256). The sparse path's fixed costs were fitted to its measured times (``bench_cce.py --cases
#: peaked,peaked-flat``, torch 2.11, the Gemma-2, Llama-3 and Llama-style d 1024 heads, kept fractions
#: 0.008-0.052, one to three rounds; within 7 % of all twelve times, with the forward's bounds and
#: without): ~1.9 ms per round whatever D, 1 ms per call, ~3 ms for the forward's bounds. Without them the
#: model priced the sparse path at the d 1024 head 2.8x too cheap and chose it where chunked was 15 %
#: faster. ``cce_launch_s`` (5 µs) and ``cce_sync_s`` (50 µs) have no measurement recorded with them.
H200 = DeviceProfile(
    name="H200", kind="gpu",
    tt_gemm_flops=600e12, tt_fp32_gemm_flops=45e12, tt_skinny_gemm_bandwidth=1.5e12, btt_blocks_bandwidth=2.8e12,
    tt_launch_s=8e-6, tt_graph_launch_s=3e-6,
    lm_head_gemm_flops=690e12, cce_tile_flops=560e12, cce_softmax_elems=0.97e12, hbm_bandwidth=4.3e12,
    cce_launch_s=5e-6, cce_sync_s=50e-6, sparse_round_s=1.9e-3, sparse_call_s=1.0e-3, forward_bounds_s=3.0e-3,
)

#: The CPU the fused loss's torch reference was fitted on: 2-core x86-64 (AVX-512, AMX), torch 2.13, two
#: threads. Fitted to whole compiled steps (``torch.compile(backend="comera")``, fused and with the cce
#: pass off) from (N, D, V) = (64, 8, 3) to (2048, 768, 8192) and (1024, 512, 32768), within ~10 % of
#: them: fp32 GEMMs ~370 GFLOP/s, bf16 ones ~1000 on the AMX units (fp16 ones at the fp32 rate); per
#: logit, counting each pass's memory traffic and the first touch of a fresh logits buffer, the
#: reference's loss and gradient step 2.4 ns (its loss alone 1.5), Inductor's softmax + cross-entropy
#: forward and backward 2.85 ns (forward 1.4) per fp32 logit, half that per 16-bit one; fixed costs per
#: call (a training step / a forward) and per chunk of rows. A CPU with more cores speeds the GEMMs and
#: the per-logit passes alike, so the ratios that decide stay close; one without AMX runs bf16 GEMMs
#: slower than assumed here. No tensor-train calibration (the tensor-train planner uses :data:`H200`).
CPU = DeviceProfile(
    name="CPU", kind="cpu",
    ref_fp32_gemm_flops=370e9, ref_bf16_gemm_flops=1000e9, ref_memory_bandwidth=40e9,
    ref_rows_s=2.4e-9, ref_rows_forward_s=1.5e-9, ref_inductor_ce_s=2.85e-9, ref_inductor_ce_forward_s=1.4e-9,
    ref_call_s=450e-6, ref_forward_call_s=170e-6, ref_inductor_call_s=120e-6, ref_inductor_forward_call_s=30e-6,
    ref_chunk_s=60e-6,
)


def profile_for(device: Any) -> DeviceProfile:
    """The profile the fused loss prices ``device`` at (a ``torch.device`` or its type, e.g. ``"cuda"``):
    :data:`H200` for every CUDA device, whichever GPU it is (no other was measured: elsewhere the
    decisions are the ones an H200 would make), :data:`CPU` for anything else, where the op runs its
    torch reference."""
    return H200 if getattr(device, "type", device) == "cuda" else CPU
