"""benchmarks/quality_study.py end to end in its CPU smoke mode: configurations resolved (iso-parameter
width, matched ranks, compression targets, checkpoints), runs as separate processes, the results table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("quality_study", ROOT / "benchmarks" / "quality_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


study = _load()
pytest.importorskip("tokenizers")


def test_every_configuration_resolves(tmp_path, capsys):
    study.main(["--smoke", "--out-dir", str(tmp_path), "--list"])
    listed = capsys.readouterr().out
    for name in study.CONFIGS:
        assert f"\n{name} " in listed or listed.startswith(f"{name} ") or f"\n{name}" in listed, name
    grouped = study.GROUPS["first"] + study.GROUPS["second"]
    assert len(set(grouped)) == len(grouped) and set(grouped) <= set(study.CONFIGS)
    for group in study.GROUPS.values():  # NAME or NAME@LR of a known configuration
        assert all(study.split_name(name)[0] in study.CONFIGS for name in group), group


def test_iso_width_and_matched_ranks(tmp_path):
    opts = study.parse_args(["--smoke", "--out-dir", str(tmp_path)])
    train_lm = study.load_train_lm()
    sizer = study.Sizer(train_lm, study.shared_flags(opts))
    sizer.vocab = study.prepare_data(train_lm, sizer.base)
    flags, _ = study.resolve("tt-attn", opts, sizer, tmp_path)
    ref, _ = study.resolve("ttm-r32", opts, sizer, tmp_path)
    target = sizer.kind_params(ref, "attn")
    got = sizer.kind_params(flags, "attn")
    rank = int(flags[flags.index("--tensorize") + 1].split(",")[0].split("=")[1])
    for other in (rank - 1, rank + 1):  # no other rank is closer to the ttm attention's parameters
        if other >= 1:
            assert abs(got - target) <= abs(sizer.kind_params(study.with_rank(flags, "attn", other), "attn") - target)
    low, _ = study.resolve("lowrank-iso", opts, sizer, tmp_path)  # plain low-rank at ttm-r32's block parameters
    low_rank = int(low[low.index("--lowrank") + 1])
    blocks = sizer.counts(ref)["blocks"]
    gap = abs(sizer.counts(low)["blocks"] - blocks)
    for other in (low_rank - 1, low_rank + 1):
        assert gap <= abs(sizer.counts(low[:-1] + [str(other)])["blocks"] - blocks)
    assert gap < 0.2 * blocks
    warm, _ = study.resolve("ttm-r32-warm10", opts, sizer, tmp_path)  # {steps/10}: a tenth of the steps
    assert warm[warm.index("--warmup-steps") + 1] == str(opts.steps // 10)
    cola, _ = study.resolve("cola-iso", opts, sizer, tmp_path)  # the same rank, SiLU between the factors
    assert cola == ["--lowrank-act", "silu"] + low
    btt, _ = study.resolve("btt-iso", opts, sizer, tmp_path)  # block tensor-trains at ttm-r32's block parameters
    btt_rank = int(btt[btt.index("--btt") + 1])
    gap = abs(sizer.counts(btt)["blocks"] - blocks)
    for other in (btt_rank - 1, btt_rank + 1):
        if other >= 1:
            assert gap <= abs(sizer.counts(btt[:-1] + [str(other)])["blocks"] - blocks)
    iso, _ = study.resolve("dense-iso", opts, sizer, tmp_path)
    seed1, _ = study.resolve("dense-iso-s1", opts, sizer, tmp_path)  # the same width, another seed
    assert seed1 == ["--seed", "1"] + iso
    width = int(iso[iso.index("--d-model") + 1])
    tt_total = sizer.params(ref)
    assert abs(sizer.params(iso) - tt_total) <= abs(sizer.params(iso[:-4] + ["--d-model", str(width + 64), "--n-heads",
                                                                             str(width // 64 + 1)]) - tt_total)


def test_smoke_study_runs_end_to_end(tmp_path):
    rows = study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "adapt-r64,svd-r32", "--steps", "6",
                       "--eval-every", "3"])
    by_name = {r["config"]: r for r in rows}
    assert set(by_name) == {"dense", "adapt-r64", "svd-r32"}  # dense runs first: svd-r32 needs its checkpoint
    for name, r in by_name.items():
        assert r["complete"] and r["val_loss"] is not None, (name, (tmp_path / "logs" / f"runs-{name}.txt").read_text())
        assert r["peak_memory_bytes"] > 0 and r["tokens"] == r["steps"] * 4 * 32
    assert by_name["dense"]["step_time_s"] > 0 and by_name["dense"]["steps"] == 6
    assert by_name["svd-r32"]["steps"] == 1 and by_name["svd-r32"]["compression"] > 1  # 10 % of the steps
    svd_log = json.loads((tmp_path / "runs" / "svd-r32.json").read_text())
    assert svd_log["args"]["init_from"] == str(tmp_path / "dense.pt") and svd_log["args"]["tt_init"] == "svd"
    assert by_name["adapt-r64"]["rank_history"]
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in table for name in by_name)
    assert json.loads((tmp_path / "results.json").read_text())[0]["config"] == "dense"

    again = study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "first", "--report-only"])
    assert {r["config"] for r in again} == set(by_name)  # all three are in the group "first"
    assert {r["config"]: r["val_loss"] for r in again} == {n: r["val_loss"] for n, r in by_name.items()}


def test_lr_sweep_names_and_the_timing_pass(tmp_path):
    opts = study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "benchmark,ttm-r32@2e-3",
                             "--lrs", "1e-3,3e-3"])
    swept = [f"{n}@{lr}" for n in study.GROUPS["benchmark"] for lr in ("0.001", "0.003")]
    assert opts.names == swept + ["ttm-r32@0.002"]
    timing = study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "benchmark,ttm-r32@2e-3",
                               "--lrs", "1e-3,3e-3", "--timing"])
    assert timing.names == study.GROUPS["benchmark"]  # step time does not depend on the lr: each config once
    grid = study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "benchmark,ttm-r32@2e-3",
                             "--lrs", "grid"])  # each configuration at its own sweep
    assert grid.names == [f"{n}@{lr:g}" for n in study.GROUPS["benchmark"] for lr in study.CONFIGS[n].lrs] + [
        "ttm-r32@0.002"]
    assert all(len(study.CONFIGS[n].lrs) >= 3 for n in study.GROUPS["benchmark"])
    with pytest.raises(SystemExit):  # "defaults" has no sweep of its own
        study.parse_args(["--configs", "dense,defaults", "--lrs", "grid"])
    with pytest.raises(SystemExit):
        study.parse_args(["--configs", "ttm-r32@fast"])
    with pytest.raises(SystemExit):
        study.parse_args(["--configs", "dense", "--lrs", "1e-3,-1"])
    # a swept run's row takes step time and memory from its configuration's timing run
    for sub, name, step_s in (("runs", "ttm-r32@0.002", 0.5), ("timing", "ttm-r32", 0.01)):
        (tmp_path / sub).mkdir(exist_ok=True)
        log = {"args": {"lr": 0.002, "batch_size": 4, "seq_len": 32, "steps": 10}, "complete": True,
               "step_time_s": step_s, "peak_memory_bytes": 1, "evals": [{"step": 10, "val_loss": 3.0, "parameters": 5}],
               "steps": [], "dense_parameters": 10, "tokens_seen": 1280, "epochs": 0.5}
        (tmp_path / sub / f"{name}.json").write_text(json.dumps(log))
    run = study.Run("ttm-r32@0.002", [], [], "", tmp_path / "runs" / "ttm-r32@0.002.json", tmp_path / "x.txt")
    (got,) = study.collect([run], tmp_path)
    assert got["step_time_s"] == 0.01 and got["step_time_alone"] and got["lr"] == 0.002
    assert got["eval_seconds"] == [10 * 0.01] and got["eval_tokens"] == [10 * 4 * 32] and got["epochs"] == 0.5
    assert got["complete"]


def test_collect_a_run_cut_while_saving_is_complete_and_a_seed_shares_its_twins_timing(tmp_path):
    """A run validated at its last step counts as complete though the deadline cut it while it saved its
    checkpoint; one cut earlier does not. A seed twin without a timing of its own reads its twin's."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "timing").mkdir()
    timing = {"args": {"steps": 40}, "complete": True, "step_time_s": 0.08, "evals": [], "steps": []}
    (tmp_path / "timing" / "w-dense.json").write_text(json.dumps(timing))
    runs = []
    for name, last in (("w-dense-s1@0.0003", 20), ("w-dense-warm20@0.0006", 12)):
        log = {"args": {"lr": 3e-4, "batch_size": 4, "seq_len": 32, "steps": 20}, "complete": False,
               "dense_parameters": 10,
               "evals": [{"step": last, "val_loss": 3.0, "parameters": 5}], "steps": [{}] * last}
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(log))
        runs.append(study.Run(name, [], [], "", tmp_path / "runs" / f"{name}.json", tmp_path / "x.txt", status="stopped"))
    done, cut = study.collect(runs, tmp_path)
    assert done["complete"] and not cut["complete"]
    assert done["step_time_s"] == cut["step_time_s"] == 0.08 and done["step_time_alone"]
    assert done["eval_seconds"] == [20 * 0.08]


