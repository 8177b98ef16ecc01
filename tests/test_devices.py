"""The device profiles (comera_compile.devices, issue 39): one profile per device, every calibration named by
what it measured, both planners deciding from it, and the old names (``DeviceModel``, ``DeviceRates``,
``ReferenceRates``, the two ``H200`` s, ``CPU``, ``rates_for``) still working as views of the profiles.

The move changes no decision: the tables below were recorded by running this file's sweeps on the code
before it (commit 1e36a2f, through the old objects: ``model=planner.H200``, ``rates=plan.H200`` /
``rates=plan.CPU``, and ``DeviceModel`` / ``DeviceRates`` / ``ReferenceRates`` built from the numbers of
CUSTOM_*); the sweeps now run through the profiles, the defaults and the old names, and must find the
same decisions and the same estimates."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import math
import pathlib
import warnings

import pytest
import torch

from comera_compile import devices
from comera_compile.devices import CPU, H200, DeviceProfile, profile_for
from comera_compile import cce as plan
from comera_compile.tt import planner
from comera_compile.tt.format import TTSpec

# ----------------------------------------------------------------------------- the sweeps

TT_LINEARS = (
    ("tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1)),
    ("tt", (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1)),
    ("tt", (4, 8), (8, 4), (1, 4, 32, 4, 1)),
    ("tt", (16, 16, 16), (16, 16, 16), (1, 16, 32, 32, 32, 16, 1)),
    ("tt", (8, 16), (32, 8), (1, 8, 4, 8, 1)),
    ("ttm", (8, 8, 8, 8), (8, 8, 8, 8), (1, 16, 16, 16, 1)),
    ("ttm", (8, 8, 12), (8, 8, 12), (1, 8, 8, 1)),
    ("ttm", (4, 4, 4), (4, 4, 4), (1, 4, 4, 1)),
    ("ttm", (16, 16, 16), (16, 16, 16), (1, 64, 64, 1)),
)
TT_EMBEDDINGS = (
    ("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1)),
    ("tt", (32, 40, 25), (8, 8, 12), (1, 16, 16, 16, 16, 16, 1)),
    ("ttm", (4, 4, 4), (4, 4, 4), (1, 4, 4, 1)),
    ("ttm", (50, 40, 64), (8, 8, 12), (1, 64, 64, 1)),
)
BTT = (((32, 32), (32, 32), 1), ((32, 32), (32, 32), 4), ((32, 32), (32, 32), 16), ((64, 64), (64, 64), 4),
       ((32, 24), (32, 96), 8), ((8, 96), (8, 96), 2))
TOKENS = (1, 16, 256, 4096, 32768)
TT_LETTER = {"factored": "F", "dense": "D", "contract": "C", "tables": "T", "blocks": "B"}
SHAPES = tuple((n, d, v) for n in (1, 64, 2048, 8192, 32768) for d in (8, 32, 128, 1024, 4096)
               for v in (3, 256, 32000, 128256, 256000))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOOSE = {"default": {}, "none": dict(reduction="none"), "exact": dict(backward="exact"),
          "capture": dict(capture=True), "deterministic": dict(deterministic=True),
          "lse_grad": dict(lse_grad=True),
          "kept0.01": dict(kept_fraction=0.01), "kept0.05": dict(kept_fraction=0.05),
          "kept0.2": dict(kept_fraction=0.2), "kept0.6": dict(kept_fraction=0.6), "budget1G": dict(memory_budget=1 << 30)}
DECIDE = {f"{'train' if t else 'infer'}{'-upcast' if u else ''}-{p}": dict(training=t, upcast=u, policy=p)
          for t in (True, False) for u in (False, True) for p in ("memory", "speed")}
SEEN = {"k0.01": (1, 100, None), "k0.05-s0.6": (5, 100, 60), "k0.3-s0.9": (30, 100, 90)}  # kept, tiles, skipped
LETTER = {"chunked": "c", "sparse": "s", "static": "t", "fused": "f", "auto": "a"}

# Other calibrations, to check that every field is read where its old name was: the profiles' numbers
# replaced, and the same numbers under the old names (what the recorded sweeps used).
CUSTOM_TT = dataclasses.replace(H200, name="other", tt_gemm_flops=300e12, tt_fp32_gemm_flops=20e12,
                                tt_skinny_gemm_bandwidth=3e12, tt_launch_s=4e-6, tt_graph_launch_s=1e-6,
                                btt_blocks_bandwidth=None)
OLD_CUSTOM_TT = dict(name="other", gemm_flops=300e12, fp32_flops=20e12, bandwidth=3e12, launch_s=4e-6,
                     graph_launch_s=1e-6, block_bandwidth=None)
CUSTOM_GPU = dataclasses.replace(H200, lm_head_gemm_flops=500e12, cce_tile_flops=400e12, cce_softmax_elems=1e30,
                                 hbm_bandwidth=1e30, cce_launch_s=0.0, cce_sync_s=0.0, sparse_round_s=0.0,
                                 sparse_call_s=0.0, forward_bounds_s=0.0)
OLD_CUSTOM_GPU = dict(gemm_flops=500e12, tile_flops=400e12, softmax_elems=1e30, bandwidth=1e30, launch_s=0.0,
                      sync_s=0.0, sparse_round_s=0.0, sparse_call_s=0.0, bounds_s=0.0)
CUSTOM_CPU = dataclasses.replace(CPU, ref_fp32_gemm_flops=740e9, ref_bf16_gemm_flops=3000e9, ref_memory_bandwidth=20e9,
                                 ref_rows_s=1.1e-9, ref_rows_forward_s=0.9e-9, ref_inductor_ce_s=5e-9,
                                 ref_inductor_ce_forward_s=2e-9, ref_call_s=300e-6, ref_forward_call_s=100e-6,
                                 ref_inductor_call_s=200e-6, ref_inductor_forward_call_s=50e-6, ref_chunk_s=90e-6)
OLD_CUSTOM_CPU = dict(gemm_flops=740e9, bf16_gemm_flops=3000e9, bandwidth=20e9, rows_s=1.1e-9, rows_forward_s=0.9e-9,
                      unfused_s=5e-9, unfused_forward_s=2e-9, call_s=300e-6, forward_call_s=100e-6,
                      unfused_call_s=200e-6, unfused_forward_call_s=50e-6, chunk_s=90e-6)


def _g(x: float) -> str:
    return f"{x:.10g}"


def tt_sweep(kw: dict) -> tuple[dict[str, str], list[str]]:
    """Every TT plan of the grid at the planner keyword arguments ``kw``: the decisions (strategy and
    split, one line per layer) and every estimate (the candidates' and each chosen step's)."""
    planner.clear_plan_cache()
    decisions, values = {}, []

    def record(key: str, spec: TTSpec, p: planner.TTPlan) -> str:
        values.append(f"{key} " + " ".join(f"{n}={_g(t)}" for n, t in p.candidates)
                      + " | " + " ".join(_g(s.est_s) for s in p.steps))
        if spec.fmt != "btt":  # the merge orders follow from the split
            assert p.cut == planner.cut_at(spec, p.split), key
        return f"{TT_LETTER[p.strategy]}{p.split}"

    def sweep(key: str, spec: TTSpec, fn) -> None:
        decisions[key] = " ".join(record(f"{key} {n} {e} {g}", spec, fn(spec, n, e, cudagraphs=g, **kw))
                                  for n in TOKENS for e in (2, 4) for g in (False, True))

    for fmt, rows, cols, ranks in TT_LINEARS:
        sweep(f"linear {fmt} {rows} {cols} {ranks}", TTSpec(fmt, rows, cols, ranks, math.prod(rows), math.prod(cols)),
              planner.plan_linear)
    for fmt, rows, cols, ranks in TT_EMBEDDINGS:
        sweep(f"embedding {fmt} {rows} {cols} {ranks}",
              TTSpec(fmt, rows, cols, ranks, math.prod(rows), math.prod(cols)), planner.plan_embedding)
    for (b1, b2), (c, a), r in BTT:
        sweep(f"btt {(b1, b2)} {(c, a)} {r}", TTSpec("btt", (b1, b2), (c, a), (1, r, 1), b1 * b2, c * a),
              planner.plan_btt_linear)
    return decisions, values


def cce_sweep(gpu: dict, cpu: dict) -> tuple[dict[str, str], list[str]]:
    """The fused loss's decisions over the grid (one letter per shape of SHAPES, see LETTER; upper case
    where decide_fused_loss says fusing pays) at the keyword arguments ``gpu`` (the Triton paths) and
    ``cpu`` (the torch reference), and every estimate, slowdown and reason."""
    plan.reset_kept_fractions()
    decisions, values = {}, []
    for dev, kw in (("gpu", gpu), ("cpu", cpu)):
        for dname, dtype in DTYPES.items():
            for name, extra in CHOOSE.items():
                decisions[f"choose {dev} {dname} {name}"] = "".join(
                    LETTER[plan.choose_strategy(*s, dtype, **extra, **kw)] for s in SHAPES)
            for name, extra in DECIDE.items():
                out = []
                for s in SHAPES:
                    d = plan.decide_fused_loss(*s, dtype, **extra, **kw)
                    letter = LETTER[d.strategy]
                    out.append(letter.upper() if d.pays else letter)
                    values.append(f"decide {dev} {dname} {name} {s} {_g(d.slowdown)} {d.logits_bytes} {d.reason}")
                decisions[f"decide {dev} {dname} {name}"] = "".join(out)
            for s in SHAPES:
                for extra in ({}, dict(training=False), dict(upcast=True),
                              dict(kept_fraction=0.05, skipped_fraction=0.5)):
                    est = plan.estimate_seconds(*s, dtype, **extra, **kw)
                    values.append(f"estimate {dev} {dname} {s} {extra} "
                                  + " ".join(f"{k}={_g(v)}" for k, v in sorted(est.items())))
    for dname in ("float32", "bfloat16"):
        dtype, eps = DTYPES[dname], plan.default_filter_eps(DTYPES[dname])
        for planned in ("chunked", "static"):
            for seen, (kept, tiles, skipped) in SEEN.items():
                out = []
                for n, d, v in SHAPES:
                    plan.reset_kept_fractions()
                    plan.observe_kept_fraction(v, d, dtype, eps, kept, tiles, skipped)
                    out.append(LETTER[plan.runtime_strategy(planned, n, d, v, dtype, filter_eps=eps, **gpu)])
                decisions[f"runtime gpu {dname} {planned} {seen}"] = "".join(out)
    plan.reset_kept_fractions()
    return decisions, values


def digest(values: list[str]) -> str:
    return hashlib.sha256("\n".join(values).encode()).hexdigest()


def decisions_digest(decisions: dict[str, str]) -> str:
    return digest([f"{k}={v}" for k, v in decisions.items()])


# ----------------------------------------------------------------------------- recorded on the old code

# The tensor-train planner at the H200: strategy (TT_LETTER) and split of each plan, in tt_sweep's order (TOKENS,
# then 2- and 4-byte elements, then without and inside a CUDA graph).
TT_DECISIONS = {
    'linear tt (12, 8, 8) (8, 8, 12) (1, 12, 30, 30, 30, 12, 1)':
        'F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 D3 D3 F3 F3',
    'linear tt (12, 8, 8) (12, 16, 16) (1, 12, 30, 30, 30, 16, 1)':
        'F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3',
    'linear tt (4, 8) (8, 4) (1, 4, 32, 4, 1)': 'F2 F2 F2 F2 F2 F2 F2 F2 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2',
    'linear tt (16, 16, 16) (16, 16, 16) (1, 16, 32, 32, 32, 16, 1)':
        'F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3 F3',
    'linear tt (8, 16) (32, 8) (1, 8, 4, 8, 1)': 'F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 F2 D2 D2 F2 F2',
    'linear ttm (8, 8, 8, 8) (8, 8, 8, 8) (1, 16, 16, 16, 1)':
        'C2 C2 C2 C2 C2 C2 C2 C2 D2 D2 C2 C2 D2 D2 C2 C2 D2 D2 C2 C2',
    'linear ttm (8, 8, 12) (8, 8, 12) (1, 8, 8, 1)': 'D2 D2 D2 C1 D2 D2 D2 C1 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2 D2',
    'linear ttm (4, 4, 4) (4, 4, 4) (1, 4, 4, 1)': 'D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1',
    'linear ttm (16, 16, 16) (16, 16, 16) (1, 64, 64, 1)':
        'C1 C1 C1 C1 C1 C1 C1 C1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1',
    'embedding ttm (16, 20, 10, 10) (4, 4, 8, 6) (1, 32, 32, 32, 1)':
        'T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 D2 D2 D2 D2',
    'embedding tt (32, 40, 25) (8, 8, 12) (1, 16, 16, 16, 16, 16, 1)':
        'T2 T2 T2 T2 T2 T2 T2 T2 T4 T4 T4 T4 T4 T4 T4 T4 D2 D2 D2 D2',
    'embedding ttm (4, 4, 4) (4, 4, 4) (1, 4, 4, 1)': 'T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 T1 D1 D1 D1 D1 D1',
    'embedding ttm (50, 40, 64) (8, 8, 12) (1, 64, 64, 1)':
        'T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 T2 D2 D2 D2 D2',
    'btt (32, 32) (32, 32) 1': 'D1 D1 D1 B1 D1 D1 D1 B1 D1 D1 B1 B1 D1 D1 B1 B1 D1 D1 B1 B1',
    'btt (32, 32) (32, 32) 4': 'D1 D1 D1 B1 D1 D1 D1 B1 D1 D1 D1 B1 D1 D1 B1 B1 D1 D1 B1 B1',
    'btt (32, 32) (32, 32) 16': 'D1 D1 D1 B1 D1 D1 D1 B1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1',
    'btt (64, 64) (64, 64) 4': 'B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1 B1',
    'btt (32, 24) (32, 96) 8': 'D1 B1 B1 B1 D1 B1 B1 B1 D1 D1 B1 B1 D1 D1 B1 B1 D1 D1 B1 B1',
    'btt (8, 96) (8, 96) 2': 'D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 D1 B1 D1 D1 B1 B1 D1 D1 B1 B1',
}

# The fused loss's planner at the H200 ("gpu") and the CPU: one letter per shape of SHAPES (LETTER; upper case
# where decide_fused_loss says fusing pays).
CCE_DECISIONS = {
    'choose gpu float32 default':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccttffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'choose gpu float32 none':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float32 exact':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccttffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'choose gpu float32 capture':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float32 deterministic':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccttffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'choose gpu float32 lse_grad':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float32 kept0.01':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffcctsfccssffffffffffffffffccssfcsssfffff'
        'fffffffffffcsssccsss',
    'choose gpu float32 kept0.05':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccssffffffffffffffffccccfcsssfffff'
        'fffffffffffccccccsss',
    'choose gpu float32 kept0.2':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccttffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'choose gpu float32 kept0.6':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccttfccttffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'choose gpu float32 budget1G':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccccffffffffffffffffccccfccccfffff'
        'fffffffffffccccccccc',
    'decide gpu float32 train-memory':
        'fffffffffffffffffffffftttfffFFfffFFfffFFffcccffcccffFFFffFFFffFFFfccttfccttffFFFffFFFffFFFfccccfccccfFFFF'
        'fFFFFfFFFFfcCCCccCCC',
    'decide gpu float32 train-speed':
        'fffffffffffffffffffffftttfffFFfffFFfffFFffcccffcccffFFFffFFFffFFFfccttfccttffFFFffFFFffFFFfccccfccccfFFFF'
        'fFFFFfFFFFfcccCccccc',
    'decide gpu float32 train-upcast-memory':
        'fffffffffffffffffffffftttfffFFfffFFfffFFffcccffcccffFFFffFFFffFFFfccttfccttffFFFffFFFffFFFfccccfccccfFFFF'
        'fFFFFfFFFFfcCCCccCCC',
    'decide gpu float32 train-upcast-speed':
        'fffffffffffffffffffffftttfffFFfffFFfffFFffcccffcccffFFFffFFFffFFFfccttfccttffFFFffFFFffFFFfccccfccccfFFFF'
        'fFFFFfFFFFfcccCccccc',
    'decide gpu float32 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaAAaaaAAaaaAAaaaAAaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaAAAA'
        'aAAAAaAAAAaAAAAaaAAA',
    'decide gpu float32 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaAAaaaAAaaaAAaaaAAaaaaaaaAAAaaAAAaaAAAaaAAAaaaaaaaAAAaaAAAaaAAAaaAAAaaaaaaAAAA'
        'aAAAAaAAAAaAAAAaaaaa',
    'decide gpu float32 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaAAaaaAAaaaAAaaaAAaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaAAAA'
        'aAAAAaAAAAaAAAAaaAAA',
    'decide gpu float32 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaAAaaaAAaaaAAaaaAAaaaaaaaAAAaaAAAaaAAAaaAAAaaaaaaaAAAaaAAAaaAAAaaAAAaaaaaaAAAA'
        'aAAAAaAAAAaAAAAaaaaa',
    'choose gpu bfloat16 default':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffcccsfcccsffffffffffffffffcccsfcccsfffcc'
        'fffccfffccfcccsccccs',
    'choose gpu bfloat16 none':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttfffffffffffffffftttsftttsfffffffffffffffftttsftttsfffff'
        'ffffffffffftttsfttts',
    'choose gpu bfloat16 exact':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccccffffffffffffffffccccfccccfffcc'
        'fffccfffccfccccccccc',
    'choose gpu bfloat16 capture':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu bfloat16 deterministic':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccccffffffffffffffffccccfccccfffcc'
        'fffccfffccfccccccccc',
    'choose gpu bfloat16 lse_grad':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttfffffffffffffffftttsftttsfffffffffffffffftttsftttsfffff'
        'ffffffffffftttsfttts',
    'choose gpu bfloat16 kept0.01':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffcccsfccssffffffffffffffffccssfccssfffcc'
        'fffccfffccfcsssccsss',
    'choose gpu bfloat16 kept0.05':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccssffffffffffffffffccccfccssfffcc'
        'fffccfffccfccccccsss',
    'choose gpu bfloat16 kept0.2':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccccffffffffffffffffccccfccccfffcc'
        'fffccfffccfccccccccc',
    'choose gpu bfloat16 kept0.6':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffffffffffffffffccccfccccffffffffffffffffccccfccccfffcc'
        'fffccfffccfccccccccc',
    'choose gpu bfloat16 budget1G':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccfffccfffccfffccfccccfccccffcccffcccffcccfccccfcccsffccc'
        'ffcccffccffcccsccccs',
    'decide gpu bfloat16 train-memory':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffFFFffFFFffFFFfcCcsfcCcSffFFFffFFFffFFFfcCCSfcCCSffFCC'
        'ffFCCffFCCfcCCSccCCS',
    'decide gpu bfloat16 train-speed':
        'fffffffffffffffffffffftttfffffffffffffffffcccffcccffFFFffFFFffFFFfcccsfcccsffFFFffFFFffFFFfcccsfcccSffFCC'
        'ffFCCffFCCfcCCSccccS',
    'decide gpu bfloat16 train-upcast-memory':
        'fffffffffffffffffffffftttffffFffffFffffFffcccffcccffFFFffFFFffFFFfcCcsfcCcSffFFFffFFFffFFFfcCCSfcCCSffFCC'
        'ffFCCffFCCfcCCSccCCS',
    'decide gpu bfloat16 train-upcast-speed':
        'fffffffffffffffffffffftttffffFffffFffffFffcccffcccffFFFffFFFffFFFfcccsfcccsffFFFffFFFffFFFfccCSfcccSffFCC'
        'ffFCCffFCCfcCCSccCCS',
    'decide gpu bfloat16 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide gpu bfloat16 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaa'
        'aaaaaaaAAAaaAAAaaaaa',
    'decide gpu bfloat16 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide gpu bfloat16 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaa'
        'aaaaaaaAAAaaAAAaaaaa',
    'choose gpu float16 default':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 none':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 exact':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 capture':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 deterministic':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 lse_grad':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 kept0.01':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttfffffffffffffffftttsfttssffffffffffffffffttssftsssfffff'
        'ffffffffffftsssftsss',
    'choose gpu float16 kept0.05':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttssffffffffffffffffttssftsssfffff'
        'ffffffffffftsssftsss',
    'choose gpu float16 kept0.2':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttssfffff'
        'fffffffffffttttftsss',
    'choose gpu float16 kept0.6':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'choose gpu float16 budget1G':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffffffffffffffffttttfttttffffffffffffffffttttfttttfffff'
        'fffffffffffttttftttt',
    'decide gpu float16 train-memory':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffFFFffFFFffFFFfttttfttttffFFFffFFFffFFFfttttfttttffFFF'
        'ffFFFffFFFfttttftttt',
    'decide gpu float16 train-speed':
        'fffffffffffffffffffffftttffffffffffffffffftttfftttffFFFffFFFffFFFfttttfttttffFFFffFFFffFFFfttttfttttffFFF'
        'ffFFFffFFFfttttftttt',
    'decide gpu float16 train-upcast-memory':
        'fffffffffffffffffffffftttffffFffffFffffFfftttfftttffFFFffFFFffFFFfttttfttttffFFFffFFFffFFFfttttfttttffFFF'
        'ffFFFffFFFfttttftttt',
    'decide gpu float16 train-upcast-speed':
        'fffffffffffffffffffffftttffffFffffFffffFfftttfftttffFFFffFFFffFFFfttttfttttffFFFffFFFffFFFfttttfttttffFFF'
        'ffFFFffFFFfttttftttt',
    'decide gpu float16 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide gpu float16 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaa'
        'aaaaaaaAAAaaAAAaaaaa',
    'decide gpu float16 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide gpu float16 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaa'
        'aaaaaaaAAAaaAAAaaaaa',
    'choose cpu float32 default':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 none':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float32 exact':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 capture':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float32 deterministic':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 lse_grad':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float32 kept0.01':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 kept0.05':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 kept0.2':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 kept0.6':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu float32 budget1G':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu float32 train-memory':
        'cccccccccccccccccccccccccccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCcCCCCcCCCCcCCCCcCCCCcCCCCcCCCC'
        'cCCCCcCCCCcCCCCcCCCC',
    'decide cpu float32 train-speed':
        'cccccccccccccccccccccccccccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCccccccccCCCCcCCCCcCCCCcCCCCcCccccCCCC'
        'cCCCCcCCCCcCCCCcCCCC',
    'decide cpu float32 train-upcast-memory':
        'cccccccccccccccccccccccccccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCcCCCCcCCCCcCCCCcCCCCcCCCCcCCCC'
        'cCCCCcCCCCcCCCCcCCCC',
    'decide cpu float32 train-upcast-speed':
        'cccccccccccccccccccccccccccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCCCccCccccccccCCCCcCCCCcCCCCcCCCCcCccccCCCC'
        'cCCCCcCCCCcCCCCcCCCC',
    'decide cpu float32 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide cpu float32 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'decide cpu float32 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAAaaAAA'
        'aaAAAaaAAAaaAAAaaAAA',
    'decide cpu float32 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'choose cpu bfloat16 default':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 none':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu bfloat16 exact':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 capture':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu bfloat16 deterministic':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 lse_grad':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu bfloat16 kept0.01':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 kept0.05':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 kept0.2':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 kept0.6':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'choose cpu bfloat16 budget1G':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu bfloat16 train-memory':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu bfloat16 train-speed':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu bfloat16 train-upcast-memory':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu bfloat16 train-upcast-speed':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'decide cpu bfloat16 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'decide cpu bfloat16 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'decide cpu bfloat16 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'decide cpu bfloat16 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'choose cpu float16 default':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 none':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 exact':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 capture':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 deterministic':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 lse_grad':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 kept0.01':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 kept0.05':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 kept0.2':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 kept0.6':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'choose cpu float16 budget1G':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'decide cpu float16 train-memory':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'decide cpu float16 train-speed':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'decide cpu float16 train-upcast-memory':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'decide cpu float16 train-upcast-speed':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'decide cpu float16 infer-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaa'
        'aaaaaaaaaaaaAAAaaAAA',
    'decide cpu float16 infer-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'decide cpu float16 infer-upcast-memory':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaAAAaaAAAaaaaaaaaaaaaaaaaaAAAaaAAAaaaaa'
        'aaaaaaaaaaaaAAAaaAAA',
    'decide cpu float16 infer-upcast-speed':
        'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
        'aaaaaaaaaaaaaaaaaaaa',
    'runtime gpu float32 chunked k0.01':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccscccsscccsscccsscccsscccsscccssccsssccsss'
        'ccsssccsssccsssccsss',
    'runtime gpu float32 chunked k0.05-s0.6':
        'cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccscccssccccccccccccccccccccccsssccccc'
        'cccccccccccccccccsss',
    'runtime gpu float32 chunked k0.3-s0.9':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccscccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'runtime gpu float32 static k0.01':
        'tttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttstttsstttsstttsstttsstttssttsssttsss'
        'ttsssttsssttsssttsss',
    'runtime gpu float32 static k0.05-s0.6':
        'tttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttssttttttttttttttttttssttsssttttt'
        'ttttttttttttsssttsss',
    'runtime gpu float32 static k0.3-s0.9':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
    'runtime gpu bfloat16 chunked k0.01':
        'cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccscccssccccccccccccccccccsscccssccccc'
        'ccccccccccccsssccsss',
    'runtime gpu bfloat16 chunked k0.05-s0.6':
        'cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccsscccccccccccccccccccccccssccccc'
        'ccccccccccccccsccsss',
    'runtime gpu bfloat16 chunked k0.3-s0.9':
        'ccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc'
        'cccccccccccccccccccc',
    'runtime gpu bfloat16 static k0.01':
        'tttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttstttssttttsttttstttsstttssttssstttss'
        'tttssttsssttsssttsss',
    'runtime gpu bfloat16 static k0.05-s0.6':
        'tttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttssttttttttttttttttttssttsssttttt'
        'ttttttttttttsssttsss',
    'runtime gpu bfloat16 static k0.3-s0.9':
        'ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt'
        'tttttttttttttttttttt',
}

# sha256 of every estimate (10 significant digits), slowdown and reason of a sweep, in order; for the sweeps at
# CUSTOM_*, of their decisions too

DIGESTS = {
    'tt': '00a2e5cf76cc01235fe5b15880723ad08da7bc5ba8d0da3144f4750e4eb1955e',
    'cce': 'd8dbc6beadc530e51fe52431917957d4417f860cfa0f1feb213c9a34c9bde51e',
    'tt_custom': '914caa71b941e10ad18207798412d1bc43ea091825f1c88e6abd7912a7a6f810',
    'tt_custom_decisions': 'd5e71b3b3faa10e4be21ab32aeea9993e8beef06bb81f9294bf988853476c813',
    'cce_custom': '8c00454e3ce0d1f5b32b112fd35a5116f98e53f6a1eebd7305c3cac03dd5d3f8',
    'cce_custom_decisions': 'c759845626d522b5dd99935110f6031911c6154549ba7dc37bd7cac6e57d63ec',
}


def _old(module, name: str):
    """An old name, which warns."""
    with pytest.warns(DeprecationWarning, match=f"{name} is deprecated"):
        return getattr(module, name)


@pytest.fixture(autouse=True)
def _fresh_plans():
    planner.clear_plan_cache()
    plan.reset_kept_fractions()
    yield
    planner.clear_plan_cache()
    plan.reset_kept_fractions()


def _compare(got: tuple[dict[str, str], list[str]], decisions: dict[str, str], values_digest: str) -> None:
    found, values = got
    assert list(found) == list(decisions)
    changed = {k: (decisions[k], found[k]) for k in decisions if found[k] != decisions[k]}
    assert not changed, changed
    assert digest(values) == values_digest


@pytest.mark.parametrize("style", ["profiles", "defaults", "old names"])
def test_every_decision_and_estimate_is_the_old_ones(style):
    """The tensor-train planner over 19 layers x 5 token counts x 2 dtypes x CUDA graph or not, and the
    fused loss's choose_strategy / decide_fused_loss / estimate_seconds / runtime_strategy over 125 heads
    x 3 dtypes at the GPU's and the CPU's rates: the same decisions and estimates as before the move,
    through the profiles, the entry points' defaults and the old objects alike."""
    if style == "profiles":
        tt, gpu, cpu = {"profile": H200}, {"profile": H200}, {"profile": CPU}
    elif style == "defaults":
        tt, gpu, cpu = {}, {}, {"profile": profile_for("cpu")}
    else:
        tt, gpu, cpu = {"profile": _old(planner, "H200")}, {"rates": _old(plan, "H200")}, {"rates": _old(plan, "CPU")}
    _compare(tt_sweep(tt), TT_DECISIONS, DIGESTS["tt"])
    _compare(cce_sweep(gpu, cpu), CCE_DECISIONS, DIGESTS["cce"])
    if style == "old names":
        _compare(cce_sweep({"rates": plan.rates_for(True)}, {"rates": plan.rates_for(False)}), CCE_DECISIONS,
                 DIGESTS["cce"])
        with pytest.warns(DeprecationWarning, match="model= is deprecated"):
            _compare(tt_sweep({"model": _old(planner, "H200")}), TT_DECISIONS, DIGESTS["tt"])


