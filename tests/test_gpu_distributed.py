"""FSDP2 (``fully_shard``) on one GPU: world size 1 over NCCL, the comera-compiled sharded model
trains exactly like the unwrapped compiled one. Skipped without CUDA.

Run on a GPU machine: ``python -m pytest -q tests/test_gpu_distributed.py``. The same check runs on
the CPU over gloo with ``python tests/test_gpu_distributed.py --cpu`` (a smoke run of this file).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import free_port  # noqa: E402

STEPS = 3
OPTIONS = {"cce_min_vocab": 0, "cce_backward": "exact"}  # inductor, the default inner compiler

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and NCCL")


def _process_group(backend: str) -> None:
    if dist.is_initialized():
        return
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group(backend, rank=0, world_size=1)


def _train(model, step_inputs, params) -> list[float]:
    opt = torch.optim.SGD(params, lr=0.5)
    losses = []
    for inputs in step_inputs:
        out = model(*inputs[0], **inputs[1])
        loss = getattr(out, "loss", out)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def compare_sharded_with_unwrapped(make_model, step_inputs, device: str, backend: str) -> list[str]:
    """Train a comera-compiled FSDP2 copy and a comera-compiled plain copy; returns the rewrite kinds
    of the sharded one after asserting equal losses and parameters."""
    import comera_compile as cc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _process_group(backend)
    net = make_model().to(device)
    ref = copy.deepcopy(net)
    fully_shard(net, mesh=init_device_mesh(device, (1,)))
    sharded = torch.compile(net, backend="comera", options=OPTIONS)
    plain = torch.compile(ref, backend="comera", options=OPTIONS)
    moved = [(tuple(t.to(device) for t in args), {k: v.to(device) for k, v in kwargs.items()})
             for args, kwargs in step_inputs]
    got, want = _train(sharded, moved, net.parameters()), _train(plain, moved, ref.parameters())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    args, kwargs = moved[0]
    report = cc.explain(net, *args, options=OPTIONS, **kwargs)
    net.reshard()  # a forward without backward leaves an FSDP2 root unsharded
    return sorted(r.kind for r in report.rewrites)


def _lm_case():
    from test_distributed import batch, make_lm

    return make_lm, [(batch(0, step), {}) for step in range(STEPS)]


def _hf_case():
    from test_hf import batch, make_model

    import comera_compile as cc

    ids, labels = batch("llama")
    return (lambda: cc.hf.fused_loss(make_model("llama"))), [((ids,), {"labels": labels})] * STEPS


@requires_gpu
def test_fsdp2_world_size_one_matches_unwrapped_tt_model():
    make, steps = _lm_case()
    kinds = compare_sharded_with_unwrapped(make, steps, "cuda", "nccl")
    assert kinds == ["cce", "tt_embedding", "tt_linear", "tt_linear"]


@requires_gpu
def test_fsdp2_world_size_one_matches_unwrapped_hf_labels_path():
    pytest.importorskip("transformers")
    make, steps = _hf_case()
    assert compare_sharded_with_unwrapped(make, steps, "cuda", "nccl") == ["cce"]


if __name__ == "__main__" and "--cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for case in (_lm_case, _hf_case):
        print(case.__name__, compare_sharded_with_unwrapped(*case(), "cpu", "gloo"))
    dist.destroy_process_group()