def _row(config, lr, loss, params, complete=True):
    return {"config": f"{config}@{lr:g}", "base": config, "lr": lr, "val_loss": loss, "complete": complete,
            "status": "done" if complete else "stopped", "parameters": params, "block_parameters": params // 2,
            "tokens_seen": 1000, "epochs": 0.1, "step_time_s": 0.01, "step_time_alone": True, "doc": config,
            "evals": [(10, loss + 1), (20, loss)], "eval_tokens": [500, 1000], "eval_seconds": [0.1, 0.2]}


def test_best_lr_per_configuration_pareto_and_seed_noise():
    rows = [_row("dense", 1e-3, 4.0, 100), _row("dense", 3e-3, 3.9, 100), _row("dense", 1e-2, 3.5, 100, False),
            _row("dense-iso", 1e-3, 4.2, 30), _row("dense-iso", 3e-3, 4.1, 30), _row("dense-iso", 1e-2, 4.3, 30),
            _row("dense-iso-s1", 1e-3, 4.25, 30), _row("dense-iso-s1", 3e-3, 4.05, 30),
            _row("ttm-r32", 1e-3, 4.0, 28), _row("ttm-r32", 3e-3, 4.05, 28), _row("tt-r32", 3e-3, 4.5, 25)]
    best = {b["config"]: b for b in study.best_rows(rows)}
    assert (best["dense"]["best_lr"], best["dense"]["val_loss"]) == (3e-3, 3.9)  # the stopped run does not count
    assert best["dense-iso"]["best_lr"] == 3e-3 and not best["dense-iso"]["lr_at_edge"]
    assert best["ttm-r32"]["best_lr"] == 1e-3 and best["ttm-r32"]["lr_at_edge"]
    assert best["dense"]["lr_losses"] == {1e-3: 4.0, 3e-3: 3.9, 1e-2: 3.5}
    text = study.best_table(list(best.values()))
    assert "| ttm-r32 | 0.001 (edge) | 4.0000 | +2.6 % | -2.4 % |" in text
    assert "0.01: 3.5000 (cut short)" in text
    assert "0.0500 at lr 0.001, 0.0500 at lr 0.003" in study.seed_noise(list(best.values()))
    points = [(b["parameters"], b["val_loss"]) for b in best.values()]
    assert study.pareto_front(points) == [(25, 4.5), (28, 4.0), (100, 3.9)]


