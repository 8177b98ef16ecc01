"""Convergence check of the fused LM-head loss: does it train like the unfused loss?

Trains the example LM (``benchmarks/train_lm.py --preset gpu``: GPT-style, d_model 768, BPE vocabulary
16384, bf16 autocast, fused AdamW) four times through ``backend="comera"``, the same steps and data:

* ``unfused``: the ``cce`` pass off (``linear`` + ``cross_entropy`` compiled by Inductor), seed 0;
* ``unfused seed 1``: the same with seed 1: the run-to-run noise;
* ``exact``: the fused loss, ``cce_backward="exact"``, seed 0;
* ``filtered``: the fused loss, ``cce_backward="filtered"`` (the default) with the path pinned to
  ``cce_strategy="sparse"``, seed 0: the cost model would pick the exact ``chunked`` path at this
  shape, so without the pin filtering would never run. The model is dense, so its graph runs
  without CUDA graphs and the sparse rounds are taken (under capture they fall back to exact).

The fused runs pass ``cce_min_vocab=0`` so the pass fuses the head whatever its cost rule says. The
runs go concurrently on the one GPU as separate processes (``--sequential`` for one at a time). The
curves (train loss per step, validation loss at every eval) go to ``<out-dir>/convergence_cce.json``
and a plot to ``<out-dir>/convergence_cce.png``; the summary table gives, per run, the final and
mean-over-the-last-k validation losses and the largest |difference| from the unfused seed-0 run,
next to the same for the unfused seed-1 run (the noise).

    python benchmarks/convergence_cce.py                      # on a GPU: writes docs/convergence_cce.*
    python benchmarks/convergence_cce.py --plot-from docs/convergence_cce.json   # plot only (no GPU)
    python benchmarks/convergence_cce.py --smoke              # tiny CPU runs into a temporary folder
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "benchmarks" / "train_lm.py"
RUNS = {  # name -> (seed, compile options)
    "unfused": (0, {"passes": {"cce": False}}),
    "unfused seed 1": (1, {"passes": {"cce": False}}),
    "exact": (0, {"cce_backward": "exact", "cce_min_vocab": 0}),
    "filtered": (0, {"cce_backward": "filtered", "cce_min_vocab": 0, "cce_strategy": "sparse"}),
}
SMOKE = ["--preset", "cpu", "--steps", "12", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
         "--seq-len", "32", "--batch-size", "4", "--eval-every", "4", "--eval-batches", "2",
         "--max-corpus-mb", "0.3", "--no-cache"]


def command(name: str, out: Path, extra: list[str], smoke: bool) -> list[str]:
    seed, options = RUNS[name]
    base = SMOKE if smoke else ["--preset", "gpu"]
    return [sys.executable, str(TRAIN), *base, *extra, "--seed", str(seed), "--compile-options", json.dumps(options),
            "--out", str(out), "--no-progress", "--log-every", "100"]


def run_all(out_dir: Path, extra: list[str], smoke: bool, sequential: bool) -> dict:
    """Launch the runs (concurrently unless ``sequential``); returns name -> train_lm's log."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    logs, procs = {}, {}
    for name in RUNS:
        path = out_dir / f"run_{name.replace(' ', '_')}.json"
        stdout = open(out_dir / f"run_{name.replace(' ', '_')}.txt", "w")
        procs[name] = (subprocess.Popen(command(name, path, extra, smoke), env=env, stdout=stdout,
                                        stderr=subprocess.STDOUT), path, stdout)
        if sequential:
            procs[name][0].wait()
    for name, (proc, path, stdout) in procs.items():
        code = proc.wait()
        stdout.close()
        if code != 0:
            tail = (out_dir / f"run_{name.replace(' ', '_')}.txt").read_text()[-2000:]
            raise RuntimeError(f"run {name!r} failed (exit {code}):\n{tail}")
        logs[name] = json.loads(path.read_text())
    return logs


def curves(logs: dict) -> dict:
    """The parts of each log the comparison needs."""
    return {name: {"train": [(s["step"], s["loss"]) for s in log["steps"]],
                   "val": [(e["step"], e["val_loss"]) for e in log["evals"]],
                   "tokens_per_s": log.get("tokens_per_s"), "peak_memory_bytes": log.get("peak_memory_bytes"),
                   "args": {k: log["args"].get(k) for k in ("steps", "seed", "compile_options", "d_model",
                                                            "vocab_size", "batch_size", "seq_len", "precision")}}
            for name, log in logs.items()}


