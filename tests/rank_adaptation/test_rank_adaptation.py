"""RankAdaptation (issue 6): the penalty gradient, physical pruning, optimizer state, stages,
compiled models, checkpoints and rank-0 layers. CPU, fp32."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile.rank_adaptation import RankAdaptation, size_coefficients
from comera_compile.tensorize import tt_parametrization

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tensorize"))  # the flat-storage tests' helpers
from test_tt_storage import slice_bonds, split_per_core  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    """A TT-matrix embedding, two TT linears; returns its loss when given targets."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 32)

    def forward(self, idx, target=None):
        h = self.fc2(F.gelu(self.fc1(self.emb(idx))))
        if target is None:
            return h
        return F.mse_loss(h, target)


def make_net(seed=0, rank=6):
    torch.manual_seed(seed)
    net = Net()
    cc.tensorize_(net, {
        "emb": cc.TTConfig(rank=rank, min_size=0, modes=((4, 4, 4), (2, 4, 4))),
        "fc1": cc.TTConfig(rank=rank, min_size=0, modes=((4, 8), (4, 4, 6)), fmt="tt"),
        "fc2": cc.TTConfig(rank=rank, min_size=0, modes=((6, 4, 4), (8, 4)), fmt="tt"),
    })
    return net


def batch(step, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 64, (n,), generator=g)
    target = torch.randn(n, 32, generator=g)
    return idx, target


def tt_layers(net):
    return {lay.fqn: lay for lay in cc.iter_tt_layers(net)}


def randomize_gates(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lay in cc.iter_tt_layers(net):
            for gate in lay.gates:
                gate.copy_(torch.randn(gate.shape, generator=g))


def core_modes(core):
    """The chain mode of a core from its shape alone: n for [r, n, r], m * n for [r, m, n, r]."""
    return math.prod(core.shape[1:-1])


# ---------------------------------------------------------------------------------- the objective


def explicit_size(net, coeffs_of):
    """S(g) = sum_layers sum_k c_k |g_{k-1}|_1 |g_k|_1 in plain torch, differentiable in the gates."""
    total = 0
    for lay in cc.iter_tt_layers(net):
        rho = [torch.ones(())] + [g.abs().sum() for g in lay.gates] + [torch.ones(())]
        for k, c in enumerate(coeffs_of(lay)):
            total = total + c * rho[k] * rho[k + 1]
    return total


def gate_grads_of(net, seed_from):
    """d(``seed_from(net)``)/dg for every gate of every layer, one tensor per gate: the gates are
    views of each layer's flat gate Parameter, so differentiate that and split it per gate."""
    layers = list(cc.iter_tt_layers(net))
    flats = [lay.param.gate_flat for lay in layers]
    grads = torch.autograd.grad(seed_from(net), flats)
    return [g for lay, flat in zip(layers, grads) for g in flat.split(lay.param.gate_sizes)]


def applied_gate_grads(net, opt, ranker, loss_grads=None):
    """Run one optimizer step (lr 0) on zero gradients (or ``loss_grads`` on the gates) and return
    the gates' gradients the optimizer then sees."""
    seen = {}

    def snapshot(optimizer, args, kwargs):
        for lay in cc.iter_tt_layers(net):
            seen[lay.fqn] = [g.clone() for g in lay.param.grads()[1]]

    handle = opt.register_step_pre_hook(snapshot)  # runs after the ranker's pre-hook
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    values = iter(loss_grads or [])
    for lay in cc.iter_tt_layers(net):
        for g in lay.param.grads()[1]:
            value = next(values, None)
            if value is not None:
                g.copy_(value)
    opt.step()
    handle.remove()
    return seen


@pytest.mark.parametrize("weight,scale", [("params", "absolute"), ("flops", "absolute"), ("params", "grad")])
def test_penalty_gradient_equals_autograd_of_explicit_objective(weight, scale):
    """absolute: gamma * dS/dg / W_0 in loss units; grad: the same times the mean |dL/dg| over the gates."""
    net = make_net()
    if weight == "params":
        def coeffs_of(lay):
            return [core_modes(c) for c in lay.cores]
    else:
        # Per-token FLOPs of streaming the input through the cores in order, written out by hand
        # for these modes (Linear: input modes ((4, 8) / (6, 4, 4)) first; embedding: lookups).
        hand = {
            "fc1": [2 * 4 * 8, 2 * 8, 2 * 4, 2 * 4 * 4, 2 * 4 * 4 * 6],
            "fc2": [2 * 6 * 4 * 4, 2 * 4 * 4, 2 * 4, 2 * 8, 2 * 8 * 4],
            "emb": [2 * 2, 2 * 2 * 4, 2 * 2 * 4 * 4],
        }

        def coeffs_of(lay):
            return hand[lay.fqn]
    # The normalization W_0: the mean |dS/dg| over all gates, with the gates at 1 (as built).
    w_0 = torch.cat([d.abs() for d in gate_grads_of(net, lambda n: explicit_size(n, coeffs_of))]).mean().item()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=10, gamma=0.3, weight=weight, prune_every=0,
                            loss_from="observe", switch="manual", scale=scale)
    randomize_gates(net)
    gates = [g for lay in cc.iter_tt_layers(net) for g in lay.gates]
    loss_grads = [1e-3 * torch.randn(g.shape, generator=torch.Generator().manual_seed(i)) for i, g in enumerate(gates)]
    applied = applied_gate_grads(net, opt, ranker, loss_grads)

    unit = 1.0 if scale == "absolute" else torch.cat(loss_grads).abs().mean().item()
    penalty = gate_grads_of(net, lambda n: 0.3 * unit * explicit_size(n, coeffs_of) / w_0)
    expected = [lg + d for lg, d in zip(loss_grads, penalty)]
    got = [g for lay in cc.iter_tt_layers(net) for g in applied[lay.fqn]]
    assert len(got) == len(expected) == 2 + 4 + 4
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert ranker.history[-1]["gamma"] == 0.3 and ranker.history[-1]["stage"] == "early"


