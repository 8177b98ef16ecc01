"""cc.param_groups: every trainable parameter in exactly one group, with the group's settings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import comera_compile as cc


class Tiny(nn.Module):
    """A TT Linear, a dense Linear with bias, a norm, a tied embedding/head pair and a frozen matrix."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 64)
        self.out = nn.Linear(64, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, idx):
        h = self.norm(self.out(torch.relu(self.fc(self.emb(idx)))))
        return self.head(h + self.frozen(h))


def make_tiny():
    torch.manual_seed(0)
    model = Tiny()
    cc.tensorize_(model, {"fc": cc.TTConfig(rank=3, min_size=0, modes=((4, 4), (8, 8)), fmt="tt"),
                          "out": cc.TTConfig(rank=3, fmt="ttm", min_size=0, modes=((8, 8), (4, 4)))})
    return model


def expected_group(name: str, p: nn.Parameter) -> str:
    """The group from the parameter's name alone (independent of param_groups' own lookup)."""
    if name.endswith(".parametrizations.weight.0.core_flat"):
        return "tt_cores"
    if name.endswith(".parametrizations.weight.0.gate_flat"):
        return "tt_gates"
    return "decay" if p.dim() >= 2 else "no_decay"


def test_every_trainable_parameter_exactly_once_in_its_group():
    model = make_tiny()
    groups = cc.param_groups(model, lr=1e-3, weight_decay=0.05)
    placed = [(g["name"], p) for g in groups for p in g["params"]]
    assert len({id(p) for _, p in placed}) == len(placed), "a parameter is in two groups"
    trainable = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}  # tied: listed once
    assert {id(p) for _, p in placed} == set(trainable)
    for group_name, p in placed:
        assert group_name == expected_group(*trainable[id(p)]), trainable[id(p)][0]
    assert sum(g["name"] == "tt_cores" for g in groups) == 1
    # one flat Parameter per TT layer holds all its cores (tt: 4 cores, ttm: 2), one all its gates
    tt_cores = next(g for g in groups if g["name"] == "tt_cores")["params"]
    assert [p.numel() for p in tt_cores] == [sum(c.numel() for c in lay.cores) for lay in cc.iter_tt_layers(model)]
    assert [len(lay.cores) for lay in cc.iter_tt_layers(model)] == [4, 2]
    assert not any(p is model.frozen.weight or p is model.frozen.bias for _, p in placed)


def test_group_settings_and_overrides():
    model = make_tiny()
    groups = {g["name"]: g for g in cc.param_groups(model, lr=1e-3, weight_decay=0.05)}
    assert set(groups) == {"tt_cores", "tt_gates", "decay", "no_decay"}
    assert (groups["tt_cores"]["lr"], groups["tt_cores"]["weight_decay"]) == (1e-3, 0.0)
    assert (groups["tt_gates"]["lr"], groups["tt_gates"]["weight_decay"]) == (1e-3, 0.0)  # the cores' lr
    assert (groups["decay"]["lr"], groups["decay"]["weight_decay"]) == (1e-3, 0.05)
    assert (groups["no_decay"]["lr"], groups["no_decay"]["weight_decay"]) == (1e-3, 0.0)
    custom = {g["name"]: g for g in cc.param_groups(model, lr=1e-3, core_lr=5e-4, gate_lr=2e-3,
                                                     core_weight_decay=0.01, gate_weight_decay=0.001)}
    assert (custom["tt_cores"]["lr"], custom["tt_cores"]["weight_decay"]) == (5e-4, 0.01)
    assert (custom["tt_gates"]["lr"], custom["tt_gates"]["weight_decay"]) == (2e-3, 0.001)


def test_dense_model_has_no_tt_groups_and_the_optimizer_trains():
    model = Tiny()
    groups = cc.param_groups(model, lr=1e-2)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    tensorized = make_tiny()
    opt = torch.optim.AdamW(cc.param_groups(tensorized, lr=1e-2))
    idx = torch.randint(0, 50, (8, 5))
    before = [p.detach().clone() for p in tensorized.parameters()]
    tensorized(idx).square().mean().backward()
    opt.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, tensorized.parameters())]
    assert all(changed[i] == p.requires_grad for i, p in enumerate(tensorized.parameters()))


def test_compiled_model_and_bad_values():
    model = make_tiny()
    compiled = torch.compile(model, backend="comera", options={"inner": "eager"})
    ids = sorted(id(p) for g in cc.param_groups(compiled, lr=1e-3) for p in g["params"])
    assert ids == sorted(id(p) for g in cc.param_groups(model, lr=1e-3) for p in g["params"])
    with pytest.raises(ValueError, match="gate_lr must be >= 0"):
        cc.param_groups(model, lr=1e-3, gate_lr=-1.0)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        cc.param_groups(model, lr=float("nan"))