def smoothed(points: list, window: int) -> list[float]:
    values = [v for _, v in points]
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def summary(data: dict, last_k: int, window: int) -> list[dict]:
    """Per run: final and mean-over-the-last-k validation loss, and the largest |difference| of
    the validation and smoothed train curves from the unfused seed-0 run."""
    base = data["unfused"]
    rows = []
    for name, run in data.items():
        val = [v for _, v in run["val"]]
        dval = max(abs(a - b) for a, b in zip(val, [v for _, v in base["val"]]))
        dtrain = max(abs(a - b) for a, b in zip(smoothed(run["train"], window), smoothed(base["train"], window)))
        tail = val[-last_k:]
        rows.append({"run": name, "final_val": val[-1], f"mean_val_last_{last_k}": sum(tail) / len(tail),
                     "max_abs_dval": dval, "max_abs_dtrain_smoothed": dtrain,
                     "tokens_per_s": run["tokens_per_s"], "peak_memory_mib": (run["peak_memory_bytes"] or 0) / 2**20})
    return rows


def print_table(rows: list[dict], last_k: int, window: int) -> None:
    noise = next(r for r in rows if r["run"] == "unfused seed 1")
    print(f"| run | final val | mean val (last {last_k}) | max abs(dval) vs unfused | max abs(dtrain), "
          f"{window}-step mean | tokens/s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(f"| {r['run']} | {r['final_val']:.4f} | {r[f'mean_val_last_{last_k}']:.4f} | {r['max_abs_dval']:.4f} | "
              f"{r['max_abs_dtrain_smoothed']:.4f} | {tps} | {r['peak_memory_mib']:,.0f} |")
    for r in rows:
        if r["run"] in ("exact", "filtered"):
            within = r["max_abs_dval"] <= noise["max_abs_dval"]
            print(f"{r['run']}: max abs(dval) {r['max_abs_dval']:.4f} {'<=' if within else '>'} seed noise "
                  f"{noise['max_abs_dval']:.4f}: {'within' if within else 'OUTSIDE'} run-to-run noise")


def plot(data: dict, path: Path, window: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib unavailable: no plot (run again with --plot-from on a machine that has it)")
        return
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in data.items():
        steps = [s for s, _ in run["train"]]
        ax_train.plot(steps, smoothed(run["train"], window), label=name, lw=1.2)
        ax_val.plot([s for s, _ in run["val"]], [v for _, v in run["val"]], marker="o", ms=3, label=name)
    ax_train.set(xlabel="step", ylabel=f"train loss ({window}-step mean)", title="train loss")
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fused LM-head loss (exact, filtered) against the unfused loss, two seeds for the noise")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=None, help="default: docs/ (a temporary folder with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    ap.add_argument("--last-k", type=int, default=3, help="evals averaged for the mean validation loss")
    ap.add_argument("--window", type=int, default=50, help="steps in the train-loss running mean")
    ap.add_argument("--sequential", action="store_true", help="one run at a time")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU runs (checks the driver, not convergence)")
    ap.add_argument("--plot-from", type=Path, default=None, help="only plot and summarize this JSON")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        data = json.loads(args.plot_from.read_text())["runs"]
        out_dir = args.out_dir or args.plot_from.parent
    else:
        out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="convergence_cce_")) if args.smoke else ROOT / "docs")
        out_dir.mkdir(parents=True, exist_ok=True)
        extra = ["--steps", str(args.steps)] if args.steps else []
        window = min(args.window, 4) if args.smoke else args.window
        args.window = window
        t0 = time.time()
        runs_dir = Path(tempfile.mkdtemp(prefix="convergence_cce_runs_"))  # per-run logs and stdout
        data = curves(run_all(runs_dir, extra, args.smoke, args.sequential or args.smoke))
        print(f"{len(RUNS)} runs in {time.time() - t0:.0f}s")
    rows = summary(data, args.last_k, args.window)
    (out_dir / "convergence_cce.json").write_text(json.dumps({"runs": data, "summary": rows}, indent=1))
    print_table(rows, args.last_k, args.window)
    plot(data, out_dir / "convergence_cce.png", args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