def test_size_coefficients_params_are_chain_modes():
    for lay in cc.iter_tt_layers(make_net()):
        assert size_coefficients(lay.spec, "params") == [core_modes(c) for c in lay.cores]
    with pytest.raises(ValueError, match="weight must be one of"):
        size_coefficients(lay.spec, "bytes")


# ---------------------------------------------------------------------------------- pruning


def zero_some_gates(net):
    """Zero a few gates per bond (a different pattern per bond); returns the kept indices."""
    kept = {}
    with torch.no_grad():
        for lay in cc.iter_tt_layers(net):
            kept[lay.fqn] = []
            for k, g in enumerate(lay.gates):
                drop = [i for i in range(g.numel()) if (i + k) % 3 == 0]
                g[drop] = 0.0
                kept[lay.fqn].append([i for i in range(g.numel()) if i not in drop])
    return kept


def test_pruning_preserves_function_and_slices_cores():
    net = make_net()
    randomize_gates(net)
    kept = zero_some_gates(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, threshold=1e-3)
    params_before = {id(p) for p in net.parameters()}
    idx, _ = batch(0, n=40)
    with torch.no_grad():
        before = net(idx)
    assert ranker.prune() is True
    with torch.no_grad():
        after = net(idx)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    for fqn, lay in tt_layers(net).items():
        assert [g.numel() for g in lay.gates] == [len(k) for k in kept[fqn]]
        ranks = tt_parametrization(lay.module).spec.ranks
        assert [c.shape[0] for c in lay.cores] == list(ranks[:-1])
        assert all(bool((g != 0).all()) for g in lay.gates)
    assert {id(p) for p in net.parameters()} == params_before  # the same Parameter objects
    assert ranker.prune() is False  # nothing left below the threshold
    report = cc.compression_report(net)
    assert ranker.num_params() == report.params
    assert ranker.history == []  # prune() called directly records nothing; steps do


def test_effective_params_is_the_size_after_pruning():
    """The size the late stage steers by counts each bond at its gates >= threshold: the size the
    model has once the others are pruned."""
    net = make_net()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lay in cc.iter_tt_layers(net):
            for gate in lay.param.gates:
                gate.copy_(torch.rand(gate.shape, generator=g))
                gate[0] = 1.0  # every bond keeps a rank
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, threshold=0.5)
    expected = ranker.effective_params()
    assert expected < ranker.num_params()
    assert ranker.prune()
    assert ranker.num_params() == cc.compression_report(net).params == expected
    assert ranker.effective_params() == expected


def test_rank_multiple_rounds_up_with_the_largest_gates():
    net = make_net(rank=12)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, threshold=0.5, rank_multiple=4)
    fc1 = tt_layers(net)["fc1"]
    with torch.no_grad():
        g = fc1.gates[1]  # 12 gates: 5 above the threshold -> 8 kept, the 8 largest
        g.copy_(torch.tensor([0.9, 0.01, 0.6, 0.2, 0.3, 0.8, 0.05, 0.7, 0.02, 0.1, 0.55, 0.4]))
    ranker.prune()
    # fc1.gates / fc1.cores are views taken before the pruning: the layer's param has the new ones
    assert fc1.param.gates[1].tolist() == pytest.approx([0.9, 0.6, 0.2, 0.3, 0.8, 0.7, 0.55, 0.4])
    assert fc1.param.cores[1].shape[-1] == 8 and fc1.param.cores[2].shape[0] == 8


@pytest.mark.parametrize("kind", ["adam", "sgd_momentum"])
def test_optimizer_state_is_sliced_like_a_fresh_optimizer(kind):
    def make_opt(params):
        if kind == "adam":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    net = make_net()
    opt = make_opt(net.parameters())
    # gate_lr_scale=1: the reference below is a plain optimizer (the gate step scaling has its own test)
    ranker = RankAdaptation(net, opt, target_compression=10, gamma=0.0, prune_every=0, loss_from="observe",
                            gate_lr_scale=1)
    for step in range(3):  # populate the state
        idx, target = batch(step)
        net(idx, target).backward()
        opt.step()
        opt.zero_grad()
    kept = zero_some_gates(net)

    # Reference: every core and gate, and every optimizer state tensor cut into per-core and
    # per-gate pieces by the shapes alone, each piece sliced by hand, put into a copy of the model
    # and a fresh optimizer.
    ref = copy.deepcopy(net)
    ref_opt = make_opt(ref.parameters())
    ref_params = dict(ref.named_parameters())
    for name, p in net.named_parameters():  # the dense parameters' state as it is
        ref_opt.state[ref_params[name]] = {k: v.clone() for k, v in opt.state[p].items()}
    for (fqn, lay), ref_lay in zip(tt_layers(net).items(), tt_layers(ref).values()):
        param, ref_param = lay.param, ref_lay.param
        shapes = (param.core_shapes, param.gate_sizes)
        cores, gates = slice_bonds(*split_per_core(*shapes, param.core_flat, param.gate_flat), kept[fqn])
        ref_param.assign_(cores, gates)
        core_state, gate_state = opt.state[param.core_flat], opt.state[param.gate_flat]
        assert core_state.keys() == gate_state.keys() and core_state
        ref_core_state, ref_gate_state = {}, {}
        for key in core_state:
            c, g = core_state[key], gate_state[key]
            if c.shape != param.core_flat.shape:  # Adam's step count
                ref_core_state[key], ref_gate_state[key] = c.clone(), g.clone()
                continue
            cs, gs = slice_bonds(*split_per_core(*shapes, c, g), kept[fqn])
            ref_core_state[key] = torch.cat([t.reshape(-1) for t in cs])
            ref_gate_state[key] = torch.cat(gs)
        ref_opt.state[ref_param.core_flat] = ref_core_state
        ref_opt.state[ref_param.gate_flat] = ref_gate_state
    ids_before = [id(p) for g in opt.param_groups for p in g["params"]]
    ranker.prune()
    assert [id(p) for g in opt.param_groups for p in g["params"]] == ids_before
    for name, p in net.named_parameters():
        assert p.shape == ref_params[name].shape, name
        assert torch.equal(p, ref_params[name]), name
        assert opt.state[p].keys() == ref_opt.state[ref_params[name]].keys(), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[ref_params[name]][key]), (name, key)
            if value.dim() > 0:
                assert value.shape == p.shape, (name, key)
    for step in range(3, 5):  # both optimizers keep training the same way
        idx, target = batch(step)
        net(idx, target).backward()
        opt.step()
        opt.zero_grad()
        ref(idx, target).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-7, msg=name)


