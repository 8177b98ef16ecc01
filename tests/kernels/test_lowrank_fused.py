"""``comera::lowrank_linear`` (kernels/lowrank_fused.py), ``act(x @ L) @ R + bias``: the fused Triton
kernels (under the interpreter, forced with COMERA_FORCE_TRITON=1) and the torch reference, forward and
every gradient (x, L, R, bias) against an independent float64 reference built from torch.nn.functional;
ranks below and above the 16 padding, d not a block multiple, leading batch dims, strided inputs;
opcheck, torch.compile (aot_eager, inductor), the dispatch and fallback, and the bad-input errors.
The GPU (bf16, a realistic shape) is in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comera_compile.kernels import lowrank_fused as mod
from comera_compile.kernels.dispatch import interpreting
from comera_compile.kernels.lowrank_fused import ACTIVATIONS, lowrank_linear

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="the kernels run here under TRITON_INTERPRET=1 (GPU: tests/test_gpu.py)")

T, D_IN, D_OUT = 37, 48, 40  # none a block multiple under the interpreter's (16, 32, 16) blocks
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
REFERENCE_ACT = {"identity": lambda h: h, "relu": F.relu, "gelu": F.gelu,
                 "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"), "silu": F.silu}


@pytest.fixture
def kernels(monkeypatch):
    """The Triton kernels under impl='auto' on CPU tensors (the interpreter), and proof that they ran:
    the torch reference raises if anything reaches it."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    monkeypatch.setattr(mod, "_BROKEN", [])

    def no_reference(*args):
        raise AssertionError("the torch reference ran instead of the kernel")

    monkeypatch.setattr(mod, "_forward_torch", no_reference)
    monkeypatch.setattr(mod, "_backward_torch", no_reference)


