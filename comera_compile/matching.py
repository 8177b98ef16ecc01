"""The matching vocabulary of the comera passes: what a node calls, and with which arguments.

A Dynamo graph records one operation in several forms: ``torch.add(a, b)``, ``a + b`` (``operator.add``)
and ``a.add(b)`` (a ``call_method`` node whose target is the string ``"add"``), with arguments given
positionally or by keyword. A pass that recognizes only one form misses the others; one that reads
``node.args[1]`` reads the wrong thing when the caller wrote ``other=``. This module gives every pass,
built-in or custom, the same answers:

* **target sets** (``LINEAR``, ``MATMUL``, ``ADD``, ``CROSS_ENTROPY``, ``RESHAPE``, ...): frozensets holding
  the functions and, as strings, the method names of one operation;
* :func:`is_call` / :func:`is_method`: does a node call one of them;
* :func:`bind`: the node's arguments by parameter name, defaults filled in, whether they were passed
  positionally or by keyword (``F.cross_entropy(input=..., target=...)``);
* :meth:`Bound.blocking`: the first argument a pass does not understand (``alpha=2.0``,
  ``rounding_mode='floor'``, ``out=``, an in-place variant), so that it can leave the node alone and say why;
* :func:`written_inputs` / :func:`first_write`: which tensors a node writes in place, and the first
  node of a stretch of the graph that writes into (a view or alias of) given values. A Dynamo graph is
  not functional: after ``h += 1`` the later uses of ``h`` are the same node, so a rewrite that moves a
  read of ``h`` across that write changes the result. A write is read from the op itself, whatever its
  name (its schema, an ``autograd.Function``'s forward that writes its input); an op whose writes are
  unknown (a function from outside torch) counts as writing every input it takes, and
  :func:`describe_write` says so for ``explain``.

Example (a pass that only handles a plain ``a + b``)::

    from comera_compile import matching as M

    if M.is_call(node, M.ADD):
        call = M.bind(node)
        problem = call.blocking("input", "other")   # e.g. "alpha=2.0", "in-place add_"
        if problem is None:
            a, b = call["input"], call["other"]
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = [
    "ADD", "ADDMM", "CAST", "CROSS_ENTROPY", "DIV", "EMBEDDING", "FLATTEN", "GETITEM", "IDENTITY",
    "LINEAR", "LINEAR_CROSS_ENTROPY", "LOG_SOFTMAX", "MATMUL", "MUL", "NARROW", "NLL_LOSS", "PERMUTE",
    "RESHAPE", "SELECT", "SQUEEZE", "SUB", "TANH", "TRANSPOSE", "UNFLATTEN", "UNSQUEEZE",
    "Bound", "bind", "call_name", "describe", "describe_write", "first_alias", "first_write", "graph_values", "is_call",
    "is_inplace", "is_method", "memory_of", "nodes_between",
    "same_size", "writes", "written_inputs",
]


def _ops(*functions: Any, methods: Iterable[str] = ()) -> frozenset:
    """A target set: the functions, each method name, and each method's ``torch.Tensor`` descriptor."""
    names = tuple(methods)
    return frozenset(functions) | frozenset(names) | frozenset(getattr(torch.Tensor, n) for n in names)


