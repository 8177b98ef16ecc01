"""GPU-only checks (skipped on CPU CI): the real Triton kernels inside compiled models, bf16, CUDA graphs."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, os.path.dirname(__file__))


class TTMLP(nn.Module):
    def __init__(self, vocab=4096, d=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def _model():
    torch.manual_seed(0)
    model = TTMLP()
    cc.tensorize_(model, cc.TTConfig(rank=16), filter_fn=lambda m, fqn: fqn in ("emb", "up", "down"))
    return model.cuda()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_tt_and_cce_model_matches_eager_on_gpu(mode):
    model = _model()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="comera", options={"cce_min_vocab": 0, "cudagraphs": mode is not None})
    for step in range(3):  # replays under CUDA graphs
        idx = torch.randint(0, 4096, (8, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        model.zero_grad()
        ref.zero_grad()
        loss = compiled(idx)
        loss.backward()
        ref_loss = ref(idx)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
        g, rg = _grads(model), _grads(ref)
        for k in rg:
            err = (g[k] - rg[k]).norm() / rg[k].norm().clamp_min(1e-12)
            assert err < 2e-2, (k, float(err))
    report = cc.explain(copy.deepcopy(ref), idx, options={"cce_min_vocab": 0})
    assert sorted(r.kind for r in report.rewrites) == ["cce", "tt_embedding", "tt_linear", "tt_linear"]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_tt_head_fused_with_its_loss_on_gpu(mode):
    """A TT head lowered to its rank-16 factors, the loss fused over them (forced: cce_min_vocab=0),
    in bf16 autocast, with and without CUDA graphs; against the eager TT model."""
    torch.manual_seed(0)
    model = TTMLP()
    cc.tensorize_(model, cc.TTConfig(rank=16, fmt="tt"), filter_fn=lambda m, fqn: fqn in ("up", "down", "head"))
    model = model.cuda()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 4096, (8, 64), device="cuda")
    report = cc.explain(copy.deepcopy(model), idx, options={"cce_min_vocab": 0})
    assert any(r.kind == "cce" and "D=16" in r.detail for r in report.rewrites), str(report)
    compiled = torch.compile(model, backend="comera", options={"cce_min_vocab": 0, "cudagraphs": mode is not None})
    for step in range(3):
        model.zero_grad()
        ref.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(idx)
            ref_loss = ref(idx)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
        g, rg = _grads(model), _grads(ref)
        for k in rg:
            err = (g[k].float() - rg[k].float()).norm() / rg[k].float().norm().clamp_min(1e-12)
            assert err < 5e-2, (k, float(err))


def test_gpt_bf16_autocast_cce_on_gpu():
    from zoo import GPT

    torch.manual_seed(0)
    model = GPT(vocab=1000, d=64, max_len=64).cuda()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 1000, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = ref(idx)
        loss = torch.compile(model, backend="comera", options={"cce_min_vocab": 0})(idx)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    g, rg = _grads(model), _grads(ref)
    for k in rg:
        err = (g[k].float() - rg[k].float()).norm() / rg[k].float().norm().clamp_min(1e-12)
        assert err < 5e-2, (k, float(err))


# ---------------------------------------------------------------- the btt and TT-matrix token paths (bf16)


@pytest.mark.parametrize("shape", [(8192, 1, 64, 64), (64, 4096, 64, 1), (64, 2048, 128, 4), (86, 1, 4096, 128),
                                   (3, 5, 7, 70)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tile", [0, 32768, 65536])
def test_btt_swap_kernel_is_the_permute_on_gpu(shape, dtype, tile):
    """Both kernels: one position a program (tile 0) and the token-tiled one (COMERA_BTT_SWAP_TILE)."""
    from comera_compile.kernels.btt_swap import _swap_triton, swap_blocks

    x = torch.randn(*shape, device="cuda").to(dtype)
    want = x.permute(2, 1, 0, 3).contiguous()
    assert torch.equal(_swap_triton(x, True, tile), want)
    if tile == 0:
        assert torch.equal(swap_blocks(x, impl="triton"), want)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("x_times_m", [True, False])
def test_btt_blocks_bf16_against_float64_on_gpu(x_times_m):
    """Both cores and the gate through the blocks path (comera::btt_blocks: strided batched GEMMs and
    the swap kernel) in bf16, against the float64 product with the weight formed block by block."""
    from comera_compile.kernels import tt_runtime
    from comera_compile.tt import TTSpec, join_flat, materialize

    spec = TTSpec("btt", (64, 64), (64, 64), (1, 2, 1), 4096, 4096, True)
    gen = torch.Generator("cuda").manual_seed(0)
    R, L = (torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64) * 0.1 for s in spec.core_shapes)
    g = torch.rand(2, device="cuda", generator=gen, dtype=torch.float64) + 0.5
    leaves = [t.clone().requires_grad_() for t in (R, L, g)]
    x = torch.randn(2048, 4096, device="cuda", generator=gen, dtype=torch.float64, requires_grad=True)
    m = materialize(leaves[:2], leaves[2:], TTSpec("btt", (64, 64), (64, 64), (1, 2, 1), 4096, 4096, False))
    want = x @ (m if x_times_m else m.t())
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x] + leaves, dy)
    lf = [t.detach().float().requires_grad_() for t in (R, L, g)]
    xb = x.detach().bfloat16().requires_grad_()
    cf, gf = join_flat(lf[:2], lf[2:])
    got = tt_runtime.btt_linear(xb, cf, gf, spec, x_times_m, None, torch.bfloat16)
    assert _rel(got, want.detach()) < 2e-2
    for gg, wg in zip(torch.autograd.grad(got, [xb] + lf, dy.bfloat16()), want_grads):
        assert _rel(gg, wg) < 3e-2


def test_btt_layers_sharing_one_input_bf16_against_float64_on_gpu():
    """Three btt layers reading one input (Q, K, V-like; V with half the column blocks) through one
    comera::btt_blocks call in bf16, each output and gradient against float64 per layer."""
    from comera_compile.kernels import tt_runtime
    from comera_compile.tt import TTSpec, join_flat, materialize

    specs = [TTSpec("btt", (64, 64), (64, 64), (1, 2, 1), 4096, 4096, True),
             TTSpec("btt", (64, 64), (64, 64), (1, 2, 1), 4096, 4096, True),
             TTSpec("btt", (64, 64), (32, 64), (1, 2, 1), 4096, 2048, True)]
    gen = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(2048, 4096, device="cuda", generator=gen, dtype=torch.float64, requires_grad=True)
    leaves, flats, wants = [], [], []
    for spec in specs:
        R, L = (torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64) * 0.1 for s in spec.core_shapes)
        g = torch.rand(2, device="cuda", generator=gen, dtype=torch.float64) + 0.5
        ref = [t.clone().requires_grad_() for t in (R, L, g)]
        wants.append((ref, x @ materialize(ref[:2], ref[2:], spec._replace(transpose=False))))
        lf = [t.detach().float().requires_grad_() for t in (R, L, g)]
        leaves.append(lf)
        flats.append(join_flat(lf[:2], lf[2:]))
    xb = x.detach().bfloat16().requires_grad_()
    got = tt_runtime.btt_linear_shared(xb, [f[0] for f in flats], [f[1] for f in flats], specs, [None] * 3,
                                       torch.bfloat16)
    dys = [torch.randn_like(w) for _, w in wants]
    want_grads = torch.autograd.grad(sum((w * d).sum() for (_, w), d in zip(wants, dys)),
                                     [x] + [t for ref, _ in wants for t in ref])
    got_grads = torch.autograd.grad(sum((g.double() * d).sum() for g, d in zip(got, dys)),
                                    [xb] + [t for lf in leaves for t in lf])
    for g, (_, w) in zip(got, wants):
        assert _rel(g, w.detach()) < 2e-2
    for gg, wg in zip(got_grads, want_grads):
        assert _rel(gg, wg) < 3e-2


def test_ttm_contract_bf16_against_float64_on_gpu():
    from comera_compile.kernels import tt_runtime
    from comera_compile.tt import TTSpec, join_flat, materialize
    from comera_compile.tt.planner import contraction_path

    spec = TTSpec("ttm", (16, 16, 16), (16, 16, 16), (1, 32, 32, 1), 4096, 4096, True)
    gen = torch.Generator("cuda").manual_seed(0)
    cores = [torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64) * 0.2 for s in spec.core_shapes]
    gates = [torch.ones(32, device="cuda", dtype=torch.float64) for _ in range(2)]
    leaves = [t.clone().requires_grad_() for t in cores + gates]
    x = torch.randn(16, 4096, device="cuda", generator=gen, dtype=torch.float64, requires_grad=True)
    m = materialize(leaves[:3], leaves[3:], TTSpec("ttm", (16, 16, 16), (16, 16, 16), (1, 32, 32, 1), 4096, 4096))
    want = x @ m
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x] + leaves, dy)
    lf = [t.detach().float().requires_grad_() for t in cores + gates]
    xb = x.detach().bfloat16().requires_grad_()
    cf, gf = join_flat(lf[:3], lf[3:])
    eq, path = contraction_path(spec, 16)
    got = tt_runtime.ttm_contract(xb, cf, gf, spec, True, None, torch.bfloat16, eq, path)
    assert _rel(got, want.detach()) < 2e-2
    for gg, wg in zip(torch.autograd.grad(got, [xb] + lf, dy.bfloat16()), want_grads):
        assert _rel(gg, wg) < 3e-2
