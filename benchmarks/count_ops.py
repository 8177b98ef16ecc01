"""Aten and comera ops per compiled training step on the CPU: a proxy, without a GPU, for the kernels a
step launches outside Inductor's own (each such op is one or more kernels on the GPU; Inductor's fused
kernels are not counted).

    python benchmarks/count_ops.py --model llama --variants tt,tt-opaque

Builds bench_compile.py's ``small`` models (every layer of bench_e2e.py's, at d 256), tensorizes them as
bench_e2e.py's ``tt`` variant, compiles with ``backend="comera"`` (``-opaque``: ``tt_merges="opaque"``),
runs two warm-up steps (forward under bf16 autocast, backward), then profiles one and prints the ops
that do work (those that call no other op, and GEMMs; less views and allocations) by count.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


# GEMMs and attention, counted though they call other ops on the CPU
GEMMS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention_for_cpu_backward"}
# ops that launch no kernel: views, metadata, allocations
NO_WORK = {"as_strided", "view", "reshape", "_reshape_alias", "detach", "resolve_conj", "resolve_neg", "transpose",
           "t", "slice", "select", "narrow", "unsqueeze", "squeeze", "expand", "permute", "alias", "_unsafe_view",
           "unbind", "split", "split_with_sizes", "empty", "empty_strided", "empty_like", "lift_fresh", "is_nonzero",
           "item", "_local_scalar_dense", "result_type", "size", "stride", "numel", "dim"}


def count(model_name: str, variant: str, top: int) -> collections.Counter:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_e2e
    import comera_compile  # noqa: F401  (registers the backend in a source checkout)
    from bench_compile import build

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, make = build(model_name, "small")
    bench_e2e.tensorize(model, model_name, "tt")
    options = {"tt_merges": "opaque"} if variant.endswith("opaque") else {}
    fn = torch.compile(model, backend="comera", options=options)
    batch = make(torch.device("cpu"), torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(*batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    # the ops that do work: those that call no other op (leaves) and GEMMs, less views and allocations
    ops = collections.Counter(e.name for e in prof.events()
                              if e.name.startswith(("aten::", "comera::")) and e.name.split("::")[1] not in NO_WORK
                              and (not e.cpu_children or e.name.split("::")[1] in GEMMS))
    print(f"{model_name} {variant}: {sum(ops.values())} ops that do work")
    for name, n in ops.most_common(top):
        print(f"  {n:6d} {name}")
    return ops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["encoder", "llama"], default="llama")
    ap.add_argument("--variants", default="tt,tt-opaque", help="comma-separated, of tt, tt-opaque")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    for variant in args.variants.split(","):
        if variant not in ("tt", "tt-opaque"):
            raise SystemExit(f"unknown variant {variant!r}; valid: tt, tt-opaque")
        count(args.model, variant, args.top)


if __name__ == "__main__":
    main()