LINEAR = _ops(torch._C._nn.linear)  # F.linear is the same object
EMBEDDING = _ops(F.embedding, torch.embedding)
MATMUL = _ops(operator.matmul, torch.matmul, torch.mm, methods=("matmul", "mm"))
ADDMM = _ops(torch.addmm, methods=("addmm",))
ADD = _ops(operator.add, torch.add, methods=("add",))
SUB = _ops(operator.sub, torch.sub, torch.subtract, methods=("sub", "subtract"))
MUL = _ops(operator.mul, torch.mul, torch.multiply, methods=("mul", "multiply"))
DIV = _ops(operator.truediv, torch.div, torch.divide, torch.true_divide, methods=("div", "divide", "true_divide"))
TANH = _ops(torch.tanh, F.tanh, methods=("tanh",))
CROSS_ENTROPY = _ops(F.cross_entropy)
NLL_LOSS = _ops(F.nll_loss)
LOG_SOFTMAX = _ops(F.log_softmax, torch.log_softmax, torch.special.log_softmax, methods=("log_softmax",))
LINEAR_CROSS_ENTROPY = _ops(*[f for f in (getattr(F, "linear_cross_entropy", None),) if f is not None])
RESHAPE = _ops(torch.reshape, methods=("view", "reshape"))
FLATTEN = _ops(torch.flatten, methods=("flatten",))
UNFLATTEN = _ops(torch.unflatten, methods=("unflatten",))
TRANSPOSE = _ops(torch.transpose, torch.swapaxes, torch.swapdims, methods=("transpose", "swapaxes", "swapdims"))
PERMUTE = _ops(torch.permute, methods=("permute",))
SELECT = _ops(torch.select, methods=("select",))
NARROW = _ops(torch.narrow, methods=("narrow",))
SQUEEZE = _ops(torch.squeeze, methods=("squeeze",))
UNSQUEEZE = _ops(torch.unsqueeze, methods=("unsqueeze",))
GETITEM = _ops(operator.getitem)
IDENTITY = _ops(torch.clone, methods=("contiguous", "clone"))  # same values, possibly a new layout
CAST = _ops(methods=("float", "double", "half", "bfloat16", "to", "type"))  # read the dtype from the fake values

_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                                operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                                operator.setitem})
# Dunder methods that write their first input (``x.__iadd__(y)``); every other dunder reads only.
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__"})


def call_name(node: Any) -> str:
    """A short name for what ``node`` calls: ``"add"``, ``"view"``, ``"cross_entropy"``, ``"iadd"``."""
    if not isinstance(node, fx.Node):
        return type(node).__name__
    if isinstance(node.target, str):
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def is_call(node: Any, targets: Iterable[Any]) -> bool:
    """``node`` calls one of ``targets``: a function (``call_function``) or a method named there."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    return node.target in targets


def is_method(node: Any, names: str | Iterable[str]) -> bool:
    """``node`` is a method call (``x.name(...)``) with one of ``names``."""
    names = {names} if isinstance(names, str) else set(names)
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def is_inplace(node: Any) -> bool:
    """``node`` writes into its first input by its name: an in-place method or function, whose name ends
    in ``_`` (``x.add_(y)``, ``torch.tanh_(x)``, ``torch._foreach_mul_([x], 2)``), an in-place operator
    (``x += y``, ``x[i] = y``) or an in-place dunder (``x.__iadd__(y)``, ``x.__setitem__(i, y)``)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.target in _INPLACE_OPERATORS:
        return True
    name = call_name(node)
    if name.startswith("__") and name.endswith("__"):
        return name in _INPLACE_DUNDERS
    return name.endswith("_")


# Methods whose name ends in "_" (or whose schema says they write) but that change no tensor's values.
_METADATA_ONLY = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "retain_grad", "record_stream"})
# Where a call's writes are read from its name: torch's functions, Tensor methods and (by their own
# convention, a trailing "_") torch's Python functions; Python's operators, builtins and math, which
# write only as the in-place operators do; the passes' own runtime functions and einops', which write
# nothing. A function from anywhere else (torch.compiler.allow_in_graph) writes what it likes.
_NAMED_WRITES_MODULES = frozenset({"torch", "_operator", "operator", "builtins", "math", "comera_compile", "einops"})
# Functions that write running statistics (training) that their schema does not declare.
_RUNNING_STATS = frozenset({"batch_norm", "instance_norm"})


