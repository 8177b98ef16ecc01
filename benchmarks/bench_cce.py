"""Linear + cross-entropy (the LM-head loss), forward + backward, bf16, on one GPU.

Measures, in the same run: eager PyTorch (F.linear + F.cross_entropy on .float() logits),
torch.compile of that, cut-cross-entropy (PyPI `cut_cross_entropy`), Liger's fused linear
cross-entropy (PyPI `liger-kernel`) and ours (`comera::linear_cross_entropy`, filtered and exact).

For each shape and input case it reports the median time (triton.testing.do_bench), the time as a
multiple of the 3-GEMM floor, the extra peak memory (peak during one fwd+bwd minus what was
allocated before it, minus the two gradients that every method returns) and the relative error of
loss, dx and dW against a float64 reference.

Input cases:
* ``random``: x ~ N(0, 1), W ~ N(0, 1/D): logits ~ N(0, 1), a flat softmax.
* ``peaked``: a learned-like softmax: a Zipf unigram prior in one hidden direction, targets drawn
  from that prior, hidden states pointing at their target's row (boost 8 nats) plus noise.

Run from the repo root:  PYTHONPATH=. python benchmarks/bench_cce.py [--shapes gemma,llama]
Full results go to $OUT/bench_cce.json (or ./bench_cce.json) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

SHAPES = {"gemma": (8192, 2304, 256000), "llama": (8192, 4096, 128256)}
GEMM_TFLOPS = 790.0  # measured bf16 rate on the H200 (ANCHORS.md)


def make_inputs(case: str, N: int, D: int, V: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    if case == "random":
        x = torch.randn(N, D, device=dev, generator=g)
        w = torch.randn(V, D, device=dev, generator=g) / D**0.5
        t = torch.randint(0, V, (N,), device=dev, generator=g)
    elif case == "peaked":
        rank = torch.arange(V, device=dev, dtype=torch.float32)
        logf = -1.1 * torch.log(rank + 10.0)
        logf = logf - torch.logsumexp(logf, 0)
        perm = torch.randperm(V, device=dev, generator=g)  # frequent ids are spread over the vocab
        logf = logf[perm]
        t = torch.multinomial(logf.exp(), N, replacement=True, generator=g)
        r = torch.randn(V, D, device=dev, generator=g) / D**0.5
        w = r.clone()
        w[:, 0] = logf - logf.mean()
        x = 8.0 * r[t] + torch.randn(N, D, device=dev, generator=g) / D**0.5
        x[:, 0] = 1.0
    else:
        raise ValueError(case)
    return x.to(dt).contiguous(), w.to(dt).contiguous(), t


def reference(x, w, t, chunk=1024):
    """float64 loss (mean) and gradients, chunk by chunk."""
    N = x.shape[0]
    w64 = w.double()
    dx = torch.empty(x.shape, device=x.device, dtype=torch.float64)
    dw = torch.zeros(w.shape, device=x.device, dtype=torch.float64)
    total = torch.zeros((), device=x.device, dtype=torch.float64)
    for i in range(0, N, chunk):
        xc = x[i:i + chunk].double()
        z = xc @ w64.T
        lse = torch.logsumexp(z, 1)
        tc = t[i:i + chunk]
        total += (lse - z.gather(1, tc[:, None])[:, 0]).sum()
        gz = torch.softmax(z, 1)
        gz[torch.arange(len(tc), device=x.device), tc] -= 1.0
        gz /= N
        dx[i:i + chunk] = gz @ w64
        dw += gz.T @ xc
        del z, gz
    return total / N, dx, dw


def rel(a, b):
    a = a.double()
    return float((a - b).norm() / b.norm())


def methods(which):
    out = {}

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    if "eager" in which:
        out["eager"] = eager
    if "compile" in which:
        out["torch.compile"] = torch.compile(eager, dynamic=False)
    if "cce" in which:
        try:
            from cut_cross_entropy import linear_cross_entropy as cce

            out["cut-cross-entropy"] = lambda x, w, t: cce(x, w, t)
        except Exception as e:  # noqa: BLE001
            print("cut-cross-entropy unavailable:", e)
    if "liger" in which:
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import (
                LigerFusedLinearCrossEntropyLoss,
            )

            lf = LigerFusedLinearCrossEntropyLoss()
            out["liger"] = lambda x, w, t: lf(w, x, t)
        except Exception as e:  # noqa: BLE001
            print("liger unavailable:", e)
    from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy as ours

    if "ours" in which:
        out["ours (filtered)"] = lambda x, w, t: ours(x, w, t)
        out["ours (exact)"] = lambda x, w, t: ours(x, w, t, backward="exact")
    if "oursf" in which:
        out["ours (filtered)"] = lambda x, w, t: ours(x, w, t)
    if "det" in which:
        out["ours (filtered, deterministic)"] = lambda x, w, t: ours(x, w, t, deterministic=True)
    return out


def run_one(name, fn, x, w, t, ref, floor_ms, rep_ms):
    from triton.testing import do_bench

    from comera_compile.kernels import linear_cross_entropy as lce_mod

    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()

    def step():
        loss = fn(xr, wr, t)
        return (loss,) + torch.autograd.grad(loss, (xr, wr))

    res = {"method": name}
    t0 = time.time()
    loss, gx, gw = step()  # warm-up / compile
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.time() - t0, 2)
    res["loss"] = float(loss)
    res["err_loss"] = abs(float(loss) - float(ref[0])) / abs(float(ref[0]))
    res["err_dx"] = rel(gx, ref[1])
    res["err_dw"] = rel(gw, ref[2])
    stats = getattr(lce_mod, "_LAST_STATS", None)
    if name.startswith("ours") and stats:
        res["stats"] = {k: (v if isinstance(v, (int, float)) else float(v)) for k, v in stats.items()}
        if lce_mod._SPARSE_BROKEN:
            res["sparse_broken"] = lce_mod._SPARSE_BROKEN[0]
    del loss, gx, gw
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    grads_bytes = out[1].numel() * out[1].element_size() + out[2].numel() * out[2].element_size()
    res["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads_bytes) / 2**20
    del out
    ms = do_bench(step, warmup=max(100, rep_ms // 4), rep=rep_ms, return_mode="median")
    if name.startswith("ours"):
        with torch.no_grad():
            res["fwd_ms"] = do_bench(lambda: fn(x, w, t), warmup=50, rep=max(100, rep_ms // 4),
                                     return_mode="median")
    res["ms"] = ms
    res["x_floor"] = ms / floor_ms
    return res


def _set_tuning(spec):
    from comera_compile.kernels import linear_cross_entropy as lce_mod

    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=")
        cur = getattr(lce_mod._TUNING, k)
        setattr(lce_mod._TUNING, k, type(cur)(v))


def fwd_sweep(x, w, t, specs, flops):
    import dataclasses

    from triton.testing import do_bench

    from comera_compile.kernels import linear_cross_entropy as lce_mod

    saved = dataclasses.replace(lce_mod._TUNING)
    ms = do_bench(lambda: lce_mod._triton_forward(x, w, t, None, 0.0, 0.0), warmup=50, rep=200,
                  return_mode="median")
    print(f"fwd raw kernel+combine: {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    for spec in specs.split(";"):
        _set_tuning(spec)
        try:
            with torch.no_grad():
                lce_mod.linear_cross_entropy(x, w, t)
                ms = do_bench(lambda: lce_mod.linear_cross_entropy(x, w, t), warmup=50, rep=200,
                              return_mode="median")
            print(f"fwd-sweep {spec}: {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"fwd-sweep {spec}: error {type(e).__name__}: {str(e)[:200]}", flush=True)
        lce_mod._TUNING = dataclasses.replace(saved)


def profile(fns, x, w, t):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for name, fn in fns.items():
        if not name.startswith("ours"):
            continue
        xr = x.detach().requires_grad_()
        wr = w.detach().requires_grad_()
        for _ in range(2):
            torch.autograd.grad(fn(xr, wr, t), (xr, wr))
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(fn(xr, wr, t), (xr, wr))
            torch.cuda.synchronize()
        print(f"-- profile {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60),
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma,llama")
    ap.add_argument("--cases", default="random,peaked")
    ap.add_argument("--methods", default="eager,compile,cce,liger,ours")
    ap.add_argument("--rep-ms", type=int, default=1000)
    ap.add_argument("--tuning", default="", help="k=v,... overrides of _TUNING for ours")
    ap.add_argument("--profile", action="store_true", help="kernel breakdown of ours (profiler)")
    ap.add_argument("--data-independent-once", action="store_true",
                    help="time eager, torch.compile and Liger (data-independent) on the first case only")
    ap.add_argument("--fwd-sweep", default="", help="tunings separated by ';' to time ours' forward")
    args = ap.parse_args()

    from comera_compile.kernels import linear_cross_entropy as lce_mod

    _set_tuning(args.tuning)
    print("torch", torch.__version__, "| device", torch.cuda.get_device_name(), "| tuning",
          lce_mod._TUNING, flush=True)
    outdir = os.environ.get("OUT", ".")
    fns = methods(args.methods.split(","))
    results = []
    for shape in args.shapes.split(","):
        N, D, V = SHAPES[shape]
        floor_ms = 3 * 2 * N * D * V / (GEMM_TFLOPS * 1e12) * 1e3
        for case in args.cases.split(","):
            x, w, t = make_inputs(case, N, D, V)
            ref = reference(x, w, t)
            print(f"== {shape} (N,D,V)=({N},{D},{V}) case={case} ref loss={float(ref[0]):.4f} "
                  f"floor={floor_ms:.1f} ms", flush=True)
            if args.fwd_sweep and not results:
                fwd_sweep(x, w, t, args.fwd_sweep, 2 * N * D * V)
            if args.profile:
                profile(fns, x, w, t)
            for name, fn in fns.items():
                if (args.data_independent_once and case != args.cases.split(",")[0]
                        and name in ("eager", "torch.compile", "liger")):
                    continue
                try:
                    r = run_one(name, fn, x, w, t, ref, floor_ms, args.rep_ms)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    r = {"method": name, "error": f"{type(e).__name__}: {e}"[:300]}
                r.update(shape=shape, case=case, N=N, D=D, V=V)
                results.append(r)
                print(json.dumps(r), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
            del x, w, t, ref
            gc.collect()
            torch.cuda.empty_cache()
    with open(os.path.join(outdir, "bench_cce.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n| shape | case | method | ms | x floor | extra MiB | err loss | err dx | err dW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['shape']} | {r['case']} | {r['method']} | error: {r['error'][:60]} |")
            continue
        print(f"| {r['shape']} | {r['case']} | {r['method']} | {r['ms']:.1f} | {r['x_floor']:.2f} | "
              f"{r['extra_mib']:.1f} | {r['err_loss']:.1e} | {r['err_dx']:.1e} | {r['err_dw']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
