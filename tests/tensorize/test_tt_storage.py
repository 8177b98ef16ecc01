"""Flat TT storage: each tensorized layer's cores live in one Parameter (``core_flat``) and its rank
gates in another (``gate_flat``); ``relayout_`` resizes them in place, with gradients and optimizer
state; ``state_dict`` keeps one entry per core and gate; compiled graphs take the two flat
Parameters as inputs. References: float64 contractions written here, per-core slicing by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc


pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    """A TT-matrix embedding, a TT linear and a TT-matrix linear; an optional tied LM head."""

    def __init__(self, tied_head=False):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 32)
        self.head = nn.Linear(32, 64, bias=False) if tied_head else None
        if tied_head:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.fc2(F.gelu(self.fc1(self.emb(idx))))
        return h if self.head is None else self.head(h)


CONFIGS = {
    "emb": cc.TTConfig(rank=6, min_size=0, fmt="ttm", modes=((4, 4, 4), (2, 4, 4))),
    "fc1": cc.TTConfig(rank=6, min_size=0, fmt="tt", modes=((4, 8), (4, 4, 6))),
    "fc2": cc.TTConfig(rank=6, min_size=0, fmt="ttm", modes=((6, 4, 4), (4, 4, 2))),
}


def make_net(seed=0, dtype=torch.float32, tied="skip"):
    torch.manual_seed(seed)
    net = Net(tied_head=tied != "skip").to(dtype)
    cc.tensorize_(net, CONFIGS if tied == "skip" else {**CONFIGS, "head": CONFIGS["emb"]}, tied=tied)
    return net


def layers(net):
    return {lay.fqn: lay for lay in cc.iter_tt_layers(net)}


def reference_weight(cores, gates, param):
    """The layer's weight in float64 from its cores and gates (DESIGN.md's definition, written
    out with einsum): ``G_1 g_1 G_2 ... G_d``, reshaped, cropped and transposed as the layer stores it."""
    acc = torch.ones(1, dtype=torch.float64)
    for k, core in enumerate(cores):
        sub = "...a,asb->...sb" if param.fmt == "tt" else "...a,amnb->...mnb"
        acc = torch.einsum(sub, acc, core.detach().double())
        if k < len(gates):
            acc = acc * gates[k].detach().double()
    acc = acc[..., 0]
    if param.fmt == "ttm":
        d = len(param.row_modes)
        acc = acc.permute(list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2)))
    m = acc.reshape(math.prod(param.row_modes), math.prod(param.col_modes))[: param.rows, : param.cols]
    return m.t() if param.transpose else m


def split_per_core(core_shapes, gate_sizes, core_values, gate_values):
    """Tensors laid out like ``core_flat`` / ``gate_flat`` cut into per-core and per-gate pieces by
    the shapes alone (cores in order, each row-major; gates in order)."""
    sizes = [math.prod(shape) for shape in core_shapes]
    cores = [t.reshape(shape) for t, shape in zip(core_values.split(sizes), core_shapes)]
    return cores, list(gate_values.split(list(gate_sizes)))


def slice_bonds(cores, gates, kept):
    """Keep the ranks ``kept[k]`` (a list of indices) on internal bond k + 1: core k's last dim,
    gate k and core k + 1's first dim; ``None`` keeps the bond whole."""
    cores, gates = list(cores), list(gates)
    for k, keep in enumerate(kept):
        if keep is None:
            continue
        keep = torch.tensor(keep, dtype=torch.long)
        cores[k] = cores[k].index_select(cores[k].dim() - 1, keep)
        gates[k] = gates[k].index_select(0, keep)
        cores[k + 1] = cores[k + 1].index_select(0, keep)
    return cores, gates


def flat(cores, gates):
    """Per-core and per-gate tensors laid out as ``core_flat`` and ``gate_flat``."""
    return torch.cat([c.reshape(-1) for c in cores]), torch.cat(list(gates))


