import logging
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import comera_compile as cc
from comera_compile.fx_utils import RewriteRejected, checked_replace


def _relu_model(x):
    return F.relu(x) * 2


@pytest.fixture
def pass_cleanup():
    names = []
    yield names
    for name in names:
        if name in cc.list_passes():
            cc.unregister_pass(name)


def _register(names, name, fn, **kw):
    cc.register_pass(name, **kw)(fn)
    names.append(name)


def _relu_to_neg(gm, ctx):
    """Observable rewrite: relu(x) -> -relu(x)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (F.relu, torch.relu):
            with gm.graph.inserting_after(node):
                neg = gm.graph.call_function(operator.neg, (node,))
            node.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
            neg.meta["example_value"] = node.meta["example_value"]
            ctx.rewrite("relu-neg", None, "negated relu")
            n += 1
    return n


def test_user_pass_makes_observable_rewrite(pass_cleanup):
    _register(pass_cleanup, "relu-neg", _relu_to_neg)
    x = torch.randn(5)
    out = torch.compile(_relu_model, backend="comera", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, -F.relu(x) * 2)
    report = cc.explain(_relu_model, torch.randn(5), options={"inner": "eager"})
    assert [r.kind for r in report.rewrites] == ["relu-neg"]


def test_pass_can_be_switched_off(pass_cleanup):
    _register(pass_cleanup, "relu-neg", _relu_to_neg)
    x = torch.randn(5)
    out = torch.compile(_relu_model, backend="comera",
                        options={"inner": "eager", "passes": {"relu-neg": False}})(x)
    torch.testing.assert_close(out, F.relu(x) * 2)


def test_disabled_by_default_pass_can_be_switched_on(pass_cleanup):
    _register(pass_cleanup, "relu-neg", _relu_to_neg, enabled=False)
    x = torch.randn(5)
    torch.testing.assert_close(torch.compile(_relu_model, backend="comera", options={"inner": "eager"})(x),
                               F.relu(x) * 2)
    torch._dynamo.reset()
    out = torch.compile(_relu_model, backend="comera", options={"inner": "eager", "passes": {"relu-neg": True}})(x)
    torch.testing.assert_close(out, -F.relu(x) * 2)


def test_ordering_before_after(pass_cleanup):
    order = []
    _register(pass_cleanup, "p-a", lambda gm, ctx: order.append("a") or 0)
    _register(pass_cleanup, "p-c", lambda gm, ctx: order.append("c") or 0, after="p-a")
    _register(pass_cleanup, "p-b", lambda gm, ctx: order.append("b") or 0, before="p-c")
    names = cc.list_passes()
    assert names.index("p-a") < names.index("p-b") < names.index("p-c")
    torch.compile(lambda x: x + 1, backend="comera", options={"inner": "eager"})(torch.ones(2))
    assert order == ["a", "b", "c"]


def test_registration_errors(pass_cleanup):
    with pytest.raises(ValueError, match="registered passes"):
        cc.register_pass("p-x", after="no-such-pass")(lambda gm, ctx: 0)
    _register(pass_cleanup, "p-y", lambda gm, ctx: 0)
    with pytest.raises(ValueError, match="already registered"):
        cc.register_pass("p-y")(lambda gm, ctx: 0)
    with pytest.raises(ValueError, match="not both"):
        cc.register_pass("p-z", before="p-y", after="p-y")(lambda gm, ctx: 0)


def _half_done_then_raise(gm, ctx):
    for node in list(gm.graph.nodes):  # mutate the graph (wrongly), then fail
        if node.op == "call_function" and node.target in (F.relu, torch.relu):
            node.target = torch.sigmoid
    raise RuntimeError("boom")


def test_failing_pass_rolls_back_and_warns(pass_cleanup, caplog):
    _register(pass_cleanup, "broken", _half_done_then_raise)
    x = torch.randn(7)
    with caplog.at_level(logging.WARNING, logger="comera_compile"):
        with pytest.warns(RuntimeWarning, match=r"pass 'broken' raised RuntimeError: boom; the graph is left"):
            out = torch.compile(_relu_model, backend="comera", options={"inner": "aot_eager"})(x)
    torch.testing.assert_close(out, F.relu(x) * 2)
    assert any("broken" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="pass 'broken'"):
        report = cc.explain(_relu_model, torch.randn(7), options={"inner": "eager"})
    assert any(s.kind == "broken" and "boom" in s.reason for s in report.skipped)
    assert "sigmoid" not in report.graphs[0].code


def test_failing_pass_reraises_under_strict(pass_cleanup):
    _register(pass_cleanup, "broken", _half_done_then_raise)
    with pytest.raises(Exception, match="boom"):
        torch.compile(_relu_model, backend="comera", options={"inner": "eager", "strict": True})(torch.randn(3))


def test_checked_replace_rejects_wrong_shape(pass_cleanup):
    outcome = {}

    def bad_rewrite(gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in (F.relu, torch.relu):
                with gm.graph.inserting_after(node):
                    wrong = gm.graph.call_function(torch.sum, (node.args[0],))  # scalar, not [5]
                try:
                    checked_replace(node, wrong)
                except RewriteRejected as exc:
                    outcome["reason"] = str(exc)
                    ctx.skip("bad", str(exc))
        return 0

    _register(pass_cleanup, "bad", bad_rewrite)
    x = torch.randn(5)
    out = torch.compile(_relu_model, backend="comera", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, F.relu(x) * 2)
    assert "shape" in outcome["reason"]


def test_passes_see_checkpoint_subgraphs(pass_cleanup):
    seen = []
    _register(pass_cleanup, "spy", lambda gm, ctx: seen.append(ctx.subgraph) or 0)

    def f(x):
        return torch.utils.checkpoint.checkpoint(lambda t: F.relu(t) * 3, x, use_reentrant=False)

    x = torch.randn(4, requires_grad=True)
    torch.compile(f, backend="comera", options={"inner": "aot_eager"})(x).sum().backward()
    assert "" in seen and any(s for s in seen), seen


def test_pass_must_return_int(pass_cleanup):
    _register(pass_cleanup, "bad-return", lambda gm, ctx: "3")
    with pytest.raises(Exception, match="number of rewrites"):
        torch.compile(lambda x: x + 1, backend="comera", options={"inner": "eager", "strict": True})(torch.ones(2))


def test_cudagraphs_follow_what_the_passes_ask_for_on_a_gpu_graph():
    """CUDA graphs turn on for a GPU graph only when a pass asks (the tensor-network pass does when it
    lowers tensor-train layers); the cudagraphs option wins either way; a CPU graph never gets them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from comera_compile.options import CompileOptions
    from comera_compile.pass_manager import PassContext
    from comera_compile.report import GraphReport

    with FakeTensorMode():
        on_gpu = [torch.empty(2, 3, device="cuda")]
    on_cpu = [torch.empty(2, 3)]

    def ctx(inputs, **options):
        return PassContext(options=CompileOptions.from_user(options or None), training=True,
                           report=GraphReport(index=0), example_inputs=inputs)

    quiet, asked, cpu = ctx(on_gpu), ctx(on_gpu), ctx(on_cpu)
    asked.request_cudagraphs("many small kernels")
    cpu.request_cudagraphs("many small kernels")
    assert not quiet.cudagraphs() and asked.cudagraphs() and not cpu.cudagraphs()
    assert asked.cudagraph_requests == ["many small kernels"]
    off = ctx(on_gpu, cudagraphs=False)
    off.request_cudagraphs("many small kernels")
    assert not off.cudagraphs() and ctx(on_gpu, cudagraphs=True).cudagraphs()


def test_the_tensor_network_pass_asks_for_cudagraphs_and_its_inductor_settings(pass_cleanup):
    """The backend has no tensor-train branch: the pass itself asks, through its context, for CUDA
    graphs and for one pointwise configuration instead of six timed ones; a graph without TT layers
    asks for neither."""
    seen = []

    def spy(gm, ctx):
        seen.append((list(ctx.cudagraph_requests), dict(ctx.inductor_config)))
        return 0

    _register(pass_cleanup, "spy-requests", spy, after="tensor_network")
    tt = torch.nn.Sequential(torch.nn.Linear(64, 64))
    cc.tensorize_(tt, cc.TTConfig(rank=4, min_size=0))
    for model in (tt, torch.nn.Sequential(torch.nn.Linear(64, 64))):
        torch._dynamo.reset()
        torch.compile(model, backend="comera", options={"inner": "eager"})(torch.randn(3, 64))
    (tt_requests, tt_config), (plain_requests, plain_config) = seen[0], seen[-1]
    assert tt_requests and "tensor-train" in tt_requests[0]
    assert tt_config.get("triton.autotune_pointwise") is False
    assert plain_requests == [] and "triton.autotune_pointwise" not in plain_config
