"""An optimizer built before tensorize_ never trains the TT cores: it is warned about at its first step,
eager or compiled; tensorize_ installs the check."""

import warnings

import pytest
import torch
from torch import nn

import comera_compile as cc
from comera_compile.tensorize.optimizer_check import stale_parameters


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _steps(model, optimizer, n=2, compiled=True):
    compiled = torch.compile(model, backend="comera", options={"inner": "eager"}) if compiled else model
    caught = []
    for _ in range(n):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(torch.randn(4, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        caught.append([w for w in seen if "tensorize_" in str(w.message)])
    return caught


@pytest.mark.parametrize("compiled", [True, False], ids=["comera", "eager"])
def test_an_optimizer_built_before_tensorize_is_warned_about_once(compiled):
    model = _model()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cc.tensorize_(model, cc.TTConfig(rank=4, min_size=0), filter_fn=lambda m, fqn: fqn == "0")
    (layer,) = cc.iter_tt_layers(model)
    cores = layer.param.core_flat.detach().clone()
    assert stale_parameters(early) == [(0, 0)]  # the emptied dense weight of layer 0
    first, second = _steps(model, early, compiled=compiled)
    (warning,) = first
    assert "holds 1 parameter(s) with no elements" in str(warning.message)
    assert "param_groups[0]['params'][0]" in str(warning.message) and "cc.param_groups" in str(warning.message)
    assert warning.filename == __file__  # points at the caller's optimizer.step()
    assert second == []  # once per optimizer
    torch.testing.assert_close(layer.param.core_flat.detach(), cores)  # what the warning is about: not trained


def test_an_optimizer_built_after_tensorize_is_not_warned_about():
    model = _model()
    cc.tensorize_(model, cc.TTConfig(rank=4, min_size=0), filter_fn=lambda m, fqn: fqn == "0")
    (layer,) = cc.iter_tt_layers(model)
    cores = layer.param.core_flat.detach().clone()
    late = torch.optim.AdamW(cc.param_groups(model, lr=1e-2))
    assert _steps(model, late) == [[], []]
    assert not torch.equal(layer.param.core_flat.detach(), cores)


def test_tensorize_installs_the_check_and_compiling_alone_does_not():
    from comera_compile.tensorize.optimizer_check import OptimizerWatch, use_watch

    installed = []
    with use_watch(OptimizerWatch(register=lambda hook: installed.append(hook) or hook)):
        torch.compile(nn.Linear(2, 2), backend="comera", options={"inner": "eager"})(torch.randn(1, 2))
        cc.hf.compile(nn.Linear(2, 2), fused_loss=False)
        assert installed == []  # no tensorize_, no hook
        cc.tensorize_(_model(), cc.TTConfig(rank=4, min_size=0), filter_fn=lambda m, fqn: fqn == "0")
    assert len(installed) == 1
