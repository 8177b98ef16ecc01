"""``cc.use_with_inductor``: the comera passes inside plain ``torch.compile`` (Inductor's pre-grad custom
pass), against eager and against ``backend="comera"``, on the CPU with tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import comera_compile as cc
import comera_compile.cache as cache
from comera_compile.inductor import ComeraPreGradPass, pass_uuid
from comera_compile.pass_manager import validated_options
from comera_compile.report import collecting

pytestmark = pytest.mark.usefixtures("one_thread")

# the exact backward makes the fused gradients comparable with eager at fp32 tolerances; cce_min_vocab=0
# fuses the head at these tiny vocabularies (the cost rule leaves heads this small alone)
OPTIONS = {"cce_min_vocab": 0, "cce_backward": "exact"}
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def no_inductor_caches():
    """A graph served from the AOTAutograd / FX graph cache runs no pre-grad pass: these tests compile
    cold so that the passes run (the cache test below uses a cache of its own)."""
    import torch._functorch.config as functorch_config

    with inductor_config.patch({"fx_graph_cache": False}), functorch_config.patch({"enable_autograd_cache": False}):
        yield


@pytest.fixture(autouse=True)
def _nothing_left_on():
    assert inductor_config.pre_grad_custom_pass is None
    yield
    cc.use_with_inductor.off()
    assert inductor_config.pre_grad_custom_pass is None, "a test left the pre-grad pass installed"


class LM(nn.Module):
    """Embedding, one hidden layer, a Linear LM head and its cross-entropy."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, labels):
        h = torch.tanh(self.fc(self.emb(idx)))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _lm_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)


