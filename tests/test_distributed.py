"""DDP and FSDP2 (``fully_shard``) around a model compiled with ``backend="comera"``: TT layers, the
fused loss and rank adaptation, on 2 CPU processes over gloo.

One spawn runs every scenario (process start-up dominates the cost); each test reads its part of
the results. The reference is the same model in eager mode on one process, fed both processes'
batches: data parallelism averages the gradients, so it must end with the same parameters.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import spawn_results  # noqa: E402

WORLD = 2
STEPS = 3
VOCAB, D = 16384, 32  # a 2 MB LM head: DDP puts it in a gradient bucket of its own (1 MB buckets)
OPTIONS = {"inner": "aot_eager", "cce_min_vocab": 0, "cce_backward": "exact"}

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class LM(nn.Module):
    """TT embedding and MLP (after tensorize), a dense LM head, and its cross-entropy."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, target):
        h = self.proj(F.gelu(self.fc(self.emb(idx))))
        return F.cross_entropy(self.lm_head(h).float().view(-1, VOCAB), target.view(-1))


def make_lm(seed: int = 0) -> LM:
    import comera_compile as cc

    torch.manual_seed(seed)
    net = LM()
    cc.tensorize_(net, cc.TTConfig(rank=4, min_size=0), filter_fn=lambda module, fqn: fqn != "lm_head")
    return net


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _train_against_reference(wrap, rank: int) -> dict:
    """STEPS of SGD on ``wrap(net)`` (this process's batches) and on an eager copy (every batch)."""
    import comera_compile as cc

    net = make_lm()
    ref = copy.deepcopy(net)
    model = torch.compile(wrap(net), backend="comera", options=OPTIONS)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(STEPS):
        model(*batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(*batch(r, step)) for r in range(WORLD)) / WORLD).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    report = cc.explain(model, *batch(rank, 99))
    kinds = sorted(r.kind for r in report.rewrites)
    return {"kinds": kinds, "graphs": len(report.graph_reports), "params": {n: _full(p) for n, p in net.named_parameters()},
            "reference": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def _ddp(net: nn.Module) -> nn.Module:
    """DDP with 1 MB gradient buckets: Dynamo's DDPOptimizer splits the graph at bucket boundaries
    and hands each piece to the backend; the head and its loss stay in one piece."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(net, bucket_cap_mb=1)


def _fsdp2(net: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(net, mesh=init_device_mesh("cpu", (WORLD,)))


def _rank_adaptation_under_ddp(rank: int) -> dict:
    """Pruning changes the cores' shapes: DDP is re-wrapped (new buckets) and the graph recompiles."""
    import comera_compile as cc

    net = make_lm()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in cc.iter_tt_layers(net):
            for gate in layer.gates:
                gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ranker = cc.RankAdaptation(net, opt, target_compression=4, gamma=1.0, prune_every=2, threshold=0.8,
                               switch="manual", loss_from="observe")
    holder = {"model": torch.compile(_ddp(net), backend="comera", options=OPTIONS)}
    ranker.on_prune(lambda r: holder.update(model=torch.compile(_ddp(net), backend="comera", options=OPTIONS)))
    losses = []
    for step in range(4):
        loss = holder["model"](*batch(rank, step))
        loss.backward()
        ranker.observe(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"events": ranker.prune_events, "ranks": [h["ranks"] for h in ranker.history], "losses": losses,
            "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def _resizing_under_fsdp2() -> list[str]:
    """What pruning (and loading a checkpoint with pruned ranks) meets on FSDP2-sharded cores."""
    from comera_compile.tensorize import require_unsharded, set_parameter_data_

    net = make_lm()
    _fsdp2(net)
    messages = []
    for attempt in (lambda: require_unsharded(net, "RankAdaptation"),
                    lambda: set_parameter_data_(net.fc.parametrizations.weight[0].core_flat, torch.zeros(2))):
        try:
            attempt()
            messages.append("no error")
        except NotImplementedError as exc:
            messages.append(str(exc))
    return messages


def _load_under_fsdp2() -> dict:
    """A sharded tensorized model loads the state dict of another (same ranks, other values), as a
    resume through torch.distributed.checkpoint does: each rank keeps its shard of the loaded values."""
    source, target = make_lm(seed=1), make_lm(seed=2)
    _fsdp2(source)
    _fsdp2(target)
    result = target.load_state_dict(source.state_dict())
    return {"missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys),
            "source": {n: _full(p) for n, p in source.named_parameters()},
            "target": {n: _full(p) for n, p in target.named_parameters()},
            "sharded": sorted(n for n, p in target.named_parameters() if hasattr(p, "full_tensor"))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    import time

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results, seconds = {}, {}
        for name, run in (("ddp", lambda: _train_against_reference(_ddp, rank)),
                          ("fsdp2", lambda: _train_against_reference(_fsdp2, rank)),
                          ("ddp_rank_adaptation", lambda: _rank_adaptation_under_ddp(rank)),
                          ("fsdp2_resizing", _resizing_under_fsdp2),
                          ("fsdp2_load", _load_under_fsdp2)):
            start = time.perf_counter()
            results[name] = run()
            seconds[name] = round(time.perf_counter() - start, 1)
        results["seconds"] = seconds
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_results(_worker, tmp_path_factory.mktemp("distributed"), WORLD)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_data_parallel_compiled_model_matches_one_process_eager(results, mode):
    for res in results:
        run = res[mode]
        assert run["kinds"] == ["cce", "tt_embedding", "tt_linear", "tt_linear"]  # rewritten under the wrapper
        assert run["graphs"] == (2 if mode == "ddp" else 1)
        assert run["params"].keys() == run["reference"].keys()
        for name, want in run["reference"].items():
            torch.testing.assert_close(run["params"][name], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_rank_adaptation_under_ddp_prunes_identically_on_every_process(results):
    a, b = (res["ddp_rank_adaptation"] for res in results)
    assert a["losses"] != b["losses"]  # different data on each process
    assert a["events"] == b["events"] >= 1 and a["ranks"] == b["ranks"]
    assert a["ranks"][-1] != a["ranks"][0]
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


def test_resizing_tt_cores_under_fsdp2_raises_a_clear_error(results):
    for res in results:
        whole_model, one_parameter = res["fsdp2_resizing"]
        assert whole_model.startswith("RankAdaptation changes the shapes of tensor-train cores"), whole_model
        assert "FSDP2 (fully_shard)" in whole_model and "['emb', 'fc', 'proj']" in whole_model
        n = make_lm().fc.parametrizations.weight[0].core_flat.numel()  # the flat cores, unsharded
        assert one_parameter.startswith(f"resizing a parameter from ({n},) to (2,) changes"), one_parameter


def test_a_sharded_tensorized_model_loads_a_checkpoint_of_the_same_ranks(results):
    """FSDP2 fixes the sharded shapes, so loading copies into each rank's shard in place (it used to
    refuse: "resizing a parameter from (n,) to (n,)")."""
    fresh = make_lm(seed=1)
    for res in results:
        run = res["fsdp2_load"]
        assert run["missing"] == [] and run["unexpected"] == []
        assert any("core_flat" in n for n in run["sharded"])
        for name, want in run["source"].items():
            assert torch.equal(run["target"][name], want), name
            assert torch.equal(want, dict(fresh.named_parameters())[name].detach()), name
