"""GPU timing shared by the per-op benchmarks (bench_btt.py, bench_swap.py)."""

from __future__ import annotations

import torch


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
            # the GPU work alone (with 0.5 ms, a custom op's fwd+bwd measured its host dispatch)
            torch.cuda._sleep(10_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in times)
    return ms[len(ms) // 2]