def _tt_model():
    """A tensor-train hidden layer, a dense head; the loss is taken outside (``_tt_loss``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 64))
    cc.tensorize_(model, {"0": cc.TTConfig(rank=4, fmt="tt", min_size=0)})
    return model


class TTLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _tt_model()

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


def _tt_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 32, generator=g), torch.randint(0, 64, (8,), generator=g)


def _loss_and_grads(model, *args):
    for p in model.parameters():
        p.grad = None
    loss = model(*args)
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, **tol):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(got_loss, want_loss, **tol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=lambda m: f"{name}: {m}")


def _kinds(report):
    return sorted((r.kind, r.module) for r in report.rewrites)


class PostGradSpy(CustomGraphPass):
    """Records the targets of every post-grad graph Inductor compiles (forward and backward)."""

    def __init__(self):
        self.targets: list[str] = []

    def __call__(self, graph):
        self.targets += [str(n.target) for n in graph.nodes if n.op == "call_function"]

    def uuid(self):
        return None

    def comera_ops(self):
        return sorted({t for t in self.targets if "comera" in t})


# ----------------------------------------------------------------------------------------------
# The API: options, installing and restoring the hook, the cache key (no compile)
# ----------------------------------------------------------------------------------------------


def test_options_are_validated_like_the_backend():
    for bad in ({"cce_min_vocabulary": 0}, {"cce_policy": "fast"}, {"passes": {"no-such-pass": True}}):
        with pytest.raises(cc.OptionsError) as backend_error:
            validated_options(bad)
        with pytest.raises(cc.OptionsError) as ours:
            cc.use_with_inductor(bad)
        assert str(ours.value) == str(backend_error.value)
    with pytest.raises(cc.OptionsError, match="inner"):
        cc.use_with_inductor({"inner": "aot_eager"})
    with pytest.raises(cc.OptionsError, match="no_such_setting"):
        cc.use_with_inductor({"inductor_config": {"no_such_setting": 1}})
    with pytest.raises(cc.OptionsError, match="pre_grad_custom_pass"):
        cc.use_with_inductor({"inductor_config": {"pre_grad_custom_pass": None}})
    assert inductor_config.pre_grad_custom_pass is None


def test_context_manager_and_plain_call_install_and_restore_the_hook():
    with cc.use_with_inductor(OPTIONS) as passes:
        assert isinstance(inductor_config.pre_grad_custom_pass, ComeraPreGradPass) and passes.active
        assert inductor_config.pre_grad_custom_pass.options == cc.CompileOptions(**OPTIONS)
    assert inductor_config.pre_grad_custom_pass is None and not passes.active

    handle = cc.use_with_inductor()  # on for the process ...
    assert isinstance(inductor_config.pre_grad_custom_pass, ComeraPreGradPass)
    handle.close()  # ... until closed
    assert inductor_config.pre_grad_custom_pass is None
    handle.close()  # twice is harmless

    cc.use_with_inductor(OPTIONS)
    cc.use_with_inductor.off()
    assert inductor_config.pre_grad_custom_pass is None


def test_settings_of_the_options_apply_in_scope_only():
    before = (inductor_config.triton.cudagraphs, inductor_config.max_autotune, inductor_config.max_pointwise_cat_inputs)
    options = {"cudagraphs": True, "max_autotune": True, "inductor_config": {"max_pointwise_cat_inputs": 123}}
    with cc.use_with_inductor(options):
        assert inductor_config.triton.cudagraphs is True and inductor_config.max_autotune is True
        assert inductor_config.max_pointwise_cat_inputs == 123
    after = (inductor_config.triton.cudagraphs, inductor_config.max_autotune, inductor_config.max_pointwise_cat_inputs)
    assert after == before


def test_nesting_shares_the_same_options_and_refuses_others():
    with cc.use_with_inductor(OPTIONS) as outer:
        installed = inductor_config.pre_grad_custom_pass
        with cc.use_with_inductor(dict(OPTIONS)) as inner:  # equal options: the same pass, nothing installed
            assert inductor_config.pre_grad_custom_pass is installed and inner.report is outer.report
        assert inductor_config.pre_grad_custom_pass is installed and outer.active
        with pytest.raises(RuntimeError, match="already on with other options"):
            cc.use_with_inductor({"cce_min_vocab": 0})
        assert inductor_config.pre_grad_custom_pass is installed
    assert inductor_config.pre_grad_custom_pass is None


def test_a_pre_grad_pass_installed_before_keeps_running_first():
    from comera_compile.inductor import PassChain

    class Theirs(CustomGraphPass):
        def __init__(self):
            self.seen = []

        def __call__(self, graph):
            self.seen.append(graph)

        def uuid(self):
            return "theirs-v1"

    theirs = Theirs()
    with inductor_config.patch(pre_grad_custom_pass=theirs):
        with cc.use_with_inductor(OPTIONS) as passes:
            chain = inductor_config.pre_grad_custom_pass
            assert isinstance(chain, PassChain) and chain.passes == (theirs, passes._pass)
            assert chain.uuid() == ("comera_compile.PassChain", ("theirs-v1", passes.uuid()))
            graph = torch.fx.Graph()
            chain(graph)  # theirs runs (ours leaves a graph without a Dynamo module alone)
            assert theirs.seen == [graph]
        assert inductor_config.pre_grad_custom_pass is theirs
        with cc.use_with_inductor(OPTIONS) as passes:
            inductor_config.pre_grad_custom_pass = [theirs, passes._pass, theirs]  # changed meanwhile
        assert inductor_config.pre_grad_custom_pass.passes == (theirs, theirs), "only our pass taken out"
        assert PassChain((theirs, lambda graph: None)).uuid() is None, "an unkeyed pass: uncacheable"
    assert inductor_config.pre_grad_custom_pass is None


def test_uuid_changes_with_options_passes_and_sources(monkeypatch):
    a = cc.use_with_inductor(OPTIONS)
    same = pass_uuid(cc.CompileOptions(**OPTIONS))
    assert a.uuid() == same == inductor_config.pre_grad_custom_pass.uuid() and isinstance(same, str)
    a.close()
    assert pass_uuid(cc.CompileOptions(**{**OPTIONS, "cce_backward": "filtered"})) != same
    assert pass_uuid(cc.CompileOptions(**{**OPTIONS, "passes": {"cce": False}})) != same
    assert pass_uuid(cc.CompileOptions(**{**OPTIONS, "inductor_config": {"max_autotune": True}})) != same
    try:
        @cc.register_pass("inductor-test-noop")
        def noop(gm, ctx):
            return 0

        with_pass = pass_uuid(cc.CompileOptions(**OPTIONS))
        assert with_pass != same, "a registered pass enters the key"

        @cc.register_pass("inductor-test-noop", replace=True)
        def noop(gm, ctx):  # noqa: F811  (the same name, other code)
            return 0 * 1 + len([])

        assert pass_uuid(cc.CompileOptions(**OPTIONS)) not in (with_pass, same), "and so does its code"
    finally:
        cc.unregister_pass("inductor-test-noop")
    assert pass_uuid(cc.CompileOptions(**OPTIONS)) == same
    monkeypatch.setattr(cache, "source_fingerprint", lambda: "other-code")
    assert pass_uuid(cc.CompileOptions(**OPTIONS)) != same, "a change to the package's code enters the key"


# ----------------------------------------------------------------------------------------------
# Compiles: against eager and backend="comera"
# ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_inductor_caches")
def test_lm_head_loss_is_fused_by_plain_torch_compile():
    """The LM head + cross-entropy becomes the fused op in plain torch.compile: the graph Inductor
    compiles calls it, the loss and gradients match eager and backend="comera", the rewrites are
    backend="comera"'s; after the block a fresh torch.compile is plain again."""
    torch.manual_seed(0)
    model = LM()
    idx, labels = _lm_batch()
    want = _loss_and_grads(model, idx, labels)
    expected = cc.explain(model, idx, labels, options={**OPTIONS, "inner": "eager"})
    assert _kinds(expected) == [("cce", "head")], str(expected)

    torch._dynamo.reset()
    spy = PostGradSpy()
    with inductor_config.patch(post_grad_custom_pre_pass=spy):
        with cc.use_with_inductor(OPTIONS) as passes, collecting() as collected:
            got = _loss_and_grads(torch.compile(model), idx, labels)
    _assert_same(got, want, **TOL)
    assert _kinds(passes.report) == _kinds(expected)
    assert [r.detail for r in passes.report.rewrites] == [r.detail for r in expected.rewrites]
    assert [str(s) for s in passes.report.skipped] == [str(s) for s in expected.skipped]
    assert passes.report.graph_reports[0].passes_run == expected.graph_reports[0].passes_run
    assert collected.graph_reports == passes.report.graph_reports  # the collector gets the same records
    assert "linear_cross_entropy" in collected.graph_reports[0].after and collected.graphs
    assert spy.comera_ops(), "Inductor compiled the fused op"

    torch._dynamo.reset()
    with collecting() as backend_report:
        backend = _loss_and_grads(torch.compile(model, backend="comera", options=OPTIONS), idx, labels)
    _assert_same(got, backend, **TOL)
    assert _kinds(backend_report) == _kinds(passes.report)

    torch._dynamo.reset()  # after the block: plain Inductor, nothing rewritten
    spy = PostGradSpy()
    with inductor_config.patch(post_grad_custom_pre_pass=spy), collecting() as after:
        _assert_same(_loss_and_grads(torch.compile(model), idx, labels), want, **TOL)
    assert inductor_config.pre_grad_custom_pass is None
    assert after.graph_reports == [] and len(passes.report.graph_reports) == 1
    assert spy.targets and not spy.comera_ops()


