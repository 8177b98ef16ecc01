"""``prune_mode="mask"``: pruning that keeps the shapes (for FSDP2, whose sharded parameters cannot
change shape). The reference is ``prune_mode="slice"`` on the same model and data: the masked model
must compute what the sliced one computes, step by step; ``shrink_`` must then give the sliced model.
Under FSDP2 (2 CPU processes over gloo) the masked run must match the same run on one process."""

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

import comera_compile as cc
from comera_compile.rank_adaptation import RankAdaptation, RankConfig, shrink_

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import spawn_results  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, WORLD = 12, 2
OPTIONS = dict(target_compression=4, gamma=1.0, prune_every=3, threshold=0.8, switch="manual", gate_lr_scale=3,
               loss_from="observe", rank_multiple=1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().double()
    cc.tensorize_(net, {"fc1": cc.TTConfig(fmt="tt", rank=5, min_size=0, modes=((4, 4), (4, 6))),
                        "fc2": cc.TTConfig(fmt="tt", rank=5, min_size=0, modes=((4, 6), (4, 4)))})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # gates spread around the threshold, so that the events differ per bond
        for layer in cc.iter_tt_layers(net):
            for gate in layer.gates:
                gate.copy_(0.6 + 0.8 * torch.rand(gate.shape, generator=g, dtype=gate.dtype))
    return net


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)


