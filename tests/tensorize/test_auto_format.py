"""``TTConfig()``'s ``fmt="auto"`` and ``rank=None``: btt at rank 1 for Linear layers at least 2048 wide on both
sides, TT-matrix at rank 32 otherwise, and TT-matrix whenever the user pinned what only TT-matrix bonds mean.
Each tensorized layer is checked against its own dense weight (the cores' contraction) in float64."""

import logging
import warnings

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.tensorize.config import AUTO_BTT_MIN_WIDTH


def _param(module):
    (layer,) = [lay for lay in cc.iter_tt_layers(module) if lay.fqn == ""]
    return layer.param


def _fmt_ranks(module):
    p = _param(module)
    return p.spec.fmt, list(p.spec.ranks)


@pytest.mark.parametrize("kind,rows,cols,cfg,want", [
    ("Linear", 2048, 2048, cc.TTConfig(), ("btt", 1)),
    ("Linear", 2048, 8192, cc.TTConfig(), ("btt", 1)),
    ("Conv1D", 4096, 2048, cc.TTConfig(), ("btt", 1)),
    ("Linear", 2047, 8192, cc.TTConfig(), ("ttm", 32)),
    ("Linear", 768, 768, cc.TTConfig(), ("ttm", 32)),
    ("Embedding", 32000, 2048, cc.TTConfig(), ("ttm", 32)),
    ("Linear", 2048, 2048, cc.TTConfig(rank=32), ("ttm", 32)),
    ("Linear", 2048, 2048, cc.TTConfig(n_cores=3), ("ttm", 32)),
    ("Linear", 2048, 2048, cc.TTConfig(init="svd"), ("ttm", 32)),
    ("Linear", 2048, 2048, cc.TTConfig(modes=((32, 64), (32, 64))), ("ttm", 32)),
    ("Linear", 2048, 2048, cc.TTConfig(fmt="btt"), ("btt", 1)),
    ("Linear", 2048, 2048, cc.TTConfig(fmt="btt", rank=4), ("btt", 4)),
    ("Linear", 64, 64, cc.TTConfig(fmt="tt"), ("tt", 32)),
    ("Linear", 64, 64, cc.TTConfig(fmt="btt"), ("btt", 1)),
])
def test_resolve_picks_the_measured_format_and_its_rank(kind, rows, cols, cfg, want):
    fmt, rank, why = cfg.resolve(kind, rows, cols)
    assert (fmt, rank) == want
    assert bool(why) == (cfg.fmt == "auto")


def test_the_width_threshold_is_2048():
    assert AUTO_BTT_MIN_WIDTH == 2048


def test_default_config_tensorizes_a_wide_layer_as_btt_rank_1_and_matches_its_dense_weight(caplog):
    torch.manual_seed(0)
    lin = nn.Linear(2048, 2048, bias=True).double()
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        cc.tensorize_(lin, cc.TTConfig())
    assert _fmt_ranks(lin) == ("btt", [1, 1, 1])
    assert any("auto: btt" in r.getMessage() for r in caplog.records)
    p = _param(lin)
    R, L = p.cores  # the btt matrix M [in, out] written out from its definition, M[(j, b), (c, a)]
    (b1, b2), (c, a) = p.spec.row_modes, p.spec.col_modes
    R = R.reshape(b1, b2, c, -1) * p.gates[0]
    L = L.reshape(-1, c, b1, a)
    m = torch.einsum("jbck,kcja->jbca", R, L).reshape(b1 * b2, c * a)[:2048, :2048]
    x = torch.randn(3, 2048, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ m + lin.bias, rtol=1e-10, atol=1e-10)
    # parameters: far fewer than the dense 2048 x 2048
    assert sum(t.numel() for t in p.cores) < 2048 * 2048 / 10


def test_default_config_keeps_ttm_rank_32_for_a_narrow_layer():
    lin = nn.Linear(768, 768)
    cc.tensorize_(lin, cc.TTConfig())
    fmt, ranks = _fmt_ranks(lin)
    assert fmt == "ttm" and max(ranks) == 32


def test_default_config_on_a_wide_model_compiles_like_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512))
    cc.tensorize_(model, cc.TTConfig(min_size=0))
    assert _fmt_ranks(model[0])[0] == "btt" and _fmt_ranks(model[2])[0] == "ttm"
    x = torch.randn(4, 2048)
    ref = model(x)
    got = torch.compile(model, backend="comera")(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_rank_adaptation_names_layers_it_cannot_prune():
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 256))
    cc.tensorize_(model, cc.TTConfig(min_size=0))  # btt r1, then ttm r32
    opt = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))
    with pytest.warns(UserWarning, match=r"1 of 2 tensor-train layers cannot be pruned \(\['0'\]\)"):
        cc.RankAdaptation(model, opt, target_compression=4)
    only_btt = nn.Sequential(nn.Linear(2048, 2048))
    cc.tensorize_(only_btt, cc.TTConfig(min_size=0))
    opt = torch.optim.AdamW(cc.param_groups(only_btt, lr=1e-3))
    with pytest.warns(UserWarning, match="no tensor-train layer can be pruned.*larger rank"):
        cc.RankAdaptation(only_btt, opt, target_compression=4)
    with warnings.catch_warnings():  # a btt layer at rank 4 can be pruned
        warnings.simplefilter("error", UserWarning)
        wide = nn.Sequential(nn.Linear(2048, 2048))
        cc.tensorize_(wide, cc.TTConfig(fmt="btt", rank=4, min_size=0))
        cc.RankAdaptation(wide, torch.optim.AdamW(cc.param_groups(wide, lr=1e-3)), target_compression=4)


def test_rank_none_is_accepted_and_bad_ranks_still_name_the_choices():
    assert cc.TTConfig().rank is None
    with pytest.raises(ValueError, match="None"):
        cc.TTConfig(rank="big")