def test_prune_with_a_live_previous_graph_and_pending_grads():
    """The previous step's loss (and its graph) is still alive during the next forward in most
    training loops, and zero_grad(set_to_none=False) keeps gradient tensors: both must follow."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    RankAdaptation(net, opt, target_compression=10, prune_every=2, threshold=0.999, gamma=1.0)
    loss = None
    for step in range(6):
        idx, target = batch(step)
        loss = net(idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert any(g.numel() < 6 for lay in cc.iter_tt_layers(net) for g in lay.gates)


def test_a_model_with_a_ranker_deep_copies_after_pruning():
    """copy.deepcopy(model) (an evaluation or EMA copy) while the ranker's forward hook is on it."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=1, threshold=0.999, gamma=1.0)
    idx, target = batch(0)
    net(idx, target).backward()
    opt.step()
    assert ranker.prune_events == 1
    twin = copy.deepcopy(net)
    assert not {id(p) for p in twin.parameters()} & {id(p) for p in net.parameters()}
    with torch.no_grad():
        torch.testing.assert_close(twin(idx), net(idx), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- rank 0


def test_layer_losing_a_bond_becomes_a_zero_bias_only_layer():
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    ranker = RankAdaptation(net, opt, target_compression=10, gamma=0.1, prune_every=0, min_rank=0)
    for step in range(2):
        idx, target = batch(step)
        net(idx, target).backward()
        opt.step()
        opt.zero_grad()
    fc1 = tt_layers(net)["fc1"]
    fc2_ranks = ranker.ranks()["fc2"]
    with torch.no_grad():
        fc1.gates[2].zero_()  # the whole bond is below the threshold
    with pytest.warns(UserWarning, match=r"fc1.*min_rank=0.*zero from now on"):
        ranker.prune()
    assert ranker.ranks()["fc1"] == [0, 0, 0, 0]
    assert fc1.module.weight.abs().max() == 0
    x = torch.randn(5, 32)
    torch.testing.assert_close(fc1.module(x), fc1.module.bias.expand(5, -1))
    compiled = torch.compile(net, backend="comera", options={"inner": "aot_eager"})
    for step in range(2, 6):  # keeps training, eager and compiled, and stays zero
        idx, target = batch(step)
        model = net if step < 4 else compiled
        loss = model(idx, target)
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert fc1.module.weight.abs().max() == 0
    assert fc1.module.bias.abs().sum() > 0
    assert ranker.history[-1]["ranks"]["fc1"] == [0, 0, 0, 0]
    assert ranker.history[-1]["ranks"]["fc2"] == fc2_ranks


# ---------------------------------------------------------------------------------- stages


def test_switch_by_step_number_and_late_stage_weights():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=50, gamma=0.01, late_gamma=1.0, augment=0.1,
                            switch=3, prune_every=0, loss_tolerance=0.0, loss_ema=0.0)
    stages = []
    for step in range(5):
        idx, target = batch(step)
        loss = net(idx, target)  # the forward hook records the scalar output
        loss.backward()
        opt.step()
        opt.zero_grad()
        stages.append((ranker.stage, ranker.history[-1]["gamma"]))
    assert stages[:3] == [("early", 0.01)] * 3
    assert ranker.switch_step == 3 and stages[3][0] == "late"
    # The size (far above 1/50 of dense) is the worse objective while the loss sits at its target.
    assert ranker.loss_target is not None and ranker.history[-1]["loss_avg"] is not None
    assert stages[3][1] == 1.0
    # Loss far above its target: only the augmentation term pushes the size.
    ranker.loss_target = ranker.loss_avg / 100
    idx, target = batch(9)
    net(idx, target).backward()
    opt.step()
    assert ranker.history[-1]["gamma"] == pytest.approx(0.1)


def test_switch_when_the_early_stage_converges_or_manually():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=50, converge_window=5, converge_tol=0.01,
                            loss_from="observe", prune_every=0, loss_ema=0.5)
    losses = [4.0, 3.0, 2.0, 1.5, 1.2, 1.1, 1.05] + [1.04] * 20
    for step, value in enumerate(losses):
        ranker.observe(torch.tensor(value))
        opt.step()
        if ranker.stage == "late":
            break
    assert ranker.stage == "late"
    assert 7 + 5 <= ranker.switch_step < len(losses)  # at least a window into the plateau
    assert ranker.loss_target == pytest.approx(ranker.loss_avg * 1.02)

    net = make_net()
    manual = RankAdaptation(net, torch.optim.SGD(net.parameters(), lr=0.0), target_compression=5,
                            switch="manual", prune_every=0)
    for _ in range(3):
        manual.optimizer.step()
    assert manual.stage == "early"
    with pytest.warns(UserWarning, match="without an observed loss"):
        manual.switch_stage()
    assert manual.stage == "late" and manual.switch_step == 3


def test_bad_options_raise():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="target_compression"):
        RankAdaptation(net, opt, target_compression=0)
    with pytest.raises(ValueError, match="weight must be one of"):
        RankAdaptation(net, opt, target_compression=2, weight="bytes")
    with pytest.raises(ValueError, match="switch must be"):
        RankAdaptation(net, opt, target_compression=2, switch="later")
    with pytest.raises(ValueError, match="no tensor-train layers"):
        RankAdaptation(nn.Linear(3, 3), opt, target_compression=2)
    with pytest.raises(ValueError, match="build the optimizer after tensorize_"):
        RankAdaptation(net, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0), target_compression=2)


