"""comera::linear_cross_entropy against a float64 eager reference (CPU; Triton interpreter)."""

import pytest
import torch
import torch.nn.functional as F

from comera_compile.cce import CCETuning, LCEOptions, cce_tuning, choose_strategy, fused_loss_pays, record_cce_stats
from comera_compile.kernels.linear_cross_entropy import linear_cross_entropy

N, D, V = 47, 31, 123  # not block multiples
PATHS = ["chunked", "sparse", "static", "fused"]


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
    ref_kw = {k: v for k, v in kw.items() if k in ("softcap", "ignore_index", "label_smoothing", "reduction")}
    go = torch.randn(loss.shape, generator=torch.Generator().manual_seed(go_seed)) + 1.5
    ref_loss, _, ref_grads = _ref64(x, w, b, t, go=go, **ref_kw)
    assert _rel(loss, ref_loss) < tol, (loss, ref_loss)
    grads = torch.autograd.grad((loss * go).sum(), leaves)
    for got, ref, name in zip(grads, ref_grads, "xwb"):
        assert got.dtype == x.dtype and got.shape == ref.shape
        assert _rel(got, ref) < tol, (name, _rel(got, ref))


@pytest.fixture
def small_tiles():
    """Tiles, chunks and buffers small enough that small problems take every multi-tile path."""
    with cce_tuning(fwd_block_m=16, fwd_block_n=32, fwd_block_k=16, bwd_block_m=16, bwd_block_n=16,
                    bwd_block_k=16, cons_block_d=16, group_v=2, fwd_group_m=2, dense_block_n=32,
                    fused_block_m=16, fused_block_n=32) as tuning:
        yield tuning


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
    _check("torch", x, w, b, t, 1e-5, strategy="chunked", memory_budget=20 * V * 4, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kw", OPTION_GRID)
def test_every_triton_path_matches_float64(small_tiles, path, kw):
    x, w, b, t = _inputs(bias=kw.get("reduction") != "sum")
    t[3] = kw.get("ignore_index", -100)
    # eps below any softmax value: the sparse path runs its rounds but drops nothing
    with record_cce_stats() as stats:
        _check("triton", x, w, b, t, 1e-5, strategy=path, filter_eps=1e-30, memory_budget=16 * V * 4, **kw)
    ran = {s.path for s in stats}
    chunked_applies = kw.get("reduction") != "none"
    if path == "chunked" and chunked_applies:
        assert ran == {"chunked"} and stats[0].chunks > 1, stats
    elif path == "static":
        assert ran == {"triton", path}, stats
    elif path == "fused":  # dX formed in the forward pass unless reduction "none" or label smoothing
        forms_dx = kw.get("reduction") != "none" and not kw.get("label_smoothing")
        assert [s.path for s in stats] == (["fused", "fused"] if forms_dx else ["triton", "fused"]), stats
    elif path == "sparse" and not (kw.get("softcap") and kw.get("label_smoothing")):
        assert ran == {"triton", "sparse"}, stats


@pytest.mark.parametrize("path", PATHS)
def test_fp16(path):
    x, w, b, t = _inputs(dtype=torch.float16)
    _check("triton", x, w, b, t, 5e-3, strategy=path, backward="exact")
    _check("torch", x, w, b, t, 5e-3, strategy=path)


@pytest.mark.parametrize("budget, fp32_acc", [(20 * V * 2, False), (V * D * 4 + 64 * V * 2, True)])
def test_chunked_dw_accumulation(budget, fp32_acc):
    """fp16 inputs: dW sums the chunks in fp32 when the buffer fits in the budget, else in fp16."""
    x, w, b, t = _inputs(dtype=torch.float16, n=150, scale=3.0)
    with cce_tuning(rows_block_v=32), record_cce_stats() as stats:  # several vocabulary steps per row
        _check("triton", x, w, b, t, 5e-3, strategy="chunked", memory_budget=budget)
    assert stats[0].chunks == (8 if not fp32_acc else 3), stats  # 20 rows; 64 rows beside the fp32 dW


@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("path", PATHS)
def test_tensor_train_head_rank_activations(path, d):
    """A TT head hands the op x = [N, r] rank activations and weight = R^T, a strided [V, r] view."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, d, generator=g)
    factor = torch.randn(d, 301, generator=g) / d**0.5  # R: [r, V]
    w = factor.t()
    t = torch.randint(0, 301, (70,), generator=g)
    assert w.stride() == (1, 301)
    with record_cce_stats() as stats:
        _check("triton", x, w, None, t, 1e-5, strategy=path, filter_eps=1e-30)
    if path != "chunked":
        assert stats[-1].path == path, stats


def test_auto_takes_the_fused_path_for_small_hidden_sizes(monkeypatch):
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    x, w, b, t = _inputs(d=32)
    with record_cce_stats() as stats:
        _check("auto", x, w, b, t, 1e-5, reduction="none")
    assert [s.path for s in stats] == ["triton", "fused"], stats
    monkeypatch.delenv("COMERA_FORCE_TRITON")
    with record_cce_stats() as stats:
        _check("auto", x, w, b, t, 1e-5, reduction="none")
    assert {s.path for s in stats} == {"torch"}, stats


def test_sparse_rounds_then_static(small_tiles):
    """A small tile buffer: several sparse rounds; nothing filtered away, so after two dense rounds
    the rest of the vocabulary goes through static chunks."""
    x, w, b, t = _inputs(n=70, scale=4.0)
    t[5] = -100
    with record_cce_stats() as stats:
        _check("triton", x, w, b, t, 1e-5, strategy="sparse", filter_eps=1e-30, label_smoothing=0.1,
               reduction="sum", memory_budget=16 * 16 * 4 * 10)
    (bwd,) = [s for s in stats if s.phase == "backward"]
    assert bwd.path == "sparse" and bwd.sparse_rounds == 2 and bwd.chunks > 0, bwd


def test_sparse_path_with_softcap_and_custom_ignore(small_tiles):
    x, w, b, t = _inputs(n=70, scale=4.0)
    t[[2, 9]] = 11
    with cce_tuning(dense_after_rounds=100, dense_density=2.0), record_cce_stats() as stats:
        _check("triton", x, w, b, t, 1e-5, softcap=3.0, ignore_index=11, filter_eps=1e-30,
               strategy="sparse", memory_budget=16 * 16 * 4 * 12)
    assert stats[-1].sparse_rounds > 1 and stats[-1].chunks == 0, stats


def test_filtered_drops_only_tiny_softmax(small_tiles):
    """Peaked softmax, fp16, default eps: tiles are skipped and the error stays small."""
    x, w, b, t = _inputs(dtype=torch.float16, bias=False, n=64, v=160, scale=1.0)
    w[:, 0] = torch.linspace(6.0, -6.0, 160).half()  # a few frequent words, a long tail
    x[:, 0] = 1.0
    t = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(3))
    with record_cce_stats() as stats:
        _check("triton", x, w, b, t, 1e-2, backward="filtered", strategy="sparse")
    assert stats[-1].kept_tiles < stats[-1].tiles, stats


@pytest.mark.parametrize("path", ["static", "fused", "chunked"])
def test_deterministic_is_bitwise_repeatable(small_tiles, path):
    x, w, b, t = _inputs(n=48)
    outs = []
    for _ in range(2):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(xr, wr, t, impl="triton", deterministic=True, strategy=path,
                                    memory_budget=16 * V * 4)
        outs.append((loss,) + torch.autograd.grad(loss, (xr, wr)))
    for a, b_ in zip(*outs):
        assert torch.equal(a, b_)


_SYNCS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("path", ["static", "fused", "chunked"])
def test_capture_safe_paths_never_read_device_values(small_tiles, monkeypatch, path):
    """The paths taken under CUDA-graph capture read no device value on the host (a host sync is
    illegal while capturing): run them with every reading method of torch.Tensor raising, and
    check they match the sparse path (the one that syncs) and the float64 reference."""
    x, w, b, t = _inputs(n=40, scale=4.0)
    t[5] = -100
    kw = dict(filter_eps=1e-30, label_smoothing=0.1, memory_budget=16 * V * 4)
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    sparse = linear_cross_entropy(xs, ws, t, bs, impl="triton", strategy="sparse", **kw)
    sparse_grads = torch.autograd.grad(sparse, (xs, ws, bs))

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync on a capture-safe path")

    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    with monkeypatch.context() as patch:
        for name in _SYNCS:
            patch.setattr(torch.Tensor, name, no_sync)
        loss = linear_cross_entropy(xr, wr, t, br, impl="triton", strategy=path, **kw)
        grads = torch.autograd.grad(loss, (xr, wr, br))
    assert _rel(loss, sparse) < 1e-6
    ref_loss, _, ref_grads = _ref64(x, w, b, t, label_smoothing=0.1)
    for got, alt, ref in zip(grads, sparse_grads, ref_grads):
        assert _rel(got, alt) < 1e-5 and _rel(got, ref) < 1e-5


def test_sync_patch_catches_the_sparse_path(monkeypatch):
    """The patch of the test above does see a host sync: the sparse rounds' one per round."""
    x, w, b, t = _inputs()
    xr = x.clone().requires_grad_()
    monkeypatch.setattr(torch.Tensor, "tolist", lambda *a: (_ for _ in ()).throw(AssertionError("sync")))
    loss = linear_cross_entropy(xr, w, t, b, impl="triton", strategy="sparse")
    with pytest.raises(AssertionError, match="sync"):
        loss.backward()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("path", ["auto", "chunked", "fused"])
def test_return_lse_and_z_loss_gradient(impl, path):
    """A differentiated lse: "chunked" formed the gradient without it, so the backward recomputes."""
    x, w, b, t = _inputs()
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    loss, lse = linear_cross_entropy(xr, wr, t, br, return_lse=True, impl=impl, softcap=4.0, strategy=path)
    assert lse.dtype == torch.float32 and lse.shape == (N,)
    ref_loss, ref_lse, ref_grads = _ref64(x, w, b, t, softcap=4.0, lse_weight=1e-2)
    assert _rel(loss, ref_loss) < 1e-5 and _rel(lse, ref_lse) < 1e-5
    grads = torch.autograd.grad(loss + 1e-2 * (lse**2).sum(), (xr, wr, br))
    for got, ref in zip(grads, ref_grads):
        assert _rel(got, ref) < 1e-5


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_chunked_second_backward_fails_loudly(path):
    """The backward scales a gradient formed in the forward in place (chunked: all of them; fused:
    dX): a second backward through the same graph raises autograd's error instead of returning
    rescaled values."""
    x, w, b, t = _inputs()
    xr = x.clone().requires_grad_()
    loss = linear_cross_entropy(xr, w, t, b, strategy=path)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


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
@pytest.mark.parametrize("path", ["auto", "chunked", "fused"])
def test_nan_and_inf_propagate_like_eager(impl, path):
    x, w, b, t = _inputs(bias=False)
    x[2, 5] = float("nan")
    x[9, 1] = float("inf")
    for reduction in ("none", "mean"):
        xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss = linear_cross_entropy(xr, w, t, reduction=reduction, impl=impl, strategy=path)
        ref = _eager(xe, w, None, t, reduction=reduction)
        assert torch.equal(loss.isnan(), ref.isnan())
        go = torch.ones_like(ref)
        (gx,) = torch.autograd.grad(loss, (xr,), go)
        (ge,) = torch.autograd.grad(ref, (xe,), go)
        assert torch.equal(gx.isnan().any(1), ge.isnan().any(1))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("path", ["chunked", "static", "fused"])
def test_non_contiguous_inputs(impl, path):
    x, w, b, t = _inputs()
    xs = torch.randn(D, 2 * N).t()[::2]  # strided rows and columns
    xs.copy_(x)
    ws = torch.empty(D, V).t()  # a transposed weight (tied-embedding style)
    ws.copy_(w)
    ts = torch.stack([t, t], 1)[:, 0]
    assert not (xs.is_contiguous() or ws.is_contiguous() or ts.is_contiguous())
    _check(impl, xs, ws, b, ts, 1e-5, strategy=path)


def test_no_grad_and_inference():
    x, w, b, t = _inputs()
    with torch.no_grad(), record_cce_stats() as stats:
        loss = linear_cross_entropy(x.requires_grad_(), w, t, b, strategy="chunked")
    assert not loss.requires_grad
    assert stats[0].path == "torch" and stats[0].phase == "forward"
    torch.testing.assert_close(loss, _eager(x, w, b, t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("path", ["auto", "chunked", "fused"])
def test_inside_torch_compile(impl, path):
    smoothing = 0.0 if path == "fused" else 0.1  # fused forms dX in the forward without smoothing

    def fn(x, w, b, t):
        h = torch.tanh(x)
        loss, lse = linear_cross_entropy(h, w, t, b, return_lse=True, label_smoothing=0.1, impl=impl)
        loss2 = linear_cross_entropy(h, w, t, b, label_smoothing=smoothing, impl=impl, strategy=path)
        return loss + 1e-3 * lse.pow(2).mean() + 0.5 * loss2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x, w, b, t = _inputs()
    args = [a.clone().requires_grad_() for a in (x, w, b)]
    args_e = [a.clone().requires_grad_() for a in (x, w, b)]
    out = compiled(*args, t)
    ref = fn(*args_e, t)
    torch.testing.assert_close(out, ref)
    for got, exp in zip(torch.autograd.grad(out, args), torch.autograd.grad(ref, args_e)):
        torch.testing.assert_close(got, exp)


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_chunked_under_inductor(path):
    """Gradients formed in the forward and scaled in the backward, compiled by Inductor."""
    x, w, b, t = _inputs()
    fn = torch.compile(lambda x, w, b: linear_cross_entropy(x, w, t, b, strategy=path), backend="inductor")
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    loss = fn(xr, wr, br)
    ref_loss, _, ref_grads = _ref64(x, w, b, t)
    assert _rel(loss, ref_loss) < 1e-5
    for got, ref in zip(torch.autograd.grad(loss, (xr, wr, br)), ref_grads):
        assert _rel(got, ref) < 1e-5


def test_dynamic_shapes_fake():
    compiled = torch.compile(
        lambda x, w, t: linear_cross_entropy(x, w, t, reduction="none", impl="torch"),
        backend="aot_eager", dynamic=True)
    for n in (17, 29):
        x, w, _, t = _inputs(n=n, bias=False)
        torch.testing.assert_close(compiled(x, w, t), _eager(x, w, None, t, reduction="none"))


@pytest.mark.parametrize("strategy, needs", [("auto", (False, False, False)), ("chunked", (True, True, True)),
                                             ("fused", (True, True, True))])
def test_opcheck(strategy, needs):
    x, w, b, t = _inputs(n=9, v=20, d=8)
    args = (x.requires_grad_(), w.requires_grad_(), t, b.requires_grad_(), 2.0, -100, 0.1, "mean",
            "filtered", 1e-4, False, "torch", strategy, -1, *needs)
    torch.library.opcheck(torch.ops.comera.linear_cross_entropy.default, args)


def test_argument_errors():
    x, w, b, t = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="backward"):
        linear_cross_entropy(x, w, t, backward="approx")
    with pytest.raises(ValueError, match="'chunked', 'sparse', 'static', 'fused'"):
        linear_cross_entropy(x, w, t, strategy="fast")
    with pytest.raises(ValueError, match="memory_budget"):
        linear_cross_entropy(x, w, t, memory_budget=-5)
    with pytest.raises(ValueError, match="same D"):
        linear_cross_entropy(x, w[:, :3], t)
    with pytest.raises(RuntimeError, match="dtype"):
        linear_cross_entropy(x, w.double(), t)


def test_options_are_checked_once_with_the_valid_values():
    with pytest.raises(ValueError, match=r"impl='cuda'; valid values: \['auto', 'triton', 'torch'\]"):
        LCEOptions(impl="cuda")
    with pytest.raises(ValueError, match=r"reduction='avg'; valid values: \['mean', 'sum', 'none'\]"):
        LCEOptions(reduction="avg")
    for bad, name in ((dict(softcap=-1.0), "softcap"), (dict(label_smoothing=1.5), "label_smoothing"),
                      (dict(filter_eps=-1e-3), "filter_eps"), (dict(filter_eps=float("nan")), "filter_eps"),
                      (dict(memory_budget=-2), "memory_budget")):
        with pytest.raises(ValueError, match=name):
            LCEOptions(**bad)
    x, w, b, t = _inputs()
    with pytest.raises(ValueError, match="filter_eps"):
        linear_cross_entropy(x, w, t, filter_eps=-1.0)
    # stored in the op's types: None stands for the defaults
    o = LCEOptions(softcap=None, ignore_index=7.0, label_smoothing=0, memory_budget=None, deterministic=1)
    assert (o.softcap, o.ignore_index, o.label_smoothing, o.memory_budget, o.deterministic) == (0.0, 7, 0.0, -1, True)
    assert type(o.softcap) is float and type(o.ignore_index) is int and type(o.deterministic) is bool
    with pytest.raises(ValueError, match="resolve"):
        o.op_args()  # filter_eps=None has no value until the dtype is known
    assert o.resolve(torch.bfloat16).filter_eps == 2.0**-12 and o.resolve(torch.float32).filter_eps == 2.0**-28


def test_options_match_the_op_schemas():
    """The ops' arguments after their tensors are LCEOptions' fields (read from the registered
    schemas), and the options survive the round trip through either op's argument tuple."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(LCEOptions)}
    for op, tensors in ((torch.ops.comera.linear_cross_entropy.default, 4),
                        (torch.ops.comera.linear_cross_entropy_backward.default, 8)):
        args = op._schema.arguments
        assert all("Tensor" in str(a.type) for a in args[:tensors])
        assert {a.name for a in args[tensors:]} == fields and len(args) - tensors == len(fields)
    o = LCEOptions(softcap=3.0, ignore_index=5, label_smoothing=0.1, reduction="sum", backward="exact",
                   filter_eps=1e-3, deterministic=True, impl="torch", strategy="static", memory_budget=1 << 20,
                   need_dx=True, need_db=True)
    assert LCEOptions.from_op_args(o.op_args()) == o
    assert LCEOptions.from_backward_op_args(o.backward_op_args()) == o
    forward = torch.ops.comera.linear_cross_entropy.default._schema.arguments[4:]
    assert [a.name for a in forward] == [f.name for f in dataclasses.fields(LCEOptions)]
    assert o.op_args()[[a.name for a in forward].index("strategy")] == "static"


def test_lce_options_live_in_cce_and_the_kernels_re_export_them():
    """LCEOptions has its home in comera_compile.cce (pure: no op) and the op module re-exports the same
    class without a warning; its impl values are the ops' (dispatch.IMPLS)."""
    import warnings

    import comera_compile.kernels.linear_cross_entropy as lce
    from comera_compile import cce
    from comera_compile.cce import options
    from comera_compile.kernels.dispatch import IMPLS

    assert "LCEOptions" in cce.__all__ and cce.LCEOptions is options.LCEOptions is LCEOptions
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lce.LCEOptions is cce.LCEOptions and lce.linear_cross_entropy is linear_cross_entropy
    assert options.IMPLS == IMPLS
    assert LCEOptions.__module__ == "comera_compile.cce.options"


@pytest.mark.parametrize("name", ["cce_tuning", "choose_strategy", "use_kept_fraction_store", "KeptFractionStore",
                                  "rates_for", "record_cce_stats", "decide_fused_loss", "CCETuning"])
def test_names_that_moved_to_cce_warn_from_the_kernels_module(name):
    """The cce names the op module used to re-export still resolve there, to the same objects, with a
    DeprecationWarning naming comera_compile.cce; nothing else resolves."""
    import comera_compile.kernels.linear_cross_entropy as lce
    from comera_compile import cce

    with pytest.warns(DeprecationWarning, match=rf"linear_cross_entropy\.{name} is deprecated.*comera_compile\.cce"):
        assert getattr(lce, name) is getattr(cce, name)
    with pytest.warns(DeprecationWarning, match="comera_compile.cce"):
        exec(f"from comera_compile.kernels.linear_cross_entropy import {name}", {})
    with pytest.raises(AttributeError):
        lce.no_such_name  # noqa: B018
    assert not [n for n in lce.__all__ if n in lce._MOVED]  # a star import never warns


def _source(module) -> str:
    import pathlib

    return pathlib.Path(module.__file__).read_text()


def test_every_dot_passes_the_one_precision_rule():
    """Every ``tl.dot`` in the kernels passes ``input_precision=DOT_PRECISION`` (without it fp32
    operands run in TF32 whatever torch is set to: about 1e-3 relative error, which the interpreter
    on the CPU does not show); every jitted function with a dot takes DOT_PRECISION, and the host sets
    it from ``dispatch.dot_precision`` only: no precision literal elsewhere."""
    import ast

    from comera_compile.kernels import linear_cross_entropy_kernels as kernels
    from comera_compile.kernels import linear_cross_entropy_paths as paths

    tree = ast.parse(_source(kernels))
    dots = 0
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "dot" and isinstance(n.func.value, ast.Name) and n.func.value.id == "tl"]
        if calls:
            assert "DOT_PRECISION" in [a.arg for a in fn.args.args], fn.name
        for call in calls:
            precision = [k.value for k in call.keywords if k.arg == "input_precision"]
            assert len(precision) == 1 and isinstance(precision[0], ast.Name) and precision[0].id == "DOT_PRECISION", (
                fn.name, call.lineno, ast.unparse(call))
        dots += len(calls)
    assert dots == _source(kernels).count("tl.dot(") >= 13
    host = ast.parse(_source(paths))
    set_at = [k for k in ast.walk(host) if isinstance(k, ast.keyword) and k.arg == "DOT_PRECISION"]
    assert set_at and all(isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "dot_precision"
                          for k in set_at), [ast.unparse(k) for k in set_at]
    for module in (kernels, paths):
        literals = [n.value for n in ast.walk(ast.parse(_source(module)))
                    if isinstance(n, ast.Constant) and n.value in ("ieee", "tf32", "tf32x3")]
        assert literals == [], (module.__name__, literals)


def test_target_rows_must_match_like_eager():
    """The raw op (what the cce pass calls) checks target.numel() == rows, the way eager does."""
    x, w, b, t = _inputs()
    with pytest.raises(ValueError, match="batch_size") as eager_err:
        _eager(x, w, b, t[:-2])
    for target in (t[:-2], t[None]):
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError, match="batch_size"):
                torch.ops.comera.linear_cross_entropy(x, w, target, b, 0.0, -100, 0.0, "mean", "filtered",
                                                      1e-4, False, impl)
    assert "batch_size" in str(eager_err.value)