def test_study_stops_before_launching_when_one_epoch_is_too_short(tmp_path):
    with pytest.raises(SystemExit, match="--allow-repeat"):
        study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "dense", "--steps", "100000"])
    assert not (tmp_path / "runs").exists()


def test_smoke_benchmark_rows_with_an_lr_sweep(tmp_path):
    """The benchmark's new row (plain low-rank at equal parameters) in an lr sweep, end to end: the
    best-lr table, tokens seen, epochs and the curves come out."""
    plots = tmp_path / "docs"
    rows = study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "lowrank-iso", "--lrs", "1e-3,3e-3",
                       "--steps", "4", "--eval-every", "2", "--plot-dir", str(plots), "--plot-prefix", "qb_"])
    by_name = {r["config"]: r for r in rows}
    assert set(by_name) == {"lowrank-iso@0.001", "lowrank-iso@0.003"}
    for name, r in by_name.items():
        log = json.loads((tmp_path / "runs" / f"{name}.json").read_text())
        assert r["complete"], (tmp_path / "logs" / f"runs-{name}.txt").read_text()
        assert log["args"]["lr"] == float(name.split("@")[1]) and r["lr"] == log["args"]["lr"]
        assert r["tokens_seen"] == 4 * 4 * 32 and r["eval_tokens"] == [2 * 128, 4 * 128]
        assert r["epochs"] == pytest.approx(16 / log["data"]["train_windows"]) and r["epochs"] < 1
        assert log["data"]["corpus"] == "python" and Path(log["data"]["manifest"]).exists()
    low = json.loads((tmp_path / "runs" / "lowrank-iso@0.001.json").read_text())
    assert low["args"]["lowrank"] and low["block_parameters"] < low["block_dense_parameters"]
    best = json.loads((tmp_path / "best.json").read_text())
    assert [b["config"] for b in best] == ["lowrank-iso"] and len(best[0]["lr_losses"]) == 2
    assert "| lowrank-iso | 0.00" in (tmp_path / "results.md").read_text()
    pytest.importorskip("matplotlib")
    for name in ("val_loss", "val_loss_vs_tokens", "val_loss_vs_seconds", "pareto"):
        assert (plots / f"qb_{name}.png").stat().st_size > 1000
    again = study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "lowrank-iso", "--report-only"])
    assert {r["config"] for r in again} == {"lowrank-iso@0.001", "lowrank-iso@0.003"}  # NAME@* from runs/


