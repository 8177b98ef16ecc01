"""The forward's logit bounds (``LogitBounds``): sparse rounds run in the forward skip, without
recomputing them, the tiles whose largest logit the forward bounds below the filter. Checked against
a brute-force filter over the full logits (never a tile the filter keeps), and end to end against
the same rounds without the bounds and against float64 (CPU; Triton interpreter for the op)."""

import math

import pytest
import torch
import torch.nn.functional as F

from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy
from comera_compile.kernels.linear_cross_entropy_paths import LogitBounds
from comera_compile.cce import adaptive_plan, cce_tuning, default_filter_eps, record_cce_stats, reset_kept_fractions

from cce_small import D, N, V, _fresh_observations, scaled_rates  # noqa: F401  (fixtures)

EPS32 = default_filter_eps(torch.float32)
forward_sparse = scaled_rates  # strategy="auto" plans "chunked" for this head; its first call probes
#                                sparse rounds in the forward: the path that takes the bounds


def _peaked(seed=0):
    """A trained-like head: a steep prior in one hidden direction, targets among the frequent
    words, hidden states pointing at their target's row (most tiles below the filter)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) / D**0.5
    w[:, 0] = torch.linspace(8.0, -192.0, V)
    w = w[torch.randperm(V, generator=g)]  # the frequent words spread over the vocabulary
    t = torch.randint(0, V, (N,), generator=g)
    order = torch.argsort(w[:, 0], descending=True)
    t = order[torch.randint(0, 12, (N,), generator=g)]
    x = 3.0 * w[t] + torch.randn(N, D, generator=g) / D**0.5
    x[:, 0] = 1.0
    return x, w, t


def _tiles_the_filter_keeps(z, order, BM, BN, eps):
    """Brute force: a tile is kept when some softmax entry in it reaches eps (NaN keeps it)."""
    p = (z - torch.logsumexp(z, 1, keepdim=True)).exp()[:, order]
    n, v = p.shape
    p = F.pad(p, (0, (-v) % BN, 0, (-n) % BM))
    tiles = p.view(p.shape[0] // BM, BM, p.shape[1] // BN, BN)
    return (tiles >= eps).any(3).any(1) | tiles.isnan().any(3).any(1)


def _bounds_of(z, rows, eps):
    n = z.shape[0]
    colmax = F.pad(z, (0, 0, 0, (-n) % rows), value=float("-inf")).view(-1, rows, z.shape[1]).amax(1)
    return LogitBounds.of(colmax, torch.logsumexp(z, 1), rows, eps)


@pytest.mark.parametrize("rows,BM,BN,n", [(16, 16, 16, 64), (16, 32, 16, 70), (32, 16, 32, 61), (8, 8, 64, 64)])
def test_the_bounds_never_rule_out_a_tile_the_filter_keeps(rows, BM, BN, n):
    torch.manual_seed(0)
    x, w, _ = _peaked()
    x = torch.cat([x, x[: n - N]]) if n > N else x[:n]
    z = x @ w.T
    order = torch.argsort(w @ x.sum(0), descending=True)
    kept = _tiles_the_filter_keeps(z, order, BM, BN, EPS32)
    flags = _bounds_of(z, rows, EPS32).tile_flags(order.to(torch.int32), n, BM, BN)
    assert flags.shape == kept.shape and flags.dtype == torch.uint8
    assert bool((flags.bool() | ~kept).all()), "a tile the filter keeps was ruled out"
    assert (flags == 0).sum() > 0.5 * flags.numel()  # and they do rule out most of a peaked head's tiles
    # without an order the tiles are read in vocabulary order
    natural = torch.arange(V)
    assert bool((_bounds_of(z, rows, EPS32).tile_flags(None, n, BM, BN).bool()
                 | ~_tiles_the_filter_keeps(z, natural, BM, BN, EPS32)).all())


def test_nan_and_infinite_logits_keep_their_tiles():
    """Every tile the filter cannot drop (a NaN or infinite entry among them: is_filtered keeps
    those) stays; a NaN lse keeps its whole token block."""
    x, w, _ = _peaked()
    z = x @ w.T
    z[3, 5] = float("nan")
    z[20, 7] = float("inf")
    z[40] = float("-inf")
    flags = _bounds_of(z, 16, EPS32).tile_flags(None, N, 16, 16)
    kept = _tiles_the_filter_keeps(z, torch.arange(V), 16, 16, EPS32)
    assert bool((flags.bool() | ~kept).all())
    assert bool((flags[0] == 1).all())  # row 3's lse is NaN
    assert flags[1, 0] == 1  # the tile of the inf logit (its softmax entry is NaN)
    assert bool((flags[2] == 1).all())  # a row of -inf logits: its lse is -inf, nothing is ruled out
    assert (flags[3] == 0).any()  # an ordinary block still rules tiles out


def test_a_logit_just_above_the_filter_keeps_its_tile():
    """The margin covers the recompute's rounding: an entry at log(eps) + 1e-3 keeps its tile."""
    z = torch.full((16, 64), -100.0)
    z[:, 0] = 0.0  # lse ~ 0
    z[5, 40] = math.log(EPS32) + 1e-3
    flags = _bounds_of(z, 16, EPS32).tile_flags(None, 16, 16, 16)
    assert flags.tolist() == [[1, 0, 1, 0]]