@pytest.mark.parametrize("path", ["auto", "fused"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("grads", [(False, True, None), (False, True, False), (True, False, False),
                                   (True, True, True)])
def test_backward_for_a_subset_of_inputs(impl, grads, path):
    """An input that needs no gradient and no bias (or a bias that needs none): the op's empty
    outputs are distinct tensors (torch.library refuses outputs that alias each other)."""
    x, w, b, t = _inputs()
    need_x, need_w, need_b = grads
    leaves = [x.clone().requires_grad_(need_x), w.clone().requires_grad_(need_w),
              None if need_b is None else b.clone().requires_grad_(need_b)]
    loss = linear_cross_entropy(*leaves[:2], t, leaves[2], impl=impl, strategy=path)
    wanted = [a for a in leaves if a is not None and a.requires_grad]
    got = torch.autograd.grad(loss, wanted)
    ref_loss, _, ref_grads = _ref64(x, w, None if need_b is None else b, t)
    for g, ref in zip(got, [r for r, a in zip(ref_grads, leaves) if a is not None and a.requires_grad]):
        assert _rel(g, ref) < 1e-5


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_tokens(path, reduction):
    """No rows: eager's result (nan mean, zero sum, empty per-token loss) on every path."""
    x, w, b, t = _inputs(n=0)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(xr, wr, t, b, impl="triton", strategy=path, reduction=reduction)
    ref = _eager(xe, we, b, t, reduction=reduction)
    torch.testing.assert_close(loss, ref, equal_nan=True)
    go = torch.ones_like(ref)
    for got, exp in zip(torch.autograd.grad(loss, (xr, wr), go), torch.autograd.grad(ref, (xe, we), go)):
        torch.testing.assert_close(got, exp)


def test_tuning_and_stats_interfaces():
    with pytest.raises(TypeError, match="valid fields"):
        with cce_tuning(block=3):
            pass
    with cce_tuning(fused_max_d=8) as tuning:
        assert tuning.fused_max_d == 8 and isinstance(tuning, CCETuning)
    x, w, b, t = _inputs()
    with record_cce_stats() as outer:
        with record_cce_stats() as inner:
            linear_cross_entropy(x.requires_grad_(), w, t, b, strategy="static").backward()
        linear_cross_entropy(x, w, t, b)
    assert [s.phase for s in inner] == ["forward", "backward"] and len(outer) == 3


def test_cost_rule():
    """Small vocabularies and heads whose fused loss costs more than Inductor's are left alone, with
    the estimate as the reason; large heads and rank-r (tensor-train) heads pay."""
    bf16 = torch.bfloat16
    ok, reason = fused_loss_pays(4096, 768, 3, bf16, "cuda")
    assert not ok and "V=3" in reason and "ms" in reason
    assert fused_loss_pays(8192, 2304, 256000, bf16, "cuda") == (True, "")
    assert fused_loss_pays(8192, 32, 128256, bf16, "cuda") == (True, "")
    assert choose_strategy(8192, 2304, 256000, bf16) == "sparse"  # filtering skips most tiles
    assert choose_strategy(8192, 4096, 128256, bf16) == "chunked"  # flat logits keep half the tiles
    # rank-32 head: fused (dX formed in the forward pass) 3.0 ms vs chunked 3.8 ms on the H200
    assert choose_strategy(8192, 32, 128256, bf16) == "fused"
    assert choose_strategy(8192, 32, 128256, bf16, capture=True) == "fused"
    assert fused_loss_pays(8192, 32, 128256, bf16, "cuda", capture=True) == (True, "")
    # The user's fp32 upcast of the logits costs the unfused loss fp32 traffic: with it the Llama-style
    # LM's head (D 1024) pays (step 34.6 vs 34.8 ms on the H200), without it and for D 4096 it is
    # slower (by speed alone: the memory policy fuses both, see test_memory_policy_on_the_gpu).
    assert fused_loss_pays(8192, 1024, 128256, bf16, "cuda", upcast=True, policy="speed") == (True, "")
    ok, reason = fused_loss_pays(8192, 1024, 128256, bf16, "cuda", policy="speed")
    assert not ok and "D=1024" in reason and "upcast" not in reason
    ok, reason = fused_loss_pays(8192, 4096, 128256, bf16, "cuda", upcast=True, policy="speed")
    assert not ok and "(fp32 upcast)" in reason
    assert choose_strategy(8192, 2304, 256000, bf16, capture=True) != "sparse"
    assert choose_strategy(8192, 4096, 128256, bf16, capture=True) not in ("sparse", "chunked")
    assert choose_strategy(8192, 4096, 128256, bf16, reduction="none") != "chunked"
    assert choose_strategy(8192, 4096, 128256, torch.float16) != "chunked"


# --- the policy: fuse for memory at a small stated slowdown, or for speed; each device's rates -----

def test_logits_bytes_are_what_the_unfused_loss_holds():
    from comera_compile.cce import format_bytes, logits_bytes

    assert logits_bytes(2048, 131072, torch.float32) == 1 << 30  # the head: 1 GiB
    assert logits_bytes(2048, 131072, torch.bfloat16) == 1 << 29  # 16-bit logits are saved as they are
    assert [format_bytes(n) for n in (1 << 30, 2_104_000_000, 64 << 20, 65_536_000, 7000)] == [
        "1 GiB", "1.96 GiB", "64 MiB", "62.5 MiB", "7 KiB"]
    # never in exponent notation ("1e+03 MiB"): whole numbers from 100 on
    assert [format_bytes(n) for n in (1000 << 20, 1023 << 20, (1 << 30) * 1500, 999 << 20, 99 << 20)] == [
        "1000 MiB", "1023 MiB", "1500 GiB", "999 MiB", "99 MiB"]


def test_the_cpu_model_prices_the_torch_reference():
    """Off the GPU the op runs its torch reference: the cost model prices that (CPU rates), whose paths
    are the chunked loop (gradient in the forward) and an exact recompute ("static"); the H200's
    rates price the Triton paths."""
    from comera_compile.cce import estimate_seconds, op_profile
    from comera_compile.devices import CPU, H200

    # the Triton paths at the GPU's profile (also under the interpreter, on the CPU), the reference at the CPU's
    assert op_profile("cuda", triton=True) is H200 and op_profile(torch.device("cpu"), triton=True) is H200
    assert op_profile("cpu", triton=False) is CPU and op_profile("cuda", triton=False) is CPU
    assert set(estimate_seconds(2048, 512, 131072, torch.float32, profile=CPU)) == {"unfused", "chunked", "static"}
    assert set(estimate_seconds(64, 8, 3, torch.float32, profile=CPU, training=False)) == {"unfused", "static"}
    assert choose_strategy(2048, 512, 131072, torch.float32, profile=CPU) == "chunked"
    assert choose_strategy(8192, 32, 128256, torch.bfloat16, profile=CPU) == "chunked"  # the H200 picks "fused"
    assert choose_strategy(8192, 32, 128256, torch.bfloat16, profile=H200) == "fused"
    assert choose_strategy(2048, 512, 131072, torch.float16, profile=CPU) == "static"
    assert choose_strategy(2048, 512, 131072, torch.float32, reduction="none", profile=CPU) == "static"


def test_auto_on_the_cpu_takes_the_path_the_cpu_model_picks():
    """On CPU tensors the op runs its torch reference and prices it at the CPU's rates: "auto" takes
    the chunked loop, which forms the gradient in the forward, so the backward recomputes nothing (the
    H200's rates pick the fused path at this small D, whose backward recomputes dW)."""
    x, w, b, t = _inputs(d=32)
    with record_cce_stats() as stats:
        linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), t, b).backward()
    assert [(s.phase, s.path) for s in stats] == [("forward", "torch")], stats
    assert choose_strategy(N, 32, V, torch.float32) == "fused"


