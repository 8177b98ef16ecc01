"""The block tensor-train's fused kernel (kernels/btt_fused.py) under the Triton interpreter: the launch
against a float64 einsum written from the definition (outputs, the regrouped intermediate, several input
or output segments, ranks that are not powers of two, blocks and features that are not tile multiples,
fp32 and fp16, outputs poisoned with NaN first); and ``comera::btt_blocks`` running it (forward and
every gradient against the same reference, the intermediate kept at rank 1 and recomputed above, an
unused output, opcheck, torch.compile), the fallback to batched GEMMs when the kernel fails, and which
calls it declines. bf16 on the GPU: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from comera_compile.kernels import btt_fused, btt_swap
from comera_compile.kernels.dispatch import interpreting

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="the kernel runs here under TRITON_INTERPRET=1 (GPU: tests/test_gpu.py)")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def first_product(xs, firsts, b, dtype):
    """``t[c, n, j, k] = sum_b x[n, j, b] F[j, b, c, k]`` in float64 (the input segments side by side
    along j), rounded to ``dtype`` as the kernels round it."""
    n = xs[0].shape[0]
    parts = [torch.einsum("njb,jbck->cnjk", x.double().view(n, -1, b), (firsts[i] if len(firsts) > 1 else firsts[0])
                          .double()) for i, x in enumerate(xs)]
    return torch.cat(parts, dim=2).to(dtype).double()


def reference(xs, firsts, seconds, b, dtype):
    """The outputs from the definition: ``y[n, c, a] = sum_{j, k} t[c, n, j, k] S[c, j, k, a]`` per output
    segment, float64."""
    t, n = first_product(xs, firsts, b, dtype), xs[0].shape[0]
    ys, c0 = [], 0
    for s in seconds:
        c = s.shape[0]
        ys.append(torch.einsum("cnjk,cjka->nca", t[c0:c0 + c], s.double()).reshape(n, -1))
        c0 += c
    return ys


def grad_reference(xs, firsts, gs, a, b, dtype):
    """The second core's gradient from the definition: ``dS_o[c, j, k, a] = sum_n t[c, n, j, k] g_o[n, c, a]``."""
    t, n = first_product(xs, firsts, b, dtype), xs[0].shape[0]
    outs, c0 = [], 0
    for g in gs:
        c = g.shape[1] // a
        outs.append(torch.einsum("cnjk,nca->cjka", t[c0:c0 + c], g.double().view(n, c, a)))
        c0 += c
    return outs