def test_deadline_counts_from_the_study_start(tmp_path):
    """--deadline-s includes the data preparation before the runs: a study that started long enough ago
    stops its runs at once (the command must end inside a device call's limit)."""
    import argparse
    import subprocess
    import time

    run = study.Run("dense", [], [], "", tmp_path / "dense.json", tmp_path / "dense.txt", status="running",
                    started=time.monotonic())
    run.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    opts = argparse.Namespace(deadline_s=30.0, started=time.monotonic() - 40.0, concurrency=1)
    study.execute([run], opts)
    # stopped by the deadline (a run that ran out its 60 s sleep would be "done"), its process ended
    assert run.status == "stopped" and run.process.poll() is not None


def test_a_run_out_of_gpu_memory_beside_others_runs_again_alone(tmp_path, monkeypatch):
    """A run whose log ends in the GPU's out-of-memory error while other runs shared the GPU is run once
    more, with the GPU to itself: nothing else starts while it waits or runs. A run that fails otherwise,
    or runs out of memory alone, stays failed."""
    import argparse
    import subprocess

    scripts = {  # per run: what each attempt prints and its exit code
        "oom": [("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1022.00 MiB", 1), ("ok", 0)],
        "long": [("ok", 0)], "after": [("ok", 0)], "broken": [("ValueError: bad flag", 1)],
        "oom-alone": [("torch.OutOfMemoryError: CUDA out of memory.", 1)],
    }
    sleeps = {"oom": 0.1, "long": 2.5, "after": 0.1, "broken": 0.1, "oom-alone": 0.1}
    starts = []

    def run_set(names):
        return [study.Run(n, [], [], "", tmp_path / f"{n}.json", tmp_path / f"{n}.txt") for n in names]

    def fake_launch(run, opts):
        attempt = sum(1 for name, _ in starts if name == run.name)
        text, code = scripts[run.name][attempt]
        starts.append((run.name, sorted(r.name for r in runs if r.status == "running")))
        with open(run.log, "w") as log:
            run.process = subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep({sleeps[run.name]}); "
                                            f"print({text!r}); sys.exit({code})"], stdout=log)
        run.started, run.status = 0.0, "running"  # started: only printed (seconds since it)

    monkeypatch.setattr(study, "launch", fake_launch)
    opts = argparse.Namespace(deadline_s=None, concurrency=2, timing=False)
    runs = run_set(["oom", "long", "after", "broken"])
    study.execute(runs, opts)
    status = {r.name: r.status for r in runs}
    assert status == {"oom": "done", "long": "done", "after": "done", "broken": "failed"}, status
    names = [name for name, _ in starts]
    assert names.count("oom") == 2 and names.count("broken") == 1, starts
    again = [others for name, others in starts if name == "oom"][1]
    assert again == []  # the second attempt started on an empty GPU
    after = names.index("oom", names.index("oom") + 1)
    assert names.index("after") > after  # nothing started between the failure and the rerun
    assert "oom" not in dict(starts)["after"]  # nor beside the rerun: "after" started once it had ended
    starts.clear()
    runs = run_set(["oom-alone"])
    study.execute(runs, argparse.Namespace(deadline_s=None, concurrency=2, timing=False))
    assert runs[0].status == "failed" and len(starts) == 1  # out of memory alone: no second try


def test_timing_pass_compiles_side_by_side_and_times_each_alone(tmp_path):
    """--timing starts every configuration at once; each waits at the barrier until all are warmed up,
    then takes the device in turn: its step time is the median of its steps after the barrier."""
    opts = study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "dense,lowrank-iso", "--timing",
                             "--timing-steps", "8"])
    assert opts.concurrency == 2
    rows = study.main(["--smoke", "--out-dir", str(tmp_path), "--configs", "dense,lowrank-iso", "--timing",
                       "--timing-steps", "8"])
    assert {r["config"] for r in rows} == {"dense", "lowrank-iso"}
    for name in ("dense", "lowrank-iso"):
        log = json.loads((tmp_path / "timing" / f"{name}.json").read_text())
        flags = log["args"]
        assert flags["barrier_parties"] == 2 and flags["barrier_step"] == 2 and log["complete"]
        assert log["alone"] is True and log["alone_from_step"] == 2 and len(log["steps"]) == 8