@pytest.mark.usefixtures("no_inductor_caches")
def test_tensorized_model_is_lowered_by_plain_torch_compile(caplog):
    """A tensor-train layer lowered and the head's loss fused, as backend="comera" does; the Inductor
    setting the tensor-network pass asks for is reported as not applied (the compile had read its
    config), with the option that applies it; the comera backend compiling inside the block is not
    rewritten twice."""
    import logging

    model = TTLoss()
    x, y = _tt_batch()
    want = _loss_and_grads(model, x, y)
    expected = cc.explain(model, x, y, options={**OPTIONS, "inner": "eager"})
    assert {r.kind for r in expected.rewrites} == {"tt_linear", "cce"}, str(expected)

    torch._dynamo.reset()
    with cc.use_with_inductor(OPTIONS) as passes, caplog.at_level(logging.WARNING, logger="comera_compile"):
        got = _loss_and_grads(torch.compile(model), x, y)
        settings = passes.report.graph_reports[0].inductor_config
        assert settings["triton.autotune_pointwise"] is inductor_config.triton.autotune_pointwise is True
        (warning,) = [r.getMessage() for r in caplog.records if "Inductor settings" in r.getMessage()]
        assert "'triton.autotune_pointwise': False" in warning and "use_with_inductor({'inductor_config'" in warning
        _assert_same(got, want, rtol=1e-4, atol=1e-5)
        assert _kinds(passes.report) == _kinds(expected)
        assert [r.detail for r in passes.report.rewrites] == [r.detail for r in expected.rewrites]
        assert [str(s) for s in passes.report.skipped] == [str(s) for s in expected.skipped]

        torch._dynamo.reset()
        with collecting() as backend_report:
            backend = _loss_and_grads(torch.compile(model, backend="comera", options=OPTIONS), x, y)
        assert len(passes.report.graph_reports) == 1, "the backend's own graph is not run through the hook"
    _assert_same(got, backend, **TOL)
    assert _kinds(backend_report) == _kinds(passes.report)


