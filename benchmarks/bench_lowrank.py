"""The rank bottleneck ``y = act(x @ L) @ R (+ bias)``: the fused Triton op ``comera::lowrank_linear``
against two torch matmuls (eager) and torch.compile of the same two matmuls (Inductor), bf16, forward and
forward + backward, on one GPU.

    python benchmarks/bench_lowrank.py                         # the six-encoder layer and three width-sweep layers (~1 minute)
    python benchmarks/bench_lowrank.py --json out.json --activation gelu --bias
    python benchmarks/bench_lowrank.py --smoke                 # CPU: checks the script (no timing)

Times are the median over ``--iters`` iterations (after warm-up) of CUDA events around one call, each
call preceded by a 256 MiB write that flushes the L2 and a short GPU spin, so the launches queue up
behind it and the events time the GPU alone (no host overhead). Every variant is checked against a
float64 reference first (relative Frobenius error of y and of dx).

The floor of a call is max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s); ``x floor`` = measured / floor.
Forward bytes: x, y, L, R and h = x @ L ([T, r]), each once, in the input dtype; FLOPs 2 T r (d_in + d_out).
The backward adds dy, x, h, L and R read, dx, dL and dR written; FLOPs twice the forward's.
``TB/s`` is the floor's bytes over the measured time (the bandwidth the call would need).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comera_compile.kernels import lowrank_fused  # noqa: E402
from comera_compile.kernels.lowrank_fused import ACTIVATIONS, lowrank_linear  # noqa: E402

PEAK_FLOPS, PEAK_BYTES = 790e12, 4.3e12
SHAPES = [(4096, 768, 768, 30), (8192, 2048, 2048, 32), (8192, 4096, 4096, 32), (8192, 4096, 11008, 32)]
SMOKE_SHAPES = [(37, 48, 40, 5), (64, 96, 80, 16)]
ACT = {"identity": lambda h: h, "relu": F.relu, "gelu": F.gelu,
       "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu}


def floors(t: int, d_in: int, d_out: int, r: int, elem: int) -> dict:
    """Bytes and FLOPs of the forward and of forward + backward (see the module doc), and their floors."""
    fwd_bytes = elem * (t * d_in + t * d_out + d_in * r + r * d_out + t * r)
    bwd_bytes = elem * (t * d_out + t * d_in + t * r + t * d_in + 2 * (d_in * r + r * d_out))
    fwd_flops = 2 * t * r * (d_in + d_out)
    out = {}
    for name, nbytes, flops in (("fwd", fwd_bytes, fwd_flops), ("fwd_bwd", fwd_bytes + bwd_bytes, 3 * fwd_flops)):
        out[name] = {"bytes": nbytes, "flops": flops,
                     "floor_ms": 1e3 * max(nbytes / PEAK_BYTES, flops / PEAK_FLOPS)}
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def cuda_time_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median over ``iters`` of CUDA events around ``fn()``, after an L2 flush and a GPU spin each."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.zero_()
        if hasattr(torch.cuda, "_sleep"):
            # ~5 ms of GPU spin: the host enqueues all of fn's launches meanwhile, so the events time
            # the GPU work alone (with 0.5 ms, the custom op's fwd+bwd measured its host dispatch, a
            # constant ~0.7 ms at every shape)
            torch.cuda._sleep(10_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return ms[len(ms) // 2]


def variants(activation: str, compile_: bool, smoke: bool):
    """name -> fn(x, L, R, b) for the three implementations."""
    act = ACT[activation]

    def two_matmuls(x, L, R, b):
        a = act(x @ L)
        return torch.addmm(b, a, R) if b is not None else a @ R

    out = {"fused": lambda x, L, R, b: lowrank_linear(x, L, R, b, activation, impl="triton" if not smoke else "auto"),
           "eager": two_matmuls}
    if compile_:
        out["compiled"] = torch.compile(two_matmuls, backend="aot_eager" if smoke else "inductor", dynamic=False)
    return out


def run_shape(shape, activation, bias, iters, compile_, device, dtype, smoke) -> list[dict]:
    t, d_in, d_out, r = shape
    g = torch.Generator(device).manual_seed(0)
    x64 = torch.randn(t, d_in, device=device, generator=g, dtype=torch.float64)
    L64 = torch.randn(d_in, r, device=device, generator=g, dtype=torch.float64) / d_in**0.5
    R64 = torch.randn(r, d_out, device=device, generator=g, dtype=torch.float64) / r**0.5
    b64 = torch.randn(d_out, device=device, generator=g, dtype=torch.float64) if bias else None
    dy64 = torch.randn(t, d_out, device=device, generator=g, dtype=torch.float64)
    # the reference from the rounded inputs (the error is the op's own)
    x, L, R, dy = (a.to(dtype) for a in (x64, L64, R64, dy64))
    b = b64.to(dtype) if bias else None
    xr = x.double().requires_grad_()
    y_ref = F.linear(ACT[activation](xr @ L.double()), R.double().t(), b.double() if bias else None)
    (dx_ref,) = torch.autograd.grad(y_ref, xr, dy.double())
    y_ref = y_ref.detach()
    del x64, L64, R64, b64, dy64, xr

    params = [x.requires_grad_(), L.requires_grad_(), R.requires_grad_()] + ([b.requires_grad_()] if bias else [])
    fl = floors(t, d_in, d_out, r, x.element_size())
    rows = []
    for name, fn in variants(activation, compile_, smoke).items():
        def forward(fn=fn):
            with torch.no_grad():
                return fn(x, L, R, b)

        def forward_backward(fn=fn):
            return torch.autograd.grad(fn(x, L, R, b), params, dy)

        y = forward()
        dx = forward_backward()[0]
        row = {"shape": list(shape), "variant": name, "activation": activation, "bias": bias,
               "err_y": rel(y, y_ref), "err_dx": rel(dx, dx_ref)}
        row["ok"] = row["err_y"] < 2e-2 and row["err_dx"] < 2e-2
        if not smoke:
            for phase, f in (("fwd", forward), ("fwd_bwd", forward_backward)):
                ms = cuda_time_ms(f, iters)
                row[f"{phase}_ms"] = ms
                row[f"{phase}_x_floor"] = ms / fl[phase]["floor_ms"]
                row[f"{phase}_tbps"] = fl[phase]["bytes"] / (ms * 1e-3) / 1e12
        row["floor"] = fl
        rows.append(row)
        print(line(row), flush=True)
    if not smoke:
        rows[0]["autotuned"] = {k: str(getattr(getattr(lowrank_fused, k), "best_config", None))
                                for k in ("_fwd_kernel", "_bwd_kernel")}
        print(f"    fused configs: fwd {rows[0]['autotuned']['_fwd_kernel']}; bwd {rows[0]['autotuned']['_bwd_kernel']}")
    return rows


HEADER = (f"{'T x d_in -> d_out, r':<26}{'variant':<10}{'err y':>8}{'err dx':>8}"
          f"{'fwd us':>10}{'x floor':>8}{'TB/s':>6}{'fwd+bwd us':>12}{'x floor':>8}{'TB/s':>6}")


def line(row: dict) -> str:
    t, d_in, d_out, r = row["shape"]
    s = f"{f'{t} x {d_in} -> {d_out}, r{r}':<26}{row['variant']:<10}{row['err_y']:>8.1e}{row['err_dx']:>8.1e}"
    if "fwd_ms" in row:
        for phase in ("fwd", "fwd_bwd"):
            s += f"{row[f'{phase}_ms'] * 1e3:>{10 if phase == 'fwd' else 12}.1f}{row[f'{phase}_x_floor']:>8.2f}"
            s += f"{row[f'{phase}_tbps']:>6.2f}"
    return s + ("" if row["ok"] else "  WRONG")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the rows (and the floors, the tuned configs) here")
    ap.add_argument("--activation", default="identity", choices=ACTIVATIONS)
    ap.add_argument("--bias", action="store_true", help="add a bias (the fused op adds it in its epilogue)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--shapes", default=None, help="T,d_in,d_out,r;... (default: 4096,768,768,30 and 8192 tokens at d 2048, 4096, 4096 -> 11008, r 32)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, fp32: checks the script, no timing")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and not args.smoke:
        print("no CUDA device: running --smoke")
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16  # (the Triton interpreter's bf16 is wrong)
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    if smoke:
        os.environ.setdefault("COMERA_FORCE_TRITON", "1")  # the kernels when TRITON_INTERPRET=1
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"act={args.activation} bias={args.bias} {str(dtype).removeprefix('torch.')}; floor: max(bytes / 4.3 TB/s, "
          f"FLOPs / 790 TFLOP/s)")
    print(HEADER)
    rows = []
    for shape in shapes:
        rows += run_shape(shape, args.activation, args.bias, args.iters, not args.no_compile, device, dtype, smoke)
    elapsed = time.perf_counter() - start
    print(f"{len(rows)} rows in {elapsed:.1f} s")
    if args.json:
        meta = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
                "dtype": str(dtype), "iters": args.iters, "peak_bytes_per_s": PEAK_BYTES, "peak_flops": PEAK_FLOPS,
                "elapsed_s": elapsed}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