def _operands(n, b, a, r, js, cs, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    xs = [rand(n, j * b) for j in js]
    firsts = [rand(j, b, sum(cs), r) for j in js] if len(js) > 1 else [rand(sum(js), b, sum(cs), r)]
    seconds = [rand(c, sum(js), r, a) for c in cs]
    gs = [rand(n, c * a) for c in cs]
    return xs, firsts, seconds, gs


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


# n, b, a, r, input blocks per segment, output blocks per segment
LAUNCHES = [
    (40, 8, 12, 1, [5], [7]),             # nothing a tile multiple
    (33, 24, 24, 1, [32], [32]),          # several chunks of blocks, b and a not powers of two
    (20, 16, 40, 2, [9], [6]),
    (21, 70, 70, 3, [4], [3]),            # a rank of 3 (padded to 4); b and a over two tiles of features
    (17, 8, 8, 4, [6], [5, 3, 7]),        # three output segments
    (17, 8, 8, 1, [6, 4, 5], [5]),        # three input segments
    (18, 16, 16, 16, [3], [2]),           # the largest rank: one block a chunk
    (18, 16, 16, 5, [3], [2, 4]),
]


@needs_interpreter
@pytest.mark.parametrize("case", LAUNCHES, ids=lambda c: f"n{c[0]}b{c[1]}a{c[2]}r{c[3]}-{c[4]}x{c[5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_through_cores_matches_the_float64_definition(case, dtype):
    n, b, a, r, js, cs = case
    xs, firsts, seconds, _ = _operands(*case, dtype, seed=0)
    ys = [torch.full((n, c * a), float("nan"), dtype=dtype) for c in cs]
    btt_fused.through_cores(xs, firsts, seconds, ys, r, b, a)
    for y, w in zip(ys, reference(xs, firsts, seconds, b, dtype)):
        assert not y.isnan().any()  # every output element written
        assert _rel(y, w) < TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("case", LAUNCHES, ids=lambda c: f"n{c[0]}b{c[1]}a{c[2]}r{c[3]}-{c[4]}x{c[5]}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_second_core_grad_matches_the_float64_definition(case, deterministic):
    """Token splits meeting by atomic adds (fp32 outputs, zeroed first), or one program per entry; the
    outputs in fp16 when deterministic (stored once, in the output's dtype)."""
    n, b, a, r, js, cs = case
    dtype = torch.float16 if deterministic else torch.float32
    xs, firsts, _, gs = _operands(*case, dtype, seed=1)
    if deterministic:
        outs = [torch.full((c, sum(js), r, a), float("nan"), dtype=dtype) for c in cs]
    else:
        outs = [torch.zeros(c, sum(js), r, a) for c in cs]
    btt_fused.second_core_grad(xs, firsts, gs, outs, r, b, a, deterministic=deterministic)
    for o, w in zip(outs, grad_reference(xs, firsts, gs, a, b, dtype)):
        assert not o.isnan().any() and _rel(o, w) < (5e-3 if deterministic else 1e-5)


@needs_interpreter
def test_second_core_grad_writes_through_strides():
    """An output given as a permuted view (the first core's gradient of the transposed layer) is
    written in place, every entry."""
    xs, firsts, _, gs = _operands(23, 8, 12, 2, [4], [3], torch.float32, seed=2)
    storage = torch.zeros(4, 12, 3, 2)  # [j, a, c, k]: the gradient as its layer stores it
    btt_fused.second_core_grad(xs, firsts, gs, [storage.permute(2, 0, 3, 1)], 2, 8, 12)
    (want,) = grad_reference(xs, firsts, gs, 12, 8, torch.float32)
    assert _rel(storage.permute(2, 0, 3, 1), want) < 1e-5


def test_launch_errors_name_the_problem():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="several input segments and several output segments"):
        btt_fused.through_cores([x, x], [x], [x], [x, x], 1, 4, 4)
    with pytest.raises(ValueError, match="at most 3"):
        btt_fused.through_cores([x], [x], [x] * 4, [x] * 4, 1, 4, 4)
    with pytest.raises(ValueError, match="the same strides"):
        btt_fused.through_cores([x], [x], [x, x.t()], [x, x], 1, 4, 4)
    with pytest.raises(ValueError, match="atomic adds in fp32"):
        btt_fused.second_core_grad([x], [x], [x], [x.half()], 1, 4, 4)


def test_tiles_satisfy_the_dot_minimum():
    """Every dot of the kernels is >= 16 in each dimension: BLOCK_C * R_PAD, BLOCK_J * R_PAD, the
    tokens, the feature tiles."""
    for kernel in ("through", "grad"):
        for r in range(1, btt_fused.MAX_RANK + 1):
            for a in (5, 16, 24, 64, 86, 128, 256):
                tiles = btt_fused.tiles_for(r, a, a, kernel)
                rp = 1 << (r - 1).bit_length()
                assert tiles.block_c * rp >= 16 and tiles.block_j * rp >= 16
                assert min(tiles.block_n, tiles.block_a, tiles.block_b) >= 16


# ------------------------------------------------------------------ comera::btt_blocks through the kernel


@pytest.fixture
def fused(monkeypatch):
    """The fused kernel under impl='auto' on CPU tensors (the interpreter), and proof that it ran: the
    batched-GEMM path raises if anything reaches it."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    monkeypatch.setattr(btt_swap, "_FUSED_BROKEN", set())

    def no_swap(*args, **kwargs):
        raise AssertionError("the batched-GEMM path ran instead of the fused kernel")

    monkeypatch.setattr(btt_swap, "swap_blocks", no_swap)


def _op_inputs(b1, b2, r, n, cs, a, dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, b1 * b2, generator=gen, dtype=torch.float64)
    first = torch.randn(b1, b2, sum(cs) * r, generator=gen, dtype=torch.float64) / b2**0.5
    seconds = [torch.randn(c, b1 * r, a, generator=gen, dtype=torch.float64) / (b1 * r)**0.5 for c in cs]
    return [t.to(dtype) for t in [x, first] + seconds]


def _op_reference(x, first, seconds, r):
    """comera::btt_blocks's outputs from the definition, float64, differentiable."""
    n, (b1, b2) = x.shape[0], first.shape[:2]
    t = torch.einsum("njb,jbm->njm", x.view(n, b1, b2), first).view(n, b1, -1, r)
    ys, c0 = [], 0
    for s in seconds:
        c = s.shape[0]
        ys.append(torch.einsum("njck,cjka->nca", t[:, :, c0:c0 + c], s.view(c, b1, r, -1)).reshape(n, -1))
        c0 += c
    return ys


def _op_check(inputs, r, unused=None, tol=1e-5):
    """comera::btt_blocks on ``inputs``: its outputs and every gradient against the float64 definition
    (an output the loss never reads: no gradient for its core)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    out = torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], r)
    want = _op_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2:], r)
    gen = torch.Generator().manual_seed(5)
    dys = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    for g, w in zip(out[:-1], want):
        assert _rel(g, w.detach()) < tol
    loss = sum((g * d.to(g.dtype)).sum() for i, (g, d) in enumerate(zip(out[:-1], dys)) if i != unused)
    ref = sum((w * d).sum() for i, (w, d) in enumerate(zip(want, dys)) if i != unused)
    wants = torch.autograd.grad(ref, ref_leaves, allow_unused=True)
    for name, g, w, leaf in zip(["x", "first"] + [f"second{i}" for i in range(len(inputs) - 2)],
                                torch.autograd.grad(loss, leaves), wants, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        if w is None:
            assert torch.equal(g, torch.zeros_like(leaf)), name
        else:
            assert _rel(g, w) < tol, name
    return out[-1]


@needs_interpreter
@pytest.mark.parametrize("r, cs, unused", [(1, (6,), None), (3, (6,), None), (1, (3, 5, 2), None),
                                           (3, (3, 5, 2), 1), (2, (4, 1), 0)],
                         ids=["r1", "r3", "r1-three-outputs", "r3-three-outputs-one-unused", "r2-first-unused"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_op_through_the_kernel_matches_the_definition(fused, r, cs, unused, deterministic):
    """Forward and every gradient through the fused kernels; nothing saved but the op's inputs (the
    returned intermediate is empty); under torch.use_deterministic_algorithms the cores' gradients
    are stored once per entry."""
    inputs = _op_inputs(5, 24, r, 19, cs, 12, torch.float32)
    assert btt_swap.fused_applies(inputs[0], inputs[1], inputs[2:], r)
    assert not btt_swap.saves_intermediate(inputs[0], inputs[1], inputs[2:], r)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        kept = _op_check(inputs, r, unused)
    finally:
        torch.use_deterministic_algorithms(before)
    assert kept.numel() == 0


@needs_interpreter
def test_op_through_the_kernel_in_fp16(fused):
    b1, b2, r, n, cs, a = 4, 32, 1, 37, (5, 3), 20
    inputs = _op_inputs(b1, b2, r, n, cs, a, torch.float16)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    got = torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], r)[:-1]
    want = _op_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2:], r)
    dys = [torch.randn(w.shape, dtype=torch.float64) for w in want]
    grads = torch.autograd.grad(got, leaves, [d.half() for d in dys])
    wants = torch.autograd.grad(want, ref_leaves, dys)
    for g, w in zip(list(got) + list(grads), [w.detach() for w in want] + list(wants)):
        assert g.dtype == torch.float16 and _rel(g, w) < 5e-3  # the fp32 accumulators cast to fp16


@needs_interpreter
@pytest.mark.parametrize("r", [1, 2])
def test_op_through_the_kernel_passes_opcheck(fused, r):
    args = _op_inputs(3, 16, r, 9, (2, 3), 8, torch.float32)
    args = (args[0].requires_grad_(), args[1].requires_grad_(), [s.requires_grad_() for s in args[2:]], r)
    torch.library.opcheck(torch.ops.comera.btt_blocks.default, args)


@needs_interpreter
def test_op_through_the_kernel_under_torch_compile(fused):
    """Inside a compiled function (aot_eager: the op and its backward opaque), values and gradients as eager."""
    inputs = _op_inputs(4, 16, 2, 11, (3, 2), 8, torch.float32)

    def f(x, first, s0, s1):
        y0, y1 = torch.ops.comera.btt_blocks(x, first, [s0, s1], 2)[:-1]
        return (y0.sin().sum() + (y1 * y1).sum())

    leaves = [t.clone().requires_grad_() for t in inputs]
    eager = f(*leaves)
    want = torch.autograd.grad(eager, leaves)
    leaves_c = [t.clone().requires_grad_() for t in inputs]
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves_c)
    torch.testing.assert_close(got, eager)
    for g, w in zip(torch.autograd.grad(got, leaves_c), want):
        torch.testing.assert_close(g, w)


def test_op_declines_the_kernel_where_it_does_not_apply(monkeypatch):
    """Second cores of different widths, more than three outputs, ranks above 16, and CPU tensors
    without the interpreter forced take the batched GEMMs (which keep the intermediate at rank 1
    while it is no larger than the input)."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    x, first, *seconds = _op_inputs(3, 16, 1, 9, (2, 3), 8, torch.float32)
    assert btt_swap._fused(x, first, seconds, 1) == interpreting()
    wide = torch.zeros(3, 3 * 1, 9)
    assert not btt_swap._fused(x, first, [seconds[0], wide], 1)
    assert not btt_swap._fused(x, torch.zeros(3, 16, 5), [torch.zeros(5, 3, 8)] * 5, 1)
    assert not btt_swap._fused(x, torch.zeros(3, 16, 17 * 2), [torch.zeros(2, 3 * 17, 8)], 17)
    monkeypatch.delenv("COMERA_FORCE_TRITON")
    assert not btt_swap._fused(x, first, seconds, 1)
    assert btt_swap.saves_intermediate(x, first, seconds, 1)  # 5 column blocks at rank 1 <= 16 features
    assert not btt_swap.saves_intermediate(x, torch.zeros(3, 16, 34), [torch.zeros(17, 6, 8)], 2)


@needs_interpreter
def test_a_failing_kernel_falls_back_once_per_signature(monkeypatch, caplog):
    """A launch that raises is reported once; its signature (dtype, b, a, outputs) takes the batched
    GEMMs from then on, with the same values; other signatures still try the kernel."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    monkeypatch.setattr(btt_swap, "_FUSED_BROKEN", set())
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(btt_fused, "through_cores", broken)
    x, first, *seconds = _op_inputs(3, 16, 1, 9, (2, 3), 8, torch.float32)
    want = _op_reference(x.double(), first.double(), [s.double() for s in seconds], 1)
    with caplog.at_level("WARNING", logger="comera_compile"):
        for _ in range(2):
            got = torch.ops.comera.btt_blocks(x, first, seconds, 1)[:-1]
            for g, w in zip(got, want):
                assert _rel(g, w) < 1e-5
    assert len(calls) == 1
    assert sum("the fused Triton kernel failed" in r.message and "no kernel here" in r.message
               for r in caplog.records) == 1
    assert btt_swap._fused(x, first, seconds[:1], 1)  # one output: another signature


@needs_interpreter
@pytest.mark.parametrize("r", [1, 3])
def test_gradients_stay_right_when_the_kernel_fails_in_the_forward(monkeypatch, r):
    """The forward's kernel fails: the batched GEMMs serve it and the backward (the intermediate,
    not saved since the fused path was planned, recomputed there)."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    monkeypatch.setattr(btt_swap, "_FUSED_BROKEN", set())

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(btt_fused, "through_cores", broken)
    kept = _op_check(_op_inputs(4, 16, r, 13, (3, 2), 8, torch.float32), r)
    assert kept.numel() == 0
