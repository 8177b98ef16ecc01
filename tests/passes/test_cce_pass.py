"""passes/cce.py: every LM-head + cross-entropy pattern is fused (explain shows "cce") and matches eager;
every unsupported variant is left alone, with a reason, and still matches eager."""

import copy
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared writers
from writers import ScaleInPlace as _Dirty, opaque_scale as _opaque_scale  # noqa: E402

V, D = 37, 12


class Head(nn.Module):
    """h -> projection -> chain -> loss, selected by `variant`."""

    def __init__(self, variant, bias=False):
        super().__init__()
        self.variant = variant
        self.body = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=bias)
        self.loss_mod = nn.CrossEntropyLoss(reduction="sum")

    def forward(self, x, y):
        h = torch.tanh(self.body(x))  # [B, T, D]
        v = self.variant
        W = self.lm_head.weight
        if v == "linear_mean":
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.view(-1))
        if v == "module_sum":
            return self.loss_mod(self.lm_head(h).reshape(-1, V), y.reshape(-1))
        if v == "matmul_T":
            return F.cross_entropy((h @ W.T).flatten(0, 1), y.flatten())
        if v == "matmul_t_bias":
            return F.cross_entropy((h @ W.t() + self.lm_head.bias).view(-1, V), y.view(-1))
        if v == "torch_matmul_transpose":
            return F.cross_entropy(torch.matmul(h, W.transpose(0, 1)).view(-1, V), y.view(-1))
        if v == "shift":
            logits = self.lm_head(h)
            return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), y[..., 1:].reshape(-1))
        if v == "shift_upcast_softcap":
            logits = self.lm_head(h)
            logits = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(logits[:, :-1, :].float().reshape(-1, V), y[:, 1:].reshape(-1))
        if v == "log_softmax_nll":
            lp = F.log_softmax(self.lm_head(h).view(-1, V), dim=-1)
            return F.nll_loss(lp, y.view(-1), reduction="sum")
        if v == "none":
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.view(-1), reduction="none")
        if v == "ignore_custom":
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.clamp(min=0).view(-1), ignore_index=5)
        if v == "label_smoothing":
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.view(-1), label_smoothing=0.1)
        if v == "linear_cross_entropy":
            return F.linear_cross_entropy(h.reshape(-1, D), W, y.reshape(-1))
        # --- unsupported variants -------------------------------------------------------------
        if v == "logits_returned":
            logits = self.lm_head(h)
            return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits
        if v == "class_weights":
            w = torch.linspace(0.5, 1.5, V)
            return F.cross_entropy(self.lm_head(h).view(-1, V), y.view(-1), weight=w)
        if v == "vocab_slice":
            return F.cross_entropy(self.lm_head(h)[..., : V - 2].reshape(-1, V - 2), y.view(-1) % (V - 2))
        if v == "prob_targets":
            p = F.softmax(torch.randn(y.numel(), V, generator=torch.Generator().manual_seed(0)), -1)
            return F.cross_entropy(self.lm_head(h).view(-1, V), p)
        if v == "class_dim_1":
            return F.cross_entropy(self.lm_head(h).transpose(1, 2), y)
        raise AssertionError(v)


FUSED = ["linear_mean", "module_sum", "matmul_T", "matmul_t_bias", "torch_matmul_transpose", "shift",
         "shift_upcast_softcap", "log_softmax_nll", "none", "ignore_custom", "label_smoothing"]
if hasattr(F, "linear_cross_entropy"):
    FUSED.append("linear_cross_entropy")
UNSUPPORTED = {
    "logits_returned": "other users",
    "class_weights": "class weights",
    "vocab_slice": "vocabulary dimension",
    "prob_targets": "class indices",
    "class_dim_1": "moves or indexes the vocabulary dimension",
}


def _inputs(seed, batch=2, seq=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, D, generator=g)
    y = torch.randint(0, V, (batch, seq), generator=g)
    y[0, 2] = -100
    y[1, 1] = 5
    y[1, 3] = 3
    return x, y


