"""TT linear / TT embedding, forward + backward, bf16, on one GPU: ours against the peers, same run.

    PYTHONPATH=. python benchmarks/bench_tt.py [--quick] [--only linear|embedding] [--json out.json]

Linear variants: dense nn.Linear; torch.einsum over the cores (x first; eager and torch.compile'd);
CoMERA-style two-GEMM (build L and R, then (x L) R; for "ttm" the same two-half split as ours, in
einsum); ours (comera::tt_linear) eager and replayed from a CUDA graph.
Embedding variants: dense nn.Embedding; a naive TT-matrix lookup (gather every core slice per
lookup, contract the chain with einsum, autograd); ours (with and without index de-duplication,
and from a CUDA graph, where de-duplication is off).
Times are medians of ``triton.testing.do_bench``; "+MiB" is peak memory above inputs/parameters;
"x floor" is time over max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s) of that layer (see --help text
in the table header). Correctness (bf16 vs an fp32 dense reference) is checked first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import comera_compile  # noqa: F401  (maps comera_compile.kernels in a source checkout)
from comera_compile.kernels.tt_embedding import tt_embedding, use_dedup
from comera_compile.kernels.tt_linear import tt_linear
from comera_compile.planner import plan_tt_embedding, plan_tt_linear
from comera_compile.tt import materialize as tt_reference_materialize, spec_from_cores

PEAK_FLOPS, PEAK_BYTES = 790e12, 4.3e12
COMPILED = []  # torch.compile'd einsum variants, timed last (compilation is slow), while time allows
DEV = "cuda"
DT = torch.bfloat16

LINEAR_SHAPES = [
    # name, fmt, row_modes, col_modes, ranks, tokens
    ("768x768 tt r30", "tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1), 4096),
    ("768x768 tt r30", "tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1), 32768),
    ("768->3072 tt r30", "tt", (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1), 4096),
    ("768->3072 tt r30", "tt", (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1), 32768),
    ("4096x4096 ttm r16", "ttm", (8, 8, 8, 8), (8, 8, 8, 8), (1, 16, 16, 16, 1), 8192),
    ("4096x4096 ttm r32", "ttm", (8, 8, 8, 8), (8, 8, 8, 8), (1, 32, 32, 32, 1), 8192),
]
EMB_SHAPES = [
    ("32000x768 ttm r32", "ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1), 32000, 768, 8192),
    ("10Mx64 ttm r32", "ttm", (40, 50, 50, 100), (4, 4, 2, 2), (1, 32, 32, 32, 1), 10_000_000, 64, 65536),
]


def make_cores(fmt, rm, cm, ranks, target_std, seed=0):
    """CoMERA's init: randn/sqrt(r_k) * target^(1/order); gates start at 1."""
    dtype, device = DT, DEV
    g = torch.Generator(device="cpu").manual_seed(seed)
    d = len(ranks) - 1
    ns = list(rm) + list(cm)
    cores = []
    for k in range(d):
        shape = (ranks[k], ns[k], ranks[k + 1]) if fmt == "tt" else (ranks[k], rm[k], cm[k], ranks[k + 1])
        c = torch.randn(shape, generator=g) / math.sqrt(ranks[k + 1]) * target_std ** (1.0 / d)
        cores.append(c.to(device=device, dtype=dtype).requires_grad_())
    gates = [torch.ones(ranks[k + 1], device=device, dtype=dtype, requires_grad=True) for k in range(d - 1)]
    return cores, gates


def materialize(cores, gates, fmt, rm, cm):
    """The padded dense matrix, through the package's reference contraction (not the op under test)."""
    spec = spec_from_cores(cores, fmt, rm, cm, math.prod(rm), math.prod(cm), False)
    return tt_reference_materialize(cores, gates, spec)


def einsum_eq(fmt, rm, cm):
    d = len(rm) + len(cm) if fmt == "tt" else len(rm)
    rows = "abcdefghijklm"[: len(rm)]
    cols = "opqrstuvwxyz"[: len(cm)]
    rk = "ABCDEFGHIJ"
    terms = []
    for k in range(d):
        left = rk[k - 1] if k else "Z"
        right = rk[k] if k < d - 1 else "Y"
        if fmt == "tt":
            mode = rows[k] if k < len(rm) else cols[k - len(rm)]
            terms.append(left + mode + right)
        else:
            terms.append(left + rows[k] + cols[k] + right)
    return "n" + rows + "," + ",".join(terms) + "->n" + cols


def chain(cs):
    """Contract a list of cores along their bonds, left to right."""
    out = cs[0]
    for c in cs[1:]:
        out = torch.tensordot(out, c, dims=([out.dim() - 1], [0]))
    return out


def gated(cores, gates):
    return [cores[k] * gates[k] if k < len(gates) else cores[k] for k in range(len(cores))]


