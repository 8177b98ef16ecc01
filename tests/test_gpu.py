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
