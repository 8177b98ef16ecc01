"""Cache safety: Inductor's caches are keyed on our sources, and CUDA-graph options reach Inductor."""

import torch

import comera_compile.cache as cache
from comera_compile.cache import SourceKeyedPass, hash_sources, inductor_config_patches


def test_hash_changes_with_any_source(tmp_path):
    (tmp_path / "pkg").mkdir()
    f = tmp_path / "pkg" / "op.py"
    f.write_text("def backward(g):\n    return 2 * g\n")
    before = hash_sources([str(tmp_path)])
    f.write_text("def backward(g):\n    return 3 * g\n")
    assert hash_sources([str(tmp_path)]) != before
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert hash_sources([str(tmp_path)]) == hash_sources([str(tmp_path)])


def test_config_patches_compose_with_a_user_pass():
    class UserPass(SourceKeyedPass.__mro__[1]):  # CustomGraphPass
        calls = 0

        def __call__(self, graph):
            UserPass.calls += 1

        def uuid(self):
            return "user-v1"

    patches = inductor_config_patches({"post_grad_custom_post_pass": UserPass()})
    ours = patches["post_grad_custom_post_pass"]
    assert isinstance(ours, SourceKeyedPass)
    assert ours.uuid()[1] == cache.source_fingerprint() and ours.uuid()[2] == "user-v1"
    ours(torch.fx.Graph())
    assert UserPass.calls == 1


def _compile_counting_misses(monkeypatch, fingerprint):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(cache, "source_fingerprint", lambda: fingerprint)
    torch._dynamo.reset()
    counters.clear()

    def f(x):
        return torch.sin(x) * 3 + 1

    torch.compile(f, backend="comera")(torch.randn(8))
    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]


def test_fx_graph_cache_misses_when_our_code_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    # config.patch restores Inductor's config on exit (a monkeypatch of its attributes left it broken
    # for every later Inductor compile in the session)
    with config.patch({"fx_graph_cache": True, "fx_graph_remote_cache": False}):
        miss, hit = _compile_counting_misses(monkeypatch, "code-v1")
        assert miss == 1 and hit == 0
        miss, hit = _compile_counting_misses(monkeypatch, "code-v1")
        assert hit == 1, "same code: the cache serves the graph"
        miss, hit = _compile_counting_misses(monkeypatch, "code-v2")
        assert miss == 1 and hit == 0, "changed code: the cached graph must not be served"


def test_cudagraphs_option_reaches_inductor(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.update(config_patches or {})
        return gm.forward

    import torch._inductor.compile_fx as compile_fx_mod

    monkeypatch.setattr(compile_fx_mod, "compile_fx", fake_compile_fx)
    from comera_compile.backend import Platform, use_platform

    with use_platform(Platform(cuda_available=lambda: True)):
        torch.compile(lambda x: x + 1, backend="comera", mode="reduce-overhead")(torch.ones(2))
        assert seen["triton.cudagraphs"] is True
        assert isinstance(seen["post_grad_custom_post_pass"], SourceKeyedPass)
        seen.clear()
        torch._dynamo.reset()
        torch.compile(lambda x: x + 2, backend="comera", options={"cudagraphs": True,
                                                                  "max_autotune": True})(torch.ones(2))
    assert seen["triton.cudagraphs"] is True and seen["max_autotune"] is True


def test_tensor_train_graphs_time_one_pointwise_configuration(monkeypatch):
    """A graph with tensor-train layers asks Inductor for one configuration per pointwise kernel (no
    first-call timing of six); a dense graph keeps Inductor's default; the user's setting wins."""
    seen: list[dict] = []

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return gm.forward

    import torch._inductor.compile_fx as compile_fx_mod

    monkeypatch.setattr(compile_fx_mod, "compile_fx", fake_compile_fx)
    x = torch.randn(4, 32)
    torch._dynamo.reset()
    torch.compile(_tt_model(), backend="comera")(x)
    assert seen[-1]["triton.autotune_pointwise"] is False
    torch._dynamo.reset()
    torch.compile(torch.nn.Linear(32, 32), backend="comera")(x)
    assert "triton.autotune_pointwise" not in seen[-1]
    torch._dynamo.reset()
    torch.compile(_tt_model(), backend="comera",
                  options={"inductor_config": {"triton.autotune_pointwise": True}})(x)
    assert seen[-1]["triton.autotune_pointwise"] is True
    torch._dynamo.reset()
    import comera_compile as cc

    summary = str(cc.explain(_tt_model(), x))
    assert "Inductor settings: " in summary and "triton.autotune_pointwise=False" in summary
    torch._dynamo.reset()


def _tt_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 64))
    import comera_compile as cc

    cc.tensorize_(model, {"0": cc.TTConfig(rank=4, fmt="tt", min_size=0)})
    return model


