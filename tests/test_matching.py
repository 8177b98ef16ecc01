"""comera_compile.matching: target sets cover every form Dynamo records, the binder reads arguments by
name whether they were passed positionally or by keyword, and names what a pass does not understand."""

import inspect
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import comera_compile as cc
from comera_compile import matching as M
from writers import ScaleInPlace as _Dirty  # noqa: E402


def _dynamo_nodes(fn, *args):
    """The call nodes of the graph Dynamo captures for ``fn``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=capture)(*args)
    (gm,) = graphs
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_target_sets_match_every_form_dynamo_records():
    a, b, w = torch.randn(3, 4), torch.randn(4), torch.randn(5, 4)
    y = torch.tensor([0, 1, 4])

    def fn(a, b, w, y):
        s = (a + b) + torch.add(a, b) + a.add(b)
        m = (a @ w.T) + torch.matmul(a, w.t()) + a.matmul(w.T) + torch.mm(a, w.t()) + a.mm(w.t()) + F.linear(a, w)
        q = (a * 2) + torch.mul(a, 2) + a.mul(2) + a / 3 + torch.div(a, 3) + a.div(3) + torch.tanh(a) + a.tanh()
        return s.sum() + F.cross_entropy(m, y) + F.nll_loss(F.log_softmax(m, -1), y) + q.view(-1).sum()

    nodes = _dynamo_nodes(fn, a, b, w, y)
    count = {name: sum(M.is_call(n, getattr(M, name)) for n in nodes)
             for name in ("ADD", "MATMUL", "LINEAR", "MUL", "DIV", "TANH", "CROSS_ENTROPY", "NLL_LOSS",
                          "LOG_SOFTMAX", "RESHAPE")}
    # 3 bias adds + 5 adds of matmul results + 7 adds of q terms + 3 adds of the losses/sums
    assert count["MATMUL"] == 5 and count["LINEAR"] == 1
    assert count["MUL"] == 3 and count["DIV"] == 3 and count["TANH"] == 2
    assert count["CROSS_ENTROPY"] == 1 and count["NLL_LOSS"] == 1 and count["LOG_SOFTMAX"] == 1
    assert count["RESHAPE"] == 1 and count["ADD"] >= 3
    assert all(not M.is_inplace(n) for n in nodes)


def _graph_with(target, args, kwargs, op="call_function"):
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    mapping = {"x": x, "y": y}
    args = tuple(mapping.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: mapping.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    return g.create_node(op, target, args, kwargs), x, y


def test_bind_reads_keywords_and_fills_defaults():
    positional, x, y = _graph_with(F.cross_entropy, ("x", "y"), {})
    keywords, kx, ky = _graph_with(F.cross_entropy, (), {"input": "x", "target": "y", "reduction": "sum"})
    p, k = M.bind(positional), M.bind(keywords)
    assert p["input"] is x and p["target"] is y and p["reduction"] == "mean" and p["ignore_index"] == -100
    assert k["input"] is kx and k["target"] is ky and k["reduction"] == "sum" and k["label_smoothing"] == 0.0
    assert list(p) == list(inspect.signature(F.cross_entropy).parameters)


@pytest.mark.parametrize("target,args,kwargs,op,problem", [
    (torch.add, ("x", "y"), {"alpha": 2.0}, "call_function", "alpha=2.0"),
    ("add", ("x", "y"), {"alpha": 2}, "call_method", "alpha=2"),
    (torch.div, ("x", 3.0), {"rounding_mode": "floor"}, "call_function", "rounding_mode='floor'"),
    ("div", ("x", 3.0), {"rounding_mode": "trunc"}, "call_method", "rounding_mode='trunc'"),
    (torch.add, ("x", "y"), {"out": "x"}, "call_function", "out=<traced x>"),
    ("add_", ("x", "y"), {}, "call_method", "in-place add_"),
    (operator.iadd, ("x", "y"), {}, "call_function", "in-place iadd"),
    (torch.addmm, ("x", "y", "y"), {"beta": 0.5}, "call_function", "beta=0.5"),
])
def test_blocking_names_the_argument_not_understood(target, args, kwargs, op, problem):
    node, *_ = _graph_with(target, args, kwargs, op)
    call = M.bind(node)
    assert call is not None
    assert call.blocking("input", "other", "mat1", "mat2") == problem


def test_default_arguments_are_understood():
    for target, args, kwargs in [(torch.add, ("x", "y"), {"alpha": 1}), (torch.div, ("x", 2.0), {"rounding_mode": None}),
                                 (operator.add, ("x", "y"), {}), (torch.addmm, ("x", "y", "y"), {"alpha": 1.0})]:
        node, *_ = _graph_with(target, args, kwargs)
        assert M.bind(node).blocking("input", "other", "mat1", "mat2") is None, target


def test_var_positional_sizes_and_unknown_keywords():
    for args, kwargs in [(("x", 2, 3), {}), (("x", (2, 3)), {}), (("x",), {"size": (2, 3)})]:
        node, *_ = _graph_with("view", args, kwargs, "call_method")
        assert M.bind(node)["size"] == (2, 3)
    unknown, *_ = _graph_with(torch.add, ("x", "y"), {"beta": 2})
    assert M.bind(unknown) is None
    nothing_known, *_ = _graph_with(torch.cumsum, ("x", 0), {})
    assert M.bind(nothing_known) is None


def test_method_descriptor_called_as_a_function():
    node, x, y = _graph_with(torch.Tensor.add, ("x", "y"), {"alpha": 3})
    assert M.is_call(node, M.ADD)
    assert M.bind(node)["other"] is y and M.bind(node).blocking("input", "other") == "alpha=3"


# Each stub's parameter names are torch's own: calling torch with every argument by those names
# gives what the positional call gives.
_SAMPLES = {
    torch.add: ((torch.randn(3), torch.randn(3)), {"alpha": 2}),
    torch.sub: ((torch.randn(3), torch.randn(3)), {"alpha": 2}),
    torch.mul: ((torch.randn(3), torch.randn(3)), {}),
    torch.true_divide: ((torch.randn(3), torch.randn(3)), {}),
    torch.div: ((torch.randn(3), torch.randn(3)), {"rounding_mode": "floor"}),
    torch.matmul: ((torch.randn(2, 3), torch.randn(3, 4)), {}),
    torch.mm: ((torch.randn(2, 3), torch.randn(3, 4)), {}),
    torch.addmm: ((torch.randn(4), torch.randn(2, 3), torch.randn(3, 4)), {"beta": 2, "alpha": 3}),
    torch._C._nn.linear: ((torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)), {}),
    torch.embedding: ((torch.randn(5, 3), torch.tensor([1, 4])), {}),
    torch.tanh: ((torch.randn(3),), {}),
    torch.log_softmax: ((torch.randn(2, 3), 1), {}),
    torch.reshape: ((torch.randn(2, 3), (3, 2)), {}),
    torch.flatten: ((torch.randn(2, 3, 4), 1, 2), {}),
    torch.unflatten: ((torch.randn(6, 2), 0, (2, 3)), {}),
    torch.transpose: ((torch.randn(2, 3), 0, 1), {}),
    torch.swapaxes: ((torch.randn(2, 3), 0, 1), {}),
    torch.permute: ((torch.randn(2, 3), (1, 0)), {}),
    torch.select: ((torch.randn(2, 3), 1, 2), {}),
    torch.narrow: ((torch.randn(2, 3), 1, 1, 2), {}),
    torch.squeeze: ((torch.randn(2, 1), 1), {}),
    torch.unsqueeze: ((torch.randn(2, 3), 1), {}),
}


@pytest.mark.parametrize("fn", list(_SAMPLES), ids=lambda f: getattr(f, "__name__", str(f)))
def test_signature_names_are_torchs(fn):
    args, kwargs = _SAMPLES[fn]
    g = fx.Graph()
    node = g.create_node("call_function", fn, args, kwargs)
    call = M.bind(node)
    assert call is not None
    by_name = {k: v for k, v in call.items() if k not in ("out", "out_dtype")}
    torch.testing.assert_close(fn(**by_name), fn(*args, **kwargs))


def test_same_size_is_structural_for_ints():
    assert M.same_size(3, 3) and not M.same_size(3, 4)


def test_readme_matching_example():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Writing a pass"):]
    code = next(c for c in re.findall(r"```python\n(.*?)```", section, re.S) if "matching as M" in c)
    namespace: dict = {}
    try:  # "<README.md>": Dynamo would read the example's traced function from the markdown file
        exec(compile(code, "<README.md>", "exec"), namespace)
    finally:
        if "plain-adds" in cc.list_passes():  # the example registers its pass (tests/test_readme.py runs it)
            cc.unregister_pass("plain-adds")

    skipped = []

    class Ctx:
        def skip(self, kind, reason, module=None):
            skipped.append(reason)

    # Every form of add is matched (torch.add, operator.add, Tensor.add); only the one with alpha= is refused.
    gm = fx.symbolic_trace(lambda a, b: torch.add(a, b) + a.add(b, alpha=2))
    assert [n.target for n in gm.graph.nodes if M.is_call(n, M.ADD)] == [torch.add, "add", operator.add]
    assert namespace["plain_adds"](gm, Ctx()) == 0
    assert len(skipped) == 1 and "alpha=2" in skipped[0]


# --- writes: every op that writes an input is seen, whatever its name; an op whose writes are unknown
# counts as writing every input it takes ---------------------------------------------------------------

def _node(nodes, name):
    return next(n for n in nodes if M.call_name(n) == name)


def test_foreach_writes_are_writes():
    a, b = torch.randn(3), torch.randn(3)

    def fn(a, b):
        a, b = a * 1.0, b * 1.0
        torch._foreach_mul_([a], 0.5)
        torch._foreach_add_([a, b], 1.0)
        torch._foreach_zero_([b])
        return a + b

    nodes = _dynamo_nodes(fn, a, b)
    a1, b1 = [n for n in nodes if M.call_name(n) == "mul"]
    assert M.is_inplace(_node(nodes, "_foreach_mul_"))
    assert M.written_inputs(_node(nodes, "_foreach_mul_")) == [a1]
    assert M.written_inputs(_node(nodes, "_foreach_add_")) == [a1, b1]
    assert M.written_inputs(_node(nodes, "_foreach_zero_")) == [b1]


def test_dunder_methods_write_only_when_in_place():
    for name, inplace in [("__getitem__", False), ("__add__", False), ("__setitem__", True), ("__iadd__", True)]:
        node, x, _ = _graph_with(name, ("x", "y"), {}, "call_method")
        assert M.is_inplace(node) is inplace, name
        assert M.written_inputs(node) == ([x] if inplace else []), name


class _Fresh(torch.autograd.Function):
    """Writes in place only into a tensor of its own."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2.0
        y.add_(1.0)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


