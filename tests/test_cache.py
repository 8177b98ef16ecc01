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
    import comera_compile.backend as backend

    monkeypatch.setattr(backend, "_cuda_available", lambda: True)
    torch.compile(lambda x: x + 1, backend="comera", mode="reduce-overhead")(torch.ones(2))
    assert seen["triton.cudagraphs"] is True
    assert isinstance(seen["post_grad_custom_post_pass"], SourceKeyedPass)
    seen.clear()
    torch._dynamo.reset()
    torch.compile(lambda x: x + 2, backend="comera", options={"cudagraphs": True, "max_autotune": True})(torch.ones(2))
    assert seen["triton.cudagraphs"] is True and seen["max_autotune"] is True
