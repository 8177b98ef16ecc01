"""Final validation loss against parameters for every row of the quality benchmark and its follow-ups
(each point a seed; the dense rows joined), from a results file such as
``benchmarks/results/quality_2026-12-02.json``.

    python benchmarks/plot_quality_summary.py benchmarks/results/quality_2026-12-02.json --out docs/quality_summary.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"dense": "black", "TT-matrix": "tab:blue", "btt": "tab:green", "bottleneck": "tab:red"}


def _labels(rows: list[dict], gap: float = 0.028) -> list:
    """Each row's label beside its best point, spread vertically within a column of points at about
    the same parameter count (within 10 %) so that no two overlap."""
    points = sorted(((r["parameters"] / 1e6, min(r["val_loss"]), r["row"]) for r in rows), key=lambda p: p[0])
    columns: list[list] = []
    for p in points:
        if columns and p[0] <= columns[-1][0][0] * 1.1:
            columns[-1].append(p)
        else:
            columns.append([p])
    out = []
    for column in columns:
        column.sort(key=lambda p: p[1])
        placed = []
        for x, y, text in column:
            ty = max(y, placed[-1] + gap) if placed else y
            placed.append(ty)
            out.append(((x, y), (max(q[0] for q in column) * 1.04, ty), text))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=Path("quality_summary.png"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.results.read_text())
    rows = data["rows"]
    if not rows or any(not r.get("val_loss") for r in rows):
        raise SystemExit(f"{args.results}: every row needs at least one val_loss")
    fig, ax = plt.subplots(figsize=(10, 6))
    dense = sorted((r for r in rows if r["family"] == "dense"), key=lambda r: r["parameters"])
    ax.plot([r["parameters"] / 1e6 for r in dense], [min(r["val_loss"]) for r in dense], color="black", lw=1,
            label="dense (best seed)")
    seen = set()
    for r in rows:
        color = COLORS.get(r["family"], "tab:gray")
        label = r["family"] if r["family"] not in seen else None
        seen.add(r["family"])
        ax.scatter([r["parameters"] / 1e6] * len(r["val_loss"]), r["val_loss"], color=color, s=18, label=label)
    for (x, y), (text_x, text_y), text in _labels(rows):
        ax.annotate(text, (x, y), xytext=(text_x, text_y), fontsize=7, va="center",
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="gray"))
    ax.set_xscale("log")
    ax.set_xlim(right=max(r["parameters"] for r in rows) / 1e6 * 1.3)  # room for the widest row's label
    ax.set_xlabel("parameters (millions, whole model)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("GPT d768, 31 M tokens: each row at its best lr, one point per seed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
