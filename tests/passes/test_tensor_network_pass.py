"""passes/tensor_network.py: TT layers lowered into batched merges and GEMMs, equal to eager in the loss
and every gradient; the strategies, the batching across layers (also after pruning leaves layers of
different ranks), every site form (Linear, tied head x @ Mᵀ, Conv1D's addmm, matmul, Embedding with
padding_idx), what is left alone, and the TT head fused with its loss by the cce pass."""

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc
from comera_compile.kernels import tt_group_merge, tt_runtime
from comera_compile.tensorize import TTConfig, tensorize_

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared writers
from writers import ScaleInPlace as _Dirty  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab=90, d=24, padding_idx=None, blocks=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.ups = nn.ModuleList(nn.Linear(d, 40) for _ in range(blocks))
        self.downs = nn.ModuleList(nn.Linear(40, d, bias=False) for _ in range(blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        for up, down in zip(self.ups, self.downs):
            h = h + down(F.gelu(up(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), idx.roll(-1, 1).view(-1))


def _tensorized(seed=0, rank=5, blocks=1, **kw):
    torch.manual_seed(seed)
    model = TinyLM(blocks=blocks, **kw)
    tensorize_(model, {"emb": TTConfig(rank=rank, min_size=0, fmt="ttm"),  # the factored ("tt") Linear path
                       "_default": TTConfig(rank=rank, min_size=0, fmt="tt")},
               filter_fn=lambda m, fqn: fqn != "head" and isinstance(m, (nn.Linear, nn.Embedding)))
    return model


def _idx(seed, batch=3, seq=9, vocab=90):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss_grads(fn, model, *args):
    model.zero_grad(set_to_none=True)
    loss = fn(*args)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_same(model, ref, args, inner="aot_eager", dynamic=False, rtol=1e-4, atol=1e-5, **options):
    ref_loss, ref_grads = _loss_grads(ref, ref, *args)
    compiled = torch.compile(model, backend="comera", dynamic=dynamic, options={"inner": inner, **options})
    loss, grads = _loss_grads(compiled, model, *args)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
    return compiled


def _report(model, *args, **options):
    report = cc.explain(copy.deepcopy(model), *args, options={"inner": "eager", **options})
    assert not [s for s in report.skipped if "rolled back" in s.reason], str(report)
    return report


def _calls(report, fn) -> int:
    return sum(1 for gm in report.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target is fn)


def _merge_calls(report) -> int:
    """The layer groups' merge calls: plain group_outputs, or the opaque op's wrapper (the default
    tt_merges="auto" makes "tt" groups opaque)."""
    return _calls(report, tt_runtime.group_outputs) + _calls(report, tt_group_merge.group_outputs_opaque)


@pytest.mark.parametrize("inner,dynamic", [("eager", False), ("aot_eager", False), ("aot_eager", True),
                                           ("inductor", False)])
def test_tt_model_matches_eager(inner, dynamic):
    model = _tensorized()
    report = _report(model, _idx(1))
    assert sorted(r.kind for r in report.rewrites if r.kind != "cce") == ["tt_embedding", "tt_linear", "tt_linear"]
    ref = copy.deepcopy(model)
    compiled = _check_same(model, ref, (_idx(1),), inner, dynamic)
    if dynamic:
        idx2 = _idx(2, batch=2, seq=11)
        torch.testing.assert_close(compiled(idx2), ref(idx2), rtol=1e-5, atol=1e-5)


def test_explain_shows_the_plan_and_no_dense_weight():
    report = _report(_tensorized(), _idx(3))
    linear = next(r for r in report.rewrites if r.kind == "tt_linear" and r.module == "ups.0")
    assert "factored" in linear.detail and "tokens=27" in linear.detail and "candidates" in linear.detail
    emb = next(r for r in report.rewrites if r.kind == "tt_embedding")
    assert emb.module == "emb" and "tables" in emb.detail
    code = report.graphs[0].code
    assert "tt_materialize" not in code and "group_outputs" in code and "lookup" in code


def test_same_structure_layers_merge_in_one_batched_call():
    model = _tensorized(blocks=3)
    report = _report(model, _idx(4))
    # one call for the 3 ups, one for the 3 downs, one for the embedding (each the opaque op's wrapper
    # for these "tt" layers under the default tt_merges="auto", plain group_outputs for "inductor")
    assert _merge_calls(report) == 3
    ups = [r for r in report.rewrites if r.module and r.module.startswith("ups.")]
    assert len(ups) == 3 and all("batched with 2 other layer(s)" in r.detail for r in ups)
    _check_same(model, copy.deepcopy(model), (_idx(4),))


def test_layers_of_different_ranks_after_pruning_still_batch_correctly():
    model = _tensorized(blocks=3, rank=6)
    layer = model.ups[1].parametrizations.weight[0]  # prune bond 1 of one layer to rank 3
    cores, gates = layer.positions()
    cores[0], cores[1], gates[0] = cores[0][..., :3], cores[1][:3], gates[0][:3]
    layer.relayout_(cores, gates)
    report = _report(model, _idx(5))
    assert _merge_calls(report) == 4  # the pruned layer is its own group
    _check_same(model, copy.deepcopy(model), (_idx(5),))


class SiteForms(nn.Module):
    """Every way a TT weight reaches a product: nn.Linear, a tied head (x @ Mᵀ), Conv1D's addmm, matmul."""

    def __init__(self, d=16, h=24, vocab=64):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(vocab, d)
        self.conv1d_weight = nn.Linear(d, h)  # tensorized; used as x @ M through addmm like GPT-2's Conv1D
        self.mm = nn.Linear(h, d, bias=False)  # tensorized; used through matmul(x, M)
        self.d, self.h, self.vocab = d, h, vocab

    def forward(self, idx):
        emb = self.emb.parametrizations.weight[0]
        x = self.emb(idx)  # [b, t, d]
        w1 = self.conv1d_weight.parametrizations.weight[0]
        m1 = cc.tt_materialize(list(w1.cores), list(w1.gates), w1.fmt, w1.row_modes, w1.col_modes, w1.rows,
                               w1.cols, False)  # [d, h] = M: Conv1D's weight layout
        y = torch.addmm(self.conv1d_weight.bias, x.reshape(-1, self.d), m1)
        w2 = self.mm.parametrizations.weight[0]
        m2 = cc.tt_materialize(list(w2.cores), list(w2.gates), w2.fmt, w2.row_modes, w2.col_modes, w2.rows,
                               w2.cols, False)
        z = torch.matmul(F.gelu(y), m2)  # [N, d]
        head = cc.tt_materialize(list(emb.cores), list(emb.gates), emb.fmt, emb.row_modes, emb.col_modes,
                                 emb.rows, emb.cols, False)  # tied head: logits = z @ Mᵀ
        logits = F.linear(z, head)
        return F.cross_entropy(logits, idx.reshape(-1))


@pytest.mark.parametrize("fmt", ["tt", "ttm"])
def test_every_site_form_matches_eager(fmt):
    model = SiteForms()
    tensorize_(model, TTConfig(rank=4, min_size=0, fmt=fmt, n_cores=2 if fmt == "ttm" else 3))
    idx = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    report = _report(model, idx)
    kinds = sorted(r.kind for r in report.rewrites)
    assert kinds.count("tt_linear") == 3 and kinds.count("tt_embedding") == 1, str(report)
    assert "tt_materialize" not in report.graphs[0].code
    _check_same(model, copy.deepcopy(model), (idx,))


def test_tt_head_is_fused_with_its_loss_over_the_rank():
    """cross_entropy(linear(x, TT head)): the head's first factor is a GEMM to rank r, then cce fuses
    the loss over [N, r] activations and the [V, r] factor; the logits never exist."""
    torch.manual_seed(0)
    model = TinyLM(vocab=200, d=24)
    tensorize_(model, TTConfig(rank=6, min_size=0, fmt="tt"), filter_fn=lambda m, fqn: fqn == "head")
    idx = _idx(6, vocab=200)
    report = _report(model, idx, cce_min_vocab=0)  # a tiny head: force the fusion the cost rule declines
    cce = next((r for r in report.rewrites if r.kind == "cce"), None)
    assert cce is not None and "D=8" in cce.detail and "V=200" in cce.detail, str(report)  # rank 6 padded to 8
    ref = TinyLM(vocab=200, d=24)  # the dense twin: the same weights, the head materialized
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    ref.load_state_dict({**state, "head.weight": model.head.weight.detach(), "head.bias": model.head.bias.detach()})
    compiled = _check_same(model, copy.deepcopy(model), (idx,), cce_min_vocab=0)  # every gradient vs eager
    torch.testing.assert_close(compiled(idx), ref(idx), rtol=1e-5, atol=1e-5)  # the loss vs the dense twin


def test_padding_idx_matches_eager():
    model = _tensorized(padding_idx=0)
    idx = _idx(4)
    idx[0, :3] = 0
    report = _report(model, idx)
    assert "tt_embedding" in [r.kind for r in report.rewrites]
    _check_same(model, copy.deepcopy(model), (idx,))


def test_out_of_range_indices_raise_index_error_compiled():
    model = _tensorized()
    compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager"})
    compiled(_idx(7))
    for bad in (-1, 90, 10_000):  # negative, the first padding row (90 -> 90 padded), past the padding
        idx = _idx(7)
        idx[1, 2] = bad
        with pytest.raises(IndexError):
            model(idx)  # eager
        with pytest.raises(IndexError, match="index out of range"):
            compiled(idx)


def test_other_users_keep_the_dense_weight_and_stay_correct():
    class WithNorm(TinyLM):
        def forward(self, idx):
            return super().forward(idx) + 1e-3 * self.ups[0].weight.norm()

    torch.manual_seed(0)
    model = WithNorm()
    tensorize_(model, TTConfig(rank=5, min_size=0), filter_fn=lambda m, fqn: fqn == "ups.0")
    report = _report(model, _idx(8))
    assert any("still forms a dense weight" in s.reason for s in report.skipped)
    _check_same(model, copy.deepcopy(model), (_idx(8),))


def test_bf16_autocast_on_cpu():
    model = _tensorized(blocks=2)
    ref = copy.deepcopy(model)
    idx = _idx(9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = _report(model, idx)
        assert sum(r.kind.startswith("tt_") for r in report.rewrites) == 5
        ref_loss, ref_grads = _loss_grads(ref, ref, idx)
        compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager"})
        loss, grads = _loss_grads(compiled, model, idx)
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    for k in ref_grads:
        err = (grads[k].float() - ref_grads[k].float()).norm() / ref_grads[k].float().norm()
        assert err < 5e-2, (k, float(err))


def test_compiled_tt_model_trains_like_eager():
    model = _tensorized(seed=5)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(8):
        idx = _idx(100 + step)
        for fn, o, out in ((compiled, opt, losses), (ref, ref_opt, ref_losses)):
            o.zero_grad()
            loss = fn(idx)
            loss.backward()
            o.step()
            out.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4)


class QKV(nn.Module):
    def __init__(self, d=24):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).square().mean()


def test_layers_reading_the_same_input_share_one_first_factor_gemm():
    torch.manual_seed(0)
    model = QKV()
    tensorize_(model, TTConfig(rank=5, min_size=0, fmt="tt"))
    x = torch.randn(2, 7, 24)
    report = _report(model, x)
    assert _calls(report, tt_runtime.project) == 1  # x @ [F1_q | F1_k | F1_v]
    assert all("one GEMM with 2 other layer(s)" in r.detail for r in report.rewrites)
    _check_same(model, copy.deepcopy(model), (x,))


def test_arguments_the_lowering_does_not_reproduce_are_left_alone_by_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 12)
            self.fc = nn.Linear(12, 24, bias=False)

        def forward(self, idx):
            h = F.embedding(idx, self.emb.weight, scale_grad_by_freq=True)  # not reproduced by the lookup
            return torch.matmul(self.fc.weight, h.transpose(-1, -2)).square().mean()  # TT weight first

    torch.manual_seed(0)
    model = Odd()
    tensorize_(model, TTConfig(rank=3, min_size=0, fmt="tt"))
    idx = torch.randint(0, 40, (3, 5))
    report = _report(model, idx)
    assert not [r for r in report.rewrites if r.kind.startswith("tt_")], str(report)
    reasons = " | ".join(s.reason for s in report.skipped)
    assert "scale_grad_by_freq=True" in reasons and "first operand" in reasons, reasons
    _check_same(model, copy.deepcopy(model), (idx,))


# --- never a wrong number: writes between what the lowering reads early and where eager reads it -----

class _SharedInput(nn.Module):
    """Two factored TT layers reading the same activations, with an optional in-place write between."""

    def __init__(self, write):
        super().__init__()
        self.write = write
        self.q = nn.Linear(24, 24, bias=False)
        self.k = nn.Linear(24, 24, bias=False)

    def forward(self, x):
        h = torch.tanh(x)
        q = self.q(h)
        if self.write == "iadd":
            h += 1
        elif self.write == "view":
            h.view(-1)[:5] = 0.0
        elif self.write == "cores":
            with torch.no_grad():
                self.k.parametrizations.weight[0].core_flat.mul_(0.5)
        k = self.k(h)
        return (q * k).sum()


def _shared_input_model(write):
    torch.manual_seed(0)
    model = _SharedInput(write)
    tensorize_(model, TTConfig(rank=4, min_size=0, fmt="tt"))
    return model


@pytest.mark.parametrize("write", ["iadd", "view"])
def test_write_into_a_shared_input_splits_the_shared_gemm(write):
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    model, ref = _shared_input_model(write), _shared_input_model(write)
    with torch.no_grad():  # eager's backward refuses a write into a value the first layer saved
        expected = ref(x)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(model, backend="comera", options={"inner": "aot_eager"})(x),
                                   expected)
        torch._dynamo.reset()
        report = cc.explain(_shared_input_model(write), x, options={"inner": "aot_eager"})
    assert "first factor computed in one GEMM" not in str(report), str(report)
    assert sum(r.kind == "tt_linear" for r in report.rewrites) == 2, str(report)