# ---------------------------------------------------------------------------------- training


def train_teacher_task(gamma, steps=300, seed=0, noise=0.1):
    """Regression onto a rank-2 TT teacher plus noise (loss floor noise**2) with a rank-8 student;
    returns (mean loss of the last 30 steps, compression, ranker)."""
    teacher = make_net(seed=100, rank=2)
    student = make_net(seed=seed, rank=8)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    ranker = RankAdaptation(student, opt, target_compression=20, gamma=gamma, prune_every=25, threshold=2e-2,
                            switch="manual", scale="absolute")
    losses = []
    for step in range(steps):
        idx, _ = batch(step, n=64)
        with torch.no_grad():
            target = teacher(idx) + noise * torch.randn(idx.shape[0], 32, generator=torch.Generator().manual_seed(step))
        loss = student(idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    tail = sum(losses[-30:]) / 30
    return tail, ranker.history[-1]["compression"], ranker


def test_rank_adaptation_compresses_more_at_a_similar_loss():
    loss_fixed, ratio_fixed, _ = train_teacher_task(gamma=0.0)
    loss_adapt, ratio_adapt, ranker = train_teacher_task(gamma=1e-3)
    assert ranker.prune_events >= 1
    assert ratio_adapt > 1.5 * ratio_fixed, (ratio_fixed, ratio_adapt)
    assert loss_adapt < 1.2 * loss_fixed, (loss_fixed, loss_adapt)  # the floor is noise**2 = 0.01


def test_history_and_plot(tmp_path, monkeypatch):
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ranker = RankAdaptation(net, opt, target_compression=10, gamma=1.0, prune_every=3, threshold=0.99, switch=4)
    for step in range(8):
        idx, target = batch(step)
        net(idx, target).backward()
        opt.step()
        opt.zero_grad()
    h = ranker.history
    assert [e["step"] for e in h] == list(range(1, 9))
    assert set(h[0]) >= {"step", "stage", "gamma", "ranks", "params", "compression"}
    assert h[0]["stage"] == "early" and h[-1]["stage"] == "late"
    assert h[-1]["params"] < h[0]["params"] and h[-1]["compression"] > h[0]["compression"]
    json.dumps(h)
    pytest.importorskip("matplotlib")
    ranker.plot(tmp_path / "ranks.png")
    assert (tmp_path / "ranks.png").stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        ranker.plot(tmp_path / "again.png")


# ---------------------------------------------------------------------------------- compiled models


def test_compiled_model_recompiles_once_per_pruning_event():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # only pruning changes the model here
    ranker = RankAdaptation(net, opt, target_compression=10, gamma=0.0, prune_every=3, threshold=1e-3)
    counter = CompileCounter()
    compiled = torch.compile(net, backend=counter)
    fc1 = tt_layers(net)["fc1"]
    with torch._dynamo.config.patch({limit_name: 2}):  # a low limit: pruning must raise it
        for step in range(15):
            idx, target = batch(step)
            loss = compiled(idx, target)  # the first forward after a shape change recompiles, once
            assert counter.frame_count == 1 + ranker.prune_events, step
            loss.backward()
            if step % 3 == 2:  # one gate to prune at each pruning step
                with torch.no_grad():
                    fc1.param.gates[1][0] = 0.0  # the current views (fc1.gates predate the pruning)
            opt.step()
            opt.zero_grad()
        assert ranker.prune_events == 5 and ranker.ranks()["fc1"][1] == 6 - 5
        assert getattr(config, limit_name) >= 2 + ranker.prune_events
    torch._dynamo.reset()


def test_comera_backend_follows_pruned_shapes():
    torch._dynamo.reset()
    net = make_net()
    randomize_gates(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, threshold=1e-3)
    compiled = torch.compile(net, backend="comera", options={"inner": "aot_eager"})
    idx, target = batch(0)
    compiled(idx, target).backward()
    zero_some_gates(net)
    ranker.prune()
    out = compiled(idx)
    torch.testing.assert_close(out, net(idx), rtol=1e-5, atol=1e-6)
    eager = copy.deepcopy(net)
    eager(idx, target).backward()
    opt.zero_grad()
    loss = compiled(idx, target)
    loss.backward()
    for lay, eager_lay in zip(cc.iter_tt_layers(net), cc.iter_tt_layers(eager)):
        for name in ("core_flat", "gate_flat"):
            p, want = getattr(lay.param, name), getattr(eager_lay.param, name)
            assert p.grad.shape == p.shape
            torch.testing.assert_close(p.grad, want.grad, rtol=1e-4, atol=1e-6)
        core_grads, gate_grads = lay.param.grads()
        assert [tuple(g.shape) for g in core_grads] == [tuple(c.shape) for c in lay.cores] == lay.param.core_shapes
        assert [g.shape for g in gate_grads] == [g.shape for g in lay.gates]
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------- checkpoints

_RESUME = textwrap.dedent('''
    import sys, torch
    torch.set_num_threads(1)  # as in this test process: the same reduction order
    sys.path.insert(0, {tests!r})
    from test_rank_adaptation import make_ranker, run_steps, new_training
    net, opt, ranker = new_training(with_ranker={early!r})
    ckpt = torch.load({ckpt!r}, weights_only=False)
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    ranker = ranker or make_ranker(net, opt)  # built on the loaded (pruned) model
    ranker.load_state_dict(ckpt["ranker"])
    run_steps(net, opt, range(ckpt["step"], ckpt["step"] + 8))
    torch.save({{"model": net.state_dict(), "ranker": ranker.state_dict()}}, {out!r})
''')


def make_ranker(net, opt):
    return RankAdaptation(net, opt, target_compression=10, gamma=2.0, prune_every=3, threshold=0.7, switch=6)


def new_training(with_ranker=True):
    net = make_net()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # spread-out gates, so that pruning goes bond by bond
        for lay in cc.iter_tt_layers(net):
            for gate in lay.gates:
                gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
    opt = torch.optim.AdamW(net.parameters(), lr=2e-2, weight_decay=0.1)
    return net, opt, (make_ranker(net, opt) if with_ranker else None)


def run_steps(net, opt, steps):
    for step in steps:
        idx, target = batch(step)
        net(idx, target).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("ranker_first", [True, False], ids=["ranker-then-load", "load-then-ranker"])
def test_checkpoint_after_pruning_resumes_bitwise_in_a_fresh_process(tmp_path, ranker_first):
    net, opt, ranker = new_training()
    run_steps(net, opt, range(9))
    assert ranker.prune_events >= 2 and ranker.stage == "late"
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "ranker": ranker.state_dict(),
                "step": 9}, ckpt)
    run_steps(net, opt, range(9, 17))
    out = tmp_path / "resumed.pt"
    script = _RESUME.format(tests=str(Path(__file__).resolve().parent), ckpt=str(ckpt), out=str(out),
                            early=ranker_first)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=120)
    resumed = torch.load(out, weights_only=False)
    state = net.state_dict()
    assert resumed["model"].keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(resumed["model"][key], value), key
    assert resumed["ranker"]["history"] == ranker.state_dict()["history"]
    assert resumed["ranker"]["prune_events"] == ranker.prune_events


