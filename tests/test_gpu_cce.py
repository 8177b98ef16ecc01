"""GPU-only checks of comera::linear_cross_entropy (skipped on CPU CI): every path in bf16 against
float64, every path in fp32 at IEEE precision unless torch allows TF32 (the interpreter on the CPU
has no TF32), replay inside a CUDA graph, and a compiled model under mode="reduce-overhead" whose
graph keeps the fused loss inside CUDA graphs."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc
from comera_compile.cce import record_cce_stats
from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(n, d, v, transposed=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).to(dtype)
    if transposed:  # a tensor-train head's factor R^T: a strided [V, r] view
        w = w.t().contiguous().t()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::17] = -100
    return x, w, t


def _ref64(x, w, t):
    xb, wb = x.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(xb @ wb.t(), t)
    return (loss.detach(),) + torch.autograd.grad(loss, (xb, wb))


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def _step(fn, x, w, t):
    loss = fn(x, w, t)
    return (loss,) + torch.autograd.grad(loss, (x, w))


SHAPES = [(1031, 256, 32003, False), (1031, 32, 32003, True)]


@pytest.mark.parametrize("n, d, v, transposed", SHAPES)
@pytest.mark.parametrize("strategy, backward, tol", [
    ("auto", "filtered", 5e-2), ("sparse", "filtered", 5e-2), ("static", "exact", 1e-2),
    ("chunked", "exact", 1e-2), ("fused", "exact", 1e-2)])
def test_every_path_bf16_against_float64(n, d, v, transposed, strategy, backward, tol):
    x, w, t = _inputs(n, d, v, transposed)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = _step(lambda a, b, c: linear_cross_entropy(a, b, c, strategy=strategy, backward=backward), xr, wr, t)
    ref = _step(lambda a, b, c: F.cross_entropy((a @ b.t()).float(), c), x.clone().requires_grad_(),
                w.clone().requires_grad_(), t)  # eager bf16: the error floor
    ref64 = _ref64(x, w, t)
    assert _rel(out[0], ref64[0]) < 1e-3
    for got, eager, exact in zip(out[1:], ref[1:], ref64[1:]):
        assert _rel(got, exact) < max(tol, 2 * _rel(eager, exact)), (_rel(got, exact), _rel(eager, exact))


@pytest.fixture
def tf32(request):
    """``torch.backends.cuda.matmul.allow_tf32`` set to the test's parameter, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = request.param
    yield request.param
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("tf32", [False], indirect=True)
@pytest.mark.parametrize("n, d, v, transposed", SHAPES)
@pytest.mark.parametrize("strategy", ["auto", "sparse", "static", "chunked", "fused"])
def test_every_path_fp32_is_ieee_unless_torch_allows_tf32(tf32, n, d, v, transposed, strategy):
    """fp32 inputs with TF32 off (torch's default) against float64 at 1e-5: every product of every
    path, library GEMM or tl.dot, runs in IEEE fp32 (a dot in TF32 rounds its operands to 10 bits,
    about 1e-4 relative here). ``filter_eps`` below any softmax value: the sparse rounds run (their
    dX and dW kernels) and drop nothing."""
    x, w, t = _inputs(n, d, v, transposed, dtype=torch.float32)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with record_cce_stats() as stats:
        out = _step(lambda a, b, c: linear_cross_entropy(a, b, c, strategy=strategy, filter_eps=1e-30), xr, wr, t)
    if strategy == "sparse":
        assert any(s.path == "sparse" and s.sparse_rounds > 0 for s in stats), stats
    for name, got, exact in zip(("loss", "dx", "dw"), out, _ref64(x, w, t)):
        assert _rel(got, exact) < 1e-5, (name, _rel(got, exact))


@pytest.mark.parametrize("tf32", [True], indirect=True)
@pytest.mark.parametrize("strategy", ["sparse", "static", "fused"])
def test_fp32_takes_tf32_when_torch_allows_it(tf32, strategy):
    """The other side of the rule (and the check that 1e-5 above sees TF32): with
    ``allow_tf32`` the kernels' products are TF32 and the gradients miss float64 by more."""
    n, d, v, transposed = SHAPES[0]
    x, w, t = _inputs(n, d, v, transposed, dtype=torch.float32)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = _step(lambda a, b, c: linear_cross_entropy(a, b, c, strategy=strategy, filter_eps=1e-30), xr, wr, t)
    errors = [_rel(got, exact) for got, exact in zip(out[1:], _ref64(x, w, t)[1:])]
    assert max(errors) > 1e-5 and max(errors) < 1e-2, errors


