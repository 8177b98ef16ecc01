"""tt_linear and the shared TT executor against an independent dense reference: float64 gradcheck of
every strategy (factored, dense, and their x @ Mᵀ forms) for TT and TT-matrix, 2 to 8 cores, odd and
padded sizes; the planner-chosen path; torch.compile with static and dynamic shapes; bad metadata."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

import comera_compile  # noqa: F401
from comera_compile.kernels import tt_runtime
from comera_compile.kernels.tt_linear import tt_linear
from comera_compile.tt import TTSpec, planner

_spec = importlib.util.spec_from_file_location("_tt_reference", pathlib.Path(__file__).with_name("tt_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

# fmt, row_modes, col_modes, ranks, rows, cols (rows/cols below the padded size where odd)
CASES = [
    ("tt", (5,), (3,), (1, 2, 1), 5, 3),  # 2 cores
    ("tt", (3, 4), (5,), (1, 2, 3, 1), 11, 5),  # 3 cores, padded rows
    ("tt", (3, 4), (5, 2), (1, 3, 4, 2, 1), 11, 9),  # 4 cores, padded rows and cols
    ("tt", (2, 3, 2), (3, 2, 2), (1, 2, 3, 4, 3, 2, 1), 10, 11),  # 6 cores, CoMERA layout
    ("tt", (2, 2, 2, 2), (2, 2, 2, 2), (1, 2, 2, 3, 2, 3, 2, 2, 1), 15, 16),  # 8 cores
    ("ttm", (3, 5), (2, 3), (1, 3, 1), 13, 6),  # 2 cores
    ("ttm", (3, 4, 2), (2, 3, 3), (1, 2, 3, 1), 23, 17),  # 3 cores, padded
    ("ttm", (2, 3, 2, 2), (2, 2, 3, 2), (1, 3, 2, 3, 1), 24, 19),  # 4 cores
    ("ttm", (2, 3, 2, 2, 2), (2, 2, 2, 3, 2), (1, 2, 3, 2, 2, 1), 45, 40),  # 5 cores
]


def _ids(c):
    return f"{c[0]}-{len(c[3]) - 1}cores-{c[4]}x{c[5]}"


def _inputs(case, dtype, lead=(2, 3), bias=True, seed=0, features=None):
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, features or rows, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return x, cores, gates, b


def _strategies(fmt, rm, cm, ranks):
    """(name, output, split): every token-sized path the executor has for this layer."""
    d = len(ranks) - 1
    out = [("dense", "dense_t", s) for s in range(1, d)]
    if fmt == "tt":
        out.append(("factored", "factors", len(rm)))
    return out


def _flats(cores_per_layer, gates_per_layer):
    """Each layer's cores and gates in flat storage, as comera::tt_materialize takes them."""
    return ([torch.cat([c.reshape(-1) for c in cores]) for cores in cores_per_layer],
            [torch.cat([g.reshape(-1) for g in gates]) for gates in gates_per_layer])


def _apply(strategy, output, split, x, cores, gates, b, case, transposed=False):
    """y = x @ M (+ b), or x @ Mᵀ when ``transposed``, through ``group_outputs`` with a forced strategy."""
    fmt, rm, cm, ranks, rows, cols = case
    cut = planner.cut_at(TTSpec(fmt, rm, cm, ranks, rows, cols), split)
    if transposed:
        output = {"factors": "factors_t", "dense_t": "dense"}[output]
    parts = tt_runtime.group_outputs(*_flats([cores], [gates]), TTSpec(fmt, rm, cm, ranks, rows, cols),
                                     cut, output, x.dtype)
    if strategy == "factored":
        return F.linear(tt_runtime.project(x, parts[0], x.dtype), parts[1], b)
    return F.linear(x, parts[0], b)