# ---------------------------------------------------------------------------------- the example


def test_train_lm_rank_adapt_flag(tmp_path):
    """benchmarks/train_lm.py --tensorize R --rank-adapt TARGET through the comera backend: pruning
    happens, the compiled model follows, the log and the plot carry ranks and compression."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_train_lm_ra", ROOT / "benchmarks" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    out, plot = tmp_path / "log.json", tmp_path / "ranks.png"
    args = ["--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8",
            "--steps", "12", "--lr", "1e-2", "--eval-every", "0", "--eval-batches", "1", "--max-corpus-mb", "1",
            "--device", "cpu", "--no-progress", "--seed", "0", "--tensorize", "4", "--rank-adapt", "1.5",
            "--rank-adapt-options", '{"prune_every": 4, "threshold": 0.995, "gamma": 0.01}',
            "--compile-options", '{"inner": "aot_eager"}', "--out", str(out), "--rank-plot", str(plot)]
    log = train_lm.main(args)
    assert all(math.isfinite(s["loss"]) for s in log["steps"])
    assert log["prune_events"] >= 1
    assert log["steps"][-1]["compression"] > log["steps"][0]["compression"]
    assert log["compression"] == pytest.approx(log["steps"][-1]["compression"])
    assert len(log["rank_history"]) == 12 and plot.stat().st_size > 1000
    assert json.loads(out.read_text())["prune_events"] == log["prune_events"]
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--rank-plot", str(plot)])


def test_train_lm_resumes_a_rank_adaptive_run_bitwise(tmp_path):
    """benchmarks/train_lm.py: a run stopped at step 6 of 12 (--stop-after 6 --save) and resumed by
    --init-from ends exactly where the uninterrupted run ends: the same per-step losses, pruning
    events, ranker history (stages, ranks, penalty weights) and weights, dropout included. A
    checkpoint with no steps left before --steps loads as weights only (the ranker starts anew)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_train_lm_resume", ROOT / "benchmarks" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    flags = ["--d-model", "64", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8",
             "--steps", "12", "--lr", "1e-2", "--eval-every", "0", "--eval-batches", "1", "--max-corpus-mb", "1",
             "--device", "cpu", "--no-progress", "--seed", "0", "--backend", "eager", "--dropout", "0.1",
             "--tensorize", "16", "--rank-adapt", "4",
             "--rank-adapt-options", '{"prune_every": 3, "threshold": 0.95, "gamma": 0.5, "switch": 5}']
    full = train_lm.main(flags + ["--save", str(tmp_path / "full.pt")])
    half = train_lm.main(flags + ["--stop-after", "6", "--save", str(tmp_path / "half.pt")])
    resumed = train_lm.main(flags + ["--init-from", str(tmp_path / "half.pt"), "--save", str(tmp_path / "resumed.pt")])
    assert [s["step"] for s in half["steps"]] == list(range(1, 7))
    assert [s["step"] for s in resumed["steps"]] == list(range(7, 13))
    assert 1 <= half["prune_events"] < full["prune_events"] == resumed["prune_events"]  # prunes in both halves
    assert half["steps"][-1]["stage"] == "late"  # the resumed ranker goes on in the late stage
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in full["steps"][6:]]
    assert resumed["rank_history"] == full["rank_history"] and len(full["rank_history"]) == 12
    assert resumed["val_loss"] == full["val_loss"]
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), key
    assert got["train_state"]["step"] == want["train_state"]["step"] == 12
    assert got["train_state"]["ranker"]["history"] == want["train_state"]["ranker"]["history"]
    again = train_lm.main(flags + ["--steps", "3", "--init-from", str(tmp_path / "full.pt")])
    assert again["final_parameters"] <= full["final_parameters"]  # loaded at the pruned ranks
    assert [h["step"] for h in again["rank_history"]] == [1, 2, 3]  # a new ranker
    with pytest.raises(SystemExit):
        train_lm.parse_args(flags + ["--stop-after", "13"])


# ---------------------------------------------------------------------------------- pace and defaults


class MLP(nn.Module):
    """A small TT-matrix MLP that returns its MSE loss when given targets."""

    def __init__(self, rank, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)
        cc.tensorize_(self, cc.TTConfig(rank=rank, fmt="ttm", min_size=0))

    def forward(self, x, y=None):
        h = self.fc2(F.gelu(self.fc1(x)))
        return h if y is None else F.mse_loss(h, y)