def _pre_grad_passes_run_late() -> bool:
    """Whether Inductor runs the pre-grad passes after the AOTAutograd cache lookup (on a miss only).
    torch 2.13: ``compile_fx`` hands them to ``aot_module_simplified`` (its ``pre_grad_passes``
    argument), which runs them after the lookup, and the pass's ``uuid()`` enters the key. torch 2.11:
    ``compile_fx`` runs them itself before calling AOTAutograd, so on every compile, a hit included,
    and the cache keys the graph they rewrote (2.11 has no ``pre_grad_passes`` argument and keys no
    ``pre_grad_custom_pass``): the pass runs and records its rewrite, then the cache serves the rest."""
    import inspect

    from torch._functorch.aot_autograd import aot_module_simplified

    return "pre_grad_passes" in inspect.signature(aot_module_simplified).parameters


def test_the_cache_is_keyed_on_the_options(monkeypatch, tmp_path):
    """Same options: the second compile is served by the AOTAutograd cache (the result still matches
    eager); other options: a miss, and the passes run. Where the pre-grad passes run after the cache
    lookup (torch 2.13) a hit runs no pass and records nothing; on torch 2.11 they run before it, on
    every compile, and the hit is keyed on the graph they rewrote (see ``_pre_grad_passes_run_late``)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    h, w = torch.randn(8, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    y = torch.randint(0, 64, (8,))

    def loss(h, w, y):
        return F.cross_entropy(F.linear(h, w), y)

    want = torch.autograd.functional.vjp(lambda h, w: loss(h, w, y), (h, w))

    def compile_once(options):
        torch._dynamo.reset()
        counters.clear()
        with cc.use_with_inductor(options) as passes:
            h_, w_ = h.detach().requires_grad_(), w.detach().requires_grad_()
            out = torch.compile(loss)(h_, w_, y)
            out.backward()
        torch.testing.assert_close((out.detach(), (h_.grad, w_.grad)), want, **TOL)
        aot = counters["aot_autograd"]
        return aot["autograd_cache_hit"], aot["autograd_cache_miss"], len(passes.report.rewrites)

    with inductor_config.patch({"fx_graph_cache": True, "fx_graph_remote_cache": False}), \
            functorch_config.patch({"enable_autograd_cache": True}):
        assert compile_once(OPTIONS) == (0, 1, 1)
        rewrites_on_a_hit = 0 if _pre_grad_passes_run_late() else 1
        assert compile_once(OPTIONS) == (1, 0, rewrites_on_a_hit), "same options: served from the cache"
        assert compile_once({**OPTIONS, "cce_strategy": "static"}) == (0, 1, 1), "other options: a miss"


@pytest.mark.usefixtures("no_inductor_caches")
def test_trainer_with_torch_compile_gets_the_fused_loss(tmp_path):
    """transformers' Trainer(torch_compile=True) compiles with the default backend (through accelerate's
    dynamo plugin): inside use_with_inductor its training graph gets the LM head's loss fused
    (cc.hf.fused_loss drops the logits that would otherwise keep the head unfused), and the step
    losses match an eager Trainer run with the same seed."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_hf import _lm_rows, _step_losses, _train_args, make_model

    rows = _lm_rows()

    def train(model, **args):
        trainer = transformers.Trainer(model=model, args=_train_args(tmp_path, max_steps=2, **args), train_dataset=rows)
        trainer.train()
        return trainer, _step_losses(trainer)

    _, want = train(make_model("llama"))
    with cc.use_with_inductor(OPTIONS) as passes:
        trainer, losses = train(cc.hf.fused_loss(make_model("llama")), torch_compile=True)
    assert trainer.args.torch_compile_backend == "inductor"
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert len(losses) == 2
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    assert _kinds(passes.report) == [("cce", "lm_head")], str(passes.report)