def _train_step(x, w, t):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with record_cce_stats() as stats:
        loss = linear_cross_entropy(xr, wr, t, impl="triton")
        grads = torch.autograd.grad(loss, (xr, wr))
    return (loss.detach(),) + grads, stats


def _ref64(x, w, t):
    xd, wd = (a.detach().double().requires_grad_() for a in (x, w))
    loss = F.cross_entropy(xd @ wd.T, t)
    return (loss.detach(),) + torch.autograd.grad(loss, (xd, wd))


def test_sparse_rounds_in_the_forward_skip_tiles_and_give_the_same_gradients(forward_sparse):
    x, w, t = _peaked()
    with_bounds, stats = _train_step(x, w, t)
    assert [(s.phase, s.path) for s in stats] == [("forward", "triton"), ("forward", "sparse")]
    sparse = stats[1]
    assert sparse.skipped_tiles > 0.5 * sparse.tiles  # most of the peaked head's tiles not recomputed
    assert sparse.kept_tiles + sparse.skipped_tiles <= sparse.tiles
    reset_kept_fractions()
    with cce_tuning(forward_bounds=False):
        without, stats_off = _train_step(x, w, t)
    assert [(s.phase, s.path) for s in stats_off] == [("forward", "triton"), ("forward", "sparse")]
    assert stats_off[1].skipped_tiles == 0 and stats_off[1].kept_tiles == sparse.kept_tiles
    for a, b, name in zip(with_bounds, without, ("loss", "dx", "dw")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the same tiles, reduced in the same order
    for got, ref, name in zip(with_bounds, _ref64(x, w, t), ("loss", "dx", "dw")):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5, name


def test_a_nan_hidden_state_propagates_with_the_bounds(forward_sparse):
    x, w, t = _peaked()
    x[7, 3] = float("nan")
    (loss, dx, dw), stats = _train_step(x, w, t)
    assert [(s.phase, s.path) for s in stats] == [("forward", "triton"), ("forward", "sparse")]
    assert loss.isnan()
    reset_kept_fractions()
    with cce_tuning(forward_bounds=False):
        (_, dx_off, dw_off), _ = _train_step(x, w, t)
    assert torch.equal(dx.isnan(), dx_off.isnan()) and torch.equal(dw.isnan(), dw_off.isnan())
    assert dx[7].isnan().all()


def test_an_automatic_sparse_choice_is_planned_as_chunked_where_that_may_run():
    """Its rounds then run in the forward, with the bounds; where the chunked path may not run (fp16,
    reduction "none", a differentiated lse) or the bounds are off, the choice stays "sparse"."""
    bf16 = torch.bfloat16
    assert adaptive_plan("sparse", bf16) == "chunked"
    assert adaptive_plan("sparse", torch.float32, reduction="sum") == "chunked"
    assert adaptive_plan("sparse", torch.float16) == "sparse"
    assert adaptive_plan("sparse", bf16, reduction="none") == "sparse"
    assert adaptive_plan("sparse", bf16, lse_grad=True) == "sparse"
    for other in ("chunked", "static", "fused"):
        assert adaptive_plan(other, bf16) == other
    with cce_tuning(forward_bounds=False):
        assert adaptive_plan("sparse", bf16) == "sparse"


def test_with_the_bounds_off_an_automatic_sparse_choice_stays_in_the_backward(forward_sparse):
    from comera_compile.cce import observe_kept_fraction

    x, w, t = _peaked()
    with cce_tuning(forward_bounds=False):
        observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64)  # peaked steps were seen: auto picks sparse
        got, stats = _train_step(x, w, t)
    assert [(s.phase, s.path) for s in stats] == [("forward", "triton"), ("backward", "sparse")]
    for a, ref, name in zip(got, _ref64(x, w, t), ("loss", "dx", "dw")):
        assert float((a.double() - ref).norm() / ref.norm()) < 1e-5, name


# --- when the bounds pay: the observed fraction of tiles they rule out --------------------------------

