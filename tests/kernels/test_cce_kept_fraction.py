"""strategy="auto" of comera::linear_cross_entropy follows the kept fraction the sparse path observed
on previous calls (not the flat-softmax assumption): the cost model, the observation store, the
run-time choice inside the op (eager and compiled), against float64 references (CPU; Triton
interpreter for the op)."""

import threading

import pytest
import torch
import torch.nn.functional as F

import comera_compile.kernels.linear_cross_entropy as lce
from comera_compile.devices import H200
from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy
from comera_compile.cce import (
    KEPT_EMA,
    KeptFractionStore,
    ShapeClass,
    cce_tuning,
    choose_strategy,
    kept_fractions,
    record_cce_stats,
    reset_kept_fractions,
    current_kept_fraction_store,
    default_filter_eps,
    default_kept_fraction_store,
    estimate_seconds,
    forward_bounds_pay,
    observe_kept_fraction,
    observed_kept_fraction,
    runtime_strategy,
    use_kept_fraction_store,
)

from cce_small import D, N, SCALED, V, _fresh_observations, scaled_rates  # noqa: F401  (fixtures)

LLAMA = (8192, 4096, 128256)  # the Llama-3 8B head
BF16 = torch.bfloat16
TOL = 1e-5  # the tolerance of the fused loss's fp32 tests; the filter drops entries below 2**-28 here


def _flat(seed=0):
    """N(0, 1) logits: an untrained head, the filter keeps every tile."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / D**0.5
    return x, w, torch.randint(0, V, (N,), generator=g)


def _peaked(seed=0):
    """A trained-like head: a steep unigram prior in one hidden direction (frequent words first),
    targets among the frequent words, hidden states pointing at their target's row: the softmax
    of every row is below 2**-28 beyond the first ~25 words, so the filter keeps ~1/8 of the tiles."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) / D**0.5
    w[:, 0] = torch.linspace(8.0, -192.0, V)
    t = torch.randint(0, 12, (N,), generator=g)
    x = 3.0 * w[t] + torch.randn(N, D, generator=g) / D**0.5
    x[:, 0] = 1.0
    return x, w, t