def graph_values(value: Any) -> list[fx.Node]:
    """The graph values inside an argument (lists, tuples and dicts flattened)."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in graph_values(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in graph_values(v)]
    return []


def _first_input(node: fx.Node) -> Any:
    if node.args:
        return node.args[0]
    return next((node.kwargs[k] for k in ("input", "self") if k in node.kwargs), None)


def _inplace_flag(node: fx.Node) -> bool:
    """``inplace=True`` given by keyword or by position (``F.relu(x, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    signature = _signature(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


@functools.lru_cache(maxsize=None)
def _signature_cached(target: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _signature(target: Callable) -> inspect.Signature | None:
    try:
        return _signature_cached(target)
    except TypeError:  # an unhashable callable
        return None


def _schema_writes(node: fx.Node) -> list[fx.Node] | None:
    """The arguments an ``OpOverload`` writes (by its schema); ``None`` (any input) for a packet with
    a mutable overload, whose overload is picked at run time."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, name)._schema for name in target.overloads()]
        return None if any(s.is_mutable for s in schemas) else []
    schema = target._schema
    if not schema.is_mutable:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            written.extend(graph_values(value))
    return written


@functools.lru_cache(maxsize=None)
def _aten_writes(name: str) -> tuple[frozenset, frozenset]:
    """(positions, keywords) of the tensor arguments that some overload of ``aten::<name>`` writes
    (``_foreach_mul_``: position 0; ``_native_batch_norm_legit``: the running statistics; an ``out=``
    overload: keyword ``out``). A written argument that holds no tensor (``aten::sort.int`` sorts a
    list) does not count."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return frozenset(), frozenset()
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return frozenset(), frozenset()
    positions, keywords = set(), set()
    for overload in packet.overloads():
        positional = 0
        for arg in getattr(packet, overload)._schema.arguments:
            if _writes_tensors(arg):
                keywords.add(arg.name)
                if not arg.kwarg_only:
                    positions.add(positional)
            positional += not arg.kwarg_only
    return frozenset(positions), frozenset(keywords)


def _writes_tensors(arg: Any) -> bool:
    """A schema argument whose tensors are written: ``Tensor(a!)``, ``Tensor(a!)[]`` (each element);
    not ``Tensor[](a!)``, a list written as a container (``aten::sort.Tensor`` sorts the list)."""
    info = arg.alias_info
    if info is None or not info.is_write or "Tensor" not in str(arg.type):
        return False
    return not (isinstance(arg.type, torch.ListType) and info.before_set)


def _owner(target: Any) -> str:
    """The top-level module a called function comes from (``"torch"`` for a Tensor method called as a
    function: ``torch.Tensor.add_(x, y)``); ``""`` when it does not say."""
    if isinstance(getattr(target, "__objclass__", None), type) and issubclass(target.__objclass__, torch._C.TensorBase):
        return "torch"
    module = getattr(target, "__module__", None)
    return module.split(".")[0] if isinstance(module, str) else ""


def _arguments(node: fx.Node) -> dict[str, Any]:
    """``node``'s arguments by name, as far as its signature (a Python function) or the schema of
    the same name (torch's builtins, Tensor methods) tells; ``{}`` when neither fits."""
    target = node.target
    signature = _signature(target) if node.op == "call_function" and callable(target) else None
    if signature is not None:
        try:
            return dict(signature.bind(*node.args, **node.kwargs).arguments)
        except TypeError:
            return {}
    try:
        packet = getattr(torch.ops.aten, call_name(node))
        schema = getattr(packet, packet.overloads()[0])._schema
    except (AttributeError, RuntimeError, IndexError):
        return {}
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _named_writes(node: fx.Node) -> list[fx.Node]:
    """The inputs a call writes by its name: an in-place name's first input, the written arguments of
    the aten schema of the same name, ``inplace=True``, ``out=``, the running statistics of a
    ``batch_norm`` / ``instance_norm`` and the weight an ``embedding`` renormalizes (``max_norm=``)."""
    name = call_name(node)
    if name in _METADATA_ONLY:
        return []
    written: list[Any] = []
    if is_inplace(node) or _inplace_flag(node):
        written.append(_first_input(node))
    if node.op == "call_method" or _owner(node.target) == "torch":
        positions, keywords = _aten_writes(name)
        written += [v for i, v in enumerate(node.args) if i in positions]
        written += [v for k, v in node.kwargs.items() if k in keywords]
    written.append(node.kwargs.get("out"))
    if name in _RUNNING_STATS or "max_norm" in node.kwargs or name.startswith("embedding"):
        args = _arguments(node)
        if name in _RUNNING_STATS:
            written += [args.get("running_mean"), args.get("running_var")]
        if args.get("max_norm") is not None:
            written.append(args.get("weight"))
    return list(dict.fromkeys(graph_values(written)))


def _subgraph_writes(node: fx.Node) -> list[fx.Node] | None:
    """The operands a higher-order op (``autograd_function_apply``, ``wrap``, a checkpoint) writes:
    those whose placeholder in one of its subgraphs (of an ``autograd.Function``: its forward's) is
    written there, or a view or alias of it, matched to the operands by position. ``None`` when the op
    has no subgraph to read, a written placeholder has no operand to match, or ``mark_dirty``
    (``dirty_idx``) says the op writes an input the subgraphs do not show."""
    owner = node.graph.owning_module
    operands = [v for v in graph_values(node.args) + graph_values(node.kwargs) if v.op != "get_attr"]
    bodies = [v for v in graph_values(node.args) if v.op == "get_attr"]
    if call_name(node) == "autograd_function_apply":
        bodies = bodies[:1]  # the forward (the backward writes into gradients, after the forward ran)
    subs = [getattr(owner, attr.target, None) if owner is not None else None for attr in bodies]
    if not subs or not all(isinstance(sub, fx.GraphModule) for sub in subs):
        return None  # no subgraph to read (a Triton kernel's wrapper writes what its kernel writes)
    written: list[fx.Node] = []
    for sub in subs:
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        pairs = writes(sub.graph.nodes)
        for k, placeholder in enumerate(placeholders):
            if first_alias(pairs, [placeholder]) is None:
                continue
            if len(placeholders) != len(operands):
                return None
            written.append(operands[k])
    if node.kwargs.get("dirty_idx") and not written:
        return None
    return list(dict.fromkeys(written))


def written_inputs(node: fx.Node) -> list[fx.Node] | None:
    """The graph values ``node`` writes into in place: ``[]`` when it writes none, ``None`` when it
    may write any of its inputs (an op this module does not know: a submodule, a function from outside
    torch, a higher-order op whose writes cannot be matched to its operands).

    Writes are in-place methods and functions, whatever their name (``x.mul_(2)``, ``torch.relu_(x)``,
    ``torch._foreach_mul_([x], 2)``, ``x += 1``, ``x[i] = v``), ``inplace=True``
    (``F.relu(x, inplace=True)``), ``out=``, the written arguments of the op's schema (of a
    ``torch.ops`` op, or of the aten op of the same name), the running statistics of a batch norm,
    and what a higher-order op's subgraphs write into its operands (an ``autograd.Function`` that
    writes its input and marks it dirty).
    """
    if node.op == "call_module":
        owner = node.graph.owning_module
        try:
            module = owner.get_submodule(node.target) if owner is not None else None
        except AttributeError:
            module = None
        builtin = module is not None and type(module).__module__.startswith("torch.nn.modules")
        return [] if builtin and not getattr(module, "inplace", False) else None
    if node.op not in ("call_function", "call_method"):
        return []
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _schema_writes(node)
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _subgraph_writes(node)
    if node.op == "call_function" and _owner(node.target) not in _NAMED_WRITES_MODULES:
        return None
    return _named_writes(node)


def memory_of(value: Any) -> Any:
    """A hashable identity of the memory behind a node's (fake) tensor value, or ``None``: two values
    with the same identity are views or aliases of one another."""
    from torch.multiprocessing.reductions import StorageWeakRef

    v = value.meta.get("example_value", value.meta.get("val")) if isinstance(value, fx.Node) else value
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except (RuntimeError, NotImplementedError):  # no storage (e.g. some subclasses): fall back to identity
        return None


def writes(nodes: Iterable[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """Every ``(writer, written value)`` among ``nodes``, in order. A node whose writes are unknown
    (:func:`written_inputs` is ``None``) counts as writing every input it takes. A pass that checks
    many values against one graph scans it once with this and asks :func:`first_alias` of the pairs."""
    pairs = []
    for node in nodes:
        written = written_inputs(node)
        if written is None:
            written = graph_values(node.args) + graph_values(node.kwargs)
        pairs.extend((node, value) for value in written)
    return pairs


def first_write(nodes: Iterable[fx.Node], values: Iterable[Any]) -> tuple[fx.Node, fx.Node] | None:
    """The first of ``nodes`` that writes into one of ``values`` or a view or alias of one (the
    same memory, by the fake tensors' storages), as ``(writer, written value)``; ``None`` if none does."""
    return first_alias(writes(nodes), values)


def describe_write(writer: fx.Node, value: fx.Node) -> str:
    """How ``explain`` names a write found by :func:`first_write`: ``"... writes in place into h"``, or
    for an op whose writes are unknown ``"... may write into h (...)"``."""
    if written_inputs(writer) is None:
        return (f"{describe(writer)} may write into {value.name} (an op whose writes the analysis does not "
                "know counts as writing every input it takes)")
    return f"{describe(writer)} writes in place into {value.name}"


def first_alias(pairs: Iterable[tuple[fx.Node, fx.Node]], values: Iterable[Any]) -> tuple[fx.Node, fx.Node] | None:
    """The first of the ``(writer, written value)`` pairs (from :func:`writes`) whose written value
    is one of ``values`` or shares its memory; ``None`` if none is."""
    guarded = [v for v in values if isinstance(v, fx.Node)]
    storages = {s for s in map(memory_of, guarded) if s is not None}
    plain = {v for v in guarded if memory_of(v) is None}
    for writer, value in pairs:
        s = memory_of(value)
        if value in plain or (s is not None and s in storages):
            return writer, value
    return None


def nodes_between(first: fx.Node, last: fx.Node) -> Iterator[fx.Node]:
    """The nodes strictly after ``first`` and strictly before ``last``, in graph order."""
    node = first.next
    while node is not last and node.op != "root":
        yield node
        node = node.next


def describe(node: Any) -> str:
    """``"torch.add (add_1)"``-style text naming a node for ``explain``."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op == "call_method":
        return f".{node.target}() ({node.name})"
    if node.op == "call_function":
        module = getattr(node.target, "__module__", None) or ""
        prefix = {"_operator": "operator.", "torch": "torch.", "torch.nn.functional": "F.",
                  "torch._C._nn": "F."}.get(module, "")
        return f"{prefix}{call_name(node)} ({node.name})"
    return f"{node.op} {node.name}"


def same_size(a: Any, b: Any) -> bool:
    """Two sizes (ints or ``torch.SymInt``) are known to be equal, without installing a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# ---------------------------------------------------------------------------------------------
# Signatures: each stub has the parameter names and defaults of the torch op (``self`` is
# ``input``); torch's builtins carry no inspectable signature.
# ---------------------------------------------------------------------------------------------

_SIGNATURES: dict[Any, Callable] = {}


def _signature_of(*targets: Any) -> Callable[[Callable], Callable]:
    def register(stub: Callable) -> Callable:
        for target in targets:
            _SIGNATURES[target] = stub
        return stub

    return register


@_signature_of(torch.add, torch.sub, torch.subtract, operator.add, operator.sub, operator.iadd, operator.isub,
               "add", "sub", "subtract", "add_", "sub_", "subtract_")
def _add(input, other, *, alpha=1, out=None): ...


@_signature_of(torch.mul, torch.multiply, torch.true_divide, operator.mul, operator.truediv, operator.imul,
               operator.itruediv, operator.floordiv, operator.matmul, torch.matmul,
               "mul", "multiply", "true_divide", "matmul", "mul_", "multiply_", "true_divide_")
def _binary(input, other, *, out=None): ...


@_signature_of(torch.div, torch.divide, "div", "divide", "div_", "divide_")
def _div(input, other, *, rounding_mode=None, out=None): ...


@_signature_of(torch.mm, "mm")
def _mm(input, mat2, *, out_dtype=None, out=None): ...


@_signature_of(torch.addmm, "addmm", "addmm_")
def _addmm(input, mat1, mat2, *, beta=1, alpha=1, out_dtype=None, out=None): ...


@_signature_of(torch._C._nn.linear)
def _linear(input, weight, bias=None): ...


@_signature_of(torch.embedding)
def _aten_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False): ...


@_signature_of(torch.tanh, "tanh", "tanh_", torch.tanh_)
def _unary(input, *, out=None): ...


@_signature_of(torch.log_softmax, torch.special.log_softmax, "log_softmax")
def _log_softmax(input, dim, dtype=None, *, out=None): ...


@_signature_of("view")
def _view(input, *size): ...


@_signature_of("reshape")
def _reshape_method(input, *shape): ...


@_signature_of(torch.reshape)
def _reshape(input, shape): ...


@_signature_of(torch.flatten, "flatten")
def _flatten(input, start_dim=0, end_dim=-1): ...


@_signature_of(torch.unflatten, "unflatten")
def _unflatten(input, dim, sizes): ...


@_signature_of(torch.transpose, torch.swapdims, "transpose", "swapdims", "transpose_", "swapdims_")
def _transpose(input, dim0, dim1): ...


@_signature_of(torch.swapaxes, "swapaxes", "swapaxes_")
def _swapaxes(input, axis0, axis1): ...


@_signature_of(torch.permute)
def _permute(input, dims): ...


@_signature_of("permute")
def _permute_method(input, *dims): ...


@_signature_of(torch.select, "select")
def _select(input, dim, index): ...


@_signature_of(torch.narrow, "narrow")
def _narrow(input, dim, start, length): ...


@_signature_of(torch.squeeze, "squeeze", "squeeze_")
def _squeeze(input, dim=None): ...


@_signature_of(torch.unsqueeze, "unsqueeze", "unsqueeze_")
def _unsqueeze(input, dim): ...


@_signature_of(operator.getitem)
def _getitem(input, index): ...


@_signature_of("t", "t_", torch.t, "contiguous", "float", "double", "half", "bfloat16")
def _no_args(input, memory_format=None): ...


@_signature_of(torch.clone, "clone")
def _clone(input, *, memory_format=None): ...


def _stub_for(node: fx.Node) -> Callable | None:
    target = node.target
    if node.op == "call_method" or target in _SIGNATURES:
        return _SIGNATURES.get(target)
    name = getattr(target, "__name__", None)
    if isinstance(name, str) and getattr(torch.Tensor, name, None) is target:  # torch.Tensor.add(x, y)
        return _SIGNATURES.get(name)
    if inspect.isfunction(target):  # a Python function: F.cross_entropy, F.log_softmax, a user's helper
        return target
    return None


@dataclass(frozen=True)
class Bound(Mapping[str, Any]):
    """A call node's arguments by parameter name (in signature order), defaults filled in.

    Var-positional parameters (``x.view(*size)``) hold a tuple; ``x.view((2, 3))`` and
    ``x.view(2, 3)`` both give ``size=(2, 3)``.
    """

    node: fx.Node
    arguments: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arguments)

    def __len__(self) -> int:
        return len(self.arguments)

    @property
    def inplace(self) -> bool:
        return is_inplace(self.node)

    def non_default(self, *understood: str) -> dict[str, Any]:
        """The arguments outside ``understood`` whose value is not their default."""
        return {k: v for k, v in self.arguments.items()
                if k not in understood and not _is_default(v, self.defaults.get(k, inspect.Parameter.empty))}

    def blocking(self, *understood: str) -> str | None:
        """What keeps a pass that understands only ``understood`` from handling this call, or ``None``.

        ``"in-place add_"`` for an in-place variant, else the first argument outside ``understood``
        that is not at its default, as ``"name=value"`` (``"alpha=2.0"``, ``"rounding_mode='floor'"``).
        """
        if self.inplace:
            return f"in-place {call_name(self.node)}"
        for name, value in self.non_default(*understood).items():
            shown = f"<traced {value.name}>" if isinstance(value, fx.Node) else repr(value)
            return f"{name}={shown}"
        return None


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(value, fx.Node) or default is inspect.Parameter.empty:
        return False
    if value is None or default is None:
        return value is default
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default) and type(value) in (type(default), int, float)
    except Exception:
        return False


def bind(node: fx.Node) -> Bound | None:
    """The arguments of a ``call_function`` / ``call_method`` node by parameter name.

    Returns ``None`` when the signature of what the node calls is unknown or the node's arguments
    do not fit it (a keyword the op does not have): treat that node as not understood.
    """
    stub = _stub_for(node) if isinstance(node, fx.Node) else None
    if stub is None:
        return None
    sig = inspect.signature(stub)
    args, kwargs = list(node.args), dict(node.kwargs)
    var = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_POSITIONAL), None)
    if var is not None and var in kwargs:  # x.view(size=(2, 3))
        args.append(kwargs.pop(var))
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if var is not None:
        packed = tuple(arguments.get(var, ()))
        if len(packed) == 1 and isinstance(packed[0], (tuple, list, torch.Size)):
            packed = tuple(packed[0])
        arguments[var] = packed
    defaults = {p.name: (() if p.kind is p.VAR_POSITIONAL else p.default) for p in sig.parameters.values()}
    return Bound(node, arguments, defaults)
