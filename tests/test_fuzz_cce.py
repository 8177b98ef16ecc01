"""Differential fuzzer for the cce pass: random LM-loss programs, compiled vs eager.

A grammar builds each program as Python source: a projection (F.linear, @, matmul, mm, addmm, a
weight stored transposed; with or without a bias and its add variants), elementwise ops on the logits
(temperature, soft-capping, alpha/rounding-mode variants, casts, in-place updates, constants), shape
ops on the rows (views, reshapes, slices, selects, shifts, transposes, index tensors, vocabulary
slices) with the targets moved in step, and a loss (cross_entropy or log_softmax + nll_loss, their
keyword forms, reduction, ignore_index with ignored targets, label_smoothing). Each program runs
eagerly and through ``backend="comera"`` (inner ``aot_eager``, fp32); the loss and every gradient must
match. Leaving a program alone is fine, changing a number is not; a good share must be rewritten, and
every loss that is not rewritten must have its reason in ``explain``.

Replay: the run is derandomized (the same examples every time). ``COMERA_FUZZ_SEED=<int>`` draws
other examples, ``COMERA_FUZZ_EXAMPLES=<n>`` changes how many; a failure prints the program's source
and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import comera_compile  # noqa: F401  (registers the backend in a source checkout)
from comera_compile.report import Report, collecting
from writers import ScaleInPlace as _Dirty, opaque_scale as _opaque_scale  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

EXAMPLES = int(os.environ.get("COMERA_FUZZ_EXAMPLES", "150"))
SEED = os.environ.get("COMERA_FUZZ_SEED")
MIN_REWRITTEN = 0.3


@dataclass
class Program:
    """A generated program: its source, the sizes of its inputs and the targets to draw."""

    B: int
    T: int
    D: int
    V: int
    ignore_index: int
    lines: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        body = "\n".join(f"    {line}" for line in self.lines)
        return f"def program(h, W, Wt, b, y):\n{body}\n"

    def __repr__(self) -> str:
        return (f"Program(B={self.B}, T={self.T}, D={self.D}, V={self.V}, ignore_index={self.ignore_index})\n"
                + self.source)


@dataclass
class _State:
    lead: list[int]  # leading (row) dims of the logits; the targets have exactly this shape
    vocab: int
    contiguous: bool = True


def _projection(draw, p: Program, s: _State) -> None:
    flat = draw(st.booleans())
    p.lines.append(f"x = h.reshape(-1, {p.D})" if flat else "x = h")
    forms = ["F.linear(x, W)", "F.linear(x, W, b)", "F.linear(input=x, weight=W, bias=b)", "x @ W.T",
             "x @ W.t()", "torch.matmul(x, W.transpose(0, 1))", "x.matmul(W.mT)", "x @ Wt"]
    if flat:
        forms += ["torch.mm(x, W.t())", "torch.addmm(b, x, W.t())", "torch.addmm(b, x, W.t(), beta=0.5)"]
    form = draw(st.sampled_from(forms))
    p.lines.append(f"z = {form}")
    if "b" not in form.replace("beta", "") and draw(st.booleans()):
        p.lines.append("z = " + draw(st.sampled_from(["z + b", "b + z", "torch.add(z, b)", "z.add(b)",
                                                      "torch.add(z, b, alpha=2.0)", "z - b", "torch.sub(z, b)"])))
    if flat and draw(st.booleans()):
        p.lines.append(f"z = z.view({p.B}, {p.T}, {p.V})")
        s.lead = [p.B, p.T]
    elif flat:
        s.lead = [p.B * p.T]
        p.lines.append("y = y.reshape(-1)")


def _elementwise(draw, p: Program, s: _State) -> None:
    op = draw(st.sampled_from(["temperature", "scale", "div", "div_rounding", "softcap", "tanh", "upcast",
                               "to_float32", "double", "add_constant", "inplace", "clone"]))
    c = draw(st.sampled_from([0.7, 2, 3.0, 30.0]))
    p.lines.append({
        "temperature": f"z = z / {c}",
        "scale": draw(st.sampled_from([f"z = z * {c}", f"z = {c} * z", f"z = torch.mul(z, {c})", f"z = z.mul({c})"])),
        "div": draw(st.sampled_from([f"z = torch.div(z, {c})", f"z = z.div({c}, rounding_mode=None)"])),
        "div_rounding": f"z = torch.div(z, {c}, rounding_mode={draw(st.sampled_from(['floor', 'trunc']))!r})",
        "softcap": draw(st.sampled_from([f"z = torch.tanh(z / {c}) * {c}", f"z = {c} * (z / {c}).tanh()"])),
        "tanh": "z = torch.tanh(z)",
        "upcast": "z = z.float()",
        "to_float32": "z = z.to(torch.float32)",
        "double": "z = z.double()",
        "add_constant": "z = z + 1.5",
        "inplace": draw(st.sampled_from([f"z = z.clone()\n    z *= {c}", f"z = z.clone()\n    z.mul_({c})",
                                         f"z = z.clone()\n    torch._foreach_mul_([z], {c})"])),
        "clone": "z = z.contiguous()",
    }[op])


def _dim(draw, s: _State, minimum: int = 1) -> int | None:
    choices = [d for d, n in enumerate(s.lead) if n >= minimum]
    return draw(st.sampled_from(choices)) if choices else None


def _index(d: int, item: str) -> str:
    return "[" + ", ".join([":"] * d + [item]) + "]"


def _shape(draw, p: Program, s: _State) -> None:
    op = draw(st.sampled_from(["shift", "shift_ellipsis", "select", "select_method", "step", "narrow", "transpose",
                               "index_tensor", "unsqueeze", "flatten", "vocab_slice"]))
    d = _dim(draw, s, 2)
    if op in ("shift", "shift_ellipsis") and d is not None:
        if op == "shift_ellipsis" and d == len(s.lead) - 1:
            p.lines += ["z = z[..., :-1, :]", "y = y[..., 1:]"]
        else:
            p.lines += [f"z = z{_index(d, ':-1')}", f"y = y{_index(d, '1:')}"]
        s.lead[d] -= 1
        s.contiguous = s.contiguous and d == 0
    elif op in ("select", "select_method") and s.lead:
        d = _dim(draw, s)
        i = draw(st.integers(-s.lead[d], s.lead[d] - 1))
        line = f"z = z.select({d}, {i})" if op == "select_method" else f"z = z{_index(d, str(i))}"
        p.lines += [line, f"y = y.select({d}, {draw(st.integers(0, s.lead[d] - 1))})"]
        s.contiguous = s.contiguous and d == 0
        del s.lead[d]
    elif op == "step" and d is not None:
        p.lines += [f"z = z{_index(d, '::2')}", f"y = y{_index(d, '::2')}"]
        s.lead[d] = (s.lead[d] + 1) // 2
        s.contiguous = False
    elif op == "narrow" and d is not None:
        p.lines += [f"z = z.narrow({d}, 1, {s.lead[d] - 1})", f"y = y.narrow({d}, 0, {s.lead[d] - 1})"]
        s.lead[d] -= 1
        s.contiguous = s.contiguous and d == 0
    elif op == "transpose" and len(s.lead) >= 2:
        p.lines += ["z = z.transpose(0, 1)", "y = y.transpose(0, 1)"]
        s.lead[0], s.lead[1] = s.lead[1], s.lead[0]
        s.contiguous = False
    elif op == "index_tensor" and s.lead:
        d = _dim(draw, s)
        idx = draw(st.lists(st.integers(0, s.lead[d] - 1), min_size=1, max_size=4))
        p.lines += [f"z = z{_index(d, f'torch.tensor({idx})')}", f"y = y{_index(d, f'torch.tensor({idx})')}"]
        s.lead[d] = len(idx)
    elif op == "unsqueeze":
        p.lines += ["z = z.unsqueeze(0)", "y = y.unsqueeze(0)"]
        s.lead.insert(0, 1)
    elif op == "flatten" and len(s.lead) >= 2:
        p.lines += ["z = z.flatten(0, 1)", "y = y.flatten(0, 1)"]
        s.lead[:2] = [s.lead[0] * s.lead[1]]
    elif op == "vocab_slice" and s.vocab > 2:
        s.vocab -= 1
        p.lines += [f"z = z[..., :{s.vocab}]", f"y = torch.where(y >= {s.vocab}, 0, y)"]
        s.contiguous = False


def _to_rows(draw, p: Program, s: _State) -> None:
    """Make the logits [N, V] (or leave [V]: an unbatched loss, which eager accepts)."""
    if len(s.lead) == 1 and draw(st.booleans()):
        return
    if not s.lead:
        if draw(st.booleans()):
            return
        p.lines += ["z = z.unsqueeze(0)", "y = y.unsqueeze(0)"]
        return
    forms = [f"z = z.reshape(-1, {s.vocab})", f"z = z.flatten(0, {len(s.lead) - 1})"]
    if s.contiguous:
        forms.append(f"z = z.view(-1, {s.vocab})")
    p.lines += [draw(st.sampled_from(forms)), "y = y.reshape(-1)"]


def _loss(draw, p: Program) -> None:
    kind = draw(st.sampled_from(["cross_entropy", "cross_entropy_kw", "module", "nll", "nll_method"]))
    kw = {}
    reduction = draw(st.sampled_from([None, "mean", "sum", "none"]))
    if reduction:
        kw["reduction"] = repr(reduction)
    if p.ignore_index != -100 or draw(st.booleans()):
        kw["ignore_index"] = str(p.ignore_index)
    if kind.startswith("cross") and draw(st.booleans()):
        kw["label_smoothing"] = "0.1"
    args = "".join(f", {k}={v}" for k, v in kw.items())
    p.lines.append("return " + {
        "cross_entropy": f"F.cross_entropy(z, y{args})",
        "cross_entropy_kw": f"F.cross_entropy(input=z, target=y{args})",
        "module": f"torch.nn.CrossEntropyLoss({args[2:]})(z, y)",
        "nll": f"F.nll_loss(F.log_softmax(z, dim=-1), y{args})",
        "nll_method": f"F.nll_loss(z.log_softmax(-1, dtype=torch.float32), target=y{args})",
    }[kind])


@st.composite
def programs(draw) -> Program:
    T = draw(st.integers(1, 6))
    D = draw(st.one_of(st.just(T), st.integers(2, 9)))  # T == D: a wrong row mapping can still fit the shapes
    p = Program(B=draw(st.integers(1, 3)), T=T, D=max(D, 2), V=draw(st.integers(3, 13)),
                ignore_index=draw(st.sampled_from([-100, 2])))
    s = _State(lead=[p.B, p.T], vocab=p.V)
    _projection(draw, p, s)
    for op in draw(st.lists(st.sampled_from(["elementwise", "shape"]), max_size=5)):
        (_elementwise if op == "elementwise" else _shape)(draw, p, s)
    _to_rows(draw, p, s)
    _loss(draw, p)
    return p


def _inputs(p: Program, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(p.B, p.T, p.D, generator=g)
    W = torch.randn(p.V, p.D, generator=g) / p.D ** 0.5
    y = torch.randint(0, p.V, (p.B, p.T), generator=g)
    y[torch.rand(p.B, p.T, generator=g) < 0.2] = p.ignore_index
    return [h, W, W.t().contiguous(), torch.randn(p.V, generator=g)], y


def _run(fn, leaves, y, compiled: bool, backward: bool = True, requires_grad: bool | set[str] | None = None):
    """The loss (and with ``backward`` the gradients) of ``fn`` on copies of ``leaves`` (h, W, Wt, b),
    those that ``requires_grad`` names (all or none for a bool; default: ``backward``) needing one."""
    needs = backward if requires_grad is None else requires_grad
    leaves = [t.clone().requires_grad_(needs if isinstance(needs, bool) else name in needs)
              for name, t in zip(("h", "W", "Wt", "b"), leaves)]
    report = None
    if compiled:
        torch._dynamo.reset()
        report = Report()
        with collecting(report):  # what explain reports, for the plain torch.compile call
            loss = torch.compile(fn, backend="comera", options={"inner": "aot_eager", "cce_min_vocab": 0})(*leaves, y)
    else:
        loss = fn(*leaves, y)
    if not backward:
        return loss.detach(), [], report
    loss.sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return loss.detach(), grads, report


def check_program(p: Program) -> bool:
    """Compiled == eager for ``p``; returns whether the cce pass rewrote it."""
    namespace = dict(_NAMESPACE)
    exec(compile(p.source, "<fuzz program>", "exec"), namespace)
    fn = namespace["program"]
    leaves, y = _inputs(p, seed=len(p.source))
    ref, ref_grads, _ = _run(fn, leaves, y, compiled=False)
    out, grads, report = _run(fn, leaves, y, compiled=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    for name, got, want in zip(("h", "W", "Wt", "b"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, equal_nan=True, msg=lambda m: f"grad {name}: {m}")
    rewritten = any(r.kind == "cce" for r in report.rewrites)
    reasons = [s.reason for s in report.skipped if s.kind == "cce"]
    assert rewritten or any(reasons), str(report)
    # The row ops re-applied to h always line up with the logits: anything else is a matching bug.
    assert not any("do not line up" in r or "does not trace" in r for r in reasons), reasons
    return rewritten


def _settings():
    kwargs = dict(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                  suppress_health_check=list(hypothesis.HealthCheck))
    return hypothesis.settings(derandomize=SEED is None, **kwargs)


@pytest.mark.fuzz
def test_fuzz_cce_matches_eager():
    print(f"cce fuzzer: {EXAMPLES} examples, " + (f"COMERA_FUZZ_SEED={SEED}" if SEED else "derandomized"))
    outcomes: list[bool] = []

    @_settings()
    @hypothesis.given(programs())
    def run(program):
        hypothesis.note(program.source)
        outcomes.append(check_program(program))

    if SEED is not None:
        run = hypothesis.seed(int(SEED))(run)
    run()
    share = sum(outcomes) / max(len(outcomes), 1)
    print(f"cce fuzzer: {len(outcomes)} programs, {share:.0%} rewritten")
    assert len(outcomes) >= min(EXAMPLES, 50) and share >= MIN_REWRITTEN, (len(outcomes), share)


# --- the edges: in-place writes around the head, 16-bit casts with scales and biases, confident rows ---

EDGE_EXAMPLES = int(os.environ.get("COMERA_FUZZ_EDGE_EXAMPLES", "100"))
_WRITES = ["{t} += 1", "{t}.mul_(0.5)", "{t}[0] = 0", "torch.relu_({t})", "F.relu({t}, inplace=True)",
           "{t}.view(-1)[:1] = 2.0", "torch.nn.ReLU(inplace=True)({t})", "torch.mul({t}, 2.0, out={t})",
           "torch._foreach_mul_([{t}], 0.5)", "torch._foreach_add_([{t}, W], 1.0)", "_Dirty.apply({t})",
           "_opaque_scale({t})"]


_NAMESPACE = {"torch": torch, "F": F, "_Dirty": _Dirty, "_opaque_scale": _opaque_scale}


@dataclass
class EdgeProgram(Program):
    """A program of one edge class: ``kind`` is "write", "dtype" or "confident"."""

    kind: str = "dtype"
    dtype: str = "float32"
    h_scale: float = 1.0
    where: str = ""  # for "write": before the projection, between it and the loss, or after the loss
    read: bool = False  # for "write": the write's target is read by the projection (h, W, or its bias b)
    target: str = ""  # for "write": what it writes (h, W, b or a view of h)

    def __repr__(self) -> str:
        return f"EdgeProgram(kind={self.kind}, dtype={self.dtype}, h_scale={self.h_scale}) " + super().__repr__()


def _reduction(draw) -> str:
    return draw(st.sampled_from(["", ", reduction='sum'", ", reduction='none'"]))


@st.composite
def edge_programs(draw, write: str | None = None) -> EdgeProgram:
    """An edge program of a random class; with ``write`` (one of ``_WRITES``), always a write of that form."""
    kind = "write" if write else draw(st.sampled_from(["write", "dtype", "confident"]))
    p = EdgeProgram(B=draw(st.integers(1, 3)), T=draw(st.integers(1, 5)), D=draw(st.integers(2, 9)),
                    V=draw(st.integers(3, 13)) if kind != "confident" else 40, ignore_index=-100, kind=kind)
    loss = f"F.cross_entropy(z.reshape(-1, {p.V}), y.reshape(-1){_reduction(draw)})"
    if kind == "write":
        p.where = draw(st.sampled_from(["before", "between", "between", "after"]))
        targets = ["h", "W", "b", "h.view(-1)"]
        if write is not None and write.startswith(("{t} +=", "_Dirty")):
            targets.remove("h.view(-1)")
        if write is not None and "{t}, W" in write:
            targets.remove("W")
        target = draw(st.sampled_from(targets))
        writes = [w for w in _WRITES if "." not in target or not w.startswith(("{t} +=", "_Dirty"))]  # not on a view
        if target == "W":
            writes = [w for w in writes if "{t}, W" not in w]  # one tensor twice in one _foreach
        write = (write or draw(st.sampled_from(writes))).format(t=target)
        proj = draw(st.sampled_from(["F.linear(h, W, b)", "h @ W.t() + b", "F.linear(h, W) + b", "torch.matmul(h, W.T)"]))
        p.read, p.target = target != "b" or "b" in proj or "W]" in write, target
        p.lines += ["h, W, b = h * 1.0, W * 1.0, b * 1.0", *([write] if p.where == "before" else []), f"z = {proj}",
                    *([write] if p.where == "between" else []), f"loss = {loss}",
                    *([write] if p.where == "after" else []), "return loss"]
    elif kind == "dtype":
        p.dtype = draw(st.sampled_from(["float16", "bfloat16", "float32"]))
        p.h_scale = draw(st.sampled_from([1.0, 1e2, 1e3]))
        lines = [draw(st.sampled_from(["z = F.linear(h, W)", "z = F.linear(h, W, b.to(h.dtype))", "z = h @ W.t()"]))]
        upcast = draw(st.booleans())
        if upcast:
            lines.append(draw(st.sampled_from(["z = z.float()", "z = z.to(torch.float32)"])))
        for _ in range(draw(st.integers(0, 2))):
            c = draw(st.sampled_from([0.015625, 0.5, 0.7, 2.0, 64.0]))
            lines.append(draw(st.sampled_from([f"z = z * {c}", f"z = z / {c}", f"z = {c} * z"])))
        if upcast and draw(st.booleans()):
            lines.insert(2, "z = z + b")  # the fp32 bias, added after the upcast
        p.lines += lines + [f"return {loss}"]
    else:
        p.lines += ["z = F.linear(h, W)", f"return F.cross_entropy(z.reshape(-1, {p.V}), y.reshape(-1), reduction='none')"]
    return p


def _edge_inputs(p: EdgeProgram, seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(p.B, p.T, p.D, generator=g) * p.h_scale
    W = torch.randn(p.V, p.D, generator=g) / p.D ** 0.5
    y = torch.randint(0, p.V, (p.B, p.T), generator=g)
    if p.kind == "confident":  # the target logit ~ 3 |h|^2 far above the others: eager's loss is 0
        W = W * 0.1
        W[y.reshape(-1)] = 3.0 * h.reshape(-1, p.D)
        y = y.clone()
    b = torch.randn(p.V, generator=g) * 20
    dt = getattr(torch, p.dtype)
    return [h.to(dt), W.to(dt), W.t().contiguous().to(dt), b], y


def _roundoff(t: torch.Tensor) -> float:
    """The unit roundoff of ``t``'s dtype: the relative error that rounding a result into it may add. Eager's
    result can land closer than that to the exact value by the luck of its roundings (seen: a bf16 loss of
    520 where the exact value is 520.81, 0.16 % off, and the fused path's 524, the next bf16 number); an error
    below it counts as it, so that a result as close as its dtype can hold always passes."""
    return torch.finfo(t.dtype).eps / 2


def _err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_edge_program(p: EdgeProgram) -> bool:
    """Compiled against eager for one edge program; returns whether the cce pass rewrote it.
    * write: the values (no backward: eager refuses one through a value that was written after use);
      a write between the projection and the loss is never fused over;
    * dtype: against the same program run on the inputs' exact fp32 values (its casts rounding as in its
      dtype), compiled is within 3x eager's error or 3x the result dtype's unit roundoff, whichever is
      larger, and finite wherever eager is;
    * confident: through the Triton kernels, no per-token loss below 0, and equal to eager."""
    namespace = dict(_NAMESPACE)
    exec(compile(p.source, "<fuzz program>", "exec"), namespace)
    fn = namespace["program"]
    leaves, y = _edge_inputs(p, seed=len(p.source))
    grads = p.kind != "write"
    # _Dirty is traced only where its input needs a gradient: values under grad mode, only that input
    # needing one (else the projection saves it, and any backward, AOTAutograd's traced one too, refuses)
    dirty = {p.target[0]} if "_Dirty" in p.source else set()
    saved = os.environ.get("COMERA_FORCE_TRITON")
    if p.kind == "confident":
        os.environ["COMERA_FORCE_TRITON"] = "1"
    try:
        with torch.enable_grad() if grads or dirty else torch.no_grad():
            ref, ref_grads, _ = _run(fn, leaves, y, compiled=False, backward=grads, requires_grad=grads or dirty)
            out, got_grads, report = _run(fn, leaves, y, compiled=True, backward=grads,
                                          requires_grad=grads or dirty)
    finally:
        if saved is None:
            os.environ.pop("COMERA_FORCE_TRITON", None)
        else:
            os.environ["COMERA_FORCE_TRITON"] = saved
    rewritten = any(r.kind == "cce" for r in report.rewrites)
    reasons = [s.reason for s in report.skipped if s.kind == "cce"]
    assert rewritten or any(reasons), str(report)
    if p.kind == "write":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
        if p.where == "between" and p.read and "h * 1.0" in p.source:
            assert not rewritten and any("writes in place" in r or "may write into" in r for r in reasons), str(report)
    elif p.kind == "confident":
        assert (out >= 0).all(), out.min()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:
        # The exact values of the program as written: run in fp32 on the inputs' exact values, with the casts
        # that the program applies to an fp32 input (its bias, ``b.to(h.dtype)``) rounding as they do in the
        # program's own dtype (in fp32, h.dtype is fp32 and the cast would keep the bias unrounded).
        exact_source = p.source.replace("b.to(h.dtype)", f"b.to(torch.{p.dtype}).to(h.dtype)")
        exact_namespace = dict(_NAMESPACE)
        exec(compile(exact_source, "<fuzz program, exact>", "exec"), exact_namespace)
        exact, exact_grads, _ = _run(exact_namespace["program"], [t.float() for t in leaves], y, compiled=False,
                                     backward=True)
        if torch.isfinite(ref).all():
            assert torch.isfinite(out).all(), (out, ref)
            assert _err(out, exact) <= 3 * max(_err(ref, exact), _roundoff(ref)) + 1e-6, (_err(out, exact),
                                                                                          _err(ref, exact))
        for name, a, e, x in zip(("h", "W", "Wt", "b"), got_grads, ref_grads, exact_grads):
            if torch.isfinite(e).all() and e.abs().sum() > 0:
                assert torch.isfinite(a).all(), name
                assert _err(a, x) <= 3 * max(_err(e, x), _roundoff(e)) + 2.0**-10, (name, _err(a, x), _err(e, x))
    return rewritten


@pytest.mark.fuzz
def test_fuzz_cce_edges_match_eager():
    print(f"cce edge fuzzer: {EDGE_EXAMPLES} examples, " + (f"COMERA_FUZZ_SEED={SEED}" if SEED else "derandomized"))
    outcomes: list[bool] = []
    kinds: set[str] = set()

    @hypothesis.settings(_settings(), max_examples=EDGE_EXAMPLES)
    @hypothesis.given(edge_programs())
    def run(program):
        hypothesis.note(repr(program))
        kinds.add(program.kind)
        outcomes.append(check_edge_program(program))

    if SEED is not None:
        run = hypothesis.seed(int(SEED))(run)
    run()
    print(f"cce edge fuzzer: {len(outcomes)} programs, {sum(outcomes) / max(len(outcomes), 1):.0%} rewritten")
    assert kinds == {"write", "dtype", "confident"} and any(outcomes), (kinds, outcomes)


WRITE_EXAMPLES = int(os.environ.get("COMERA_FUZZ_WRITE_EXAMPLES", "4"))


@pytest.mark.fuzz
@pytest.mark.parametrize("write", _WRITES)
def test_fuzz_cce_every_write_form_matches_eager(write):
    """Each form of write (``_foreach`` ops, an ``autograd.Function`` marking its input dirty, a function
    whose writes are unknown, ...) on a random target, before, between or after the head and its loss;
    ``COMERA_FUZZ_WRITE_EXAMPLES=<n>`` sets the number per form."""

    @hypothesis.settings(_settings(), max_examples=WRITE_EXAMPLES, derandomize=False)
    @hypothesis.given(edge_programs(write=write))
    def run(program):
        hypothesis.note(repr(program))
        check_edge_program(program)

    run = hypothesis.seed(_WRITES.index(write) if SEED is None else int(SEED))(run)  # other draws per form
    run()