def _ref64(x, w, t):
    xd, wd = (a.detach().double().requires_grad_() for a in (x, w))
    loss = F.cross_entropy(xd @ wd.T, t)
    return (loss.detach(),) + torch.autograd.grad(loss, (xd, wd))


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _step(fn, x, w, t):
    """One training step of ``fn`` checked against float64; returns the (phase, path) it ran."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with record_cce_stats() as stats:
        loss = fn(xr, wr, t)
        grads = torch.autograd.grad(loss, (xr, wr))
    ref = _ref64(x, w, t)
    for got, exp, name in zip((loss,) + grads, ref, ("loss", "dx", "dw")):
        assert _rel(got, exp) < TOL, (name, _rel(got, exp), stats)
    return [(s.phase, s.path) for s in stats]


def _auto(x, w, t):
    return linear_cross_entropy(x, w, t, impl="triton")


CHUNKED = [("forward", "chunked")]
SPARSE_IN_FORWARD = [("forward", "triton"), ("forward", "sparse")]  # the chunked plan's outputs
SPARSE = [("forward", "triton"), ("backward", "sparse")]
EPS32 = default_filter_eps(torch.float32)


# --- the cost model --------------------------------------------------------------------------------

def test_an_observed_kept_fraction_flips_the_llama_head_to_sparse():
    """On the H200's rates the Llama-3 head takes "chunked" at the flat assumption (half the tiles
    kept), "sparse" once peaked steps were observed (4 % of the tiles kept: measured there, a
    learned-like softmax keeps 1.5-5 %); the rules of _allowed stay as they were. At 10 % the sparse
    rounds' fixed costs (five rounds) make chunked the faster again."""
    eps = default_filter_eps(BF16)
    assert choose_strategy(*LLAMA, BF16, rates=H200) == "chunked"
    flat, peaked = (estimate_seconds(*LLAMA, BF16, rates=H200, kept_fraction=k) for k in (None, 0.04))
    assert flat["sparse"] > flat["chunked"] and peaked["sparse"] < peaked["chunked"]
    assert estimate_seconds(*LLAMA, BF16, rates=H200, kept_fraction=0.48) == pytest.approx(flat)
    assert choose_strategy(*LLAMA, BF16, rates=H200, kept_fraction=0.04) == "sparse"
    assert choose_strategy(*LLAMA, BF16, rates=H200, kept_fraction=0.1) == "chunked"
    assert choose_strategy(*LLAMA, BF16, rates=H200, kept_fraction=0.6) == "chunked"
    for _ in range(3):  # three peaked steps of the sparse path: 4 % of 64 x 1002 tiles
        observe_kept_fraction(LLAMA[2], LLAMA[1], BF16, eps, 2565, 64 * 1002)
    seen = kept_fractions()[ShapeClass(LLAMA[2], LLAMA[1], BF16, eps)]
    assert seen.observations == 3 and seen.fraction == pytest.approx(0.04, abs=1e-3)
    assert observed_kept_fraction(LLAMA[2], LLAMA[1], BF16) == seen.fraction
    assert choose_strategy(*LLAMA, BF16, rates=H200) == "sparse"
    # another threshold, another dtype, or another head is another shape class: still flat
    assert choose_strategy(*LLAMA, BF16, rates=H200, filter_eps=eps / 2) == "chunked"
    assert choose_strategy(LLAMA[0], 2048, LLAMA[2], BF16, rates=H200) == "chunked"
    # deterministic, capture, an exact backward: never sparse; fp16: never chunked (sparse pays here)
    assert choose_strategy(*LLAMA, BF16, rates=H200, deterministic=True) == "chunked"
    assert choose_strategy(*LLAMA, BF16, rates=H200, backward="exact") == "chunked"
    assert choose_strategy(*LLAMA, BF16, rates=H200, capture=True) == "static"
    assert choose_strategy(*LLAMA, torch.float16, rates=H200) == "static"
    assert choose_strategy(*LLAMA, torch.float16, rates=H200, kept_fraction=0.1) == "sparse"  # vs static
    reset_kept_fractions()
    assert kept_fractions() == {} and choose_strategy(*LLAMA, BF16, rates=H200) == "chunked"


def test_the_store_is_a_thread_safe_running_average():
    assert observed_kept_fraction(V, D, torch.float32) is None
    observe_kept_fraction(V, D, torch.float32, EPS32, 0, 0)  # nothing covered: no observation
    assert kept_fractions() == {}
    observe_kept_fraction(V, D, torch.float32, EPS32, 8, 8)
    observe_kept_fraction(V, D, torch.float32, EPS32, 0, 8)
    seen = kept_fractions()[ShapeClass(V, D, torch.float32, EPS32)]
    assert (seen.fraction, seen.last, seen.observations) == (1.0 - KEPT_EMA, 0.0, 2)

    def feed():
        for _ in range(200):
            observe_kept_fraction(V, 2 * D, torch.float32, EPS32, 3, 12)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seen = kept_fractions()[ShapeClass(V, 2 * D, torch.float32, EPS32)]
    assert seen.observations == 800 and seen.fraction == pytest.approx(0.25)