def relayout(param, kept, optimizers=()):
    """Keep ``kept`` on every bond through the public index maps and ``relayout_``."""
    cores, gates = slice_bonds(*param.positions(), kept)
    param.relayout_(cores, gates, optimizers=optimizers)


# A bond pattern per layer: every bond loses some ranks (not a prefix), one bond of fc1 stays whole.
KEPT = {"emb": [[0, 2, 5], [1, 3, 4]], "fc1": [[1, 3], None, [0, 4], [2]], "fc2": [[0, 5], [1, 2, 3]]}


# ---------------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("tied", ["skip", "share"])
def test_a_model_has_exactly_two_tt_parameters_per_layer(tied):
    net = make_net(tied=tied)
    tt_layers = list(cc.iter_tt_layers(net))
    assert [lay.fqn for lay in tt_layers] == ["emb", "fc1", "fc2"]
    if tied == "share":
        assert tt_layers[0].shared_with == ("head",)
    names = [n for n, _ in net.named_parameters()]  # a shared Parameter is listed once
    tt_names = [n for n in names if ".parametrizations." in n]
    assert tt_names == [f"{lay.fqn}.parametrizations.weight.0.{kind}" for lay in tt_layers
                        for kind in ("core_flat", "gate_flat")]
    assert len(names) == len(tt_names) + 2  # and the two biases
    for lay in tt_layers:
        param = lay.param
        assert param.core_flat.shape == (sum(c.numel() for c in param.cores),)
        assert param.gate_flat.shape == (sum(g.numel() for g in param.gates),)
        assert len(param.cores) == len(param.core_shapes) and len(param.gates) == len(param.core_shapes) - 1
        # cores and gates are views of the two Parameters, in order, not Parameters of their own
        offset = 0
        for core in param.cores:
            assert not isinstance(core, nn.Parameter) and core._base is param.core_flat
            assert core.storage_offset() == offset and core.is_contiguous()
            offset += core.numel()
        assert all(g._base is param.gate_flat for g in param.gates)
        assert param.ranks == [1] + param.gate_sizes + [1]
    assert sum(p.numel() for p in net.parameters()) == cc.compression_report(net).params


