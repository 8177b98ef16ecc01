"""The contraction planner: the network, the strategies it chooses and why (factored through the rank
bottleneck, dense for TT-matrices and small token counts, gathered tables for embeddings), merge orders,
symbolic token counts without guards, plan time, and the FLOPs against torch.einsum's default path."""

from __future__ import annotations


import math

import pytest
import sympy
import torch

from comera_compile.tt import TTSpec, planner
from comera_compile.tt.planner import cut_at, plan_tt_embedding, plan_tt_linear, size_hint, tt_network

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


def test_comera_path_four_token_gemms_backward():
    plan = plan_tt_linear(*COMERA_768, 4096)
    assert plan.strategy == "factored" and not plan.forms_dense_weight and plan.split == 3
    assert [s.label for s in plan.steps_in("forward")] == ["T = X·L", "Y = T·R"]
    assert len(plan.steps_in("backward")) == 4  # dY Rᵀ, ·Lᵀ, Xᵀ dT, Tᵀ dY
    assert all(s.m != 4096 and s.n != 4096 and s.k != 4096 for s in plan.steps_in("merge", "merge_backward"))
    text = plan.describe()
    assert "halves" in text and "candidates" in text and "us" in text and "torch.einsum" in text


def test_ttm_is_dense_and_tables_for_embeddings():
    plan = plan_tt_linear(*TTM_4096, 8192)
    assert plan.strategy == "dense" and plan.forms_dense_weight
    # a TT-matrix has no low-rank bottleneck: its other candidate contracts the tokens through the cores
    assert [n for n, _ in plan.candidates] == ["dense", "contract"]
    emb = plan_tt_embedding("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1), 8192)
    assert emb.strategy == "tables" and emb.split == 2 and emb.table_shapes == ((320, 16, 32), (100, 48, 32))
    assert "tables" in emb.describe()


def test_strategy_follows_the_costs():
    """The cheapest candidate wins. CoMERA's 768x768 rank 30: the bottleneck at 1 and 4096 tokens (at one
    token both paths are launch-bound and the dense weight's extra traffic decides; at 4096 six skinny
    GEMMs beat three 768-wide ones); at 32768 tokens the two are within a few percent at the measured H200
    rates (cuBLAS's skinny GEMMs reach ~1.5 TB/s), and the estimate decides. A rank as large as the
    layer: the dense weight at any token count."""
    for n in (1, 4096, 32768):
        plan = plan_tt_linear(*COMERA_768, n)
        assert plan.est_s == min(t for _, t in plan.candidates)
        if n < 32768:
            assert plan.strategy == "factored"
        else:
            factored, dense = dict(plan.candidates)["factored"], dict(plan.candidates)["dense"]
            assert abs(factored - dense) < 0.1 * dense
    wide = plan_tt_linear("tt", (4, 8), (8, 4), (1, 4, 32, 4, 1), 4096)
    assert wide.strategy == "dense"
    # the cache is keyed on the ranks: the same ranks give the very same plan object
    assert plan_tt_linear("tt", (4, 8), (8, 4), [1, 4, 32, 4, 1], 4096) is wide
    assert plan_tt_linear(*COMERA_768, 32768, cudagraphs=True).cudagraphs


def test_brackets_merge_consecutive_runs_cheapest_first():
    def runs(b):
        if isinstance(b, int):
            return [b]
        left, right = runs(b[0]), runs(b[1])
        assert left[-1] + 1 == right[0]  # (left run, right run) in chain order
        return left + right

    def spec(fmt, rm, cm, ranks):
        return TTSpec(fmt, rm, cm, ranks, math.prod(rm), math.prod(cm))

    for args in (COMERA_768, COMERA_3072, TTM_4096):
        d = len(args[3]) - 1
        for split in range(1, d):
            cut = cut_at(spec(*args), split)
            assert runs(cut.left) == list(range(0, split)) and runs(cut.right) == list(range(split, d))
    # CoMERA's L = G1·G2·G3: left to right is cheaper than right to left at these ranks
    assert cut_at(spec(*COMERA_768), 3).left == ((0, 1), 2)


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


def test_plans_are_cached():
    """The second call returns the cached plan (planning time is measured in benchmarks/bench_planner.py)."""
    planner.clear_plan_cache()
    first = plan_tt_linear(*COMERA_768, 4096)
    assert plan_tt_linear(*COMERA_768, 4096) is first
    planner.clear_plan_cache()
    assert plan_tt_linear(*COMERA_768, 4096) is not first


@pytest.mark.parametrize("args,ratio", [(COMERA_768, 0.6), (COMERA_3072, 0.7), (TTM_4096, 1.0)],
                         ids=["comera768", "comera3072", "ttm4096"])
def test_fewer_flops_than_einsum_default(args, ratio):
    """torch.einsum(x, G1, ..., Gd) contracts left to right; the planned path (batched merges + the rank
    bottleneck) needs a fraction of its FLOPs; a TT-matrix's dense weight needs no more than it (but at GEMM
    efficiency, with no token-sized intermediates r times larger than the activations)."""
    plan = plan_tt_linear(*args, 8192)
    assert plan.flops <= ratio * plan.einsum_flops, plan.describe()
    assert "torch.einsum's FLOPs" in plan.summary() and "\n" not in plan.summary()


def test_bad_arguments():
    with pytest.raises(ValueError, match="'tt', 'ttm' or 'btt'"):
        plan_tt_linear("cp", (4,), (4,), (1, 2, 1), 8)
    with pytest.raises(ValueError, match="ranks must have"):
        plan_tt_linear("tt", (4,), (4,), (1, 2, 2, 1), 8)
    with pytest.raises(ValueError, match="at least two cores"):
        plan_tt_linear("ttm", (4,), (4,), (1, 1), 8)