@pytest.mark.parametrize("style", ["profiles", "old names"])
def test_other_calibrations_read_every_field_where_its_old_name_was(style):
    """Profiles with every tensor-train, Triton-path and reference field changed decide and estimate as
    the old objects with the same numbers did (recorded on the old code)."""
    if style == "profiles":
        tt, gpu, cpu = CUSTOM_TT, CUSTOM_GPU, CUSTOM_CPU
    else:
        tt = _old(planner, "DeviceModel")(**OLD_CUSTOM_TT)
        gpu, cpu = _old(plan, "DeviceRates")(**OLD_CUSTOM_GPU), _old(plan, "ReferenceRates")(**OLD_CUSTOM_CPU)
        assert (tt.profile, gpu.profile.calibrations(), cpu.profile.calibrations()) == (
            dataclasses.replace(CUSTOM_TT), CUSTOM_GPU.calibrations(), CUSTOM_CPU.calibrations())
    decisions, values = tt_sweep({"profile": tt})
    assert (decisions_digest(decisions), digest(values)) == (DIGESTS["tt_custom_decisions"], DIGESTS["tt_custom"])
    decisions, values = cce_sweep({"profile": gpu}, {"profile": cpu})
    assert (decisions_digest(decisions), digest(values)) == (DIGESTS["cce_custom_decisions"], DIGESTS["cce_custom"])