def test_one_store_is_thread_safe_and_its_own():
    """A caller's store is a thread-safe running average of its own: threads running in a copy of the
    block's context feed it through the module functions, and through its methods directly, none of
    it in the default store."""
    store = KeptFractionStore()
    key = (V, D, torch.float32, EPS32)

    def feed():
        for _ in range(100):
            observe_kept_fraction(*key, 3, 12)  # the current store: the block's
            store.observe(*key, 3, 12)

    with use_kept_fraction_store(store) as current:
        assert current is store and current_kept_fraction_store() is store
        threads = [threading.Thread(target=feed) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert kept_fractions() == store.snapshot()
    seen = store.snapshot()[ShapeClass(*key)]
    assert seen.observations == 800 and seen.fraction == pytest.approx(0.25)
    assert store.estimate(V, D, torch.float32) == seen.fraction
    assert current_kept_fraction_store() is default_kept_fraction_store()
    assert kept_fractions() == {} and observed_kept_fraction(V, D, torch.float32) is None
    store.reset()
    assert store.snapshot() == {} and store.estimate(V, D, torch.float32) is None


def test_two_stores_do_not_see_each_others_observations():
    """The decisions of a call (runtime_strategy, forward_bounds_pay, choose_strategy) and the
    counters behind them come from the current store only; blocks nest and restore the outer store
    (also on an exception); the default store is the one outside every block."""
    args = (N, D, V, torch.float32)
    kw = dict(filter_eps=EPS32, rates=SCALED)
    key = (V, D, torch.float32, EPS32)
    flat, peaked = KeptFractionStore(), KeptFractionStore()
    with cce_tuning(probe_every=3, bounds_min_skip=0.3):
        with use_kept_fraction_store(flat):
            observe_kept_fraction(*key, 64, 64, skipped_tiles=0)
            with use_kept_fraction_store(peaked):
                observe_kept_fraction(*key, 8, 64, skipped_tiles=50)
                assert runtime_strategy("static", *args, **kw) == "sparse"
                assert forward_bounds_pay(*key)
                assert choose_strategy(N, D, V, torch.float32, rates=SCALED) == "sparse"
            assert current_kept_fraction_store() is flat
            # 2 calls counted in the flat store: a 3rd is a probe; the peaked store's count is its own
            assert [runtime_strategy("static", *args, **kw) for _ in range(2)] == ["static"] * 2
            assert [forward_bounds_pay(*key) for _ in range(2)] == [False, False]
            assert choose_strategy(N, D, V, torch.float32, rates=SCALED) == "chunked"
            with pytest.raises(RuntimeError), use_kept_fraction_store(peaked):
                raise RuntimeError("the block's store is removed on the way out")
            assert current_kept_fraction_store() is flat
            assert runtime_strategy("static", *args, **kw) == "sparse"  # the probe
            assert forward_bounds_pay(*key)
        with use_kept_fraction_store(peaked):
            assert [runtime_strategy("static", *args, **kw) for _ in range(2)] == ["sparse"] * 2
    assert flat.snapshot()[ShapeClass(*key)].fraction == 1.0
    assert peaked.snapshot()[ShapeClass(*key)].fraction == 0.125
    assert kept_fractions() == {} and observed_kept_fraction(V, D, torch.float32) is None
    assert runtime_strategy("static", *args, **kw) == "sparse"  # the default store: nothing seen, a probe
    with pytest.raises(TypeError):
        with use_kept_fraction_store({}):
            pass


def test_use_kept_fraction_store_nests_and_restores():
    """Blocks nest: the innermost is current, and each exit (also by an exception) restores the
    outer block's store, then the default one; re-entering a store already current nests too."""
    a, b = KeptFractionStore(), KeptFractionStore()
    default = default_kept_fraction_store()
    with use_kept_fraction_store(a):
        assert current_kept_fraction_store() is a
        with use_kept_fraction_store(b):
            assert current_kept_fraction_store() is b
            with use_kept_fraction_store(a):
                assert current_kept_fraction_store() is a
            assert current_kept_fraction_store() is b
        assert current_kept_fraction_store() is a
        with pytest.raises(KeyError), use_kept_fraction_store(b):
            assert current_kept_fraction_store() is b
            raise KeyError("leaves the block")
        assert current_kept_fraction_store() is a
    assert current_kept_fraction_store() is default


def test_the_default_store_is_the_one_of_callers_that_chose_none():
    """Outside any block the module functions read and write the default store, as before the stores
    existed; a block's observations never reach it, and it is current again after the block."""
    default = default_kept_fraction_store()
    key = (V, D, torch.float32, EPS32)
    observe_kept_fraction(*key, 16, 64)
    assert default.snapshot() == kept_fractions() and default.estimate(V, D, torch.float32) == 0.25
    with use_kept_fraction_store() as own:
        assert own is not default and kept_fractions() == {}
        observe_kept_fraction(*key, 64, 64)
        assert observed_kept_fraction(V, D, torch.float32) == 1.0
    assert observed_kept_fraction(V, D, torch.float32) == 0.25
    assert default.snapshot()[ShapeClass(*key)].observations == 1
    reset_kept_fractions()
    assert default.snapshot() == {} and own.estimate(V, D, torch.float32) == 1.0


def test_runtime_strategy_probes_then_follows_the_observation():
    """With no observation the run-time choice probes the sparse path; then it takes the cheaper
    path at the observed fraction, and probes again after probe_every calls without one. An
    observation after n silent calls weighs 1 - (1 - KEPT_EMA)**n."""
    args = (N, D, V, torch.float32)
    kw = dict(filter_eps=EPS32, rates=SCALED)
    with cce_tuning(probe_every=4):
        assert runtime_strategy("chunked", *args, **kw) == "sparse"  # nothing observed: a probe
        observe_kept_fraction(V, D, torch.float32, EPS32, 64, 64)  # flat: every tile kept
        assert [runtime_strategy("chunked", *args, **kw) for _ in range(4)] == ["chunked"] * 3 + ["sparse"]
        assert runtime_strategy("chunked", *args, **kw) == "sparse"  # until the probe's observation comes
        observe_kept_fraction(V, D, torch.float32, EPS32, 64, 64)
        assert [runtime_strategy("static", *args, **kw) for _ in range(3)] == ["static"] * 3
        observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64)  # peaked, after 3 silent calls
        fraction = kept_fractions()[ShapeClass(V, D, torch.float32, EPS32)].fraction
        assert fraction == pytest.approx((1 - KEPT_EMA)**3 + (1 - (1 - KEPT_EMA)**3) * 0.125)
        # 0.23: sparse is cheaper than static, not yet than chunked
        assert [runtime_strategy(p, *args, **kw) for p in ("static", "chunked")] == ["sparse", "chunked"]
        observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64)
        assert [runtime_strategy(p, *args, **kw) for p in ("chunked", "static", "sparse")] == ["sparse"] * 3


