"""The block tensor-train's token contraction (``tt_runtime.btt_linear``, the planner's ``"blocks"``
strategy) against an independent float64 reference: the matrix assembled block by block from the
definition ``M[(j, b), (c, a)] = sum_k R[j, b, c, k] g[k] L[k, c, j, a]``, then a plain product. Forward
and every gradient (x, both cores, the gate, the bias), ``x @ M`` and ``x @ Mᵀ``, padded sizes; the
planner's choice and costs; the pass rewriting a btt Linear when the blocks are cheaper, against eager."""

from __future__ import annotations

import copy

import pytest
import torch

from comera_compile.kernels import tt_runtime
from comera_compile.tensorize import TTConfig, iter_tt_layers, tensorize_
from comera_compile.tt import TTSpec, join_flat
from comera_compile.tt.planner import plan_btt_linear, plan_linear
from wide_model import Wide, compiled_step_matches_eager  # noqa: E402  (tests/kernels/wide_model.py)


def reference_m(R, g, L, spec):
    """``M`` [rows, cols] block by block (row block j, column block c), differentiable, cropped."""
    b1, c = spec.row_modes[0], spec.col_modes[0]
    full = torch.cat([torch.cat([R[j, :, k, :] @ torch.diag(g) @ L[:, k, j, :] for k in range(c)], dim=1)
                      for j in range(b1)], dim=0)
    return full[: spec.rows, : spec.cols]


# row_modes, col_modes, rank, rows, cols (below the padded size where odd)
CASES = [((4, 3), (3, 5), 2, 12, 15), ((4, 3), (3, 5), 2, 11, 13), ((2, 5), (4, 2), 1, 10, 8), ((3, 2), (2, 3), 3, 5, 6)]