def test_memory_policy_fuses_the_1_gib_cpu_head():
    """The issue's head (D 512, fp32, 128k vocabulary x 2048 tokens: 1 GiB of logits) on the CPU: by
    the CPU's rates the fused loss is a few percent slower than Inductor's (measured 1.08x), within the
    memory policy's 1.15x: the default fuses it; "speed" does not. It was left unfused at the H200's
    rates, "estimated at 2.93 ms against 2.22 ms": the speed policy on the GPU still says so."""
    from comera_compile.devices import CPU
    from comera_compile.cce import MEMORY_POLICY_SLOWDOWN, decide_fused_loss

    head = (2048, 512, 131072, torch.float32)
    decision = decide_fused_loss(*head, rates=CPU)
    assert decision.pays and decision.reason == "" and decision.strategy == "chunked"
    assert decision.logits_bytes == 1 << 30 and 1.0 < decision.slowdown <= MEMORY_POLICY_SLOWDOWN
    assert fused_loss_pays(*head, "cpu") == (True, "")
    ok, reason = fused_loss_pays(*head, "cpu", policy="speed")
    assert not ok and "logits 1 GiB float32 (cce_policy='speed')" in reason
    ok, reason = fused_loss_pays(*head, "cuda", policy="speed")
    assert not ok and "estimated at 2.93 ms" in reason and "against 2.22 ms" in reason