# --- the op: eager and compiled --------------------------------------------------------------------

def test_auto_flips_from_chunked_to_sparse_after_peaked_steps(scaled_rates):
    """Training starts flat and becomes peaked. The first step probes the sparse path (it forms the
    chunked plan's gradients in the forward), which observes every tile kept: "chunked" then; the
    peaked steps take chunked until the next probe observes the peaked fraction, then sparse. Every
    step matches float64, whichever path it took."""
    flat, peaked = _flat(), _peaked()
    with cce_tuning(probe_every=4):
        paths = [_step(_auto, *flat), _step(_auto, *flat), _step(_auto, *flat)]
        assert paths == [SPARSE_IN_FORWARD, CHUNKED, CHUNKED]
        assert kept_fractions()[ShapeClass(V, D, torch.float32, EPS32)].fraction == 1.0
        paths = [_step(_auto, *peaked), _step(_auto, *peaked), _step(_auto, *peaked)]
    # the 4th call since the probe probes; then the cost model's "sparse" is planned as "chunked"
    # (adaptive_plan), whose sparse rounds run in the forward, where the forward's logit bounds apply
    assert paths == [CHUNKED, SPARSE_IN_FORWARD, SPARSE_IN_FORWARD], paths
    seen = kept_fractions()[ShapeClass(V, D, torch.float32, EPS32)]
    assert seen.last <= 0.15 and seen.fraction < 0.2, seen
    assert choose_strategy(N, D, V, torch.float32, rates=SCALED) == "sparse"


def test_a_compiled_graph_follows_the_observations(scaled_rates):
    """Under torch.compile the plan is traced as a constant ("chunked": no observation is read
    while tracing), yet the op decides when it runs: sparse rounds in its forward while the
    observed fraction is peaked, chunked once it is flat; one compilation."""
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(_auto, backend=backend)
    peaked, flat = _peaked(), _flat()
    observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64)  # as if peaked steps had run
    assert _step(fn, *peaked) == SPARSE_IN_FORWARD
    assert _step(fn, *peaked) == SPARSE_IN_FORWARD
    reset_kept_fractions()
    assert _step(fn, *flat) == SPARSE_IN_FORWARD  # nothing observed: a probe, which finds it flat
    assert _step(fn, *flat) == CHUNKED
    assert len(compiles) == 1
    (op,) = [n for n in compiles[0].graph.nodes if "linear_cross_entropy" in str(n.target)]
    planned = lce.LCEOptions.from_op_args(op.args[4:])
    assert planned.strategy == "chunked" and planned.adaptive


