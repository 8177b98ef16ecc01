"""Linear + cross-entropy (the LM-head loss), forward + backward, bf16, on one GPU.

Measures, in the same run: eager PyTorch (F.linear + F.cross_entropy on .float() logits),
torch.compile of that, cut-cross-entropy (PyPI ``cut-cross-entropy``), Liger's fused linear
cross-entropy (PyPI ``liger-kernel``, called as ``loss_fn(weight, input, target)``) and every path
of ours (``comera::linear_cross_entropy``): the default (``auto``, the cost model's choice; a
sparse choice runs its rounds in the forward, which skip the tiles the forward's logit bounds rule
out; the forward computes the bounds while the fraction they were seen to rule out is at least
``CCETuning.bounds_min_skip``), ``auto-nobounds`` (the same with ``CCETuning.forward_bounds=False``: a sparse choice's rounds
in the backward, every tile recomputed), ``sparse`` (filtered, pinned: rounds in the backward), ``static`` (exact recompute), ``chunked`` (exact, gradient in the forward)
at two memory budgets, ``fused`` (small D only), and the default and ``static`` replayed as a CUDA
graph (inside capture the default never takes the sparse path).

``auto`` prices the sparse path at the kept fraction observed on previous calls of the same shape
class (``kept_fractions()``), probing it when there is none: the observations are reset for each
shape and input case (another "model"), and the ``auto`` rows run ``--auto-warmup`` steps (default
3) before the recorded step, so that the recorded and timed steps take the path chosen from the
observation of this case (the row's ``paths``, ``auto_chose`` and ``kept_fraction`` say which, and
what was observed). A run of ``auto`` that does not take the sparse path probes it once in
``CCETuning.probe_every`` (50) calls, inside the timing too (the median is what is reported).

Shapes: Gemma-2 2B (8192, 2304, 256000), Llama-3 8B (8192, 4096, 128256), the dense head of the
Llama-style LM of bench_e2e.py (8192, 1024, 128256) and its tensor-train head at rank 32: the loss
over the rank activations x [8192, 32] and the factor R^T, a strided [128256, 32] view of R [32, V]
(the peers get a contiguous copy).

For each shape and input case it reports the median time (``triton.testing.do_bench``), the time as
a multiple of the floor (FLOPs of 3 GEMMs at 790 TFLOP/s, or bytes at 4.3 TB/s), the extra peak
memory (peak during one fwd+bwd minus what was allocated before it, minus the two gradients every
method returns) and the relative error against a float64 reference on a slice: the mean loss over
all rows, dx over the first rows, dW over the first vocabulary columns.

Input cases:
* ``random``: x ~ N(0, 1), W ~ N(0, 1/D): logits ~ N(0, 1), a flat softmax.
* ``peaked``: a learned-like softmax: a Zipf unigram prior in one hidden direction, targets drawn
  from that prior, hidden states pointing at their target's row (boost 8 nats) plus noise.
* ``peaked-mid``, ``peaked-flat``: the same with a boost of 4 and 2 nats: flatter learned-like
  softmaxes, where the filtered paths skip fewer tiles (``auto`` must not be slower than exact there).

Run from the repo root (peers from wheels carried in .whl/):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_cce.py
``--smoke`` runs tiny shapes on the CPU (Triton interpreter) to check the script.
Results go to $OUT/bench_cce.json (or ./bench_cce.json) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # read when the kernels are decorated: before importing them
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAPES = {"gemma": (8192, 2304, 256000), "llama": (8192, 4096, 128256),
          "lm1024": (8192, 1024, 128256), "tt32": (8192, 32, 128256)}
SMOKE_SHAPES = {"small": (96, 48, 500), "tt16": (64, 16, 300), "cpu-lm": (1024, 512, 32768)}
SMOKE_DEFAULT = ("small", "tt16")  # cpu-lm: the CPU comparison at a small LM head (--impl auto)
TRANSPOSED = {"tt32", "tt16"}  # the weight is R^T, a strided view
GEMM_TFLOPS = 790.0  # bf16 peak rate on the H200
HBM_TBPS = 4.3
MIB = 1 << 20
PEERS = ("eager", "torch.compile", "cut-cross-entropy", "liger", "torch-lce", "torch-lce-chunked")
METHODS = ("eager,torch.compile,cut-cross-entropy,liger,torch-lce,torch-lce-chunked,auto,auto-nobounds,sparse,static,"
           "chunked,fused,graph,backend,auto-exact")
SMOKE_METHODS = "eager,auto,sparse,static,chunked,fused"


# the learned-like cases: how far (in nats) a hidden state points at its target's row; the flatter the
# softmax, the fewer logit tiles the filtered paths can skip
PEAKED_BOOST = {"peaked": 8.0, "peaked-mid": 4.0, "peaked-flat": 2.0}
CASES = ("random",) + tuple(PEAKED_BOOST)


def make_inputs(case: str, N: int, D: int, V: int, device: str, dtype, transposed: bool, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    if case == "random":
        x = torch.randn(N, D, device=device, generator=g)
        w = torch.randn(V, D, device=device, generator=g) / D**0.5
        t = torch.randint(0, V, (N,), device=device, generator=g)
    elif case in PEAKED_BOOST:
        rank = torch.arange(V, device=device, dtype=torch.float32)
        logf = -1.1 * torch.log(rank + 10.0)
        logf = logf - torch.logsumexp(logf, 0)
        perm = torch.randperm(V, device=device, generator=g)  # frequent ids are spread over the vocab
        logf = logf[perm]
        t = torch.multinomial(logf.exp(), N, replacement=True, generator=g)
        r = torch.randn(V, D, device=device, generator=g) / D**0.5
        w = r.clone()
        w[:, 0] = logf - logf.mean()
        x = PEAKED_BOOST[case] * r[t] + torch.randn(N, D, device=device, generator=g) / D**0.5
        x[:, 0] = 1.0
    else:
        raise ValueError(case)
    w = w.to(dtype)
    w = w.t().contiguous().t() if transposed else w.contiguous()
    return x.to(dtype).contiguous(), w, t


def reference(x, w, t, rows: int = 512, cols: int = 4096, chunk: int = 1024):
    """float64 mean loss over all rows, dx of the first ``rows`` rows, dW of the first ``cols``
    vocabulary columns (the lse of every row is needed for those)."""
    N = x.shape[0]
    V = w.shape[0]
    w64 = w.double()
    cols = min(cols, V)
    lse = torch.empty((N,), device=x.device, dtype=torch.float64)
    total = torch.zeros((), device=x.device, dtype=torch.float64)
    dw = torch.zeros((cols, w.shape[1]), device=x.device, dtype=torch.float64)
    for i in range(0, N, chunk):
        xc, tc = x[i:i + chunk].double(), t[i:i + chunk]
        z = xc @ w64.T
        lse[i:i + chunk] = torch.logsumexp(z, 1)
        total += (lse[i:i + chunk] - z.gather(1, tc[:, None])[:, 0]).sum()
        g = torch.exp(z[:, :cols] - lse[i:i + chunk, None])
        hit = tc < cols
        g[hit.nonzero()[:, 0], tc[hit]] -= 1.0
        dw += g.T @ xc / N
        del z, g
    xr, tr = x[:rows].double(), t[:rows]
    g = torch.softmax(xr @ w64.T, 1)
    g[torch.arange(len(tr), device=x.device), tr] -= 1.0
    return {"loss": total / N, "dx": g @ w64 / N, "dw": dw, "rows": rows, "cols": cols}


def rel(a, b):
    a = a.double()
    return float((a - b).norm() / b.norm())


def peer_methods(which, device):
    out = {}

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    if "eager" in which:
        out["eager"] = eager
    if "torch.compile" in which:
        out["torch.compile"] = torch.compile(eager, dynamic=False)
    if "cut-cross-entropy" in which and device == "cuda":
        try:
            from cut_cross_entropy import linear_cross_entropy as cce

            out["cut-cross-entropy"] = lambda x, w, t: cce(x, w.contiguous(), t)
        except Exception as e:  # noqa: BLE001
            print("cut-cross-entropy unavailable:", e)
    # torch >= 2.13's own F.linear_cross_entropy: its reference path (options=None) and its chunked one
    lce = getattr(F, "linear_cross_entropy", None)
    if lce is None and {"torch-lce", "torch-lce-chunked"} & set(which):
        print(f"torch-lce unavailable: torch {torch.__version__} has no F.linear_cross_entropy (torch >= 2.13)")
    elif lce is not None:
        if "torch-lce" in which:
            out["torch-lce"] = lambda x, w, t: lce(x, w, t)
        if "torch-lce-chunked" in which:
            chunked = torch.nn.LinearCrossEntropyOptions()
            out["torch-lce-chunked"] = lambda x, w, t: lce(x, w, t, options=chunked)
    if "liger" in which and device == "cuda":
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

            lf = LigerFusedLinearCrossEntropyLoss()
            out["liger"] = lambda x, w, t: lf(w.contiguous(), x, t)
        except Exception as e:  # noqa: BLE001
            print("liger unavailable:", e)
    return out


def our_methods(which, D, budgets, impl, device):
    """name -> (fn, replay as a CUDA graph)."""
    from comera_compile.cce import cce_tuning
    from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy as ours

    def make(**kw):
        return lambda x, w, t: ours(x, w, t, impl=impl, **kw)

    def without_bounds(x, w, t):  # the forward decides where the sparse rounds run: the backward's
        with cce_tuning(forward_bounds=False):
            return ours(x, w, t, impl=impl)

    out = {}
    if "auto" in which:
        out["ours auto"] = (make(), False)
    if "auto-exact" in which:  # what auto runs pinned exact: the yardstick auto must not be slower than
        out["ours auto, exact backward"] = (make(backward="exact"), False)
    if "auto-nobounds" in which:  # as before the forward's logit bounds: a sparse choice runs in the backward
        out["ours auto, no forward bounds"] = (without_bounds, False)
    if "sparse" in which:
        out["ours sparse (filtered)"] = (make(strategy="sparse"), False)
    if "static" in which:
        out["ours static (exact)"] = (make(strategy="static", backward="exact"), False)
    if "chunked" in which:
        for b in budgets:
            out[f"ours chunked {b // MIB} MiB (exact)"] = (make(strategy="chunked", memory_budget=b), False)
    if "fused" in which and D <= 256:
        out["ours fused (exact)"] = (make(strategy="fused"), False)
    if "backend" in which:  # what a user's compiled module runs: the pass fuses linear + cross_entropy
        import comera_compile  # noqa: F401  (registers the backend)

        def user_loss(x, w, t):
            return F.cross_entropy(F.linear(x, w).float(), t)

        out["ours via backend=\"comera\""] = (torch.compile(user_loss, backend="comera", dynamic=False), False)
    if "graph" in which and device == "cuda":
        out["ours auto (CUDA graph)"] = (make(), True)
        out["ours static (CUDA graph)"] = (make(strategy="static", backward="exact"), True)
    return out


def bench_ms(fn, rep_ms, device):
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def capture(step, device):
    """Warm up on a side stream, then capture ``step`` as a CUDA graph; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def errors(out, ref):
    loss, gx, gw = out
    return {"err_loss": abs(float(loss) - float(ref["loss"])) / abs(float(ref["loss"])),
            "err_dx": rel(gx[:ref["rows"]], ref["dx"]), "err_dw": rel(gw[:ref["cols"]], ref["dw"])}


