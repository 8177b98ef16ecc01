"""RankConfig: RankAdaptation's options as one frozen value, validated once; the keyword arguments and
``config=`` build the same ranker; the package's public names."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

import comera_compile as cc
from comera_compile import rank_adaptation
from comera_compile.rank_adaptation import RankAdaptation, RankConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_rank_adaptation import batch, make_net  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def new_training():
    net = make_net()
    return net, torch.optim.AdamW(net.parameters(), lr=2e-2)


@pytest.mark.filterwarnings("ignore:RankAdaptation")
def test_the_keywords_and_a_config_build_the_same_ranker():
    options = dict(gamma=2.0, prune_every=3, threshold=0.7, switch=6, rank_multiple=2)
    histories = []
    for build in (lambda net, opt: RankAdaptation(net, opt, target_compression=10, **options),
                  lambda net, opt: RankAdaptation(net, opt, config=RankConfig(target_compression=10, **options)),
                  lambda net, opt: RankAdaptation(net, opt, 10, config=RankConfig(3, threshold=0.1), **options)):
        net, opt = new_training()
        ranker = build(net, opt)
        assert ranker.config == RankConfig(10, **options)
        for step in range(9):
            idx, target = batch(step)
            net(idx, target).backward()
            opt.step()
            opt.zero_grad()
        histories.append(ranker.history)
    assert histories[0] == histories[1] == histories[2]
    assert histories[0][-1]["ranks"] != histories[0][0]["ranks"]  # it pruned


def test_the_ranker_exposes_the_config_as_attributes():
    net, opt = new_training()
    ranker = RankAdaptation(net, opt, 4, gamma=0.5, loss_ema=0.8, gate_lr_scale=3)
    config = ranker.config
    assert config.late_gamma is None and ranker.late_gamma == 0.5 == ranker.gamma  # late_gamma: gamma's
    assert ranker.loss_ema_decay == 0.8 and ranker.gate_lr_scale == 3.0 and isinstance(config.gamma, float)
    for field in dataclasses.fields(RankConfig):
        if field.name not in ("late_gamma", "loss_ema", "loss_from", "prune_mode"):
            assert getattr(ranker, field.name) == getattr(config, field.name), field.name
    assert config.prune_mode == "auto" and ranker.prune_mode == "slice"  # "auto": no FSDP2 here
    # the keyword defaults are RankConfig's
    assert RankAdaptation(net, opt, 4).config == RankConfig(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gamma = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("name, bad, accepts", [
    ("target_compression", 0, "a finite number > 0"),
    ("target_compression", float("inf"), "a finite number > 0"),
    ("gamma", -1.0, ">= 0"),
    ("gamma", "1", ">= 0"),
    ("late_gamma", float("nan"), ">= 0"),
    ("augment", -0.1, ">= 0"),
    ("threshold", -1e-3, ">= 0"),
    ("converge_tol", -0.1, ">= 0"),
    ("loss_tolerance", -0.5, ">= 0"),
    ("scale", "relative", "one of ('grad', 'absolute')"),
    ("weight", "bytes", "one of ('params', 'flops')"),
    ("grad_ema", 1.0, "in [0, 1)"),
    ("loss_ema", -0.1, "in [0, 1)"),
    ("prune_every", -1, "an int >= 0 (0: never)"),
    ("prune_every", 2.5, "an int >= 0 (0: never)"),
    ("rank_multiple", 0, "a positive int"),
    ("min_rank", -1, "an int >= 0"),
    ("min_rank", True, "an int >= 0"),
    ("gate_lr_scale", 0, "'auto' or a number > 0"),
    ("gate_lr_scale", "fast", "'auto' or a number > 0"),
    ("switch", "later", "'auto', 'manual' or a step number >= 0"),
    ("switch", -1, "'auto', 'manual' or a step number >= 0"),
    ("converge_window", 0, "an int >= 1"),
    ("min_early_steps", -1, "an int >= 0"),
    ("recompiles_per_event", -1, "an int >= 0"),
    ("recompiles_per_event", 1.5, "an int >= 0"),
    ("loss_from", "labels", "'output' or 'observe'"),
])
def test_a_bad_option_names_itself_and_what_it_accepts(name, bad, accepts):
    options = {"target_compression": 2.0, name: bad}
    want = f"RankConfig.{name} must be {accepts}"
    with pytest.raises(ValueError, match=re.escape(want)):
        RankConfig(**options)
    net, opt = new_training()
    with pytest.raises(ValueError, match=f"RankConfig.{name} must be"):  # the ranker checks before the model
        RankAdaptation(net, opt, **options)


def test_the_ranker_rejects_unknown_options_and_a_missing_target():
    net, opt = new_training()
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['gama'\]; the options are \['target_compression'"):
        RankAdaptation(net, opt, 2, gama=1.0)
    with pytest.raises(TypeError, match="target_compression is required"):
        RankAdaptation(net, opt, gamma=1.0)
    with pytest.raises(TypeError, match="config must be a RankConfig, got dict"):
        RankAdaptation(net, opt, config={"target_compression": 2})
    with pytest.raises(ValueError, match="RankConfig.gamma must be >= 0"):  # an override is validated too
        RankAdaptation(net, opt, config=RankConfig(2), gamma=-1)


def test_the_package_exports_and_keeps_its_old_names():
    assert rank_adaptation.__all__ == ["RankAdaptation", "RankConfig", "shrink_", "size_coefficients"]
    assert rank_adaptation.shrink_ is rank_adaptation.pruning.shrink_
    assert cc.RankAdaptation is rank_adaptation.RankAdaptation is rank_adaptation.ranker.RankAdaptation
    assert rank_adaptation.size_coefficients is rank_adaptation.objective.size_coefficients
    for module in ("config", "distributed", "objective", "plot", "pruning", "ranker"):
        sub = getattr(rank_adaptation, module)
        for name in sub.__all__:
            assert not name.startswith("_") and hasattr(sub, name), (module, name)
    params = inspect.signature(RankAdaptation).parameters
    assert list(params)[:3] == ["model", "optimizer", "target_compression"] and "config" in params


def test_rank_config_is_public_at_the_top_level():
    import comera_compile as cc
    from comera_compile.rank_adaptation import RankConfig

    assert cc.RankConfig is RankConfig and "RankConfig" in cc.__all__
