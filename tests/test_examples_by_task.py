"""The task examples (examples/quickstart.py, hf_trainer.py, rank_adaptation.py) run as a user runs them,
shortened, and do what they say: the rewrites happen, the compiled model matches eager, ranks shrink."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_task_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_rewrites_trains_and_matches_eager():
    out = _load("quickstart").main(["--steps", "12"])
    assert out["rewrites"].count("tt_linear") == 12 and out["rewrites"].count("cce") == 1
    losses = out["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 1.0
    assert out["compiled"] == pytest.approx(out["eager"], rel=1e-4, abs=1e-4)


def test_hf_trainer_example_fuses_the_loss_and_lowers_the_tt_layers():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _load("hf_trainer").main(["--steps", "2"])
    assert out["rewrite_kinds"] == ["cce", "tt_linear"]
    assert math.isfinite(out["training_loss"])


def test_rank_adaptation_example_prunes_ranks():
    out = _load("rank_adaptation").main(["--steps", "220"])
    ranks = out["ranks"]
    assert sum(ranks["up"]) + sum(ranks["down"]) < 8 + 16 + 16 + 16 + 16 + 8  # pruned from the rank-16 start
    assert out["loss"] < 1e-2  # it still fits the rank-2 teacher