def test_autograd_function_that_marks_its_input_dirty_writes_it():
    def fn(x):
        h = torch.tanh(x)
        _Dirty.apply(h)
        return _Fresh.apply(h).sum()

    nodes = _dynamo_nodes(fn, torch.randn(3, requires_grad=True))
    dirty, fresh = [n for n in nodes if M.call_name(n) == "autograd_function_apply"]
    h = _node(nodes, "tanh")
    assert dirty.kwargs.get("dirty_idx") == [0]
    assert h in M.graph_values(M.written_inputs(dirty) or dirty.args)
    assert M.first_write([dirty], [h]) == (dirty, h)
    assert M.written_inputs(fresh) == []


def test_a_schema_that_writes_is_a_write_whatever_the_name():
    def fn(x, rm, rv):
        rm, rv = rm * 1.0, rv * 1.0
        y = torch._native_batch_norm_legit(x, None, None, rm, rv, True, 0.1, 1e-5)[0]
        s = torch.sort(y, dim=-1).values  # aten::sort has overloads that write a list, never a tensor
        return s.sum() + rm.sum() + rv.sum()

    nodes = _dynamo_nodes(fn, torch.randn(4, 3), torch.zeros(3), torch.ones(3))
    rm, rv = [n for n in nodes if M.call_name(n) == "mul"]
    assert M.written_inputs(_node(nodes, "_native_batch_norm_legit")) == [rm, rv]
    assert M.written_inputs(_node(nodes, "sort")) == []