def test_a_model_under_its_own_store_does_not_move_another_models_path(scaled_rates):
    """Model A trains into peaked logits under store A, model B stays flat under store B: each call
    takes the path of its own store's observations (with one shared store, B's flat steps would
    pull A's estimate to ~0.56 and A's next step would take chunked); the default store sees none."""
    a, b = KeptFractionStore(), KeptFractionStore()
    peaked, flat = _peaked(), _flat()
    with use_kept_fraction_store(a):
        assert [_step(_auto, *peaked), _step(_auto, *peaked)] == [SPARSE_IN_FORWARD, SPARSE_IN_FORWARD]
    with use_kept_fraction_store(b):
        # the first call of B probes (nothing observed in B), then takes chunked (B is flat)
        assert [_step(_auto, *flat), _step(_auto, *flat)] == [SPARSE_IN_FORWARD, CHUNKED]
    with use_kept_fraction_store(a):
        assert _step(_auto, *peaked) == SPARSE_IN_FORWARD
    key = ShapeClass(V, D, torch.float32, EPS32)
    assert a.snapshot()[key].observations == 3 and a.snapshot()[key].fraction < 0.2
    assert b.snapshot()[key].observations == 1 and b.snapshot()[key].fraction == 1.0
    assert kept_fractions() == {}


def test_a_backward_after_the_block_observes_into_the_forwards_store(scaled_rates):
    """Autograd may run the backward after the block of its forward exited, or inside another
    store's block: its sparse rounds (and the run-time choice before them) use the forward's store."""
    peaked = _peaked()
    key = ShapeClass(V, D, torch.float32, EPS32)

    def forward(strategy, **kw):
        x, w = (v.clone().requires_grad_() for v in peaked[:2])
        return linear_cross_entropy(x, w, peaked[2], impl="triton", strategy=strategy, **kw), (x, w)

    a, b = KeptFractionStore(), KeptFractionStore()
    with use_kept_fraction_store(a):
        loss, leaves = forward("sparse")  # a pinned sparse path: its rounds run in the backward
    with record_cce_stats() as stats:
        grads = torch.autograd.grad(loss, leaves)
    assert [(s.phase, s.path) for s in stats] == [("backward", "sparse")]
    assert a.snapshot()[key].observations == 1 and kept_fractions() == {}
    a.observe(*key, 8, 64)  # peaked: "auto" (bounds off) plans sparse rounds in the backward
    with use_kept_fraction_store(a), cce_tuning(forward_bounds=False):
        loss, leaves = forward("auto")
    with use_kept_fraction_store(b), record_cce_stats() as stats:
        grads = torch.autograd.grad(loss, leaves)
    assert [(s.phase, s.path) for s in stats] == [("backward", "sparse")]
    assert a.snapshot()[key].observations == 3 and b.snapshot() == {} and kept_fractions() == {}
    for got, exp in zip(grads, _ref64(*peaked)[1:]):
        assert _rel(got, exp) < TOL


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum", label_smoothing=0.1),
                                dict(softcap=20.0, ignore_index=3), dict(softcap=20.0, label_smoothing=0.1)])
def test_the_chunked_plan_formed_by_sparse_rounds_matches_float64(scaled_rates, kw):
    """The first call of an automatic "chunked" plan probes: sparse rounds form the gradients in the
    forward (for grad_output = 1; the backward scales them), with a bias, reduction "sum", label
    smoothing, softcap and ignored rows; softcap with label smoothing cannot filter and stays chunked."""
    x, w, t = _peaked(seed=1)
    t[[5, 17]] = kw.get("ignore_index", -100)
    b = torch.randn(V, generator=torch.Generator().manual_seed(2))
    leaves = [a.clone().requires_grad_() for a in (x, w, b)]
    go = torch.tensor(1.7)
    with record_cce_stats() as stats:
        loss = linear_cross_entropy(*leaves[:2], t, leaves[2], impl="triton", **kw)
        grads = torch.autograd.grad(loss, leaves, go)
    filters = not (kw.get("softcap") and kw.get("label_smoothing"))
    assert [(s.phase, s.path) for s in stats] == (SPARSE_IN_FORWARD if filters else CHUNKED), stats
    ref = [a.detach().double().requires_grad_() for a in (x, w, b)]
    z = ref[0] @ ref[1].T + ref[2]
    if kw.get("softcap"):
        z = kw["softcap"] * torch.tanh(z / kw["softcap"])
    ref_loss = F.cross_entropy(z, t, **{k: v for k, v in kw.items() if k != "softcap"})
    assert _rel(loss, ref_loss) < TOL
    for got, exp, name in zip(grads, torch.autograd.grad(ref_loss, ref, go.double()), "xwb"):
        assert _rel(got, exp) < TOL, (name, _rel(got, exp))