def bench(fn, warmup=10, rep=50):
    if DEV == "cpu":  # smoke mode: run once
        fn()
        return float("nan")
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_extra_mib(fn):
    if DEV == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def fresh(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def cuda_graph(step):
    """Capture ``step`` (forward + backward into static buffers) in a CUDA graph; returns replay.
    ``step`` must use leaves that no live autograd graph on another stream refers to."""
    if DEV == "cpu":
        raise RuntimeError("no CUDA graphs on CPU")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- linear


def run_linear(name, fmt, rm, cm, ranks, n, quick, rows_out):
    I, O = math.prod(rm), math.prod(cm)
    cores, gates = make_cores(fmt, rm, cm, ranks, math.sqrt(1.0 / (I + O)))
    params = cores + gates
    x = (torch.randn(n, I, device=DEV) ).to(DT).requires_grad_()
    dy = torch.randn(n, O, device=DEV, dtype=DT)
    plan = plan_tt_linear(fmt, rm, cm, ranks, n, 2)

    # correctness: ours (bf16) against an fp32 dense reference
    y = tt_linear(x, cores, gates, None, fmt, rm, cm, I, O)
    grads = torch.autograd.grad(y, [x] + params, dy)
    x32 = x.detach().float().requires_grad_()
    p32 = [p.detach().float().requires_grad_() for p in params]
    yr = x32 @ materialize(p32[: len(cores)], p32[len(cores):], fmt, rm, cm)
    gr = torch.autograd.grad(yr, [x32] + p32, dy.float())
    err = max([rel(y, yr)] + [rel(a, b) for a, b in zip(grads, gr)])

    dense = torch.nn.Linear(I, O, bias=False, device=DEV, dtype=DT)
    eq = einsum_eq(fmt, rm, cm)
    xv_shape = (n, *rm)

    def f_dense():
        return torch.autograd.grad(dense(x), [x, dense.weight], dy)

    def einsum_fwd(x, cores, gates):
        return torch.einsum(eq, x.view(xv_shape), *gated(cores, gates)).reshape(n, O)

    def f_einsum():
        return torch.autograd.grad(einsum_fwd(x, cores, gates), [x] + params, dy)

    compiled = torch.compile(einsum_fwd)

    def f_einsum_c():
        return torch.autograd.grad(compiled(x, cores, gates), [x] + params, dy)

    split = plan.split or (len(rm) if fmt == "tt" else len(rm) // 2)
    if fmt == "ttm":
        split = len(rm) // 2

    def two_gemm_fwd(x, cores, gates):
        gc = gated(cores, gates)
        left = chain([gc[0].squeeze(0)] + gc[1:split])
        right = chain(gc[split:])
        if fmt == "tt":
            return (x @ left.reshape(I, -1)) @ right.reshape(-1, O)
        A, B = left, right.squeeze(-1)
        h = split
        # A [m1 n1 m2 n2 ... r], B [r m n ...]; contract like ours: (x·A)·B
        a_rows = "abcdefgh"[:h]
        a_cols = "opqrstuv"[:h]
        b_rows = "ijklm"[: len(rm) - h]
        b_cols = "wxyzs"[: len(cm) - h]
        a_idx = "".join(r + c for r, c in zip(a_rows, a_cols)) + "R"
        b_idx = "R" + "".join(r + c for r, c in zip(b_rows, b_cols))
        t = torch.einsum(f"n{a_rows}{b_rows},{a_idx}->n{a_cols}{b_rows}R", x.view(xv_shape), A)
        return torch.einsum(f"n{a_cols}{b_rows}R,{b_idx}->n{a_cols}{b_cols}", t, B).reshape(n, O)

    def f_two():
        return torch.autograd.grad(two_gemm_fwd(x, cores, gates), [x] + params, dy)

    def f_ours():
        return torch.autograd.grad(tt_linear(x, cores, gates, None, fmt, rm, cm, I, O), [x] + params, dy)

    with torch.no_grad():
        base_err = {"einsum": rel(einsum_fwd(x, cores, gates), yr), "two": rel(two_gemm_fwd(x, cores, gates), yr)}
    print(f"  baseline forward rel err vs fp32 reference: {base_err}", flush=True)
    variants = [("dense nn.Linear", f_dense), ("einsum eager", f_einsum),
                ("CoMERA two-GEMM" if fmt == "tt" else "two-half einsum", f_two), ("ours", f_ours)]
    if not quick:
        COMPILED.append((name, n, f_einsum_c, rows_out))
    res = {}
    for vname, fn in variants:
        try:
            fn()
            mem = peak_extra_mib(fn)
            ms = bench(fn)
            res[vname] = (ms, mem)
        except Exception as e:  # report, keep going
            res[vname] = (float("nan"), float("nan"))
            print(f"  {vname} failed: {type(e).__name__}: {str(e)[:200]}")
    del y, grads, yr, gr
    xg, *pg = fresh(x, *params)
    dg = fresh(dense.weight)[0]

    def g_ours():
        return torch.autograd.grad(tt_linear(xg, pg[: len(cores)], pg[len(cores):], None, fmt, rm, cm, I, O),
                                   [xg] + pg, dy)

    def g_dense():
        return torch.autograd.grad(F.linear(xg, dg), [xg, dg], dy)

    for vname, fn in (("dense (CUDA graph)", g_dense), ("ours (CUDA graph)", g_ours)):
        try:
            res[vname] = (bench(cuda_graph(fn)), float("nan"))
        except Exception as e:
            print(f"  {vname} failed: {type(e).__name__}: {str(e)[:300]}")

    act_bytes = 2 * n * (2 * I + 2 * O)  # x, dy read; y, dx written
    floor_tt = max(plan.flops / PEAK_FLOPS, act_bytes / PEAK_BYTES) * 1e3
    floor_dense = max(6 * n * I * O / PEAK_FLOPS, (act_bytes + 4 * I * O) / PEAK_BYTES) * 1e3
    dense_ms = res.get("dense nn.Linear", (float("nan"),))[0]
    for vname, (ms, mem) in res.items():
        floor = floor_dense if vname.startswith("dense") else floor_tt
        rows_out.append(dict(kind="linear", shape=name, tokens=n, variant=vname, ms=ms, extra_mib=mem,
                             x_floor=ms / floor, speedup_vs_dense=dense_ms / ms, rel_err=err,
                             plan=plan.strategy))
    print(f"{name} N={n}: plan {plan.strategy}{' fused' if plan.fused else ''}; max rel err (bf16 vs fp32 ref) "
          f"{err:.2e}; floors: TT {floor_tt * 1e3:.1f} us, dense {floor_dense * 1e3:.1f} us", flush=True)
    for vname, (ms, mem) in res.items():
        print(f"   {vname:<20} {ms * 1e3:9.1f} us  +{mem:8.1f} MiB   {dense_ms / ms:5.2f}x vs dense", flush=True)


# ----------------------------------------------------------------------------- embedding


def run_embedding(name, fmt, rm, cm, ranks, V, D, n, quick, rows_out):
    cores, gates = make_cores(fmt, rm, cm, ranks, 1.0)
    params = cores + gates
    idx = torch.randint(0, V, (n,), device=DEV)
    dy = torch.randn(n, D, device=DEV, dtype=DT)
    plan = plan_tt_embedding(fmt, rm, cm, ranks, n, 2)

    y = tt_embedding(idx, cores, gates, fmt, rm, cm, V, D)
    grads = torch.autograd.grad(y, params, dy)
    err = float("nan")
    if V * D <= 64e6:
        p32 = [p.detach().float().requires_grad_() for p in params]
        yr = F.embedding(idx, materialize(p32[: len(cores)], p32[len(cores):], fmt, rm, cm)[:V, :D])
        gr = torch.autograd.grad(yr, p32, dy.float())
        err = max([rel(y, yr)] + [rel(a, b) for a, b in zip(grads, gr)])
        del yr, gr
    else:  # check a sample of rows against the naive lookup in fp32
        p32 = [p.detach().float() for p in params]
        yr = naive_lookup(idx[:512], p32[: len(cores)], p32[len(cores):], rm, cm, D)
        err = rel(y[:512], yr)

    emb = torch.nn.Embedding(V, D, device=DEV, dtype=DT)

    def f_dense():
        return torch.autograd.grad(emb(idx), [emb.weight], dy)

    def f_naive():
        return torch.autograd.grad(naive_lookup(idx, cores, gates, rm, cm, D), params, dy)

    def f_ours():
        return torch.autograd.grad(tt_embedding(idx, cores, gates, fmt, rm, cm, V, D), params, dy)

    def f_ours_nodedup():
        with use_dedup(False):
            return f_ours()

    res = {}
    for vname, fn in [("dense nn.Embedding", f_dense), ("naive TT lookup", f_naive), ("ours", f_ours),
                      ("ours (no dedup)", f_ours_nodedup)]:
        try:
            fn()
            mem = peak_extra_mib(fn)
            res[vname] = (bench(fn), mem)
        except Exception as e:
            res[vname] = (float("nan"), float("nan"))
            print(f"  {vname} failed: {type(e).__name__}: {str(e)[:200]}")
    del y, grads
    pg = fresh(*params)
    wg = fresh(emb.weight)[0]

    def g_ours():
        return torch.autograd.grad(tt_embedding(idx, pg[: len(cores)], pg[len(cores):], fmt, rm, cm, V, D), pg, dy)

    def g_dense():
        return torch.autograd.grad(F.embedding(idx, wg), [wg], dy)

    for vname, fn in (("dense (CUDA graph)", g_dense), ("ours (CUDA graph)", g_ours)):
        try:
            res[vname] = (bench(cuda_graph(fn)), float("nan"))
        except Exception as e:
            print(f"  {vname} failed: {type(e).__name__}: {str(e)[:300]}")
    tt_params = sum(p.numel() for p in params)
    dense_bytes = V * D * 2
    ratio = V * D / tt_params
    floor = max(plan.flops / PEAK_FLOPS, (n * D * 2 * 2 + n * 8) / PEAK_BYTES) * 1e3
    dense_ms = res["dense nn.Embedding"][0]
    naive_ms = res["naive TT lookup"][0]
    print(f"{name} lookups={n}: plan {plan.strategy}; rel err {err:.2e}; weight {dense_bytes / 2**20:.1f} MiB dense vs "
          f"{tt_params * 2 / 2**20:.3f} MiB TT ({ratio:.0f}x less); floor {floor * 1e3:.1f} us", flush=True)
    for vname, (ms, mem) in res.items():
        rows_out.append(dict(kind="embedding", shape=name, tokens=n, variant=vname, ms=ms, extra_mib=mem,
                             x_floor=ms / floor, vs_dense=ms / dense_ms, speedup_vs_naive=naive_ms / ms, rel_err=err,
                             compression=ratio, plan=plan.strategy))
        print(f"   {vname:<20} {ms * 1e3:9.1f} us  +{mem:8.1f} MiB  {ms / dense_ms:5.2f}x dense time  "
              f"{naive_ms / ms:6.2f}x faster than naive", flush=True)


def naive_lookup(idx, cores, gates, rm, cm, D):
    """Gather every core's slice for each lookup and contract the chain (autograd does the rest)."""
    digits = []
    rest = idx
    for m in reversed(rm):
        digits.append(rest % m)
        rest = rest // m
    digits = digits[::-1]
    gc = gated(cores, gates)
    cur = gc[0][0, digits[0]]  # [n, n1, r1]
    for k in range(1, len(gc)):
        s = gc[k].permute(1, 0, 2, 3)[digits[k]]  # [n, r, n_k, r']
        cur = torch.einsum("uar,urbs->uabs", cur, s).reshape(idx.numel(), -1, s.shape[-1])
    return cur.reshape(idx.numel(), -1)[:, :D]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["linear", "embedding"])
    ap.add_argument("--json")
    ap.add_argument("--compile-budget-s", type=float, default=120.0)
    ap.add_argument("--fmt", choices=["tt", "ttm"], help="only linear shapes of this format")
    args = ap.parse_args()
    torch.manual_seed(0)
    global DEV, DT, LINEAR_SHAPES, EMB_SHAPES
    if not torch.cuda.is_available():  # CPU smoke test of the script itself: tiny shapes, no timing
        DEV, DT = "cpu", torch.float32
        LINEAR_SHAPES = [("smoke tt", "tt", (3, 4), (4, 3), (1, 3, 5, 3, 1), 64),
                         ("smoke ttm", "ttm", (2, 3, 2), (2, 2, 3), (1, 3, 4, 1), 64)]
        EMB_SHAPES = [("smoke emb", "ttm", (4, 5, 3), (2, 3, 2), (1, 4, 5, 1), 50, 11, 64)]
    print(torch.__version__, torch.cuda.get_device_name() if DEV == "cuda" else "cpu", flush=True)
    rows = []
    if args.only != "embedding":
        shapes = [LINEAR_SHAPES[0], LINEAR_SHAPES[4]] if args.quick else LINEAR_SHAPES
        for shape in [sh for sh in shapes if args.fmt in (None, sh[1])]:
            run_linear(*shape, args.quick, rows)
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    if args.only != "linear":
        for shape in (EMB_SHAPES[:1] if args.quick else EMB_SHAPES):
            run_embedding(*shape, args.quick, rows)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    import time

    t0 = time.time()
    for name, n, fn, _ in COMPILED:
        if time.time() - t0 > args.compile_budget_s:
            print(f"einsum compiled {name} N={n}: skipped (compile budget spent)", flush=True)
            continue
        try:
            fn()
            mem = peak_extra_mib(fn)
            ms = bench(fn)
            dense_ms = next(r["ms"] for r in rows if r["shape"] == name and r["tokens"] == n
                            and r["variant"] == "dense nn.Linear")
            rows.append(dict(kind="linear", shape=name, tokens=n, variant="einsum compiled", ms=ms, extra_mib=mem,
                             speedup_vs_dense=dense_ms / ms))
            print(f"einsum compiled {name} N={n}: {ms * 1e3:9.1f} us +{mem:8.1f} MiB {dense_ms / ms:5.2f}x vs dense",
                  flush=True)
        except Exception as e:
            print(f"einsum compiled {name} N={n} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch._dynamo.reset()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