@pytest.mark.usefixtures("no_inductor_caches")
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_trainer_with_torch_compile_lowers_the_tt_layers_and_fuses_the_loss(checkpointing, tmp_path):
    """Trainer(torch_compile=True) on a tensorized model inside use_with_inductor: one training graph
    with the TT layers lowered and the head's loss fused, with TrainingArguments(gradient_checkpointing=
    True) too (whose checkpointed layers Dynamo ran eagerly, unseen by any pass, before use_with_inductor
    let it trace them: 5 graphs, 0 rewrites, nothing said); the step losses match an eager Trainer run
    with the same settings; Dynamo's setting is back as it was after the block."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_hf import _lm_rows, _step_losses, _train_args, make_model

    rows = _lm_rows()
    args = dict(gradient_checkpointing=True) if checkpointing else {}

    def tensorized():
        model = make_model("llama")
        cc.tensorize_(model, cc.TTConfig(rank=4, min_size=0), filter_fn=lambda m, fqn: ".mlp." in fqn)
        return model

    def train(model, **more):
        trainer = transformers.Trainer(model=model, args=_train_args(tmp_path, max_steps=2, **args, **more),
                                       train_dataset=rows)
        trainer.train()
        return _step_losses(trainer)

    want = train(tensorized())
    setting = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    before = getattr(torch._dynamo.config, setting, None)
    torch._dynamo.reset()
    with cc.use_with_inductor(OPTIONS) as passes:
        losses = train(cc.hf.fused_loss(tensorized()), torch_compile=True)
    assert getattr(torch._dynamo.config, setting, None) == before
    torch.testing.assert_close(losses, want, rtol=1e-4, atol=1e-5)
    training = [g for g in passes.graph_reports if any(r.kind == "cce" for r in g.rewrites)]
    assert len(training) == 1, str(passes.report)
    kinds = [(r.kind, r.module) for r in training[0].rewrites]
    assert ("cce", "lm_head") in kinds and sum(kind == "tt_linear" for kind, _ in kinds) == 3, str(passes.report)


@pytest.mark.usefixtures("no_inductor_caches")
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_an_accelerate_loop_compiling_with_inductor_gets_the_rewrites(mixed_precision):
    """A user's own loop with accelerate (``Accelerator(dynamo_backend="inductor")``, which takes no
    "comera" backend): inside use_with_inductor, ``prepare`` compiles the model with the tensor-train
    layer lowered and the head's loss fused, the rewrites ``explain`` reports for backend="comera", and
    the loss and gradients those of eager (under bf16 autocast with ``mixed_precision="bf16"``)."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = TTLoss()
    x, y = _tt_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
        want = _loss_and_grads(model, x, y)
    expected = cc.explain(model, x, y, options={**OPTIONS, "inner": "eager"})
    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)  # a state another test left has other settings
    try:
        accelerator = Accelerator(cpu=True, dynamo_backend="inductor", mixed_precision=mixed_precision)
        with cc.use_with_inductor(OPTIONS) as passes:
            prepared, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
            assert isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
            for p in prepared.parameters():
                p.grad = None
            loss = prepared(x, y)
            accelerator.backward(loss)
            got = loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone()
                                  for n, p in prepared.named_parameters() if p.grad is not None}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert _kinds(passes.report) == _kinds(expected) == [("cce", "model.2"), ("tt_linear", "model.0")]
    tol = dict(rtol=1e-4, atol=1e-5) if mixed_precision == "no" else dict(rtol=2e-2, atol=3e-3)
    _assert_same(got, want, **tol)