def train(net: nn.Module, mode: str, steps: int = STEPS, ranks=(0,), model: nn.Module | None = None,
          ranker_net: nn.Module | None = None) -> tuple[RankAdaptation, list[float]]:
    """``steps`` of AdamW with rank adaptation; the loss is the mean over ``ranks``' batches (the
    batch of this process only, when ``model`` is a data-parallel wrapper)."""
    model = net if model is None else model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    ranker = RankAdaptation(ranker_net or net, opt, prune_mode=mode, **OPTIONS)
    losses = []
    for step in range(steps):
        loss = sum(F.mse_loss(model(x), y) for x, y in (batch(r, step) for r in ranks)) / len(ranks)
        loss.backward()
        ranker.observe(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return ranker, losses


def test_masked_pruning_computes_what_sliced_pruning_computes():
    sliced, masked = make_net(), make_net()
    sizes = [list(layer.param.gate_sizes) for layer in cc.iter_tt_layers(masked)]
    a, loss_a = train(sliced, "slice")
    b, loss_b = train(masked, "mask")
    assert a.prune_events >= 2 and [h["ranks"] for h in a.history] == [h["ranks"] for h in b.history]
    assert a.history[-1]["ranks"] != a.history[0]["ranks"]
    torch.testing.assert_close(torch.tensor(loss_b), torch.tensor(loss_a), rtol=1e-9, atol=1e-12)
    assert [h["params"] for h in b.history] == [h["params"] for h in a.history]  # the gates left, counted
    assert [h["effective_params"] for h in b.history] == [h["effective_params"] for h in a.history]
    # the shapes stayed; the masked gates are exactly zero
    assert [list(layer.param.gate_sizes) for layer in cc.iter_tt_layers(masked)] == sizes
    for layer in cc.iter_tt_layers(masked):
        live = b.ranks()[layer.fqn]
        assert [int(g.ne(0).sum()) for g in layer.gates] == live != list(layer.param.gate_sizes)
    x = batch(9, 0)[0]
    torch.testing.assert_close(masked(x), sliced(x), rtol=1e-9, atol=1e-12)
    # shrink_ gives the sliced model: same ranks, same outputs
    assert shrink_(masked) == a.ranks()
    torch.testing.assert_close(masked(x), sliced(x), rtol=1e-9, atol=1e-12)


def test_shrink_slices_the_optimizer_state_with_the_cores():
    """``shrink_(model, optimizer)``: Adam's moments follow the cores and gates, so training goes on as the
    sliced run's (the same next step)."""
    sliced, masked = make_net(), make_net()
    a, _ = train(sliced, "slice", steps=6)
    opt_a = a.optimizer
    b, _ = train(masked, "mask", steps=6)
    opt_b = b.optimizer
    a.remove()
    b.remove()
    shrink_(masked, opt_b)
    for net, opt in ((sliced, opt_a), (masked, opt_b)):
        for p in net.parameters():
            assert all(v.shape == p.shape for v in opt.state[p].values() if torch.is_tensor(v) and v.dim())
        x, y = batch(5, 99)
        F.mse_loss(net(x), y).backward()
        opt.step()
    for got, want in zip(masked.parameters(), sliced.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_a_resumed_masked_run_reads_its_masks_from_the_zero_gates():
    """The masks are not in the ranker's state: a run resumed from a checkpoint holds the gates that
    were exactly zero at zero, as the uninterrupted run does."""
    whole = make_net()
    ranker, _ = train(whole, "mask")
    first = make_net()
    train(first, "mask", steps=6)
    resumed = copy.deepcopy(first)
    opt = torch.optim.AdamW(resumed.parameters(), lr=3e-2)
    again = RankAdaptation(resumed, opt, prune_mode="mask", **OPTIONS)
    layers = list(cc.iter_tt_layers(resumed))
    zero_before = [g.eq(0) for layer in layers for g in layer.gates]
    assert any(bool(z.any()) for z in zero_before)
    for step in range(6, 8):  # no pruning event in these two steps: only the held masks keep the zeros
        F.mse_loss(resumed(batch(0, step)[0]), batch(0, step)[1]).backward()
        opt.step()
        opt.zero_grad()
    zero_after = [g.eq(0) for layer in cc.iter_tt_layers(resumed) for g in layer.gates]
    assert all(bool(a[b].all()) for a, b in zip(zero_after, zero_before))
    assert again.ranks() == {layer.fqn: [int(g.ne(0).sum()) for g in layer.gates] for layer in layers}
    del ranker


def test_an_unknown_prune_mode_names_the_choices():
    with pytest.raises(ValueError, match="prune_mode must be one of"):
        RankConfig(target_compression=2, prune_mode="cut")


# ------------------------------------------------------------------------------------------------
# FSDP2 on 2 CPU processes: the masked run equals the one-process run on both batches
# ------------------------------------------------------------------------------------------------


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        net = make_net()
        fully_shard(net, mesh=init_device_mesh("cpu", (WORLD,)))
        errors = []
        try:
            RankAdaptation(net, torch.optim.AdamW(net.parameters()), prune_mode="slice", **OPTIONS)
        except NotImplementedError as exc:
            errors.append(str(exc))
        ranker, losses = train(net, "auto", ranks=(rank,))
        try:
            shrink_(net)
        except NotImplementedError as exc:
            errors.append(str(exc))
        gates = [layer.param.gate_flat.detach().full_tensor() for layer in cc.iter_tt_layers(net)]
        cores = [layer.param.core_flat.detach().full_tensor() for layer in cc.iter_tt_layers(net)]
        torch.save({"mode": ranker.prune_mode, "errors": errors, "ranks": [h["ranks"] for h in ranker.history],
                    "events": ranker.prune_events, "params": [h["params"] for h in ranker.history],
                    "losses": losses, "gates": gates, "cores": cores}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    return spawn_results(_worker, tmp_path_factory.mktemp("fsdp_mask"), WORLD)


def test_fsdp2_prunes_by_masking_and_matches_one_process(fsdp_results):
    """FSDP2 averages the processes' gradients: one process fed the mean loss of both batches takes the
    same steps, so it must end with the same gates, cores and ranks (slice mode there: the reference)."""
    reference = make_net()
    ranker, _ = train(reference, "slice", ranks=tuple(range(WORLD)))
    for res in fsdp_results:
        assert res["mode"] == "mask"
        assert len(res["errors"]) == 2 and "prune_mode='mask'" in res["errors"][0] and "fc1" in res["errors"][0]
        assert "shrink_" in res["errors"][1] and "FSDP2" in res["errors"][1]  # shrink_ needs the unsharded model
        assert res["events"] == ranker.prune_events >= 2
        assert res["ranks"] == [h["ranks"] for h in ranker.history]
        assert res["params"] == [h["params"] for h in ranker.history]
    a, b = fsdp_results
    assert a["ranks"] == b["ranks"] and all(torch.equal(x, y) for x, y in zip(a["gates"], b["gates"]))
    shrink_(masked := make_net())  # a model of the trained one's shapes, loaded with its values, then shrunk
    with torch.no_grad():
        for layer, gates, cores in zip(cc.iter_tt_layers(masked), a["gates"], a["cores"]):
            layer.param.gate_flat.copy_(gates)
            layer.param.core_flat.copy_(cores)
    assert shrink_(masked) == ranker.ranks()
    for got, want in zip(cc.iter_tt_layers(masked), cc.iter_tt_layers(reference)):
        torch.testing.assert_close(got.param.gate_flat, want.param.gate_flat, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(got.param.core_flat, want.param.core_flat, rtol=1e-7, atol=1e-9)