def _run(model, x, y):
    model.zero_grad(set_to_none=True)
    out = model(x, y)
    loss = out[0] if isinstance(out, tuple) else out
    (loss.sum() if loss.dim() else loss).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(variant, inner="aot_eager", dynamic=False, bias=None):
    torch.manual_seed(0)
    model = Head(variant, bias=variant == "matmul_t_bias" if bias is None else bias)
    ref = copy.deepcopy(model)
    x, y = _inputs(1)
    ref_out, ref_grads = _run(ref, x, y)
    compiled = torch.compile(model, backend="comera", dynamic=dynamic, options={"inner": inner, "cce_min_vocab": 0})
    out, _ = _run(compiled, x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    torch._dynamo.reset()
    return cc.explain(copy.deepcopy(ref), x, y, options={"inner": "eager", "cce_min_vocab": 0})


@pytest.mark.parametrize("variant", FUSED)
def test_pattern_fused_and_matches_eager(variant):
    report = _check(variant)
    kinds = [r.kind for r in report.rewrites]
    assert kinds == ["cce"], (variant, str(report))
    assert report.rewrites[0].module in ("lm_head", None)
    code = report.graphs[0].code
    assert "comera.linear_cross_entropy" in code
    assert "cross_entropy(" not in code.replace("linear_cross_entropy", "")
    assert "nll_loss" not in code


@pytest.mark.parametrize("variant", list(UNSUPPORTED))
def test_unsupported_left_alone_with_reason(variant):
    report = _check(variant)
    assert report.rewrites == []
    reasons = [s.reason for s in report.skipped if s.kind == "cce"]
    assert reasons and UNSUPPORTED[variant] in reasons[0], reasons
    assert "comera.linear_cross_entropy" not in report.graphs[0].code


def test_tied_embedding_gpt_inductor_dynamic():
    import sys, os
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from zoo import GPT, loss_and_grads

    model = GPT()
    ref = copy.deepcopy(model)
    (idx,) = GPT.example(seed=4)
    ref_loss, ref_grads = loss_and_grads(ref, [idx])
    compiled = torch.compile(model, backend="comera", dynamic=True, options={"cce_min_vocab": 0})
    loss, grads = loss_and_grads(compiled, [idx], params_of=model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6)
    report = cc.explain(copy.deepcopy(ref), idx, options={"inner": "eager", "cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"]


def test_pass_can_be_switched_off():
    x, y = _inputs(2)
    report = cc.explain(Head("linear_mean"), x, y, options={"inner": "eager", "passes": {"cce": False}})
    assert report.rewrites == [] and "comera.linear_cross_entropy" not in report.graphs[0].code


def test_min_vocab_option_leaves_small_heads():
    x, y = _inputs(3)
    report = cc.explain(Head("linear_mean"), x, y, options={"inner": "eager", "cce_min_vocab": 1000})
    assert report.rewrites == [] and "cce_min_vocab" in report.skipped[0].reason


def test_no_grad_inference():
    model = Head("shift")
    x, y = _inputs(5)
    with torch.no_grad():
        ref = model(x, y)
        out = torch.compile(model, backend="comera", options={"inner": "aot_eager"})(x, y)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_exact_backward_option_reaches_the_op():
    x, y = _inputs(6)
    report = cc.explain(Head("linear_mean"), x, y,
                        options={"inner": "eager", "cce_backward": "exact", "cce_min_vocab": 0})
    assert "'exact'" in report.graphs[0].code


@pytest.mark.parametrize("strategy", ["sparse", "static", "fused", "chunked"])
def test_pinned_strategy_reaches_the_op_and_matches_eager(strategy):
    """``cce_strategy`` pins the op's path (shown in explain); the compiled loss and gradients
    still match eager whichever path runs."""
    x, y = _inputs(7)
    report = cc.explain(Head("linear_mean"), x, y,
                        options={"inner": "eager", "cce_strategy": strategy, "cce_min_vocab": 0})
    assert f"'{strategy}'" in report.graphs[0].code and f"path={strategy}" in str(report), str(report)
    torch.manual_seed(0)
    model = Head("linear_mean")
    ref = copy.deepcopy(model)
    ref_out, ref_grads = _run(ref, x, y)
    compiled = torch.compile(model, backend="comera",
                             options={"inner": "aot_eager", "cce_strategy": strategy, "cce_min_vocab": 0})
    out, _ = _run(compiled, x, y)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("options, rewrites", [({"cce_min_vocab": 0}, 1), ({"cce_min_vocab": None}, 0),
                                              ({"cce_min_vocab": 0, "cce_strategy": "static"}, 1)])
def test_the_cost_model_runs_once_per_head(monkeypatch, options, rewrites):
    """One decision per head (whether fusing pays, the op's path): the build and the detail explain
    shows read it; the cost model is not run again for each."""
    import comera_compile.cce.planner as plan

    runs = []
    estimate = plan.estimate_seconds
    monkeypatch.setattr(plan, "estimate_seconds", lambda *a, **k: runs.append((a, k)) or estimate(*a, **k))
    x, y = _inputs(8)
    report = cc.explain(Head("linear_mean"), x, y, options={"inner": "eager", **options})
    assert len(report.rewrites) == rewrites and len(report.rewrites) + len(_cce_skips(report)) == 1
    pinned = options.get("cce_strategy", "auto") != "auto"
    assert len(runs) == (0 if pinned else 1), runs  # a pinned path with cce_min_vocab needs no estimate
    if rewrites:
        path = options.get("cce_strategy") or plan.choose_strategy(*runs[0][0][:4], rates=runs[0][1]["rates"])
        assert f"path={path}" in str(report) and f"'{path}'" in report.graphs[0].code


def test_bad_strategy_option_names_the_choices():
    from comera_compile.options import OptionsError

    with pytest.raises(OptionsError, match="cce_strategy.*'auto', 'chunked', 'sparse', 'static', 'fused'"):
        cc.CompileOptions(cce_strategy="fastest")


# --- rewrites that are never wrong ---------------------------------------------------------------

def _against_eager(fn, B=2, T=5, hidden=8, vocab=V, options=None):
    """Loss and gradients of ``fn(h, W, b, y)`` compiled (aot_eager) vs eager; returns the explain report."""
    g = torch.Generator().manual_seed(10)
    h0, W0, b0 = torch.randn(B, T, hidden, generator=g), torch.randn(vocab, hidden, generator=g), torch.randn(vocab, generator=g)
    y = torch.randint(0, vocab, (B, T), generator=g)
    y[0, 1] = -100
    results = []
    for compiled in (False, True):
        h, W, b = (t.clone().requires_grad_() for t in (h0, W0, b0))
        if compiled:
            report = cc.explain(fn, h, W, b, y, options={"inner": "aot_eager", "cce_min_vocab": 0, **(options or {})})
            loss = report.output
        else:
            loss = fn(h, W, b, y)
        loss.sum().backward()
        results.append((loss.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in (h, W, b)]))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for name, a, e in zip("hWb", grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    return report


def _cce_skips(report):
    return [s.reason for s in report.skipped if s.kind == "cce"]


def test_case1_add_alpha_is_left_alone_naming_alpha():
    report = _against_eager(lambda h, W, b, y: F.cross_entropy(torch.add(h @ W.T, b, alpha=2.0).view(-1, V), y.view(-1)))
    assert report.rewrites == [] and "alpha=2.0" in _cce_skips(report)[0]


def test_case2_div_rounding_mode_is_no_softcap():
    def fn(h, W, b, y):
        z = h @ W.T
        return F.cross_entropy((torch.tanh(torch.div(z, 3.0, rounding_mode="floor")) * 3.0).view(-1, V), y.view(-1))

    report = _against_eager(fn)
    assert report.rewrites == [] and "rounding_mode='floor'" in _cce_skips(report)[0]


def test_case3_select_after_view_reaches_the_right_rows():
    def fn(h, W, b, y):
        logits = F.linear(h.reshape(-1, 8), W).view(2, 5, V)
        return F.cross_entropy(logits[0], y[0])

    report = _against_eager(fn)
    assert [r.kind for r in report.rewrites] == ["cce"]


def test_case3_shift_after_view_when_seq_len_equals_hidden():
    def fn(h, W, b, y):
        logits = F.linear(h.reshape(-1, 8), W).view(2, 8, V)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1))

    report = _against_eager(fn, T=8, hidden=8)
    assert [r.kind for r in report.rewrites] == ["cce"]