def test_unwritten_shared_input_still_shares_the_gemm():
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    report = cc.explain(_shared_input_model(None), x, options={"inner": "aot_eager"})
    assert "first factor computed in one GEMM" in str(report), str(report)


def test_write_into_the_cores_in_forward_keeps_the_layer_and_matches_eager():
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(1))
    model, ref = _shared_input_model("cores"), _shared_input_model("cores")
    with torch.no_grad():
        expected = ref(x)
        torch._dynamo.reset()
        got = torch.compile(model, backend="comera", options={"inner": "aot_eager"})(x)
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
    report = cc.explain(_shared_input_model("cores"), x, options={"inner": "aot_eager"})
    reasons = [s.reason for s in report.skipped]
    assert any("writes in place" in r and "cores or gates" in r for r in reasons), str(report)


# --- never a wrong number (round 3): writes the matcher did not see, a later layer's bias, dead outputs,
# frozen members of a shared group -------------------------------------------------------------------

class _SharedQKV(nn.Module):
    """Q, K and V reading one input (at d 48 a btt layer has 8 x 6 blocks), with ``case`` between them:
    a ``_foreach`` write / a ``mark_dirty`` write / a plain write into the input, a write into K's bias,
    or K's output left unused."""

    def __init__(self, case, d=48):
        super().__init__()
        self.case = case
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = x * 1.0
        q = self.q(h)
        if self.case == "foreach":
            torch._foreach_mul_([h], 2.0)
        elif self.case == "dirty":
            _Dirty.apply(h)
        elif self.case == "mul_":
            h.mul_(2.0)
        elif self.case == "bias":
            with torch.no_grad():
                self.k.bias.add_(1.0)
        k, v = self.k(h), self.v(h)
        if self.case == "dead":
            return (q + v).sum()
        return (q * k + v).sum()