def test_memory_policy_threshold_and_slowdown_cap():
    """The memory rule applies above the threshold only (strictly), and never beyond 1.15x: the CPU's
    bf16 head (its GEMMs run at the AMX rate unfused, in fp32 in the reference) stays unfused."""
    from comera_compile.devices import CPU
    from comera_compile.cce import decide_fused_loss

    head = (2048, 512, 131072, torch.float32)
    assert decide_fused_loss(*head, memory_threshold=(1 << 30) - 1, rates=CPU).pays
    below = decide_fused_loss(*head, memory_threshold=1 << 30, rates=CPU)
    assert not below.pays and below.reason.startswith("logits 1 GiB float32: below cce_memory_threshold 1 GiB, and "
                                                      "the fused loss is estimated at")
    bf16 = decide_fused_loss(2048, 512, 131072, torch.bfloat16, rates=CPU)
    assert not bf16.pays and bf16.slowdown > 1.15
    assert bf16.reason.startswith("logits 512 MiB bfloat16 would be avoided, but the fused loss is estimated at")
    assert bf16.reason.endswith(f"{bf16.slowdown:.2f}x, more than the 1.15x the memory policy allows")


def test_memory_policy_on_the_gpu():
    """At the H200's rates the default fuses the heads a speed rule declines for a few percent (the
    Llama-style LM's head without an upcast, 1.96 GiB of bf16 logits) and still leaves a 3-class
    classifier head alone, naming its logits' size."""
    bf16 = torch.bfloat16
    assert fused_loss_pays(8192, 1024, 128256, bf16, "cuda") == (True, "")
    assert fused_loss_pays(8192, 4096, 128256, bf16, "cuda", upcast=True) == (True, "")
    ok, reason = fused_loss_pays(4096, 768, 3, bf16, "cuda")
    assert not ok and reason.startswith("logits 24 KiB bfloat16: below cce_memory_threshold 64 MiB")


