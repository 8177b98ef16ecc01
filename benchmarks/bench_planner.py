"""Planning time of the TT planner (CPU): a cold plan per layer shape, and a cached one.

    python benchmarks/bench_planner.py

The backend plans every TT site of a graph while compiling, so a cold plan should stay well under
15 ms (the target) and a cached one under 0.1 ms. Median of ``--repeats`` cold plans (the cache
cleared before each) and the mean of 1,000 cached calls. These are timings, not correctness checks:
the tests check what the plans are; this script says how long they take, on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comera_compile.tt import planner  # noqa: E402

SHAPES = {
    "comera768": ("tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1), 4096),
    "comera3072": ("tt", (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1), 32768),
    "ttm4096": ("ttm", (8, 8, 8, 8), (8, 8, 8, 8), (1, 16, 16, 16, 1), 8192),
    "tt8": ("tt", (4, 4, 4, 4), (4, 4, 4, 4), (1, 4, 16, 32, 32, 32, 16, 4, 1), 8192),
    "ttm6": ("ttm", (4,) * 6, (4,) * 6, (1,) + (16,) * 5 + (1,), 4096),
}
COLD_TARGET_S, CACHED_TARGET_S = 15e-3, 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"{'shape':<12} {'cold median ms':>15} {'cached us':>10}  target")
    missed = 0
    for name, shape in SHAPES.items():
        cold = []
        for _ in range(args.repeats):
            planner.clear_plan_cache()
            t0 = time.perf_counter()
            planner.plan_tt_linear(*shape)
            cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(1000):
            planner.plan_tt_linear(*shape)
        cached = (time.perf_counter() - t0) / 1000
        ok = statistics.median(cold) <= COLD_TARGET_S and cached <= CACHED_TARGET_S
        missed += not ok
        print(f"{name:<12} {statistics.median(cold) * 1e3:>15.2f} {cached * 1e6:>10.2f}  "
              f"{'met' if ok else 'MISSED'} (cold <= {COLD_TARGET_S * 1e3:g} ms, cached <= {CACHED_TARGET_S * 1e6:g} us)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