@pytest.mark.parametrize("transposed", [False, True], ids=["xM", "xMt"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_strategy_gradcheck_float64(case, transposed):
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, _ = _inputs(case, torch.float64, lead=(3,), features=cols if transposed else rows)
    b = torch.randn(rows if transposed else cols, dtype=torch.float64)
    d = len(cores)
    leaves = [t.requires_grad_() for t in [x, *cores, *gates, b]]
    for strategy, output, split in _strategies(fmt, rm, cm, ranks):
        def fn(x, *rest):
            return _apply(strategy, output, split, x, list(rest[:d]), list(rest[d:2 * d - 1]), rest[-1], case,
                          transposed)

        y = fn(*leaves)
        w = ref.dense_matrix(cores, gates, fmt, rm, cm)[:rows, :cols]
        expect = F.linear(x, w, b) if transposed else F.linear(x, w.T, b)
        torch.testing.assert_close(y, expect, msg=lambda m: f"{strategy}@{split}: {m}")
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True), (strategy, split)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tt_linear_matches_reference(case):
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float64)
    d = len(cores)
    leaves = [t.requires_grad_() for t in [x, *cores, *gates, b]]
    y = tt_linear(x, cores, gates, b, fmt, rm, cm, rows, cols)
    y_ref = ref.linear_reference(x, cores, gates, b, fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        torch.testing.assert_close(g, g_ref)
    assert d == len(ranks) - 1


def test_batched_group_equals_layer_by_layer():
    """K layers merged in one batched call give each layer's own result (values and gradients)."""
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    layers = [ref.make_cores(fmt, rm, cm, ranks, seed=s) for s in range(3)]
    leaves = [[t.clone().requires_grad_() for t in c + g] for c, g in layers]
    d = len(layers[0][0])
    split = len(rm)
    cut = planner.cut_at(TTSpec(fmt, rm, cm, ranks, rows, cols), split)
    spec = TTSpec(fmt, rm, cm, ranks, rows, cols)
    for output in ("factors", "factors_t", "dense", "dense_t", "tables"):
        batched = tt_runtime.group_outputs(*_flats([lv[:d] for lv in leaves], [lv[d:] for lv in leaves]), spec, cut,
                                           output, torch.float64)
        per = len(batched) // 3
        weights = [torch.randn_like(t) for t in batched]
        grads = torch.autograd.grad(sum((t * w).sum() for t, w in zip(batched, weights)), [t for lv in leaves for t in lv])
        for k, lv in enumerate(leaves):
            one = tt_runtime.group_outputs(*_flats([lv[:d]], [lv[d:]]), spec, cut, output, torch.float64)
            for a, b in zip(one, batched[k * per:(k + 1) * per]):
                torch.testing.assert_close(a, b)
            g_one = torch.autograd.grad(sum((t * w).sum() for t, w in zip(one, weights[k * per:(k + 1) * per])), lv)
            for a, b in zip(g_one, grads[k * len(lv):(k + 1) * len(lv)]):
                torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_aot_eager(dynamic):
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    _, cores, gates, b = _inputs(case, torch.float32, seed=7)
    d = len(cores)

    def f(x, cores, gates, b):
        return tt_linear(x, cores, gates, b, fmt, rm, cm, rows, cols).square().sum()

    compiled = torch.compile(f, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    for n in (5, 9):
        x = torch.randn(n, rows)
        results = []
        for fn in (f, compiled):
            leaves = [t.clone().requires_grad_() for t in [x, *cores, *gates, b]]
            loss = fn(leaves[0], leaves[1:1 + d], leaves[1 + d:-1], leaves[-1])
            results.append((loss, torch.autograd.grad(loss, leaves)))
        torch.testing.assert_close(results[0][0], results[1][0])
        for a, c in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(a, c)


def test_bad_metadata_names_the_function():
    fmt, rm, cm, ranks, rows, cols = CASES[1]
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.float32)
    with pytest.raises(ValueError, match="comera::tt_linear: .tt. with row_modes"):
        tt_linear(torch.randn(2, rows), cores[:2], gates[:1], None, fmt, rm, cm, rows, cols)
    with pytest.raises(ValueError, match="fmt must be 'tt', 'ttm' or 'btt'"):
        tt_linear(torch.randn(2, rows), cores, gates, None, "cp", rm, cm, rows, cols)
    with pytest.raises(ValueError, match="exceed the padded shape"):
        tt_linear(torch.randn(2, 99), cores, gates, None, fmt, rm, cm, 99, cols)
    with pytest.raises(ValueError, match="x has 7 features"):
        tt_linear(torch.randn(2, 7), cores, gates, None, fmt, rm, cm, rows, cols)


def test_low_precision_and_zero_tokens():
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.bfloat16, seed=3)
    y = tt_linear(x, cores, gates, b, fmt, rm, cm, rows, cols)
    assert y.dtype == torch.bfloat16
    y_ref = ref.linear_reference(x.double(), [c.double() for c in cores], [g.double() for g in gates], b.double(),
                                 fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y.double(), y_ref, rtol=3e-2, atol=3e-2)
    empty = torch.zeros(0, rows)
    c32 = [c.float().requires_grad_() for c in cores]
    y0 = tt_linear(empty, c32, [g.float() for g in gates], None, fmt, rm, cm, rows, cols)
    assert y0.shape == (0, cols)
    y0.sum().backward()
    assert all(c.grad is not None and not c.grad.abs().sum() for c in c32)