def test_batch_norm_in_training_writes_its_running_statistics():
    def fn(x, rm, rv):
        rm, rv = rm * 1.0, rv * 1.0
        return F.batch_norm(x, rm, rv, training=True).sum() + rm.sum()

    nodes = _dynamo_nodes(fn, torch.randn(4, 3), torch.zeros(3), torch.ones(3))
    rm, rv = [n for n in nodes if M.call_name(n) == "mul"]
    assert M.written_inputs(_node(nodes, "batch_norm")) == [rm, rv]


def test_an_op_whose_writes_are_unknown_writes_every_input():
    @torch.compiler.allow_in_graph
    def opaque_scale(t):
        t.mul_(2.0)
        return t

    def fn(x):
        h = x * 1.0
        opaque_scale(h)
        return h.sum()

    nodes = _dynamo_nodes(fn, torch.randn(3))
    h, call = _node(nodes, "mul"), _node(nodes, "opaque_scale")
    assert M.written_inputs(call) is None
    assert M.first_write([call], [h]) == (call, h)
    assert "may write" in M.describe_write(call, h) and "writes in place" in M.describe_write(_node(nodes, "mul"), h)
    pure = [n for n in nodes if n is not call]
    assert all(M.written_inputs(n) == [] for n in pure), [M.call_name(n) for n in pure]
