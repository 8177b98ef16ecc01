"""comera::tt_embedding against an independent dense reference (float64 gradcheck of every core and
gate, TT-matrix and TT formats, 2 to 4+ cores, odd sizes, repeated indices), the Triton kernels under
the interpreter (fp32, with and without de-duplication), and torch.compile(backend="aot_eager")."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch

import comera_compile  # noqa: F401
from comera_compile.kernels.tt_embedding import tt_embedding, use_dedup
from comera_compile.kernels.tt_linear import use_impl
from comera_compile.planner import plan_tt_embedding

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
    idx.view(-1)[3] = rows - 1  # the last (padded-boundary) row
    return idx


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks)
    idx = _indices(rows, (2, 5))
    d = len(cores)
    leaves = [t.requires_grad_() for t in [*cores, *gates]]

    def fn(*p):
        return tt_embedding(idx, p[:d], p[d:], fmt, rm, cm, rows, cols)

    with use_impl("torch"):
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)
        y = fn(*leaves)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, leaves, dy)
    y_ref = ref.embedding_reference(idx, leaves[:d], leaves[d:], fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for gr, gref in zip(grads, torch.autograd.grad(y_ref, leaves, dy)):
        torch.testing.assert_close(gr, gref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dedup,program", [(True, False), (False, False), (True, True)],
                         ids=["dedup", "no-dedup", "dedup-program"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_triton_interpreter_matches_reference(case, dedup, program, monkeypatch):
    from comera_compile.kernels import tt_embedding as mod

    calls = []
    for name in ("_run_program", "_fwd_triton", "_bwd_triton"):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.float32, seed=2)
    idx = _indices(rows, (19,), seed=4)
    d = len(cores)
    leaves = [t.requires_grad_() for t in [*cores, *gates]]
    from comera_compile.kernels.tt_linear import use_program

    with use_impl("triton"), use_dedup(dedup), use_program(program):
        y = tt_embedding(idx, leaves[:d], leaves[d:], fmt, rm, cm, rows, cols)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, leaves, dy)
    assert set(calls) == {"_fwd_triton", "_bwd_triton"} | ({"_run_program"} if program else set()), calls
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = ref.embedding_reference(idx, l64[:d], l64[d:], fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    for gr, gref in zip(grads, torch.autograd.grad(y_ref, l64, dy.double())):
        torch.testing.assert_close(gr.double(), gref, rtol=1e-4, atol=1e-4)


def test_never_vocabulary_sized():
    """The gathered tables (and so their gradients) are far smaller than the vocabulary."""
    for fmt, rm, cm, ranks in [("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1)),
                               ("ttm", (40, 50, 50, 100), (4, 4, 2, 2), (1, 32, 32, 32, 1)),
                               ("tt", (16, 20, 10, 10), (4, 4, 8, 6), (1, 8, 8, 8, 8, 8, 8, 8, 1))]:
        plan = plan_tt_embedding(fmt, rm, cm, ranks, 8192)
        vocab = math.prod(rm)
        (il, ol, r), (ir, orr, _) = plan.table_shapes
        assert il * ir == vocab and ol * orr == math.prod(cm)
        assert il < vocab and ir < vocab
        assert il * ol * r + ir * orr * r < vocab * math.prod(cm) / 20
        assert "tables" in plan.describe()


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


def test_low_precision_cores():
    """bf16 cores: tables merged in fp32, rows and gradients returned in bf16."""
    fmt, rm, cm, ranks, rows, cols = CASES[2]
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.bfloat16, seed=3)
    d = len(cores)
    leaves = [t.requires_grad_() for t in [*cores, *gates]]
    idx = _indices(rows, (17,), seed=9)
    y = tt_embedding(idx, leaves[:d], leaves[d:], fmt, rm, cm, rows, cols)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = ref.embedding_reference(idx, l64[:d], l64[d:], fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=2e-2)
    for gr, gref in zip(grads, torch.autograd.grad(y_ref, l64, dy.double())):
        torch.testing.assert_close(gr.double(), gref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_scalar_and_empty_indices(impl):
    fmt, rm, cm, ranks, rows, cols = CASES[1]
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=torch.float32)
    d = len(cores)
    with use_impl(impl):
        y = tt_embedding(torch.tensor(rows - 1), cores, gates, fmt, rm, cm, rows, cols)
        torch.testing.assert_close(y.double(), ref.embedding_reference(
            torch.tensor(rows - 1), [c.double() for c in cores], [g.double() for g in gates], fmt, rm, cm, rows,
            cols), rtol=1e-5, atol=1e-5)
        assert tt_embedding(torch.zeros(0, 3, dtype=torch.long), cores, gates, fmt, rm, cm, rows, cols).shape == \
            (0, 3, cols)
    assert d == 3