def test_the_numbers_are_the_old_ones_under_names_that_say_what_they_measured():
    assert (H200.tt_gemm_flops, H200.tt_fp32_gemm_flops, H200.tt_skinny_gemm_bandwidth, H200.btt_blocks_bandwidth,
            H200.tt_launch_s, H200.tt_graph_launch_s) == (600e12, 45e12, 1.5e12, 2.8e12, 8e-6, 3e-6)
    assert (H200.lm_head_gemm_flops, H200.cce_tile_flops, H200.cce_softmax_elems, H200.hbm_bandwidth,
            H200.cce_launch_s, H200.cce_sync_s, H200.sparse_round_s, H200.sparse_call_s, H200.forward_bounds_s) == (
        690e12, 560e12, 0.97e12, 4.3e12, 5e-6, 50e-6, 1.9e-3, 1.0e-3, 3.0e-3)
    assert CPU.calibrations() == dict(
        ref_fp32_gemm_flops=370e9, ref_bf16_gemm_flops=1000e9, ref_memory_bandwidth=40e9, ref_rows_s=2.4e-9,
        ref_rows_forward_s=1.5e-9, ref_inductor_ce_s=2.85e-9, ref_inductor_ce_forward_s=1.4e-9, ref_call_s=450e-6,
        ref_forward_call_s=170e-6, ref_inductor_call_s=120e-6, ref_inductor_forward_call_s=30e-6, ref_chunk_s=60e-6)
    assert (H200.kind, CPU.kind) == ("gpu", "cpu") and H200.has_tt_rates and not CPU.has_tt_rates


