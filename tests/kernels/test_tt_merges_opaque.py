"""``options={"tt_merges": "opaque"}``: the token-independent merges of each layer group as one custom op
forward and one backward. A compiled training step against eager (loss and every gradient) for TT
(factored), TT-matrix (dense weight) and a TT-matrix embedding (tables), with explain saying so; the ops'
registrations (torch.library.opcheck: schema, fake, autograd); the bad value."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc
from comera_compile import explain
from comera_compile.kernels import tt_group_merge, tt_runtime
from comera_compile.options import OptionsError
from comera_compile.tt import TTSpec, planner


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(120, 32)
        self.q = nn.Linear(32, 32)
        self.k = nn.Linear(32, 32)
        self.fc = nn.Linear(32, 48)
        self.out = nn.Linear(48, 5)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + torch.tanh(self.q(h)) * self.k(h)
        return self.out(F.gelu(self.fc(h)))


@pytest.mark.parametrize("fmt", ["tt", "ttm"])
def test_opaque_merges_train_like_eager(fmt):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Net()
    cc.tensorize_(eager, {"emb": cc.TTConfig(fmt="ttm", rank=4, min_size=0),
                          "_default": cc.TTConfig(fmt=fmt, rank=4, min_size=0)},
                  filter_fn=lambda mod, fqn: fqn != "out")
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="comera", fullgraph=True,
                         options={"inner": "aot_eager", "tt_merges": "opaque"})
    idx, target = torch.randint(0, 120, (3, 7)), torch.randint(0, 5, (3, 7))

    def run(model, fn):
        model.zero_grad()
        loss = F.cross_entropy(fn(idx).flatten(0, 1), target.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for _ in range(2):  # the second step reuses the compiled graph
        want_loss, want = run(eager, eager)
        got_loss, got = run(compiled_model, step)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    text = str(explain(step, idx))  # the compiled model's options are reused
    assert "tt_merges='opaque'" in text


@pytest.mark.parametrize("spec, output", [
    (TTSpec("ttm", (3, 4), (2, 3), (1, 3, 1), 11, 6, True), "dense_t"),
    (TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 11, 6, True), "factors"),
    (TTSpec("ttm", (3, 4), (2, 3), (1, 3, 1), 11, 6, False), "tables"),
], ids=["ttm-dense", "tt-factors", "ttm-tables"])
@pytest.mark.parametrize("layers", [2, 1])
def test_the_ops_pass_opcheck_and_match_group_outputs(spec, output, layers):
    """Two layers in one group, and one (whose merge of a single core would be a view of its own
    storage); values exact, gradients to float64 rounding, against group_outputs. The op takes the
    stacked storages and returns each output kind stacked, so the layers' outputs are views of one
    tensor per kind: nothing is copied per layer."""
    gen = torch.Generator().manual_seed(0)
    n_core = sum(torch.Size(s).numel() for s in spec.core_shapes)
    flats = [torch.randn(n_core, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(layers)]
    gates = [(torch.rand(sum(spec.gate_sizes), generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
             for _ in range(layers)]
    plan = planner.plan_embedding(spec, 16) if output == "tables" else planner.plan_linear(spec, 16)
    args = tt_runtime.merge_args(spec, plan, output, torch.float64)
    stacked = (torch.stack(flats), torch.stack(gates)) if layers > 1 else (flats[0][None], gates[0][None])
    torch.library.opcheck(torch.ops.comera.tt_group_merge, (*stacked, *args))
    got = tt_group_merge.group_outputs_opaque(flats, gates, spec, plan, output, torch.float64)
    want = tt_runtime.group_outputs(flats, gates, spec, plan, output, torch.float64)
    assert len(got) == len(want)
    per_kind = len(got) // layers
    for kind in range(per_kind):  # layer k's output of each kind: index k of one stacked tensor
        assert len({got[k * per_kind + kind]._base.data_ptr() for k in range(layers)}) == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    weights = [torch.randn_like(t) for t in want]
    for a, b in zip(torch.autograd.grad(got, flats + gates, weights), torch.autograd.grad(want, flats + gates, weights)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec, output", [
    (TTSpec("ttm", (3, 4), (2, 3), (1, 3, 1), 11, 6, True), "dense_t"),
    (TTSpec("ttm", (3, 4), (2, 3), (1, 3, 1), 11, 6, True), "dense"),
    (TTSpec("ttm", (3, 4, 2), (2, 3, 2), (1, 3, 2, 1), 23, 11, True), "dense"),
    (TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 11, 6, True), "factors"),
    (TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 11, 6, True), "factors_t"),
    (TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 11, 6, True), "dense"),
    (TTSpec("ttm", (3, 4), (2, 3), (1, 3, 1), 11, 6, False), "tables"),
    (TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 12, 6, False), "tables"),
    (TTSpec("btt", (2, 4), (3, 2), (1, 3, 1), 8, 6, True), "dense"),
    (TTSpec("btt", (2, 4), (3, 2), (1, 3, 1), 8, 6, True), "dense_t"),
])
@pytest.mark.parametrize("layers", [3, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merges_fake_layout_is_the_real_one(spec, output, layers, dtype):
    """What fake propagation uses instead of running the merges (group_outputs_like, and the opaque op's
    fake, both from one cached meta-device run): the same shapes, strides, dtypes and device as
    group_outputs' and the op's real outputs, per layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_core, n_gate = sum(torch.Size(s).numel() for s in spec.core_shapes), sum(spec.gate_sizes)
    flats = [torch.randn(n_core) for _ in range(layers)]
    gates = [torch.rand(n_gate) + 0.5 for _ in range(layers)]
    if spec.fmt == "btt":  # no chain: the plan is not read
        cut = planner.Cut(1, 0, 1)
    else:
        plan = planner.plan_embedding(spec, 16) if output == "tables" else planner.plan_linear(spec, 16)
        cut = getattr(plan, "cut", plan)
    want = tt_runtime.group_outputs(flats, gates, spec, cut, output, dtype)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in flats], [mode.from_tensor(t) for t in gates]
        like = tt_runtime.group_outputs_like(*fakes, spec, cut, output, dtype)
        opaque = tt_group_merge.group_outputs_opaque(*fakes, spec, cut, output, dtype)
    real_opaque = tt_group_merge.group_outputs_opaque(flats, gates, spec, cut, output, dtype)
    assert len(like) == len(want) == len(opaque) == len(real_opaque)
    for a, b in zip(like, want):
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    for a, b in zip(opaque, real_opaque):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