def test_default_settings_prune_within_a_few_hundred_steps():
    """Teacher of rank 2, student of rank 8, every RankAdaptation option at its default and the
    optimizer from cc.param_groups: the first gates reach the threshold within 400 steps (at a shared
    lr of 3e-3 and an absolute penalty of 1e-3, ~1000 steps were needed)."""
    teacher, student = MLP(rank=2, seed=100), MLP(rank=8, seed=0)
    opt = torch.optim.AdamW(cc.param_groups(student, lr=3e-3))
    ranker = RankAdaptation(student, opt, target_compression=50)
    assert (ranker.gamma, ranker.scale, ranker.threshold, ranker.prune_every) == (1.0, "grad", 1e-2, 50)
    for step in range(400):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(64, 64, generator=g)
        with torch.no_grad():
            y = teacher(x) + 0.05 * torch.randn(64, 64, generator=g)
        loss = student(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ranker.prune_events:
            break
    assert ranker.prune_events >= 1, f"no gate pruned in {ranker.step} steps; ranks {ranker.ranks()}"
    assert math.isfinite(loss.item())
    assert all(min(r) >= 1 for r in ranker.ranks().values())


def test_slow_gate_learning_rate_warns_with_the_fix():
    net = MLP(rank=4, seed=0)
    with pytest.warns(UserWarning, match=r"fewer than 9,900 steps.*cc.param_groups"):
        RankAdaptation(net, torch.optim.AdamW(net.parameters(), lr=1e-4), target_compression=5, gate_lr_scale=1)
    with pytest.warns(UserWarning, match=r"lr 1e-05 x gate_lr_scale 10\).*fewer than 9,900 steps.*cc.param_groups"):
        RankAdaptation(net, torch.optim.AdamW(net.parameters(), lr=1e-5), target_compression=5)  # gates at 10x
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RankAdaptation(net, torch.optim.AdamW(cc.param_groups(net, lr=1e-3)), target_compression=5)
        RankAdaptation(net, torch.optim.SGD(net.parameters(), lr=1e-4), target_compression=5)  # not Adam-type


class _Output:
    """What a Hugging Face model returns with labels=: an object with .loss and .logits."""

    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class Wrapped(nn.Module):
    def __init__(self, as_dict):
        super().__init__()
        self.net, self.as_dict = make_net(), as_dict

    def forward(self, idx, target):
        logits = self.net(idx)
        loss = F.mse_loss(logits, target)
        return {"loss": loss, "logits": logits} if self.as_dict else _Output(loss, logits)


@pytest.mark.parametrize("as_dict", [False, True])
def test_loss_is_read_from_a_model_output_or_a_dict(as_dict):
    model = Wrapped(as_dict)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ranker = RankAdaptation(model, opt, target_compression=10, prune_every=0, loss_ema=0.5, switch="manual")
    seen = []
    for step in range(3):
        idx, target = batch(step)
        out = model(idx, target)
        loss = out["loss"] if as_dict else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append(loss.item())
    expected = seen[0]
    for value in seen[1:]:
        expected = 0.5 * expected + 0.5 * value
    assert ranker.loss_avg == pytest.approx(expected)
    ranker.switch_stage()  # no "without an observed loss" warning: the loss was observed
    assert ranker.loss_target == pytest.approx(expected * 1.02)


# ---------------------------------------------------------------------------------- plain optimizers


class IssueMLP(nn.Module):
    """64 -> 256 -> 64 with GELU, tensorized by ``cc.TTConfig(rank=16)`` (``fmt`` given or the default)."""

    def __init__(self, seed, fmt=None, rank=16):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)
        cc.tensorize_(self, cc.TTConfig(rank=rank) if fmt is None else cc.TTConfig(rank=rank, fmt=fmt, min_size=0))

    def forward(self, x, y=None):
        h = self.fc2(F.gelu(self.fc1(x)))
        return h if y is None else F.mse_loss(h, y)


def train_issue_setup(fmt, groups, steps, **options):
    """The issue's set-up: a rank-2 teacher of the same format the student can fit exactly (the loss
    falls toward zero), AdamW at lr 3e-3 over ``model.parameters()`` or ``cc.param_groups``,
    RankAdaptation(target_compression=4) with ``options``; stops at the first pruning event."""
    teacher = IssueMLP(seed=100, fmt=fmt or "auto", rank=2)
    student = IssueMLP(seed=1, fmt=fmt)
    assert [lay.spec.fmt for lay in cc.iter_tt_layers(student)] == ["tt" if fmt == "tt" else "ttm"] * 2
    opt = torch.optim.AdamW(cc.param_groups(student, lr=3e-3) if groups else student.parameters(), lr=3e-3)
    ranker = RankAdaptation(student, opt, target_compression=4.0, **options)
    for step in range(steps):
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            y = teacher(x)
        student(x, y).backward()
        opt.step()
        opt.zero_grad()
        if ranker.prune_events:
            break
    return ranker


@pytest.mark.parametrize("groups", [False, True], ids=["model.parameters", "param_groups"])
@pytest.mark.parametrize("fmt", [None, "tt"], ids=["default-fmt", "tt"])
def test_defaults_prune_on_a_plain_optimizer_in_both_formats(fmt, groups):
    """Every RankAdaptation option at its default: the first pruning event within 400 steps on a
    ``model.parameters()`` optimizer as on ``cc.param_groups``, in both formats (the plain
    optimizer trained the gates at the cores' lr: no pruning in 1,500 steps)."""
    ranker = train_issue_setup(fmt, groups, steps=400)
    assert ranker.prune_events >= 1, f"no gate pruned in {ranker.step} steps; ranks {ranker.ranks()}"
    first = list(ranker.history[0]["ranks"].values())
    now = list(ranker.ranks().values())
    assert sum(map(sum, now)) < sum(map(sum, first)) and all(min(r) >= 1 for r in now), (first, now)
    assert ranker.prune_events == 1 and ranker.step % ranker.prune_every == 0