def test_the_old_names_are_views_of_the_profiles():
    """Each old object reads the profile's numbers under its old names and stands for the profile (the
    same plans, from the same cache entries); rates_for, which the op calls at run time, does not warn."""
    model, rates, ref = _old(planner, "H200"), _old(plan, "H200"), _old(plan, "CPU")
    assert (model.name, model.gemm_flops, model.fp32_flops, model.bandwidth, model.launch_s, model.graph_launch_s,
            model.block_bandwidth) == ("H200", 600e12, 45e12, 1.5e12, 8e-6, 3e-6, 2.8e12)
    assert model.for_blocks().bandwidth == 2.8e12 and model.copy_s(3e12) == 2.0
    assert (rates.gemm_flops, rates.tile_flops, rates.softmax_elems, rates.bandwidth, rates.launch_s, rates.sync_s,
            rates.sparse_round_s, rates.sparse_call_s, rates.bounds_s) == (
        690e12, 560e12, 0.97e12, 4.3e12, 5e-6, 50e-6, 1.9e-3, 1.0e-3, 3.0e-3)
    assert (ref.gemm_flops, ref.bf16_gemm_flops, ref.chunk_s) == (370e9, 1000e9, 60e-6)
    assert ref.gemm_s(740e9, torch.float32) == 2.0 and ref.gemm_s(1000e9, torch.bfloat16) == 1.0
    assert model.profile is H200 and rates.profile is H200 and ref.profile is CPU
    assert _old(plan, "DeviceRates")() == rates and _old(plan, "ReferenceRates")() == ref
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan.rates_for(True) is rates and plan.rates_for(False) is ref
    spec = TTSpec(*TT_LINEARS[0], 768, 768)
    with pytest.warns(DeprecationWarning, match="model= is deprecated"):
        assert planner.plan_linear(spec, 4096, model=model) is planner.plan_linear(spec, 4096)
    assert planner.plan_linear(spec, 4096, profile=model) is planner.plan_linear(spec, 4096, profile=H200)
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        planner.plan_linear(spec, 4096, profile=CUSTOM_TT, model=model)
    with pytest.raises(TypeError, match="not both"):
        plan.choose_strategy(8192, 4096, 128256, torch.bfloat16, profile=H200, rates=rates)
    with pytest.raises(TypeError, match="DeviceProfile"):
        plan.choose_strategy(8192, 4096, 128256, torch.bfloat16, profile="H200")


