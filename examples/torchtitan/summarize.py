"""Read torchtitan's step lines from OUT/<variant>.log; write OUT/summary.json and OUT/loss.png.

Tokens/s: the median of torchtitan's logged rates past step 10 (past compilation; a profiled step, see
``launch.py --profile-steps``, moves a median less than a mean).

    python summarize.py OUT dense_ce dense fused comera

Each variant's step time and peak memory are also given against the dense run (``dense_ce``, else
``dense``: the first of them that completed steps) as ``vs_dense``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
TIMING = re.compile(r"launch\.py timing: step (\d+) end_to_end_s ([\d.e+-]+) data_loading_s ([\d.e+-]+)")
REWRITES = re.compile(r"comera_compile - INFO - graph (\d+): (\d+) rewrite\(s\)")  # COMERA_LOG=info


def parse(path: Path) -> dict:
    steps, rewrites, timing = [], {}, []
    for line in path.read_text(errors="replace").splitlines():
        t = TIMING.search(line)
        if t:  # launch.py --timing-lines
            timing.append({"step": int(t[1]), "step_s": float(t[2]), "data_loading_s": float(t[3])})
        r = REWRITES.search(line)
        if r:
            rewrites[int(r[1])] = int(r[2])  # per compiled graph (each rank logs the same)
        m = LINE.search(line)
        if m and "validate" not in line:
            steps.append({"step": int(m[1]), "loss": float(m[2]), "memory_gib": float(m[3]),
                          "tps": int(m[4].replace(",", ""))})
    later = [s for s in steps if s["step"] > 10] or steps  # past compilation / warm-up
    times = [t for t in timing if t["step"] > 10] or timing
    return {"steps": steps, "completed": steps[-1]["step"] if steps else 0,
            "tokens_per_s": _median([s["tps"] for s in later]),
            "peak_memory_gib": max((s["memory_gib"] for s in steps), default=None),
            "final_loss": steps[-1]["loss"] if steps else None,
            "comera_rewrites_per_graph": rewrites,
            "median_step_s": _median([t["step_s"] for t in times]),
            "median_data_loading_s": _median([t["data_loading_s"] for t in times])}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


DENSE = ("dense_ce", "dense")  # the dense references, in order of preference


def against_dense(summary: dict) -> None:
    """Add ``vs_dense`` to each variant: its step time (the dense tokens/s over its own, at the same batch)
    and peak memory as multiples of the dense run's, and which dense run that is; None without one."""
    ref = next((v for v in DENSE if summary.get(v, {}).get("tokens_per_s")), None)
    for s in summary.values():
        if ref is None or not s["tokens_per_s"]:
            s["vs_dense"] = None
            continue
        d = summary[ref]
        s["vs_dense"] = {"reference": ref, "step": d["tokens_per_s"] / s["tokens_per_s"],
                         "peak_memory": (s["peak_memory_gib"] / d["peak_memory_gib"]
                                         if d["peak_memory_gib"] else None)}


def main(out: str, *variants: str) -> None:
    out_dir = Path(out)
    summary = {v: parse(out_dir / f"{v}.log") for v in variants if (out_dir / f"{v}.log").exists()}
    against_dense(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    for v, s in summary.items():
        vs = s["vs_dense"]
        rel = ""
        if vs:
            mem = f", peak memory {vs['peak_memory']:.2f}x" if vs["peak_memory"] is not None else ""
            rel = f"  step {vs['step']:.2f}x{mem} {vs['reference']}"
        timing = ""
        if s["median_step_s"] is not None:
            timing = (f"  median step {s['median_step_s'] * 1e3:.1f} ms, of it waiting for data "
                      f"{s['median_data_loading_s'] * 1e3:.1f} ms")
        print(f"{v:8s} steps {s['completed']:4d}  tokens/s {s['tokens_per_s']}  peak {s['peak_memory_gib']} GiB  "
              f"final loss {s['final_loss']}  comera rewrites per graph {s['comera_rewrites_per_graph']}{rel}{timing}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for v, s in summary.items():
        plt.plot([p["step"] for p in s["steps"]], [p["loss"] for p in s["steps"]], label=v)
    plt.xlabel("step"), plt.ylabel("training loss"), plt.legend()
    plt.savefig(out_dir / "loss.png", dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