def test_case7_all_keyword_arguments_are_fused():
    def fn(h, W, b, y):
        return F.cross_entropy(input=F.linear(input=h, weight=W, bias=b).view(-1, V), target=y.view(-1),
                               reduction="sum")

    report = _against_eager(fn)
    assert [r.kind for r in report.rewrites] == ["cce"] and not report.skipped


@pytest.mark.parametrize("case", ["transpose_rows", "select_dim1", "index_tensor", "temperature_softcap",
                                  "nll_log_softmax_before_flatten", "addmm", "strided_weight_view"])
def test_row_and_value_ops_are_fused_exactly(case):
    idx = torch.tensor([4, 0, 2])
    fns = {
        "transpose_rows": lambda h, W, b, y: F.cross_entropy(F.linear(h, W, b).transpose(0, 1).reshape(-1, V),
                                                             y.t().reshape(-1)),
        "select_dim1": lambda h, W, b, y: F.cross_entropy((h @ W.t()).select(1, 3), y[:, 2], label_smoothing=0.1),
        "index_tensor": lambda h, W, b, y: F.cross_entropy(F.linear(h, W)[:, idx].flatten(0, 1), y[:, :3].flatten()),
        "temperature_softcap": lambda h, W, b, y: F.cross_entropy(
            (torch.tanh((h @ W.T + b) / 0.7 / 3.0) * 3.0).float().view(-1, V), y.view(-1), reduction="none"),
        "nll_log_softmax_before_flatten": lambda h, W, b, y: F.nll_loss(
            torch.matmul(h, W.T).log_softmax(-1)[:, 1:].flatten(0, 1), y[:, :-1].flatten(), reduction="sum"),
        "addmm": lambda h, W, b, y: F.cross_entropy(torch.addmm(b, h.reshape(-1, 8), W.t()), y.reshape(-1)),
        # a lowered TT head: the weight is a transposed view of one slice of an unbind
        "strided_weight_view": lambda h, W, b, y: F.cross_entropy(
            F.linear(h, torch.unbind(torch.stack([W, 2 * W]).transpose(1, 2))[1].t()).view(-1, V), y.view(-1)),
    }
    report = _against_eager(fns[case])
    assert [r.kind for r in report.rewrites] == ["cce"], str(report)


