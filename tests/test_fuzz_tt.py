"""Differential fuzzer for tensorized models, through the public API only.

Random models (an Embedding with random sizes and index patterns, then one or two Linear layers with
random, often prime, sizes, with or without bias; often then a group of two or three Linears of one
structure reading one input, as Q, K and V do, whose members may be frozen or have their output left
unused, with a write between the first member and the others: into the shared input by
``torch._foreach_mul_``, by an ``autograd.Function`` that marks it dirty or by ``mul_``, or into the
second member's bias) are tensorized with random formats, ranks, core counts and padding
(``cc.tensorize_``), compiled with ``backend="comera"`` and compared with:

* the same model densified (``cc.densify_``), run eagerly: the output and the input/bias gradients;
* the same tensorized model run eagerly (the weights materialized): the gradients of every core and gate
  (a parameter eager leaves without a gradient must have none).

Each example also draws the backend's ``tt_strategy`` (``"auto"`` or a pinned token-sized path), so
every executor (dense weight, factored, TT-matrix contraction, btt blocks, embedding tables) meets
random shapes, not only those the cost model picks it for.

Run it alone with ``pytest -m fuzz tests/test_fuzz_tt.py``; ``COMERA_FUZZ_TT_EXAMPLES=<n>`` sets the
number of examples (``COMERA_FUZZ_TT_GROUP_EXAMPLES=<n>``: of those that always have a group, per write)
and ``COMERA_FUZZ_SEED=<int>`` draws other ones (the default run is derandomized).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import comera_compile as cc
from writers import ScaleInPlace as _Dirty  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = int(os.environ.get("COMERA_FUZZ_TT_EXAMPLES", "20"))
GROUP_EXAMPLES = int(os.environ.get("COMERA_FUZZ_TT_GROUP_EXAMPLES", "3"))  # per write
SEED = os.environ.get("COMERA_FUZZ_SEED")
SIZES = [2, 3, 5, 7, 12, 16, 31, 37, 64, 97]


@dataclass
class Case:
    vocab: int
    dims: list[int]  # embedding dim, then each Linear's out_features
    bias: list[bool]
    configs: list[tuple]  # (rank, fmt, n_cores, max_pad) per layer
    index_shape: tuple[int, ...]
    index_pattern: str
    seed: int
    tt_strategy: str = "auto"  # the backend's tt_strategy option: every token-sized path, pinned where it applies
    shared: list[tuple[bool, bool]] = field(default_factory=list)  # (frozen, dead) per member of the group
    write: str = "none"  # between the group's first member and the others (WRITES)

    def config(self, i: int) -> cc.TTConfig:
        rank, fmt, n_cores, max_pad = self.configs[min(i, len(self.configs) - 1)]  # the group: one config
        return cc.TTConfig(rank=rank, fmt=fmt, n_cores=n_cores, max_pad=max_pad, min_size=0)


# What the group's forward does between its first member and the others: write into the shared input
# h (the first member is then frozen: eager's backward needs no value the write changes) or into the
# second member's bias (a copy of it that the member reads).
WRITES = ["none", "foreach", "dirty", "mul_", "bias_add_", "bias_foreach"]


# The group's paths: btt layers share one blocks call or one merge of their dense weights, "tt" layers
# one first-factor GEMM or one merge, TT-matrices one merge or none (contracted).
GROUP_STRATEGIES = {"btt": ["blocks", "auto", "dense"], "tt": ["factored", "auto", "dense"],
                    "ttm": ["auto", "dense", "contract"]}


def _write(kind: str, h: torch.Tensor, bias: torch.Tensor) -> None:
    if kind == "foreach":
        torch._foreach_mul_([h], 2.0)
    elif kind == "dirty":
        _Dirty.apply(h)
    elif kind == "mul_":
        h.mul_(2.0)
    elif kind == "bias_add_":
        bias.add_(1.0)
    elif kind == "bias_foreach":
        torch._foreach_add_([bias], 1.0)


class Model(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.emb = nn.Embedding(case.vocab, case.dims[0])
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias)
                                    for a, b, bias in zip(case.dims, case.dims[1:], case.bias))
        d = case.dims[-1]
        self.shared = nn.ModuleList(nn.Linear(d, d) for _ in case.shared)

    def forward(self, idx, x0):
        x = self.emb(idx) + x0
        for i, layer in enumerate(self.layers):
            x = layer(x if i == 0 else torch.tanh(x))
        if not self.shared:
            return x
        h = x * 1.0
        biases = [m.bias * 1.0 for m in self.shared]
        outs = []
        for i, m in enumerate(self.shared):
            if i == 1:
                _write(self.case.write, h, biases[1])
            outs.append(F.linear(h, m.weight, biases[i]))
        return x + sum(o for o, (_, dead) in zip(outs, self.case.shared) if not dead)


@st.composite
def cases(draw, group: bool = False, write: str | None = None) -> Case:
    """A case; with ``group``, always one with a group of Linears reading one input (with ``write``
    between its members, when given)."""
    n_linear = draw(st.integers(1, 2))
    dims = [draw(st.sampled_from(SIZES)) for _ in range(n_linear + 1)]
    configs = []
    for _ in range(n_linear + 1):
        fmt = draw(st.sampled_from(["tt", "ttm", "auto", "btt"]))
        n_cores = draw(st.sampled_from([None, 2] if fmt == "btt" else [None, 2, 3]))  # btt: always two cores
        configs.append((draw(st.integers(1, 8)), fmt, n_cores, draw(st.sampled_from([0.0, 0.1, 0.5]))))
    shape = draw(st.sampled_from([(5,), (2, 3), (1, 1), (3, 1, 4)]))
    members = draw(st.sampled_from([2, 3] if group else [0, 2, 3]))
    shared = [(draw(st.booleans()), draw(st.booleans())) for _ in range(members)]
    write = (write or draw(st.sampled_from(WRITES))) if shared else "none"
    if write in ("foreach", "dirty", "mul_"):
        shared[0] = (True, shared[0][1])
    strategies = ["auto", "dense", "factored", "contract", "blocks", "tables"]
    if shared:
        dims[-1] = draw(st.sampled_from([12, 16, 31, 48]))  # the group's width: sizes that compress
        fmt = draw(st.sampled_from(["tt", "ttm", "btt"]))
        configs.append((draw(st.integers(1, 4)), fmt, 2 if fmt == "btt" else None, 0.1))
        strategies = GROUP_STRATEGIES[fmt]
    return Case(vocab=draw(st.sampled_from(SIZES[2:])), dims=dims, bias=[draw(st.booleans()) for _ in range(n_linear)],
                configs=configs, index_shape=shape, index_pattern=draw(st.sampled_from(["random", "repeated", "edges"])),
                seed=draw(st.integers(0, 2 ** 16)),
                tt_strategy=draw(st.sampled_from(strategies)), shared=shared, write=write)


def _indices(case: Case, g: torch.Generator) -> torch.Tensor:
    n = 1
    for s in case.index_shape:
        n *= s
    if case.index_pattern == "repeated":
        flat = torch.full((n,), int(torch.randint(0, case.vocab, (1,), generator=g)))
    elif case.index_pattern == "edges":
        flat = torch.tensor([0, case.vocab - 1] * n)[:n]
    else:
        flat = torch.randint(0, case.vocab, (n,), generator=g)
    return flat.reshape(case.index_shape)


def _loss_and_grads(model, idx, x0, probe, names, params_of=None):
    x0 = x0.clone().requires_grad_()
    out = model(idx, x0)
    (out * probe).sum().backward()
    params = dict((params_of or model).named_parameters())
    grads = {n: params[n].grad for n in names}
    return out.detach(), x0.grad, grads


def _close(got, want, what: str) -> None:
    """Equal gradients; a parameter eager gives none (frozen, or its output unused) gets none."""
    assert (got is None) == (want is None), f"{what}: {'no gradient' if got is None else 'a gradient'} where eager " \
                                            f"gives {'none' if want is None else 'one'}"
    if want is not None:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def check_case(case: Case) -> None:
    torch.manual_seed(case.seed)
    g = torch.Generator().manual_seed(case.seed)
    model = Model(case)
    names = ["emb"] + [f"layers.{i}" for i in range(len(case.dims) - 1)]
    names += [f"shared.{j}" for j in range(len(case.shared))]
    cc.tensorize_(model, {name: case.config(i) for i, name in enumerate(names)})
    for member, (frozen, _) in zip(model.shared, case.shared):
        member.requires_grad_(not frozen)
    eager_tt = copy.deepcopy(model)
    idx = _indices(case, g)
    x0 = torch.randn(*case.index_shape, case.dims[0], generator=g)
    probe = torch.randn(*case.index_shape, case.dims[-1], generator=g)
    tt_names = [n for n, _ in model.named_parameters() if n.endswith((".core_flat", ".gate_flat"))]
    assert len(tt_names) == 2 * len(list(cc.iter_tt_layers(model)))  # every layer's cores and gates
    bias_names = [n for n, _ in model.named_parameters() if n.endswith("bias")]

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="comera", options={"inner": "aot_eager", "tt_strategy": case.tt_strategy})
    out, dx, grads = _loss_and_grads(compiled, idx, x0, probe, tt_names + bias_names, params_of=model)
    _, _, ref_tt = _loss_and_grads(eager_tt, idx, x0, probe, tt_names)
    # densify_ last: it edits the class that a deep copy of a parametrized module shares
    ref_out, ref_dx, ref_bias = _loss_and_grads(cc.densify_(model), idx, x0, probe, bias_names)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5, msg=lambda m: f"output vs densified: {m}")
    torch.testing.assert_close(dx, ref_dx, rtol=1e-4, atol=1e-5, msg=lambda m: f"input grad vs densified: {m}")
    for name, want in {**ref_bias, **ref_tt}.items():
        _close(grads[name], want, f"grad {name}")


@pytest.mark.fuzz
def test_fuzz_tensorized_models_match_densified():
    print(f"tt fuzzer: {EXAMPLES} examples, " + (f"COMERA_FUZZ_SEED={SEED}" if SEED else "derandomized"))

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True, derandomize=SEED is None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(cases())
    def run(case):
        check_case(case)

    if SEED is not None:
        run = hypothesis.seed(int(SEED))(run)
    run()


@pytest.mark.fuzz
@pytest.mark.parametrize("write", WRITES)
def test_fuzz_groups_reading_one_input_match_eager(write):
    """Only cases with a group of Linears reading one input (frozen and unused members), each write
    between them; ``COMERA_FUZZ_TT_GROUP_EXAMPLES=<n>`` sets the number per write."""
    print(f"tt group fuzzer, write {write}: {GROUP_EXAMPLES} examples, "
          + (f"COMERA_FUZZ_SEED={SEED}" if SEED else f"seed {WRITES.index(write)}"))

    @hypothesis.settings(max_examples=GROUP_EXAMPLES, deadline=None, database=None, print_blob=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(cases(group=True, write=write))
    def run(case):
        check_case(case)

    run = hypothesis.seed(WRITES.index(write) if SEED is None else int(SEED))(run)  # other draws per write
    run()
