"""tensorize_ / densify_ / compression_report / iter_tt_layers (comera_compile/tensorize/)."""

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_compile import explain, tt
from tiny_models import Tiny  # noqa: E402  (tests/tensorize/tiny_models.py)
from comera_compile.tensorize import (
    TTConfig,
    TTParametrization,
    compression_report,
    densify_,
    iter_tt_layers,
    tensorize_,
)


def reference_weight(cores, gates, spec):
    """Independent float64 contraction over the full index tensor (DESIGN.md's definition)."""
    acc = torch.ones(1, dtype=torch.float64)
    for k, core in enumerate(cores):
        sub = "...a,asb->...sb" if spec.fmt == "tt" else "...a,amnb->...mnb"
        acc = torch.einsum(sub, acc, core.detach().double())
        if k < len(gates):
            acc = acc * gates[k].detach().double()
    acc = acc[..., 0]
    if spec.fmt == "ttm":
        d = len(spec.row_modes)
        acc = acc.permute(list(range(0, 2 * d, 2)) + list(range(1, 2 * d, 2)))
    m = acc.reshape(spec.padded_rows, spec.padded_cols)[: spec.rows, : spec.cols]
    return m.t() if spec.transpose else m


def _tensorized_tiny(seed=0, rank=6, **kw):
    torch.manual_seed(seed)
    m = Tiny()
    m.dense_weights = [m.emb.weight, m.fc1.weight]  # references a user might still hold
    fmt = kw.pop("fmt", None)  # CoMERA's split by default: a TT-matrix embedding, a "tt" Linear
    tensorize_(m, {"emb": TTConfig(rank=rank, min_size=0, fmt=fmt or "ttm", **kw),
                   "fc1": TTConfig(rank=rank, min_size=0, fmt=fmt or "tt", **kw)},
               filter_fn=lambda mod, fqn: fqn in ("emb", "fc1"))
    return m


# ----------------------------------------------------------------------------------------------
# Structure
# ----------------------------------------------------------------------------------------------


def test_layers_keep_type_and_name_and_weight_is_the_op():
    m = _tensorized_tiny()
    assert isinstance(m.emb, nn.Embedding) and isinstance(m.fc1, nn.Linear)
    assert type(m.fc2) is nn.Linear and "weight" in m.fc2._parameters  # not selected: untouched
    names = dict(m.named_parameters())
    # two flat Parameters per layer: every core and every gate is a view of one of them
    assert {n for n in names if ".parametrizations." in n} == {
        f"{layer}.parametrizations.weight.0.{flat}" for layer in ("emb", "fc1") for flat in ("core_flat", "gate_flat")}
    keys = m.state_dict().keys()  # the checkpoint still has one entry per core and gate
    assert "fc1.parametrizations.weight.0.cores.0" in keys and "emb.parametrizations.weight.0.gates.0" in keys
    assert not any("_flat" in k for k in keys)
    assert not any(n.endswith("original") for n in names)  # no dense weight kept
    assert not any(k.endswith("original") for k in m.state_dict())
    assert m.fc1.parametrizations.weight.original.numel() == 0
    assert all(w.numel() == 0 for w in m.dense_weights)  # the dense storage was released
    layers = {layer.fqn: layer for layer in iter_tt_layers(m)}
    assert set(layers) == {"emb", "fc1"}
    assert layers["emb"].spec.fmt == "ttm" and layers["fc1"].spec.fmt == "tt"
    for layer in layers.values():
        assert all(torch.equal(g, torch.ones_like(g)) for g in layer.gates)  # gates start at 1
        assert len(layer.gates) == layer.spec.n_cores - 1
        w = layer.module.weight
        assert w.shape == tuple(layer.spec.weight_shape)
        torch.testing.assert_close(w, reference_weight(layer.cores, layer.gates, layer.spec).to(w.dtype))
    idx = torch.randint(0, 101, (3, 5))
    want = F.linear(torch.relu(F.linear(F.embedding(idx, m.emb.weight), m.fc1.weight, m.fc1.bias)),
                    m.fc2.weight, m.fc2.bias).mean(1)
    torch.testing.assert_close(m(idx), want)


def test_dynamo_graph_shows_linear_of_tt_materialize():
    m = _tensorized_tiny()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    idx = torch.randint(0, 101, (2, 4))
    out = torch.compile(m, backend=backend)(idx)
    torch.testing.assert_close(out, m(idx))
    (gm,) = graphs
    op = torch.ops.comera.tt_materialize
    producers = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (F.linear, F.embedding):
            w = node.args[1]
            producers[node.target] = w.target if w.op == "call_function" else w.op
    assert producers[F.embedding] is op
    # fc1's weight comes from the op; fc2 (not tensorized) is a plain placeholder.
    linear_weights = [n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear]
    assert [w.target is op for w in linear_weights] == [True, False]


def _tt_weight(fmt, row_modes, col_modes, rank, rows, cols, transpose):
    """A weight that is exactly a cropped TT of the given layout and rank."""
    sizes = tt.core_sizes(fmt, row_modes, col_modes)
    spec = tt.TTSpec(fmt, row_modes, col_modes, tt.cap_ranks(sizes, tt.normalize_ranks(rank, len(sizes))),
                     rows, cols, transpose)
    cores = [torch.randn(s, dtype=torch.float64) for s in spec.core_shapes]
    return tt.materialize(cores, [torch.ones(r, dtype=torch.float64) for r in spec.gate_sizes], spec)


