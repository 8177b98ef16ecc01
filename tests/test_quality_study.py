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
    iso, _ = study.resolve("dense-iso", opts, sizer, tmp_path)
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