def test_time_to_a_loss_and_the_loss_at_a_time_interpolate_between_evaluations():
    xs, ys = [10.0, 20.0, 30.0], [4.0, 3.0, 2.0]
    assert study.time_to(xs, ys, 2.5) == pytest.approx(25.0)
    assert study.time_to(xs, ys, 4.5) == 10.0  # reached at the first evaluation
    assert study.time_to(xs, ys, 1.0) is None  # never reached
    assert study.time_to([1.0, 2.0, 3.0], [3.0, 2.0, 2.5], 2.2) == pytest.approx(1.8)  # the first crossing
    assert study._loss_at(xs, ys, 15.0) == pytest.approx(3.5)
    assert study._loss_at(xs, ys, 30.0) == 2.0 and study._loss_at(xs, ys, 31.0) is None


def test_the_width_groups_rows_resolve_and_share_one_recipe(tmp_path, capsys):
    """Every row of width2048 is d 2048 x 8 layers (heads of 128) but for what the row is about: the
    frontier's widths, the iso row's width, the factored rows' compression flags."""
    study.main(["--out-dir", str(tmp_path), "--configs", "width2048", "--lrs", "grid", "--list",
                "--steps", "4", "--batch-size", "2", "--extra=--max-corpus-mb 0.3 --corpus stdlib"])
    listed = capsys.readouterr().out
    for name in study.GROUPS["width2048"]:
        lrs = study.CONFIGS[name].lrs
        assert len(lrs) >= 3, name  # each row at three learning rates or more
        for lr in lrs:
            assert f"{name}@{lr:g} " in listed, (name, lr)
    lines = listed.splitlines()
    for name in study.GROUPS["width2048"]:
        flags = lines[lines.index(next(l for l in lines if l.startswith(f"{name}@"))) + 1].split()
        width = int(flags[len(flags) - 1 - flags[::-1].index("--d-model") + 1])  # the last --d-model wins
        layers = int(flags[flags.index("--n-layers") + 1])
        assert layers == 8, name
        expect = {"w-d1024": 1024, "w-d1536": 1536}.get(name, 2048)
        if name != "w-dense-iso":
            assert width == expect, (name, width)
        else:
            assert width < 1024  # narrower: the parameters of w-btt-r1
        for other in ("--seq-len", "--batch-size", "--steps"):
            assert other in flags


def test_smoke_width_study_reports_time_to_the_dense_loss(tmp_path):
    """The width study end to end at smoke size: a timing pass, then the runs; results.md holds the
    time-to-loss table with the dense row as the reference (ratio 1.00x)."""
    configs = "w-dense,w-btt-r1,w-d1024"
    base = ["--smoke", "--out-dir", str(tmp_path), "--steps", "6", "--eval-every", "3"]
    study.main(base + ["--configs", configs, "--timing", "--timing-steps", "6"])
    rows = study.main(base + ["--configs", "w-dense@0.003,w-btt-r1@0.003,w-d1024@0.003"])
    assert {r["config"] for r in rows} == {"w-dense@0.003", "w-btt-r1@0.003", "w-d1024@0.003"}
    assert all(r["complete"] and r["step_time_alone"] for r in rows)
    text = (tmp_path / "results.md").read_text()
    section = text[text.index("to dense's final loss"):]
    dense_line = next(line for line in section.splitlines() if line.startswith("| w-dense | "))
    assert "**1.00x**" in dense_line
    best = study.best_rows(rows)
    ref = study.reference(best, "dense")
    assert ref["config"] == "w-dense"


def test_the_best_row_names_a_cut_short_lr_that_was_already_lower():
    def run(lr, evals, complete):
        return {"config": f"w-x@{lr}", "base": "w-x", "lr": lr, "complete": complete, "evals": evals,
                "val_loss": evals[-1][1], "eval_step": evals[-1][0], "step_time_s": None, "step_time_alone": False,
                "parameters": None, "block_parameters": None, "tokens_seen": None, "epochs": None, "doc": ""}
    stalled = run(0.0024, [(100, 6.3), (200, 6.2), (300, 6.0)], True)
    cut_better = run(0.0012, [(100, 5.0), (200, 4.3)], False)
    cut_worse = run(0.0048, [(100, 6.5)], False)
    (best,) = study.best_rows([stalled, cut_better, cut_worse])
    assert best["best_lr"] == 0.0024  # only complete runs are the best row
    assert best["cut_lower"] == [(0.0012, 200, 4.3, 6.2)]
    assert "0.0012 cut short was lower at step 200 (4.3000 against 6.2000)" in study.best_table([best])
    assert study.cut_lower_runs([stalled, cut_better, cut_worse], [best]) == [(best, cut_better)]
    (only,) = study.best_rows([run(0.0024, [(100, 4.0), (200, 3.0)], True), cut_worse])
    assert only["cut_lower"] == []
    assert study.cut_lower_runs([cut_worse], [only]) == []


