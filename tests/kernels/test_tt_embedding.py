"""tt_embedding and the executor's lookup against an independent dense reference (float64 gradcheck
of every core and gate at every table split and the dense path, TT-matrix and TT formats, 2 to 5
cores, odd sizes, repeated indices), nn.Embedding's errors for bad indices, padding_idx, and
torch.compile(backend="aot_eager")."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

import comera_compile  # noqa: F401
from comera_compile.kernels import tt_runtime
from comera_compile.kernels.tt_embedding import tt_embedding
from comera_compile.tt import TTSpec, planner

_spec = importlib.util.spec_from_file_location("_tt_reference", pathlib.Path(__file__).with_name("tt_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

# fmt, row_modes, col_modes, ranks, rows (vocabulary), cols (embedding dim)
CASES = [
    ("ttm", (5, 7), (3, 5), (1, 6, 1), 33, 14),  # 2 cores, padded
    ("ttm", (3, 4, 5), (2, 3, 2), (1, 3, 4, 1), 55, 11),  # 3 cores
    ("ttm", (2, 3, 2, 3), (2, 2, 3, 2), (1, 3, 2, 3, 1), 31, 23),  # 4 cores
    ("tt", (3, 4, 5), (2, 3), (1, 2, 3, 4, 2, 1), 60, 5),  # 5 cores
    ("tt", (4, 5), (3,), (1, 3, 2, 1), 17, 3),  # 3 cores
]


def _ids(c):
    return f"{c[0]}-{len(c[3]) - 1}cores-{c[4]}x{c[5]}"


def _indices(rows, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, shape, generator=g)
    idx.view(-1)[:3] = idx.view(-1)[-1]  # repeated rows
    idx.view(-1)[3] = rows - 1  # the last row before the padding
    return idx


def _flats(cores, gates):
    """One layer's cores and gates in flat storage, as comera::tt_materialize takes them."""
    return [torch.cat([c.reshape(-1) for c in cores])], [torch.cat([g.reshape(-1) for g in gates])]


def _lookup(case, split, idx, cores, gates, padding_idx=None):
    fmt, rm, cm, ranks, rows, cols = case
    cut = planner.cut_at(TTSpec(fmt, rm, cm, ranks, rows, cols), split)
    A, B = tt_runtime.group_outputs(*_flats(cores, gates), TTSpec(fmt, rm, cm, ranks, rows, cols),
                                    cut, "tables", cores[0].dtype)
    return tt_runtime.lookup(idx, A, B, rows, cols, padding_idx)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tables_at_every_split_gradcheck_float64(case):
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks)
    d = len(cores)
    idx = _indices(rows, (2, 5))
    leaves = [t.requires_grad_() for t in [*cores, *gates]]
    expect = ref.embedding_reference(idx, cores, gates, fmt, rm, cm, rows, cols)
    for split in range(1, d):
        (il, ol, r), (ir, orr, _) = planner.table_shapes(fmt, rm, cm, ranks, split)
        assert il * ir == math.prod(rm) and ol * orr == math.prod(cm)
        torch.testing.assert_close(_lookup(case, split, idx, cores, gates), expect)

        def fn(*leaves):
            return _lookup(case, split, idx, list(leaves[:d]), list(leaves[d:]))

        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True), split


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tt_embedding_matches_reference(case):
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks)
    leaves = [t.requires_grad_() for t in [*cores, *gates]]
    idx = _indices(rows, (3, 4), seed=2)
    y = tt_embedding(idx, cores, gates, fmt, rm, cm, rows, cols)
    y_ref = ref.embedding_reference(idx, cores, gates, fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("bad", [-1, 55, 57, 10_000], ids=["negative", "first-padding-row", "last-padding-row",
                                                           "past-padding"])
def test_out_of_range_indices_raise_like_nn_embedding(bad):
    case = CASES[1]  # 55 rows padded to 60
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.float32)
    idx = torch.tensor([[1, 2], [bad, 3]])
    with pytest.raises(IndexError):
        F.embedding(idx, torch.zeros(rows, cols))  # what eager does
    with pytest.raises(IndexError, match="index out of range"):
        _lookup(case, 1, idx, cores, gates)
    with pytest.raises(IndexError, match="index out of range"):
        tt_embedding(idx, cores, gates, fmt, rm, cm, rows, cols)