@pytest.mark.parametrize("dynamic", [False, True])
def test_aot_eager_training_step_matches_eager(dynamic):
    """The op's fake and its backward formulas trace through AOTAutograd (static and dynamic
    token counts): loss and every core/gate gradient equal eager."""
    eager = _tensorized_tiny(seed=0)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="aot_eager", dynamic=dynamic)
    for tokens in (5, 7):
        idx = torch.randint(0, 101, (3, tokens))
        target = torch.randint(0, 7, (3,))
        for model, fn in ((eager, eager), (compiled_model, step)):
            model.zero_grad()
            F.cross_entropy(fn(idx), target).backward()
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_padding_never_changes_outputs():
    """Dense layers whose weights are cropped TTs of rank 2 in padded layouts: TT-SVD at rank 4
    (a 0/1 crop mask has TT rank 2) reproduces them exactly, so the layers' outputs are unchanged
    by the padding, which is cropped away."""
    torch.manual_seed(0)
    lin, emb = nn.Linear(37, 29).double(), nn.Embedding(53, 10).double()
    with torch.no_grad():
        lin.weight.copy_(_tt_weight("tt", (5, 8), (6, 5), 2, 37, 29, True))
        emb.weight.copy_(_tt_weight("ttm", (7, 8), (2, 5), 2, 53, 10, False))
    x, idx = torch.randn(4, 37, dtype=torch.float64), torch.randint(0, 53, (9,))
    want_lin, want_emb = lin(x), emb(idx)
    model = nn.ModuleDict(dict(lin=lin, emb=emb))
    tensorize_(model, {
        "lin": TTConfig(rank=4, modes=((5, 8), (6, 5)), init="svd", min_size=0, fmt="tt"),
        "emb": TTConfig(rank=4, modes=((7, 8), (2, 5)), init="svd", min_size=0),
    })
    report = compression_report(model)
    assert {lay.fqn: lay.padded_shape for lay in report.layers} == {"lin": (40, 30), "emb": (56, 10)}
    assert all(lay.init_error < 1e-10 and lay.tt_params < lay.dense_params for lay in report.layers)
    torch.testing.assert_close(model["lin"](x), want_lin)
    torch.testing.assert_close(model["emb"](idx), want_emb)
    # And the crop is exact for any cores: the weight is the top-left block of the padded matrix.
    for layer in iter_tt_layers(model):
        with torch.no_grad():
            for c in layer.cores:
                c.normal_()
        torch.testing.assert_close(layer.module.weight, reference_weight(layer.cores, layer.gates, layer.spec))


def test_assigning_a_weight_refits_the_cores():
    torch.manual_seed(0)
    m = _tensorized_tiny(rank=4)
    target = _tt_weight("tt", (8, 6), (8, 10), 4, 48, 80, True).float()
    assert next(iter_tt_layers(m)).fqn == "emb"
    assert {layer.fqn: layer.spec.describe() for layer in iter_tt_layers(m)}["fc1"] == "[8,6]||[8,10]"
    m.fc1.weight = target
    torch.testing.assert_close(m.fc1.weight, target, rtol=1e-4, atol=1e-4)
    assert m.fc1.parametrizations.weight.original.numel() == 0


# ----------------------------------------------------------------------------------------------
# Initialization
# ----------------------------------------------------------------------------------------------


def test_random_init_matches_dense_variance():
    in_f, out_f = 192, 256
    second, emb_rows = [], []
    for seed in range(32):
        torch.manual_seed(seed)
        model = nn.ModuleDict(dict(lin=nn.Linear(in_f, out_f), emb=nn.Embedding(300, 32)))
        tensorize_(model, TTConfig(rank=8, min_size=0, fmt="tt"))
        second.append(model["lin"].weight.pow(2).mean().item())
        emb_rows.append(model["emb"].weight.detach())
    # CoMERA: std sqrt(1 / (in + out)) for linear layers.
    assert sum(second) / len(second) == pytest.approx(1 / (in_f + out_f), rel=0.15)
    rows = torch.cat(emb_rows)
    # nn.Embedding's rows are N(0, 1).
    assert rows.pow(2).mean().item() == pytest.approx(1.0, rel=0.15)
    assert abs(rows.mean().item()) < 0.05
    # A custom target.
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f)
    tensorize_(lin, TTConfig(rank=8, min_size=0, init_std=0.5))
    assert lin.weight.std().item() == pytest.approx(0.5, rel=0.35)


def test_svd_init_from_pretrained_reports_error_and_respects_tolerance():
    torch.manual_seed(0)
    # A weight with exact low TT rank in layout [6,4,4]||[4,4,6] plus a little noise.
    spec = tt.TTSpec("tt", (6, 4, 4), (4, 4, 6), (1, 3, 4, 4, 4, 3, 1), 96, 96, True)
    cores = [torch.randn(s) for s in spec.core_shapes]
    w = tt.materialize(cores, [torch.ones(r) for r in spec.gate_sizes], spec)
    w = w / w.std() * 0.05
    lin = nn.Linear(96, 96)
    with torch.no_grad():
        lin.weight.copy_(w + 1e-5 * torch.randn_like(w))
    x = torch.randn(5, 96)
    want = lin(x)
    tensorize_(lin, TTConfig(rank=30, modes=((6, 4, 4), (4, 4, 6)), init="svd", svd_tol=1e-2, fmt="tt",
                             min_size=0))
    (layer,) = list(iter_tt_layers(lin))
    assert layer.spec.ranks == (1, 3, 4, 4, 4, 3, 1)  # the tolerance found the true ranks
    (row,) = compression_report(lin).layers
    assert row.init == "svd" and row.init_error < 1e-2
    assert (lin(x) - want).norm() / want.norm() < 1e-2
    # A rank cap below the true ranks: larger error, still reported.
    lin2 = nn.Linear(96, 96)
    with torch.no_grad():
        lin2.weight.copy_(w)
    tensorize_(lin2, TTConfig(rank=2, modes=((6, 4, 4), (4, 4, 6)), init="svd", min_size=0, fmt="tt"))
    (row2,) = compression_report(lin2).layers
    assert row2.ranks == (1, 2, 2, 2, 2, 2, 1) and 0.01 < row2.init_error < 1
    assert "svd err" in str(compression_report(lin2))


# ----------------------------------------------------------------------------------------------
# Selection, configs, errors
# ----------------------------------------------------------------------------------------------