def _fake_run(tmp_path, name, evals, status="running"):
    path = tmp_path / "runs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"evals": [{"step": s, "val_loss": v} for s, v in evals]}))
    return study.Run(name=name, flags=[], needs=[], doc="", json=path, log=tmp_path / f"{name}.txt", status=status)


def test_abandon_names_runs_behind_another_lr_of_their_row_at_the_same_step(tmp_path):
    """--abandon: a running run more than the margin above another lr of its own configuration at the
    same validation step, and only from the given step on; other configurations never count."""
    good = _fake_run(tmp_path, "w-btt-r2@0.0048", [(95, 6.0), (190, 4.0), (285, 3.0)])
    bad = _fake_run(tmp_path, "w-btt-r2@0.0192", [(95, 6.1), (190, 4.6), (285, 3.5)])
    close = _fake_run(tmp_path, "w-btt-r2@0.0096", [(95, 6.0), (190, 4.3), (285, 3.2)])
    other_row = _fake_run(tmp_path, "w-dense@0.0003", [(95, 5.0), (190, 3.0), (285, 2.0)])
    early = _fake_run(tmp_path, "w-dense@0.0006", [(95, 9.0)])
    runs = [good, bad, close, other_row, early]
    found = study.behind(runs, 0.1, after_step=190)
    assert [(r.name, last["step"], better, loss) for r, last, better, loss in found] == \
        [("w-btt-r2@0.0192", 285, "w-btt-r2@0.0048", 3.0)]  # 3.2 is within 10 % of 3.0; 9.0 is before step 190
    assert [r.name for r, *_ in study.behind(runs, 0.05, after_step=190)] == ["w-btt-r2@0.0192", "w-btt-r2@0.0096"]
    assert [r.name for r, *_ in study.behind(runs, 0.1, after_step=0)] == ["w-btt-r2@0.0192", "w-dense@0.0006"]
    assert study.behind(runs, 0.1, after_step=300) == []  # nobody has reached step 300
    bad.status = "done"  # a finished run is never abandoned, but still counts as a rival
    assert study.behind(runs, 0.1, after_step=190) == []
    unreadable = study.Run(name="w-btt-r2@0.0024", flags=[], needs=[], doc="", json=tmp_path / "none.json",
                           log=tmp_path / "none.txt", status="running")
    assert study.behind([good, unreadable], 0.1, after_step=0) == []  # no log yet: nothing to judge


def test_abandon_arguments_are_checked(tmp_path):
    for bad in (["--abandon", "0"], ["--abandon", "-0.1"], ["--abandon", "0.1", "--abandon-after", "1.5"]):
        with pytest.raises(SystemExit):
            study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "dense"] + bad)
    opts = study.parse_args(["--smoke", "--out-dir", str(tmp_path), "--configs", "dense", "--abandon", "0.1"])
    assert opts.abandon == 0.1 and opts.abandon_after == 0.3


def test_execute_abandons_the_run_behind_and_starts_the_next(tmp_path, monkeypatch):
    """In the scheduler: the run behind is stopped (status "abandoned"), which frees its slot for the
    pending run; the run ahead goes on."""
    import argparse
    import subprocess
    monkeypatch.setattr(study, "ABANDON_CHECK_S", 0.0)
    ahead = _fake_run(tmp_path, "w-btt-r2@0.0048", [(95, 3.0)], status="pending")
    behind = _fake_run(tmp_path, "w-btt-r2@0.0192", [(95, 4.0)], status="pending")
    pending = _fake_run(tmp_path, "w-btt-r2@0.0096", [], status="pending")
    launched = []

    def launch(run, opts):
        run.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        run.started, run.status = 0.0, "running"
        launched.append(run.name)
        if run is pending:  # the last run: end the study by stopping everything
            ahead.process.terminate()
            run.process.terminate()

    monkeypatch.setattr(study, "launch", launch)
    opts = argparse.Namespace(abandon=0.1, abandon_after=0.0, steps=190, concurrency=2, deadline_s=None,
                              timing=False)
    study.execute([ahead, behind, pending], opts)
    assert launched == ["w-btt-r2@0.0048", "w-btt-r2@0.0192", "w-btt-r2@0.0096"]
    assert behind.status == "abandoned" and behind.process.poll() is not None


