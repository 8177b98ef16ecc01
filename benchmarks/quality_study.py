"""Does a tensorized model keep its quality? Named configurations of ``benchmarks/train_lm.py --preset gpu``
trained at equal steps and tokens, side by side on one GPU, collected into a table and plots.

    python benchmarks/quality_study.py --list                            # the configurations
    python benchmarks/quality_study.py --out-dir study --configs first --deadline-s 530   # one GPU call
    python benchmarks/quality_study.py --out-dir study --configs dense,ttm-r32,adapt-r64 --steps 800
    python benchmarks/quality_study.py --out-dir study --timing --configs dense,ttm-r32   # step time, each alone
    python benchmarks/quality_study.py --out-dir qb --configs benchmark --lrs grid --concurrency 14
    python benchmarks/quality_study.py --out-dir smoke --smoke           # CPU, tiny sizes: checks the pipeline

The quality benchmark (``--configs benchmark``, ``benchmarks/quality_benchmark.sh``): dense, dense-iso (a
narrower dense model with the total parameters of ttm-r32; a second seed, dense-iso-s1), lowrank-iso (each
block Linear as two Linears ``d_in -> r -> d_out``, ``r`` giving the block parameters of ttm-r32), cola-iso
(the same with a SiLU between), btt-iso (block tensor-trains at those parameters), ttm-r32, tt-all (``"tt"``
at those parameters) and adapt-r64 (rank adaptation from r64 to ttm-r32's size), each at every learning rate
of ``--lrs`` (``grid``: each configuration's own three; runs ``NAME@LR``; ``--configs NAME@LR`` adds one);
``--configs next`` holds its follow-ups. On the ``python`` corpus
(train_lm's gpu preset: the standard library and the installed packages, 200 MB), every training window
seen at most once (train_lm stops a run that needs more than one epoch; the study checks before it starts).
The tables give each configuration at its best learning rate (``(edge)`` when that is the smallest or
largest tried), the tokens seen and the epochs; the plots the validation loss against steps, tokens and
seconds (step x the step time measured alone by ``--timing``, where there is one), and the final loss
against parameters with its Pareto front (``--plot-dir docs --plot-prefix NAME_`` puts them in docs/).

Runs are separate processes (``--concurrency`` at a time): validation loss does not depend on speed, so
they share the GPU. A run that needs another's checkpoint (``svd-*`` start from ``dense``, at the same
learning rate) starts when that one is done. ``--deadline-s`` (counted from the study's start, data
preparation included) stops what is still running in time to write the results: each run updates its JSON
at every evaluation, so a stopped run reports its last validation loss (marked). ``--abandon 0.1`` stops a
run that is more than 10 % above another learning rate of its configuration at the same validation step
(from 30 % of the steps on, ``--abandon-after``), so a sweep's hopeless points give the GPU to the runs
still pending. Step times measured side by side are inflated by the sharing; ``--timing`` times each
configuration alone (once, whatever ``--lrs`` says: all compile side by side, then each runs
its timed steps while the others wait, train_lm ``--barrier``) for ``--timing-steps`` steps and the
tables take step time and memory from there when present (``--trained``: from the models the study
saved, e.g. at the ranks rank adaptation ended with).

Writes ``<out-dir>/runs/<run>.json`` (train_lm's logs), ``<run>.pt`` (the final models),
``logs/runs-<run>.txt`` (their output), ``results.md`` (the best-lr table and every run's),
``results.json`` (every run), ``best.json`` (each configuration at its best lr), ``cache/`` (the tokenizer,
the tokens and the corpus' manifest), and the plots ``val_loss.png``, ``val_loss_vs_tokens.png``,
``val_loss_vs_seconds.png``, ``pareto.png``, ``loss_vs_compression.png`` and ``rank_adaptation.png``.
``--report-only`` makes the tables and plots again from the logs in ``<out-dir>/runs`` and ``timing/``
(e.g. after copying several calls' folders into one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_LM = ROOT / "benchmarks" / "train_lm.py"

SMOKE_ARGS = ["--device", "cpu", "--precision", "fp32", "--d-model", "128", "--n-layers", "2", "--n-heads", "2",
              "--vocab-size", "512", "--corpus", "python", "--max-corpus-mb", "0.2", "--eval-batches", "2",
              "--backend", "eager"]
SMOKE_RANK_DIVISOR = 8  # the smoke model is 6x narrower: ranks 16 / 32 / 64 become 2 / 4 / 8
SMOKE_WIDTH_DIVISOR = 16  # a configuration's own width: the width study's d 2048 becomes d 128
SMOKE_SIZES = {"steps": 20, "batch_size": 4, "seq_len": 32, "eval_every": 10, "concurrency": 2}


@dataclass(frozen=True)
class Config:
    """One run: train_lm flags on top of ``--preset gpu`` and the study's shared flags.

    ``{ckpt:NAME}`` in ``args`` is the checkpoint of run NAME (which then runs first and saves one);
    ``{steps/N}`` the study's steps divided by N.
    ``iso_of``: a dense model as wide as gives the parameter count of run ``iso_of``.
    ``lowrank_of``: the blocks' Linears as factored layers (``factor_flag R``: ``--lowrank`` plain
    low-rank products, ``--btt`` block tensor-trains), ``R`` the rank whose block parameter count is
    closest to that of run ``lowrank_of``.
    ``match``: ``{kind: run}``: this run's rank for that layer kind is the one whose parameter count
    is closest to the same kind's in that run (e.g. fmt tt against ttm at equal parameters).
    ``target_like``: ``--rank-adapt`` aims at the whole-model compression of that run.
    ``steps_scale``: a fraction of the study's steps (fine-tuning from a checkpoint).
    ``lrs``: the configuration's own learning-rate sweep (``--lrs grid``), centred where earlier runs
    put its best.
    ``timed_as``: the configuration whose ``--timing`` step time this one shares (the same model and step:
    another seed or warm-up).
    ``env``: environment settings of the run's process (e.g. ``COMERA_BTT_KEEP``), written at the head of
    its log with the command.
    """

    doc: str
    args: tuple[str, ...] = ()
    iso_of: str | None = None
    lowrank_of: str | None = None
    factor_flag: str = "--lowrank"
    match: dict = field(default_factory=dict)
    target_like: str | None = None
    steps_scale: float = 1.0
    lrs: tuple[float, ...] = ()
    timed_as: str | None = None
    env: dict = field(default_factory=dict)


TTM = ("--fmt", "ttm")
# Each pruning event that changes shapes costs a recompile (~a minute with 13 runs compiling side by side):
# the study's rank-adaptive runs prune every 200 steps.
ADAPT = ("--rank-adapt-options", '{"prune_every": 200}')
EMB_STD = ("--tt-init-std", "emb=0.02")  # the dense model's embedding init (tensorize_'s default for Embedding is 1)
# Learning-rate sweeps (--lrs grid), factor 2 apart, at batch 32 x 512: the wide dense model learns best
# lowest; the narrower and the factored ones higher (earlier one-epoch runs: dense 6e-4, dense-iso 1e-3,
# ttm-r32 3e-3 at the edge, tt 3e-3 diverged).
WIDE_LRS = (3e-4, 6e-4, 1.2e-3)
NARROW_LRS = (6e-4, 1.2e-3, 2.4e-3)
FACTORED_LRS = (1.2e-3, 2.4e-3, 4.8e-3)
HIGH_LRS = (2.4e-3, 4.8e-3, 9.6e-3)  # TT-matrix and BTT were best at the top of FACTORED_LRS
CONFIGS: dict[str, Config] = {
    # the baselines
    "dense": Config("dense baseline, seed 0", lrs=WIDE_LRS),
    "dense-s1": Config("dense, seed 1 (seed noise)", ("--seed", "1")),
    "dense-iso": Config("dense, narrower: the parameters of ttm-r32", iso_of="ttm-r32", lrs=NARROW_LRS),
    "dense-iso-s1": Config("dense-iso, seed 1 (init and data order: the seed noise)", ("--seed", "1"),
                           iso_of="ttm-r32", lrs=NARROW_LRS),
    "lowrank-iso": Config("blocks as plain low-rank products d_in -> r -> d_out: the block parameters of ttm-r32",
                          lowrank_of="ttm-r32", lrs=FACTORED_LRS),
    "cola-iso": Config("lowrank-iso with SiLU between the factors (CoLA's low-rank activation)",
                       ("--lowrank-act", "silu"), lowrank_of="ttm-r32", lrs=FACTORED_LRS),
    "btt-iso": Config("blocks as two-core block tensor-trains (BTT; rank 1: Monarch): the block parameters of "
                      "ttm-r32", lowrank_of="ttm-r32", factor_flag="--btt",
                      lrs=FACTORED_LRS),
    "defaults": Config("tensorize_ defaults on every layer (tied head/embedding skipped)",
                       ("--tensorize", "default", "--compress", "attn,mlp,tok,pos,head")),
    # fixed ranks
    "ttm-r16": Config("blocks ttm rank 16", ("--tensorize", "16") + TTM, lrs=HIGH_LRS),
    "btt-pkg": Config("btt-iso through the package: TTConfig(fmt='btt') rank 1 under backend='comera' (the same "
                      "blocks as the example's BTTLinear)", ("--tensorize", "1", "--fmt", "btt"), lrs=FACTORED_LRS),
    "ttm-r32": Config("blocks ttm rank 32", ("--tensorize", "32") + TTM, lrs=FACTORED_LRS),
    "ttm-r64": Config("blocks ttm rank 64", ("--tensorize", "64") + TTM, lrs=HIGH_LRS),
    "dense-d512": Config("dense at d 512 (a point between dense-iso and dense on the parameter axis)",
                         ("--d-model", "512", "--n-heads", "8"), lrs=NARROW_LRS),
    "tt-r32": Config("blocks tt rank 32", ("--tensorize", "32", "--fmt", "tt")),
    # rank adaptation
    "adapt-r64": Config("rank-adaptive from ttm r64 to the size of ttm-r32 (RankAdaptation defaults, pruning every "
                        "200 steps)", ("--tensorize", "64") + TTM + ADAPT, target_like="ttm-r32",
                        lrs=FACTORED_LRS),
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
                     match={"attn": "ttm-r32", "mlp": "ttm-r32"}, lrs=NARROW_LRS),
    "tt-all-silu": Config("tt-all with SiLU at each layer's rank bottleneck (TTConfig(activation='silu'): CoLA's "
                          "low-rank activation in the TT format)", ("--tensorize", "32", "--fmt", "tt",
                                                                    "--tt-activation", "silu"),
                          match={"attn": "ttm-r32", "mlp": "ttm-r32"}, lrs=FACTORED_LRS),
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
    "ttm-c2-iso": Config("ttm with 2 cores per layer (gates at the cores' lr), ranks matched to ttm-r32's block "
                         "parameters", ("--tensorize", "32", "--tt-cores", "2") + TTM,
                         match={"attn": "ttm-r32", "mlp": "ttm-r32"}),
    "ttm-c4-iso": Config("ttm with 4 cores per layer (gates at the cores' lr), ranks matched to ttm-r32's block "
                         "parameters", ("--tensorize", "32", "--tt-cores", "4") + TTM,
                         match={"attn": "ttm-r32", "mlp": "ttm-r32"}),
    "ttm-r32-fanin": Config("ttm-r32 (gates at the cores' lr) with each core's step scaled by the layer's mean "
                            "core fan-in over its own (--core-lr-rule fan-in)",
                            ("--tensorize", "32", "--core-lr-rule", "fan-in") + TTM),
    "btt-pkg-g1": Config("btt-pkg with the gate at the cores' lr and the cores' weight decay at the example's 0.1",
                         ("--tensorize", "1", "--fmt", "btt", "--gate-lr-scale", "1", "--core-weight-decay", "0.1")),
    "btt-pkg-g10-wd": Config("btt-pkg with the cores' weight decay at 0.1 and the gate at 10x the lr (btt-pkg-g1 "
                             "less its gate change)", ("--tensorize", "1", "--fmt", "btt", "--gate-lr-scale", "10",
                                                       "--core-weight-decay", "0.1")),
    "ttm-r32-gate10x": Config("ttm-r32 with the gates at 10x the cores' lr (train_lm's default until the group seeds "
                              "showed 1x better)", ("--tensorize", "32", "--gate-lr-scale", "10") + TTM),
    "ttm-r32-gate1x": Config("ttm-r32 with the gates at the cores' lr", ("--tensorize", "32", "--gate-lr-scale", "1")
                             + TTM),
    "ttm-r32-corewd": Config("ttm-r32 with weight decay 0.1 on the cores",
                             ("--tensorize", "32", "--core-weight-decay", "0.1") + TTM),
    "ttm-r32-balanced": Config("ttm-r32 with every core started at the same std (TTConfig init='balanced')",
                               ("--tensorize", "32", "--tt-init", "balanced") + TTM),
    "ttm-r32-warm10": Config("ttm-r32 with a warm-up of 10 % of the steps (default 5 %)",
                             ("--tensorize", "32", "--warmup-steps", "{steps/10}") + TTM),
    "ttm-r32-corelr3": Config("ttm-r32 with the cores at 3x lr", ("--tensorize", "32", "--core-lr-scale", "3") + TTM),
}
# The width study (group "width2048"): a GPT of d 2048 x 8 layers (heads of 128), where btt's step is
# faster than dense's; every row shares that recipe but for what the row is about. Learning-rate sweeps
# factor 2 apart, centred where the 19.7 M-token probe put each row (dense 3e-4 best, diverged at 1.2e-3;
# TT-matrix r32 2.4e-3; btt r1 4.8e-3).
W2048 = ("--d-model", "2048", "--n-layers", "8", "--n-heads", "16")
BTT = ("--fmt", "btt", "--gate-lr-scale", "1", "--core-weight-decay", "0.1")  # the quality benchmark's btt-pkg-g1
W_DENSE_LRS = (1.5e-4, 3e-4, 6e-4)
W_FRONTIER_LRS = (3e-4, 6e-4, 1.2e-3)
W_BTT_LRS = (2.4e-3, 4.8e-3, 9.6e-3)
CONFIGS.update({
    "w-dense": Config("d 2048 dense (the reference: its final loss is the target)", W2048, lrs=W_DENSE_LRS),
    "w-dense-iso": Config("dense at the parameters of w-btt-r1 (narrower, 8 layers)", W2048, iso_of="w-btt-r1",
                          lrs=NARROW_LRS),
    "w-d1024": Config("dense at d 1024 (the dense frontier: the best dense model for a smaller budget)",
                      ("--d-model", "1024", "--n-layers", "8", "--n-heads", "8"), lrs=W_FRONTIER_LRS),
    "w-d1536": Config("dense at d 1536 (the dense frontier)", ("--d-model", "1536", "--n-layers", "8", "--n-heads",
                                                                "12"), lrs=W_FRONTIER_LRS),
    # plain low-rank and plain TT were best at the low edge of their first sweeps: their grids go one lower
    "w-lowrank-iso": Config("blocks as plain low-rank products at the block parameters of w-btt-r1", W2048,
                            lowrank_of="w-btt-r1", lrs=(3e-4,) + NARROW_LRS),
    "w-ttm-r32": Config("blocks TT-matrix rank 32", W2048 + ("--tensorize", "32") + TTM, lrs=FACTORED_LRS),
    "w-tt-r32": Config("blocks plain tensor train (fmt 'tt') rank 32: the fastest whole step at d 2048 in "
                       "bench_e2e", W2048 + ("--tensorize", "32", "--fmt", "tt"), lrs=(6e-4,) + FACTORED_LRS),
    "w-btt-r1": Config("blocks btt rank 1 through the package", W2048 + ("--tensorize", "1") + BTT, lrs=W_BTT_LRS),
    "w-default": Config("the package's defaults: TTConfig() (btt rank 1 at this width) and cc.param_groups' "
                        "(the cores undecayed)", W2048 + ("--tensorize", "default"), lrs=W_BTT_LRS,
                        timed_as="w-btt-r1"),
    "w-btt-r2": Config("blocks btt rank 2 through the package", W2048 + ("--tensorize", "2") + BTT, lrs=W_BTT_LRS),
    "w-btt-r4": Config("blocks btt rank 4 through the package", W2048 + ("--tensorize", "4") + BTT, lrs=W_BTT_LRS),
    "w-mix-mlp-btt": Config("MLP btt r1, attention TT-matrix r32", W2048 + (
        "--tensorize", "attn=32,mlp=1", "--fmt", "attn=ttm,mlp=btt", "--gate-lr-scale", "1",
        "--core-weight-decay", "0.1"), lrs=FACTORED_LRS),
    "w-mix-attn-btt": Config("attention btt r1, MLP TT-matrix r32", W2048 + (
        "--tensorize", "attn=1,mlp=32", "--fmt", "attn=btt,mlp=ttm", "--gate-lr-scale", "1",
        "--core-weight-decay", "0.1"), lrs=FACTORED_LRS),
})
# the warm-up check: the wide dense rows plateaued near loss 4 at 6e-4 with the default 5 % warm-up
for _name in ("w-dense", "w-d1536"):
    CONFIGS[f"{_name}-warm20"] = replace(CONFIGS[_name], doc=f"{_name} with a warm-up of 20 % of the steps",
                                         args=CONFIGS[_name].args + ("--warmup-steps", "{steps/5}"),
                                         timed_as=_name)
# btt r1 with every layer's intermediate kept for the backward (COMERA_BTT_KEEP=inf; by default those larger
# than the input, here all but the MLP's down projection, are recomputed there): the same training, a
# faster step at more memory
CONFIGS["w-btt-r1-keep"] = replace(CONFIGS["w-btt-r1"], doc="w-btt-r1 with every intermediate kept for the backward "
                                   "(COMERA_BTT_KEEP=inf), not recomputed", env={"COMERA_BTT_KEEP": "inf"})
for _name in ("w-dense", "w-btt-r1"):
    CONFIGS[f"{_name}-s1"] = replace(CONFIGS[_name], doc=f"{_name}, seed 1 (seed noise)",
                                     args=CONFIGS[_name].args + ("--seed", "1"), timed_as=_name)
# Second (and third) seeds of the best runs of "benchmark" and "next", at their best lr (the group "seeds").
CONFIGS["ttm-r64-gate1x"] = Config("ttm-r64 with the gates at the cores' lr",
                                   ("--tensorize", "64", "--gate-lr-scale", "1") + TTM)
for _name in ("dense-d512", "ttm-r32", "ttm-r32-gate1x", "btt-iso", "ttm-r64", "ttm-c2-iso", "ttm-c4-iso",
              "btt-pkg-g1", "ttm-r64-gate1x", "dense", "ttm-r32-fanin"):
    for _seed in ((1, 2) if _name in ("ttm-r32-gate1x", "btt-iso", "dense") else (1,)):
        _base = CONFIGS[_name]
        CONFIGS[f"{_name}-s{_seed}"] = replace(_base, doc=f"{_name}, seed {_seed} (seed noise)",
                                                args=_base.args + ("--seed", str(_seed)))
# benchmark: the quality benchmark's rows (with --lrs grid); next: its follow-ups (past the top of the sweeps
# where the best was at the edge, other TT-matrix ranks, a third dense size); first, second: the earlier
# short study's two calls
GROUPS = {
    "seeds": ["dense-s1@0.0006", "dense-d512-s1@0.0012", "ttm-r32-s1@0.0048", "ttm-r32-gate1x-s1@0.0048",
              "ttm-r32-gate1x-s2@0.0048", "btt-iso-s1@0.0096", "ttm-r64-s1@0.0024"],
    # next2: after the gates' lr default moved to 1x: its lr neighbours, other core counts at equal
    # parameters, btt through the package with the example's decay, ttm-r64 with 1x gates, core steps
    # scaled by fan-in
    "next2": ["ttm-r32-gate1x@0.0024", "ttm-r32-gate1x@0.0096", "ttm-c2-iso@0.0048", "ttm-c4-iso@0.0048",
              "ttm-c2-iso-s1@0.0048", "ttm-c4-iso-s1@0.0048", "btt-pkg-g1@0.0096", "btt-pkg-g1-s1@0.0096",
              "ttm-r64-gate1x@0.0024", "ttm-r64-gate1x-s1@0.0024",
              "ttm-r32-fanin@0.0048", "ttm-r32-fanin-s1@0.0048",
              # tt with and without an activation at the bottleneck, with the gates at the cores' lr
              "tt-all@0.0012", "tt-all@0.0024", "tt-all-silu@0.0012", "tt-all-silu@0.0024", "tt-all-silu@0.0048"],
    # next3: the learning rates next2 left at one value (each row's sweep to three, the edges extended),
    # the package's btt with each of its two changes alone (gate lr, core decay)
    "next3": ["btt-pkg-g1@0.0048", "btt-pkg-g1@0.0192", "ttm-c2-iso@0.0024", "ttm-c2-iso@0.0096",
              "ttm-c4-iso@0.0024", "ttm-c4-iso@0.0096", "ttm-r32-fanin@0.0006", "ttm-r32-fanin@0.0012",
              "ttm-r32-fanin@0.0024", "tt-all-silu@0.0006", "tt-all@0.0006", "btt-pkg-g10-wd@0.0096",
              "btt-pkg@0.0096"],  # btt-pkg: the gate at the cores' lr (train_lm's default now), no core decay
    # the benchmark at the tuned learning rates (each row's best of its sweep, BENCHMARKS.md section 4):
    # the baselines (dense, dense-iso over two seeds, plain low-rank) and the kept formats (TT-matrix r32,
    # btt r1 through the package over two seeds); 7 runs side by side, then --timing alone
    "tuned": ["dense@0.0006", "dense-iso@0.0012", "dense-iso-s1@0.0012", "lowrank-iso@0.0024", "ttm-r32@0.0048",
              "btt-pkg-g1@0.0096", "btt-pkg-g1-s1@0.0096"],
    "next": ["ttm-r32@0.0096", "btt-iso@0.0096", "cola-iso@0.0006", "ttm-r16", "ttm-r64", "dense-d512",
             "ttm-r32-gate1x@0.0048", "ttm-r32-warm10@0.0048", "ttm-r32-balanced@0.0048", "btt-pkg@0.0048"],
    # the width study (BENCHMARKS.md, "Time to loss at d 2048"): --lrs grid sweeps each row; the first
    # rows are the decisive ones (dense and btt r1), so a study cut by its deadline has them
    "width2048": ["w-dense", "w-btt-r1", "w-dense-iso", "w-d1024", "w-d1536", "w-ttm-r32", "w-btt-r2", "w-btt-r4",
                  "w-lowrank-iso", "w-mix-mlp-btt", "w-mix-attn-btt", "w-tt-r32", "w-default"],
    "benchmark": ["dense", "dense-iso", "dense-iso-s1", "lowrank-iso", "cola-iso", "btt-iso", "ttm-r32", "tt-all",
                  "adapt-r64"],
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
        if args.tensorize is not None or args.lowrank is not None or args.btt is not None:
            with _quiet():
                self.train_lm.compress(model, args)
        return model, args

    def counts(self, flags: list[str]) -> dict[str, int]:
        """``{"total": parameters, "blocks": the transformer blocks', kind: TT parameters of that kind}``,
        remembered per flags."""
        key = tuple(flags)
        if key not in self._counts:
            model, _ = self.model(flags)
            counts = {"total": sum(p.numel() for p in model.parameters()),
                      "blocks": self.train_lm.block_parameters(model)}
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

    def factor_rank(self, flags: list[str], target_blocks: int, flag: str = "--lowrank") -> int:
        """The rank of ``flag`` (``--lowrank`` or ``--btt``, one for every compressed Linear) whose block
        parameters are closest to ``target_blocks``."""
        def count(rank: int) -> int:
            return self.counts(flags + [flag, str(rank)])["blocks"]

        lo, hi = 1, 4096
        while lo < hi:  # parameters grow with the rank: the first rank at or above the target
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(mid) < target_blocks else (lo, mid)
        return min((max(lo - 1, 1), lo), key=lambda r: abs(count(r) - target_blocks))

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
    status: str = "pending"  # pending, running, done, failed, stopped, abandoned, skipped
    alone: bool = False  # ran out of GPU memory beside other runs: runs again with the GPU to itself


def split_name(name: str) -> tuple[str, float | None]:
    """``"ttm-r32@0.002"`` -> ``("ttm-r32", 0.002)``: a run is a configuration, at a learning rate
    of its own when the name says one (``--lrs``), else at the preset's."""
    base, sep, lr = name.partition("@")
    return base, float(lr) if sep else None


def run_name(base: str, lr: float | None) -> str:
    return base if lr is None else f"{base}@{lr:g}"


def resolve(name: str, opts: argparse.Namespace, sizer: Sizer, out: Path) -> tuple[list[str], list[str]]:
    """The run's train_lm flags (every special field resolved) and the runs it needs first (a
    checkpoint's run at the same learning rate). Checkpoints go to ``out`` (the timing pass's to
    ``out/timing``, so they never replace the study's)."""
    base, lr = split_name(name)
    cfg = CONFIGS[base]
    out = out / "timing" if opts.timing else out
    flags, needs = [], []
    for arg in _smoke_args(cfg.args) if opts.smoke else cfg.args:
        if arg.startswith("{ckpt:"):
            dep = run_name(arg[len("{ckpt:"):-1], lr)
            needs.append(dep)
            arg = str(out / f"{dep}.pt")
        if arg.startswith("{steps/"):  # a fraction of the study's steps, e.g. a warm-up
            arg = str(max(1, opts.steps // int(arg[len("{steps/"):-1])))
        flags.append(arg.replace("{out}", str(out)))
    if cfg.iso_of:
        flags += sizer.iso_width(sizer.params(resolve(cfg.iso_of, opts, sizer, out)[0]), flags)
    if cfg.lowrank_of:
        target = sizer.counts(resolve(cfg.lowrank_of, opts, sizer, out)[0])["blocks"]
        flags += [cfg.factor_flag, str(sizer.factor_rank(flags, target, cfg.factor_flag))]
    for kind, ref in cfg.match.items():
        target = sizer.kind_params(resolve(ref, opts, sizer, out)[0], kind)
        flags = with_rank(flags, kind, sizer.matched_rank(flags, kind, target))
    if cfg.target_like:
        flags += ["--rank-adapt", f"{sizer.compression(resolve(cfg.target_like, opts, sizer, out)[0]):.4g}"]
    if cfg.steps_scale != 1.0:
        flags += ["--steps", str(max(1, round(opts.steps * cfg.steps_scale)))]
    if lr is not None:
        flags += ["--lr", f"{lr:g}"]
    return flags, needs


def _smoke_args(args: tuple[str, ...]) -> list[str]:
    """A configuration's flags at smoke size: ranks / 8; a width of its own / 16 (the width study's d 2048
    becomes the smoke model's d 128) with heads of 64 (at least one) and 2 layers."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--tensorize" and out[i + 1].isdigit():
            out[i + 1] = str(max(2, int(out[i + 1]) // SMOKE_RANK_DIVISOR))
        elif arg == "--d-model":
            out[i + 1] = str(int(out[i + 1]) // SMOKE_WIDTH_DIVISOR)
        elif arg == "--n-layers":
            out[i + 1] = "2"
    for i, arg in enumerate(out[:-1]):
        if arg == "--n-heads" and "--d-model" in out:
            out[i + 1] = str(max(1, int(out[out.index("--d-model") + 1]) // 64))
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
        runs[name] = Run(name, base + flags, needs, CONFIGS[split_name(name)[0]].doc, out / sub / f"{name}.json",
                         out / "logs" / f"{sub}-{name}.txt")
    if opts.timing:  # compile side by side, then time each alone (train_lm --barrier)
        shutil.rmtree(out / "timing" / "barrier", ignore_errors=True)  # an earlier pass's arrivals
        warmup = max(1, min(10, opts.timing_steps // 4))
        for run in runs.values():
            run.flags += ["--steps", str(opts.timing_steps), "--eval-every", "0", "--eval-batches", "1",
                          "--barrier", str(out / "timing" / "barrier"), "--barrier-parties", str(len(runs)),
                          "--barrier-step", str(warmup)]
    return sorted(runs.values(), key=lambda r: (not any(r.name in o.needs for o in runs.values()), names.index(r.name)
                                                if r.name in names else -1))


def prepare_data(train_lm, base: list[str]) -> int:
    """Read the corpus, train the tokenizer and tokenize once, into the cache the runs read (the
    corpus' manifest beside it); check that the study's steps fit in one epoch of the train split
    (train_lm stops otherwise, unless --allow-repeat is among the shared flags); the vocabulary size."""
    args = train_lm.parse_args(["--preset", "gpu"] + base)
    data = train_lm.load_data(args)
    sampler = data.sampler(args.batch_size, args.seq_len, seed=args.seed, allow_repeat=args.allow_repeat)
    train_lm.plan_epochs(data, sampler, args, args.steps)
    sys.stdout.flush()
    return data.tokenizer.vocab_size


# ------------------------------------------------------------------------------------------------ running


def run_env(name: str) -> dict[str, str]:
    """The environment settings of run ``name``'s configuration (``Config.env``)."""
    cfg = CONFIGS.get(split_name(name)[0])
    return dict(cfg.env) if cfg is not None else {}


def launch(run: Run, opts: argparse.Namespace) -> None:
    run.json.parent.mkdir(parents=True, exist_ok=True)
    run.log.parent.mkdir(parents=True, exist_ok=True)
    run.json.unlink(missing_ok=True)
    threads = str(max(1, (os.cpu_count() or 2) // max(1, opts.concurrency)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", threads)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    settings = run_env(run.name)
    env.update(settings)
    cmd = [sys.executable, str(TRAIN_LM), "--preset", "gpu"] + run.flags + ["--out", str(run.json)]
    with open(run.log, "w") as log:
        log.write(" ".join([f"{k}={v}" for k, v in settings.items()] + cmd) + "\n")
        log.flush()
        run.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    run.started = time.monotonic()
    run.status = "running"
    print(f"[{_clock()}] start {run.name}", flush=True)


OUT_OF_MEMORY = ("CUDA out of memory", "OutOfMemoryError")


def ran_out_of_memory(run: Run) -> bool:
    """Whether the run's log ends in the GPU's out-of-memory error."""
    try:
        tail = run.log.read_text(errors="replace")[-20000:]
    except OSError:
        return False
    return any(marker in tail for marker in OUT_OF_MEMORY)


ABANDON_CHECK_S = 15.0  # --abandon: seconds between reads of the running runs' logs


def execute(runs: list[Run], opts: argparse.Namespace) -> None:
    """Run everything, ``opts.concurrency`` at a time, each after the runs it needs; stop at the deadline.
    A run that ran out of GPU memory while others shared the GPU runs once more, alone: no other run
    starts while it waits for the GPU to empty or runs (the timing pass excepted: its runs meet at a
    barrier)."""
    deadline = getattr(opts, "started", time.monotonic()) + opts.deadline_s if opts.deadline_s else None
    by_name = {r.name: r for r in runs}
    checked = time.monotonic()
    while True:
        if (getattr(opts, "abandon", None) and not getattr(opts, "timing", False)
                and time.monotonic() - checked > ABANDON_CHECK_S):
            abandon_behind(runs, opts)
            checked = time.monotonic()
        sharing = sum(r.status == "running" for r in runs) > 1
        for run in runs:
            if run.status == "running" and run.process.poll() is not None:
                run.status = "done" if run.process.returncode == 0 else "failed"
                if (run.status == "failed" and sharing and not run.alone and not getattr(opts, "timing", False)
                        and ran_out_of_memory(run)):
                    run.status, run.alone = "pending", True
                    print(f"[{_clock()}] out of GPU memory beside other runs: {run.name} runs again alone",
                          flush=True)
                    continue
                if opts.timing:  # a run that ended before the barrier (failed) keeps no one waiting there
                    barrier = opts.out_dir / "timing" / "barrier"
                    barrier.mkdir(parents=True, exist_ok=True)
                    (barrier / f"ready-ended-{run.name}").touch()
                print(f"[{_clock()}] {run.status} {run.name} ({time.monotonic() - run.started:.0f}s)", flush=True)
        for run in runs:
            if run.status == "pending" and any(by_name[n].status in ("failed", "skipped", "stopped", "abandoned")
                                               for n in run.needs):
                run.status = "skipped"
        running = sum(r.status == "running" for r in runs)
        waiting_alone = [r for r in runs if r.alone and r.status == "pending"]
        if any(r.alone and r.status == "running" for r in runs):
            pass  # the GPU is the retried run's
        elif waiting_alone:
            if running == 0:
                launch(waiting_alone[0], opts)
        else:
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


def _evals(run: Run) -> list[dict]:
    """The validation losses the run's JSON log holds so far (train_lm rewrites it at every evaluation)."""
    try:
        return json.loads(run.json.read_text()).get("evals") or []
    except (OSError, ValueError):  # not written yet, or caught while being written
        return []


def behind(runs: list[Run], margin: float, after_step: int) -> list[tuple[Run, dict, str, float]]:
    """The running runs to give up on: at their last evaluation (at step ``after_step`` or later) the
    validation loss is more than ``margin`` (a fraction) above that of another learning rate of the same
    configuration at the same step. Returns ``(run, its last evaluation, the better run, its loss)``."""
    evals = {r.name: _evals(r) for r in runs if r.status in ("running", "done", "stopped", "abandoned")}
    found = []
    for run in runs:
        mine = evals.get(run.name)
        if run.status != "running" or not mine or mine[-1]["step"] < after_step:
            continue
        last, base = mine[-1], split_name(run.name)[0]
        rivals = [(other, e["val_loss"]) for other, others in evals.items()
                  if other != run.name and split_name(other)[0] == base
                  for e in others if e["step"] == last["step"] and math.isfinite(e["val_loss"])]
        if rivals:
            better, loss = min(rivals, key=lambda item: item[1])
            if not math.isfinite(last["val_loss"]) or last["val_loss"] > loss * (1 + margin):
                found.append((run, last, better, loss))
    return found


def abandon_behind(runs: list[Run], opts: argparse.Namespace) -> None:
    """``--abandon``: stop the runs :func:`behind` names (their GPU share goes to the runs still pending);
    they report their last validation loss, marked cut short, as a run stopped by the deadline does."""
    for run, last, better, loss in behind(runs, opts.abandon, math.ceil(opts.abandon_after * opts.steps)):
        print(f"[{_clock()}] abandoned {run.name} at step {last['step']}: val loss {last['val_loss']:.4f}, "
              f"{last['val_loss'] / loss - 1:+.1%} against {better}'s {loss:.4f} at that step", flush=True)
        run.process.terminate()
        try:
            run.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            run.process.kill()
        run.status = "abandoned"


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
    """One row per run: what its JSON log says (the timing pass's step time and memory when there is one:
    the configuration's, whatever the run's learning rate)."""
    rows = []
    for run in runs:
        log = json.loads(run.json.read_text()) if run.json.exists() else {}
        base = split_name(run.name)[0]
        timing = {}
        for name in (base, getattr(CONFIGS.get(base), "timed_as", None)):  # its own timing, else its twin's
            timing_path = out / "timing" / f"{name}.json"
            if name and timing_path.exists() and run.json != timing_path:
                timing = json.loads(timing_path.read_text())
                break
        rows.append(row(run, log, timing))
    return rows


def row(run: Run, log: dict, timing: dict) -> dict:
    evals = log.get("evals") or []
    steps = log.get("steps") or []
    source = timing if timing.get("complete") else log
    params = evals[-1]["parameters"] if evals else log.get("parameters")
    args = log.get("args", {})
    step_tokens = args.get("batch_size", 0) * args.get("seq_len", 0)
    step_time = source.get("step_time_s") or _median_step(steps)
    alone = bool(timing) or run.json.parent.name == "timing"
    return {
        "config": run.name, "base": split_name(run.name)[0], "lr": args.get("lr"), "seed": args.get("seed"),
        # complete: trained to its last step and validated there (a run cut by the deadline while it saved
        # its checkpoint is complete; one cut earlier is not)
        "doc": run.doc, "status": run.status,
        "complete": bool(log.get("complete")) or bool(evals and args.get("steps") and evals[-1]["step"] >= args["steps"]),
        "steps_done": len(steps), "steps": args.get("steps"),
        "tokens": len(steps) * step_tokens,
        "tokens_seen": log.get("tokens_seen", len(steps) * step_tokens), "epochs": log.get("epochs"),
        "train_tokens": log.get("train_tokens"), "val_tokens": log.get("val_tokens"),
        "corpus": (log.get("data") or {}).get("corpus"), "corpus_digest": (log.get("data") or {}).get("digest"),
        "val_loss": evals[-1]["val_loss"] if evals else None, "eval_step": evals[-1]["step"] if evals else None,
        "evals": [(e["step"], e["val_loss"]) for e in evals],
        "eval_tokens": [e.get("tokens", e["step"] * step_tokens) for e in evals],
        # seconds of training at each evaluation: step x the step time measured alone (--timing), else the
        # run's own step times (side by side with the others: inflated by the sharing)
        "eval_seconds": [e["step"] * step_time if alone and step_time else e.get("train_seconds", e.get("seconds"))
                         for e in evals],
        "dense_parameters": log.get("dense_parameters"), "parameters": params,
        "block_parameters": log.get("final_block_parameters") or log.get("block_parameters"),
        "compression": log["dense_parameters"] / params if params else None,
        "block_compression": log.get("block_compression") or _block_ratio(log),
        "step_time_s": step_time, "step_time_alone": alone,
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


def best_rows(rows: list[dict]) -> list[dict]:
    """One row per configuration: its run at the learning rate with the lowest final validation loss
    (among its complete runs; among all when none is complete), with every learning rate's loss."""
    by_base: dict[str, list[dict]] = {}
    for r in rows:
        by_base.setdefault(r["base"], []).append(r)
    best = []
    for base, group in by_base.items():
        scored = [r for r in group if r["val_loss"] is not None]
        if not scored:
            continue
        pool = [r for r in scored if r["complete"]] or scored
        top = min(pool, key=lambda r: r["val_loss"])
        lrs = sorted({r["lr"] for r in group if r["lr"] is not None})
        best.append(dict(top, config=base, run=top["config"], best_lr=top["lr"], runs=len(group),
                         lr_losses={r["lr"]: r["val_loss"] for r in scored},
                         lr_complete={r["lr"]: r["complete"] for r in scored},
                         lr_at_edge=len(lrs) >= 2 and top["lr"] in (lrs[0], lrs[-1]),
                         cut_lower=_cut_lower(top, scored)))
    return best


def cut_lower_runs(rows: list[dict], best: list[dict]) -> list[tuple[dict, dict]]:
    """(best row, run) for each cut-short run that was already below its configuration's best row
    (:func:`_cut_lower`): the plots draw these beside the best rows, dotted, so that a likely better lr
    cut by a deadline is seen, not only named in the table."""
    out = []
    for b in best:
        for lr, *_ in b.get("cut_lower") or []:
            run = next((r for r in rows if r["base"] == b["config"] and r["lr"] == lr and not r["complete"]), None)
            if run is not None:
                out.append((b, run))
    return out


def _cut_lower(top: dict, runs: list[dict]) -> list[tuple]:
    """The cut-short runs (another lr) whose last validation loss is below both ``top``'s final loss and
    ``top``'s loss at that same step: (lr, step, its loss, top's loss there). Such an lr is likely the
    better one; only complete runs can be the best row."""
    curve = dict(top.get("evals") or [])
    out = []
    for r in runs:
        if r is top or r["complete"] or r.get("eval_step") not in curve:
            continue
        there = curve[r["eval_step"]]
        if r["val_loss"] < min(there, top["val_loss"]):
            out.append((r["lr"], r["eval_step"], r["val_loss"], there))
    return out


#: the study's reference rows, by role: the d 768 benchmark's names, then the width study's
REFERENCES = {"dense": ("dense", "w-dense"), "dense-iso": ("dense-iso", "w-dense-iso")}


def reference(best: list[dict], role: str) -> dict | None:
    """The best row playing ``role`` (``"dense"`` or ``"dense-iso"``) in this study, if any."""
    return next((b for name in REFERENCES[role] for b in best if b["config"] == name), None)


def best_table(best: list[dict]) -> str:
    refs = {role: reference(best, role) for role in REFERENCES}
    head = ("config", "best lr", "val loss", "vs dense", "vs dense-iso", "val loss at each lr", "parameters",
            "block parameters", "tokens seen", "epochs", "step ms", "what")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in best:
        rel = {k: f"{100 * (b['val_loss'] / ref['val_loss'] - 1):+.1f} %" if ref and ref is not b else ""
               for k, ref in refs.items()}
        sweep = ", ".join(f"{lr:g}: {loss:.4f}{'' if b['lr_complete'][lr] else ' (cut short)'}"
                          for lr, loss in sorted(b["lr_losses"].items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        sweep += "".join(f"; {lr:g} cut short was lower at step {step} ({loss:.4f} against {there:.4f})"
                         for lr, step, loss, there in b.get("cut_lower") or [])
        step = f"{1e3 * b['step_time_s']:.0f}{'' if b['step_time_alone'] else '*'}" if b["step_time_s"] else ""
        lines.append("| " + " | ".join([
            b["config"],
            (f"{b['best_lr']:g}" if b["best_lr"] is not None else "") + (" (edge)" if b["lr_at_edge"] else ""),
            f"{b['val_loss']:.4f}" + ("" if b["complete"] else " (cut short)"), rel["dense"], rel["dense-iso"],
            sweep, f"{b['parameters']:,}" if b["parameters"] else "",
            f"{b['block_parameters']:,}" if b["block_parameters"] else "",
            f"{b['tokens_seen']:,}" if b["tokens_seen"] else "",
            f"{b['epochs']:.3f}" if b["epochs"] is not None else "",
            step, b["doc"]]) + " |")
    lines += ["", "Each configuration at its best learning rate: the lowest final validation loss of its runs (nats "
              "per token on the fixed held-out windows). (edge): the best lr is the smallest or largest tried, "
              "so a wider sweep may do better. epochs: training tokens seen / the train split's windows (each "
              "window once per epoch). \"cut short was lower\": a run stopped early at another lr was already below "
              "this one, at the same step and at this one's end: that lr is likely the better one."]
    noise = seed_noise(best)
    if noise:
        lines += ["", noise]
    return "\n".join(lines)


def is_dense(name: str) -> bool:
    """A dense row (drawn dashed in the plots)."""
    return name.startswith(("dense", "w-dense", "w-d1024", "w-d1536"))


SEED_PAIRS = (("dense-iso", "dense-iso-s1"), ("w-dense", "w-dense-s1"), ("w-btt-r1", "w-btt-r1-s1"))


def seed_noise(best: list[dict]) -> str:
    """The seed-to-seed spread of a row run with seeds 0 and 1 (dense-iso; the width study's dense and
    btt r1) at each learning rate both ran."""
    return "\n".join(filter(None, (_seed_noise(best, a, b) for a, b in SEED_PAIRS)))


def _seed_noise(best: list[dict], first: str, second: str) -> str:
    a, b = (next((x for x in best if x["config"] == n), None) for n in (first, second))
    if not a or not b:
        return ""
    common = sorted(set(a["lr_losses"]) & set(b["lr_losses"]), key=lambda lr: lr or 0)
    parts = [f"{abs(a['lr_losses'][lr] - b['lr_losses'][lr]):.4f} at lr {lr:g}" if lr is not None else
             f"{abs(a['lr_losses'][lr] - b['lr_losses'][lr]):.4f}" for lr in common]
    return (f"Seed noise (|{first} - {second}|, same lr): " + ", ".join(parts) +
            f"; at each one's best lr {abs(a['val_loss'] - b['val_loss']):.4f}.") if parts else ""


def _loss_at(xs: list[float], ys: list[float], x: float) -> float | None:
    """The curve ``ys(xs)`` at ``x``, linear between evaluations; None outside ``[xs[0], xs[-1]]``."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0] if xs and x == xs[0] else None


def time_to(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first ``x`` where the curve ``ys(xs)`` reaches ``target`` or below, linear between
    evaluations; None when it never does."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 <= target:
            return x0 if y0 <= target else x0 + (x1 - x0) * (y0 - target) / (y0 - y1)
    return xs[0] if xs and ys[0] <= target else None


def time_to_loss_table(best: list[dict], fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)) -> str:
    """Each row at its best lr against the dense reference, on wall-clock seconds (step x the step time
    measured alone): when it reaches the reference's final validation loss, as a ratio to the
    reference's whole run, and its loss at fractions of that run's seconds (blank past its own end)."""
    ref = reference(best, "dense")
    if not ref or not ref["eval_seconds"] or None in ref["eval_seconds"]:
        return ""
    target, total = ref["val_loss"], ref["eval_seconds"][-1]
    points = [f * total for f in fractions]
    head = ["config", "best lr", "final loss", "seconds (run)", "to dense's final loss", "ratio to dense's run"]
    head += [f"loss at {p:.0f} s ({f:.0%})" for p, f in zip(points, fractions)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in best:
        secs, losses = b["eval_seconds"], [loss for _, loss in b["evals"]]
        if not secs or None in secs:
            continue
        reach = time_to(secs, losses, target)
        at = [_loss_at(secs, losses, p) for p in points]
        lines.append("| " + " | ".join(
            [b["config"] + ("" if b["step_time_alone"] else "*"), f"{b['best_lr']:g}" if b["best_lr"] else "",
             f"{b['val_loss']:.4f}", f"{secs[-1]:.1f}", f"{reach:.1f} s" if reach is not None else "not reached",
             f"**{reach / total:.2f}x**" if reach is not None else ""]
            + [f"{x:.4f}" if x is not None else "" for x in at]) + " |")
    lines += ["", f"Seconds: step x the step time measured alone (--timing); * measured side by side (inflated). "
              f"Target: {ref['config']}'s final validation loss {target:.4f} after {total:.1f} s. Losses between "
              f"evaluations are interpolated linearly; a run's curve under its own cosine schedule, not the "
              f"loss of a run scheduled to end there."]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    names = {r["config"]: r for r in rows}
    head = ("config", "val loss", "vs dense", "parameters", "compression", "blocks", "step ms", "peak GiB (alloc / "
            "reserved)", "steps", "tokens seen", "epochs", "what")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dense_row = names.get(run_name("dense", r["lr"])) if "@" in r["config"] else None
        dense_row = dense_row or names.get("dense")
        dense = dict(dense_row["evals"]) if dense_row else {}  # step -> val loss
        loss = r["val_loss"]
        ref = dense.get(r["eval_step"])  # dense at the same step (a stopped run may have fewer)
        if dense_row and r["steps"] != dense_row["steps"] and dense_row["complete"]:
            ref = dense_row["val_loss"]  # a fine-tune of the trained dense model: against where dense ended
        rel = f"{100 * (loss / ref - 1):+.1f} %" if loss is not None and ref else ""
        step = f"{1e3 * r['step_time_s']:.0f}{'' if r['step_time_alone'] else '*'}" if r["step_time_s"] else ""
        mem = (f"{r['peak_memory_bytes'] / 2**30:.1f} / {r['peak_memory_reserved_bytes'] / 2**30:.1f}"
               if r["peak_memory_bytes"] else "")
        done = f"{r['eval_step']}/{r['steps']}" + ("" if r["complete"] else " (cut short)")
        lines.append("| " + " | ".join([
            r["config"], f"{loss:.4f}" if loss is not None else r["status"], rel,
            f"{r['parameters']:,}" if r["parameters"] else "", _ratio(r["compression"]), _ratio(r["block_compression"]),
            step, mem, done if r["eval_step"] else r["status"], f"{r['tokens_seen']:,}" if r["tokens_seen"] else "",
            f"{r['epochs']:.3f}" if r["epochs"] is not None else "", r["doc"]]) + " |")
    lines.append("")
    lines.append("vs dense: against the dense run (at the same lr when swept) at the same step (a shorter fine-tune: "
                 "at its end). step ms: median step time; "
                 "* measured side by side with the other runs (inflated by the sharing), otherwise alone (--timing). "
                 "steps: the step of the last validation / the run's steps. tokens seen: training tokens (windows x "
                 "seq len); epochs: of the train split.")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:.1f}x" if x else ""


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (parameters, loss) points no other point beats on both (fewer or as many parameters and a
    lower loss), by parameters."""
    front, best = [], math.inf
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def plots(rows: list[dict], out: Path, prefix: str = "") -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        if r["evals"]:
            xs, ys = zip(*r["evals"])
            ax.plot(xs, ys, marker=".", lw=1, label=r["config"], ls="--" if is_dense(r["config"]) else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, out / f"{prefix}val_loss.png", plt))

    best = best_rows(rows)
    for key, name, label in (("eval_tokens", "val_loss_vs_tokens", "training tokens seen"),
                             ("eval_seconds", "val_loss_vs_seconds", "seconds of training: step x step time alone "
                                                                      "(--timing); * side by side, inflated")):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for b in best:
            xs, ys = b[key], [loss for _, loss in b["evals"]]
            if xs and all(x is not None for x in xs):
                shared = key == "eval_seconds" and not b["step_time_alone"]
                lr = f" (lr {b['best_lr']:g})" if b["best_lr"] is not None else ""
                ax.plot(xs, ys, marker=".", lw=1, label=f"{b['config']}{lr}{'*' if shared else ''}",
                        ls="--" if is_dense(b["config"]) else "-")
        for b, run in cut_lower_runs(rows, best):
            xs, ys = run.get(key) or [], [loss for _, loss in run["evals"]]
            if xs and all(x is not None for x in xs):
                ax.plot(xs, ys, marker=".", lw=1, ls=":",
                        label=f"{b['config']} (lr {run['lr']:g}, cut at step {run['eval_step']})")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("each configuration at its best learning rate", fontsize=9)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, out / f"{prefix}{name}.png", plt))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = [(b["parameters"], b["val_loss"]) for b in best if b["parameters"] and b["val_loss"] is not None]
    for b in best:
        if b["parameters"] and b["val_loss"] is not None:
            ax.scatter(b["parameters"], b["val_loss"], s=18)
            ax.annotate(b["config"], (b["parameters"], b["val_loss"]), fontsize=7)
    front = pareto_front(points)
    if front:
        ax.step(*zip(*front), where="post", lw=1, color="gray", label="Pareto front")
        ax.legend(fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (whole model)")
    ax.set_ylabel("final validation loss at the best lr")
    written.append(_save(fig, out / f"{prefix}pareto.png", plt))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["val_loss"] is not None and r["block_compression"]:
            ax.scatter(r["block_compression"], r["val_loss"], s=18)
            ax.annotate(r["config"], (r["block_compression"], r["val_loss"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("compression of the transformer blocks (dense / parameters)")
    ax.set_ylabel("final validation loss")
    written.append(_save(fig, out / f"{prefix}loss_vs_compression.png", plt))

    adaptive = [r for r in rows if r["rank_history"]]
    if adaptive:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in adaptive:
            xs, ys = zip(*r["rank_history"])
            ax.plot(xs, ys, label=r["config"])
        ax.set_xlabel("step")
        ax.set_ylabel("whole-model compression")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"{prefix}rank_adaptation.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(runs: list[Run], opts: argparse.Namespace) -> None:
    out = opts.out_dir
    rows = collect(runs, out)
    best = best_rows(rows)
    text = best_table(best) + "\n\n" + table(rows)
    if not opts.timing and time_to_loss_table(best):
        text += "\n\n" + time_to_loss_table(best)
    (out / ("timing.md" if opts.timing else "results.md")).write_text(text + "\n")
    (out / ("timing.json" if opts.timing else "results.json")).write_text(json.dumps(rows, indent=1))
    if not opts.timing:
        (out / "best.json").write_text(json.dumps(best, indent=1, default=str))
    print(text)
    if not opts.timing:
        for path in plots(rows, opts.plot_dir or out, opts.plot_prefix):
            print(f"plot: {path}")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    started = time.monotonic()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("study"))
    p.add_argument("--configs", default="all",
                   help=f"comma-separated names (--list) or groups ({', '.join(GROUPS)}), or all; NAME@LR: that "
                        "configuration at that learning rate")
    p.add_argument("--lrs", type=_lrs, default=None, metavar="LR,LR,...|grid",
                   help="a learning-rate sweep: every configuration named without @LR runs at each of these "
                        "(runs NAME@LR), or with 'grid' at its own sweep (--list shows them); the tables give "
                        "each configuration at its best")
    p.add_argument("--list", action="store_true", help="print the configurations and their flags, run nothing")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=13, help="runs at a time on the one GPU (--smoke: 2)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop the runs still going this many seconds after the study started (data preparation "
                        "included) and report what they logged")
    p.add_argument("--abandon", type=float, default=None, metavar="FRACTION",
                   help="stop a run whose validation loss is more than FRACTION (e.g. 0.1) above that of another "
                        "learning rate of the same configuration at the same step, from --abandon-after of the "
                        "steps on: a sweep's hopeless points give their GPU share to the runs still pending "
                        "(reported cut short, at their last validation)")
    p.add_argument("--abandon-after", type=float, default=0.3, metavar="FRACTION",
                   help="with --abandon: the fraction of --steps before which no run is abandoned (default 0.3)")
    p.add_argument("--extra", default="", help="more train_lm flags for every run, e.g. '--cuda-graphs'")
    p.add_argument("--cache-dir", type=Path, default=None, help="tokenizer cache (default: <out-dir>/cache)")
    p.add_argument("--timing", action="store_true",
                   help="time each configuration alone, --timing-steps steps: all start at once (each holds its "
                        "model on the GPU while it waits for its turn), compile side by side, then run in turn")
    p.add_argument("--timing-steps", type=int, default=40)
    p.add_argument("--trained", action="store_true",
                   help="with --timing: start each configuration from the model the study saved "
                        "(<out-dir>/<config>.pt), so a rank-adapted one is timed at its final ranks")
    p.add_argument("--plot-dir", type=Path, default=None,
                   help="write the plots here instead of <out-dir>, e.g. docs (with --plot-prefix)")
    p.add_argument("--plot-prefix", default="", help="prefix of the plots' file names, e.g. quality_benchmark_")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the table and plots from the JSON logs already in <out-dir>/runs (and timing/), "
                        "e.g. after copying two calls' runs/ into one folder")
    p.add_argument("--smoke", action="store_true",
                   help=f"CPU, tiny model and data, eager: checks the pipeline (defaults {SMOKE_SIZES})")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE_SIZES)
    opts = p.parse_args(argv)
    if opts.abandon is not None and not opts.abandon > 0:
        p.error(f"--abandon: a fraction above 0, e.g. 0.1 (10 % above the best lr at the same step), "
                f"not {opts.abandon}")
    if not 0 <= opts.abandon_after <= 1:
        p.error(f"--abandon-after: a fraction of the steps in [0, 1], not {opts.abandon_after}")
    names = []
    for item in (n for n in opts.configs.split(",") if n):
        names += list(CONFIGS) if item == "all" else GROUPS.get(item, [item])
    try:
        names = [run_name(*split_name(n)) for n in names]  # NAME@1e-3 -> NAME@0.001
    except ValueError as error:
        p.error(f"--configs: a learning rate after @ must be a number ({error})")
    unknown = [n for n in names if split_name(n)[0] not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; valid: {', '.join(CONFIGS)}")
    if opts.timing:  # step time does not depend on the learning rate: each configuration once
        names = [split_name(n)[0] for n in names]
    elif opts.lrs:
        if opts.lrs == "grid":
            gridless = [n for n in names if "@" not in n and not CONFIGS[n].lrs]
            if gridless:
                p.error(f"--lrs grid: {gridless} have no sweep of their own; name them NAME@LR or give --lrs LR,...")

        def sweep(name: str) -> list[float]:
            return list(CONFIGS[name].lrs) if opts.lrs == "grid" else opts.lrs

        names = [m for n in names for m in ([n] if "@" in n else [run_name(n, lr) for lr in sweep(n)])]
    opts.names = list(dict.fromkeys(names))
    opts.out_dir = opts.out_dir.resolve()  # the runs start in the repository root
    opts.cache_dir = (opts.cache_dir or opts.out_dir / "cache").resolve()
    opts.plot_dir = opts.plot_dir.resolve() if opts.plot_dir else None
    opts.started = started  # --deadline-s counts from here
    if opts.timing:  # every run at once: they compile side by side, then take the GPU in turn (--barrier)
        opts.concurrency = len(opts.names)
    return opts


def logged_runs(opts: argparse.Namespace) -> list[Run]:
    """The runs whose JSON logs are in ``<out-dir>/runs``, as the study left them: for a name without
    @LR, its run and its runs at every learning rate logged (``NAME@*.json``)."""
    runs, seen = [], set()
    for name in opts.names:
        folder = opts.out_dir / "runs"
        paths = [folder / f"{name}.json"]
        if "@" not in name:
            paths += sorted(folder.glob(f"{name}@*.json"), key=lambda p: split_name(p.stem)[1])
        for path in paths:
            if not path.exists() or path in seen:
                continue
            seen.add(path)
            log = json.loads(path.read_text())
            flags = [] if "args" not in log else [f"{k}={v}" for k, v in log["args"].items() if v not in (None, False)]
            runs.append(Run(path.stem, flags, [], CONFIGS[split_name(path.stem)[0]].doc, path,
                            opts.out_dir / "logs" / f"runs-{path.stem}.txt",
                            status="done" if log.get("complete") else "stopped"))
    return runs


def _lrs(text: str) -> list[float] | str:
    if text == "grid":
        return text
    try:
        lrs = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected learning rates separated by commas") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive learning rates")
    return lrs


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
            grid = CONFIGS[split_name(run.name)[0]].lrs
            lrs = f" (--lrs grid: {', '.join(f'{lr:g}' for lr in grid)})" if grid else ""
            env = "".join(f"{k}={v} " for k, v in run_env(run.name).items())
            print(f"{run.name:16} {run.doc}{lrs}\n{'':16} {env}{' '.join(run.flags)}")
        return []
    start = time.monotonic()
    execute(runs, opts)
    print(f"[{_clock()}] all runs ended after {time.monotonic() - start:.0f}s", flush=True)
    report(runs, opts)
    return collect(runs, opts.out_dir)


if __name__ == "__main__":
    main()