@pytest.mark.parametrize("n, d, v, transposed", SHAPES)
@pytest.mark.parametrize("strategy", ["auto", "sparse", "static", "chunked", "fused"])
def test_replays_inside_a_cuda_graph(n, d, v, transposed, strategy):
    """Forward + backward captured once and replayed on new data gives eager's values; inside
    capture the sparse path (host syncs) is replaced by the static schedule."""
    x, w, t = _inputs(n, d, v, transposed)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ts = t.clone()

    backward = "filtered" if strategy in ("auto", "sparse") else "exact"

    def step():
        return _step(lambda a, b, c: linear_cross_entropy(a, b, c, strategy=strategy, backward=backward), xs, ws, ts)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with record_cce_stats() as stats, torch.cuda.graph(graph):
        out = step()
    assert "sparse" not in {s.path for s in stats}, stats
    x2, w2, t2 = _inputs(n, d, v, transposed, seed=1)
    with torch.no_grad():
        xs.copy_(x2)
        ws.copy_(w2)
        ts.copy_(t2)
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(lambda a, b, c: linear_cross_entropy(a, b, c, strategy="static", backward="exact"),
                  x2.clone().requires_grad_(), w2.clone().requires_grad_(), t2)
    for got, exp in zip(out, eager):
        assert _rel(got, exp) < 1e-2


class Head(nn.Module):
    def __init__(self, d=256, vocab=32000):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, h, y):
        return F.cross_entropy(self.head(torch.relu(self.body(h))).float().flatten(0, 1), y.flatten())


def test_reduce_overhead_keeps_the_fused_loss_in_the_cuda_graph():
    torch.manual_seed(0)
    model = Head().cuda().bfloat16()
    ref = Head().cuda().bfloat16()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="comera", options={"cudagraphs": True, "cce_min_vocab": 0})
    torch._dynamo.utils.counters.clear()
    for step in range(4):
        # A training loop's zero_grad(set_to_none=True): cudagraph trees allocate .grad inside the
        # captured backward, so accumulating into it on the next step is refused by PyTorch (README,
        # "CUDA graphs"); that is torch's rule for any reduce-overhead step, not this op's.
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        h = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, 32000, (4, 256), device="cuda")
        loss = compiled(h, y)
        loss.backward()
        ref_loss = ref(h, y)
        ref_loss.backward()
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            err = float((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm())
            assert err < 3e-2, (step, name, err)
    skips = dict(torch._dynamo.utils.counters["inductor"])
    assert not any("cudagraph" in k and "skip" in k for k in skips if skips[k]), skips
    report = cc.explain(Head().cuda().bfloat16(), h, y, options={"cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"]


@pytest.mark.parametrize("strategy", ["auto", "sparse", "static", "chunked", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_bias_over_16bit_logits_on_the_gpu(strategy, dtype):
    """``(x @ W.T).float() + b`` with an fp32 bias (|b| ~ 20) on every path: within 2x eager's error
    against float64 (db through the paths that hold the logits' gradient in x's dtype: + that dtype's eps)."""
    x, w, t = _inputs(4096, 256, 32000, dtype=dtype)
    b = torch.randn(32000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) * 20
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    loss = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], strategy=strategy, backward="exact")
    grads = torch.autograd.grad(loss, leaves)
    el = [a.clone().requires_grad_() for a in (x, w, b)]
    eager = F.cross_entropy((el[0] @ el[1].t()).float() + el[2], t)
    eager_grads = torch.autograd.grad(eager, el)
    rl = [a.detach().double().requires_grad_() for a in (x, w, b)]
    ref = F.cross_entropy(rl[0] @ rl[1].t() + rl[2], t)
    ref_grads = torch.autograd.grad(ref, rl)
    assert abs(float(loss) - float(ref)) <= 2 * abs(float(eager) - float(ref)) + 1e-5
    assert grads[2].dtype == torch.float32
    for name, a, e, r in zip("xwb", grads, eager_grads, ref_grads):
        floor = torch.finfo(dtype).eps if name == "b" else 1e-6
        assert _rel(a, r) <= 2 * _rel(e, r) + floor, (name, _rel(a, r), _rel(e, r))


@pytest.mark.parametrize("strategy", ["auto", "sparse", "static", "chunked", "fused"])
def test_confident_rows_never_give_a_negative_loss_on_the_gpu(strategy):
    x, w, t = _inputs(4096, 256, 32000, dtype=torch.float32)
    t = t.clamp_min(0)
    w = w * 0.1
    w[t] = 3.0 * x  # the target logit ~ 3 |x|^2 ~ 770 far above the rest: eager's loss is 0
    loss = linear_cross_entropy(x, w, t, strategy=strategy, reduction="none")
    eager = F.cross_entropy(x @ w.t(), t, reduction="none")
    assert (loss >= 0).all(), (float(loss.min()), int((loss < 0).sum()))
    # logits ~ 770 round by ~1e-4 in fp32 (eager too): rows whose target repeats are not confident
    torch.testing.assert_close(loss, eager, rtol=1e-4, atol=5e-3)