def test_gpu_followups_starts_the_width_study_with_its_settings(tmp_path):
    """benchmarks/gpu_followups.sh with WIDTH_RUNS starts benchmarks/width_gpu.sh's background job after
    its own checks, and the study's settings (RUNS, ABANDON, CONCURRENCY) reach quality_study.py. python3
    is a stand-in that records its arguments, so nothing trains."""
    import os
    import shutil
    import subprocess
    import time
    tree, work, fake = tmp_path / "tree", tmp_path / "work", tmp_path / "bin"
    (tree / "benchmarks").mkdir(parents=True)
    for name in ("gpu_followups.sh", "width_gpu.sh"):
        shutil.copy(ROOT / "benchmarks" / name, tree / "benchmarks" / name)
    fake.mkdir()
    calls = tmp_path / "calls.txt"
    for tool in ("python3", "nvidia-smi"):
        (fake / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        (fake / tool).chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", SKIP_TESTS="1", SKIP_E2E="1",
               SKIP_CCE="1", WIDTH_RUNS="w-btt-r2@0.0024,w-tt-r32@0.0006", WORK=str(work), ABANDON="0.1",
               CONCURRENCY="2", TIMING="")
    env.pop("GPU_TESTS", None)  # unset, as in the README's command (it once stopped the job under set -u)
    subprocess.run(["bash", "benchmarks/gpu_followups.sh", str(tmp_path / "out")], cwd=tree, env=env, check=True,
                   timeout=120)
    assert (tmp_path / "out" / "ALL_DONE").exists()
    for _ in range(300):  # the job runs in the background: up to about a minute
        if "JOB-DONE" in (work / "job.log").read_text():
            break
        time.sleep(0.2)
    study_calls = [line for line in calls.read_text().splitlines() if "quality_study.py" in line]
    assert len(study_calls) == 1, calls.read_text()  # TIMING empty: no timing pass
    args = study_calls[0].split()
    assert args[args.index("--configs") + 1] == "w-btt-r2@0.0024,w-tt-r32@0.0006"
    assert args[args.index("--abandon") + 1] == "0.1" and args[args.index("--concurrency") + 1] == "2"
    assert "width study started" in (tmp_path / "out" / "progress.txt").read_text()


def test_gpu_followups_times_the_swap_then_reruns_titan_variants_under_each_ab_setting(tmp_path):
    """gpu_followups.sh runs bench_swap.py, the torchtitan demo, then one demo per TITAN_AB entry with its
    environment settings and variants; COMERA_BTT_SWAP_TILE=best becomes what `bench_swap.py --best-tile`
    printed (stand-ins for python3 and run_demo.sh record what they were given)."""
    import os
    import shutil
    import subprocess
    tree, fake = tmp_path / "tree", tmp_path / "bin"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "examples" / "torchtitan").mkdir(parents=True)
    (tree / ".whl" / "titan").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_followups.sh", tree / "benchmarks" / "gpu_followups.sh")
    calls = tmp_path / "calls.txt"
    (tree / "examples" / "torchtitan" / "run_demo.sh").write_text(
        f'echo "run_demo tile=${{COMERA_BTT_SWAP_TILE:-unset}} keep=${{COMERA_BTT_KEEP:-unset}} '
        f'variants=$VARIANTS out=$OUT" >> {calls}\n')
    fake.mkdir()
    (fake / "python3").write_text(f'#!/bin/sh\necho "python3 $*" >> {calls}\n'
                                  'case "$*" in *--best-tile*) echo 32768;; esac\n')
    (fake / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", SKIP_TESTS="1", SKIP_E2E="1",
               SKIP_CCE="1", VARIANTS="dense_ce_cg comera_cg",
               TITAN_AB="COMERA_BTT_SWAP_TILE=best:comera_cg;COMERA_BTT_KEEP=8,COMERA_BTT_SWAP_TILE=0:comera_cg "
                        "comera_noac_cg;comera_cg;")  # an entry without settings is skipped, said in progress.txt
    for name in ("WIDTH_RUNS", "COMERA_BTT_SWAP_TILE", "COMERA_BTT_KEEP"):
        env.pop(name, None)
    subprocess.run(["bash", "benchmarks/gpu_followups.sh", str(tmp_path / "out")], cwd=tree, env=env, check=True,
                   timeout=120)
    lines = calls.read_text().splitlines()
    assert any("bench_swap.py --json" in line for line in lines), lines
    demos = [line for line in lines if line.startswith("run_demo")]
    assert demos == [
        f"run_demo tile=unset keep=unset variants=dense_ce_cg comera_cg out={tmp_path}/out/titan",
        f"run_demo tile=32768 keep=unset variants=comera_cg out={tmp_path}/out/titan_ab1",
        f"run_demo tile=0 keep=8 variants=comera_cg comera_noac_cg out={tmp_path}/out/titan_ab2"], demos
    assert (tmp_path / "out" / "titan_ab1.txt").read_text().strip() == "COMERA_BTT_SWAP_TILE=32768: comera_cg"
    assert "TITAN_AB: 'comera_cg' is not NAME=VALUE" in (tmp_path / "out" / "progress.txt").read_text()