@pytest.mark.parametrize("case,blocker", [
    ("inplace", "in-place mul_"),
    ("double", "torch.float64"),
    ("bias_after_scale", "a bias added after"),
    ("sub", "torch.sub"),
    ("flatten_vocab", "merges the vocabulary dimension"),
    ("movedim", ".movedim() (movedim)"),
])
def test_unsupported_path_ops_are_left_alone_naming_the_blocker(case, blocker):
    fns = {
        "inplace": lambda h, W, b, y: F.cross_entropy(F.linear(h, W).mul_(2).reshape(-1, V), y.reshape(-1)),
        "double": lambda h, W, b, y: F.cross_entropy(F.linear(h, W).double().reshape(-1, V), y.reshape(-1)),
        "bias_after_scale": lambda h, W, b, y: F.cross_entropy(((h @ W.T) * 2 + b).reshape(-1, V), y.reshape(-1)),
        "sub": lambda h, W, b, y: F.cross_entropy(torch.sub(h @ W.T, b).reshape(-1, V), y.reshape(-1)),
        "flatten_vocab": lambda h, W, b, y: F.cross_entropy(F.linear(h, W).flatten(1).view(-1, V), y.reshape(-1)),
        "movedim": lambda h, W, b, y: F.cross_entropy(F.linear(h, W).movedim(0, 1).reshape(-1, V), y.t().reshape(-1)),
    }
    report = _against_eager(fns[case])
    assert report.rewrites == [] and blocker in _cce_skips(report)[0], _cce_skips(report)


def test_cost_rule_leaves_small_vocabularies_alone_by_default():
    from comera_compile.cce import fused_loss_pays

    fn = lambda h, W, b, y: F.cross_entropy(F.linear(h, W).view(-1, 3), y.view(-1).clamp(0, 2))  # noqa: E731
    report = _against_eager(fn, vocab=3, options={"cce_min_vocab": None})
    ok, reason = fused_loss_pays(10, 8, 3, torch.float32, "cpu")
    assert not ok and report.rewrites == [] and _cce_skips(report) == [reason]


# --- the policy (memory by default), the device's rates, the logits' memory in explain -------------

def test_small_head_left_alone_naming_its_logits_memory():
    """Default options, a tiny head on the CPU: its logits are below cce_memory_threshold and its fused
    loss is slower at the CPU's rates (not the H200's): left alone, explain stating the logits' size."""
    from comera_compile.cce import fused_loss_pays

    fn = lambda h, W, b, y: F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1))  # noqa: E731
    report = _against_eager(fn, options={"cce_min_vocab": None})
    (reason,) = _cce_skips(report)
    assert report.rewrites == [] and reason.startswith("logits 2 KiB float32: below cce_memory_threshold 64 MiB, and ")
    assert reason == fused_loss_pays(10, 8, V, torch.float32, "cpu")[1] != fused_loss_pays(10, 8, V, torch.float32, "cuda")[1]


