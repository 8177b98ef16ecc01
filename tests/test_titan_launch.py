"""examples/torchtitan/launch.py's stand-ins (no torchtitan needed): a missing package's stand-in lets an import
succeed and refuses any use with an error naming the package; an installed package is never replaced."""

import importlib.util
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


def test_a_missing_package_is_stood_in_for_and_refuses_use(monkeypatch, clean_modules):
    monkeypatch.setattr(launch, "_missing", lambda package: True)
    assert launch._offline_stubs() == ["datasets", "tensorboard"]
    from datasets import Dataset, load_dataset  # noqa: F401  - the import torchtitan does
    from datasets.distributed import split_dataset_by_node
    from torch.utils.tensorboard import SummaryWriter
    for call in (lambda: load_dataset("x"), lambda: Dataset(), lambda: split_dataset_by_node(None),
                 lambda: SummaryWriter("d")):
        with pytest.raises(RuntimeError, match="is not installed .*--offline-stubs"):
            call()


def test_an_installed_package_is_used_as_it_is(monkeypatch, clean_modules):
    monkeypatch.setattr(launch, "_missing", lambda package: False)
    before = {name: sys.modules.get(name) for name in ("datasets", "torch.utils.tensorboard")}
    assert launch._offline_stubs() == []
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