@pytest.mark.parametrize("x_times_m", [True, False], ids=["x@M", "x@Mt"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}|{c[1]}r{c[2]}-{c[3]}x{c[4]}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_btt_linear_matches_the_float64_reference_forward_and_backward(case, x_times_m, bias):
    rm, cm, r, rows, cols = case
    spec = TTSpec("btt", rm, cm, (1, r, 1), rows, cols, True)
    gen = torch.Generator().manual_seed(0)
    R = torch.randn(*spec.core_shapes[0], generator=gen, dtype=torch.float64, requires_grad=True)
    L = torch.randn(*spec.core_shapes[1], generator=gen, dtype=torch.float64, requires_grad=True)
    g = (torch.rand(r, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    fin, fout = (rows, cols) if x_times_m else (cols, rows)
    x = torch.randn(2, 3, fin, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(fout, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    dy = torch.randn(2, 3, fout, generator=gen, dtype=torch.float64)

    m = reference_m(R, g, L, spec)
    want = x @ (m if x_times_m else m.t()) + (b if bias else 0)
    want_grads = torch.autograd.grad(want, [x, R, L, g] + ([b] if bias else []), dy)

    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, R, L, g)]
        xb = b.detach().to(dtype).requires_grad_() if bias else None
        core_flat, gate_flat = join_flat(leaves[1:3], [leaves[3]])
        got = tt_runtime.btt_linear(leaves[0], core_flat, gate_flat, spec, x_times_m, xb, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want.detach(), rtol=tol, atol=tol)
        got_grads = torch.autograd.grad(got, leaves + ([xb] if bias else []), dy.to(dtype))
        for name, gg, wg in zip(["x", "R", "L", "g", "bias"], got_grads, want_grads):
            torch.testing.assert_close(gg.double(), wg, rtol=tol, atol=tol, msg=f"d{name} in {dtype}")


@pytest.mark.parametrize("cs", [(5,), (5, 2, 3)], ids=["one-layer", "three-layers"])
def test_btt_blocks_op_passes_opcheck(cs):
    """comera::btt_blocks: fake shapes and strides, autograd registration (torch.library.opcheck), for
    one second core and for three (layers sharing the input, each its own column blocks and width)."""
    b1, b2, r, n = 3, 4, 2, 7
    gen = torch.Generator().manual_seed(2)
    args = (torch.randn(n, b1 * b2, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(b1, b2, sum(cs) * r, generator=gen, dtype=torch.float64, requires_grad=True),
            [torch.randn(c, b1 * r, 3 + i, generator=gen, dtype=torch.float64, requires_grad=True)
             for i, c in enumerate(cs)], r)
    torch.library.opcheck(torch.ops.comera.btt_blocks.default, args)


def _blocks_reference(x, first, seconds, r):
    """The outputs of comera::btt_blocks written out with einsum, block by block (float64)."""
    n, (b1, b2) = x.shape[0], first.shape[:2]
    t = torch.einsum("njk,jkm->njm", x.view(n, b1, b2), first)  # [n, b1, C r]
    t = t.view(n, b1, -1, r)
    ys, c0 = [], 0
    for s in seconds:
        c = s.shape[0]
        part = t[:, :, c0:c0 + c, :].permute(0, 2, 1, 3).reshape(n, c, b1 * r)  # [n, c, b1 r]
        ys.append(torch.einsum("ncm,cma->nca", part, s).reshape(n, -1))
        c0 += c
    return ys


@pytest.mark.parametrize("unused", [None, 1], ids=["all-used", "one-output-unused"])
def test_btt_blocks_outputs_and_gradients_against_an_einsum_reference(unused):
    """Three layers through one comera::btt_blocks call: each output and every gradient against the
    float64 einsum written block by block; an output the loss never reads gets no gradient and
    changes nothing."""
    b1, b2, r, n, cs = 4, 3, 2, 6, (3, 5, 2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, b1 * b2, generator=gen, dtype=torch.float64)
    first = torch.randn(b1, b2, sum(cs) * r, generator=gen, dtype=torch.float64)
    seconds = [torch.randn(c, b1 * r, 2 + i, generator=gen, dtype=torch.float64) for i, c in enumerate(cs)]
    leaves = [t.clone().requires_grad_() for t in [x, first] + seconds]
    ref_leaves = [t.clone().requires_grad_() for t in [x, first] + seconds]
    got = torch.ops.comera.btt_blocks(leaves[0], leaves[1], leaves[2:], r)[:-1]
    want = _blocks_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2:], r)
    dys = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    loss = sum((g * d).sum() for i, (g, d) in enumerate(zip(got, dys)) if i != unused)
    ref = sum((w * d).sum() for i, (w, d) in enumerate(zip(want, dys)) if i != unused)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    wants = torch.autograd.grad(ref, ref_leaves, allow_unused=True)  # the unused output's core: None
    for g, w, leaf in zip(torch.autograd.grad(loss, leaves), wants, leaves):
        torch.testing.assert_close(g, torch.zeros_like(leaf) if w is None else w)


def test_btt_linear_fp16_is_close_to_the_reference():
    spec = TTSpec("btt", (4, 4), (4, 4), (1, 2, 1), 16, 16, True)
    gen = torch.Generator().manual_seed(1)
    R, L = (torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5 for s in spec.core_shapes)
    g = torch.ones(2, dtype=torch.float64)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    want = x @ reference_m(R, g, L, spec)
    core_flat, gate_flat = join_flat([R.float(), L.float()], [g.float()])
    got = tt_runtime.btt_linear(x.half(), core_flat, gate_flat, spec, True, None, torch.float16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_planner_costs_both_and_picks_the_blocks_for_large_blocks():
    small = TTSpec("btt", (4, 3), (3, 5), (1, 2, 1), 11, 14, True)
    plan = plan_btt_linear(small, 64)
    assert plan.strategy == "dense" and [n for n, _ in plan.candidates] == ["dense", "blocks"]
    wide = TTSpec("btt", (64, 64), (64, 64), (1, 1, 1), 4096, 4096, True)
    n = 8192
    plan = plan_btt_linear(wide, n)
    assert plan.strategy == "blocks" and {k for k, _ in plan.candidates} == {"blocks", "dense"}
    fwd = sum(s.flops for s in plan.steps_in("forward"))
    assert fwd == 2 * n * 1 * (4096 * 64 + 4096 * 64)  # 2 n r (P c + Q b1)
    assert sum(s.flops for s in plan.steps_in("backward")) == 2 * fwd
    assert "blocks ~" in plan.summary() and "other: dense ~" in plan.summary()
    assert "R [b1, b2, c, r]" in plan.describe() and "T = X·(R g)" in plan.describe()
    assert plan_btt_linear(wide.with_ranks((1, 1, 1)), n) is plan  # cached: rows, cols, transpose do not matter
    with pytest.raises(ValueError, match="plan_btt_linear"):
        plan_linear(wide, n)
    with pytest.raises(ValueError, match="plan_btt_linear plans a 'btt' layer"):
        plan_btt_linear(TTSpec("ttm", (4, 4), (4, 4), (1, 2, 1), 16, 16, True), n)


@pytest.mark.parametrize("merges", ["inductor", "opaque"])
def test_pass_contracts_the_tokens_through_a_wide_btt_layer_and_matches_eager(merges):
    """A btt Linear wide enough (2048, blocks of 64, rank 4) that the blocks beat forming the weight:
    the blocks run as comera::btt_blocks, whatever tt_merges says."""
    torch.manual_seed(0)
    eager = Wide(2048)
    tensorize_(eager, TTConfig(fmt="btt", rank=4, modes=((32, 64), (32, 64)), min_size=0),
               filter_fn=lambda mod, fqn: fqn == "fc")
    (layer,) = iter_tt_layers(eager)
    assert plan_btt_linear(layer.spec, 16).strategy == "blocks"
    from comera_compile.kernels import btt_blocks

    calls = []
    forward = btt_blocks.current_impl().blocks_forward
    with btt_blocks.use_impl(blocks_forward=lambda *a: calls.append(1) or forward(*a)):
        text = compiled_step_matches_eager(eager, torch.randn(4, 4, 2048), tt_merges=merges)
    assert calls
    assert "btt 2048->2048, blocks [32x64]|[32x64] at rank 4: blocks ~" in text and "other: dense ~" in text
    assert "marker op" not in text and "still forms a dense weight" not in text


# ------------------------------------------------------------------ comera::btt_swap (the regrouping copy)

SWAP_SHAPES = [(5, 1, 7, 3), (3, 4, 2, 1), (70, 2, 9, 4), (9, 3, 66, 1), (4, 2, 5, 70), (1, 1, 1, 1), (6, 0, 2, 2)]


@pytest.mark.parametrize("shape", SWAP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("widen", [True, False], ids=["wide", "narrow"])
def test_swap_kernel_matches_the_permute(shape, dtype, widen):
    """The Triton kernel (interpreter) against permute(2, 1, 0, 3): K below, at and above the tile's 64,
    ragged tiles on every axis, an empty tensor; exact (a copy). ``widen``: the K elements moved as
    int32 / int64 where their bytes allow (fp16 K = 4: one int64; fp32 K = 70: 35; fp16 K = 70: 35
    int32; K = 1 and fp16 K = 3: as they are)."""
    from comera_compile.kernels.btt_swap import swap_blocks

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = x.permute(2, 1, 0, 3).contiguous()
    got = swap_blocks(x, impl="triton", widen=widen)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(swap_blocks(got, impl="triton", widen=widen), x)  # its own inverse


TOKEN_SWAP_SHAPES = [(5, 7, 3, 1), (64, 9, 96, 1), (130, 3, 5, 1), (9, 3, 66, 1), (1, 1, 1, 1), (6, 0, 2, 1),
                     (4, 5, 3, 2), (3, 6, 2, 4)]


@pytest.mark.parametrize("shape", TOKEN_SWAP_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tile", [1, 128, 2048, 32768])
def test_the_token_tiled_swap_matches_the_permute(shape, dtype, tile):
    """The kernel with tiles of several positions m (interpreter) against permute(2, 1, 0, 3): A and B
    below, at and above the 128 a tile spans, M not a multiple of the tile's positions, an empty tensor;
    K = 2 and 4 in fp16 widen to one integer (the token-tiled kernel), fp32 K = 2 to one int64, fp32 K = 4
    to two (the other kernel). Exact (a copy), and its own inverse."""
    from comera_compile.kernels.btt_swap import _swap_triton

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.permute(2, 1, 0, 3).contiguous()
    got = _swap_triton(x, True, tile)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(_swap_triton(got, True, tile), x)


def test_token_tiles_span_a_and_b_and_fill_the_tile_with_positions():
    from comera_compile.kernels.btt_swap import token_tiles

    assert token_tiles(64, 64, 32768) == (64, 4, 64)  # bf16: 4 x 64 x 64 x 2 bytes
    assert token_tiles(64, 96, 32768) == (64, 2, 128)  # B padded to 128: 2 positions fill 32 KiB
    assert token_tiles(64, 64, 32768, itemsize=8) == (64, 1, 64)  # rank 4 widened to int64: one position
    assert token_tiles(200, 3, 8192) == (128, 8, 4)  # A beyond 128 takes two tiles; 8,192 / (2 x 512) = 8
    assert token_tiles(64, 64, 1) == (64, 1, 64)  # never fewer than one position
    from comera_compile.kernels.btt_swap import token_warps

    assert [token_warps(t) for t in (2048, 16384, 32768, 65536)] == [4, 4, 8, 8]


def test_the_swap_tile_comes_from_the_environment_and_a_bad_value_names_the_variable(monkeypatch):
    """COMERA_BTT_SWAP_TILE (bytes) picks the kernel at each call (unset: DEFAULT_TILE); the result is the same;
    a value that is no count of bytes raises, naming the variable and what it takes."""
    from comera_compile.kernels import btt_swap as mod

    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    x = torch.randn(6, 5, 7, 1)
    want = x.permute(2, 1, 0, 3).contiguous()
    launched = []
    for name in ("_swap_kernel", "_swap_tokens_kernel"):
        kernel = getattr(mod, name)
        monkeypatch.setattr(mod, name, _Recorder(kernel, name, launched))
    monkeypatch.delenv(mod.TILE_ENV, raising=False)
    assert mod.default_tile() == mod.DEFAULT_TILE
    for value, kernel in (("0", "_swap_kernel"), ("8192", "_swap_tokens_kernel"), (" 256 ", "_swap_tokens_kernel")):
        monkeypatch.setenv(mod.TILE_ENV, value)
        launched.clear()
        assert torch.equal(mod.swap_blocks(x, impl="triton"), want)
        assert launched == [kernel], value
    for bad in ("-1", "big", "1.5"):
        monkeypatch.setenv(mod.TILE_ENV, bad)
        with pytest.raises(ValueError, match=r"COMERA_BTT_SWAP_TILE=.*expected a number >= 0 \(bytes"):
            mod.swap_blocks(x, impl="triton")


class _Recorder:
    """A Triton kernel's stand-in that records its launches by name and launches the kernel."""

    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(self.name)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_widened_view_holds_the_same_bytes():
    """What the kernel moves when it widens: [A, M, B, K] as [A, M, B, K'] of int64 / int32, K' = K x
    itemsize / width; no view where no wider integer divides the row."""
    from comera_compile.kernels import btt_swap

    assert btt_swap.widened(torch.zeros(2, 3, 4, 4, dtype=torch.bfloat16)).shape == (2, 3, 4, 1)
    assert btt_swap.widened(torch.zeros(2, 3, 4, 4, dtype=torch.bfloat16)).dtype == torch.int64
    assert btt_swap.widened(torch.zeros(2, 3, 4, 6, dtype=torch.float16)).dtype == torch.int32
    assert btt_swap.widened(torch.zeros(2, 3, 4, 2, dtype=torch.float32)).shape == (2, 3, 4, 1)
    for x in (torch.zeros(2, 3, 4, 1, dtype=torch.bfloat16), torch.zeros(2, 3, 4, 3, dtype=torch.float16),
              torch.zeros(2, 3, 4, 1, dtype=torch.float32)):
        assert btt_swap.widened(x) is x


def test_swap_op_backward_swaps_back_and_checks_its_input():
    from comera_compile.kernels.btt_swap import swap_blocks

    x = torch.randn(3, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.comera.btt_swap, (x,))
    with pytest.raises(ValueError, match=r"expected a 4-D tensor \[A, M, B, K\], got shape \(3, 4\)"):
        swap_blocks(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="impl='fast'; valid values"):
        swap_blocks(x.detach(), impl="fast")


def test_btt_linear_with_the_swap_kernel_matches_the_reference(monkeypatch):
    """The whole blocks path with the Triton swap (interpreter, forced), forward and backward, fp32."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    rm, cm, r, rows, cols = (4, 3), (3, 5), 2, 11, 13
    spec = TTSpec("btt", rm, cm, (1, r, 1), rows, cols, True)
    gen = torch.Generator().manual_seed(3)
    R = torch.randn(*spec.core_shapes[0], generator=gen, dtype=torch.float64, requires_grad=True)
    L = torch.randn(*spec.core_shapes[1], generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.rand(r, generator=gen, dtype=torch.float64).requires_grad_()
    x = torch.randn(6, rows, generator=gen, dtype=torch.float64, requires_grad=True)
    want = x @ reference_m(R, g, L, spec)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, R, L, g], dy)
    leaves = [t.detach().float().requires_grad_() for t in (x, R, L, g)]
    core_flat, gate_flat = join_flat(leaves[1:3], [leaves[3]])
    got = tt_runtime.btt_linear(leaves[0], core_flat, gate_flat, spec, True, None, torch.float32)
    torch.testing.assert_close(got.double(), want.detach(), rtol=2e-5, atol=2e-5)
    for name, gg, wg in zip("xRLg", torch.autograd.grad(got, leaves, dy.float()), want_grads):
        torch.testing.assert_close(gg.double(), wg, rtol=2e-5, atol=2e-5, msg=f"d{name}")


def test_a_failing_swap_kernel_raises_at_every_call_and_switches_nothing(monkeypatch):
    """No process-wide switch: a kernel that fails raises (impl='auto' and 'triton' alike), and a later
    call runs the kernel again; impl='torch' takes the permute."""
    from comera_compile.kernels import btt_swap as mod

    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    calls = []

    def broken(x, widen=True):
        calls.append(1)
        raise RuntimeError("no kernel here")

    x = torch.randn(3, 2, 4, 5)
    with mod.use_impl(swap_kernel=broken):
        for impl in ("auto", "auto", "triton"):
            with pytest.raises(RuntimeError, match="no kernel here"):
                mod.swap_blocks(x, impl=impl)
        assert len(calls) == 3
        assert torch.equal(mod.swap_blocks(x, impl="torch"), x.permute(2, 1, 0, 3).contiguous())
    assert torch.equal(mod.swap_blocks(x), x.permute(2, 1, 0, 3).contiguous())  # the real kernel runs again


def test_swap_never_returns_a_view_of_its_input():
    """With A or B of 1 the permute is already contiguous; the op must still return a new tensor (a custom
    op may not alias its input). Found by the tt fuzzer (a rank-1 btt layer over one token, blocks pinned)."""
    from comera_compile.kernels.btt_swap import swap_blocks

    for shape in ((1, 1, 3, 4), (3, 1, 1, 4), (1, 2, 1, 1)):
        x = torch.randn(*shape)
        y = swap_blocks(x)
        assert y.data_ptr() != x.data_ptr() and torch.equal(y, x.permute(2, 1, 0, 3))
        assert torch.ops.comera.btt_swap(x).data_ptr() != x.data_ptr()


@pytest.mark.parametrize("d, hidden, r, want", [
    (1024, 2816, 1, "dense"), (2048, 5632, 4, "dense"),  # measured: the blocks lost (1.24x, 1.70x the dense step)
    (2048, 5632, 1, "blocks"), (4096, 11008, 1, "blocks"), (4096, 11008, 4, "blocks"),  # the blocks won
    (4096, 4096, 1, "blocks"), (4096, 4096, 4, "blocks")])
def test_planner_picks_what_the_width_sweep_measured_faster(d, hidden, r, want):
    """The MLP and attention layers of the width sweep's LMs (8,192 tokens, under CUDA graphs): the
    choice the H200 model makes is the path whose whole training step measured faster (bench_e2e
    with the blocks pinned, 2026-12-01)."""
    from torch import nn

    layer = nn.Linear(d, hidden)
    tensorize_(layer, TTConfig(fmt="btt", rank=r, min_size=0))
    (tt_layer,) = iter_tt_layers(layer)
    assert plan_btt_linear(tt_layer.spec, 8192, cudagraphs=True).strategy == want


@pytest.mark.parametrize("r, kept", [(1, True), (4, False)])
def test_blocks_keep_the_intermediate_only_while_it_is_no_larger_than_the_input(r, kept):
    """Rank 1 (c <= b2): the regrouped intermediate [c, n, b1 r] is saved for the backward; rank 4 (c r
    > b2): it is recomputed there, so the layer saves nothing larger than its input."""
    spec = TTSpec("btt", (4, 8), (8, 4), (1, r, 1), 32, 32, True)
    gen = torch.Generator().manual_seed(3)
    cores = [torch.randn(*s, generator=gen, requires_grad=True) for s in spec.core_shapes]
    core_flat, gate_flat = join_flat(cores, [torch.ones(r, requires_grad=True)])
    x = torch.randn(64, 32, generator=gen, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = tt_runtime.btt_linear(x, core_flat, gate_flat, spec, True, None, torch.float32)
    n, b1, c = 64, 4, 8
    assert ((c, n, b1 * r) in saved) == kept
    y.sum().backward()  # and the recomputing backward runs
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("env, r, kept", [("4", 4, True), ("3.9", 4, False), ("inf", 4, True), ("0", 1, False),
                                          (" 1 ", 1, True)])
def test_comera_btt_keep_moves_the_bound_of_the_kept_intermediate(monkeypatch, env, r, kept):
    """COMERA_BTT_KEEP: the intermediate (here r x the input's entries) is kept while no larger than that
    multiple of the input, recomputed otherwise, and the gradients match the float64 reference either way;
    a value that is no number >= 0 raises, naming the variable."""
    from comera_compile.kernels.btt_blocks import keep_ratio

    monkeypatch.setenv("COMERA_BTT_KEEP", env)
    b1, b2, n, c = 4, 8, 16, 8  # the intermediate [c, n, b1 r] has r x the input's n b1 b2 entries
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(n, b1 * b2, generator=gen, dtype=torch.float64, requires_grad=True)
    first = torch.randn(b1, b2, c * r, generator=gen, dtype=torch.float64, requires_grad=True)
    second = torch.randn(c, b1 * r, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, ts = torch.ops.comera.btt_blocks(x, first, [second], r)
    assert ts.numel() == r * x.numel()
    assert any(t is ts for t in saved) == kept
    ref = [t.detach().clone().requires_grad_() for t in (x, first, second)]
    (want,) = _blocks_reference(ref[0], ref[1], ref[2:], r)
    dy = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    for g, w in zip(torch.autograd.grad(y, (x, first, second), dy), torch.autograd.grad(want, ref, dy)):
        torch.testing.assert_close(g, w)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("COMERA_BTT_KEEP", bad)
        with pytest.raises(ValueError, match=r"COMERA_BTT_KEEP=.*expected a number >= 0"):
            keep_ratio()


@pytest.mark.parametrize("env", ["1", "inf"])
def test_under_compile_the_intermediate_is_saved_whatever_comera_btt_keep(monkeypatch, env):
    """Under torch.compile AOTAutograd merges the backward's recomputing btt_blocks call with the forward's
    (common-subexpression elimination), so the compiled backward never runs the op again and the
    intermediate is among the forward's saved outputs at every setting (what the docs of keep_ratio say);
    the gradients match eager's."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setenv("COMERA_BTT_KEEP", env)
    torch._dynamo.reset()
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm.forward
        return compiler

    b1, b2, n, c, r = 4, 8, 16, 8, 4  # the intermediate [c, n, b1 r] has r x the input's entries
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(shape, generator=gen, requires_grad=True)
              for shape in ((n, b1 * b2), (b1, b2, c * r), (c, b1 * r, 3))]

    def fn(x, first, second):
        return torch.ops.comera.btt_blocks(x, first, [second], r)[0].square().sum()

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                           partition_fn=min_cut_rematerialization_partition)
    got = torch.autograd.grad(torch.compile(fn, backend=backend)(*leaves), leaves)
    want = torch.autograd.grad(fn(*leaves), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    calls = {name: [str(node.target) for node in gm.graph.nodes if "comera" in str(node.target)]
             for name, gm in graphs.items()}
    assert calls == {"fw": ["comera.btt_blocks.default"], "bw": ["comera.btt_blocks_backward.default"]}, calls
    saved = [node.meta["val"].shape for node in graphs["fw"].graph.output_node().args[0][1:]]
    assert (c, n, b1 * r) in saved, saved
    torch._dynamo.reset()


@pytest.mark.parametrize("transpose_out", [False, True], ids=["dense", "dense_t"])
def test_group_weights_of_btt_layers_match_the_block_by_block_reference(transpose_out):
    """group_outputs for K btt layers of one structure (one batched product) against each layer's matrix
    assembled block by block, float64, with gradients for every core and gate."""
    from comera_compile.tt.planner import Cut

    spec = TTSpec("btt", (4, 3), (3, 5), (1, 2, 1), 11, 13, True)
    gen = torch.Generator().manual_seed(4)
    layers = [[torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in spec.core_shapes]
              + [(torch.rand(2, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()] for _ in range(3)]
    flats = [join_flat(cores[:2], [cores[2]]) for cores in layers]
    got = tt_runtime.group_outputs([f[0] for f in flats], [f[1] for f in flats], spec, Cut(1, 0, 1),
                                   "dense_t" if transpose_out else "dense", torch.float64)
    assert len(got) == 3
    for (R, L, g), m in zip(layers, got):
        want = reference_m(R, g, L, spec)
        want = want.t() if transpose_out else want
        torch.testing.assert_close(m, want, rtol=1e-12, atol=1e-12)
        dm = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(m, (R, L, g), dm, retain_graph=True),
                        torch.autograd.grad(want, (R, L, g), dm)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="btt layer gives output 'dense' or 'dense_t'"):
        tt_runtime.group_outputs([flats[0][0]], [flats[0][1]], spec, Cut(1, 0, 1), "factors", torch.float64)


@pytest.mark.parametrize("merges", ["inductor", "opaque"])
def test_btt_layers_that_form_their_weights_share_one_batched_merge(merges):
    """Three btt Linears of one structure on the dense path (few tokens): one group, the step matches
    eager (under tt_merges="opaque" too)."""
    from torch import nn

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(48, 48), nn.Linear(48, 48), nn.Linear(48, 48)
            self.head = nn.Linear(48, 3)

        def forward(self, x):
            return self.head(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))

    torch.manual_seed(0)
    eager = Three()
    tensorize_(eager, TTConfig(fmt="btt", rank=2, min_size=0), filter_fn=lambda mod, fqn: fqn in ("a", "b", "c"))
    assert all(plan_btt_linear(lay.spec, 16).strategy == "dense" for lay in iter_tt_layers(eager))
    text = compiled_step_matches_eager(eager, torch.randn(4, 4, 48), tt_merges=merges)
    assert text.count("(the weight formed in the graph, then a dense GEMM); token-independent merges batched "
                      "with 2 other layer(s)") == 3, text


class QKV(torch.nn.Module):
    """Three projections of one input (the last one narrower: fewer column blocks) and an output one."""

    def __init__(self, d=2048, inplace=False):
        super().__init__()
        self.q, self.k = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False)
        self.v, self.o = torch.nn.Linear(d, d // 2), torch.nn.Linear(d // 2, 3)
        self.inplace = inplace

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.inplace:
            k.mul_(0.5)
        return self.o(v * torch.sigmoid((q * k).sum(-1, keepdim=True) / 64))


def _qkv(inplace=False):
    torch.manual_seed(0)
    eager = QKV(inplace=inplace)
    tensorize_(eager, {"q": TTConfig(fmt="btt", rank=2, modes=((32, 64), (32, 64)), min_size=0),
                       "k": TTConfig(fmt="btt", rank=2, modes=((32, 64), (32, 64)), min_size=0),
                       "v": TTConfig(fmt="btt", rank=2, modes=((32, 64), (16, 64)), min_size=0)})
    return eager


def test_btt_layers_reading_one_input_share_one_blocks_call():
    """Q, K and V on the blocks path (2048 wide, pinned): one btt_blocks call for the three, whose
    column blocks differ (V has half), biases on two; the step matches eager."""
    from comera_compile.kernels import btt_blocks

    eager = _qkv()
    calls = []
    forward = btt_blocks.current_impl().blocks_forward
    with btt_blocks.use_impl(blocks_forward=lambda *a: calls.append([s.shape[0] for s in a[2]]) or forward(*a)):
        text = compiled_step_matches_eager(eager, torch.randn(4, 4, 2048), tt_strategy="blocks")
    assert text.count("one batched call with 2 other layer(s) reading the same input") == 3, text
    assert calls and all(c == [32, 32, 16] for c in calls)  # the column blocks of each: one call, all three


def test_an_output_written_in_place_keeps_its_layer_out_of_the_shared_call():
    """K is scaled in place after the projections: K is rewritten on its own, Q and V share a call."""
    text = compiled_step_matches_eager(_qkv(inplace=True), torch.randn(4, 4, 2048), tt_strategy="blocks")
    assert text.count("one batched call with 1 other layer(s) reading the same input") == 2, text


# ------------------------------------------------------------------ every op under opcheck, odd shapes

# tokens n, row blocks b1 of b2, rank r, column blocks of each second core, their widths a_i, transposed
OPCHECK_CASES = [(7, 3, 4, 2, (5,), (3,), False), (5, 3, 4, 2, (2, 3), (5, 1), True),
                 (1, 1, 5, 3, (1,), (2,), True), (0, 3, 4, 2, (2, 3), (5, 1), True), (0, 2, 1, 1, (3,), (4,), False)]
# the gradients asked of comera::btt_blocks_backward: x's (it reads first), first's (reads x), the seconds' (ts)
GIVEN = [("x", "first", "seconds"), ("x",), ("first",), ("seconds",), ("first", "seconds")]


def _op_inputs(case, dtype):
    """``x [n, b1 b2]``, ``first [b1, b2, C r]``, ``seconds [c_i, b1 r, a_i]``; transposed cases give
    each as the permuted view of a contiguous tensor of the reversed shape (as a tied head reads its cores)."""
    n, b1, b2, r, cs, widths, transposed = case
    gen = torch.Generator().manual_seed(5)

    def tensor(*shape):
        if not transposed:
            return torch.randn(*shape, generator=gen, dtype=dtype)
        return torch.randn(*shape[::-1], generator=gen, dtype=dtype).permute(*range(len(shape) - 1, -1, -1))

    return tensor(n, b1 * b2), tensor(b1, b2, sum(cs) * r), [tensor(c, b1 * r, a) for c, a in zip(cs, widths)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: f"n{c[0]}-{c[1]}x{c[2]}r{c[3]}{'-T' if c[6] else ''}")
def test_every_op_of_the_blocks_path_passes_opcheck(case, impl, monkeypatch):
    """comera::btt_swap (kernels/btt_swap.py), comera::btt_blocks and comera::btt_blocks_backward
    (kernels/btt_blocks.py) under torch.library.opcheck:
    each fake's shapes and strides against its real op, the schema, the autograd registration, AOT
    dispatch. Odd shapes, cores, x and the outputs' gradients as transposed views, zero tokens; the
    backward asked for each subset of its gradients. ``"triton"``: the swap kernel (interpreter, fp32)
    runs inside the ops; ``"torch"``: the permute (fp64)."""
    from comera_compile.kernels import btt_blocks  # noqa: F401 (defines comera::btt_blocks)
    from comera_compile.kernels import btt_swap as mod

    calls = []
    kernel = mod.current_impl().swap_kernel
    if impl == "triton":
        monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    with mod.use_impl(swap_kernel=lambda *a, **k: calls.append(1) or kernel(*a, **k)):
        _opcheck_every_op(case, impl)
    assert impl == "torch" or calls  # the kernel ran


def _opcheck_every_op(case, impl):
    n, b1, b2, r = case[:4]
    x, first, seconds = _op_inputs(case, torch.float32 if impl == "triton" else torch.float64)
    leaves = [t.requires_grad_() for t in [x, first] + seconds]
    torch.library.opcheck(torch.ops.comera.btt_swap.default, (x.detach().reshape(n, 1, b1, b2),))
    torch.library.opcheck(torch.ops.comera.btt_swap.default, (first.detach().unsqueeze(1),))  # a view of the core
    torch.library.opcheck(torch.ops.comera.btt_blocks.default, (leaves[0], leaves[1], leaves[2:], r))
    with torch.no_grad():
        *ys, ts = torch.ops.comera.btt_blocks(x, first, seconds, r)
    grads = [torch.randn(y.shape[::-1], dtype=y.dtype).t() for y in ys]  # transposed views
    for given in GIVEN:
        args = (grads, x.detach() if "first" in given else None, ts if "seconds" in given else None,
                first.detach() if "x" in given else None, [s.detach() for s in seconds], r)
        torch.library.opcheck(torch.ops.comera.btt_blocks_backward.default, args)


# ------------------------------------------------------------------ what the blocks' backward saves

WANTS = [("x",), ("first",), ("seconds",), ("x", "seconds"), ("first", "seconds"), ("x", "first", "seconds")]


@pytest.mark.parametrize("r, kept", [(1, True), (3, False)], ids=["ts-kept", "ts-recomputed"])
@pytest.mark.parametrize("wants", WANTS, ids="+".join)
def test_btt_blocks_saves_only_what_its_backward_reads(wants, r, kept):
    """Each gradient reads one saved tensor: first's reads x, x's reads first, the seconds' read the
    intermediate (kept, or recomputed from x and first). x is saved only where a gradient reads it,
    so writing x in place after the op (a frozen layer; x's own gradient) leaves the gradients as the
    float64 einsum reference gives them."""
    b1, b2, n, cs = 3, 4, 5, (2, 1)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(n, b1 * b2, generator=gen, dtype=torch.float64)
    first = torch.randn(b1, b2, sum(cs) * r, generator=gen, dtype=torch.float64)
    seconds = [torch.randn(c, b1 * r, 2 + i, generator=gen, dtype=torch.float64) for i, c in enumerate(cs)]
    names = ["x", "first"] + ["seconds"] * len(cs)
    leaves = [t.clone().requires_grad_(name in wants) for t, name in zip([x, first] + seconds, names)]
    refs = [t.clone().requires_grad_(name in wants) for t, name in zip([x, first] + seconds, names)]
    xin = leaves[0].clone()  # a non-leaf input that may be written in place
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        *ys, ts = torch.ops.comera.btt_blocks(xin, leaves[1], leaves[2:], r)
    assert ts.numel() <= x.numel() if kept else ts.numel() > x.numel()
    x_read = "first" in wants or ("seconds" in wants and not kept)
    assert any(t is xin for t in saved) == x_read
    assert any(t is ts for t in saved) == ("seconds" in wants and kept)
    if not x_read:
        xin.mul_(2.0)
    want = _blocks_reference(refs[0], refs[1], refs[2:], r)
    dys = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in want]
    got = torch.autograd.grad(ys, [t for t in leaves if t.requires_grad], dys)
    wants_grads = torch.autograd.grad(want, [t for t in refs if t.requires_grad], dys)
    for g, w in zip(got, wants_grads, strict=True):
        torch.testing.assert_close(g, w)


class FrozenQ(torch.nn.Module):
    """Q read before its input is doubled in place, K and V after (the issue's pattern)."""

    def __init__(self, d=64, input_grad=False):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.o = torch.nn.Linear(d, 3)
        self.input_grad = input_grad

    def forward(self, x):
        if self.input_grad:
            x = x * 1.0  # an intermediate: it may be written in place
        q = self.q(x)
        x.mul_(2.0)
        k, v = self.k(x), self.v(x)
        return self.o(v * torch.sigmoid((q * k).sum(-1, keepdim=True)))


@pytest.mark.parametrize("input_grad", [False, True], ids=["x-no-grad", "x-grad"])
def test_a_frozen_btt_layer_lets_its_input_be_written_in_place(input_grad):
    """A frozen btt Q on the blocks path, its input doubled in place after it: the step matches eager
    (output, the input's gradient, every parameter's gradient), as eager's frozen Linear saves no input."""
    torch.manual_seed(0)
    eager = FrozenQ(input_grad=input_grad)
    tensorize_(eager, TTConfig(fmt="btt", rank=2, min_size=0), filter_fn=lambda mod, fqn: fqn in ("q", "k", "v"))
    eager.q.requires_grad_(False)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="comera", options={"inner": "aot_eager", "tt_strategy": "blocks"},
                         fullgraph=True)
    x0 = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    xe, xc = (x0.clone().requires_grad_(input_grad) for _ in range(2))
    want, got = eager(xe), step(xc)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(xc.grad, xe.grad) if input_grad else torch.testing.assert_close(xc, xe)
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
        assert (p.grad is None) == (q.grad is None) == name.startswith("q."), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=name)


# ------------------------------------------------------------------ zero tokens

@pytest.mark.parametrize("dynamic, batches", [(None, (0,)), (True, (5, 0, 3))], ids=["static", "dynamic"])
def test_zero_tokens_on_the_blocks_path_match_eager(dynamic, batches):
    """A btt layer on the blocks path (pinned) given no tokens, shape (0, 3, 64): an empty output and
    zero gradients, as eager; under dynamic=True the batch sizes 5, 0, 3 in turn."""
    from comera_compile.kernels import btt_blocks

    calls = []
    forward = btt_blocks.current_impl().blocks_forward
    with btt_blocks.use_impl(blocks_forward=lambda *a: calls.append(a[0].shape[0]) or forward(*a)):
        _zero_token_steps(dynamic, batches)
    assert set(calls) >= {b * 3 for b in batches}  # the blocks ran, zero tokens included


def _zero_token_steps(dynamic, batches):
    from torch import nn

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))
    tensorize_(eager, TTConfig(fmt="btt", rank=2, min_size=0), filter_fn=lambda mod, fqn: fqn == "0")
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="comera", options={"inner": "aot_eager", "tt_strategy": "blocks"},
                         fullgraph=True, dynamic=dynamic)
    for batch in batches:
        x = torch.randn(batch, 3, 64)
        eager.zero_grad()
        compiled_model.zero_grad()
        want, got = eager(x), step(x)
        want.square().sum().backward()
        got.square().sum().backward()
        assert got.shape == want.shape == (batch, 3, 3)
        torch.testing.assert_close(got, want)
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