def test_profile_for_a_device():
    """Every CUDA device is priced as the H200 (the only GPU measured), anything else as the CPU, where
    the fused loss runs its torch reference; fused_loss_pays follows it."""
    assert profile_for("cuda") is H200 and profile_for(torch.device("cuda", 1)) is H200
    assert profile_for("cpu") is CPU and profile_for(torch.device("cpu")) is CPU and profile_for("mps") is CPU
    head = (2048, 512, 131072, torch.float32)
    for device_type in ("cuda", "cpu"):
        decision = plan.decide_fused_loss(*head, profile=profile_for(device_type))
        assert plan.fused_loss_pays(*head, device_type) == (decision.pays, decision.reason)
    assert set(plan.estimate_seconds(*head, profile=CPU)) == {"unfused", "chunked", "static"}
    assert {"sparse", "fused"} <= set(plan.estimate_seconds(*head, profile=H200))


def test_a_profile_has_what_its_planners_read():
    """A profile is checked when it is built (the fused loss's fields of its kind); the tensor-train
    planner refuses one without tensor-train rates (the CPU's: it plans at the H200's on every device)."""
    with pytest.raises(ValueError, match="kind"):
        DeviceProfile(name="tpu", kind="tpu")
    with pytest.raises(ValueError, match="lm_head_gemm_flops"):
        dataclasses.replace(H200, name="half", lm_head_gemm_flops=None)
    with pytest.raises(ValueError, match="ref_chunk_s"):
        dataclasses.replace(CPU, ref_chunk_s=None)
    with pytest.raises(ValueError, match="no tensor-train rates"):
        planner.plan_tt_linear(*TT_LINEARS[0], 4096, profile=CPU)
    faster = dataclasses.replace(H200, name="faster", tt_skinny_gemm_bandwidth=3e12)  # the bound of its products
    assert hash(faster) != hash(H200) and faster != H200
    slow = planner.plan_tt_linear(*TT_LINEARS[0], 32768)
    fast = planner.plan_tt_linear(*TT_LINEARS[0], 32768, profile=faster)
    assert fast is not slow and fast.est_s < slow.est_s


def test_devices_sits_at_the_bottom():
    """devices.py imports nothing from the package (both planners import it)."""
    tree = ast.parse(pathlib.Path(devices.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "typing"}, imported