def _inputs(t=T, d_in=D_IN, d_out=D_OUT, r=5, bias=True, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, t, d_in, generator=g, dtype=torch.float64)
    L = torch.randn(d_in, r, generator=g, dtype=torch.float64) / d_in**0.5
    R = torch.randn(r, d_out, generator=g, dtype=torch.float64) / r**0.5
    b = torch.randn(d_out, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(*lead, t, d_out, generator=g, dtype=torch.float64)
    return x, L, R, b, dy


def _reference(x, L, R, b, dy, activation):
    """float64 forward and gradients through F.linear and the F activation (autograd's own backward)."""
    leaves = [a.detach().double().requires_grad_() for a in (x, L, R) + ((b,) if b is not None else ())]
    h = F.linear(leaves[0], leaves[1].t())
    y = F.linear(REFERENCE_ACT[activation](h), leaves[2].t(), leaves[3] if b is not None else None)
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def _close(got, want, tol, name):
    """Elementwise within tol, relative to the tensor's scale."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max().clamp_min(1.0)),
                               msg=lambda m: f"{name}: {m}")


def _check(x, L, R, b, dy, activation, dtype, impl="auto", tol=None):
    tol = TOL[dtype] if tol is None else tol
    want, want_grads = _reference(x, L, R, b, dy, activation)
    leaves = [a.detach().to(dtype).requires_grad_() for a in (x, L, R) + ((b,) if b is not None else ())]
    got = lowrank_linear(*leaves[:3], leaves[3] if b is not None else None, activation, impl=impl)
    assert got.dtype == dtype
    _close(got, want, tol, "y")
    grads = torch.autograd.grad(got, leaves, dy.to(dtype))
    for name, g, w in zip(["dx", "dL", "dR", "dbias"], grads, want_grads):
        assert g.dtype == dtype, name
        _close(g, w, tol, name)


# ---------------------------------------------------------------------------------------------- the kernels


@needs_interpreter
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("r", [5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_kernels_match_the_float64_reference(kernels, dtype, r, bias, activation):
    x, L, R, b, dy = _inputs(r=r, bias=bias)
    _check(x, L, R, b, dy, activation, dtype)


@needs_interpreter
@pytest.mark.parametrize("t, d_in, d_out, r, lead", [
    (37, 64, 32, 5, ()),         # d_in, d_out block multiples: the unmasked (EVEN_K, EVEN_N) loops
    (5, 48, 40, 1, ()),          # rank 1, fewer tokens than a block
    (21, 40, 24, 33, ()),        # rank padded to 64
    (9, 24, 20, 128, ()),        # the largest rank
    (7, 48, 40, 6, (2, 3)),      # leading batch dims
    (1, 17, 3, 4, ()),           # one token, tiny d
])
def test_kernels_at_edge_shapes(kernels, t, d_in, d_out, r, lead):
    x, L, R, b, dy = _inputs(t, d_in, d_out, r, lead=lead, seed=1)
    _check(x, L, R, b, dy, "gelu", torch.float32)


@needs_interpreter
def test_kernels_take_strided_inputs(kernels):
    """x a column slice, L and R transposed views, dy an expanded (stride 0) gradient: no copies needed."""
    x, L, R, b, _ = _inputs(r=6, seed=2)
    base = torch.zeros(T, 2 * D_IN)
    base[:, ::2] = x.float()
    leaves = [base[:, ::2].detach().requires_grad_(), L.float().t().contiguous().t().detach().requires_grad_(),
              R.float().t().contiguous().t().detach().requires_grad_(), b.float().requires_grad_()]
    assert leaves[0].stride() == (2 * D_IN, 2) and leaves[1].stride() == (1, D_IN) and leaves[2].stride() == (1, 6)
    dy = torch.randn(1, D_OUT, dtype=torch.float64).expand(T, D_OUT)
    want, want_grads = _reference(x, L, R, b, dy, "silu")
    got = lowrank_linear(*leaves, "silu")
    _close(got, want, 2e-5, "y")
    for name, g, w in zip(["dx", "dL", "dR", "dbias"], torch.autograd.grad(got, leaves, dy.float()), want_grads):
        _close(g, w, 2e-5, name)


@needs_interpreter
@pytest.mark.parametrize("needs", [(False, True, True, True), (True, False, False, False), (False, False, True, False),
                                   (False, False, False, True)], ids=["no-dx", "dx-only", "dR-only", "db-only"])
def test_kernels_form_only_the_gradients_asked_for(kernels, needs):
    x, L, R, b, dy = _inputs(r=5, seed=3)
    want, want_grads = _reference(x, L, R, b, dy, "relu")
    leaves = [a.float().requires_grad_(n) for a, n in zip((x, L, R, b), needs)]
    got = lowrank_linear(*leaves, "relu")
    _close(got, want, 2e-5, "y")
    asked = [a for a, n in zip(leaves, needs) if n]
    for g, w in zip(torch.autograd.grad(got, asked, dy.float()), [w for w, n in zip(want_grads, needs) if n]):
        _close(g, w, 2e-5, "grad")


@needs_interpreter
def test_no_tokens(kernels):
    x, L, R, b, dy = _inputs(t=0)
    leaves = [a.float().requires_grad_() for a in (x, L, R, b)]
    y = lowrank_linear(*leaves, "gelu")
    assert y.shape == (0, D_OUT)
    dx, dL, dR, db = torch.autograd.grad(y, leaves, dy.float())
    assert dx.shape == (0, D_IN) and not dL.any() and not dR.any() and not db.any()


@needs_interpreter
def test_the_op_returns_the_fp32_pre_activation(kernels):
    x, L, R, b, _ = _inputs(r=5)
    y, h = torch.ops.comera.lowrank_linear(x.half(), L.half(), R.half(), b.half(), "gelu", "auto")
    assert y.dtype == torch.float16 and h.dtype == torch.float32 and h.shape == (T, 5)
    _close(h, x.half().double() @ L.half().double(), 1e-3, "h")


# ---------------------------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_reference_matches_the_float64_reference(dtype, activation):
    x, L, R, b, dy = _inputs(r=5, lead=(2,))
    _check(x, L, R, b, dy, activation, dtype, impl="torch")


def test_auto_on_cpu_takes_the_reference(monkeypatch):
    """Without COMERA_FORCE_TRITON, CPU tensors never reach a kernel (the interpreter is slow)."""
    monkeypatch.delenv("COMERA_FORCE_TRITON", raising=False)

    def no_kernel(*args):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(mod, "_forward_triton", no_kernel)
    monkeypatch.setattr(mod, "_backward_triton", no_kernel)
    x, L, R, b, dy = _inputs(r=4)
    _check(x, L, R, b, dy, "silu", torch.float32)


def test_activation_none_is_identity():
    x, L, R, b, _ = _inputs(r=4)
    torch.testing.assert_close(lowrank_linear(x, L, R, b, None, impl="torch"), F.linear(x @ L, R.t(), b))
    torch.testing.assert_close(lowrank_linear(x, L, R, impl="torch"), x @ L @ R)


def test_weights_are_cast_to_the_input_dtype():
    x, L, R, b, dy = _inputs(r=4)
    Lf = L.float().requires_grad_()
    y = lowrank_linear(x.half(), Lf, R.float(), b.float(), "relu", impl="torch")
    assert y.dtype == torch.float16
    (dL,) = torch.autograd.grad(y, Lf, dy.half())
    assert dL.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- the op


@needs_interpreter
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_opcheck(impl):
    x, L, R, b, dy = _inputs(t=9, d_in=20, d_out=18, r=3)
    args = (x.float().requires_grad_(), L.float().requires_grad_(), R.float().requires_grad_(),
            b.float().requires_grad_(), "gelu", impl)
    torch.library.opcheck(torch.ops.comera.lowrank_linear.default, args)
    h = (x @ L).float()
    bwd = (dy.float(), x.float(), L.float(), R.float(), h, "gelu", impl, True, True, True, True)
    torch.library.opcheck(torch.ops.comera.lowrank_linear_backward.default, bwd)


@needs_interpreter
@pytest.mark.parametrize("dynamic", [False, True])
def test_under_torch_compile_aot_eager(kernels, dynamic):
    def fn(x, L, R, b):
        return lowrank_linear(torch.tanh(x), L, R, b, "gelu").square().sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for t in (T, 23) if dynamic else (T,):
        x, L, R, b, _ = _inputs(t=t, r=5, seed=t)
        args = [a.float().requires_grad_() for a in (x, L, R, b)]
        out = compiled(*args)
        ref = [a.detach().requires_grad_() for a in (x, L, R, b)]
        want = F.linear(F.gelu(F.linear(torch.tanh(ref[0]), ref[1].t())), ref[2].t(), ref[3]).square().sum()
        _close(out, want.detach(), 2e-5, "loss")
        for name, g, w in zip(["dx", "dL", "dR", "dbias"], torch.autograd.grad(out, args),
                              torch.autograd.grad(want, ref)):
            _close(g, w, 2e-5, name)


@needs_interpreter
def test_under_torch_compile_inductor(kernels):
    def fn(x, L, R):
        return lowrank_linear(x * 2.0, L, R, None, "silu")

    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    x, L, R, _, dy = _inputs(r=5, bias=False)
    args = [a.float().requires_grad_() for a in (x, L, R)]
    got = compiled(*args)
    want, want_grads = _reference(2.0 * x, L, R, None, dy, "silu")
    _close(got, want, 2e-5, "y")
    grads = torch.autograd.grad(got, args, dy.float())
    _close(grads[0], 2.0 * want_grads[0], 2e-5, "dx")
    for name, g, w in zip(["dL", "dR"], grads[1:], want_grads[1:]):
        _close(g, w, 2e-5, name)


# ---------------------------------------------------------------------------------------------- dispatch, errors


@needs_interpreter
def test_ranks_above_the_kernel_limit(monkeypatch):
    """r > 128: "auto" takes the reference; "triton" raises, naming r."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")

    def no_kernel(*args):
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(mod, "_forward_triton", no_kernel)
    x, L, R, b, _ = _inputs(t=3, d_in=8, d_out=6, r=129)
    y = lowrank_linear(x.float(), L.float(), R.float(), b.float())
    _close(y, F.linear(x @ L, R.t(), b), 1e-5, "y")
    with pytest.raises(ValueError, match=r"r <= 128, got r=129"):
        lowrank_linear(x.float(), L.float(), R.float(), b.float(), impl="triton")


