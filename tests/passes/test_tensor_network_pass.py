"""passes/tensor_network.py: linear/embedding of a tt_materialize weight -> tt_linear/tt_embedding,
never forming the dense weight, equal to eager in loss and every gradient."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc
from comera_compile.tensorize import TTConfig, tensorize_


class TinyLM(nn.Module):
    def __init__(self, vocab=90, d=24, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.up = nn.Linear(d, 40)
        self.down = nn.Linear(40, d, bias=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), idx.roll(-1, 1).view(-1))


def _tensorized(seed=0, **kw):
    torch.manual_seed(seed)
    model = TinyLM(**kw)
    tensorize_(model, TTConfig(rank=5, min_size=0), filter_fn=lambda m, fqn: fqn in ("emb", "up", "down"))
    return model


def _idx(seed, batch=3, seq=9):
    return torch.randint(0, 90, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss_grads(fn, model, idx):
    model.zero_grad(set_to_none=True)
    loss = fn(idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("inner,dynamic", [("eager", False), ("aot_eager", False), ("aot_eager", True),
                                           ("inductor", False), ("inductor", True)])
def test_tt_model_matches_eager(inner, dynamic):
    model = _tensorized()
    ref = copy.deepcopy(model)
    idx = _idx(1)
    ref_loss, ref_grads = _loss_grads(ref, ref, idx)
    compiled = torch.compile(model, backend="comera", dynamic=dynamic, options={"inner": inner})
    loss, grads = _loss_grads(compiled, model, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    if dynamic:
        idx2 = _idx(2, batch=2, seq=11)
        torch.testing.assert_close(compiled(idx2), ref(idx2), rtol=1e-5, atol=1e-5)


def test_explain_shows_rewrites_with_plans_and_no_dense_weight():
    model = _tensorized()
    report = cc.explain(model, _idx(3), options={"inner": "eager"})
    kinds = sorted(r.kind for r in report.rewrites)
    assert kinds == ["cce", "tt_embedding", "tt_linear", "tt_linear"], str(report)
    modules = {r.module for r in report.rewrites if r.kind.startswith("tt_")}
    assert modules == {"emb", "up", "down"}
    linear = next(r for r in report.rewrites if r.kind == "tt_linear")
    assert "FLOP" in linear.detail and "launches" in linear.detail and "tokens=" in linear.detail
    code = report.graphs[0].code
    assert "tt_materialize" not in code
    assert "comera.tt_linear" in code and "comera.tt_embedding" in code


def test_padding_idx_embedding_left_alone_with_reason():
    model = _tensorized(padding_idx=0)
    ref = copy.deepcopy(model)
    idx = _idx(4)
    report = cc.explain(model, idx, options={"inner": "eager"})
    assert "tt_embedding" not in [r.kind for r in report.rewrites]
    assert any("padding_idx" in s.reason for s in report.skipped)
    torch.testing.assert_close(report.output, ref(idx))


def test_compiled_tt_model_trains_like_eager():
    model = _tensorized(seed=5)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(8):
        idx = _idx(100 + step)
        for fn, m, o, out in ((compiled, model, opt, losses), (ref, ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = fn(idx)
            loss.backward()
            o.step()
            out.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)