def test_pinned_strategies_do_not_follow_the_observations(scaled_rates):
    """A pinned path runs as asked whatever was observed, and probes nothing; a pinned sparse
    backward still reports what it kept."""
    observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64)
    peaked = _peaked()
    assert _step(lambda x, w, t: linear_cross_entropy(x, w, t, impl="triton", strategy="chunked"),
                 *peaked) == CHUNKED
    assert _step(lambda x, w, t: linear_cross_entropy(x, w, t, impl="triton", strategy="static"),
                 *peaked) == [("forward", "triton"), ("backward", "static")]
    reset_kept_fractions()
    assert _step(lambda x, w, t: linear_cross_entropy(x, w, t, impl="triton", strategy="sparse"),
                 *peaked) == SPARSE
    assert kept_fractions()[ShapeClass(V, D, torch.float32, EPS32)].last <= 0.15


_SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("case", ["deterministic", "exact", "capture", "dense"])
def test_no_probe_and_no_sync_where_sparse_may_not_run(scaled_rates, monkeypatch, case):
    """Deterministic, an exact backward, CUDA-graph capture: auto never probes the sparse path and
    reads no device value on the host; neither does a call that follows a dense observation."""
    kw = {"deterministic": dict(deterministic=True), "exact": dict(backward="exact")}.get(case, {})
    if case == "capture":
        monkeypatch.setattr(lce, "stream_capturing", lambda x: True)
    if case == "dense":
        observe_kept_fraction(V, D, torch.float32, EPS32, 64, 64)

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as patch:
        for name in _SYNCS:
            patch.setattr(torch.Tensor, name, no_sync)
        xr, wr = (a.clone().requires_grad_() for a in _peaked()[:2])
        t = _peaked()[2]
        with record_cce_stats() as stats:
            loss = linear_cross_entropy(xr, wr, t, impl="triton", **kw)
            grads = torch.autograd.grad(loss, (xr, wr))
    assert "sparse" not in {s.path for s in stats}, stats
    assert len(kept_fractions()) == (1 if case == "dense" else 0)
    for got, exp in zip((loss,) + grads, _ref64(*_peaked())):
        assert _rel(got, exp) < TOL


def _pass_plan(pinned):
    """The options the cce pass gives the op for a small head (``cce_strategy`` pinned or not)."""
    import comera_compile as cc

    head = torch.nn.Linear(12, 37, bias=False)
    x, y = torch.randn(8, 12), torch.randint(0, 37, (8,))
    options = {"inner": "eager", "cce_min_vocab": 0, **({"cce_strategy": pinned} if pinned else {})}
    report = cc.explain(lambda x, y: F.cross_entropy(head(x), y), x, y, options=options)
    (op,) = [n for n in report.graphs[0].graph.nodes if "linear_cross_entropy" in str(n.target)]
    return lce.LCEOptions.from_op_args(op.args[4:])


@pytest.mark.parametrize("pinned", [None, "chunked"])
def test_the_cce_pass_plans_an_adaptive_call_unless_pinned(pinned):
    """The cce pass fixes the op's plan at compile time; an unpinned plan (cce_strategy "auto") is
    marked adaptive, so the op re-decides when it runs; a pinned one is not."""
    planned = _pass_plan(pinned)
    assert planned.adaptive == (pinned is None) and planned.need_dw


