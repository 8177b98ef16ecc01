"""A block tensor-train layer's blocks path, forward + backward, bf16, on one GPU: ``comera::btt_blocks``
(batched library GEMMs with the swap kernel between them) against the dense layer it replaces
(``F.linear``, cuBLAS), at the width sweep's layer shapes: what the planner's choice between the blocks
and the dense weight rests on, layer by layer.

    python benchmarks/bench_btt.py                      # d 1024, 2048 and 4096 layers at 8,192 tokens
    python benchmarks/bench_btt.py --json out.json
    python benchmarks/bench_btt.py --smoke              # CPU: checks the script (no timing)

Layers as the width sweep's Llama blocks have them after ``tensorize_(model, TTConfig(fmt="btt",
rank=1))``: ``qkv`` (three d -> d layers reading one input: one op with three outputs), ``o`` (d -> d),
``gate_up`` (two d -> ffn layers), ``down`` (ffn -> d); ``dense`` is the one GEMM with every output's
weight stacked. Times: the median of CUDA events around one forward + backward (every gradient: the
input's and the cores'), each after an L2 flush and a GPU spin (``gpu_timing.cuda_time_ms``). The
blocks path is checked against a float64 reference first (relative error of the outputs, of dx and of the
cores' gradients).
``floor``: the bytes a layer cannot avoid (x twice, the outputs, their gradients and dx, once each) at
4.3 TB/s, or for ``dense`` its 3 GEMMs' FLOPs at 790 TFLOP/s, whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import PEAK_BYTES, PEAK_FLOPS, WIDTHS, llama_ffn  # noqa: E402
from bench_swap import btt_spec  # noqa: E402


def layers(d: int, ffn: int) -> list[tuple[str, int, list[int]]]:
    """``(name, d_in, [d_out per output])`` of one transformer block."""
    return [("qkv", d, [d, d, d]), ("o", d, [d]), ("gate_up", d, [ffn, ffn]), ("down", ffn, [d])]


def op_inputs(d_in: int, d_outs: list[int], rank: int, n: int, device, dtype, gen):
    """``x, first, seconds`` of one ``comera::btt_blocks`` call (the cores scaled to unit-variance outputs)."""
    specs = [btt_spec(d_in, o, rank) for o in d_outs]
    (b1, b2), a = specs[0].row_modes, specs[0].col_modes[1]
    cs = [s.col_modes[0] for s in specs]
    x = torch.randn(n, b1 * b2, device=device, generator=gen).to(dtype)
    first = (torch.randn(b1, b2, sum(cs) * rank, device=device, generator=gen) / b2**0.5).to(dtype)
    seconds = [(torch.randn(c, b1 * rank, a, device=device, generator=gen) / (b1 * rank)**0.5).to(dtype) for c in cs]
    return x, first, seconds


def reference(x, first, seconds, rank):
    """Outputs of the op from the definition, float64."""
    n, (b1, b2) = x.shape[0], first.shape[:2]
    t = torch.einsum("njb,jbm->njm", x.double().view(n, b1, b2), first.double()).view(n, b1, -1, rank)
    ys, c0 = [], 0
    for s in seconds:
        c = s.shape[0]
        ys.append(torch.einsum("njck,cjka->nca", t[:, :, c0:c0 + c], s.double().view(c, b1, rank, -1)).reshape(n, -1))
        c0 += c
    return ys


def rel(a, b) -> float:
    return float(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).detach())


def run_layer(name, d_in, d_outs, rank, n, args, device, dtype) -> list[dict]:
    from gpu_timing import cuda_time_ms

    gen = torch.Generator(device=device).manual_seed(0)
    x, first, seconds = op_inputs(d_in, d_outs, rank, n, device, dtype, gen)
    leaves = [t.requires_grad_() for t in (x, first, *seconds)]
    dys = [torch.randn(n, s.shape[0] * s.shape[2], device=device, generator=gen).to(dtype) for s in seconds]
    w_dense = torch.randn(sum(d_outs), d_in, device=device, generator=gen).to(dtype).div_(d_in**0.5).requires_grad_()
    x_dense = x.detach()[:, :d_in].clone().requires_grad_()
    dy_dense = torch.randn(n, sum(d_outs), device=device, generator=gen).to(dtype)
    elem = x.element_size()
    unavoidable = elem * (2 * n * d_in + 2 * n * sum(d_outs)) + elem * n * d_in  # x twice, y, dy, dx
    rows = []

    def fwd_bwd():
        out = torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], rank)[:-1]
        torch.autograd.backward(out, dys)

    def forward():
        with torch.no_grad():
            torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], rank)

    def check() -> tuple[float, float, float]:
        out = torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], rank)[:-1]
        grads = torch.autograd.grad(out, leaves, dys)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        ref = reference(ref_leaves[0], ref_leaves[1], ref_leaves[2:], rank)
        wants = torch.autograd.grad(ref, ref_leaves, [d.double() for d in dys])
        return (max(rel(o, w.detach()) for o, w in zip(out, ref)), rel(grads[0], wants[0]),
                max(rel(g, w) for g, w in zip(grads[1:], wants[1:])))

    def dense_fwd_bwd():
        F.linear(x_dense, w_dense).backward(dy_dense)

    err_y, err_dx, err_cores = check()
    if args.smoke:
        ms = fwd_ms = float("nan")
    else:
        ms = cuda_time_ms(fwd_bwd, args.iters)
        fwd_ms = cuda_time_ms(forward, args.iters)
    rows.append({"layer": name, "d_in": d_in, "d_outs": d_outs, "rank": rank, "n": n, "variant": "blocks",
                 "fwd_bwd_ms": ms, "fwd_ms": fwd_ms, "err_y": err_y, "err_dx": err_dx, "err_cores": err_cores,
                 "floor_ms": 1e3 * unavoidable / PEAK_BYTES})
    if not args.smoke:
        ms = cuda_time_ms(dense_fwd_bwd, args.iters)
        flops = 6 * n * d_in * sum(d_outs)
        rows.append({"layer": name, "d_in": d_in, "d_outs": d_outs, "rank": rank, "n": n, "variant": "dense",
                     "fwd_bwd_ms": ms, "fwd_ms": float("nan"), "err_y": float("nan"), "err_dx": float("nan"),
                     "err_cores": float("nan"),
                     "floor_ms": 1e3 * max(flops / PEAK_FLOPS, unavoidable / PEAK_BYTES)})
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default=",".join(str(d) for d in WIDTHS))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ranks", default="1")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, no timing (checks the script)")
    args = ap.parse_args(argv)
    if args.smoke:
        device, dtype, widths, n = torch.device("cpu"), torch.float32, {64: 96}, 40
    else:
        device, dtype, n = torch.device("cuda"), torch.bfloat16, args.tokens
        widths = {int(d): llama_ffn(int(d)) for d in args.widths.split(",")}
    rows = []
    for d, ffn in widths.items():
        for rank in (int(r) for r in args.ranks.split(",")):
            for name, d_in, d_outs in layers(d, ffn):
                new = run_layer(name, d_in, d_outs, rank, n, args, device, dtype)
                _print_layer(new, d)
                rows.extend(new)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


def _print_layer(rows, d) -> None:
    dense = next((r["fwd_bwd_ms"] for r in rows if r["variant"] == "dense"), float("nan"))
    for r in rows:
        print(f"d{d} r{r['rank']} {r['layer']:8s} {r['variant']:6s} fwd+bwd {r['fwd_bwd_ms']:8.3f} ms  fwd {r['fwd_ms']:7.3f} ms"
              f"  x floor {r['fwd_bwd_ms'] / r['floor_ms']:5.2f}  vs dense {r['fwd_bwd_ms'] / dense:5.2f}"
              f"  err y {r['err_y']:.1e} dx {r['err_dx']:.1e} cores {r['err_cores']:.1e}", flush=True)


if __name__ == "__main__":
    main()
