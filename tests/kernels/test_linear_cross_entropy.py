"""comera::linear_cross_entropy against a float64 eager reference (CPU; Triton interpreter)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from comera_compile.kernels import linear_cross_entropy as lce
from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy

N, D, V = 37, 45, 123  # not block multiples


def _inputs(dtype=torch.float32, bias=True, scale=1.0, seed=0, n=N, d=D, v=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * scale / d**0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, b, t


def _eager(x, w, b, t, softcap=0.0, **kw):
    z = F.linear(x, w, b)
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.float() if z.dtype != torch.float64 else z, t, **kw)


def _ref64(x, w, b, t, go=None, softcap=0.0, lse_weight=0.0, **kw):
    """float64 eager loss (and lse) with gradients for x, w, b."""
    leaves = [a.detach().double().requires_grad_() for a in (x, w) + ((b,) if b is not None else ())]
    xb, wb = leaves[:2]
    bb = leaves[2] if b is not None else None
    z = F.linear(xb, wb, bb)
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, t, **kw)
    lse = torch.logsumexp(z, 1)
    total = loss if go is None else (loss * go.double()).sum()
    if lse_weight:
        total = total + lse_weight * (lse**2).sum()
    grads = torch.autograd.grad(total, leaves)
    return loss.detach(), lse.detach(), grads


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(impl, x, w, b, t, tol, go_seed=1, **kw):
    leaves = [a.clone().requires_grad_() for a in (x, w) + ((b,) if b is not None else ())]
    bb = leaves[2] if b is not None else None
    loss = linear_cross_entropy(leaves[0], leaves[1], t, bb, impl=impl, **kw)
    assert loss.dtype == torch.float32
    ref_kw = {k: v for k, v in kw.items() if k in ("softcap", "ignore_index", "label_smoothing",
                                                     "reduction")}
    go = torch.randn(loss.shape, generator=torch.Generator().manual_seed(go_seed)) + 1.5
    ref_loss, _, ref_grads = _ref64(x, w, b, t, go=go, **ref_kw)
    assert _rel(loss, ref_loss) < tol, (loss, ref_loss)
    grads = torch.autograd.grad((loss * go).sum(), leaves)
    for got, ref, name in zip(grads, ref_grads, "xwb"):
        assert got.dtype == x.dtype
        assert _rel(got, ref) < tol, (name, _rel(got, ref))


OPTION_GRID = [
    dict(),
    dict(softcap=5.0, label_smoothing=0.1, reduction="none"),
    dict(label_smoothing=0.2, reduction="sum"),
    dict(softcap=3.0, ignore_index=7, reduction="mean"),
]


@pytest.mark.parametrize("kw", OPTION_GRID + [dict(softcap=2.0, label_smoothing=0.3, reduction="sum")])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_reference_matches_float64(kw, bias):
    x, w, b, t = _inputs(bias=bias)
    t[3] = kw.get("ignore_index", -100)
    _check("torch", x, w, b, t, 1e-5, **kw)


@pytest.mark.parametrize("kw", OPTION_GRID)
def test_triton_matches_float64(kw):
    x, w, b, t = _inputs(bias=kw.get("reduction") != "sum")
    t[3] = kw.get("ignore_index", -100)
    _check("triton", x, w, b, t, 1e-5, backward="exact", **kw)


@pytest.fixture
def small_tiles(monkeypatch):
    """Shrink tiles and buffers so that small problems take every multi-tile path."""
    tun = dataclasses.replace(lce._TUNING, fwd_block_m=16, fwd_block_n=32, fwd_block_k=16,
                              bwd_block_m=16, bwd_block_n=16, bwd_block_k=16, cons_block_d=16,
                              group_v=2, fwd_group_m=2, dense_block_n=32)
    monkeypatch.setattr(lce, "_TUNING", tun)
    return tun


@pytest.mark.parametrize(
    "budget, mode, det",
    [
        (dict(tile_budget_bytes=1 << 30), "filtered", False),  # one sparse round
        (dict(tile_budget_bytes=16 * 16 * 4 * 10, dense_density=2.0, dense_after_rounds=2,
              dense_budget_bytes=70 * 4 * 32), "filtered", False),  # sparse rounds, then dense
        (dict(dense_budget_bytes=70 * 4 * 32), "exact", False),  # dense chunks
        (dict(), "filtered", True),  # deterministic
    ],
)
def test_triton_tile_paths(small_tiles, budget, mode, det):
    for k, v in budget.items():
        setattr(small_tiles, k, v)
    x, w, b, t = _inputs(n=70, scale=4.0)
    t[5] = -100
    # eps below any softmax value: the filtered paths run but drop nothing
    _check("triton", x, w, b, t, 1e-5, backward=mode, deterministic=det, filter_eps=1e-30,
           label_smoothing=0.1, reduction="sum")
    stats = {k: int(v) for k, v in lce._LAST_STATS.items()}
    assert (stats["sparse_rounds"] > 0) == (mode == "filtered" and not det), stats
    assert (stats["dense_chunks"] > 0) == (mode == "exact" or det or "dense_density" in budget), stats


def test_filtered_drops_only_tiny_softmax(small_tiles):
    """Peaked softmax, fp16, default eps: tiles are skipped and the error stays small."""
    x, w, b, t = _inputs(dtype=torch.float16, bias=False, n=64, v=160, scale=1.0)
    w[:, 0] = torch.linspace(6.0, -6.0, 160).half()  # a few frequent words, a long tail
    x[:, 0] = 1.0
    t = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(3))
    _check("triton", x, w, b, t, 1e-2, backward="filtered")
    stats = {k: int(v) for k, v in lce._LAST_STATS.items()}
    assert stats["kept_sparse"] < stats["tiles"], stats


def test_deterministic_is_bitwise_repeatable(small_tiles):
    x, w, b, t = _inputs(n=48)
    outs = []
    for _ in range(2):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(xr, wr, t, impl="triton", deterministic=True)
        outs.append((loss,) + torch.autograd.grad(loss, (xr, wr)))
    for a, b_ in zip(*outs):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_return_lse_and_z_loss_gradient(impl):
    x, w, b, t = _inputs()
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    loss, lse = linear_cross_entropy(xr, wr, t, br, return_lse=True, impl=impl, softcap=4.0)
    assert lse.dtype == torch.float32 and lse.shape == (N,)
    ref_loss, ref_lse, ref_grads = _ref64(x, w, b, t, softcap=4.0, lse_weight=1e-2)
    assert _rel(loss, ref_loss) < 1e-5 and _rel(lse, ref_lse) < 1e-5
    grads = torch.autograd.grad(loss + 1e-2 * (lse**2).sum(), (xr, wr, br))
    for got, ref in zip(grads, ref_grads):
        assert _rel(got, ref) < 1e-5


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp16(impl):
    x, w, b, t = _inputs(dtype=torch.float16)
    _check(impl, x, w, b, t, 5e-3, backward="exact")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bad", [123, 500, -1, -7])
def test_out_of_range_targets_raise_like_eager(impl, bad):
    x, w, b, t = _inputs()
    t[4] = bad
    with pytest.raises(IndexError) as eager_err:
        _eager(x, w, b, t)
    with pytest.raises(IndexError) as ours:
        linear_cross_entropy(x, w, t, b, impl=impl)
    assert str(bad) in str(ours.value) and str(bad) in str(eager_err.value)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(impl, reduction):
    x, w, b, t = _inputs()
    t[:] = -100
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xr, wr, t, b, reduction=reduction, impl=impl)
    ref = _eager(xe, we, b, t, reduction=reduction)
    torch.testing.assert_close(loss, ref, equal_nan=True)
    go = torch.ones_like(ref)
    for got, exp in zip(torch.autograd.grad(loss, (xr, wr), go), torch.autograd.grad(ref, (xe, we), go)):
        torch.testing.assert_close(got, exp, equal_nan=True)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_nan_and_inf_propagate_like_eager(impl):
    x, w, b, t = _inputs(bias=False)
    x[2, 5] = float("nan")
    x[9, 1] = float("inf")
    for reduction in ("none", "mean"):
        xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss = linear_cross_entropy(xr, w, t, reduction=reduction, impl=impl)
        ref = _eager(xe, w, None, t, reduction=reduction)
        assert torch.equal(loss.isnan(), ref.isnan())
        go = torch.ones_like(ref)
        (gx,) = torch.autograd.grad(loss, (xr,), go)
        (ge,) = torch.autograd.grad(ref, (xe,), go)
        assert torch.equal(gx.isnan().any(1), ge.isnan().any(1))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_contiguous_inputs(impl):
    x, w, b, t = _inputs()
    xs = torch.randn(D, 2 * N).t()[::2]  # strided rows and columns
    xs.copy_(x)
    ws = torch.empty(D, V).t()  # a transposed weight (tied-embedding style)
    ws.copy_(w)
    ts = torch.stack([t, t], 1)[:, 0]
    assert not (xs.is_contiguous() or ws.is_contiguous() or ts.is_contiguous())
    _check(impl, xs, ws, b, ts, 1e-5, backward="exact")


def test_no_grad_and_inference():
    x, w, b, t = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(x.requires_grad_(), w, t, b)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _eager(x, w, b, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_inside_torch_compile(impl):
    def fn(x, w, b, t):
        h = torch.tanh(x)
        loss, lse = linear_cross_entropy(h, w, t, b, return_lse=True, label_smoothing=0.1,
                                         impl=impl)
        return loss + 1e-3 * lse.pow(2).mean()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x, w, b, t = _inputs()
    args = [a.clone().requires_grad_() for a in (x, w, b)]
    args_e = [a.clone().requires_grad_() for a in (x, w, b)]
    out = compiled(*args, t)
    ref = fn(*args_e, t)
    torch.testing.assert_close(out, ref)
    for got, exp in zip(torch.autograd.grad(out, args), torch.autograd.grad(ref, args_e)):
        torch.testing.assert_close(got, exp)


def test_dynamic_shapes_fake():
    compiled = torch.compile(
        lambda x, w, t: linear_cross_entropy(x, w, t, reduction="none", impl="torch"),
        backend="aot_eager", dynamic=True)
    for n in (17, 29):
        x, w, _, t = _inputs(n=n, bias=False)
        torch.testing.assert_close(compiled(x, w, t), _eager(x, w, None, t, reduction="none"))


def test_opcheck():
    x, w, b, t = _inputs(n=9, v=20, d=8)
    args = (x.requires_grad_(), w.requires_grad_(), t, b.requires_grad_(), 2.0, -100, 0.1, "mean",
            "filtered", 1e-4, False, "torch")
    torch.library.opcheck(torch.ops.comera.linear_cross_entropy.default, args)


def test_argument_errors():
    x, w, b, t = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="backward"):
        linear_cross_entropy(x, w, t, backward="approx")
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(RuntimeError, match="dtype"):
        linear_cross_entropy(x, w.double(), t)


def test_sparse_path_with_softcap_and_custom_ignore(small_tiles):
    small_tiles.tile_budget_bytes = 16 * 16 * 4 * 12  # several sparse rounds
    small_tiles.dense_after_rounds = 100
    small_tiles.dense_density = 2.0
    x, w, b, t = _inputs(n=70, scale=4.0)
    t[[2, 9]] = 11
    _check("triton", x, w, b, t, 1e-5, softcap=3.0, ignore_index=11, filter_eps=1e-30)
    assert int(lce._LAST_STATS["sparse_rounds"]) > 1


def test_auto_picks_triton_when_forced(monkeypatch):
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    x, w, b, t = _inputs()
    lce._LAST_STATS.clear()
    xr = x.clone().requires_grad_()
    linear_cross_entropy(xr, w, t, b).backward()
    assert lce._LAST_STATS  # the Triton backward ran
    monkeypatch.delenv("COMERA_FORCE_TRITON")
    lce._LAST_STATS.clear()
    linear_cross_entropy(x.clone().requires_grad_(), w, t, b).backward()
    assert not lce._LAST_STATS  # the torch reference ran
