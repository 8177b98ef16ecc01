"""RankAdaptation under DistributedDataParallel: 2 CPU processes on gloo make the same pruning
decisions and end with identical ranks, parameters and histories."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from ports import free_port  # noqa: E402

WORLD = 2
STEPS = 12


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import comera_compile as cc
        from comera_compile.rank_adaptation import RankAdaptation
        from torch.nn.parallel import DistributedDataParallel as DDP
        from test_rank_adaptation import batch, make_net

        net = make_net(seed=0)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for lay in cc.iter_tt_layers(net):
                for gate in lay.gates:
                    gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
        opt = torch.optim.AdamW(net.parameters(), lr=2e-2, weight_decay=0.1)
        # switch=4: the late stage uses the loss, which differs per process unless averaged.
        ranker = RankAdaptation(net, opt, target_compression=10, gamma=2.0, late_gamma=2.0, augment=0.01,
                                prune_every=3, threshold=0.7, switch=4)
        holder = {"ddp": DDP(net)}
        ranker.on_prune(lambda r: holder.update(ddp=DDP(net)))  # new shapes: new buckets
        for step in range(STEPS):
            idx, target = batch(100 * rank + step)  # different data on each process
            loss = holder["ddp"](idx, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.save({"params": {k: v.detach().clone() for k, v in net.state_dict().items()},
                    "history": ranker.history, "events": ranker.prune_events, "last_loss": loss.item()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_processes_make_identical_pruning_decisions(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert a["last_loss"] != b["last_loss"]  # the processes did see different data
    assert a["events"] == b["events"] >= 2
    assert a["history"] == b["history"]  # ranks, sizes, penalty weights and stages, step by step
    assert a["history"][-1]["stage"] == "late"
    assert a["history"][-1]["ranks"] != a["history"][0]["ranks"]
    assert a["params"].keys() == b["params"].keys()
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