def test_unknown_policy_names_the_choices():
    from comera_compile.cce import decide_fused_loss

    with pytest.raises(ValueError, match=r"policy='fast'; valid values: \['memory', 'speed'\]"):
        decide_fused_loss(64, 8, 3, torch.float32, policy="fast")


def test_memory_budget_option():
    from comera_compile import CompileOptions
    from comera_compile.options import OptionsError

    assert CompileOptions(cce_memory_budget=1 << 30).cce_memory_budget == 1 << 30
    for bad in (-1, 1.5, True):
        with pytest.raises(OptionsError, match="cce_memory_budget"):
            CompileOptions(cce_memory_budget=bad)


@pytest.mark.parametrize("max_d", [16, 128])
@pytest.mark.parametrize("kw", [dict(), dict(softcap=4.0, label_smoothing=0.1), dict(softcap=3.0, ignore_index=7)])
def test_fused_path_in_one_or_several_hidden_chunks(max_d, kw):
    """D = 31: one chunk (each loaded tile serves the logits and the product) or two chunks of 16
    columns (each recomputing the logits) give the same float64-accurate loss and gradients; the
    forward takes one K step too (target logit gathered on the host, ignored rows included)."""
    x, w, b, t = _inputs()
    t[3] = kw.get("ignore_index", -100)
    with cce_tuning(fused_max_d=max_d, fused_block_m=16, fused_block_n=32), record_cce_stats() as stats:
        _check("triton", x, w, b, t, 1e-5, strategy="fused", **kw)
    forward = "triton" if kw.get("label_smoothing") else "fused"  # fused: dX formed in the forward
    assert [s.path for s in stats] == [forward, "fused"], stats