def test_filter_fn_and_per_module_configs():
    torch.manual_seed(0)
    m = Tiny()
    calls = []

    def filter_fn(module, fqn):
        calls.append((type(module).__name__, fqn))
        return isinstance(module, nn.Linear)

    tensorize_(m, TTConfig(rank=4, min_size=0), filter_fn=filter_fn)
    assert {layer.fqn for layer in iter_tt_layers(m)} == {"fc1", "fc2"} - {"fc2"} | _maybe_fc2(m)
    assert ("Embedding", "emb") in calls and ("Linear", "fc1") in calls

    m = Tiny()
    tensorize_(m, {"emb": TTConfig(rank=5, fmt="ttm", n_cores=2, min_size=0),
                   "re:fc\\d": TTConfig(rank=3, fmt="ttm", min_size=0)})
    specs = {layer.fqn: layer.spec for layer in iter_tt_layers(m)}
    assert specs["emb"].n_cores == 2 and max(specs["emb"].ranks) == 5
    assert specs["fc1"].fmt == "ttm" and max(specs["fc1"].ranks) == 3

    m = Tiny()
    tensorize_(m, {"fc1": TTConfig(rank=4, n_cores=3, min_size=0), "_default": None})
    assert [(layer.fqn, layer.spec.n_cores) for layer in iter_tt_layers(m)] == [("fc1", 3)]


def _maybe_fc2(m):
    """fc2 (80 -> 7) does not compress at rank 4, so it is skipped with a reason."""
    return {layer.fqn for layer in iter_tt_layers(m) if layer.fqn == "fc2"}