def test_gate_lr_scale_is_the_gates_lr_times_the_scale():
    """gate_lr_scale='auto' on a plain optimizer trains exactly as the same optimizer with the gates in
    a group of their own at 10x lr (weight decay, momentum and Adam's moments included); on
    cc.param_groups' default (gates at the cores' lr) it does the same, as cc.param_groups with
    gate_lr=10x and no scaling; gates already faster than the cores are left alone (bitwise); a number
    scales the gates' lr by it."""
    lr = 1e-2

    def optimizer(kind, params):
        return {"sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=0.1, nesterov=True),
                "adam": lambda p: torch.optim.Adam(p, lr=lr, amsgrad=True),
                "adamw": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1)}[kind](params)

    def run(kind, layout, scale, ranker=True, gate_lr=None):
        net = make_net()
        gate_ids = {id(lay.param.gate_flat) for lay in cc.iter_tt_layers(net)}
        others = [p for p in net.parameters() if id(p) not in gate_ids]
        gates = [p for p in net.parameters() if id(p) in gate_ids]
        if layout == "plain":
            params = net.parameters()
        elif layout == "own-group":  # the reference: nothing scaled, the gates at scale x lr
            params = [{"params": others}, {"params": gates, "lr": scale * lr}]
        else:
            params = cc.param_groups(net, lr=lr, weight_decay=0.1, gate_weight_decay=0.1, gate_lr=gate_lr)
        opt = optimizer(kind, params)
        if ranker and layout != "own-group":
            r = RankAdaptation(net, opt, target_compression=10, gamma=0.0, prune_every=0,
                               gate_lr_scale="auto" if scale is None else scale)
            slow = layout == "plain" or (layout == "groups" and gate_lr is None)
            assert r._gate_scales == [10.0 if scale is None and slow else (scale or 1.0)] * 3
        run_steps(net, opt, range(6))
        return {n: p.detach().clone() for n, p in net.named_parameters()}

    for kind in ("sgd", "adam", "adamw"):
        for got, want in ((run(kind, "plain", None), run(kind, "own-group", 10.0)),
                          (run(kind, "plain", 3.0), run(kind, "own-group", 3.0)),
                          (run(kind, "groups", None), run(kind, "groups", None, ranker=False, gate_lr=10 * lr))):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, kind=kind, name=name: f"{kind} {name}: {m}")
        # gates in their own group faster than the cores': 'auto' leaves them alone (bitwise)
        faster = run(kind, "groups", None, gate_lr=10 * lr)
        alone = run(kind, "groups", None, ranker=False, gate_lr=10 * lr)
        for name, p in alone.items():
            assert torch.equal(faster[name], p), (kind, name)


def reference_switch_step(losses, decay, window, tol):
    """The documented automatic switch in plain Python: the first step whose loss EMA improved over
    the last ``window`` steps by less than ``tol`` of its value then or of its whole descent so far."""
    ema, trace, peak = None, [], -math.inf
    for step, value in enumerate(losses):
        ema = value if ema is None else decay * ema + (1 - decay) * value
        peak = max(peak, ema)
        trace.append(ema)
        if len(trace) > window:
            old, new = trace[-window - 1], trace[-1]
            if old - new < tol * max(abs(old), peak - new):
                return step
    return None


def observing_ranker(losses, net=None, opt=None, *, until_late=False):
    """A ranker on a model that does not train (lr 0) that observes ``losses``, one per step (up to
    the switch with ``until_late``); returns the model, the optimizer and the ranker."""
    if net is None:
        net = make_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=50, loss_from="observe", prune_every=0)
    for value in losses:
        ranker.observe(torch.tensor(value))
        opt.step()
        if until_late and ranker.stage == "late":
            break
    return net, opt, ranker


def test_the_early_stage_ends_when_the_loss_falls_toward_zero():
    """A loss that halves every ~70 steps toward 0 (1 -> 1e-4 in 920 steps) improves by ~63% per
    window forever, so the relative test alone never switched; the descent test ends the early
    stage once a window brings < 1% of the descent so far (here at step 537, the loss at 0.5% of
    its start)."""
    losses = [math.exp(-step / 100) for step in range(1500)]
    net, opt, ranker = observing_ranker(losses, until_late=True)
    want = reference_switch_step(losses, decay=0.95, window=100, tol=0.01)
    assert want is not None and losses[want] < 1e-2
    assert ranker.stage == "late" and ranker.switch_step == want, (ranker.switch_step, want)
    assert ranker.loss_target == pytest.approx(ranker.loss_avg * 1.02)
    # a resumed ranker goes on from the same descent
    state = ranker.state_dict()
    other = observing_ranker([], net, opt)[2]
    other.load_state_dict(state)
    assert other._loss_peak == ranker._loss_peak == pytest.approx(1.0)


def test_the_switch_on_a_plateau():
    """A loss that levels off at a floor switches by the same rule, a few windows into the plateau
    (step 268; the relative test alone: step 288)."""
    losses = [0.5 + math.exp(-step / 30) for step in range(600)]
    ranker = observing_ranker(losses)[2]
    want = reference_switch_step(losses, decay=0.95, window=100, tol=0.01)
    assert ranker.switch_step == want and 100 < want < 300


# ---------------------------------------------------------------------------------- min_rank


def zero_gates_except(net, fqn, bond, values):
    """Set one bond's gates to ``values`` (all below the default threshold 1e-2)."""
    with torch.no_grad():
        tt_layers(net)[fqn].param.gates[bond].copy_(torch.tensor(values))


