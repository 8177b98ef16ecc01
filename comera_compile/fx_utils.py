"""Helpers that passes share: module names, fake values, subgraphs, checked replacement; and the
module a ``torch.compile`` wrapper holds."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

# the local or global the model was reached through; a wrapper's ``*args`` with the module first
# (accelerate's mixed-precision forward: ``L['args'][0]``) counts as that local too
_PREFIX = re.compile(r"^[LG]\['args'\]\[\d+\]\.?|^[LG]\['[^']*'\]\.?")
_BRACKET = re.compile(r"\.?_modules\['([^']*)'\]|\['([^']*)'\]")
# Attributes through which wrappers hold the user's module: torch.compile, activation checkpointing,
# FSDP1, and a bound method's module (a wrapper that calls ``model.forward``).
_WRAPPER_ATTRS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "__self__"}
# Ops a loss input goes through between the projection and the loss (reshapes, upcast, row slices,
# log_softmax, soft-capping): walking back over them finds where the logits come from.
_LOGITS_CHAIN = {"view", "reshape", "flatten", "contiguous", "float", "to", "getitem", "log_softmax",
                 "tanh", "mul", "truediv", "div"}


class RewriteRejected(RuntimeError):
    """A replacement whose fake output does not match the original's; the rewrite is not made."""


class Declined(Exception):
    """A candidate a pass leaves as it is. Every built-in pass declines by raising it with the reason
    (naming the node or argument that blocked the rewrite), and records that reason for ``explain``
    with ``ctx.skip``; the graph is unchanged."""


def clean_module_name(name: str) -> str:
    """The user's name of a module from Dynamo's qualified name.

    ``"L['self'].layers[0].mlp"`` / ``"L['self']._modules['h']"`` / ``"G['model'].lm_head"`` /
    ``"L['args'][0].lm_head"`` -> ``"layers.0.mlp"`` / ``"h"`` / ``"lm_head"`` / ``"lm_head"``; wrapper attributes (``_orig_mod`` of a compiled
    submodule, ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``, a bound method's
    ``__self__``) are dropped.
    """
    name = _PREFIX.sub("", name)
    name = _BRACKET.sub(lambda m: "." + (m.group(1) or m.group(2)), name)
    name = re.sub(r"\[(\d+)\]", r".\1", name)
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_ATTRS)


def unwrap_compiled(model: Any) -> Any:
    """The module a ``torch.compile``'d module wraps (its ``_orig_mod``), or ``model`` itself."""
    return getattr(model, "_orig_mod", model)


SOURCE_META = ("nn_module_stack", "stack_trace", "source_fn_stack")  # where a node comes from in the user's code


def inherit_source_meta(nodes: Sequence[fx.Node], source: fx.Node) -> None:
    """Give ``nodes`` (built to replace ``source``) its module stack, stack trace and source function,
    where they have none: ``explain`` and Inductor's provenance then name the user's module."""
    for key in SOURCE_META:
        if key in source.meta:
            for node in nodes:
                node.meta.setdefault(key, source.meta[key])