class Bilinearish(nn.Module):
    """A leaf holding a 2-D weight that tensorize_ does not support."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(300, 300))


def test_skipped_layers_carry_reasons():
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(
        small=nn.Linear(8, 8),
        sparse=nn.Embedding(1000, 64, sparse=True),
        renorm=nn.Embedding(1000, 64, max_norm=1.0),
        norm=nn.LayerNorm(64),
        wide=nn.Linear(256, 256),
        no_gain=nn.Linear(12, 12),
        odd=Bilinearish(),
        mlp=nn.Sequential(nn.Linear(300, 300), nn.GELU()),
    ))
    tied_a, tied_b = nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False)
    tied_b.weight = tied_a.weight
    model["tied_a"], model["tied_b"] = tied_a, tied_b
    tensorize_(model, TTConfig(rank=8, min_size=100), filter_fn=lambda mod, fqn: True)
    report = compression_report(model)
    reasons = {s.fqn: s.reason for s in report.skipped}
    assert "min_size" in reasons["small"]
    assert "sparse" in reasons["sparse"] and "max_norm" in reasons["renorm"]
    assert "unsupported module type Bilinearish" in reasons["odd"]
    assert "norm" not in reasons and "mlp" not in reasons  # 1-D weights and containers are no candidates
    assert "shared" in reasons["tied_a"] and "shared" in reasons["tied_b"]
    assert "no compression" in reasons["no_gain"]
    assert [lay.fqn for lay in report.layers] == ["wide", "mlp.0"]
    text = str(report)
    assert "skipped:" in text and "tied_a" in text and "min_size" in text
    # The tie survives.
    assert model["tied_a"].weight is model["tied_b"].weight


def test_invalid_rank_or_shape_raises_naming_the_layer():
    for cfg, match in [
        (TTConfig(rank=[4, 4], min_size=0, fmt="tt"), r"layer 'fc1'.*valid: a positive int, or 3 positive ints"),
        (TTConfig(rank=4, modes=((4, 4), (8, 10)), min_size=0, fmt="tt"),
         r"layer 'fc1'.*less than rows x cols = 48 x 80"),
        (TTConfig(rank=4, fmt="ttm", modes=((6, 8), (80,)), min_size=0), r"layer 'fc1'.*as many row modes"),
        (TTConfig(rank=4, fmt="tt", n_cores=1, min_size=0), r"layer 'fc1'.*needs >= 2 cores"),
    ]:
        torch.manual_seed(0)
        m = Tiny()
        before = copy.deepcopy(m.state_dict())
        with pytest.raises(ValueError, match=match):
            tensorize_(m, cfg, filter_fn=lambda mod, fqn: fqn == "fc1")
        assert list(iter_tt_layers(m)) == []  # nothing changed
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    for kwargs, match in [(dict(fmt="cp"), "'auto', 'tt', 'ttm'"), (dict(rank=0), "rank"),
                          (dict(rank=[2, 0]), "positive"), (dict(init="zeros"), "'random', 'balanced', 'svd'"),
                          (dict(svd_tol=0.1), "svd_tol"), (dict(modes=((2, 3),)), "row_modes, col_modes"),
                          (dict(max_pad=-1), "max_pad"), (dict(n_cores=0), "n_cores")]:
        with pytest.raises(ValueError, match=match):
            TTConfig(**kwargs)


def test_config_keys_that_select_no_layer_raise_with_the_closest_names():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(lm_head=nn.Linear(64, 300), blocks=nn.ModuleList([nn.Linear(64, 64)])))
    before = copy.deepcopy(m.state_dict())
    for config, match in [
        ({"lm_haed": TTConfig(rank=4)}, r"'lm_haed' matches no layer.*closest layer names: \['lm_head'"),
        ({"re:head": TTConfig(rank=4)}, r"'re:head' matches no layer \(the pattern must match a whole name\)"),
        ({"blocks": TTConfig(rank=4)}, r"'blocks' names a ModuleList.*\['blocks.0'\].*re:blocks\[\.\]\.\*"),
        ({"re:(": TTConfig(rank=4)}, r"not a valid regular expression"),
    ]:
        with pytest.raises(ValueError, match=match):
            tensorize_(m, {**config, "_default": TTConfig(rank=4, min_size=0)})
        assert list(iter_tt_layers(m)) == []
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_unselected_layers_are_listed_and_containers_are_not():
    torch.manual_seed(0)
    m = nn.ModuleDict(dict(attn=nn.Linear(64, 64), mlp=nn.Sequential(nn.Linear(64, 256), nn.GELU(),
                                                                       nn.Linear(256, 64))))
    tensorize_(m, TTConfig(rank=4, min_size=0), filter_fn=lambda module, fqn: "mlp" in fqn)
    assert [layer.fqn for layer in iter_tt_layers(m)] == ["mlp.0", "mlp.2"]
    assert {(s.fqn, s.reason) for s in compression_report(m).skipped} == {
        ("attn", "not selected: filter_fn returned False")}
    # A second call that selects other layers leaves the first call's TT layers alone and unlisted.
    tensorize_(m, {"attn": TTConfig(rank=4, min_size=0)})
    assert [layer.fqn for layer in iter_tt_layers(m)] == ["attn", "mlp.0", "mlp.2"]
    assert compression_report(m).skipped == ()


def test_tensorizing_again_refactors_the_layer():
    torch.manual_seed(0)
    lin = nn.Linear(96, 96)
    tensorize_(lin, TTConfig(rank=12, modes=((6, 4, 4), (4, 4, 6)), min_size=0, fmt="tt"))
    (first,) = list(iter_tt_layers(lin))
    w = lin.weight.detach().double().clone()
    # init="svd": TT-SVD of the current weight to the new rank (capped ranks: exact).
    tensorize_(lin, TTConfig(rank=30, modes=((6, 4, 4), (4, 4, 6)), init="svd", min_size=0, fmt="tt"))
    (second,) = list(iter_tt_layers(lin))
    assert second.param is not first.param
    assert max(second.spec.ranks) > 12
    torch.testing.assert_close(reference_weight(second.cores, second.gates, second.spec), w, rtol=1e-4, atol=1e-5)
    # A smaller rank: an approximation, with its error in the report.
    tensorize_(lin, TTConfig(rank=3, modes=((6, 4, 4), (4, 4, 6)), init="svd", min_size=0, fmt="tt"))
    (third,) = list(iter_tt_layers(lin))
    assert max(third.spec.ranks) == 3
    (row,) = compression_report(lin).layers
    err = (reference_weight(third.cores, third.gates, third.spec) - w).norm() / w.norm()
    assert row.init_error == pytest.approx(err.item(), rel=1e-3)
    # init="random" with another layout: new random cores of that layout (asked for by refactor=True).
    tensorize_(lin, TTConfig(rank=5, fmt="ttm", min_size=0), refactor=True)
    (fourth,) = list(iter_tt_layers(lin))
    assert fourth.spec.fmt == "ttm" and max(fourth.spec.ranks) == 5
    assert list(lin.parametrizations.weight) == [tt_param(lin)]  # one parametrization, not stacked


def tt_param(module):
    (p,) = [p for p in module.parametrizations.weight if isinstance(p, TTParametrization)]
    return p


def _tied_pair(vocab=300, d=32):
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(emb=nn.Embedding(vocab, d), head=nn.Linear(d, vocab, bias=False)))
    model["head"].weight = model["emb"].weight
    return model


def test_tied_pair_is_skipped_by_default_naming_the_option():
    model = _tied_pair()
    tensorize_(model, TTConfig(rank=4, min_size=0))
    reasons = {s.fqn: s.reason for s in compression_report(model).skipped}
    assert set(reasons) == {"emb", "head"}
    assert "tied='share'" in reasons["emb"] and "tied='untie'" in reasons["head"] and "['head']" in reasons["emb"]
    assert model["emb"].weight is model["head"].weight
    with pytest.raises(ValueError, match=r"tied must be one of \['skip', 'share', 'untie'\]"):
        tensorize_(model, TTConfig(rank=4, min_size=0), tied="yes")


def test_tied_share_makes_one_tt_read_by_rows_and_contracted_by_columns():
    model = _tied_pair()
    tensorize_(model, TTConfig(rank=6, min_size=0), tied="share")
    emb, head = model["emb"], model["head"]
    assert tt_param(emb) is tt_param(head)
    (layer,) = list(iter_tt_layers(model))
    assert layer.fqn == "emb" and layer.shared_with == ("head",)
    assert layer.spec.fmt == "ttm" and not layer.spec.transpose and layer.spec.weight_shape == (300, 32)
    m = reference_weight(layer.cores, layer.gates, layer.spec)  # [V, D], float64
    idx = torch.randint(0, 300, (3, 5))
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(emb(idx).double(), m[idx], rtol=1e-5, atol=1e-6)
    out = head(x.float())
    torch.testing.assert_close(out.double(), x @ m.t(), rtol=1e-4, atol=1e-5)
    # Both uses train the same cores.
    (emb(idx).sum() + out.square().sum()).backward()
    assert layer.param.grads() is not None
    assert list(model.parameters()) == [layer.param.core_flat, layer.param.gate_flat]
    report = compression_report(model)
    assert report.dense_params == 300 * 32 and report.params == layer.spec.num_params
    assert "shared with head" in str(report)
    # A checkpoint loads into a fresh shared pair; densify_ restores the tie.
    other = _tied_pair()
    tensorize_(other, TTConfig(rank=6, min_size=0), tied="share")
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other["head"](x.float()), out)
    densify_(other)
    assert other["emb"].weight is other["head"].weight
    assert isinstance(other["emb"].weight, nn.Parameter)
    torch.testing.assert_close(other["emb"].weight.double(), m, rtol=1e-5, atol=1e-6)


def test_tied_share_refactors_and_untie_gives_each_its_own_tt():
    model = _tied_pair()
    tensorize_(model, TTConfig(rank=6, min_size=0), tied="share")
    w = model["emb"].weight.detach().clone()
    tensorize_(model, TTConfig(rank=32, init="svd", min_size=0), tied="share")  # again: re-factored
    (layer,) = list(iter_tt_layers(model))
    assert layer.shared_with == ("head",) and max(layer.spec.ranks) > 6
    torch.testing.assert_close(model["head"].weight, w, rtol=1e-4, atol=1e-5)
    tensorize_(model, TTConfig(rank=4, init="svd", min_size=0), tied="untie")
    layers = {layer.fqn: layer for layer in iter_tt_layers(model)}
    assert set(layers) == {"emb", "head"} and layers["emb"].shared_with == ()
    assert layers["emb"].spec.fmt == "ttm" and layers["head"].spec.fmt == "ttm" and layers["head"].spec.transpose
    assert tt_param(model["emb"]) is not tt_param(model["head"])
    # A dense tie untied: two TT layers, the head in the Linear layout.
    model = _tied_pair()
    tensorize_(model, TTConfig(rank=4, min_size=0), tied="untie")
    assert {layer.fqn for layer in iter_tt_layers(model)} == {"emb", "head"}
    # share needs both ends of the tie selected.
    model = _tied_pair()
    tensorize_(model, {"emb": TTConfig(rank=4, min_size=0)}, tied="share")
    assert list(iter_tt_layers(model)) == []
    reasons = {s.fqn: s.reason for s in compression_report(model).skipped}
    assert "tied with ['head'], which is not selected" in reasons["emb"]


def test_tied_share_with_different_configs_raises_naming_the_modules_and_fields():
    """One shared TT has one config: different configs for the tie's modules raise before any layer
    changes, naming both modules and the fields that differ; equal configs (two dict entries) share."""
    model = _tied_pair()
    configs = {"head": TTConfig(fmt="tt", rank=4, activation="silu", min_size=0),
               "emb": TTConfig(fmt="tt", rank=4, min_size=0)}
    with pytest.raises(ValueError, match=r"tied='share'.*'emb'.*'head'.*activation.*None.*'silu'.*untie"):
        tensorize_(model, configs, tied="share")
    assert list(iter_tt_layers(model)) == [] and model["emb"].weight is model["head"].weight
    with pytest.raises(ValueError, match=r"rank.*4.*6"):
        tensorize_(model, {"emb": TTConfig(rank=4, min_size=0), "re:h.*": TTConfig(rank=6, min_size=0)}, tied="share")
    tensorize_(model, {"emb": TTConfig(rank=4, min_size=0), "head": TTConfig(rank=4, min_size=0)}, tied="share")
    (layer,) = list(iter_tt_layers(model))
    assert layer.shared_with == ("head",)


# ----------------------------------------------------------------------------------------------
# Checkpoints and densify
# ----------------------------------------------------------------------------------------------


def test_state_dict_round_trip_same_ranks():
    a, b = _tensorized_tiny(seed=0), _tensorized_tiny(seed=1)
    idx = torch.randint(0, 101, (4, 6))
    assert not torch.allclose(a(idx), b(idx))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(idx), a(idx))


def _prune(layer, bond, keep):
    """Slice bond ``bond`` (1-based, internal) of a TT layer to ``keep`` ranks, as rank
    adaptation does: same Parameter objects, smaller data."""
    cores, gates = layer.param.positions()
    cores[bond - 1] = cores[bond - 1][..., :keep]
    cores[bond] = cores[bond][:keep]
    gates[bond - 1] = gates[bond - 1][:keep]
    layer.param.relayout_(cores, gates)


def test_state_dict_round_trip_changed_ranks(tmp_path):
    a = _tensorized_tiny(seed=0)
    layers = {layer.fqn: layer for layer in iter_tt_layers(a)}
    _prune(layers["fc1"], 2, 3)
    _prune(layers["emb"], 1, 2)
    with torch.no_grad():
        layers["fc1"].param.gates[0].mul_(0.5)  # layers["fc1"].gates are views from before the pruning
    idx = torch.randint(0, 101, (4, 6))
    want = a(idx)
    path = tmp_path / "pruned.pt"
    torch.save(a.state_dict(), path)

    b = _tensorized_tiny(seed=1)  # fresh model, original ranks
    params_before = {n: id(p) for n, p in b.named_parameters()}
    b.load_state_dict(torch.load(path))
    assert {n: id(p) for n, p in b.named_parameters()} == params_before  # same Parameter objects
    torch.testing.assert_close(b(idx), want)
    got = {layer.fqn: layer.spec.ranks for layer in iter_tt_layers(b)}
    assert got == {layer.fqn: layer.spec.ranks for layer in iter_tt_layers(a)}
    assert got["fc1"][2] == 3 and got["emb"][1] == 2
    # A checkpoint with other modes is still refused, by load_state_dict's own check.
    c = Tiny()
    tensorize_(c, TTConfig(rank=6, n_cores=2, fmt="tt", min_size=0),
               filter_fn=lambda mod, fqn: fqn == "fc1")
    with pytest.raises(RuntimeError):
        c.load_state_dict(torch.load(path), strict=False)


def test_load_changed_ranks_while_an_old_graph_is_alive(tmp_path):
    a = _tensorized_tiny(seed=0)
    layers = {layer.fqn: layer for layer in iter_tt_layers(a)}
    _prune(layers["fc1"], 2, 3)
    path = tmp_path / "pruned.pt"
    torch.save(a.state_dict(), path)
    idx = torch.randint(0, 101, (4, 6))

    b = _tensorized_tiny(seed=1)
    old_loss = b(idx).square().mean()  # keeps the old-shape gradient accumulators alive
    b.load_state_dict(torch.load(path))
    b(idx).square().mean().backward()  # must accumulate into the new shapes
    for layer in iter_tt_layers(b):
        grads, _ = layer.param.grads()
        assert [g.shape for g in grads] == [c.shape for c in layer.cores]
    del old_loss


def test_densify_restores_plain_dense_weights():
    m = _tensorized_tiny()
    idx = torch.randint(0, 101, (4, 6))
    want = m(idx)
    w_fc1 = m.fc1.weight.detach().clone()
    densify_(m)
    assert type(m.fc1) is nn.Linear and type(m.emb) is nn.Embedding
    assert isinstance(m.fc1.weight, nn.Parameter) and m.fc1.weight.requires_grad
    assert list(iter_tt_layers(m)) == []
    torch.testing.assert_close(m.fc1.weight, w_fc1)
    torch.testing.assert_close(m(idx), want)
    assert set(m.state_dict()) == set(Tiny().state_dict())


# ----------------------------------------------------------------------------------------------
# Training and reporting
# ----------------------------------------------------------------------------------------------


def test_tensorized_model_trains_in_eager_mode():
    m = _tensorized_tiny(seed=0, rank=6)
    torch.manual_seed(0)
    idx = torch.randint(0, 101, (32, 8))
    target = torch.randint(0, 7, (32,))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(m(idx), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(layer.param.gate_flat.grad is not None for layer in iter_tt_layers(m))


def test_report_on_compiled_model_and_structured_fields():
    m = _tensorized_tiny()
    compiled = torch.compile(m, backend="eager")
    report = compression_report(compiled)
    layers = {lay.fqn: lay for lay in report.layers}
    assert layers["fc1"].weight_shape == (80, 48) and layers["emb"].weight_shape == (101, 48)
    assert layers["fc1"].dense_params == 80 * 48
    for layer in iter_tt_layers(m):
        assert layers[layer.fqn].tt_params == layer.spec.num_params == sum(
            t.numel() for t in list(layer.cores) + list(layer.gates))
    assert report.params == sum(p.numel() for p in m.parameters())
    assert report.dense_params == sum(p.numel() for p in Tiny().parameters())
    text = str(report)
    for column in ("layer", "fmt", "factorization", "ranks", "dense", "tt", "total:"):
        assert column in text
    assert layers["emb"].factorization in text


# ----------------------------------------------------------------------------------------------
# CoMERA's six-encoder transformer (the configuration of the paper's reference code)
# ----------------------------------------------------------------------------------------------


class SixEncoder(nn.Module):
    """CoMERA's MNLI model, BERT-style: d 768, FFN 3072, 12 heads, vocab 30522, 6 encoders.

    Its published totals (dense 66.96 M -> 1.49 M at rank 30, 44.9x) fix which layers exist and
    which are tensorized: word embedding (TT-matrix, rank 32), the 36 encoder linears and the
    768x768 pooler (TT, rank 30) are tensorized; position (512) and token-type (2) embeddings,
    LayerNorms, biases and the 3-way classifier stay dense. Gates are counted as parameters.
    """

    def __init__(self, vocab=30522, d=768, ffn=3072, heads=12, n_layers=6, max_pos=512, n_cls=3):
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_pos, d)
        self.token_type = nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            q=nn.Linear(d, d), k=nn.Linear(d, d), v=nn.Linear(d, d), o=nn.Linear(d, d),
            ff1=nn.Linear(d, ffn), ff2=nn.Linear(ffn, d), ln1=nn.LayerNorm(d), ln2=nn.LayerNorm(d),
        )) for _ in range(n_layers))
        self.pooler = nn.Linear(d, d)
        self.cls = nn.Linear(d, n_cls)

    def forward(self, idx):
        b, t = idx.shape
        h = self.ln(self.word(idx) + self.pos(torch.arange(t, device=idx.device)) + self.token_type.weight[0])
        for layer in self.layers:
            q, k, v = (layer[n](h).view(b, t, self.heads, -1).transpose(1, 2) for n in "qkv")
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
            h = layer["ln1"](h + layer["o"](a))
            h = layer["ln2"](h + layer["ff2"](F.gelu(layer["ff1"](h))))
        return self.cls(torch.tanh(self.pooler(h[:, 0])))


def test_comera_six_encoder_parameter_counts():
    with torch.device("meta"):  # counts only: no memory, no init cost
        model = SixEncoder()
    dense = sum(p.numel() for p in model.parameters())
    assert round(dense / 1e6, 2) == 66.96
    tensorize_(model, {
        "word": TTConfig(rank=32, modes=((16, 20, 10, 10), (4, 4, 8, 6))),
        r"re:layers\.\d+\.(q|k|v|o|ff1|ff2)": TTConfig(rank=30, fmt="tt"),  # CoMERA's linear format
        "pooler": TTConfig(rank=30, fmt="tt"),
    })
    report = compression_report(model)
    layers = {lay.fqn: lay for lay in report.layers}
    assert len(layers) == 6 * 6 + 2
    cores_only = {fqn: tt.count_params(tt.TTSpec(lay.fmt, *_modes(lay), lay.ranks, 1, 1).core_shapes,
                                       include_gates=False) for fqn, lay in layers.items()}
    # Automatic factorization and rank capping reproduce CoMERA's layouts.
    assert layers["layers.0.q"].factorization == "[12,8,8]||[8,8,12]"
    assert layers["layers.0.q"].ranks == (1, 12, 30, 30, 30, 12, 1)
    assert cores_only["layers.0.q"] == 20_448
    assert layers["layers.3.ff1"].factorization == "[12,8,8]||[12,16,16]"
    assert layers["layers.3.ff1"].ranks == (1, 12, 30, 30, 30, 16, 1)
    assert cores_only["layers.3.ff1"] == 28_960
    assert layers["layers.3.ff2"].factorization == "[16,16,12]||[8,8,12]"  # mirrored
    assert cores_only["layers.3.ff2"] == 28_960
    assert layers["word"].fmt == "ttm" and layers["word"].padded_shape == (32000, 768)
    assert cores_only["word"] == 167_808
    assert report.dense_params == dense
    assert round(report.params / 1e6, 2) == 1.49
    assert round(report.ratio, 1) == 44.9
    assert report.params == sum(p.numel() for p in model.parameters())
    # Every Linear-like layer left dense is listed: the dict selects none of these three.
    assert {s.fqn: s.reason for s in report.skipped} == dict.fromkeys(
        ["pos", "token_type", "cls"], "not selected: no key of the config dict matches it, and there is no '_default'")


def _modes(lay):
    rm, cm = lay.factorization.replace("[[", "").replace("]]", "").replace("]||[", "],[").split("],[")
    return tuple(map(int, rm.strip("[]").split(","))), tuple(map(int, cm.strip("[]").split(",")))


def test_six_encoder_slice_runs_and_trains():
    """A 1-encoder, small-vocab version of the same model runs forward/backward after tensorize_."""
    torch.manual_seed(0)
    model = SixEncoder(vocab=1000, d=96, ffn=192, heads=4, n_layers=1, max_pos=16)
    tensorize_(model, TTConfig(rank=8, min_size=0),
               filter_fn=lambda mod, fqn: fqn == "word" or fqn.startswith("layers."))
    assert {lay.fqn for lay in iter_tt_layers(model)} >= {"word", "layers.0.q", "layers.0.ff2"}
    idx = torch.randint(0, 1000, (4, 16))
    target = torch.randint(0, 3, (4,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        loss = F.cross_entropy(model(idx), target)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first
    assert isinstance(model.layers[0]["q"].parametrizations.weight[0], TTParametrization)


def test_defaults_tt_matrix_everywhere_and_embeddings_keep_their_scale():
    """The quality study's defaults: fmt='auto' makes a TT-matrix of every layer, and a tensorized
    embedding starts at the std of the table it replaces (the model's own init)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(4096, 256), "small": nn.Embedding(4096, 256), "fc": nn.Linear(256, 512)})
    with torch.no_grad():
        model["small"].weight.normal_(0.0, 0.02)  # a GPT's embedding init
    tensorize_(model, TTConfig(rank=16))
    layers = {layer.fqn: layer for layer in iter_tt_layers(model)}
    assert {lay.spec.fmt for lay in layers.values()} == {"ttm"}
    for name, want in (("emb", 1.0), ("small", 0.02)):
        got = float(model[name].weight.detach().std())
        assert 0.7 * want < got < 1.4 * want, (name, got)
    got = float(model["fc"].weight.detach().std())  # Linear: CoMERA's sqrt(1 / (in + out))
    assert 0.7 * math.sqrt(1 / 768) < got < 1.4 * math.sqrt(1 / 768)


# ----------------------------------------------------------------------------------------------
# No silent no-ops, no surprising semantics
# ----------------------------------------------------------------------------------------------


def _bf16_tt_linear(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256)).bfloat16()
    tensorize_(model, TTConfig(rank=4, fmt=fmt, min_size=0))
    return model