def test_compiled_graph_takes_each_layers_flat_parameters():
    """The graph Dynamo hands the backend has each layer's core_flat and gate_flat as inputs (the
    Parameter objects themselves), and no per-core input; explain shows every layer rewritten."""
    net = make_net()
    idx = torch.randint(0, 64, (2, 5))
    inputs = []

    def capture(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    torch.compile(net, backend=capture)(idx)
    tt_params = [p for lay in cc.iter_tt_layers(net) for p in (lay.param.core_flat, lay.param.gate_flat)]
    assert [t for t in inputs if any(t is p for p in tt_params)] == tt_params
    assert len(inputs) == len(tt_params) + 2 + 1  # the two biases and idx

    torch._dynamo.reset()
    report = cc.explain(net, idx, options={"inner": "aot_eager"})
    assert len(report.graph_reports) == 1
    gm = report.graph_reports[0].gm
    placeholders = {n.name: tuple(n.meta["example_value"].shape) for n in gm.graph.nodes if n.op == "placeholder"}
    assert not [n for n in placeholders if "cores" in n or "gates" in n]
    for lay in cc.iter_tt_layers(net):
        for kind in ("core_flat", "gate_flat"):
            found = [shape for name, shape in placeholders.items()
                     if f"_{lay.fqn}_modules_parametrizations_" in name and name.endswith(f"_{kind}_")]
            assert found == [tuple(getattr(lay.param, kind).shape)], (lay.fqn, kind, list(placeholders))
    assert sorted(r.module for r in report.rewrites) == ["emb", "fc1", "fc2"]
    torch.testing.assert_close(report.output, net(idx), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- relayout_


def test_relayout_drops_zero_gated_ranks_and_keeps_the_function():
    net = make_net(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for fqn, lay in layers(net).items():
            for gate, keep in zip(lay.param.gates, KEPT[fqn]):
                gate.copy_(0.5 + torch.rand(gate.shape, generator=g, dtype=torch.float64))
                if keep is not None:  # the ranks to drop get a zero gate
                    gate[[i for i in range(gate.numel()) if i not in keep]] = 0.0
    idx = torch.randint(0, 64, (3, 7))
    want_out = net(idx).detach()
    want = {fqn: reference_weight(lay.param.cores, lay.param.gates, lay.param) for fqn, lay in layers(net).items()}
    identity = {n: p for n, p in net.named_parameters()}
    old = {fqn: (list(lay.param.core_shapes), list(lay.param.gate_sizes), lay.param.core_flat.detach().clone(),
                 lay.param.gate_flat.detach().clone()) for fqn, lay in layers(net).items()}

    for fqn, lay in layers(net).items():
        relayout(lay.param, KEPT[fqn])

    assert dict(net.named_parameters()).keys() == identity.keys()
    assert all(p is identity[n] for n, p in net.named_parameters())  # the same Parameter objects
    for fqn, lay in layers(net).items():
        param = lay.param
        cores, gates = slice_bonds(*split_per_core(*old[fqn]), KEPT[fqn])
        assert param.core_shapes == [tuple(c.shape) for c in cores]
        assert param.gate_sizes == [g.numel() for g in gates]
        for got, expected in zip(param.cores + param.gates, cores + gates):
            assert torch.equal(got, expected)
        assert all(bool((g != 0).all()) for g in param.gates)
        torch.testing.assert_close(reference_weight(param.cores, param.gates, param), want[fqn], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lay.module.weight, want[fqn], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(net(idx), want_out, rtol=1e-12, atol=1e-12)


def train(net, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 5), generator=g)
        net(idx).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("kind", ["adamw_amsgrad", "sgd_momentum"])
def test_relayout_gathers_grads_and_optimizer_state_like_slicing_each_core_by_hand(kind):
    def make_opt(params):
        if kind == "adamw_amsgrad":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    net = make_net()
    opt = make_opt(net.parameters())
    train(net, opt, 3)
    net(torch.randint(0, 64, (4, 5))).square().mean().backward()  # a pending gradient
    ref = copy.deepcopy(net)  # trained on below with per-core state sliced by hand
    ref_opt = make_opt(ref.parameters())
    ref_params = dict(ref.named_parameters())
    expected = {}
    for name, p in net.named_parameters():
        state = {key: value.clone() for key, value in opt.state[p].items()}
        ref_opt.state[ref_params[name]] = state
        ref_params[name].grad = p.grad.clone()
        expected[name] = (state, p.grad.clone())
    for fqn, lay in layers(ref).items():  # the reference: everything cut per core and gate, sliced by hand
        param, prefix = lay.param, f"{fqn}.parametrizations.weight.0."
        shapes, kept = (param.core_shapes, param.gate_sizes), KEPT[fqn]
        (core_state, core_grad), (gate_state, gate_grad) = (expected[prefix + k] for k in ("core_flat", "gate_flat"))

        def by_hand(core_values, gate_values):
            return slice_bonds(*split_per_core(*shapes, core_values, gate_values), kept)

        param.assign_(*by_hand(param.core_flat.detach(), param.gate_flat.detach()))
        param.core_flat.grad, param.gate_flat.grad = flat(*by_hand(core_grad, gate_grad))
        for key, value in core_state.items():
            if value.shape == core_grad.shape:  # step counts are left as they are
                core_state[key], gate_state[key] = flat(*by_hand(value, gate_state[key]))

    params_before = [id(p) for group in opt.param_groups for p in group["params"]]
    for fqn, lay in layers(net).items():
        relayout(lay.param, KEPT[fqn], optimizers=[opt])
    assert [id(p) for group in opt.param_groups for p in group["params"]] == params_before
    for name, p in net.named_parameters():
        want = ref_params[name]
        assert torch.equal(p, want) and torch.equal(p.grad, want.grad), name
        assert opt.state[p].keys() == ref_opt.state[want].keys(), name
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[want][key]), (name, key)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    train(net, opt, 2, seed=1)  # the gathered state trains like the sliced one
    train(ref, ref_opt, 2, seed=1)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-7, msg=name)


# ---------------------------------------------------------------------------------- state_dict


def test_state_dict_has_one_entry_per_core_and_gate_and_loads_changed_ranks(tmp_path):
    a = make_net(seed=0)
    with torch.no_grad():
        for lay in layers(a).values():
            lay.param.gate_flat.uniform_(0.5, 1.5)
    for fqn, lay in layers(a).items():
        relayout(lay.param, KEPT[fqn])
    state = a.state_dict()
    tt_keys = [k for k in state if ".parametrizations." in k]
    want_keys = []
    for fqn, lay in layers(a).items():
        prefix = f"{fqn}.parametrizations.weight.0."
        want_keys += [f"{prefix}cores.{k}" for k in range(len(lay.param.core_shapes))]
        want_keys += [f"{prefix}gates.{k}" for k in range(len(lay.param.gate_sizes))]
        for k, core in enumerate(lay.param.cores):
            assert torch.equal(state[f"{prefix}cores.{k}"], core) and not state[f"{prefix}cores.{k}"].requires_grad
        for k, gate in enumerate(lay.param.gates):
            assert torch.equal(state[f"{prefix}gates.{k}"], gate)
    assert sorted(tt_keys) == sorted(want_keys)
    assert [tuple(state[f"fc1.parametrizations.weight.0.cores.{k}"].shape) for k in range(5)] == [
        (1, 4, 2), (2, 8, 6), (6, 4, 2), (2, 4, 1), (1, 6, 1)]
    path = tmp_path / "pruned.pt"
    torch.save(state, path)

    b = make_net(seed=1)  # the original ranks, other values
    idx = torch.randint(0, 64, (3, 7))
    assert not torch.allclose(a(idx), b(idx))
    before = {n: p for n, p in b.named_parameters()}
    b.load_state_dict(torch.load(path))
    assert all(p is before[n] for n, p in b.named_parameters())  # the same Parameter objects
    for fqn, lay in layers(b).items():
        want = layers(a)[fqn].param
        assert lay.param.core_shapes == want.core_shapes and lay.param.gate_sizes == want.gate_sizes
        torch.testing.assert_close(lay.module.weight, reference_weight(want.cores, want.gates, want).float(),
                                   rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b(idx), a(idx))

    partial = dict(state)
    del partial["fc2.parametrizations.weight.0.gates.1"]
    partial["fc2.parametrizations.weight.0.cores.3"] = torch.zeros(1)
    result = make_net().load_state_dict(partial, strict=False)
    assert result.missing_keys == ["fc2.parametrizations.weight.0.gates.1"]
    assert result.unexpected_keys == ["fc2.parametrizations.weight.0.cores.3"]


def test_a_checkpoint_whose_bonds_do_not_line_up_is_refused_by_name():
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 20)
    cc.tensorize_(lin, cc.TTConfig(rank=4, modes=((3, 4), (4, 5)), fmt="tt", min_size=0))
    state = lin.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    key = "parametrizations.weight.0.cores.1"
    state[key] = state[key][..., :3].clone()  # core 1 ends with rank 3, gate 1 and core 2 still have 4
    with pytest.raises(RuntimeError, match="bond 2 does not line up: .*cores.1 ends with rank 3"):
        lin.load_state_dict(state)
    for k, v in lin.state_dict().items():  # nothing was changed by the refused load
        torch.testing.assert_close(v, before[k])