# --- never a wrong number: precision at the edges ----------------------------------------------

def _max_elem_rel(got, ref):
    """The largest per-element relative error over the entries above 1e-3 of the largest one."""
    got, ref = got.detach().double(), ref.detach().double()
    big = ref.abs() > 1e-3 * ref.abs().max()
    return float(((got - ref).abs()[big] / ref.abs()[big]).max())


@pytest.mark.parametrize("impl,path", [("torch", "auto")] + [("triton", p) for p in PATHS])
def test_confident_rows_never_give_a_negative_loss(impl, path):
    """The target logit far above the rest: eager's per-token loss is exactly 0 on most rows. The
    kernels form the lse apart from the target logit; the difference must never go below zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    t = torch.randint(0, 300, (64,), generator=g)
    w = torch.randn(300, 32, generator=g) * 0.1
    w[t] = 3.0 * x  # target logit ~ 3 |x|^2 ~ 96, the others ~ 0
    eager = F.cross_entropy(F.linear(x, w), t, reduction="none")
    assert (eager == 0).sum() > 32  # the case is the one it claims to be
    for kw in (dict(reduction="none"), dict(reduction="none", label_smoothing=0.0, softcap=200.0)):
        loss = linear_cross_entropy(x, w, t, impl=impl, strategy=path, **kw)
        assert (loss >= 0).all(), (loss.min(), int((loss < 0).sum()))
        torch.testing.assert_close(loss, F.cross_entropy(200.0 * torch.tanh(F.linear(x, w) / 200.0), t,
                                                         reduction="none") if "softcap" in kw else eager,
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("offset", [1e2, 1e4])
@pytest.mark.parametrize("impl,path", [("torch", "auto")] + [("triton", p) for p in PATHS])
def test_gradients_at_large_logits_are_as_exact_as_eager(impl, path, offset):
    """Logits around ``offset`` (a shared offset plus O(1) differences, so the softmax is not one-hot).
    Any fp32 computation rounds each logit by about |z| * 2**-24, which moves each probability by
    that much relative: at 1e4 eager's own per-element gradient error against float64 is ~3 %. The
    recomputed logits of the backward add nothing measurable to that bound: each path's per-element
    error stays within 1.5x eager fp32's (measured: 1.0-1.1x)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g)
    w = torch.randn(300, 32, generator=g) / 32**0.5
    t = torch.randint(0, 300, (64,), generator=g)
    x[:, 0], w[:, 0] = offset**0.5, offset**0.5
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.autograd.grad(F.cross_entropy(F.linear(xd, wd), t), (xd, wd))
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager = torch.autograd.grad(F.cross_entropy(F.linear(xe, we), t), (xe, we))
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(linear_cross_entropy(xc, wc, t, impl=impl, strategy=path, backward="exact"), (xc, wc))
    for name, a, e, r in zip("xw", got, eager, ref):
        bound = 1.5 * _max_elem_rel(e, r) + 1e-6
        assert _max_elem_rel(a, r) <= bound, (name, _max_elem_rel(a, r), _max_elem_rel(e, r))


