"""TT layers of one base class share one parametrized class, so blocks compiled one by one from one
code object (torchtitan's per-block ``torch.compile``, ``block.compile()``) reuse one graph instead of
recompiling per block (and failing past Dynamo's ``recompile_limit`` under ``fullgraph=True``). The
shared ``weight`` property must still read the module it is called on: under ``parametrize.cached()``,
after torch's ``remove_parametrizations`` on a sibling, and through ``deepcopy``."""

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.utils import parametrize

import comera_compile as cc
from comera_compile.tensorize.parametrization import tt_parametrization


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _blocks(n=10, d=16, fmt="btt", **kw):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(d) for _ in range(n))
    cc.tensorize_(blocks, cc.TTConfig(fmt=fmt, min_size=0, **kw))
    return blocks


@pytest.mark.parametrize("backend", ["eager", "comera"])
def test_blocks_compiled_one_by_one_share_one_graph(backend):
    blocks = _blocks(n=10)  # more blocks than Dynamo's default recompile_limit (8)
    assert len({type(m) for b in blocks for m in (b.up, b.down)}) == 1
    x = torch.randn(2, 5, 16, dtype=torch.float32, requires_grad=True)

    def run(layers):
        y = x
        for layer in layers:
            y = layer(y)
        y.square().mean().backward()
        grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        return y.detach(), grads

    want, want_grads = run(blocks)
    torch._dynamo.reset()
    counters.clear()
    compiled = [torch.compile(b, backend=backend, fullgraph=True) for b in blocks]
    got, got_grads = run(compiled)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_each_layer_reads_its_own_weight_also_when_cached():
    blocks = _blocks(n=3)
    layers = [m for b in blocks for m in (b.up, b.down)]
    want = [m.parametrizations.weight().detach() for m in layers]  # torch's own ParametrizationList
    assert all(not torch.equal(want[0], w) for w in want[2::2])  # different layers, different weights
    for cached in (False, True):
        if cached:
            with parametrize.cached():
                got = [m.weight.detach() for m in layers]
                again = [m.weight for m in layers]
                assert all(a is b for a, b in zip(again, [m.weight for m in layers]))
        else:
            got = [m.weight.detach() for m in layers]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_torch_remove_parametrizations_leaves_the_siblings_working():
    blocks = _blocks(n=2)
    first, second = blocks[0].up, blocks[1].up
    shared = type(first)
    want_first = first.weight.detach().clone()
    want_second = second.weight.detach().clone()
    parametrize.remove_parametrizations(first, "weight", leave_parametrized=True)
    assert type(first) is nn.Linear
    torch.testing.assert_close(first.weight.detach(), want_first, rtol=0, atol=0)
    assert type(second) is shared
    torch.testing.assert_close(second.weight.detach(), want_second, rtol=0, atol=0)
    x = torch.randn(3, 16)
    torch.testing.assert_close(second(x), x @ want_second.t() + second.bias, rtol=1e-6, atol=1e-6)
    # the removed layer can be tensorized again, and joins the shared class
    cc.tensorize_(first, cc.TTConfig(fmt="btt", min_size=0, init="svd"), refactor=True)
    assert type(first) is shared


def test_deepcopy_and_densify_keep_their_own_weights():
    blocks = _blocks(n=2)
    twin = copy.deepcopy(blocks)
    x = torch.randn(3, 16)
    torch.testing.assert_close(twin[1](twin[0](x)), blocks[1](blocks[0](x)), rtol=0, atol=0)
    with torch.no_grad():
        tt_parametrization(twin[0].up).core_flat.mul_(2.0)
    assert not torch.allclose(twin[0].up.weight, blocks[0].up.weight)
    want = blocks[1].up.weight.detach().clone()
    cc.densify_(twin)
    assert type(twin[0].up) is nn.Linear
    assert type(blocks[1].up).__name__ == "ParametrizedLinear"
    torch.testing.assert_close(blocks[1].up.weight.detach(), want, rtol=0, atol=0)


def test_bottleneck_layers_share_a_class_of_their_own():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    cc.tensorize_(net, {"0": cc.TTConfig(fmt="tt", rank=4, activation="silu", min_size=0, n_cores=2),
                        "1": cc.TTConfig(fmt="tt", rank=4, activation="silu", min_size=0, n_cores=2),
                        "2": cc.TTConfig(fmt="tt", rank=4, min_size=0, n_cores=2)})
    assert type(net[0]) is type(net[1]) is not type(net[2])
    x = torch.randn(4, 16, dtype=torch.float64)
    net.double()
    for layer in net[:2]:  # act(x L) R from each layer's own cores (test_tt_activation checks the math)
        assert tt_parametrization(layer).activation == "silu"
        torch.testing.assert_close(layer(x), tt_parametrization(layer).bottleneck_linear(x, layer.bias))
    assert not torch.allclose(net[0](x), net[1](x))
    w = net[2].weight.detach()
    torch.testing.assert_close(net[2](x), x @ w.t() + net[2].bias)


class _Scale(nn.Module):
    def forward(self, b):
        return 3.0 * b


def test_another_parametrization_on_one_layer_leaves_its_siblings_alone():
    blocks = _blocks(n=2)
    first, second = blocks[0].up, blocks[1].up
    bias_first, bias_second = first.bias.detach().clone(), second.bias.detach().clone()
    parametrize.register_parametrization(first, "bias", _Scale())
    assert type(first) is type(second)
    torch.testing.assert_close(first.bias, 3.0 * bias_first, rtol=0, atol=0)
    assert isinstance(second.bias, nn.Parameter)
    torch.testing.assert_close(second.bias.detach(), bias_second, rtol=0, atol=0)
    with parametrize.cached():
        torch.testing.assert_close(first.bias, 3.0 * bias_first, rtol=0, atol=0)
        torch.testing.assert_close(second.bias.detach(), bias_second, rtol=0, atol=0)
    x = torch.randn(3, 16, dtype=torch.float64)
    blocks.double()
    torch.testing.assert_close(first(x), x @ first.weight.t() + 3.0 * bias_first.double())
    torch.testing.assert_close(second(x), x @ second.weight.t() + second.bias)
    # a second layer may take the same parametrization; removing it restores the plain bias
    parametrize.register_parametrization(second, "bias", _Scale())
    torch.testing.assert_close(second.bias.detach().float(), 3.0 * bias_second, rtol=1e-6, atol=0)
    parametrize.remove_parametrizations(first, "bias", leave_parametrized=False)
    assert isinstance(first.bias, nn.Parameter) and type(first) is type(second)
    torch.testing.assert_close(first.bias.detach().float(), bias_first, rtol=1e-6, atol=0)
    torch.testing.assert_close(second.bias.detach().float(), 3.0 * bias_second, rtol=1e-6, atol=0)


def test_a_layer_with_another_parametrization_keeps_its_class_and_says_so(caplog):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64))
    parametrize.register_parametrization(net[0], "bias", _Scale())
    want_bias = net[0].bias.detach().clone()
    with caplog.at_level("INFO", logger="comera_compile.tensorize.parametrization"):
        cc.tensorize_(net, cc.TTConfig(fmt="btt", min_size=0))
    assert type(net[0]) is not type(net[2]) and type(net[1]) is type(net[2])
    assert "keeps a parametrized class of its own (parametrized: ['bias', 'weight'])" in caplog.text
    x = torch.randn(3, 16)
    torch.testing.assert_close(net[0](x), x @ net[0].weight.t() + want_bias, rtol=1e-5, atol=1e-6)
