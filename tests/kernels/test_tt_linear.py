"""comera::tt_linear against an independent dense reference (float64 gradcheck, TT and TT-matrix,
2 to 8 cores, odd and padded sizes), the Triton kernels under the interpreter (fp32), and
torch.compile(backend="aot_eager") with static and dynamic shapes."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

import comera_compile  # noqa: F401
from comera_compile.kernels import tt_linear as tt_linear_mod
from comera_compile.kernels.tt_linear import tt_linear, use_impl
from comera_compile.planner import plan_tt_linear, token_bucket

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


def _inputs(case, dtype, lead=(2, 3), bias=True, seed=0):
    fmt, rm, cm, ranks, rows, cols = case
    cores, gates = ref.make_cores(fmt, rm, cm, ranks, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, rows, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(cols, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return x, cores, gates, b


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gradcheck_float64(case):
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float64, lead=(3,))
    d = len(cores)
    leaves = [t.requires_grad_() for t in [x, *cores, *gates, b]]

    def fn(x, *rest):
        return tt_linear(x, rest[:d], rest[d:2 * d - 1], rest[-1], fmt, rm, cm, rows, cols)

    with use_impl("torch"):
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)
        y = fn(*leaves)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, leaves, dy)
    # against the dense reference: output and every gradient (x, each core, each gate, bias)
    y_ref = ref.linear_reference(*leaves[:1], leaves[1:1 + d], leaves[1 + d:-1], leaves[-1], fmt, rm, cm, rows, cols)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    for gr, gref in zip(grads, grads_ref):
        torch.testing.assert_close(gr, gref, rtol=1e-9, atol=1e-9)


def _count_calls(monkeypatch, name):
    calls = []
    orig = getattr(tt_linear_mod, name)

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(tt_linear_mod, name, spy)
    return calls


@pytest.mark.parametrize("program", [False, True], ids=["torch-merges", "program-merges"])
@pytest.mark.parametrize("case,n", [(CASES[3], 37), (CASES[2], 70), (CASES[4], 5), (CASES[6], 19)],
                         ids=["tt6-37tok", "tt4-70tok", "tt8-5tok", "ttm3-19tok"])
def test_triton_interpreter_matches_reference(case, n, program, monkeypatch):
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float32, lead=(n,), seed=3)
    d = len(cores)
    leaves = [t.requires_grad_() for t in [x, *cores, *gates, b]]
    fwd_calls = _count_calls(monkeypatch, "xlr_forward")
    bwd_calls = _count_calls(monkeypatch, "xlr_backward")
    program_calls = _count_calls(monkeypatch, "_run_program")
    with use_impl("triton"), tt_linear_mod.use_program(program):
        y = tt_linear(x, cores, gates, b, fmt, rm, cm, rows, cols)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, leaves, dy)
    plan = plan_tt_linear(fmt, rm, cm, ranks, token_bucket(n), 4)
    if plan.fused:
        assert fwd_calls and bwd_calls, "the fused Triton chain did not run"
        assert len(program_calls) == (3 if program else 0), "program launches: fwd, bwd recompute, bwd"
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = ref.linear_reference(l64[0], l64[1:1 + d], l64[1 + d:-1], l64[-1], fmt, rm, cm, rows, cols)
    grads_ref = torch.autograd.grad(y_ref, l64, dy.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    for gr, gref in zip(grads, grads_ref):
        torch.testing.assert_close(gr.double(), gref, rtol=1e-4, atol=1e-4)


def test_fused_kernels_direct_odd_sizes():
    """The two Triton kernels alone, with non-block-multiple tokens, widths and rank."""
    torch.manual_seed(0)
    for n, i, o, r in [(37, 23, 70, 5), (130, 65, 17, 19), (1, 3, 2, 1)]:
        x = torch.randn(n, i)
        L, R, b = torch.randn(i, r), torch.randn(o, r), torch.randn(o)
        dy = torch.randn(n, o)
        y = tt_linear_mod.xlr_forward(x, L, R, b)
        torch.testing.assert_close(y, (x @ L) @ R.T + b, rtol=1e-4, atol=1e-4)
        dx, t, u = tt_linear_mod.xlr_backward(x, dy, L, R)
        torch.testing.assert_close(t, x @ L, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(u, dy @ R, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dx, (dy @ R) @ L.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_aot_eager(dynamic):
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float32, lead=(4, 5), seed=5)
    d = len(cores)

    def f(x, cores, gates, b):
        return torch.nn.functional.gelu(tt_linear(x, cores, gates, b, fmt, rm, cm, rows, cols)).sum()

    compiled = torch.compile(f, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_() for t in [x, *cores, *gates, b]]
        loss = fn(leaves[0], leaves[1:1 + d], leaves[1 + d:-1], leaves[-1])
        results.append((loss, torch.autograd.grad(loss, leaves)))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, c in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, c)
    if dynamic:  # a second token count reuses the dynamic graph and stays correct
        x2 = torch.randn(7, rows)
        leaves = [t.clone().requires_grad_() for t in [x2, *cores, *gates, b]]
        out = compiled(leaves[0], leaves[1:1 + d], leaves[1 + d:-1], leaves[-1])
        torch.testing.assert_close(out, f(x2, cores, gates, b))


def test_opcheck():
    case = CASES[2]
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float64, lead=(4,))
    args = ([x.requires_grad_(), [c.requires_grad_() for c in cores], [g.requires_grad_() for g in gates],
             b.requires_grad_(), fmt, list(rm), list(cm), rows, cols])
    torch.library.opcheck(torch.ops.comera.tt_linear.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_bad_metadata_names_the_op():
    fmt, rm, cm, ranks, rows, cols = CASES[2]
    x, cores, gates, b = _inputs(CASES[2], torch.float64)
    with pytest.raises(ValueError, match="comera::tt_linear"):
        tt_linear(x, cores[:-1], gates, b, fmt, rm, cm, rows, cols)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_low_precision_cores(impl):
    """bf16 cores and gates with fp32 activations: merged in fp32, gradients returned in bf16."""
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float32, lead=(9,), seed=11)
    cores = [c.to(torch.bfloat16).requires_grad_() for c in cores]
    gates = [g.to(torch.bfloat16).requires_grad_() for g in gates]
    x.requires_grad_()
    d = len(cores)
    with use_impl(impl):
        y = tt_linear(x, cores, gates, None, fmt, rm, cm, rows, cols)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, [x] + cores + gates, dy)
    assert y.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads[1:])
    l64 = [t.detach().double().requires_grad_() for t in [x] + cores + gates]
    y_ref = ref.linear_reference(l64[0], l64[1:1 + d], l64[1 + d:], None, fmt, rm, cm, rows, cols)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
    for gr, gref in zip(grads, torch.autograd.grad(y_ref, l64, dy.double())):
        torch.testing.assert_close(gr.double(), gref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_zero_tokens(impl):
    case = CASES[3]
    fmt, rm, cm, ranks, rows, cols = case
    x, cores, gates, b = _inputs(case, torch.float32, lead=(0,))
    leaves = [t.requires_grad_() for t in [x, *cores, *gates, b]]
    d = len(cores)
    with use_impl(impl):
        y = tt_linear(leaves[0], leaves[1:1 + d], leaves[1 + d:-1], leaves[-1], fmt, rm, cm, rows, cols)
        grads = torch.autograd.grad(y.sum(), leaves)
    assert y.shape == (0, cols)
    assert all(float(g.abs().sum()) == 0.0 for g in grads)