@pytest.mark.parametrize("fmt,tokens", [("ttm", 4), ("tt", 512)])  # the dense and the factored plan
def test_compiled_bf16_tt_layer_fed_fp32_raises_like_eager(fmt, tokens):
    """Outside autocast a bf16 layer fed fp32 activations raises in eager mode (a dense nn.Linear and
    the TT layer alike); the compiled TT layer raises too instead of computing in fp32."""
    x = torch.randn(tokens, 256)
    dense = nn.Linear(256, 256).bfloat16()
    with pytest.raises(RuntimeError, match="dtype"):
        dense(x)
    model = _bf16_tt_linear(fmt)
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)
    compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager"})
    with pytest.raises(RuntimeError, match="dtype"):
        compiled(x)
    # Matching dtypes compile and agree with eager.
    torch.testing.assert_close(compiled(x.bfloat16()).float(), model(x.bfloat16()).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt,tokens", [("ttm", 4), ("tt", 512)])
def test_compiled_bf16_tt_layer_fed_fp32_under_autocast_matches_eager(fmt, tokens):
    """Autocast mixes dtypes legitimately: ambient or inside the compiled code, the compiled layer
    computes what eager autocast does."""
    torch.manual_seed(1)
    x = torch.randn(tokens, 256)
    model = _bf16_tt_linear(fmt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        report = explain(model, x, options={"inner": "aot_eager"})
    assert [r.kind for r in report.rewrites] == ["tt_linear"], str(report)  # lowered, not left alone
    assert report.output.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(report.output.float(), want.float(), rtol=2e-2, atol=2e-2)

    def inside(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        return y.float()

    report = explain(inside, x, options={"inner": "aot_eager"})
    assert [r.kind for r in report.rewrites] == ["tt_linear"], str(report)
    torch.testing.assert_close(report.output, want.float(), rtol=2e-2, atol=2e-2)


def test_filter_fn_that_selects_no_layer_raises_like_a_config_key():
    """A filter_fn that returns False for every layer it is asked about raises before any layer
    changes, as a config key that matches no layer does, naming the layers it was asked about."""
    torch.manual_seed(0)
    m = Tiny()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ValueError, match=r"filter_fn returned False for every layer it was asked about "
                                         r"\(3: \['emb', 'fc1', 'fc2'\]\)"):
        tensorize_(m, TTConfig(rank=4, min_size=0), filter_fn=lambda mod, fqn: fqn == "fc3")
    # With a config dict it is asked only about the layers the dict selects.
    with pytest.raises(ValueError, match=r"filter_fn returned False for every layer.*\(1: \['fc1'\]\)"):
        tensorize_(m, {"fc1": TTConfig(rank=4, min_size=0)}, filter_fn=lambda mod, fqn: fqn == "fc2")
    assert list(iter_tt_layers(m)) == []
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    # A selected layer that cannot be tensorized is not a silent no-op: the report gives the reason.
    tensorize_(m, TTConfig(rank=4), filter_fn=lambda mod, fqn: fqn == "fc1")
    assert list(iter_tt_layers(m)) == []
    assert "min_size" in {s.fqn: s.reason for s in compression_report(m).skipped}["fc1"]


def test_random_init_of_an_already_tensorized_layer_needs_refactor():
    """init='random' on a TT layer would throw its trained cores away: it raises naming the layers
    unless refactor=True; init='svd' re-factors the current weight and needs no flag."""
    m = _tensorized_tiny(seed=0)
    with torch.no_grad():
        m.fc1.parametrizations.weight[0].core_flat.mul_(1.5)  # "trained"
    trained = {k: v.clone() for k, v in m.state_dict().items()}
    w = m.fc1.weight.detach().clone()
    with pytest.raises(ValueError, match=r"init='random' would replace the cores of the already tensorized "
                                         r"layer\(s\) \['emb', 'fc1'\].*refactor=True.*init='svd'"):
        tensorize_(m, TTConfig(rank=4, min_size=0))
    with pytest.raises(ValueError, match=r"already tensorized layer\(s\) \['fc1'\]"):
        tensorize_(m, {"fc1": TTConfig(rank=4, min_size=0, fmt="ttm"), "_default": None})
    with pytest.raises(ValueError, match=r"init='balanced' would replace .* \['fc1'\]"):  # random too
        tensorize_(m, {"fc1": TTConfig(rank=4, min_size=0, init="balanced"), "_default": None})
    assert m.state_dict().keys() == trained.keys()
    assert all(torch.equal(trained[k], v) for k, v in m.state_dict().items())  # nothing changed
    # A call that leaves the TT layers out still tensorizes the others.
    tensorize_(m, TTConfig(rank=4, min_size=0, fmt="ttm"), filter_fn=lambda mod, fqn: fqn == "fc2")
    assert "fc2" in {layer.fqn for layer in iter_tt_layers(m)}
    torch.testing.assert_close(m.fc1.weight, w)
    # init="svd" re-factors the current weight (exactly, at a rank that holds it): no flag needed.
    tensorize_(m, {"fc1": TTConfig(rank=64, init="svd", min_size=0, fmt="tt"), "_default": None})
    torch.testing.assert_close(m.fc1.weight, w, rtol=1e-4, atol=1e-5)
    # refactor=True: new random cores, as asked.
    tensorize_(m, {"fc1": TTConfig(rank=3, min_size=0, fmt="ttm"), "_default": None}, refactor=True)
    (fc1,) = [layer for layer in iter_tt_layers(m) if layer.fqn == "fc1"]
    assert fc1.spec.fmt == "ttm" and max(fc1.spec.ranks) == 3


def test_svd_tolerance_not_reached_warns_and_is_recorded():
    """svd_tol is a target the rank cap may stop short of: the reached per-layer error is recorded
    (TTParametrization.init_error, compression_report) and a warning names the layer, the error and
    the capped bonds."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(noisy=nn.Linear(96, 96), low=nn.Linear(96, 96)))
    with torch.no_grad():
        model["low"].weight.copy_(_tt_weight("tt", (6, 4, 4), (4, 4, 6), 2, 96, 96, True).float())
    modes = ((6, 4, 4), (4, 4, 6))
    dense = {name: model[name].weight.detach().double().clone() for name in model}
    with pytest.warns(UserWarning, match=r"svd_tol=0.05\) not reached by 1 layer\(s\): 'noisy': relative error "
                                         r"0\.[5-9]\d* > 0.05, stopped by the rank cap \(rank=4\) at bond\(s\) \[1,"):
        tensorize_(model, TTConfig(rank=4, modes=modes, init="svd", svd_tol=0.05, min_size=0, fmt="tt"))
    rows = {lay.fqn: lay for lay in compression_report(model).layers}
    for name in ("noisy", "low"):  # the recorded error is the one of the cores the layer computes with
        p = tt_param(model[name])
        err = (reference_weight(p.cores, p.gates, p.spec) - dense[name]).norm() / dense[name].norm()
        assert p.init_error == rows[name].init_error == pytest.approx(err.item(), rel=1e-3, abs=1e-6)
        assert p.svd_tol == rows[name].svd_tol == 0.05
    assert rows["noisy"].init_error > 0.5 and rows["low"].init_error < 0.05
    lines = {line.split()[0]: line for line in str(compression_report(model)).splitlines()}
    assert re.search(r"svd err 0\.\d+ > svd_tol 0.05", lines["noisy"]) and "svd_tol" not in lines["low"]
    # Reached: no warning.
    model = nn.ModuleDict(dict(low=nn.Linear(96, 96)))
    with torch.no_grad():
        model["low"].weight.copy_(_tt_weight("tt", (6, 4, 4), (4, 4, 6), 2, 96, 96, True).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensorize_(model, TTConfig(rank=4, modes=modes, init="svd", svd_tol=0.05, min_size=0, fmt="tt"))


@pytest.mark.parametrize("fmt", ["ttm", "tt"])
def test_balanced_init_gives_every_core_one_std_and_the_weight_its_variance(fmt):
    """init='balanced': the cores of a layer at one std, the weight's entries at the target std like
    CoMERA's init (whose last core is larger)."""
    torch.manual_seed(0)
    stds = {}
    for init in ("random", "balanced"):
        variances = []
        for _ in range(8):  # the entries share cores: one draw's sample variance scatters, its mean does not
            lin = nn.Linear(768, 768, bias=False)
            tensorize_(lin, TTConfig(rank=32, fmt=fmt, init=init, init_std=0.02))
            (layer,) = iter_tt_layers(lin)
            stds[init] = [c.std().item() for c in layer.param.cores]
            variances.append(lin.weight.detach().double().var().item())
        assert sum(variances) / len(variances) == pytest.approx(0.02**2, rel=0.1)
    assert max(stds["balanced"]) / min(stds["balanced"]) < 1.2  # sample stds of cores of 144+ entries
    assert max(stds["random"]) / min(stds["random"]) > 2  # the last core, of right rank 1


def test_tensorizing_nothing_warns_with_each_layers_reason():
    import comera_compile as cc

    """tensorize_ never does nothing silently: a model none of whose layers would get smaller is named
    in a warning with each layer's reason, and nothing changes."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"tensorized no layer of this Sequential: '0': .*min_size.*'1': "):
        cc.tensorize_(model, cc.TTConfig(rank=32))
    assert not list(cc.iter_tt_layers(model))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.warns(UserWarning, match="has no Linear, Embedding or Conv1D layer"):
        cc.tensorize_(nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model that is tensorized gets no such warning
        cc.tensorize_(nn.Sequential(nn.Linear(256, 256)), cc.TTConfig(rank=4))


def test_random_cores_over_loaded_weights_are_warned_about(tmp_path):
    """A transformers model loaded by from_pretrained, tensorized with init='random', loses its loaded
    weights: the warning names the source, the layers and init='svd'. A model built fresh, or one
    factored by init='svd', is not warned about."""
    transformers = pytest.importorskip("transformers")
    import comera_compile as cc

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    pick = dict(filter_fn=lambda m, fqn: fqn.endswith("mlp.up_proj"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"loaded from .*model.layers.0.mlp.up_proj.*init='svd'"):
        cc.tensorize_(loaded, cc.TTConfig(rank=4, min_size=0), **pick)
    for model, config in ((transformers.LlamaForCausalLM(cfg), cc.TTConfig(rank=4, min_size=0)),
                          (transformers.LlamaForCausalLM.from_pretrained(tmp_path),
                           cc.TTConfig(rank=4, min_size=0, init="svd"))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cc.tensorize_(model, config, **pick)
        assert not [w for w in seen if "loaded from" in str(w.message)]


def test_random_cores_over_trained_weights_are_warned_about():
    """A plain model trained in the user's own loop (no from_pretrained to say so), tensorized with the
    default init='random', loses what it learned: the warning names the layer that looks trained and
    init='svd'. The same model fresh, or factored with init='svd', gets no such warning."""
    import comera_compile as cc

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    trained = mlp()
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(1))
    y = (x[:, :4].sum(1) > 0).long()
    opt = torch.optim.Adam(trained.parameters(), 1e-3)
    for step in range(200):
        batch = slice(step % 16 * 128, (step % 16 + 1) * 128)
        loss = nn.functional.cross_entropy(trained(x[batch]), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    pick = dict(filter_fn=lambda m, fqn: fqn == "2")
    with pytest.warns(UserWarning, match=r"weight of '2' looks trained .*init='svd'"):
        cc.tensorize_(trained, cc.TTConfig(rank=4, min_size=0), **pick)
    for model, config in ((mlp(), cc.TTConfig(rank=4, min_size=0)), (mlp(), cc.TTConfig(rank=4, min_size=0, init="svd"))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cc.tensorize_(model, config, **pick)
        assert not [w for w in seen if "looks trained" in str(w.message)], [str(w.message) for w in seen]