@needs_interpreter
def test_a_failing_kernel_falls_back_once(monkeypatch, caplog):
    """impl='auto': a kernel that cannot run is reported once and the reference serves; 'triton' raises."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    monkeypatch.setattr(mod, "_BROKEN", [])

    def broken(*args):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(mod, "_forward_triton", broken)
    x, L, R, b, dy = _inputs(r=4)
    with caplog.at_level("WARNING", logger="comera_compile"):
        _check(x, L, R, b, dy, "relu", torch.float32)
        _check(x, L, R, b, dy, "relu", torch.float32)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no kernel here" in caplog.records[0].message
    with pytest.raises(RuntimeError, match="no kernel here"):
        lowrank_linear(x.float(), L.float(), R.float(), impl="triton")


def test_bad_inputs_are_named():
    x, L, R, b, _ = (a.float() if a is not None else None for a in _inputs(t=4, d_in=6, d_out=5, r=3))
    with pytest.raises(ValueError, match=r"activation='tanh' is not supported; valid values: \['identity', 'relu', "
                                         r"'gelu', 'gelu_tanh', 'silu'\]"):
        lowrank_linear(x, L, R, b, "tanh")
    with pytest.raises(ValueError, match=r"x has 7 features .* expected L \[d_in=7, r\]"):
        lowrank_linear(torch.zeros(4, 7), L, R, b)
    with pytest.raises(ValueError, match=r"R has shape \(4, 5\), expected \[r=3, d_out\]"):
        lowrank_linear(x, L, torch.zeros(4, 5), b)
    with pytest.raises(ValueError, match=r"L must be 2-D \[d_in, r\], got shape \(6,\)"):
        lowrank_linear(x, torch.zeros(6), R, b)
    with pytest.raises(ValueError, match=r"R must be 2-D \[r, d_out\]"):
        lowrank_linear(x, L, torch.zeros(3, 5, 1), b)
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \[d_out=5\]"):
        lowrank_linear(x, L, R, torch.zeros(4))
    with pytest.raises(ValueError, match=r"rank r \(L.shape\[1\]\) must be >= 1, got 0"):
        lowrank_linear(x, torch.zeros(6, 0), torch.zeros(0, 5), b)
    with pytest.raises(TypeError, match=r"R is torch.float16 but x is torch.float32"):
        torch.ops.comera.lowrank_linear(x, L, R.half(), b, "relu", "torch")
    with pytest.raises(ValueError, match=r"impl='fast'; valid values"):
        lowrank_linear(x, L, R, b, impl="fast")
    with pytest.raises(TypeError, match="floating-point"):
        lowrank_linear(torch.zeros(4, 6, dtype=torch.int64), L.long(), R.long())