@pytest.mark.parametrize("min_rank", [1, 2])
def test_min_rank_keeps_the_largest_gates_of_a_bond_below_the_threshold(min_rank):
    """Every gate of fc1's third bond below the threshold: the bond keeps its ``min_rank`` largest
    gates (values unchanged) and the layer computes what it computed with the others set to zero;
    the size the late stage steers by counts the bond at that rank; the bond is not pushed further;
    a warning says the layer stays only thanks to the floor."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, min_rank=min_rank)
    values = [0.004, 0.009, 0.001, 0.007, 0.002, 0.003]
    zero_gates_except(net, "fc1", 2, values)
    ref = copy.deepcopy(net)  # the reference: the same model with the pruned gates set to zero
    keep = sorted(sorted(range(6), key=lambda i: -values[i])[:min_rank])
    with torch.no_grad():
        tt_layers(ref)["fc1"].param.gates[2][[i for i in range(6) if i not in keep]] = 0.0
    expected_size = ranker.effective_params()
    floored = rf"bond 3 of fc1 fell below the threshold.*min_rank={min_rank} keeps.*rank {min_rank} on that bond"
    with pytest.warns(UserWarning, match=floored):
        assert ranker.prune()
    assert ranker.ranks()["fc1"] == [4, 6, min_rank, 6] and ranker.dead == []
    assert tt_layers(net)["fc1"].param.gates[2].tolist() == pytest.approx([values[i] for i in keep])
    idx, _ = batch(0, n=40)
    with torch.no_grad():
        torch.testing.assert_close(net(idx), ref(idx), rtol=1e-5, atol=1e-7)
    assert ranker.num_params() == cc.compression_report(net).params == expected_size
    pushes = dict(zip(tt_layers(net), ranker.penalty_gradients(1.0)))
    assert torch.count_nonzero(pushes["fc1"][2]) == 0  # at its floor: nothing to push
    assert all(torch.count_nonzero(p) == p.numel() for k, p in enumerate(pushes["fc1"]) if k != 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per layer
        zero_gates_except(net, "fc1", 1, [0.001] * 6)
        ranker.prune()
    assert ranker.ranks()["fc1"] == [4, min_rank, min_rank, 6]


def test_a_penalty_that_overwhelms_the_loss_keeps_every_layer_by_default():
    """An absolute penalty 100x the loss gradients drives every gate to the threshold at once: with
    the defaults every bond keeps a rank (no layer is deleted) and says so; min_rank=0 deletes the
    layers, each with a warning naming it."""
    def train(**options):
        net = make_net()
        opt = torch.optim.Adam(cc.param_groups(net, lr=3e-3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ranker = RankAdaptation(net, opt, target_compression=100, prune_every=10, gamma=0.1, scale="absolute",
                                    **options)
            run_steps(net, opt, range(150))
        messages = [str(w.message) for w in caught if "RankAdaptation: step" in str(w.message)]
        return net, ranker, messages

    net, ranker, messages = train()
    assert ranker.dead == [] and all(min(r) >= 1 for r in ranker.ranks().values())
    assert all(tt_layers(net)[fqn].module.weight.detach().abs().max() > 0 for fqn in ranker.ranks())
    assert sorted(re.search(r"bond \d of (\w+) fell", m).group(1) for m in messages) == ["emb", "fc1", "fc2"]
    net, ranker, messages = train(min_rank=0)
    assert ranker.dead == ["emb", "fc1", "fc2"] and ranker.ranks()["fc1"] == [0, 0, 0, 0]
    assert sorted(re.search(r"a bond of (\w+) fell", m).group(1) for m in messages) == ["emb", "fc1", "fc2"]
    assert all("min_rank=0" in m and "zero from now on" in m for m in messages)


def test_bad_min_rank_and_gate_lr_scale_raise():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match=r"min_rank must be an int >= 0"):
            RankAdaptation(net, opt, target_compression=2, min_rank=bad)
    for bad in ("fast", 0, -2.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"gate_lr_scale must be 'auto' or a number > 0"):
            RankAdaptation(net, opt, target_compression=2, gate_lr_scale=bad)
    with pytest.raises(ValueError, match=r"converge_window must be an int >= 1"):
        RankAdaptation(net, opt, target_compression=2, converge_window=0)
    with pytest.raises(ValueError, match=r"converge_tol must be >= 0"):
        RankAdaptation(net, opt, target_compression=2, converge_tol=-0.1)


# ---------------------------------------------------------------------------------- one definition of rank


def _reload(state, order):
    """A new model and ranker from ``state`` (model, optimizer, ranker), in one of three orders."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    if order == "ranker-then-load":
        ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, min_rank=state["min_rank"])
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        ranker.load_state_dict(state["ranker"])
        return ranker
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, min_rank=state["min_rank"])
    if order == "load-then-ranker":
        ranker.load_state_dict(state["ranker"])
    return ranker  # "model-only": a ranker without the saved state, on the loaded model


@pytest.mark.parametrize("min_rank", [0, 1])
def test_ranks_are_the_same_after_a_checkpoint_round_trip(min_rank):
    """fc1 loses every gate of a bond: with min_rank=0 it is zeroed (ranks 0 everywhere), with the
    default it keeps rank 1 on that bond. ranks(), the history, the effective size and the layer's
    weight read the same at the end of training and after reloading the checkpoint, with or without
    the ranker's state."""
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ranker = RankAdaptation(net, opt, target_compression=10, prune_every=0, min_rank=min_rank)
    run_steps(net, opt, range(2))
    zero_gates_except(net, "fc1", 2, [0.0] * 6)
    with pytest.warns(UserWarning, match="fc1"):
        ranker.prune()
    run_steps(net, opt, range(2, 4))
    want = {"emb": [6, 6], "fc1": [0, 0, 0, 0] if min_rank == 0 else [4, 6, 1, 6], "fc2": [6, 6, 6, 4]}
    assert ranker.ranks() == ranker.history[-1]["ranks"] == want
    state = {"model": copy.deepcopy(net.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
             "ranker": ranker.state_dict(), "min_rank": min_rank}
    sizes = (ranker.num_params(), ranker.effective_params())
    for order in ("ranker-then-load", "load-then-ranker", "model-only"):
        again = _reload(state, order)
        assert again.ranks() == want, order
        assert (again.num_params(), again.effective_params()) == sizes, order
        fc1 = tt_layers(again.model)["fc1"].module
        assert (fc1.weight.detach().abs().max() == 0) == (min_rank == 0), order