@pytest.mark.parametrize("pinned", [None, "sparse"])
def test_the_cce_pass_plans_an_automatic_sparse_choice_as_chunked(monkeypatch, pinned):
    """Where the cost model picks sparse, the pass plans "chunked" (adaptive_plan: the op then runs
    the sparse rounds in its forward, with the forward's logit bounds); a pinned "sparse" stays."""
    import dataclasses

    import comera_compile.passes.cce as cce_pass

    real = cce_pass.decide_fused_loss
    monkeypatch.setattr(cce_pass, "decide_fused_loss",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), strategy="sparse"))
    planned = _pass_plan(pinned)
    assert planned.strategy == ("chunked" if pinned is None else "sparse")
    assert planned.adaptive == (pinned is None)


# The sparse path's times measured on the H200 (bench_cce.py --cases peaked,peaked-flat, torch 2.11,
# 2026-12-04): (shape, kept fraction, fraction the forward's bounds ruled out, ms with the bounds,
# ms without them, ms of the chunked path at its default 256 MiB budget)
MEASURED_SPARSE = [
    ((8192, 2304, 256000), 0.028, 0.969, 29.84, 44.00, 54.34),
    ((8192, 2304, 256000), 0.0076, 0.986, 25.39, 39.12, 53.74),
    ((8192, 4096, 128256), 0.0518, 0.944, 28.16, 40.41, 40.33),
    ((8192, 4096, 128256), 0.0155, 0.971, 22.67, 34.77, 40.43),
    ((8192, 1024, 128256), 0.0521, 0.939, 13.98, 15.39, 12.16),
    ((8192, 1024, 128256), 0.0155, 0.971, 9.56, 11.27, 11.98),
]


@pytest.mark.parametrize("shape,kept,skipped,bounded_ms,unbounded_ms,chunked_ms", MEASURED_SPARSE)
def test_the_cost_model_prices_the_measured_sparse_path(shape, kept, skipped, bounded_ms, unbounded_ms, chunked_ms):
    """The H200 rates reproduce the sparse path's measured times within 10 %, with the forward's
    bounds and without, and a run-time choice between the forward's sparse rounds and the chunked
    path picks the one that was faster there (the d 1024 head at 5 % kept: chunked)."""
    with_bounds = estimate_seconds(*shape, BF16, rates=H200, kept_fraction=kept, skipped_fraction=skipped)
    without = estimate_seconds(*shape, BF16, rates=H200, kept_fraction=kept)
    assert with_bounds["sparse"] * 1e3 == pytest.approx(bounded_ms, rel=0.1)
    assert without["sparse"] * 1e3 == pytest.approx(unbounded_ms, rel=0.1)
    faster = "sparse" if bounded_ms < chunked_ms else "chunked"
    assert min(("sparse", "chunked"), key=with_bounds.get) == faster


def test_the_run_time_path_choices_are_pure_planner_functions():
    """forward_path / recompute_path (comera_compile.cce): the planned path where sparse rounds may not run or
    the plan is pinned; fused for a small D; the observation (here none yet: a sparse probe) only for "auto"
    plans. They read shapes and flags, no tensor."""
    from comera_compile.cce import KeptFractionStore, forward_path, recompute_path, use_kept_fraction_store

    big = (4096, 1024, 32000, torch.bfloat16)
    kw = dict(filter_eps=2.0 ** -12, memory_budget=256 << 20)
    with use_kept_fraction_store(KeptFractionStore()):  # nothing observed
        assert forward_path("chunked", False, True, *big, **kw) == "chunked"  # pinned by the user
        assert forward_path("chunked", True, False, *big, **kw) == "chunked"  # e.g. under CUDA-graph capture
        assert forward_path("static", True, True, *big, **kw) == "static"
        assert forward_path("chunked", True, True, *big, **kw) == "sparse"  # no observation yet: a probe
        assert recompute_path("auto", False, True, 4096, 32, 32000, torch.bfloat16, **kw) == "fused"
        assert recompute_path("auto", False, False, *big, **kw) == "static"
        assert recompute_path("auto", False, True, *big, **kw) == "sparse"
        assert recompute_path("sparse", False, False, *big, **kw) == "static"
        assert recompute_path("fused", True, True, *big, **kw) == "fused"
        assert recompute_path("static", True, True, *big, **kw) == "sparse"  # adaptive: the probe
        assert recompute_path("static", False, True, *big, **kw) == "static"