SHARED = [("btt", "blocks"), ("btt", "auto"), ("tt", "auto")]  # shared blocks call, dense group, factored


def _shared_qkv(case, fmt):
    torch.manual_seed(0)
    model = _SharedQKV(case)
    tensorize_(model, TTConfig(fmt=fmt, rank=2, min_size=0))
    if case in ("foreach", "dirty", "mul_"):
        model.q.requires_grad_(False)  # eager's backward then needs no value the write changes
    return model


def _check_shared_qkv(case, fmt, strategy, x_grad=False):
    """Compiled (aot_eager) against eager: the loss, which parameters get a gradient (None stays None),
    every gradient, and the input's gradient where it has one."""
    x0 = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1))
    results = []
    for compiled in (False, True):
        model = _shared_qkv(case, fmt)
        x = x0.clone().requires_grad_(x_grad or case == "dirty")  # Dynamo traces mark_dirty only then
        torch._dynamo.reset()
        fn = torch.compile(model, backend="comera", options={"inner": "aot_eager", "tt_strategy": strategy}) \
            if compiled else model
        loss = fn(x)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, x.grad, model))
    (ref, ref_grads, ref_dx, _), (out, grads, dx, model) = results
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
    if ref_dx is not None:
        torch.testing.assert_close(dx, ref_dx, rtol=1e-4, atol=1e-4)
    return model