def test_padding_idx_passes_no_gradient():
    case = CASES[2]
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks)
    leaves = [t.requires_grad_() for t in [*cores, *gates]]
    d = len(cores)
    idx = _indices(rows, (4, 6), seed=5)
    idx[0, :2] = 7
    y = _lookup(case, 2, idx, leaves[:d], leaves[d:], padding_idx=7 - rows)  # negative form, as F.embedding takes
    w = ref.dense_matrix(leaves[:d], leaves[d:], fmt, rm, cm)[:rows, :cols]
    y_ref = F.embedding(idx, w, padding_idx=7)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    for g, g_ref in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)):
        torch.testing.assert_close(g, g_ref)


def test_tables_are_far_smaller_than_the_dense_table():
    for fmt, rm, cm, ranks in [("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1)),
                               ("tt", (16, 20, 10, 10), (4, 4, 8, 6), (1, 8, 8, 8, 8, 8, 8, 8, 1))]:
        plan = planner.plan_tt_embedding(fmt, rm, cm, ranks, 8192)
        assert plan.strategy == "tables"
        vocab = math.prod(rm)
        (il, ol, r), (ir, orr, _) = plan.table_shapes
        assert il * ol * r + ir * orr * r < vocab * math.prod(cm) / 4  # far below the dense table


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_aot_eager(dynamic):
    fmt, rm, cm, ranks, rows, cols = CASES[1]
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.float32, seed=7)
    d = len(cores)

    def f(idx, cores, gates):
        return tt_embedding(idx, cores, gates, fmt, rm, cm, rows, cols).square().sum()

    compiled = torch.compile(f, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    for n in (9, 13):
        idx = _indices(rows, (n,), seed=n)
        results = []
        for fn in (f, compiled):
            leaves = [t.clone().requires_grad_() for t in [*cores, *gates]]
            loss = fn(idx, leaves[:d], leaves[d:])
            results.append((loss, torch.autograd.grad(loss, leaves)))
        torch.testing.assert_close(results[0][0], results[1][0])
        for a, c in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(a, c)


def test_opcheck():
    fmt, rm, cm, ranks, rows, cols = CASES[1]
    cores, gates = ref.make_cores(fmt, rm, cm, ranks)
    args = [_indices(rows, (6,)), [c.requires_grad_() for c in cores], [g.requires_grad_() for g in gates], fmt,
            list(rm), list(cm), rows, cols]
    torch.library.opcheck(torch.ops.comera.tt_embedding.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.comera.tt_index_split.default, [_indices(rows, (6,)), rows, 5],
                          test_utils=("test_schema", "test_faketensor"))


def test_low_precision_scalar_and_empty_indices():
    case = CASES[2]
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.bfloat16, seed=3)
    idx = _indices(rows, (17,), seed=9)
    y = tt_embedding(idx, cores, gates, fmt, rm, cm, rows, cols)
    assert y.dtype == torch.bfloat16
    y_ref = ref.embedding_reference(idx, [c.double() for c in cores], [g.double() for g in gates], fmt, rm, cm,
                                    rows, cols)
    torch.testing.assert_close(y.double(), y_ref, rtol=3e-2, atol=3e-2)
    c32, g32 = [c.float() for c in cores], [g.float() for g in gates]
    one = tt_embedding(torch.tensor(rows - 1), c32, g32, fmt, rm, cm, rows, cols)
    assert one.shape == (cols,)
    torch.testing.assert_close(one.double(), ref.embedding_reference(
        torch.tensor(rows - 1), [c.double() for c in c32], [g.double() for g in g32], fmt, rm, cm, rows, cols),
        rtol=1e-5, atol=1e-5)
    assert tt_embedding(torch.zeros(0, 3, dtype=torch.long), c32, g32, fmt, rm, cm, rows, cols).shape == (0, 3, cols)