def _compile_tt(monkeypatch, fingerprint="code-v1", options=None):
    """A fresh Dynamo compile (forward and backward) of a model with a tensor-train layer and a fused
    head loss; returns the AOTAutograd and FX graph cache counters of that compile."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    monkeypatch.setattr(cache, "source_fingerprint", lambda: fingerprint)
    torch._dynamo.reset()
    counters.clear()
    model = _tt_model()

    def loss(x, y):
        return F.cross_entropy(model(x), y)

    x, y = torch.randn(8, 32), torch.randint(0, 64, (8,))
    torch.compile(loss, backend="comera", options={"cce_min_vocab": 0, **(options or {})})(x, y).backward()
    aot, fx = counters["aot_autograd"], counters["inductor"]
    return {"hit": aot["autograd_cache_hit"], "miss": aot["autograd_cache_miss"],
            "bypass": aot["autograd_cache_bypass"], "fx_hit": fx["fxgraph_cache_hit"]}


def _rewrites_of_tt_graph():
    import comera_compile as cc
    import torch.nn.functional as F

    model = _tt_model()
    report = cc.explain(lambda x, y: F.cross_entropy(model(x), y), torch.randn(8, 32),
                        torch.randint(0, 64, (8,)), options={"inner": "eager", "cce_min_vocab": 0})
    return {r.kind for r in report.rewrites}


def test_tt_graph_hits_the_aot_cache_in_a_second_compile(monkeypatch, tmp_path):
    """The tensor_network pass calls the TT executor's Python functions in the graph: marked
    cacheable under our source hash, a second compile loads the graph from the AOTAutograd cache
    (no trace, no Inductor), and a change to our code misses."""
    assert _rewrites_of_tt_graph() == {"tt_linear", "cce"}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    with config.patch({"fx_graph_cache": True, "fx_graph_remote_cache": False}):
        first = _compile_tt(monkeypatch)
        assert first["miss"] == 1 and first["bypass"] == 0 and first["hit"] == 0
        second = _compile_tt(monkeypatch)
        assert second["hit"] == 1 and second["miss"] == 0, "same code, same options: the cache serves the graph"
        changed = _compile_tt(monkeypatch, fingerprint="code-v2")
        assert changed["miss"] == 1 and changed["hit"] == 0, "changed code: the cached graph must not be served"
    assert "group_outputs" not in str(config.unsafe_marked_cacheable_functions), "marked for our compiles only"


def test_a_changed_option_changes_the_cache_key(monkeypatch, tmp_path):
    """An option that changes what the passes emit (the fused loss's backward) is a different graph:
    no stale hit; the first options hit again afterwards."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config

    with config.patch({"fx_graph_cache": True, "fx_graph_remote_cache": False}):
        assert _compile_tt(monkeypatch, options={"cce_backward": "exact"})["miss"] == 1
        other = _compile_tt(monkeypatch, options={"cce_backward": "filtered"})
        assert other["miss"] == 1 and other["hit"] == 0
        assert _compile_tt(monkeypatch, options={"cce_backward": "exact"})["hit"] == 1


def test_graph_functions_names_only_our_python_functions():
    from comera_compile.kernels import tt_runtime

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    t = graph.call_function(tt_runtime.project, (x, x, torch.float32))
    s = graph.call_function(torch.sin, (t,))
    graph.output(graph.call_function(torch.ops.aten.cos.default, (s,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert cache.graph_functions(gm) == ["comera_compile.kernels.tt_runtime.project"]
    patches = inductor_config_patches({}, gm)
    assert patches["unsafe_marked_cacheable_functions"] == {
        "comera_compile.kernels.tt_runtime.project": cache.source_fingerprint()}


def test_a_setting_read_while_tracing_enters_the_cache_key(monkeypatch):
    """COMERA_BTT_KEEP decides, while the graph is traced, which activations the btt op saves: a graph
    cached under one value must not be served under another (both keys: the backend's post-grad pass and
    the Inductor pre-grad pass of cc.use_with_inductor)."""
    import comera_compile as cc
    from comera_compile.inductor import pass_uuid

    ours = SourceKeyedPass()
    monkeypatch.delenv("COMERA_BTT_KEEP", raising=False)
    keys = {ours.uuid()}
    pre = {pass_uuid(cc.CompileOptions())}
    for value in ("inf", "2"):
        monkeypatch.setenv("COMERA_BTT_KEEP", value)
        keys.add(ours.uuid())
        pre.add(pass_uuid(cc.CompileOptions()))
    assert len(keys) == 3 and len(pre) == 3
    monkeypatch.setenv("COMERA_BTT_KEEP", " 2 ")
    assert ours.uuid() in keys  # surrounding blanks read as the same value
