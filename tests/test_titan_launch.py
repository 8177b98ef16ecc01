"""examples/torchtitan/launch.py's stand-ins (no torchtitan needed): a missing package's stand-in lets an import
succeed and refuses any use with an error naming the package; an installed package is never replaced."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("titan_launch", ROOT / "examples" / "torchtitan" / "launch.py")
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)


@pytest.fixture
def clean_modules(monkeypatch):
    saved = dict(sys.modules)
    yield
    for name in set(sys.modules) - set(saved):
        del sys.modules[name]
    sys.modules.update(saved)


def test_a_missing_package_is_stood_in_for_and_refuses_use(clean_modules):
    assert launch._offline_stubs(missing=lambda package: True) == ["datasets", "tensorboard"]
    from datasets import Dataset, load_dataset  # noqa: F401  - the import torchtitan does
    from datasets.distributed import split_dataset_by_node
    from torch.utils.tensorboard import SummaryWriter
    for call in (lambda: load_dataset("x"), lambda: Dataset(), lambda: split_dataset_by_node(None),
                 lambda: SummaryWriter("d")):
        with pytest.raises(RuntimeError, match="is not installed .*--offline-stubs"):
            call()


def test_an_installed_package_is_used_as_it_is(clean_modules):
    before = {name: sys.modules.get(name) for name in ("datasets", "torch.utils.tensorboard")}
    assert launch._offline_stubs(missing=lambda package: False) == []
    assert {name: sys.modules.get(name) for name in before} == before


def test_the_fsdp_stand_in_is_only_added_where_torch_lacks_it(monkeypatch):
    import torch.distributed.fsdp as fsdp

    had = getattr(fsdp, "DataParallelMeshDims", None)
    launch._fsdp_mesh_dims_shim()
    if had is not None:
        assert fsdp.DataParallelMeshDims is had
    else:
        with pytest.raises(RuntimeError, match="needs torch >= 2.12"):
            fsdp.DataParallelMeshDims(shard="x")
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")


def test_the_demo_summary_reads_steps_and_rewrites(tmp_path):
    spec = importlib.util.spec_from_file_location("titan_summarize", ROOT / "examples" / "torchtitan" / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    log = tmp_path / "comera.log"
    step = ("[titan] 2026-12-04 23:15:53,6{i} - root - INFO - step: {i:2d}  loss: {loss:8.5f}  grad_norm:  0.5668  "
            "memory: {mem:5.2f}GiB(1.00%)  tps: {tps:,}  tflops: 0.00  mfu: 0.00%")
    lines = ["[titan] 2026-12-04 23:15:53,451 - comera_compile - INFO - graph 0: 5 rewrite(s), 0 candidate(s) left alone"]
    lines += [step.format(i=i, loss=6.0 - 0.1 * i, mem=10.0 + i, tps=1000 * i) for i in range(1, 13)]
    log.write_text("\n".join(lines) + "\n")
    summary = summarize.parse(log)
    assert summary["completed"] == 12 and summary["final_loss"] == pytest.approx(4.8)
    assert summary["tokens_per_s"] == pytest.approx((11000 + 12000) / 2)  # steps past 10 only
    assert summary["peak_memory_gib"] == pytest.approx(22.0)
    assert summary["comera_rewrites_per_graph"] == {0: 5}


def test_the_demo_summary_compares_each_variant_with_the_dense_run(tmp_path):
    spec = importlib.util.spec_from_file_location("titan_summarize", ROOT / "examples" / "torchtitan" / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    step = "step: {i:2d}  loss: 5.00000  grad_norm:  0.5  memory: {mem:5.2f}GiB(1.00%)  tps: {tps:,}  tflops: 0.00"
    runs = {"dense_ce": (20.0, 30000), "comera": (5.0, 48000), "dense": (None, None)}
    for name, (mem, tps) in runs.items():
        lines = [step.format(i=i, mem=mem, tps=tps) for i in range(11, 14)] if mem else ["Error: it failed"]
        (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
    summarize.main(str(tmp_path), "dense_ce", "dense", "comera")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["comera"]["vs_dense"] == {"reference": "dense_ce", "step": pytest.approx(30000 / 48000),
                                             "peak_memory": pytest.approx(0.25)}
    assert summary["dense"]["vs_dense"] is None  # no steps
    assert summary["dense_ce"]["vs_dense"]["step"] == pytest.approx(1.0)


def test_the_demo_summary_reads_the_timing_lines(tmp_path):
    """launch.py --timing-lines: the median step and data-loading seconds past step 10."""
    spec = importlib.util.spec_from_file_location("titan_summarize", ROOT / "examples" / "torchtitan" / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    step = "step: {i:2d}  loss: 5.00000  grad_norm:  0.5  memory: 1.00GiB(1.00%)  tps: 1,000  tflops: 0.00"
    timing = "launch.py timing: step {i} end_to_end_s {e2e} data_loading_s {data}"
    lines = []
    for i, (e2e, data) in enumerate([(9.0, 5.0), (0.2, 0.01), (0.3, 0.03), (0.25, 0.02), (1e-1, 2e-3)], start=10):
        lines += [step.format(i=i), timing.format(i=i, e2e=e2e, data=data)]
    log = tmp_path / "fused.log"
    log.write_text("\n".join(lines) + "\n")
    summary = summarize.parse(log)
    assert summary["median_step_s"] == pytest.approx(0.225)  # of 0.1, 0.2, 0.25, 0.3 (step 10 left out)
    assert summary["median_data_loading_s"] == pytest.approx(0.015)
    (tmp_path / "plain.log").write_text(step.format(i=11) + "\n")
    assert summarize.parse(tmp_path / "plain.log")["median_step_s"] is None  # a log without the lines
