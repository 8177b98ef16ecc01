"""The contraction planner: networks, CoMERA's path, re-planning on token count and rank, symbolic
token counts without guards, plan time, and the FLOPs against torch.einsum's default path."""

from __future__ import annotations

import time

import pytest
import sympy
import torch

from comera_compile import planner
from comera_compile.planner import plan_tt_embedding, plan_tt_linear, size_hint, tt_network

COMERA_768 = ("tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1))
COMERA_3072 = ("tt", (12, 8, 8), (12, 16, 16), (1, 12, 30, 30, 30, 16, 1))
TTM_4096 = ("ttm", (8, 8, 8, 8), (8, 8, 8, 8), (1, 16, 16, 16, 1))


def test_network_is_a_graph_of_tensors_and_indices():
    g = tt_network(*COMERA_768, n_tokens=4096)
    assert set(g.nodes) == {"x", "y", "G1", "G2", "G3", "G4", "G5", "G6"}
    sizes = {k: d["size"] for _, _, k, d in g.edges(keys=True, data=True)}
    names = {d["name"]: d["size"] for _, _, d in g.edges(data=True)}
    assert names["tokens"] == 4096 and names["i1"] == 12 and names["o3"] == 12 and names["r3"] == 30
    assert len(sizes) == 1 + 6 + 5  # tokens, 6 modes, 5 internal bonds
    assert g.degree("G3") == 3 and g.degree("G1") == 2  # boundary ranks (size 1) are squeezed
    gm = tt_network(*TTM_4096, n_tokens=16)
    assert gm.degree("G2") == 4  # left rank, row mode, col mode, right rank


def test_comera_path_and_four_token_gemms_backward():
    plan = plan_tt_linear(*COMERA_768, 4096, fused=False)
    assert plan.strategy.startswith("split@3") and not plan.forms_dense_weight
    fwd = plan.steps_in("forward")
    assert [s.out for s in fwd] == ["T1-3", "y"]  # (X L) R
    assert fwd[0].equation.endswith("->nC")  # the token-sized intermediate is [tokens, r]
    bwd_token = [s for s in plan.steps_in("backward") if s.token_sized]
    assert len(bwd_token) == 4  # dY R^T, .L^T, T1^T dY, X^T U1
    assert all(not s.token_sized for s in plan.steps_in("merge", "merge_backward"))  # core grads token-free
    fused = plan_tt_linear(*COMERA_768, 4096)
    assert fused.fused == "xlr" and fused.launches < plan.launches
    text = fused.describe()
    assert "triton:tt_xlr_fwd" in text and "FLOP" in text and "alternatives" in text and "baselines" in text


def test_planner_switches_path_with_token_count():
    small = plan_tt_linear(*COMERA_768, 1)
    large = plan_tt_linear(*COMERA_768, 4096)
    assert small.strategy != large.strategy
    assert large.strategy.startswith("split@3")


def test_planner_switches_path_with_rank_and_replans():
    low = plan_tt_linear("tt", (4, 8), (8, 4), (1, 4, 2, 4, 1), 4096, fused=False)
    high = plan_tt_linear("tt", (4, 8), (8, 4), (1, 4, 32, 4, 1), 4096, fused=False)
    assert low.ranks != high.ranks
    assert low.strategy != high.strategy
    # the cache is keyed on the ranks: the same ranks give the very same plan object
    assert plan_tt_linear("tt", (4, 8), (8, 4), [1, 4, 32, 4, 1], 4096, fused=False) is high


def test_symbolic_token_count_uses_hint_without_guards():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x = mode.from_tensor(torch.empty(4096, 768), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    n = x.shape[0] * 8  # a SymInt expression
    assert isinstance(n, torch.SymInt)
    plan = plan_tt_linear(*COMERA_768, n)
    assert plan.n_tokens == 32768
    assert len(env.guards) == 0
    assert size_hint(sympy.Integer(77)) == 77
    assert size_hint(sympy.Symbol("s0"), fallback=123) == 123


def _plan_time(args):
    best = float("inf")
    for _ in range(3):
        planner.clear_plan_cache()
        t0 = time.perf_counter()
        plan_tt_linear(*args)
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("args", [COMERA_768 + (4096,), COMERA_3072 + (32768,), TTM_4096 + (8192,),
                                  ("tt", (4, 4, 4, 4), (4, 4, 4, 4), (1, 4, 16, 32, 32, 32, 16, 4, 1), 8192),
                                  ("ttm", (4,) * 6, (4,) * 6, (1,) + (16,) * 5 + (1,), 4096)],
                         ids=["comera768", "comera3072", "ttm4096", "tt8", "ttm6"])
def test_plan_time_under_15ms(args):
    assert _plan_time(args) <= 15e-3


def test_plans_are_cached():
    plan_tt_linear(*COMERA_768, 4096)
    t0 = time.perf_counter()
    for _ in range(100):
        plan_tt_linear(*COMERA_768, 4096)
    assert (time.perf_counter() - t0) / 100 < 1e-4


# 6-8-core chains, ranks >= 8, thousands of tokens: chosen path vs torch.einsum's default path
# (left to right over (x, G1, ..., Gd), forward + autograd backward; see planner's module doc)
HALF_CHAINS = [
    ("tt", (12, 8, 8), (8, 8, 12), (1, 12, 8, 8, 8, 12, 1)),
    ("tt", (16, 16, 12), (16, 16, 12), (1, 16, 8, 8, 8, 16, 1)),
    ("ttm", (4,) * 6, (4,) * 6, (1,) + (30,) * 5 + (1,)),
    ("ttm", (4,) * 6, (4,) * 6, (1,) + (64,) * 5 + (1,)),
    ("ttm", (4,) * 8, (2,) * 8, (1,) + (30,) * 7 + (1,)),
    ("ttm", (4,) * 8, (2,) * 8, (1,) + (64,) * 7 + (1,)),
]
# "tt" chains at ranks 16-30 (CoMERA's own layers among them): with x first, torch's left-to-right
# order is already close to the rank bottleneck (for 768x768 rank 30 it costs ~1.7x the two GEMMs
# X·L, T·R, which no non-dense path beats), so the best possible ratio is ~0.59; recomputing T1 in
# the backward (the op returns only y) makes ours 0.64-0.69. The 0.5 target is not met here.
SHORT_CHAINS = [COMERA_768, COMERA_3072, ("tt", (8, 8, 8, 8), (8, 8, 8, 8), (1, 8) + (16,) * 5 + (8, 1))]


@pytest.mark.parametrize("n", [4096, 32768])
@pytest.mark.parametrize("chain", HALF_CHAINS, ids=lambda c: f"{c[0]}{len(c[3]) - 1}-r{c[3][2]}")
def test_half_the_flops_of_einsum_default(chain, n):
    plan = plan_tt_linear(*chain, n)
    assert not plan.forms_dense_weight
    assert plan.flops <= 0.5 * plan.einsum_default_flops, plan.describe()


@pytest.mark.xfail(strict=True, reason="tt chains at ranks 16-30: no non-dense path costs under ~0.59x the "
                                       "left-to-right path (see SHORT_CHAINS comment); ours is 0.64-0.69x")
@pytest.mark.parametrize("chain", SHORT_CHAINS, ids=["comera768", "comera3072", "tt8-r16"])
def test_half_the_flops_of_einsum_default_comera_chains(chain):
    plan = plan_tt_linear(*chain, 4096)
    assert plan.flops <= 0.5 * plan.einsum_default_flops


def test_einsum_default_is_left_to_right():
    plan = plan_tt_linear(*COMERA_768, 4096)
    base = dict(plan.baselines)
    assert set(base) == {"torch.einsum left-to-right", "opt_einsum greedy",
                         "opt_einsum auto (torch.einsum with opt_einsum)"}
    assert plan.einsum_default_flops == base["torch.einsum left-to-right"]
    assert planner._left_to_right(4) == [(0, 1), (0, 2), (0, 1)]


def test_dense_weight_only_when_allowed():
    # a tiny rank-heavy layer where merging all cores is the cheapest
    args = ("ttm", (2, 2), (2, 2), (1, 64, 1), 4096)
    plan = plan_tt_linear(*args)
    assert not plan.forms_dense_weight
    dense = plan_tt_linear(*args, allow_dense=True)
    assert dense.forms_dense_weight and "FORMS DENSE WEIGHT" in dense.describe()


def test_embedding_plan():
    plan = plan_tt_embedding("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1), 8192)
    assert plan.split == 2 and plan.table_shapes == ((320, 16, 32), (100, 48, 32))
    assert plan_tt_embedding("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1), 8192) is plan
    assert plan.plan_time_s < 15e-3
    assert "A[320, 16, 32]" in plan.describe()


def test_summary_line_for_explain():
    line = plan_tt_linear(*COMERA_768, 4096).summary()
    assert line.startswith("split@3") and "FLOP" in line and "torch.einsum" in line and "\n" not in line