def test_the_bounds_are_computed_while_what_they_rule_out_pays():
    """No observation: computed (a probe). Observed to rule out little: not computed, until
    probe_every calls have passed (a probe again); observed to rule out much: computed. The
    estimate is a running average weighted like the kept fraction's."""
    from comera_compile.cce import (
        KEPT_EMA, ShapeClass, forward_bounds_pay, kept_fractions, observe_kept_fraction)

    key = (V, D, torch.float32, EPS32)
    with cce_tuning(probe_every=3, bounds_min_skip=0.3):
        assert forward_bounds_pay(*key)
        observe_kept_fraction(*key, 2, 64)  # rounds without the bounds: nothing about them learnt
        assert forward_bounds_pay(*key) and kept_fractions()[ShapeClass(*key)].skipped is None
        observe_kept_fraction(*key, 2, 64, skipped_tiles=1)  # they ruled out 1 tile in 64
        assert [forward_bounds_pay(*key) for _ in range(3)] == [False, False, True]
        observe_kept_fraction(*key, 2, 64, skipped_tiles=60)  # the probe, after 3 calls without them
        w = 1 - (1 - KEPT_EMA) ** 3
        assert kept_fractions()[ShapeClass(*key)].skipped == pytest.approx((1 - w) / 64 + w * 60 / 64)
        assert all(forward_bounds_pay(*key) for _ in range(5))
        with cce_tuning(forward_bounds=False):
            assert not forward_bounds_pay(*key)
    # other shape classes are their own
    assert forward_bounds_pay(V, D, torch.bfloat16, EPS32)


def test_the_cost_model_counts_the_tiles_the_bounds_rule_out(monkeypatch):
    """Rounds in the forward skip the ruled-out tiles' recompute: at a kept fraction where sparse
    rounds lose to chunked, an observed skipped fraction that pays makes them win; one below
    ``bounds_min_skip`` (bounds not computed) does not count."""
    from comera_compile.cce import (
        estimate_seconds, observe_kept_fraction, runtime_strategy)

    from cce_small import SCALED

    args = (N, D, V, torch.float32)
    base = estimate_seconds(*args, rates=SCALED, kept_fraction=0.25)
    half = estimate_seconds(*args, rates=SCALED, kept_fraction=0.25, skipped_fraction=0.5)
    assert base["sparse"] > base["chunked"] and half["sparse"] < base["sparse"]
    assert {k: v for k, v in half.items() if k != "sparse"} == {k: v for k, v in base.items() if k != "sparse"}
    kw = dict(filter_eps=EPS32, rates=SCALED)
    with cce_tuning(probe_every=100, bounds_min_skip=0.3):
        observe_kept_fraction(V, D, torch.float32, EPS32, 16, 64, skipped_tiles=45)  # 0.25 kept, 0.70 ruled out
        assert runtime_strategy("chunked", *args, **kw) == "sparse"
        import comera_compile.cce.planner as plan

        seen = []
        real = plan.estimate_seconds
        monkeypatch.setattr(plan, "estimate_seconds",
                            lambda *a, **k: seen.append(k["skipped_fraction"]) or real(*a, **k))
        runtime_strategy("chunked", *args, **kw)
        runtime_strategy("static", *args, **kw)  # rounds in a backward recompute every tile
        assert seen == [pytest.approx(45 / 64), 0.0]
        monkeypatch.undo()
        reset_kept_fractions()
        observe_kept_fraction(V, D, torch.float32, EPS32, 16, 64, skipped_tiles=12)  # 0.19 < 0.3: not computed
        assert runtime_strategy("chunked", *args, **kw) == "chunked"


def test_rounds_in_the_forward_drop_the_bounds_where_they_rule_out_little(forward_sparse):
    """After an observation that the bounds rule out little, the forward's rounds run without them
    (the same kept tiles and bitwise the same gradients); a probe brings them back."""
    from comera_compile.cce import observe_kept_fraction

    x, w, t = _peaked()
    with cce_tuning(probe_every=2):
        observe_kept_fraction(V, D, torch.float32, EPS32, 8, 64, skipped_tiles=0)
        without, stats = _train_step(x, w, t)
        assert [(s.phase, s.path, s.bounded) for s in stats] == [("forward", "triton", False),
                                                                 ("forward", "sparse", False)]
        assert stats[1].skipped_tiles == 0
        probe, stats_probe = _train_step(x, w, t)  # the 2nd call without them: a probe
        assert [(s.path, s.bounded) for s in stats_probe] == [("triton", False), ("sparse", True)]
        assert stats_probe[1].skipped_tiles > 0.5 * stats_probe[1].tiles
        assert stats_probe[1].kept_tiles == stats[1].kept_tiles
        _, stats_after = _train_step(x, w, t)  # the peaked head's bounds pay: kept on
        assert stats_after[1].bounded
    for a, b, name in zip(without, probe, ("loss", "dx", "dw")):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for got, ref, name in zip(without, _ref64(x, w, t), ("loss", "dx", "dw")):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5, name
