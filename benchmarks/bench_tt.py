"""One TT layer, forward + backward, bf16, replayed from a CUDA graph: ours (each strategy) against dense
nn.Linear / nn.Embedding and a torch.einsum over the cores; and the calibration of the planner's cost model.

    python benchmarks/bench_tt.py                # layers + calibration (one GPU, ~1 minute)
    python benchmarks/bench_tt.py --calibrate    # calibration only: the rates of devices.H200 the TT planner uses
    python benchmarks/bench_tt.py --smoke        # CPU: checks the script (no timing)

For each layer the planner's estimate of each strategy is printed beside the measured time, and the
floor: max(FLOPs / 790 TFLOP/s, bytes / 4.3 TB/s) of the cheapest strategy (``x floor`` = measured / floor).
Every variant is checked against a float64 reference first (relative error of the output and of the
input gradient).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import comera_compile as cc  # noqa: E402
from comera_compile.kernels import tt_runtime  # noqa: E402
from comera_compile.tt import planner  # noqa: E402
from comera_compile.tt import TTSpec, materialize, random_cores  # noqa: E402

PEAK_FLOPS, PEAK_BYTES = 790e12, 4.3e12

LINEARS = [  # name, fmt, row_modes, col_modes, rank, tokens
    ("768x768 tt r30", "tt", (12, 8, 8), (8, 8, 12), 30, 4096),
    ("768x768 tt r30", "tt", (12, 8, 8), (8, 8, 12), 30, 32768),
    ("768->3072 tt r30", "tt", (12, 8, 8), (12, 16, 16), 30, 4096),
    ("3072->768 tt r30", "tt", (16, 16, 12), (8, 8, 12), 30, 4096),
    ("768x768 ttm r16", "ttm", (12, 8, 8), (8, 8, 12), 16, 4096),
    ("1024x1024 tt r32", "tt", (16, 8, 8), (8, 8, 16), 32, 8192),
    ("1024->4096 tt r32", "tt", (16, 8, 8), (16, 16, 16), 32, 8192),
    ("4096x4096 ttm r16", "ttm", (8, 8, 8, 8), (8, 8, 8, 8), 16, 8192),
]
EMBEDDINGS = [  # name, fmt, row_modes, col_modes, rank, rows, cols, lookups
    ("30522x768 ttm r30", "ttm", (14, 14, 13, 12), (4, 4, 8, 6), 30, 30522, 768, 4096),
    ("128256x1024 ttm r32", "ttm", (16, 16, 16, 32), (4, 4, 8, 8), 32, 128256, 1024, 8192),
]


def graph_time_ms(fn, reps: int = 20) -> float:
    """Median time of ``fn`` replayed from a CUDA graph. ``main`` puts the whole run on a side stream
    (tensors made on the legacy default stream would make the backward's capture fail)."""
    stream = torch.cuda.current_stream()
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 10)
    return sorted(times)[len(times) // 2]


def _flats(cores, gates):
    """One layer's cores and gates in flat storage, as comera::tt_materialize takes them."""
    return [torch.cat([c.reshape(-1) for c in cores])], [torch.cat([g.reshape(-1) for g in gates])]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _layer(fmt, rm, cm, rank, rows, cols, device, transpose):
    spec = TTSpec(fmt, rm, cm, (1,) + (rank,) * ((len(rm) + len(cm) if fmt == "tt" else len(rm)) - 1) + (1,),
                  rows, cols, transpose)
    std = math.sqrt(1.0 / (rows + cols)) if transpose else 1.0
    cores = [c.to(device).requires_grad_() for c in random_cores(spec, std)]
    gates = [torch.ones(r, device=device, requires_grad=True) for r in spec.gate_sizes]
    return spec, cores, gates


def run_linear(name, fmt, rm, cm, rank, n, device, smoke) -> None:
    rows, cols = math.prod(rm), math.prod(cm)
    spec, cores, gates = _layer(fmt, rm, cm, rank, rows, cols, device, True)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(n, rows, device=device, dtype=dt, requires_grad=True)
    dy = torch.randn(n, cols, device=device, dtype=dt)
    w_ref = materialize([c.double() for c in cores], [g.double() for g in gates], spec).detach()
    y_ref = x.double() @ w_ref.t()
    dx_ref = dy.double() @ w_ref
    plans = {}
    for strategy in ("factored", "dense"):
        if strategy == "factored" and fmt != "tt":
            continue
        p = planner.plan_linear(spec, n, x.element_size(), cudagraphs=True)
        cut = planner.cut_at(spec, spec.bottleneck if strategy == "factored" else planner.dense_split(spec))
        plans[strategy] = (cut, dict(p.candidates).get(strategy), p.strategy)

    leaves = [x, *cores, *gates]

    def ours(strategy):
        cut, _, _ = plans[strategy]

        def fn():
            out = "factors" if strategy == "factored" else "dense_t"
            parts = tt_runtime.group_outputs(*_flats(cores, gates), spec, cut, out, dt)
            y = F.linear(tt_runtime.project(x, parts[0], dt), parts[1]) if strategy == "factored" else F.linear(x, parts[0])
            return y, torch.autograd.grad(y, leaves, dy)  # no AccumulateGrad: capturable
        return fn

    w = torch.randn(cols, rows, device=device, dtype=dt, requires_grad=True)

    def dense():
        return torch.autograd.grad(F.linear(x, w), [x, w], dy)

    print(f"{name} at {n} tokens (planner picks {next(iter(plans.values()))[2]})")
    for strategy in plans:
        y, grads = ours(strategy)()
        err_y, err_dx = rel(y.detach(), y_ref), rel(grads[0], dx_ref)
        ok = err_y < 2e-2 and err_dx < 2e-2
        line = f"  ours {strategy:<9} err y {err_y:.1e} dx {err_dx:.1e} {'ok' if ok else 'WRONG'}"
        if not smoke:
            t = graph_time_ms(ours(strategy))
            est = plans[strategy][1]
            line += f"  {t * 1e3:8.1f} us  (planner est {est * 1e6:.1f} us)"
        print(line, flush=True)
    if not smoke:
        t = graph_time_ms(dense)
        floor = max(6 * n * rows * cols / PEAK_FLOPS, 2 * 3 * n * (rows + cols) / PEAK_BYTES)
        print(f"  dense nn.Linear            {t * 1e3:8.1f} us  (floor {floor * 1e6:.1f} us)")


def run_embedding(name, fmt, rm, cm, rank, rows, cols, n, device, smoke) -> None:
    spec, cores, gates = _layer(fmt, rm, cm, rank, rows, cols, device, False)
    idx = torch.randint(0, rows, (n,), device=device)
    dout = torch.randn(n, cols, device=device)
    w_ref = materialize([c.double() for c in cores], [g.double() for g in gates], spec).detach()
    p = planner.plan_embedding(spec, n, 4, cudagraphs=True)

    def ours():
        A, B = tt_runtime.group_outputs(*_flats(cores, gates), spec, p, "tables", torch.float32)
        out = tt_runtime.lookup(idx, A, B, rows, cols)
        return out, torch.autograd.grad(out, [*cores, *gates], dout)

    out, _ = ours()
    print(f"{name} at {n} lookups: {p.strategy}@{p.split}, err {rel(out.detach(), w_ref[idx]):.1e}")
    if smoke:
        return
    w = torch.randn(rows, cols, device=device, requires_grad=True)

    def dense():
        return torch.autograd.grad(F.embedding(idx, w), [w], dout)

    print(f"  ours tables {graph_time_ms(ours) * 1e3:8.1f} us (planner est {p.est_s * 1e6:.1f} us); "
          f"dense nn.Embedding {graph_time_ms(dense) * 1e3:8.1f} us")


def calibrate(device) -> None:
    """Measured GEMM rates at the shapes TT layers use, and the cost of a launch inside a graph."""
    print("calibration (bf16 GEMMs replayed from a CUDA graph):")
    shapes = [(8192, 8192, 8192), (4096, 768, 768), (4096, 3072, 768), (8192, 4096, 1024),
              (4096, 30, 768), (4096, 768, 30), (768, 30, 4096), (30, 768, 4096), (32768, 30, 768), (32768, 768, 30),
              (4096, 32, 768), (4096, 768, 32), (768, 32, 4096), (32, 768, 4096),
              (8192, 32, 1024), (8192, 4096, 32), (1024, 32, 8192)]
    bw, rate = [], []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        t = graph_time_ms(lambda: torch.mm(a, b)) / 1e3
        flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
        ai = flops / nbytes
        print(f"  [{m}x{k}]·[{k}x{n}] {t * 1e6:8.1f} us  {flops / t / 1e12:6.1f} TFLOP/s  {nbytes / t / 1e12:5.2f} TB/s")
        (rate if ai > 300 else bw).append((flops / t, nbytes / t))
    tiny = torch.randn(8, 8, device=device)

    def many():
        for _ in range(100):
            tiny.mul_(1.0)

    t_graph = graph_time_ms(many) / 1e3 / 100
    torch.cuda.synchronize()
    import time as _t

    t0 = _t.perf_counter()
    for _ in range(20):
        many()
    torch.cuda.synchronize()
    t_eager = (_t.perf_counter() - t0) / 2000
    print(f"  launch: {t_graph * 1e6:.2f} us per kernel inside a graph, {t_eager * 1e6:.2f} us eager")
    print(f"  => devices.H200: tt_gemm_flops={max(r for r, _ in rate):.3g}, tt_skinny_gemm_bandwidth={sorted(b for _, b in bw)[len(bw) // 2]:.3g}, "
          f"tt_graph_launch_s={t_graph:.2g}, tt_launch_s={t_eager:.2g}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream())
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        calibrate(device)
        if args.calibrate:
            return
    for name, fmt, rm, cm, rank, n in LINEARS:
        run_linear(name, fmt, rm, cm, rank, n if not args.smoke else 64, device, args.smoke)
    for name, fmt, rm, cm, rank, rows, cols, n in EMBEDDINGS:
        run_embedding(name, fmt, rm, cm, rank, rows, cols, n if not args.smoke else 64, device, args.smoke)


if __name__ == "__main__":
    main()