@pytest.mark.parametrize("fmt,strategy", SHARED)
@pytest.mark.parametrize("case", ["foreach", "dirty"])
def test_foreach_and_mark_dirty_writes_into_a_shared_input_split_the_shared_call(case, fmt, strategy):
    _check_shared_qkv(case, fmt, strategy)


@pytest.mark.parametrize("fmt,strategy", SHARED)
def test_a_write_into_a_later_layers_bias_keeps_it_out_of_the_shared_call(fmt, strategy):
    _check_shared_qkv("bias", fmt, strategy)


@pytest.mark.parametrize("fmt,strategy", SHARED + [("ttm", "auto")])
def test_a_layer_whose_output_is_unused_gets_no_gradient(fmt, strategy):
    model = _check_shared_qkv("dead", fmt, strategy)
    k_params = list(model.k.parameters())
    assert all(p.grad is None for p in k_params)
    before = [p.detach().clone() for p in k_params]
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    for p, b in zip(k_params, before):  # AdamW leaves a parameter without a gradient as it is
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)


@pytest.mark.parametrize("x_grad", [False, True])
@pytest.mark.parametrize("fmt,strategy", SHARED + [("ttm", "auto")])
def test_a_frozen_layer_read_before_a_write_into_its_input_saves_nothing_it_writes(fmt, strategy, x_grad):
    _check_shared_qkv("mul_", fmt, strategy, x_grad)