@pytest.mark.parametrize("impl,path", [("torch", "auto")] + [("triton", p) for p in PATHS])
def test_fp32_bias_over_fp16_logits_is_added_in_fp32(small_tiles, impl, path):
    """``F.cross_entropy((x @ W.T).float() + b)`` with x, W fp16 and b fp32 (|b| ~ 20): the op takes the
    fp32 bias as it is and adds it in fp32; rounding it to fp16 first costs ~100x eager's error."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(47, 16, generator=g).half(), torch.randn(123, 16, generator=g).half()
    b = torch.randn(123, generator=g) * 20
    t = torch.randint(0, 123, (47,), generator=g)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    loss = linear_cross_entropy(*leaves[:2], t, leaves[2], impl=impl, strategy=path, backward="exact",
                                memory_budget=16 * 123 * 4)
    grads = torch.autograd.grad(loss, leaves)
    el = [a.clone().requires_grad_() for a in (x, w, b)]
    eager = F.cross_entropy(F.linear(el[0], el[1]).float() + el[2], t)
    eager_grads = torch.autograd.grad(eager, el)
    ref_loss, _, ref_grads = _ref64(x, w, b, t)
    assert abs(float(loss.detach()) - float(ref_loss)) <= 2 * abs(float(eager.detach()) - float(ref_loss)) + 1e-6
    assert grads[2].dtype == torch.float32
    for name, a, e, r in zip("xwb", grads, eager_grads, ref_grads):
        # the chunked, sparse and static paths hold the logits' gradient in the input dtype (fp16: 2**-11)
        # for their GEMMs, as eager does for dx and dW, and sum db from it; eager keeps db's in fp32
        floor = 2.0**-11 if (name == "b" and path != "fused" and impl == "triton") else 1e-6
        assert _rel(a, r) <= 2 * _rel(e, r) + floor, (name, _rel(a, r), _rel(e, r))