def module_name(node: fx.Node) -> str | None:
    """The fully qualified name of the innermost ``nn.Module`` that produced ``node``."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        qualname = list(stack.values())[-1][0]
        return clean_module_name(qualname) or None
    return None


def nearest_module_name(node: fx.Node, max_steps: int = 16) -> str | None:
    """The module that made ``node``'s data: the nearest node along the first inputs that runs in a
    submodule of ``node``'s own module, else ``node``'s own module.

    A loss is usually computed by the model's top-level forward or a library function
    (transformers' ``loss_function``), so its own module is the whole model; walking back along the
    first input finds the projection that made its logits (``lm_head``), the name a user looks for.
    """
    own = module_name(node)
    cur: Any = node
    for _ in range(max_steps):
        if not isinstance(cur, fx.Node) or not cur.args:
            break
        cur = cur.args[0]
        name = module_name(cur) if isinstance(cur, fx.Node) else None
        if name and (own is None or name.startswith(own + ".")):
            return name
    return own


def logits_source(loss_input: fx.Node, max_steps: int = 32) -> fx.Node:
    """The node a loss input comes from, past reshapes, upcasts, row slices, log_softmax and
    soft-capping: the projection, or a placeholder when the logits were made in another graph."""
    cur = loss_input
    for _ in range(max_steps):
        target = cur.target if isinstance(cur.target, str) else getattr(cur.target, "__name__", "")
        if cur.op not in ("call_function", "call_method") or target not in _LOGITS_CHAIN:
            return cur
        inputs = [a for a in cur.args if isinstance(a, fx.Node)]
        if not inputs:
            return cur
        cur = inputs[0]
    return cur


def source_name(node: fx.Node) -> str | None:
    """For a placeholder that is a parameter or buffer: its name in the model (``"lm_head.weight"``)."""
    grapharg = node.meta.get("grapharg")
    if grapharg is None:
        return None
    try:
        name = grapharg.source.name() if callable(grapharg.source.name) else grapharg.source.name
    except Exception:
        return None
    name = clean_module_name(name)
    return re.sub(r"_(parameters|buffers)\.", "", name.replace("._parameters", "").replace("._buffers", "")) or None


def fake(node: Any) -> Any:
    """The fake value recorded for a node (Dynamo's ``example_value`` or AOT's ``val``)."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def size_hint(n: Any, fallback: int = 4096) -> int:
    """An int for a token count that may be an int, a ``torch.SymInt`` or a sympy expression.

    Reads the size hint without installing a guard: ``ShapeEnv.optimization_hint`` (torch 2.13),
    ``SymNode.hint_int`` / ``ShapeEnv.size_hint`` (torch 2.11). A free sympy expression without a
    shape environment has no hint: ``fallback`` is used.
    """
    if isinstance(n, bool):
        raise TypeError("n_tokens must be an integer, not bool")
    if isinstance(n, int):
        return n
    node = getattr(n, "node", None)
    if node is not None:  # torch.SymInt
        shape_env = getattr(node, "shape_env", None)
        expr = getattr(node, "expr", None)
        if shape_env is not None and expr is not None:
            for name in ("optimization_hint", "size_hint"):
                fn = getattr(shape_env, name, None)
                if fn is None:
                    continue
                try:
                    return int(fn(expr))
                except Exception:
                    pass
        for name in ("hint_int", "optimization_hint"):
            fn = getattr(node, name, None)
            if fn is not None:
                try:
                    return int(fn())
                except Exception:
                    pass
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        return fallback
    try:
        import sympy

        if isinstance(n, sympy.Expr):
            return int(n) if n.is_number else fallback
    except ImportError:  # pragma: no cover
        pass
    return int(n)


def autocast_enabled_at(node: fx.Node, device: str) -> bool:
    """Whether autocast for ``device`` is on where ``node`` runs: around the compiled call, or in an
    autocast region of the traced code (``_enter_autocast`` / ``_exit_autocast`` nodes) before it.
    Outside autocast eager refuses mixed dtypes in a matmul, which fake tensors do not check."""
    enabled = [torch.is_autocast_enabled(device)]
    for n in node.graph.nodes:
        if n is node:
            break
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            enabled.append(bool(n.args[2]) if n.args[:1] == (device,) and len(n.args) > 2 else enabled[-1])
        elif n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast and len(enabled) > 1:
            enabled.pop()
    return enabled[-1]


def check_eager_dtypes(node: fx.Node, operands: Sequence[Any]) -> None:
    """Raise :class:`Declined` when ``node``'s tensor operands mix dtypes outside autocast: eager
    raises there (fake tensors do not check), so the original call is kept and raises the same way.
    Autocast, around the compiled call or in a region of the traced code, mixes them legitimately."""
    values = [fake(t) for t in operands if t is not None]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    dtypes = sorted({str(v.dtype) for v in tensors})
    if len(dtypes) > 1 and not autocast_enabled_at(node, tensors[0].device.type):
        raise Declined(f"mixed dtypes {dtypes} outside autocast: eager raises, and so does the original call, "
                       "which is kept")


def iter_graph_modules(gm: fx.GraphModule, prefix: str = "") -> Iterator[tuple[str, fx.GraphModule]]:
    """The graph and every nested higher-order-op subgraph (checkpoint bodies, cond branches...)."""
    yield prefix, gm
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            yield from iter_graph_modules(sub, f"{prefix}.{name}" if prefix else name)


def _fake_mode(values: Sequence[Any]):
    for value in values:
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            return mode
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def fake_call(target: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``target`` on the fake values of ``args``/``kwargs`` (nodes replaced by their fakes)."""
    fargs = tree_map(fake, args)
    fkwargs = tree_map(fake, kwargs)
    flat = [v for v in torch.utils._pytree.tree_leaves((fargs, fkwargs)) if isinstance(v, torch.Tensor)]
    mode = _fake_mode(flat)
    if mode is None:
        raise RewriteRejected("no fake tensor mode found on the inputs")
    with mode:
        return target(*fargs, **fkwargs)


def fake_node(node: fx.Node) -> Any:
    """Compute the fake value of a ``call_function``/``call_method`` node from its inputs' fakes."""
    if node.op == "call_function":
        return fake_call(node.target, node.args, node.kwargs)
    if node.op == "call_method":
        return fake_call(lambda self, *a, **k: getattr(self, node.target)(*a, **k), node.args, node.kwargs)
    raise RewriteRejected(f"cannot compute a fake value for a {node.op} node")


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        ea = a.node.expr if isinstance(a, torch.SymInt) else a
        eb = b.node.expr if isinstance(b, torch.SymInt) else b
        return str(ea) == str(eb)  # structural; never installs a guard
    return int(a) == int(b)


def same_meta(new: Any, old: Any) -> str | None:
    """``None`` when ``new`` and ``old`` have the same shape and dtype, else what differs."""
    if isinstance(old, torch.Tensor) != isinstance(new, torch.Tensor):
        return f"produces {type(new).__name__}, expected {type(old).__name__}"
    if not isinstance(old, torch.Tensor):
        return None
    if new.dtype != old.dtype:
        return f"dtype {new.dtype} != {old.dtype}"
    if new.dim() != old.dim() or not all(_same_size(a, b) for a, b in zip(new.shape, old.shape)):
        return f"shape {tuple(new.shape)} != {tuple(old.shape)}"
    return None


def checked_replace(old: fx.Node, new: fx.Node, erase: Sequence[fx.Node] = ()) -> None:
    """Replace ``old`` by ``new`` after checking the fake output of ``new`` against ``old``.

    ``new`` (and any nodes it was built from) must already be in the graph. Its fake value is
    computed from its inputs' fake values; on a shape or dtype mismatch the new nodes are removed
    and :class:`RewriteRejected` is raised, leaving the graph as it was.
    ``erase`` lists nodes of the matched pattern to remove once they have no users.
    """
    graph = old.graph
    expected = fake(old)
    created = _new_nodes_feeding(new, old)
    try:
        if expected is None:
            raise RewriteRejected(f"{old.name} has no fake value to check the replacement against")
        for node in created:  # topological order
            node.meta["example_value"] = fake_node(node)
        problem = same_meta(fake(new), expected)
    except RewriteRejected:
        _erase_all(graph, created)
        raise
    except Exception as exc:  # the replacement does not even trace: reject it
        _erase_all(graph, created)
        raise RewriteRejected(f"replacement failed on fake inputs: {exc}") from exc
    if problem is not None:
        _erase_all(graph, created)
        raise RewriteRejected(f"replacement output differs from the original: {problem}")
    inherit_source_meta(created, old)
    old.replace_all_uses_with(new)
    erase_unused([old, *erase])


def _new_nodes_feeding(new: fx.Node, old: fx.Node) -> list[fx.Node]:
    """Nodes without a fake value that feed ``new`` (the freshly built replacement), in order."""
    seen: set[fx.Node] = set()
    order: list[fx.Node] = []

    def visit(node: fx.Node) -> None:
        if node in seen or node is old or fake(node) is not None and node is not new:
            return
        seen.add(node)
        for inp in node.all_input_nodes:
            visit(inp)
        order.append(node)

    visit(new)
    return order


def _erase_all(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)


def erase_unused(nodes: Sequence[fx.Node]) -> None:
    """Erase those of ``nodes`` that have no users (repeatedly: erasing one can free another)."""
    remaining = [n for n in dict.fromkeys(nodes) if n.op not in ("placeholder", "output")]
    changed = True
    while changed:
        changed = False
        for node in list(remaining):
            if not node.users:
                node.graph.erase_node(node)
                remaining.remove(node)
                changed = True
