"""tensorize_ / densify_ / checkpoints / compiled training with ``TTConfig(fmt="btt")``.

Weights are checked against ``reference_btt``: the matrix assembled block by block in float64 from the
definition ``W[(c, a), (b1, b2)] = sum_k L[k, c, b1, a] g[k] R[b1, b2, c, k]`` (nn.Linear: ``M = W.T`` has
rows = in), sharing no code with the implementation.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_compile import explain, tt
from tiny_models import Tiny  # noqa: E402  (tests/tensorize/tiny_models.py)
from comera_compile.tensorize import TTConfig, compression_report, densify_, iter_tt_layers, tensorize_


def reference_btt(cores, gates, spec):
    """``M`` [(b1, b2), (c, a)] block by block (row block j, column block c), cropped; ``M.T`` for a Linear."""
    R, L = (t.detach().double() for t in cores)
    g = gates[0].detach().double()
    b1, c = spec.row_modes[0], spec.col_modes[0]
    full = torch.cat([torch.cat([R[j, :, k, :] @ torch.diag(g) @ L[:, k, j, :] for k in range(c)], dim=1)
                      for j in range(b1)], dim=0)
    m = full[: spec.rows, : spec.cols]
    return m.t() if spec.transpose else m


def _btt_tiny(seed=0, rank=3, **kw):
    torch.manual_seed(seed)
    m = Tiny()
    tensorize_(m, TTConfig(fmt="btt", rank=rank, min_size=0, **kw), filter_fn=lambda mod, fqn: fqn in ("emb", "fc1"))
    return m


def _layers(model):
    return {layer.fqn: layer for layer in iter_tt_layers(model)}


def test_linear_and_embedding_become_btt_with_the_prototypes_blocks():
    m = _btt_tiny()
    layers = _layers(m)
    assert set(layers) == {"emb", "fc1"}
    fc1, emb = layers["fc1"].spec, layers["emb"].spec
    # 48 = 8 blocks of 6 in, 80 = 10 blocks of 8 out; the vocabulary (101, prime) is padded to 13 x 8 (104).
    assert (fc1.fmt, fc1.row_modes, fc1.col_modes, fc1.ranks, fc1.transpose) == ("btt", (8, 6), (10, 8), (1, 3, 1), True)
    assert (emb.row_modes, emb.col_modes, emb.transpose) == ((13, 8), (8, 6), False)
    for layer in layers.values():
        torch.testing.assert_close(layer.module.weight.double(), reference_btt(layer.cores, layer.gates, layer.spec))
    idx = torch.randint(0, 101, (2, 5))
    torch.testing.assert_close(m.emb(idx), m.emb.weight[idx])
    report = compression_report(m)
    rows = {lay.fqn: lay for lay in report.layers}
    assert rows["fc1"].fmt == "btt" and rows["fc1"].factorization == "[8x6]|[10x8]"
    assert rows["fc1"].tt_params == 8 * 6 * 10 * 3 + 3 * 10 * 8 * 8 + 3 < rows["fc1"].dense_params
    assert "btt" in str(report) and "[8x6]|[10x8]" in str(report)


def test_benchmark_shapes_match_the_prototypes_factors():
    """The prototype (benchmarks/train_lm.py, BTTLinear) splits 768 into 32 blocks of 24 and 3072 into 64 of 48."""
    model = nn.Sequential(nn.Linear(768, 3072, device="meta"), nn.Linear(3072, 768, device="meta"))
    tensorize_(model, TTConfig(fmt="btt", rank=1))
    specs = [layer.spec for layer in iter_tt_layers(model)]
    assert [(s.row_modes, s.col_modes) for s in specs] == [((32, 24), (64, 48)), ((64, 48), (32, 24))]


def test_invalid_btt_configs_raise_naming_the_layer_and_the_choices():
    with pytest.raises(ValueError, match=r"TTConfig.fmt must be one of \('auto', 'tt', 'ttm', 'btt'\)"):
        TTConfig(fmt="monarch")
    with pytest.raises(ValueError, match="rank must be >= 1"):
        TTConfig(fmt="btt", rank=0)
    cases = [(dict(n_cores=3), "n_cores=3 is invalid for the 'btt' format"),
             (dict(modes=((2, 3, 8), (8, 10))), r"fmt='btt' needs two row modes \(b1 blocks of b2\)"),
             (dict(modes=((6, 6), (8, 10))), "cover 36 x 80, less than rows x cols = 48 x 80"),
             (dict(rank=[2, 3]), "valid: a positive int, or 1 positive ints")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=r"layer 'fc1' \(Linear \(80, 48\)\).*" + match):
            tensorize_(Tiny(), {"fc1": TTConfig(fmt="btt", min_size=0, **kwargs)})


def test_modes_override_rank_cap_and_padding_never_changes_outputs():
    """A Linear whose weight is exactly a cropped BTT of rank 2 in a padded layout: init="svd" at rank 2
    reproduces it (cropping a block keeps its rank), so the outputs are unchanged by the padding; the
    rank is capped at the block rank min(b2, a) (where a BTT stores more than the dense weight)."""
    torch.manual_seed(0)
    spec = tt.TTSpec("btt", (5, 8), (6, 5), (1, 2, 1), 37, 29, True)
    cores = [torch.randn(s, dtype=torch.float64) for s in spec.core_shapes]
    lin = nn.Linear(37, 29).double()
    with torch.no_grad():
        lin.weight.copy_(reference_btt(cores, [torch.ones(2, dtype=torch.float64)], spec))
    x = torch.randn(4, 37, dtype=torch.float64)
    want = lin(x)
    model = nn.ModuleDict(dict(lin=lin))
    tensorize_(model, TTConfig(fmt="btt", rank=2, modes=((5, 8), (6, 5)), init="svd", min_size=0))
    (lay,) = compression_report(model).layers
    assert lay.padded_shape == (40, 30) and lay.init_error < 1e-10
    torch.testing.assert_close(model["lin"](x), want)
    capped = nn.ModuleDict(dict(lin=nn.Linear(37, 29)))
    tensorize_(capped, TTConfig(fmt="btt", rank=100, modes=((5, 8), (6, 5)), min_size=0))
    (skipped,) = compression_report(capped).skipped
    assert "no compression: btt [5x8]|[6x5] at ranks [1, 5, 1]" in skipped.reason  # blocks are 8 x 5


def test_random_init_matches_the_dense_init_std():
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(a=nn.Linear(256, 192), b=nn.Linear(192, 256)))
    tensorize_(model, {"a": TTConfig(fmt="btt", rank=4), "b": TTConfig(fmt="btt", rank=2, init_std=0.02)})
    assert model["a"].weight.std().item() == pytest.approx((1 / (256 + 192)) ** 0.5, rel=0.05)
    assert model["b"].weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_svd_init_error_falls_with_rank():
    torch.manual_seed(0)
    dense = nn.Linear(48, 80)
    errors = []
    for rank in (1, 2, 3):  # rank 4 of 8 x 6 blocks would store more than the dense weight
        m = nn.ModuleDict(dict(fc=copy.deepcopy(dense)))
        tensorize_(m, TTConfig(fmt="btt", rank=rank, init="svd", min_size=0))
        (lay,) = compression_report(m).layers
        w = m["fc"].weight.detach().double()
        assert lay.init_error == pytest.approx(((w - dense.weight.double()).norm() / dense.weight.norm()).item(),
                                               rel=1e-4)
        errors.append(lay.init_error)
    assert errors[0] > errors[1] > errors[2] > 0


def test_tied_share_makes_one_btt_read_by_rows_and_contracted():
    torch.manual_seed(0)
    emb, head = nn.Embedding(120, 48), nn.Linear(48, 120, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict(dict(emb=emb, head=head))
    tensorize_(model, TTConfig(fmt="btt", rank=2, min_size=0), tied="share")
    (layer,) = iter_tt_layers(model)
    assert layer.shared_with == ("head",) and not layer.spec.transpose
    w = reference_btt(layer.cores, layer.gates, layer.spec).float()
    idx, x = torch.randint(0, 120, (7,)), torch.randn(3, 48)
    torch.testing.assert_close(model["emb"](idx), w[idx])
    torch.testing.assert_close(model["head"](x), x @ w.t())


def test_state_dict_round_trips_same_and_pruned_ranks(tmp_path):
    a, b = _btt_tiny(seed=0), _btt_tiny(seed=1)
    idx = torch.randint(0, 101, (4, 6))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(idx), a(idx))
    layer = _layers(a)["fc1"]
    cores, gates = layer.param.positions()  # keep ranks 0 and 2 of 3, as rank pruning slices them
    keep = torch.tensor([0, 2])
    cores[0], gates[0], cores[1] = cores[0][..., keep], gates[0][keep], cores[1][keep]
    layer.param.relayout_(cores, gates)
    want = a(idx)
    torch.save(a.state_dict(), tmp_path / "pruned.pt")
    c = _btt_tiny(seed=2)
    c.load_state_dict(torch.load(tmp_path / "pruned.pt"))
    assert _layers(c)["fc1"].spec.ranks == (1, 2, 1)
    torch.testing.assert_close(c(idx), want)
    for modes, match in [(((6, 8), (8, 10)), r"size mismatch for fc1.parametrizations.weight.0.cores.0"),
                         (((8, 6), (10, 9)), r"fc1.parametrizations.weight.0.cores.1 has shape \(2, 10, 8, 8\); "
                                             r"btt \[8x6\]\|\[10x9\] at rank 2 .* needs \(2, 10, 8, 9\)")]:
        other = Tiny()  # other blocks: refused, naming the core
        tensorize_(other, TTConfig(fmt="btt", rank=2, min_size=0, modes=modes), filter_fn=lambda mod, fqn: fqn == "fc1")
        with pytest.raises(RuntimeError, match=match):
            other.load_state_dict(torch.load(tmp_path / "pruned.pt"), strict=False)


def test_densify_gives_back_a_linear_with_the_btt_weight():
    m = _btt_tiny()
    idx = torch.randint(0, 101, (4, 6))
    want = m(idx)
    refs = {fqn: reference_btt(layer.cores, layer.gates, layer.spec) for fqn, layer in _layers(m).items()}
    densify_(m)
    assert type(m.fc1) is nn.Linear and type(m.emb) is nn.Embedding and not list(iter_tt_layers(m))
    torch.testing.assert_close(m.fc1.weight.double(), refs["fc1"])
    torch.testing.assert_close(m.emb.weight.double(), refs["emb"])
    torch.testing.assert_close(m(idx), want)


def _step(model, fn, idx, target):
    model.zero_grad()
    loss = F.cross_entropy(fn(idx), target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["comera", "inductor"])
def test_compiled_training_step_matches_eager(backend):
    """fullgraph=True (no graph break); at 15 tokens and these small blocks, forming the weight is
    estimated cheaper than contracting the tokens, so the tensor-network pass forms it in the graph
    (plain ops, in place of the opaque marker op) and says why (with both estimates) in explain."""
    torch._dynamo.reset()
    eager = _btt_tiny(seed=0)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend=backend, fullgraph=True)
    idx, target = torch.randint(0, 101, (3, 5)), torch.randint(0, 7, (3,))
    want_loss, want = _step(eager, eager, idx, target)
    got_loss, got = _step(compiled_model, step, idx, target)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    if backend == "comera":
        text = str(explain(compiled_model, idx))
        assert "(the weight formed in the graph, then a dense GEMM)" in text and "other: blocks ~" in text
        assert "the table formed in the graph" in text
        assert "still forms a dense weight" not in text and "marker op" not in text


class TiedLM(nn.Module):
    """An embedding and an LM head that share one weight (``vocab`` x ``d``)."""

    def __init__(self, vocab, d):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


@pytest.mark.parametrize("vocab, options", [(120, {"tt_strategy": "blocks"}), (32000, {})],
                         ids=["blocks-pinned", "default-options"])
def test_tied_btt_head_on_the_blocks_path_trains_like_eager(vocab, options):
    """A btt shared by the embedding and the LM head (tied="share"): the head reads the cores as
    transposed views, so its blocks run on non-contiguous cores; loss and every gradient of a step match
    eager. At 32000 words and 4 tokens the planner picks the blocks for the head by itself."""
    torch.manual_seed(0)
    eager = TiedLM(vocab, 64)
    tensorize_(eager, TTConfig(fmt="btt", rank=2, min_size=0), tied="share")
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="comera", options=options, fullgraph=True)
    idx, target = torch.randint(0, vocab, (1, 4)), torch.randint(0, vocab, (4,))
    want_loss, want = _step(eager, lambda i: eager(i).flatten(0, 1), idx, target)
    got_loss, got = _step(compiled_model, lambda i: step(i).flatten(0, 1), idx, target)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    text = str(explain(compiled_model, idx, options={"inner": "aot_eager", **options}))
    assert "blocks ~" in text and "other: dense ~" in text, text
