"""Does a tensorized model keep its quality? Named configurations of ``examples/train_lm.py --preset gpu``
trained at equal steps and tokens, side by side on one GPU, collected into a table and plots.

    python benchmarks/quality_study.py --list                            # the configurations
    python benchmarks/quality_study.py --out-dir study --configs first --deadline-s 530   # one GPU call
    python benchmarks/quality_study.py --out-dir study --configs dense,ttm-r32,adapt-r64 --steps 800
    python benchmarks/quality_study.py --out-dir study --timing --configs dense,ttm-r32   # step time, one at a time
    python benchmarks/quality_study.py --out-dir smoke --smoke           # CPU, tiny sizes: checks the pipeline

Runs are separate processes (``--concurrency`` at a time): validation loss does not depend on speed, so
they share the GPU. A run that needs another's checkpoint (``svd-*`` start from ``dense``) starts when
that one is done. ``--deadline-s`` stops what is still running in time to write the results: each run
updates its JSON at every evaluation, so a stopped run reports its last validation loss (marked).
Step times measured side by side are inflated by the sharing; ``--timing`` runs the configurations
alone for ``--timing-steps`` steps and the table takes step time and memory from there when present
(``--trained``: from the models the study saved, e.g. at the ranks rank adaptation ended with).

Writes ``<out-dir>/runs/<config>.json`` (train_lm's logs), ``<config>.pt`` (the final models),
``logs/runs-<config>.txt`` (their output),
``results.md`` (the table), ``results.json``, and the plots ``val_loss.png``, ``loss_vs_compression.png``
and ``rank_adaptation.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_LM = ROOT / "examples" / "train_lm.py"

SMOKE_ARGS = ["--device", "cpu", "--precision", "fp32", "--d-model", "128", "--n-layers", "2", "--n-heads", "2",
              "--vocab-size", "512", "--max-corpus-mb", "1", "--eval-batches", "2", "--backend", "eager"]
SMOKE_RANK_DIVISOR = 8  # the smoke model is 6x narrower: ranks 16 / 32 / 64 become 2 / 4 / 8
SMOKE_SIZES = {"steps": 20, "batch_size": 4, "seq_len": 32, "eval_every": 10, "concurrency": 2}


@dataclass(frozen=True)
class Config:
    """One run: train_lm flags on top of ``--preset gpu`` and the study's shared flags.

    ``{ckpt:NAME}`` in ``args`` is the checkpoint of run NAME (which then runs first and saves one).
    ``iso_of``: a dense model as wide as gives the parameter count of run ``iso_of``.
    ``match``: ``{kind: run}``: this run's rank for that layer kind is the one whose parameter count
    is closest to the same kind's in that run (e.g. fmt tt against ttm at equal parameters).
    ``target_like``: ``--rank-adapt`` aims at the whole-model compression of that run.
    ``steps_scale``: a fraction of the study's steps (fine-tuning from a checkpoint).
    """

    doc: str
    args: tuple[str, ...] = ()
    iso_of: str | None = None
    match: dict = field(default_factory=dict)
    target_like: str | None = None
    steps_scale: float = 1.0


TTM = ("--fmt", "ttm")
# Each pruning event that changes shapes costs a recompile (~a minute with 13 runs compiling side by side):
# the study's rank-adaptive runs prune every 200 steps.
ADAPT = ("--rank-adapt-options", '{"prune_every": 200}')
EMB_STD = ("--tt-init-std", "emb=0.02")  # the dense model's embedding init (tensorize_'s default for Embedding is 1)
CONFIGS: dict[str, Config] = {
    # the baselines
    "dense": Config("dense baseline, seed 0"),
    "dense-s1": Config("dense, seed 1 (seed noise)", ("--seed", "1")),
    "dense-iso": Config("dense, narrower: the parameters of ttm-r32", iso_of="ttm-r32"),
    "defaults": Config("tensorize_ defaults on every layer (tied head/embedding skipped)",
                       ("--tensorize", "default", "--compress", "attn,mlp,tok,pos,head")),
    # fixed ranks
    "ttm-r16": Config("blocks ttm rank 16", ("--tensorize", "16") + TTM),
    "ttm-r32": Config("blocks ttm rank 32", ("--tensorize", "32") + TTM),
    "ttm-r64": Config("blocks ttm rank 64", ("--tensorize", "64") + TTM),
    "tt-r32": Config("blocks tt rank 32", ("--tensorize", "32", "--fmt", "tt")),
    # rank adaptation
    "adapt-r64": Config("rank-adaptive from ttm r64 to the size of ttm-r32 (RankAdaptation defaults, pruning every "
                        "200 steps)", ("--tensorize", "64") + TTM + ADAPT, target_like="ttm-r32"),
    "adapt-r64-g05": Config("adapt-r64 with gamma 0.5 (half the default push)",
                            ("--tensorize", "64", "--rank-adapt-options", '{"gamma": 0.5, "prune_every": 200}') + TTM,
                            target_like="ttm-r32"),
    "adapt-r64-to16": Config("rank-adaptive from ttm r64 to the size of ttm-r16", ("--tensorize", "64") + TTM + ADAPT,
                             target_like="ttm-r16"),
    "adapt-r64-flops": Config("adapt-r64 with the FLOPs-weighted penalty",
                              ("--tensorize", "64", "--rank-adapt-options", '{"weight": "flops", "prune_every": 200}')
                              + TTM, target_like="ttm-r32"),
    "svd-r64": Config("TT-SVD of the trained dense model at r64, then rank adaptation to ttm-r32's size (gates at "
                      "30x lr, pruning every 50 steps: the fine-tune is short)",
                      ("--init-from", "{ckpt:dense}", "--tt-init", "svd", "--tensorize", "64", "--gate-lr-scale", "30",
                       "--rank-adapt-options", '{"prune_every": 50}') + TTM, target_like="ttm-r32", steps_scale=0.1),
    "svd-r32": Config("TT-SVD of the trained dense model at r32, fine-tuned at fixed rank",
                      ("--init-from", "{ckpt:dense}", "--tt-init", "svd", "--tensorize", "32") + TTM, steps_scale=0.1),
    # formats per layer kind, at equal parameters
    "tt-attn": Config("attention tt, MLP ttm: parameters of ttm-r32 per kind",
                      ("--tensorize", "32", "--fmt", "attn=tt,mlp=ttm"), match={"attn": "ttm-r32"}),
    "tt-mlp": Config("attention ttm, MLP tt: parameters of ttm-r32 per kind",
                     ("--tensorize", "32", "--fmt", "attn=ttm,mlp=tt"), match={"mlp": "ttm-r32"}),
    "tt-all": Config("blocks tt: parameters of ttm-r32 per kind", ("--tensorize", "32", "--fmt", "tt"),
                     match={"attn": "ttm-r32", "mlp": "ttm-r32"}),
    "ttm-r32-fused": Config("ttm-r32 with one fused qkv projection", ("--tensorize", "32", "--qkv", "fused") + TTM),
    # embeddings
    "ttm-r32+pos": Config("ttm-r32 and the position table (ttm, init std 0.02)",
                          ("--tensorize", "32", "--compress", "attn,mlp,pos") + TTM + EMB_STD),
    "ttm-r32+pos-std1": Config("ttm-r32+pos with tensorize_'s default embedding init (std 1)",
                               ("--tensorize", "32", "--compress", "attn,mlp,pos") + TTM),
    "ttm-r32+pos-tt": Config("ttm-r32 and the position table (tt, parameters of the ttm one)",
                             ("--tensorize", "32", "--compress", "attn,mlp,pos", "--fmt", "attn=ttm,mlp=ttm,emb=tt")
                             + EMB_STD, match={"pos": "ttm-r32+pos"}),
    "ttm-r32+tok": Config("ttm-r32 and the token table (ttm, init std 0.02; head untied, dense)",
                          ("--tensorize", "32", "--compress", "attn,mlp,tok", "--head", "untied") + TTM + EMB_STD),
    "ttm-r32+tok-shared": Config("ttm-r32 and the tied token embedding/head as one shared ttm (init std 0.02)",
                                 ("--tensorize", "32", "--compress", "attn,mlp,tok", "--tied", "share") + TTM + EMB_STD),
    "dense-iso-all": Config("dense, narrower: the parameters of ttm-r32+tok-shared", iso_of="ttm-r32+tok-shared"),
    "dense-untied": Config("dense with an untied head (the reference of ttm-r32+tok)", ("--head", "untied")),
    # the fused LM-head loss against the model's own (the dense runs): issue 11's convergence check
    "dense-cce-exact": Config("dense, the head's loss fused (cce_min_vocab=0), exact gradient",
                              ("--compile-options", '{"cce_min_vocab": 0, "cce_backward": "exact"}')),
    "dense-cce-filtered": Config("dense, the head's loss fused (cce_min_vocab=0), filtered gradient",
                                 ("--compile-options", '{"cce_min_vocab": 0, "cce_backward": "filtered"}')),
    # at this shape the cost model picks the exact chunked path even when filtering is allowed: pin
    # the sparse (filtered) path so that filtering actually runs
    "dense-cce-sparse": Config("dense, the head's loss fused on the sparse path: filtered gradient",
                               ("--compile-options",
                                '{"cce_min_vocab": 0, "cce_backward": "filtered", "cce_strategy": "sparse"}')),
    # optimizer settings of the TT cores and gates (param_groups' defaults: gates at 10x lr, no core decay)
    "ttm-r32-gate1x": Config("ttm-r32 with the gates at the cores' lr", ("--tensorize", "32", "--gate-lr-scale", "1")
                             + TTM),
    "ttm-r32-corewd": Config("ttm-r32 with weight decay 0.1 on the cores",
                             ("--tensorize", "32", "--core-weight-decay", "0.1") + TTM),
    "ttm-r32-corelr3": Config("ttm-r32 with the cores at 3x lr", ("--tensorize", "32", "--core-lr-scale", "3") + TTM),
}
GROUPS = {  # two GPU calls of at most 10 minutes each (the rest are extras)
    "first": ["dense", "dense-s1", "dense-iso", "defaults", "ttm-r16", "ttm-r32", "ttm-r64", "adapt-r64", "svd-r64",
              "svd-r32"],
    "second": ["adapt-r64-to16", "adapt-r64-g05", "adapt-r64-flops", "tt-r32", "tt-attn", "tt-mlp", "ttm-r32-fused",
               "ttm-r32+pos", "ttm-r32+pos-std1", "ttm-r32+tok-shared", "dense-iso-all", "ttm-r32-gate1x",
               "ttm-r32-corewd"],
}


def load_train_lm():
    spec = importlib.util.spec_from_file_location("study_train_lm", TRAIN_LM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ sizing


class Sizer:
    """Parameter counts of configurations, from their models built on the meta device (no memory)."""

    def __init__(self, train_lm, base: list[str]):
        self.train_lm = train_lm
        self.base = base
        self.vocab = None
        self._counts: dict[tuple, dict[str, int]] = {}

    def model(self, flags: list[str]):
        args = self.train_lm.parse_args(["--preset", "gpu"] + self.base + flags)
        model = self.train_lm.build_model(args, self.vocab, device="meta")
        if args.tensorize is not None:
            with _quiet():
                self.train_lm.compress(model, args)
        return model, args

    def counts(self, flags: list[str]) -> dict[str, int]:
        """``{"total": parameters, kind: TT parameters of that kind}``, remembered per flags."""
        key = tuple(flags)
        if key not in self._counts:
            model, _ = self.model(flags)
            counts = {"total": sum(p.numel() for p in model.parameters())}
            for lay in self.train_lm.cc.iter_tt_layers(model):
                kind = self.train_lm.layer_kind(lay.fqn)
                counts[kind] = counts.get(kind, 0) + sum(p.numel() for p in list(lay.cores) + list(lay.gates))
            self._counts[key] = counts
        return self._counts[key]

    def params(self, flags: list[str]) -> int:
        return self.counts(flags)["total"]

    def kind_params(self, flags: list[str], kind: str) -> int:
        return self.counts(flags).get(kind, 0)

    def compression(self, flags: list[str]) -> float:
        model, args = self.model(flags)
        dense = self.train_lm.build_model(args, self.vocab, device="meta")
        return sum(p.numel() for p in dense.parameters()) / sum(p.numel() for p in model.parameters())

    def iso_width(self, target: int, flags: list[str]) -> list[str]:
        """--d-model (a multiple of 64, heads of 64) whose dense model is closest to ``target`` parameters."""
        best = None
        for width in range(64, 4097, 64):
            shape = ["--d-model", str(width), "--n-heads", str(width // 64)]
            gap = abs(self.params(flags + shape) - target)
            if best is None or gap < best[0]:
                best = (gap, shape)
        return best[1]

    def matched_rank(self, flags: list[str], kind: str, target: int) -> int:
        """The rank of ``kind`` (others as in ``flags``) whose parameter count is closest to ``target``."""
        def count(rank: int) -> float:  # a rank too large to compress leaves the layers dense: past any target
            return self.kind_params(with_rank(flags, kind, rank), kind) or math.inf

        lo, hi = 1, 512
        while lo < hi:  # parameters grow with the rank: the first rank at or above the target
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
        return min((max(lo - 1, 1), lo), key=lambda r: abs(count(r) - target))


def with_rank(flags: list[str], kind: str, rank: int) -> list[str]:
    """``flags`` with ``--tensorize`` giving ``kind`` its own rank (other kinds keep theirs)."""
    flags = list(flags)
    i = flags.index("--tensorize")
    current = flags[i + 1]
    ranks = dict(item.split("=") for item in current.split(",")) if "=" in current else {}
    if not ranks:
        ranks = {k: current for k in ("attn", "mlp", "tok", "pos", "head")}
    ranks[kind] = str(rank)
    flags[i + 1] = ",".join(f"{k}={v}" for k, v in ranks.items())
    return flags


class _quiet:
    """Silence stdout and warnings while sizing (tensorize_ prints its report)."""

    def __enter__(self):
        import contextlib
        import io
        import warnings

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        self._stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._stack.close()


# ------------------------------------------------------------------------------------------------ planning


@dataclass
class Run:
    name: str
    flags: list[str]
    needs: list[str]
    doc: str
    json: Path
    log: Path
    process: subprocess.Popen | None = None
    started: float | None = None
    status: str = "pending"  # pending, running, done, failed, stopped, skipped


def resolve(name: str, opts: argparse.Namespace, sizer: Sizer, out: Path) -> tuple[list[str], list[str]]:
    """The run's train_lm flags (every special field resolved) and the runs it needs first.
    Checkpoints go to ``out`` (the timing pass's to ``out/timing``, so they never replace the study's)."""
    cfg = CONFIGS[name]
    out = out / "timing" if opts.timing else out
    flags, needs = [], []
    for arg in _smoke_ranks(cfg.args) if opts.smoke else cfg.args:
        if arg.startswith("{ckpt:"):
            dep = arg[len("{ckpt:"):-1]
            needs.append(dep)
            arg = str(out / f"{dep}.pt")
        flags.append(arg.replace("{out}", str(out)))
    if cfg.iso_of:
        flags += sizer.iso_width(sizer.params(resolve(cfg.iso_of, opts, sizer, out)[0]), flags)
    for kind, ref in cfg.match.items():
        target = sizer.kind_params(resolve(ref, opts, sizer, out)[0], kind)
        flags = with_rank(flags, kind, sizer.matched_rank(flags, kind, target))
    if cfg.target_like:
        flags += ["--rank-adapt", f"{sizer.compression(resolve(cfg.target_like, opts, sizer, out)[0]):.4g}"]
    if cfg.steps_scale != 1.0:
        flags += ["--steps", str(max(1, round(opts.steps * cfg.steps_scale)))]
    return flags, needs


def _smoke_ranks(args: tuple[str, ...]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--tensorize" and out[i + 1].isdigit():
            out[i + 1] = str(max(2, int(out[i + 1]) // SMOKE_RANK_DIVISOR))
    return out


def shared_flags(opts: argparse.Namespace) -> list[str]:
    flags = ["--steps", str(opts.steps), "--batch-size", str(opts.batch_size), "--seq-len", str(opts.seq_len),
             "--eval-every", str(opts.eval_every), "--no-progress", "--cache-dir", str(opts.cache_dir)]
    if opts.smoke:
        flags += SMOKE_ARGS
    return flags + opts.extra.split()


def plan(opts: argparse.Namespace, names: list[str], train_lm) -> list[Run]:
    out = opts.out_dir
    base = shared_flags(opts)
    sizer = Sizer(train_lm, base)
    sizer.vocab = prepare_data(train_lm, base)
    runs, order = {}, list(names)
    while order:
        name = order.pop(0)
        if name in runs:
            continue
        flags, needs = resolve(name, opts, sizer, out)
        order += [n for n in needs if n not in runs]
        sub = "timing" if opts.timing else "runs"
        trained = out / f"{name}.pt"  # every study run saves its final model
        if not opts.timing:
            flags += ["--save", str(trained)]
        elif opts.trained and trained.exists():
            flags += ["--init-from", str(trained)]  # time the model the study ended with (pruned ranks)
        runs[name] = Run(name, base + flags, needs, CONFIGS[name].doc, out / sub / f"{name}.json",
                         out / "logs" / f"{sub}-{name}.txt")
    if opts.timing:
        for run in runs.values():
            run.flags += ["--steps", str(opts.timing_steps), "--eval-every", "0", "--eval-batches", "1"]
    return sorted(runs.values(), key=lambda r: (not any(r.name in o.needs for o in runs.values()), names.index(r.name)
                                                if r.name in names else -1))


def prepare_data(train_lm, base: list[str]) -> int:
    """Train the tokenizer and tokenize the corpus once, into the cache the runs read; the vocabulary size."""
    args = train_lm.parse_args(["--preset", "gpu"] + base)
    max_bytes = int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None
    data = train_lm.load_token_data(args.tokenizer, args.vocab_size, max_bytes=max_bytes, cache_dir=args.cache_dir)
    print(f"data: {data.tokenizer.name} vocabulary {data.tokenizer.vocab_size}, {data.train.numel():,} train / "
          f"{data.val.numel():,} validation tokens ({'cached' if data.from_cache else 'built'} in {data.cache})",
          flush=True)
    return data.tokenizer.vocab_size


# ------------------------------------------------------------------------------------------------ running


def launch(run: Run, opts: argparse.Namespace) -> None:
    run.json.parent.mkdir(parents=True, exist_ok=True)
    run.log.parent.mkdir(parents=True, exist_ok=True)
    run.json.unlink(missing_ok=True)
    threads = str(max(1, (os.cpu_count() or 2) // max(1, opts.concurrency)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cmd = [sys.executable, str(TRAIN_LM), "--preset", "gpu"] + run.flags + ["--out", str(run.json)]
    with open(run.log, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        run.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    run.started = time.monotonic()
    run.status = "running"
    print(f"[{_clock()}] start {run.name}", flush=True)


def execute(runs: list[Run], opts: argparse.Namespace) -> None:
    """Run everything, ``opts.concurrency`` at a time, each after the runs it needs; stop at the deadline."""
    deadline = time.monotonic() + opts.deadline_s if opts.deadline_s else None
    by_name = {r.name: r for r in runs}
    while True:
        for run in runs:
            if run.status == "running" and run.process.poll() is not None:
                run.status = "done" if run.process.returncode == 0 else "failed"
                print(f"[{_clock()}] {run.status} {run.name} ({time.monotonic() - run.started:.0f}s)", flush=True)
        for run in runs:
            if run.status == "pending" and any(by_name[n].status in ("failed", "skipped", "stopped")
                                               for n in run.needs):
                run.status = "skipped"
        running = sum(r.status == "running" for r in runs)
        for run in runs:
            if running >= opts.concurrency:
                break
            if run.status == "pending" and all(by_name[n].status == "done" for n in run.needs):
                launch(run, opts)
                running += 1
        if not any(r.status in ("pending", "running") for r in runs):
            return
        if deadline is not None and time.monotonic() > deadline:
            stop_all(runs)
            return
        time.sleep(1.0)


def stop_all(runs: list[Run]) -> None:
    print(f"[{_clock()}] deadline: stopping {[r.name for r in runs if r.status == 'running']}", flush=True)
    for run in runs:
        if run.status == "running":
            run.process.terminate()
    for run in runs:
        if run.status == "running":
            try:
                run.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                run.process.kill()
            run.status = "stopped"
        elif run.status == "pending":
            run.status = "skipped"


def _clock() -> str:
    return time.strftime("%H:%M:%S")


# ------------------------------------------------------------------------------------------------ results


def collect(runs: list[Run], out: Path) -> list[dict]:
    """One row per run: what its JSON log says (the timing pass's step time and memory when there is one)."""
    rows = []
    for run in runs:
        log = json.loads(run.json.read_text()) if run.json.exists() else {}
        timing_path = out / "timing" / f"{run.name}.json"
        timing = json.loads(timing_path.read_text()) if timing_path.exists() and run.json != timing_path else {}
        rows.append(row(run, log, timing))
    return rows


def row(run: Run, log: dict, timing: dict) -> dict:
    evals = log.get("evals") or []
    steps = log.get("steps") or []
    source = timing if timing.get("complete") else log
    params = evals[-1]["parameters"] if evals else log.get("parameters")
    args = log.get("args", {})
    return {
        "config": run.name, "doc": run.doc, "status": run.status, "complete": bool(log.get("complete")),
        "steps_done": len(steps), "steps": args.get("steps"),
        "tokens": len(steps) * args.get("batch_size", 0) * args.get("seq_len", 0),
        "val_loss": evals[-1]["val_loss"] if evals else None, "eval_step": evals[-1]["step"] if evals else None,
        "evals": [(e["step"], e["val_loss"]) for e in evals],
        "dense_parameters": log.get("dense_parameters"), "parameters": params,
        "compression": log["dense_parameters"] / params if params else None,
        "block_compression": log.get("block_compression") or _block_ratio(log),
        "step_time_s": source.get("step_time_s") or _median_step(steps),
        "step_time_alone": bool(timing) or run.json.parent.name == "timing",
        "peak_memory_bytes": source.get("peak_memory_bytes"),
        "peak_memory_reserved_bytes": source.get("peak_memory_reserved_bytes"),
        "first_prune_step": log.get("first_prune_step"), "flags": " ".join(run.flags),
        "rank_history": [(h["step"], h["compression"]) for h in log.get("rank_history", [])],
    }


def _block_ratio(log: dict) -> float | None:
    dense, now = log.get("block_dense_parameters"), log.get("block_parameters")
    return dense / now if dense and now else None


def _median_step(steps: list[dict]) -> float | None:
    seconds = sorted(s["seconds"] for s in steps[max(1, len(steps) // 10):])
    return seconds[len(seconds) // 2] if seconds else None


def table(rows: list[dict]) -> str:
    dense_row = next((r for r in rows if r["config"] == "dense"), None)
    dense = dict(dense_row["evals"]) if dense_row else {}  # step -> val loss
    head = ("config", "val loss", "vs dense", "parameters", "compression", "blocks", "step ms", "peak GiB (alloc / "
            "reserved)", "steps", "what")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        loss = r["val_loss"]
        ref = dense.get(r["eval_step"])  # dense at the same step (a stopped run may have fewer)
        if dense_row and r["steps"] != dense_row["steps"] and dense_row["complete"]:
            ref = dense_row["val_loss"]  # a fine-tune of the trained dense model: against where dense ended
        rel = f"{100 * (loss / ref - 1):+.1f} %" if loss is not None and ref else ""
        step = f"{1e3 * r['step_time_s']:.0f}{'' if r['step_time_alone'] else '*'}" if r["step_time_s"] else ""
        mem = (f"{r['peak_memory_bytes'] / 2**30:.1f} / {r['peak_memory_reserved_bytes'] / 2**30:.1f}"
               if r["peak_memory_bytes"] else "")
        done = f"{r['eval_step']}/{r['steps']}" + ("" if r["complete"] else f" ({r['status']})")
        lines.append("| " + " | ".join([
            r["config"], f"{loss:.4f}" if loss is not None else r["status"], rel,
            f"{r['parameters']:,}" if r["parameters"] else "", _ratio(r["compression"]), _ratio(r["block_compression"]),
            step, mem, done if r["eval_step"] else r["status"], r["doc"]]) + " |")
    lines.append("")
    lines.append("vs dense: against the dense run's validation loss at the same step (a shorter fine-tune: at its "
                 "end). step ms: median step time; "
                 "* measured side by side with the other runs (inflated by the sharing), otherwise alone (--timing). "
                 "steps: the step of the last validation / the run's steps.")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:.1f}x" if x else ""


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    written = []
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        if r["evals"]:
            xs, ys = zip(*r["evals"])
            ax.plot(xs, ys, marker=".", lw=1, label=r["config"], ls="--" if r["config"].startswith("dense") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, out / "val_loss.png", plt))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["val_loss"] is not None and r["block_compression"]:
            ax.scatter(r["block_compression"], r["val_loss"], s=18)
            ax.annotate(r["config"], (r["block_compression"], r["val_loss"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("compression of the transformer blocks (dense / parameters)")
    ax.set_ylabel("final validation loss")
    written.append(_save(fig, out / "loss_vs_compression.png", plt))

    adaptive = [r for r in rows if r["rank_history"]]
    if adaptive:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in adaptive:
            xs, ys = zip(*r["rank_history"])
            ax.plot(xs, ys, label=r["config"])
        ax.set_xlabel("step")
        ax.set_ylabel("whole-model compression")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "rank_adaptation.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(runs: list[Run], opts: argparse.Namespace) -> None:
    out = opts.out_dir
    rows = collect(runs, out)
    text = table(rows)
    (out / ("timing.md" if opts.timing else "results.md")).write_text(text + "\n")
    (out / ("timing.json" if opts.timing else "results.json")).write_text(json.dumps(rows, indent=1))
    print(text)
    if not opts.timing:
        for path in plots(rows, out):
            print(f"plot: {path}")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("study"))
    p.add_argument("--configs", default="all",
                   help=f"comma-separated names (--list) or groups ({', '.join(GROUPS)}: one GPU call each), or all")
    p.add_argument("--list", action="store_true", help="print the configurations and their flags, run nothing")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=13, help="runs at a time on the one GPU (--smoke: 2)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop the runs still going after this many seconds and report what they logged")
    p.add_argument("--extra", default="", help="more train_lm flags for every run, e.g. '--cuda-graphs'")
    p.add_argument("--cache-dir", type=Path, default=None, help="tokenizer cache (default: <out-dir>/cache)")
    p.add_argument("--timing", action="store_true", help="run each configuration alone, --timing-steps steps")
    p.add_argument("--timing-steps", type=int, default=40)
    p.add_argument("--trained", action="store_true",
                   help="with --timing: start each configuration from the model the study saved "
                        "(<out-dir>/<config>.pt), so a rank-adapted one is timed at its final ranks")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the table and plots from the JSON logs already in <out-dir>/runs (and timing/), "
                        "e.g. after copying two calls' runs/ into one folder")
    p.add_argument("--smoke", action="store_true",
                   help=f"CPU, tiny model and data, eager: checks the pipeline (defaults {SMOKE_SIZES})")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE_SIZES)
    opts = p.parse_args(argv)
    names = []
    for item in (n for n in opts.configs.split(",") if n):
        names += list(CONFIGS) if item == "all" else GROUPS.get(item, [item])
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; valid: {', '.join(CONFIGS)}")
    opts.names = names
    opts.out_dir = opts.out_dir.resolve()  # the runs start in the repository root
    opts.cache_dir = (opts.cache_dir or opts.out_dir / "cache").resolve()
    if opts.timing:
        opts.concurrency = 1
    return opts


def logged_runs(opts: argparse.Namespace) -> list[Run]:
    """The runs whose JSON logs are in ``<out-dir>/runs``, as the study left them."""
    runs = []
    for name in opts.names:
        path = opts.out_dir / "runs" / f"{name}.json"
        if path.exists():
            log = json.loads(path.read_text())
            flags = [] if "args" not in log else [f"{k}={v}" for k, v in log["args"].items() if v not in (None, False)]
            runs.append(Run(name, flags, [], CONFIGS[name].doc, path, opts.out_dir / "logs" / f"runs-{name}.txt",
                            status="done" if log.get("complete") else "stopped"))
    return runs


def main(argv: list[str] | None = None) -> list[dict]:
    opts = parse_args(argv)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    if opts.report_only:
        runs = logged_runs(opts)
        report(runs, opts)
        return collect(runs, opts.out_dir)
    train_lm = load_train_lm()
    runs = plan(opts, opts.names, train_lm)
    if opts.list:
        for run in runs:
            print(f"{run.name:16} {run.doc}\n{'':16} {' '.join(run.flags)}")
        return []
    start = time.monotonic()
    execute(runs, opts)
    print(f"[{_clock()}] all runs ended after {time.monotonic() - start:.0f}s", flush=True)
    report(runs, opts)
    return collect(runs, opts.out_dir)


if __name__ == "__main__":
    main()
