"""Loss and compression over training from benchmarks/train_lm.py JSON logs (``--out``).

    python benchmarks/plot_rank_adaptation.py dense.json tt.json adaptive.json --labels dense "TT r16" adaptive \\
        --out docs/rank_adaptation_loss_compression.png

Needs matplotlib. Prints a table of the final numbers (markdown) as well.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smooth", type=int, default=20, help="moving-average window of the training loss")
    args = p.parse_args()
    labels = args.labels or [f.stem for f in args.logs]
    if len(labels) != len(args.logs):
        p.error("one label per log")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ratio) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    rows = []
    for path, label in zip(args.logs, labels):
        log = json.loads(path.read_text())
        steps = [s["step"] for s in log["steps"]]
        losses = [s["loss"] for s in log["steps"]]
        dense = log["dense_parameters"]
        ratios = [s.get("compression", dense / log["parameters"]) for s in log["steps"]]
        ax_loss.plot(steps, smooth(losses, args.smooth), label=f"{label} (train, {args.smooth}-step mean)", lw=1)
        evals = log["evals"]
        ax_loss.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o--", ms=3, lw=0.8,
                     label=f"{label} (val)")
        ax_ratio.plot(steps, ratios, label=label)
        tail = losses[-50:]
        rows.append((label, log["parameters"], log.get("final_parameters", log["parameters"]),
                     log.get("compression", dense / log["parameters"]), sum(tail) / len(tail),
                     evals[-1]["val_loss"], log.get("tokens_per_s")))
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.set_ylim(top=min(ax_loss.get_ylim()[1], 4.0))
    ax_loss.legend(fontsize=7)
    ax_ratio.set_ylabel("compression (dense / parameters)")
    ax_ratio.set_xlabel("step")
    ax_ratio.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    print("| run | parameters at start | at end | compression at end | train loss (last 50 steps) | val loss | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for label, start, end, ratio, train, val, tps in rows:
        print(f"| {label} | {start:,} | {end:,} | {ratio:.1f}x | {train:.3f} | {val:.3f} | "
              f"{tps:,.0f} |" if tps else f"| {label} | {start:,} | {end:,} | {ratio:.1f}x | {train:.3f} | {val:.3f} | n/a |")


if __name__ == "__main__":
    main()
