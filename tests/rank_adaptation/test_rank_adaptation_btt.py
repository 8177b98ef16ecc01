"""RankAdaptation on block tensor-train (``fmt="btt"``) layers: the one rank bond per layer is pruned
physically (``R``'s last dimension, ``L``'s first), the layer computing what it computed with the pruned
gates set to zero; ``min_rank`` floors a Monarch (rank-1) layer. CPU, fp32."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.rank_adaptation import RankAdaptation, size_coefficients

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self, rank=4, fc2_rank=1):
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.fc1 = nn.Linear(64, 256)  # 8 blocks of 8 in, 16 of 16 out
        self.fc2 = nn.Linear(256, 32)
        cc.tensorize_(self, {"fc1": cc.TTConfig(fmt="btt", rank=rank, min_size=0),
                             "fc2": cc.TTConfig(fmt="btt", rank=fc2_rank, min_size=0)})

    def forward(self, idx, target=None):
        h = self.fc2(F.gelu(self.fc1(self.emb(idx))))
        return h if target is None else F.mse_loss(h, target)


def make_net(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


def batch(step, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (n,), generator=g), torch.randn(n, 32, generator=g)


def layers(net):
    return {lay.fqn: lay for lay in cc.iter_tt_layers(net)}


def set_gates(net, fqn, values):
    with torch.no_grad():
        layers(net)[fqn].param.gates[0].copy_(torch.tensor(values))


def test_size_coefficients_count_the_cores():
    for lay in cc.iter_tt_layers(make_net()):
        r = lay.spec.ranks[1]
        assert sum(c * r for c in size_coefficients(lay.spec, "params")) == sum(c.numel() for c in lay.cores)
        assert size_coefficients(lay.spec, "flops") == [2 * c for c in size_coefficients(lay.spec, "params")]


def test_pruning_slices_the_rank_bond_and_preserves_the_function():
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    idx, target = batch(0)
    net(idx, target).backward()
    opt.step()  # optimizer state exists, shaped like the flat Parameters
    set_gates(net, "fc1", [0.9, 0.0005, 1.1, 0.0002])  # gates 1 and 3 fall below the threshold
    ref = copy.deepcopy(net)  # the same model with the pruned gates set to zero
    with torch.no_grad():
        layers(ref)["fc1"].param.gates[0][[1, 3]] = 0.0
    params_before = {id(p) for p in net.parameters()}
    size_before = cc.compression_report(net).params
    ranker = RankAdaptation(net, opt, target_compression=2, prune_every=0, threshold=1e-3)
    assert ranker.prune()
    fc1 = layers(net)["fc1"]
    b1, b2, c, a = *fc1.spec.row_modes, *fc1.spec.col_modes
    assert fc1.spec.ranks == (1, 2, 1) and ranker.ranks()["fc1"] == [2]
    assert [tuple(t.shape) for t in fc1.cores] == [(b1, b2, c, 2), (2, c, b1, a)]
    assert fc1.param.gates[0].tolist() == pytest.approx([0.9, 1.1])
    assert {id(p) for p in net.parameters()} == params_before
    assert cc.compression_report(net).params == ranker.num_params() == size_before - 2 * (b1 * b2 * c + c * b1 * a + 1)
    for key, value in opt.state[fc1.param.core_flat].items():
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            assert value.shape == fc1.param.core_flat.shape, key
    with torch.no_grad():
        torch.testing.assert_close(net(idx), ref(idx), rtol=1e-5, atol=1e-6)
    net(idx, target).backward()  # trains on at the new shapes
    opt.step()
    assert fc1.param.core_flat.grad.shape == fc1.param.core_flat.shape


@pytest.mark.parametrize("min_rank", [1, 2])
def test_min_rank_floors_the_bond(min_rank):
    """Every gate of fc1 below the threshold: the bond keeps its ``min_rank`` largest gates; a Monarch
    layer (rank 1, fc2) whose gate falls below it stays at rank 1 (min_rank >= 1)."""
    net = make_net()
    values = [0.004, 0.009, 0.001, 0.007]
    set_gates(net, "fc1", values)
    set_gates(net, "fc2", [0.001])
    ref = copy.deepcopy(net)
    keep = sorted(sorted(range(4), key=lambda i: -values[i])[:min_rank])
    with torch.no_grad():
        layers(ref)["fc1"].param.gates[0][[i for i in range(4) if i not in keep]] = 0.0
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=2, prune_every=0, min_rank=min_rank)
    with pytest.warns(UserWarning, match="fell below the threshold"):
        assert ranker.prune()
    assert ranker.ranks() == {"fc1": [min_rank], "fc2": [1]} and ranker.dead == []
    idx, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(net(idx), ref(idx), rtol=1e-5, atol=1e-7)


def test_compiled_model_follows_the_pruned_bond():
    torch._dynamo.reset()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=2, prune_every=0, threshold=1e-3)
    compiled = torch.compile(net, backend="comera", options={"inner": "aot_eager"}, fullgraph=True)
    idx, target = batch(0)
    compiled(idx, target).backward()
    set_gates(net, "fc1", [0.9, 0.0, 1.1, 0.7])
    assert ranker.prune() and ranker.ranks()["fc1"] == [3]
    eager = copy.deepcopy(net)
    opt.zero_grad()
    eager(idx, target).backward()
    compiled(idx, target).backward()
    for lay, eager_lay in zip(cc.iter_tt_layers(net), cc.iter_tt_layers(eager)):
        for name in ("core_flat", "gate_flat"):
            got, want = getattr(lay.param, name).grad, getattr(eager_lay.param, name).grad
            assert math.prod(got.shape) == getattr(lay.param, name).numel()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()
