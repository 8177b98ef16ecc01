"""``TTConfig(activation=...)``: a ``"tt"`` Linear with a nonlinearity at its rank bottleneck computes
``act(x L) R + b``. Checked against float64 references built from the cores by hand, under eager and
``backend="comera"``, through checkpoints, rank pruning and the errors it owes. CPU, float64/fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile import tt
from comera_compile.rank_adaptation import RankAdaptation
from comera_compile.tensorize.checkpoint import tt_layout
from comera_compile.tensorize.transform import restore_tt_layout_

pytestmark = pytest.mark.usefixtures("one_thread")

ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 48)
        self.fc1 = nn.Linear(48, 80)
        self.fc2 = nn.Linear(80, 48, bias=False)

    def forward(self, idx):
        return self.fc2(F.gelu(self.fc1(self.emb(idx))))


def make(act="silu", rank=6, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    net = Net().to(dtype)
    cc.tensorize_(net, cc.TTConfig(rank=rank, fmt="tt", activation=act, min_size=0, n_cores=4),
                  filter_fn=lambda m, fqn: fqn.startswith("fc"))
    with torch.no_grad():  # gates away from 1, so that folding each into its place is checked
        for layer in cc.iter_tt_layers(net):
            layer.param.gate_flat.uniform_(0.5, 1.5)
    return net


def hand_factors(layer):
    """``L`` [in, r] and ``R`` [r, out] of a "tt" layer in float64, written out with einsum from the
    cores and gates (independent of ``tt.bottleneck_factors``)."""
    spec, b = layer.spec, layer.spec.bottleneck
    cores = [c.detach().double() for c in layer.cores]
    gates = [g.detach().double() for g in layer.gates]
    left = cores[0][0]  # [n_1, r_1]
    for k in range(1, b):
        left = torch.einsum("ia,a,ajb->ijb", left, gates[k - 1], cores[k]).reshape(-1, cores[k].shape[-1])
    left = left * gates[b - 1]
    right = cores[-1][..., 0]  # [r_{d-1}, n_d]
    for k in range(len(cores) - 2, b - 1, -1):
        right = torch.einsum("ajb,b,bi->aji", cores[k], gates[k], right).reshape(cores[k].shape[0], -1)
    return left[: spec.rows], right[:, : spec.cols]


@pytest.mark.parametrize("act", sorted(ACTS))
def test_forward_is_act_of_x_l_times_r_against_float64(act):
    net = make(act)
    idx = torch.randint(0, 40, (3, 7))
    h = net.emb(idx)
    (L1, R1), (L2, R2) = (hand_factors(next(cc.iter_tt_layers(m))) for m in (net.fc1, net.fc2))
    want = F.linear(ACTS[act](h @ L1), R1.t(), net.fc1.bias.detach())
    want = F.linear(ACTS[act](F.gelu(want) @ L2), R2.t())
    torch.testing.assert_close(net(idx), want, rtol=1e-12, atol=1e-12)


def test_the_factors_multiply_to_the_linear_layers_weight():
    """Without the activation the same cores make a layer whose weight (tt_materialize) is L @ R."""
    net = make("relu")
    for layer in cc.iter_tt_layers(net):
        L, R = tt.bottleneck_factors(layer.cores, layer.gates, layer.spec)
        HL, HR = hand_factors(layer)
        torch.testing.assert_close(L, HL)
        torch.testing.assert_close(R, HR)
        weight = tt.materialize(layer.cores, layer.gates, layer.spec)  # [out, in] for a Linear
        torch.testing.assert_close((L @ R).t(), weight)
    with pytest.raises(ValueError, match="no rank bottleneck"):
        spec = tt.TTSpec("ttm", (4, 4), (4, 4), (1, 2, 1), 16, 16, True)
        tt.bottleneck_factors(tt.random_cores(spec, 0.1), [torch.ones(2)], spec)


def test_gradients_of_cores_gates_bias_and_input_pass_gradcheck():
    net = make("gelu", rank=3)
    fc1 = net.fc1
    p = fc1.parametrizations.weight[0]
    x = torch.randn(4, 48, dtype=torch.float64, requires_grad=True)

    def f(x, core_flat, gate_flat, bias):
        with torch.no_grad():
            p.core_flat.copy_(core_flat)
            p.gate_flat.copy_(gate_flat)
        # the layer's own math on leaves we control: the same function of (x, cores, gates, bias)
        spec = p.spec
        cores, gates = tt.split_flat(core_flat, gate_flat, spec)
        L, R = tt.bottleneck_factors(cores, gates, spec)
        return F.linear(F.gelu(x @ L), R.t(), bias)

    args = (x, p.core_flat.detach().clone().requires_grad_(), p.gate_flat.detach().clone().requires_grad_(),
            fc1.bias.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args)
    # and the module's backward gives those gradients to its own Parameters
    out = fc1(x)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, p.core_flat, p.gate_flat, fc1.bias), g)
    want = torch.autograd.grad(f(*args), args, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compiled_training_step_matches_eager(inner):
    net = make("silu", dtype=torch.float32)
    twin = copy.deepcopy(net)
    compiled = torch.compile(net, backend="comera", options={"inner": inner}, fullgraph=True)
    idx = torch.randint(0, 40, (2, 9))
    out, want = compiled(idx), twin(idx)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    want.square().mean().backward()
    for (name, a), (_, b) in zip(net.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_dense_weight_and_densify_refuses_changing_nothing():
    net = make("relu")
    idx = torch.randint(0, 40, (5,))
    before = net(idx)
    with pytest.raises(RuntimeError, match="no dense weight"):
        net.fc1.weight
    with pytest.raises(ValueError, match=r"densify_: .*\['fc1', 'fc2'\].*Nothing was changed"):
        cc.densify_(net)
    assert len(list(cc.iter_tt_layers(net))) == 2
    torch.testing.assert_close(net(idx), before, rtol=0, atol=0)
    assert "activation='relu'" in repr(net.fc1)


def test_assigning_a_dense_weight_raises_and_changes_nothing():
    """``module.weight = W`` cannot make ``act(x L) R + b`` compute ``x W^T + b``: it raises like reading
    ``module.weight`` does, and the layer keeps its cores and its function."""
    net = make("silu")
    idx = torch.randint(0, 40, (5,))
    before = net(idx).detach()
    cores = net.fc1.parametrizations.weight[0].core_flat.detach().clone()
    with pytest.raises(RuntimeError, match=r"'silu'.*assign.*no dense weight"):
        net.fc1.weight = torch.randn(80, 48, dtype=torch.float64)
    assert torch.equal(net.fc1.parametrizations.weight[0].core_flat, cores)
    torch.testing.assert_close(net(idx), before, rtol=0, atol=0)

@pytest.mark.parametrize("kwargs, match", [
    ({"activation": "tanh"}, r"activation must be one of \[None, 'relu', 'gelu', 'silu'\]"),
    ({"activation": "relu"}, "needs fmt='tt'"),
    ({"activation": "relu", "fmt": "ttm"}, "needs fmt='tt'"),
    ({"activation": "relu", "fmt": "tt", "init": "svd"}, "needs init='random' or 'balanced'"),
])
def test_config_errors_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cc.TTConfig(**kwargs)


def test_an_embedding_with_an_activation_is_refused_before_any_layer_changes():
    torch.manual_seed(0)
    net = Net()
    with pytest.raises(ValueError, match=r"'emb'.*applies to Linear layers"):
        cc.tensorize_(net, cc.TTConfig(rank=4, fmt="tt", activation="gelu", min_size=0))
    assert not list(cc.iter_tt_layers(net))


def test_state_dict_and_layout_round_trip_exactly():
    net = make("gelu")
    layout = tt_layout(net)
    assert {e["activation"] for e in layout} == {"gelu"}
    torch.manual_seed(5)
    fresh = Net().double()
    restore_tt_layout_(fresh, layout)
    fresh.load_state_dict(net.state_dict())
    idx = torch.randint(0, 40, (4,))
    assert torch.equal(fresh(idx), net(idx))
    assert tt_layout(fresh) == layout
    # a layout written before the option existed has no "activation": the layers are linear
    plain = Net().double()
    restore_tt_layout_(plain, [{k: v for k, v in e.items() if k != "activation"} for e in layout])
    assert all(lay.param.activation is None for lay in cc.iter_tt_layers(plain))


def test_restore_refuses_a_layout_the_model_does_not_fit_naming_the_field():
    """restore_tt_layout_ checks a layout against the model before any layer changes: a module named by
    two layers, a shared module of another shape, an activation on an embedding raise ValueError naming
    the module and the field."""
    layout = tt_layout(make("gelu"))
    fc1, fc2 = (next(e for e in layout if e["fqn"] == name) for name in ("fc1", "fc2"))
    for bad, match in (([fc1, fc2, dict(fc1)], r"'fc1' is named by two layers \(field 'fqn'\)"),
                       ([{**fc1, "shared_with": ["fc2"]}], r"'fc2' \(field 'shared_with' of 'fc1'\).*\(48, 80\)")):
        fresh = Net().double()
        with pytest.raises(ValueError, match=match):
            restore_tt_layout_(fresh, bad)
        assert not list(cc.iter_tt_layers(fresh))
    pair = nn.ModuleDict(dict(fc1=nn.Linear(48, 80), emb=nn.Embedding(80, 48))).double()
    with pytest.raises(ValueError, match=r"'fc1' has field 'activation' 'gelu'.*\['emb'\] are embeddings"):
        restore_tt_layout_(pair, [{**fc1, "shared_with": ["emb"]}])
    assert not list(cc.iter_tt_layers(pair))


def test_pruning_the_bottleneck_bond_keeps_the_function():
    """Gates at the bottleneck below the threshold: the bond shrinks physically and the layer computes
    what it computed with those gates at zero (act(0) = 0 for relu/silu/gelu: the pruned channels
    contribute nothing)."""
    net = make("silu", dtype=torch.float32)
    fc1 = next(cc.iter_tt_layers(net.fc1))
    b = fc1.spec.bottleneck
    with torch.no_grad():
        fc1.param.gates[b - 1][[0, 2]] = 1e-5
    ref = copy.deepcopy(net)
    with torch.no_grad():
        next(cc.iter_tt_layers(ref.fc1)).param.gates[b - 1][[0, 2]] = 0.0
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    ranker = RankAdaptation(net, opt, target_compression=2, prune_every=0, threshold=1e-3)
    assert ranker.prune()
    assert ranker.ranks()["fc1"][b - 1] == fc1.spec.ranks[b] - 2
    idx = torch.randint(0, 40, (6,))
    with torch.no_grad():
        torch.testing.assert_close(net(idx), ref(idx), rtol=1e-5, atol=1e-6)