def test_the_default_row_is_btt_r1_with_the_packages_optimizer_defaults():
    """w-default (TTConfig() and cc.param_groups' defaults, what a user who follows the README gets) tensorizes
    the d 2048 blocks exactly as w-btt-r1 does (format, ranks, modes of every layer), and its optimizer
    differs only in the cores' weight decay (0 against the study's 0.1): issue 37's target 4 compares the
    two rows' time to loss."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("train_lm_for_default_row", ROOT / "benchmarks" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)

    def build(name):
        args = train_lm.parse_args(list(study.CONFIGS[name].args) + ["--n-layers", "1", "--seq-len", "32"])
        torch.manual_seed(0)
        model = train_lm.GPT(256, 32, args.d_model, args.n_layers, args.n_heads)
        train_lm.compress(model, args)
        layers = {lay.fqn: (lay.param.spec.fmt, tuple(lay.param.spec.ranks), tuple(lay.param.spec.row_modes),
                            tuple(lay.param.spec.col_modes)) for lay in train_lm.cc.iter_tt_layers(model)}
        opt = train_lm.make_optimizer(model, args, torch.device("cpu"))
        groups = {g["name"]: (len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups}
        return layers, groups, args.lr

    default_layers, default_groups, lr = build("w-default")
    btt_layers, btt_groups, _ = build("w-btt-r1")
    assert default_layers == btt_layers and len(default_layers) == 4  # the block's qkv, proj, fc and mlp.proj
    assert {fmt for fmt, ranks, _, _ in default_layers.values()} == {"btt"}
    assert all(max(ranks) == 1 for _, ranks, _, _ in default_layers.values())
    assert default_groups.keys() == btt_groups.keys()
    for name in default_groups:
        want = btt_groups[name] if name != "tt_cores" else btt_groups[name][:2] + (0.0,)
        assert default_groups[name] == pytest.approx(want), name
    assert btt_groups["tt_cores"][2] == 0.1 and default_groups["tt_gates"][1] == lr


def test_a_configurations_env_reaches_its_process_and_heads_its_log(tmp_path, monkeypatch):
    """Config.env (w-btt-r1-keep: COMERA_BTT_KEEP=inf) is set in the run's process, and only in its own; the
    log's first line names it with the command. train_lm is a stand-in that writes what it saw."""
    import argparse

    assert study.run_env("w-btt-r1-keep@0.0096") == {"COMERA_BTT_KEEP": "inf"} and study.run_env("w-btt-r1") == {}
    assert study.CONFIGS["w-btt-r1-keep"].args == study.CONFIGS["w-btt-r1"].args  # the same model and training
    stand_in = tmp_path / "train_lm.py"
    stand_in.write_text("import os, sys\n"
                        "out = sys.argv[sys.argv.index('--out') + 1]\n"
                        "open(out, 'w').write(os.environ.get('COMERA_BTT_KEEP', '-'))\n")
    monkeypatch.setattr(study, "TRAIN_LM", stand_in)
    monkeypatch.delenv("COMERA_BTT_KEEP", raising=False)
    opts = argparse.Namespace(concurrency=1)
    seen = {}
    for name in ("w-btt-r1-keep@0.0096", "w-btt-r1@0.0096"):
        run = study.Run(name, ["--lr", "0.0096"], [], "", tmp_path / f"{name}.json", tmp_path / f"{name}.txt")
        study.launch(run, opts)
        assert run.process.wait(timeout=60) == 0
        seen[name] = (run.json.read_text(), run.log.read_text().splitlines()[0])
    assert seen["w-btt-r1-keep@0.0096"][0] == "inf" and seen["w-btt-r1@0.0096"][0] == "-"
    assert seen["w-btt-r1-keep@0.0096"][1].startswith("COMERA_BTT_KEEP=inf ")
    assert "COMERA_BTT_KEEP" not in seen["w-btt-r1@0.0096"][1]