def _vocab_a_few_percent_slower(n_tokens, hidden, least):
    """A vocabulary (>= least) whose fused loss the CPU's rates put slower than the unfused one, within
    the memory policy's cap (found through the cost model, so it follows the rates)."""
    from comera_compile.devices import CPU
    from comera_compile.cce import MEMORY_POLICY_SLOWDOWN, decide_fused_loss

    for vocab in range(least, 20001, 100):
        if 1.0 < decide_fused_loss(n_tokens, hidden, vocab, torch.float32, rates=CPU).slowdown <= MEMORY_POLICY_SLOWDOWN:
            return vocab
    raise AssertionError(f"no vocabulary from {least} puts the fused loss within 1.15x")


@pytest.mark.parametrize("policy", ["memory", "speed"])
def test_policy_decides_a_head_a_few_percent_slower(policy):
    """A head whose fused loss is estimated a few percent slower on the CPU, its logits above the
    threshold: the memory policy fuses it (explain: the memory avoided and the estimated slowdown) and
    loss and gradients equal eager's; the speed policy leaves it, stating the logits' memory. With the
    default threshold (64 MiB) the memory policy leaves it too."""
    B, T, hidden = 4, 32, 16
    vocab = _vocab_a_few_percent_slower(B * T, hidden, least=(1 << 20) // (B * T * 4) + 1)
    logits = f"logits {B * T * vocab * 4 / 2**20:.3g} MiB float32"
    fn = lambda h, W, b, y: F.cross_entropy(F.linear(h, W).view(-1, vocab), y.view(-1))  # noqa: E731
    options = {"cce_min_vocab": None, "cce_policy": policy, "cce_memory_threshold": 1 << 20}
    report = _against_eager(fn, B=B, T=T, hidden=hidden, vocab=vocab, options=options)
    if policy == "memory":
        assert [r.kind for r in report.rewrites] == ["cce"] and _cce_skips(report) == [], str(report)
        assert re.search(rf"path=chunked; {logits} avoided, for an estimated 1\.\d\dx the unfused loss's time$",
                         report.rewrites[0].detail), report.rewrites[0].detail
        torch._dynamo.reset()
        report = _against_eager(fn, B=B, T=T, hidden=hidden, vocab=vocab, options={"cce_min_vocab": None})
        assert _cce_skips(report)[0].startswith(f"{logits}: below cce_memory_threshold 64 MiB")
    else:
        (reason,) = _cce_skips(report)
        assert report.rewrites == [] and reason.endswith(f"; {logits} (cce_policy='speed')"), reason


# --- never a wrong number: writes between the head and the loss, scales and biases at the edges ------

def _idx_write(h, W, b, y):
    idx = torch.arange(3)
    logits = F.linear(h, W)[:, idx]
    idx.add_(1)
    return F.cross_entropy(logits.flatten(0, 1), y[:, :3].flatten())


def _written(kind):
    """A head whose hidden states, weight, bias or row index is written in place after the projection."""
    def fn(h, W, b, y):
        h, W, b = h * 1.0, W * 1.0, b * 1.0  # non-leaf copies: eager allows writing into them
        logits = F.linear(h, W, b if kind == "bias" else None)
        aux = None
        if kind == "iadd":
            h += 1
        elif kind == "mul_":
            h.mul_(0.5)
        elif kind == "setitem":
            h[0] = 0
        elif kind == "relu_module_aux":
            aux = nn.ReLU(inplace=True)(h)
        elif kind == "relu_positional":
            F.relu(h, True)
        elif kind == "out":
            torch.mul(h, 2.0, out=h)
        elif kind == "view_alias":
            h.view(-1).add_(1)
        elif kind == "weight":
            W.mul_(2)
        elif kind == "weight_transposed_alias":
            W.t().mul_(2)
        elif kind == "bias":
            b.zero_()
        loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
        return loss + aux.mean() if aux is not None else loss
    return fn


WRITES = ["iadd", "mul_", "setitem", "relu_module_aux", "relu_positional", "out", "view_alias", "weight",
          "weight_transposed_alias", "bias"]


def _with_grads_of(fn, trainable, B=2, T=5, hidden=8):
    """``fn(h, W, b, y)`` compiled (aot_eager) vs eager, with gradients for the inputs in ``trainable``
    only (eager refuses a backward through a value it saved and that was then written); returns the
    explain report."""
    g = torch.Generator().manual_seed(10)
    h0, W0, b0 = torch.randn(B, T, hidden, generator=g), torch.randn(V, hidden, generator=g), torch.randn(V, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    results = []
    for compiled in (False, True):
        ins = [t.clone().requires_grad_(name in trainable) for name, t in zip("hWb", (h0, W0, b0))]
        with torch.enable_grad() if trainable else torch.no_grad():
            if compiled:
                torch._dynamo.reset()
                report = cc.explain(fn, *ins, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
                loss = report.output
            else:
                loss = fn(*ins, y)
        grads = torch.autograd.grad(loss, [t for t in ins if t.requires_grad]) if trainable else ()
        results.append((loss.detach(), grads))
    (ref, ref_grads), (out, grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, e in zip(grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    return report


@pytest.mark.parametrize("trainable", ["", "h"])
@pytest.mark.parametrize("kind", WRITES + ["index"])
def test_write_between_head_and_loss_is_left_alone_and_matches_eager(kind, trainable):
    if trainable and kind in ("weight", "weight_transposed_alias", "index", "out"):
        pytest.skip("eager's backward refuses this write (the projection saved the written value, or out=)")
    report = _with_grads_of(_idx_write if kind == "index" else _written(kind), trainable)
    assert report.rewrites == [], str(report)
    assert "writes in place" in _cce_skips(report)[0], _cce_skips(report)


@pytest.mark.parametrize("kind", ["before_projection", "unrelated", "after_loss_on_a_copy"])
def test_writes_that_change_nothing_the_op_reads_still_fuse(kind):
    def fn(h, W, b, y):
        h = h * 1.0
        other = b * 1.0
        if kind == "before_projection":
            h += 1
        logits = F.linear(h, W)
        if kind == "unrelated":
            other.mul_(3)
        loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
        if kind == "after_loss_on_a_copy":
            other.add_(1)
        return loss + other.sum()

    report = _with_grads_of(fn, "hWb")
    assert [r.kind for r in report.rewrites] == ["cce"], str(report)


@pytest.mark.parametrize("mode", ["no_grad", "frozen_head"])
def test_write_after_the_head_is_left_alone_in_eval_and_with_a_frozen_head(mode):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(8, V, bias=False)
    if mode == "frozen_head":
        head.requires_grad_(False)

    def fn(x, y):
        h = torch.tanh(x)
        logits = head(h)
        h.mul_(0.5)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))

    x, y = torch.randn(2, 5, 8, generator=g), torch.randint(0, V, (2, 5), generator=g)
    with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
        expected = fn(x, y)
        report = cc.explain(fn, x, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    torch.testing.assert_close(report.output, expected)
    assert report.rewrites == [] and "writes in place" in _cce_skips(report)[0]


def test_write_after_the_head_with_default_options_and_inductor():
    """The reported case: N=512, V=32000, default options (the cost rule fuses this head)."""
    g = torch.Generator().manual_seed(0)
    x0, W = torch.randn(512, 16, generator=g), torch.randn(32000, 16, generator=g) * 0.1
    y = torch.randint(0, 32000, (512,), generator=g)

    def fn(x, W, y):
        h = x * 2.0
        logits = F.linear(h, W)
        h += 1
        return F.cross_entropy(logits, y)

    x = x0.clone().requires_grad_()
    expected = fn(x, W, y)
    (gx_ref,) = torch.autograd.grad(expected, x)
    torch._dynamo.reset()
    x = x0.clone().requires_grad_()
    got = torch.compile(fn, backend="comera")(x, W, y)
    (gx,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(gx, gx_ref)
    torch._dynamo.reset()
    report = cc.explain(fn, x0.clone().requires_grad_(), W, y)
    assert "writes in place" in " ".join(_cce_skips(report)), str(report)


def _unseen_write(kind):
    """A head whose hidden states or weight is written after the projection by an op the write
    analysis once missed: a ``_foreach`` op, an ``autograd.Function`` marking its input dirty, or a
    function whose writes are unknown."""
    def fn(h, W, b, y):
        h, W = h * 1.0, W * 1.0
        logits = F.linear(h, W)
        if kind == "foreach":
            torch._foreach_mul_([h], 0.5)
        elif kind == "foreach_weight":
            torch._foreach_mul_([W], 2.0)
        elif kind == "dirty":
            _Dirty.apply(h)
        elif kind == "opaque":
            _opaque_scale(h)
        return F.cross_entropy(logits.view(-1, V), y.view(-1))
    return fn


@pytest.mark.parametrize("kind,trainable", [("foreach", ""), ("foreach", "h"), ("foreach_weight", ""),
                                            ("dirty", "h"), ("opaque", ""), ("opaque", "h")])
def test_writes_by_foreach_mark_dirty_or_unknown_ops_are_left_alone_and_match_eager(kind, trainable):
    report = _with_grads_of(_unseen_write(kind), trainable)
    assert report.rewrites == [], str(report)
    reason = _cce_skips(report)[0]
    assert ("may write into" if kind == "opaque" else "writes in place") in reason, reason


@pytest.mark.parametrize("trainable,fused", [("h", False), ("", True)])
def test_write_after_the_loss_into_what_the_fused_op_saves(trainable, fused):
    """A frozen head saves only its weight, so eager allows a write into h after the loss; the fused op
    saves h for its backward: in training it leaves the loss alone, without gradients it fuses."""
    def fn(h, W, b, y):
        h = h * 1.0
        loss = F.cross_entropy(F.linear(h, W).view(-1, V), y.view(-1))
        h.mul_(0.5)
        return loss

    report = _with_grads_of(fn, trainable)
    if fused:
        assert [r.kind for r in report.rewrites] == ["cce"], str(report)
    else:
        assert report.rewrites == [] and "after the loss" in _cce_skips(report)[0], str(report)


def _fp16_head(scale_op):
    def fn(h, W, b, y):
        z = F.linear(h, W).float()
        z = z * 64 if scale_op == "mul64" else z / 0.015625 if scale_op == "div" else z * 0.5
        return F.cross_entropy(z.view(-1, V), y.view(-1))
    return fn


@pytest.mark.parametrize("scale_op", ["mul64", "div"])
def test_fp16_scale_that_could_overflow_is_not_folded(scale_op):
    """|h| ~ 1e3 in fp16: h * 64 overflows fp16 (65504), eager's fp32 logits * 64 does not."""
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(2, 5, 8, generator=g) * 1e3).half().requires_grad_()
    W = (torch.randn(V, 8, generator=g) * 0.05).half().requires_grad_()
    y = torch.randint(0, V, (2, 5), generator=g)
    fn = _fp16_head(scale_op)
    expected = fn(h, W, None, y)
    ref_grads = torch.autograd.grad(expected, (h, W))
    report = cc.explain(fn, h, W, None, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    grads = torch.autograd.grad(report.output, (h, W))
    assert torch.isfinite(expected) and torch.isfinite(report.output)
    torch.testing.assert_close(report.output, expected)
    for a, e in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e)
    assert report.rewrites == [] and "overflow" in _cce_skips(report)[0]


def test_fp16_scale_below_one_is_folded_and_matches_eager():
    g = torch.Generator().manual_seed(1)
    h, W = torch.randn(2, 5, 8, generator=g).half(), torch.randn(V, 8, generator=g).half()
    y = torch.randint(0, V, (2, 5), generator=g)
    fn = _fp16_head("half")
    report = cc.explain(fn, h, W, None, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"]
    torch.testing.assert_close(report.output, fn(h, W, None, y), rtol=2e-3, atol=2e-3)


def test_fp32_bias_after_fp16_upcast_keeps_eager_precision():
    """fp16 logits ``.float() + b`` with an fp32 bias (|b| ~ 20): the bias is added in fp32, as eager
    does; cast to fp16 first it cost 167x eager's error against float64."""
    g = torch.Generator().manual_seed(2)
    h, W = torch.randn(4, 16, 8, generator=g).half(), torch.randn(V, 8, generator=g).half()
    b = torch.randn(V, generator=g) * 20
    y = torch.randint(0, V, (4, 16), generator=g)

    def fn(h, W, b, y):
        return F.cross_entropy((F.linear(h, W).float() + b).view(-1, V), y.view(-1))

    ref = F.cross_entropy((F.linear(h.double(), W.double()) + b.double()).view(-1, V), y.view(-1))
    eager_err = abs(float(fn(h, W, b, y)) - float(ref))
    report = cc.explain(fn, h, W, b, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"]
    assert abs(float(report.output) - float(ref)) <= 2 * eager_err + 1e-6, (float(report.output), float(ref))


def test_confident_per_token_losses_are_never_negative(monkeypatch):
    """reduction="none" with the target logit far above the rest, through the Triton kernels."""
    monkeypatch.setenv("COMERA_FORCE_TRITON", "1")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 300, (64,), generator=g)
    W = torch.randn(300, 32, generator=g) * 0.1
    W[y] = 3.0 * h

    def fn(h, W, y):
        return F.cross_entropy(F.linear(h, W), y, reduction="none")

    expected = fn(h, W, y)
    report = cc.explain(fn, h, W, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"]
    assert (report.output >= 0).all(), report.output.min()
    torch.testing.assert_close(report.output, expected, rtol=1e-5, atol=1e-4)


def test_mixed_dtype_head_outside_autocast_raises_like_eager():
    """fp32 hidden states into a bf16 head: eager's matmul raises; fake tensors do not check, so the
    fused op would have computed a loss. The original call is kept, and raises the same way."""
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(8, 16, generator=g), torch.randn(V, 16, generator=g).bfloat16()
    y = torch.randint(0, V, (8,), generator=g)

    def fn(h, W, y):
        return F.cross_entropy(F.linear(h, W).float(), y)

    with pytest.raises(RuntimeError, match="dtype") as eager:
        fn(h, W, y)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="dtype") as compiled:
        torch.compile(fn, backend="comera", options={"inner": "aot_eager", "cce_min_vocab": 0})(h, W, y)
    assert type(compiled.value) is type(eager.value) or isinstance(compiled.value, RuntimeError)


def test_mixed_dtype_head_under_autocast_is_fused_and_matches_eager():
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(8, 16, generator=g), torch.randn(V, 16, generator=g)
    y = torch.randint(0, V, (8,), generator=g)

    def fn(h, W, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = F.linear(h, W)
        return F.cross_entropy(z.float(), y)

    report = cc.explain(fn, h, W, y, options={"inner": "aot_eager", "cce_min_vocab": 0})
    assert [r.kind for r in report.rewrites] == ["cce"], str(report)
    torch.testing.assert_close(report.output, fn(h, W, y), rtol=1e-2, atol=1e-2)


def test_bias_of_shape_1_v_is_fused_like_bart():
    """BART adds ``final_logits_bias`` of shape [1, V] to the logits: the same bias for every row."""
    report = _against_eager(lambda h, W, b, y: F.cross_entropy((F.linear(h, W) + b.view(1, V)).view(-1, V), y.view(-1)))
    assert [r.kind for r in report.rewrites] == ["cce"], str(report)
    assert "bias=yes" in report.rewrites[0].detail


def test_bias_that_differs_per_row_is_left_alone():
    """A [T, V] addend is not one bias for every row: left alone, naming its shape."""
    def fn(h, W, b, y):
        per_position = torch.stack([b * (t + 1) for t in range(5)])  # [T=5, V]
        return F.cross_entropy((F.linear(h, W) + per_position).view(-1, V), y.view(-1))

    report = _against_eager(fn)
    assert report.rewrites == [] and "not a [V] bias" in _cce_skips(report)[0], _cce_skips(report)


_TORCH_LCE = pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.13 has no F.linear_cross_entropy")


@_TORCH_LCE
@pytest.mark.parametrize("case", ["bias_smoothing_sum", "ignore_index_none", "module"])
def test_torch_linear_cross_entropy_with_its_arguments_is_fused_and_matches_eager(case):
    torch.manual_seed(0)
    module = nn.LinearCrossEntropyLoss(8, V, bias=True, label_smoothing=0.05) if case == "module" else None
    fns = {
        "bias_smoothing_sum": lambda h, W, b, y: F.linear_cross_entropy(
            h.reshape(-1, 8), W, y.reshape(-1), linear_bias=b, reduction="sum", label_smoothing=0.1),
        "ignore_index_none": lambda h, W, b, y: F.linear_cross_entropy(
            h.reshape(-1, 8), W, y.reshape(-1).clamp_min(0), ignore_index=5, reduction="none"),
        "module": lambda h, W, b, y: module(h.reshape(-1, 8), y.reshape(-1)),
    }
    report = _against_eager(fns[case])
    assert [r.kind for r in report.rewrites] == ["cce"], str(report)


@_TORCH_LCE
def test_torch_linear_cross_entropy_with_class_weights_is_left_alone():
    w = torch.linspace(0.5, 1.5, V)
    report = _against_eager(lambda h, W, b, y: F.linear_cross_entropy(h.reshape(-1, 8), W, y.reshape(-1), weight=w))
    assert report.rewrites == [] and "class weights" in _cce_skips(report)[0], _cce_skips(report)