@pytest.mark.parametrize("merges", [None, "auto", "inductor"])
def test_auto_merges_make_tt_and_embedding_groups_opaque_and_leave_ttm_linears_to_inductor(merges):
    """The default ("auto"): the "tt" Linears' group and the TT-matrix embedding's are each one opaque
    op; the TT-matrix Linear's merges (a dense weight) stay plain ops; "inductor" keeps all of them
    plain. The compiled step matches eager either way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Net()
    cc.tensorize_(eager, {"emb": cc.TTConfig(fmt="ttm", rank=4, min_size=0),
                          "fc": cc.TTConfig(fmt="ttm", rank=4, min_size=0),
                          "_default": cc.TTConfig(fmt="tt", rank=4, min_size=0)},
                  filter_fn=lambda mod, fqn: fqn != "out")
    compiled_model = copy.deepcopy(eager)
    options = {"inner": "aot_eager"} if merges is None else {"inner": "aot_eager", "tt_merges": merges}
    step = torch.compile(compiled_model, backend="comera", fullgraph=True, options=options)
    idx, target = torch.randint(0, 120, (3, 7)), torch.randint(0, 5, (3, 7))
    for model, fn in ((eager, eager), (compiled_model, step)):
        model.zero_grad()
        F.cross_entropy(fn(idx).flatten(0, 1), target.flatten()).backward()
    for (name, a), b in zip(compiled_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    rows = [r for g in explain(step, idx).graph_reports for r in g.rewrites]
    by_module = {r.module: r for r in rows}
    assert {"emb", "q", "k", "fc"} <= set(by_module)
    opaque = merges != "inductor"
    for module in ("emb", "q", "k"):
        assert ("one opaque op" in by_module[module].detail) == opaque, module
    assert "one opaque op" not in by_module["fc"].detail


def test_a_bad_tt_merges_value_names_the_choices():
    with pytest.raises(OptionsError, match=r"option 'tt_merges' got 'fast'; valid values: \['auto', 'inductor', 'opaque'\]"):
        cc.CompileOptions(tt_merges="fast")


def test_an_output_kind_the_loss_never_reads_gets_zero_gradient():
    """Factors (F1, F2) of two layers where the loss reads only the F1s: the F2 kind's gradient comes
    as None to the op's backward, which takes it as zero; the gradients match group_outputs'."""
    spec = TTSpec("tt", (3, 4), (2, 3), (1, 2, 3, 2, 1), 11, 6, True)
    gen = torch.Generator().manual_seed(1)
    n_core = sum(torch.Size(s).numel() for s in spec.core_shapes)
    flats = [torch.randn(n_core, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2)]
    gates = [(torch.rand(sum(spec.gate_sizes), generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
             for _ in range(2)]
    plan = planner.plan_linear(spec, 16)
    got = tt_group_merge.group_outputs_opaque(flats, gates, spec, plan, "factors", torch.float64)
    want = tt_runtime.group_outputs(flats, gates, spec, plan, "factors", torch.float64)
    loss_got = sum((t * t).sum() for t in got[0::2])
    loss_want = sum((t * t).sum() for t in want[0::2])
    for a, b in zip(torch.autograd.grad(loss_got, flats + gates), torch.autograd.grad(loss_want, flats + gates)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
