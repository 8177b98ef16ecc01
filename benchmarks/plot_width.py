"""Step time against width from bench_e2e's width sweep (``--json`` files, one or more).

    python benchmarks/plot_width.py benchmarks/results/width_sweep_2026-12-01.json --out docs/width_sweep_step_time.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {"dense-inductor": "dense, inductor", "dense-inductor-cg": "dense, inductor + CUDA graphs",
          "ttm": "TT-matrix r32", "tt": "tt r32", "btt": "btt r1 (Monarch; the planner's choice)", "btt-r4": "btt r4",
          "btt-after": "btt r1, after the copy kernel and btt_blocks (d 2048: blocks pinned)"}
# A row may carry ``dense_step_ms``, the dense inductor + CUDA graphs step of its own run: its ratio is then
# taken against that (rows gathered from several runs), else against the dense row of its width.


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("width_sweep_step_time.png"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for f in args.json for r in json.loads(f.read_text()) if r["model"].startswith("lm-d")]
    if not rows:
        raise SystemExit("no width-sweep rows (model lm-d*) in the given files")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        dense = {int(r["model"][4:]): r["step_ms"] for r in rows if r["variant"] == "dense-inductor-cg"}
        pts = sorted((int(r["model"][4:]), r["step_ms"], r.get("dense_step_ms", dense.get(int(r["model"][4:]))))
                     for r in rows if r["variant"] == variant)
        widths = [p[0] for p in pts]
        ax.plot(widths, [p[1] for p in pts], marker="o", label=LABELS.get(variant, variant))
        ratio = [(w, p[1] / p[2]) for w, p in zip(widths, pts) if p[2]]
        ax2.plot([w for w, _ in ratio], [q for _, q in ratio], marker="o", label=LABELS.get(variant, variant))
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(sorted({int(r["model"][4:]) for r in rows}))
        a.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        a.set_xlabel("model width d")
        a.grid(alpha=0.3)
    ax.set_ylabel("training step (ms, median)")
    ax.set_yscale("log")
    ax2.set_ylabel("step / dense inductor + CUDA graphs")
    ax2.axhline(0.6, color="grey", ls="--", lw=1)
    ax2.text(ax2.get_xlim()[0], 0.62, " target 0.6", color="grey", fontsize=8)
    ax.legend(fontsize=8)
    device = rows[0].get("device", "")
    fig.suptitle(f"Llama-style LM, 8 x 1024 tokens, bf16 ({device}, torch {rows[0].get('torch', '')})", fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