def run_one(name, fn, x, w, t, ref, floor_ms, rep_ms, device, graph=False, warmup=0):
    """One method on one input: errors, paths, memory, time. ``warmup``: steps run before the
    recorded one (for ``auto``: the kept fraction is observed first)."""
    from comera_compile.cce import kept_fractions, record_cce_stats

    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()

    def step():
        loss = fn(xr, wr, t)
        return (loss,) + torch.autograd.grad(loss, (xr, wr))

    res = {"method": name}
    t0 = time.time()
    for i in range(warmup):
        step()
        if i == 0:
            if device == "cuda":
                torch.cuda.synchronize()
            res["first_call_s"] = round(time.time() - t0, 2)
    with record_cce_stats() as stats:
        if graph:
            g, out = capture(step, device)
            g.replay()
        else:
            out = step()  # warm-up / compile; checked first
    if device == "cuda":
        torch.cuda.synchronize()
    res.setdefault("first_call_s", round(time.time() - t0, 2))
    res.update(errors(out, ref))
    res["loss"] = float(out[0])
    if stats:
        res["paths"] = [f"{s.phase}:{s.path}" for s in stats]
        res["stats"] = [{k: v for k, v in vars(s).items() if v not in (0, "")} for s in stats]
    if name.startswith("ours auto"):
        # the path of the recorded step: chunked, sparse (in the backward, or in the forward for a
        # chunked plan), static or fused; and the kept fraction it was chosen from
        ran = [s.path for s in stats if s.path != "triton"] or ["?"]
        res["auto_chose"] = "+".join(dict.fromkeys(ran))
        seen = [v for k, v in kept_fractions().items()
                if (k.vocab, k.hidden, k.dtype) == (w.shape[0], w.shape[1], w.dtype)]
        res["kept_fraction"] = round(seen[0].fraction, 4) if seen else None
        skipped = seen[0].skipped if seen else None
        res["skipped_fraction"] = round(skipped, 4) if skipped is not None else None
        print(f"  {name} chose {res['auto_chose']} ({' '.join(res.get('paths', []))}); observed kept fraction "
              f"{res['kept_fraction'] if seen else 'none (flat assumption)'}, ruled out by the bounds "
              f"{res['skipped_fraction']}", flush=True)
    del out
    gc.collect()
    if device == "cuda" and not graph:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        grads_bytes = sum(o.numel() * o.element_size() for o in out[1:])
        res["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads_bytes) / MIB
        del out
    res["ms"] = bench_ms(g.replay if graph else step, rep_ms, device)
    res["x_floor"] = res["ms"] / floor_ms
    return res


def floor_ms(N, D, V, elem):
    flops = 3 * 2 * N * D * V / (GEMM_TFLOPS * 1e12)
    bytes_ = (2 * N * D + 2 * V * D) * elem / (HBM_TBPS * 1e12)
    return max(flops, bytes_) * 1e3


def table(results):
    lines = ["| shape | case | method | ms | x floor | extra MiB | err loss | err dx | err dW | paths |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['case']} | {r['method']} | error: {r['error'][:80]} |")
            continue
        mib = f"{r['extra_mib']:.1f}" if "extra_mib" in r else "-"
        lines.append(f"| {r['shape']} | {r['case']} | {r['method']} | {r['ms']:.2f} | {r['x_floor']:.2f} | {mib} | "
                     f"{r['err_loss']:.1e} | {r['err_dx']:.1e} | {r['err_dw']:.1e} | {' '.join(r.get('paths', []))} |")
    return "\n".join(lines)


def auto_against_exact(auto, own, tolerance=0.02):
    """How auto's time reads against its own exact path's: ``"same path"`` when both ran the same paths (the
    same kernels: a difference is timing noise), otherwise ``"not slower"`` or ``"SLOWER"`` (by more than
    ``tolerance``)."""
    if auto.get("paths") and auto.get("paths") == own.get("paths"):
        return f"the same path, {abs(auto['ms'] / own['ms'] - 1) * 100:.1f} % apart: timing noise"
    return "not slower" if auto["ms"] <= own["ms"] * (1 + tolerance) else "SLOWER"


def verdicts(results):
    """Ours against the issue's targets: default <= 0.9x the fastest peer, exact <= 1.0x
    torch.compile, the TT head >= 10x faster than the dense head (lm1024) of the same LM."""
    ok = [r for r in results if "error" not in r]
    lines = []
    for shape, case in sorted({(r["shape"], r["case"]) for r in ok}):
        rows = [r for r in ok if r["shape"] == shape and (r["case"] == case or r["method"] in PEERS)]
        peers = [r for r in rows if r["method"] in PEERS and r["method"] != "eager"]
        mine = {r["method"]: r for r in rows if r["case"] == case and r["method"].startswith("ours")}
        if not peers or "ours auto" not in mine:
            continue
        best = min(peers, key=lambda r: r["ms"])
        auto = mine["ours auto"]
        exact = [r for n, r in mine.items() if "exact" in n and "graph" not in n]
        line = (f"{shape}/{case}: auto ({auto.get('auto_chose', '?')}, kept fraction "
                f"{auto.get('kept_fraction')}) {auto['ms']:.2f} ms = {auto['ms'] / best['ms']:.2f}x "
                f"{best['method']} ({best['ms']:.2f} ms), +{auto.get('extra_mib', float('nan')):.0f} MiB")
        own = mine.get("ours auto, exact backward")
        if own:
            line += (f"; its exact path {own['ms']:.2f} ms: auto {auto['ms'] / own['ms']:.2f}x "
                     f"({auto_against_exact(auto, own)})")
        via = mine.get('ours via backend="comera"')
        if via and own:
            line += f"; a compiled module (backend=\"comera\") {via['ms']:.2f} ms = {via['ms'] / own['ms']:.2f}x it"
        comp = [r for r in peers if r["method"] == "torch.compile"]
        if exact and comp:
            e = min(exact, key=lambda r: r["ms"])
            line += f"; best exact {e['method']} {e['ms']:.2f} ms = {e['ms'] / comp[0]['ms']:.2f}x torch.compile"
        lines.append(line)
    dense = [r for r in ok if r["shape"] == "lm1024" and r["method"] == "ours auto"]
    tt = [r for r in ok if r["shape"] == "tt32" and r["method"] == "ours auto"]
    for d in dense:
        for r in tt:
            if r["case"] == d["case"]:
                lines.append(f"TT head r=32 vs dense head D=1024 ({d['case']}): {d['ms'] / r['ms']:.1f}x faster")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None, help=f"comma list of {list(SHAPES)} (default: all)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    ap.add_argument("--methods", default=None, help=f"default: {METHODS} ({SMOKE_METHODS} with --smoke)")
    ap.add_argument("--budgets-mib", default="256,1024", help="memory budgets of the chunked rows")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--tuning", default="", help="k=v,... CCETuning overrides for ours")
    ap.add_argument("--auto-warmup", type=int, default=3,
                    help="steps of the auto rows before the recorded one (the first observes the kept fraction)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU (Triton interpreter)")
    ap.add_argument("--impl", choices=["auto", "triton", "torch"], default=None,
                    help="our op's implementation (default: auto on the GPU, triton, i.e. the interpreter, with "
                         "--smoke on the CPU; auto on the CPU runs its torch reference, what CPU users get)")
    args = ap.parse_args(argv)

    from comera_compile.cce import CCETuning, cce_tuning, reset_kept_fractions

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        ap.error("no GPU: use --smoke")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = args.shapes.split(",") if args.shapes else list(SMOKE_DEFAULT if args.smoke else shapes)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    impl = args.impl or ("auto" if device == "cuda" else "triton")
    which = (args.methods or (SMOKE_METHODS if args.smoke else METHODS)).split(",")
    budgets = [int(b) * MIB for b in args.budgets_mib.split(",")]
    types = {f.name: f.type for f in CCETuning.__dataclass_fields__.values()}
    tuning = {k: (float(v) if types[k] in (float, "float") else int(v))
              for k, v in (kv.split("=") for kv in filter(None, args.tuning.split(",")))}
    print("torch", torch.__version__, "| device", torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "| tuning", tuning or "defaults", flush=True)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown case(s) {unknown}; valid: {list(CASES)}")
    peers = peer_methods(which, device)
    results = []
    with cce_tuning(**tuning):
        for shape in names:
            N, D, V = shapes[shape]
            fl = floor_ms(N, D, V, torch.finfo(dtype).bits // 8)
            mine = our_methods(which, D, budgets, impl, device)
            for ci, case in enumerate(args.cases.split(",")):
                x, w, t = make_inputs(case, N, D, V, device, dtype, shape in TRANSPOSED)
                ref = reference(x, w, t)
                reset_kept_fractions()  # another input case, another "model": auto observes it afresh
                print(f"== {shape} (N,D,V)=({N},{D},{V}) case={case} ref loss={float(ref['loss']):.4f} "
                      f"floor={fl:.2f} ms", flush=True)
                todo = [(n, f, False) for n, f in peers.items() if ci == 0]  # peers: data-independent
                todo += [(n, f, g) for n, (f, g) in mine.items()]
                for name, fn, graph in todo:
                    try:
                        warm = args.auto_warmup if name.startswith("ours auto") and not graph else 0
                        r = run_one(name, fn, x, w, t, ref, fl, args.rep_ms, device, graph, warm)
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        r = {"method": name, "error": f"{type(e).__name__}: {e}"[:300]}
                    r.update(shape=shape, case=case, N=N, D=D, V=V)
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                del x, w, t, ref
    with open(os.path.join(os.environ.get("OUT", "."), "bench_cce.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(table(results))
    print()
    print(verdicts(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
