"""benchmarks/train_lm.py --preset gpu on a GPU (skipped without CUDA): bf16 autocast, fused AdamW over
cc.param_groups, the comera backend with TT-matrix blocks, rank adaptation pruning between steps, CUDA
graphs, and a pruned checkpoint reloaded. Small sizes, so it takes a few compiles, not a study."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--preset", "gpu", "--d-model", "256", "--n-layers", "2", "--n-heads", "4", "--seq-len", "128",
         "--batch-size", "8", "--tokenizer", "bytes", "--eval-every", "0", "--eval-batches", "2", "--no-progress"]


def _train_lm():
    spec = importlib.util.spec_from_file_location("gpu_train_lm", ROOT / "benchmarks" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_preset_rank_adaptive_tt_run(tmp_path, cuda_graphs):
    train_lm = _train_lm()
    ckpt = tmp_path / "tt.pt"
    flags = SMALL + ["--tensorize", "16", "--fmt", "ttm"]
    log = train_lm.main(flags + ["--steps", "8", "--rank-adapt", "4", "--save", str(ckpt), "--rank-adapt-options",
                                 '{"prune_every": 3, "threshold": 0.999}'] + (["--cuda-graphs"] if cuda_graphs else []))
    assert log["device"].startswith("cuda") and log["args"]["precision"] == "bf16"
    assert all(math.isfinite(s["loss"]) for s in log["steps"]) and math.isfinite(log["val_loss"])
    assert log["prune_events"] >= 1 and log["final_parameters"] < log["parameters"]
    assert log["peak_memory_reserved_bytes"] >= log["peak_memory_bytes"] > 0 and log["step_time_s"] > 0
    again = train_lm.main(flags + ["--steps", "1", "--init-from", str(ckpt)])
    assert again["parameters"] == log["final_parameters"]


def test_gpu_preset_dense_matches_eager_first_steps():
    train_lm = _train_lm()
    eager = train_lm.main(SMALL + ["--steps", "3", "--backend", "eager"])
    torch._dynamo.reset()
    compiled = train_lm.main(SMALL + ["--steps", "3"])
    for a, b in zip(eager["steps"], compiled["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2)  # bf16
