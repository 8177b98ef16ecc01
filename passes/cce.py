"""Fuse the language-model head and its cross-entropy into ``comera::linear_cross_entropy``.

The pattern, matched on the Dynamo (torch-level) graph from the loss back to the projection:

    loss   = cross_entropy(chain(proj), target, ...)        | nll_loss(log_softmax(chain(proj)), ...)
    chain  = any mix of view/reshape/flatten, row slicing (``logits[..., :-1, :]``), a ``.float()``
             upcast and soft-capping ``tanh(z / c) * c``
    proj   = linear(h, W[, b]) | h @ W.T [+ b] | matmul(h, W.t())
    and torch's own ``F.linear_cross_entropy(h, W, target, ...)``.

The fused op takes the hidden states with the same row slicing applied (slicing rows of the
logits is slicing rows of ``h``), flattened to [N, D], so the logits never exist. Every candidate
that is left alone gets its reason in ``explain``; nothing is rewritten unless it is exact.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from comera_compile.fx_utils import RewriteRejected, checked_replace, fake, module_name, _same_size
from comera_compile.pass_manager import REGISTRY, PassContext

KIND = "cce"

_CROSS_ENTROPY = {F.cross_entropy, torch.nn.functional.cross_entropy}
_NLL = {F.nll_loss}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.nn.functional.log_softmax}
_LINEAR = {torch._C._nn.linear, F.linear}
_MATMUL = {operator.matmul, torch.matmul, torch.mm}
_RESHAPE_METHODS = {"view", "reshape", "flatten", "contiguous"}
_RESHAPE_FUNCS = {torch.reshape, torch.flatten}
_TANH = {torch.tanh, F.tanh}
_LINEAR_CE = {getattr(F, "linear_cross_entropy", None)} - {None}


class _Skip(Exception):
    """A candidate that stays as it is; the message is the reason shown by ``explain``."""


@dataclass
class _Match:
    loss: fx.Node
    pattern: str
    target: fx.Node
    h: fx.Node
    weight: fx.Node
    weight_transposed: bool = False  # the graph holds W as [D, V]
    bias: Any = None
    proj: fx.Node | None = None
    softcap: float = 0.0
    upcast: bool = False
    row_index: list[Any] = field(default_factory=list)  # getitem indices to re-apply on h, in order
    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    chain: list[fx.Node] = field(default_factory=list)  # pattern nodes to erase once unused


def _is_method(node: Any, names: set[str] | str) -> bool:
    names = {names} if isinstance(names, str) else names
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def _is_call(node: Any, targets: set[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _describe(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target} ({node.name})"


def _only_user(node: fx.Node, user: fx.Node) -> None:
    others = [u for u in node.users if u is not user]
    if others:
        raise _Skip(f"the logits ({node.name}) have other users ({', '.join(_describe(u) for u in others)}); "
                    "left alone: fusing would compute them twice and keep them in memory anyway")


def _loss_args(node: fx.Node, m: dict[str, Any], nll: bool) -> None:
    weight = _arg(node, 2, "weight", None)
    if weight is not None:
        raise _Skip("class weights (weight=) are not supported by the fused kernel")
    for index, name in ((3, "size_average"), (5, "reduce")):
        if _arg(node, index, name, None) is not None:
            raise _Skip(f"legacy argument {name}= is not supported")
    m["ignore_index"] = _arg(node, 4, "ignore_index", -100)
    m["reduction"] = _arg(node, 6, "reduction", "mean")
    m["label_smoothing"] = 0.0 if nll else _arg(node, 7, "label_smoothing", 0.0)
    for key in ("ignore_index", "reduction", "label_smoothing"):
        if isinstance(m[key], fx.Node):
            raise _Skip(f"{key} is a traced value, not a constant")
    if m["reduction"] not in ("mean", "sum", "none"):
        raise _Skip(f"reduction={m['reduction']!r}")


def _row_index_ok(index: Any, ndim: int) -> bool:
    """``index`` (a getitem key) selects rows only: the last (vocabulary) dimension is untouched."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (isinstance(i, (slice, int)) or i is Ellipsis) for i in items):
        return False
    if any(isinstance(i, slice) and any(isinstance(v, fx.Node) for v in (i.start, i.stop, i.step))
           for i in items):
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    if len(items) < ndim:
        return True
    return len(items) == ndim and items[-1] == slice(None)


def _softcap_of(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """``tanh(x / c) * c`` (either operand order) -> (x, c, nodes)."""
    if not (_is_call(node, {operator.mul, torch.mul}) and len(node.args) == 2):
        return None
    a, b = node.args
    tanh, c = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not isinstance(tanh, fx.Node):
        return None
    if not (_is_call(tanh, _TANH) or _is_method(tanh, "tanh")):
        return None
    div = tanh.args[0]
    if not (_is_call(div, {operator.truediv, torch.div}) and len(div.args) == 2
            and isinstance(div.args[1], (int, float)) and float(div.args[1]) == float(c)):
        return None
    if not (float(c) > 0.0):
        return None
    return div.args[0], float(c), [node, tanh, div]


def _strip_transpose(w: Any) -> fx.Node | None:
    """``W.t()`` / ``W.T`` / ``W.transpose(0, 1)`` / ``W.permute(1, 0)`` -> W (2-D), else None."""
    if not isinstance(w, fx.Node):
        return None
    if _is_method(w, "t") or _is_call(w, {torch.t}):
        return w.args[0]
    if (w.op == "call_function" and w.target is getattr and w.args[1] in ("T", "mT")):
        return w.args[0]
    if (_is_method(w, "transpose") or _is_call(w, {torch.transpose})) and sorted(
            int(d) % 2 for d in w.args[1:3]) == [0, 1]:
        return w.args[0]
    if _is_method(w, "permute") and tuple(w.args[1:]) in ((1, 0), ((1, 0),)):
        return w.args[0]
    return None


def _match_projection(node: fx.Node, m: dict[str, Any]) -> None:
    if _is_call(node, _LINEAR):
        m["h"], m["weight"] = node.args[0], _arg(node, 1, "weight", None)
        m["bias"] = _arg(node, 2, "bias", None)
        m["proj"] = node
        return
    bias = None
    if _is_call(node, {operator.add, torch.add}) and len(node.args) == 2:
        a, b = node.args
        for mm, other in ((a, b), (b, a)):
            if _is_call(mm, _MATMUL) and isinstance(other, fx.Node):
                fb, fo = fake(other), fake(mm)
                if isinstance(fb, torch.Tensor) and fb.dim() == 1 and fo is not None and _same_size(
                        fb.shape[0], fo.shape[-1]):
                    _only_user(mm, node)
                    m["chain"].append(mm)
                    bias, node = other, mm
                    break
    if _is_call(node, _MATMUL):
        h, wt = node.args[:2]
        fw = fake(wt)
        if not isinstance(fw, torch.Tensor) or fw.dim() != 2:
            raise _Skip("the projection's weight is not a 2-D matrix")
        w = _strip_transpose(wt)
        if w is not None:
            m["weight"] = w
            if len(wt.users) == 1:
                m["chain"].append(wt)
        else:
            m["weight"], m["weight_transposed"] = wt, True
        m["h"], m["bias"], m["proj"] = h, bias, node
        return
    raise _Skip(f"the logits come from {_describe(node)}, not a linear projection")


def _match(loss: fx.Node) -> _Match | None:
    m: dict[str, Any] = {"chain": [], "row_index": [], "softcap": 0.0, "upcast": False}
    if _is_call(loss, _LINEAR_CE):
        if _arg(loss, 3, "weight", None) is not None or loss.kwargs.get("weight") is not None:
            raise _Skip("class weights (weight=) are not supported by the fused kernel")
        m.update(pattern="F.linear_cross_entropy", h=loss.args[0], weight=loss.args[1], target=loss.args[2],
                 bias=loss.kwargs.get("linear_bias"), reduction=loss.kwargs.get("reduction", "mean"),
                 ignore_index=loss.kwargs.get("ignore_index") if loss.kwargs.get("ignore_index") is not None
                 else -100, label_smoothing=loss.kwargs.get("label_smoothing", 0.0))
        return _Match(loss=loss, **m)
    if _is_call(loss, _CROSS_ENTROPY):
        m["pattern"] = "cross_entropy"
        logits, m["target"] = loss.args[0], _arg(loss, 1, "target", None)
        _loss_args(loss, m, nll=False)
    elif _is_call(loss, _NLL):
        m["pattern"] = "log_softmax+nll_loss"
        lsm, m["target"] = loss.args[0], _arg(loss, 1, "target", None)
        if not (_is_call(lsm, _LOG_SOFTMAX) or _is_method(lsm, "log_softmax")):
            return None  # an nll_loss on something else is no LM head candidate
        _loss_args(loss, m, nll=True)
        dim = _arg(lsm, 1, "dim", None)
        flsm = fake(lsm)
        if dim is None or flsm is None or int(dim) % flsm.dim() != flsm.dim() - 1:
            raise _Skip(f"log_softmax over dim={dim}, not the last (vocabulary) dimension")
        if _arg(lsm, 3 if lsm.op == "call_function" else 2, "dtype", None) is not None:
            raise _Skip("log_softmax(dtype=...) is not supported")
        _only_user(lsm, loss)
        m["chain"].append(lsm)
        logits = lsm.args[0]
    else:
        return None
    flog = fake(logits)
    if not isinstance(flog, torch.Tensor) or flog.dim() != 2:
        raise _Skip("the loss input is not [N, V] logits (class dimension must be last)")
    if not isinstance(m["target"], fx.Node) or fake(m["target"]) is None or fake(m["target"]).dtype != torch.int64:
        raise _Skip("the targets are not class indices (int64); probability targets are not supported")

    cur, user = logits, loss if m["pattern"] == "cross_entropy" else m["chain"][-1]
    while True:
        _only_user(cur, user)
        fcur = fake(cur)
        if _is_method(cur, _RESHAPE_METHODS) or _is_call(cur, _RESHAPE_FUNCS):
            src = cur.args[0]
            if not _same_size(fake(src).shape[-1], fcur.shape[-1]):
                raise _Skip(f"{_describe(cur)} changes the vocabulary dimension")
        elif _is_call(cur, {operator.getitem}):
            src = cur.args[0]
            if not _row_index_ok(cur.args[1], fake(src).dim()):
                raise _Skip(f"{_describe(cur)} indexes the vocabulary dimension or uses tensor indices")
            m["row_index"].insert(0, cur.args[1])
        elif _is_method(cur, "float") or (_is_method(cur, "to") and torch.float32 in cur.args[1:]):
            src = cur.args[0]
            m["upcast"] = True
        elif (sc := _softcap_of(cur)) is not None:
            if m["softcap"]:
                raise _Skip("soft-capping applied twice")
            src, m["softcap"], nodes = sc
            m["chain"] += nodes
            user, cur = nodes[-1], src
            continue
        else:
            _match_projection(cur, m)  # (a bias add also puts its matmul on the chain)
            m["chain"].append(cur)
            break
        m["chain"].append(cur)
        user, cur = cur, src
    return _Match(loss=loss, **m)


def _build(graph: fx.Graph, m: _Match, ctx: PassContext) -> fx.Node:
    from comera_compile.kernels.linear_cross_entropy import default_filter_eps

    fh, fw = fake(m.h), fake(m.weight)
    proj_dtype = fake(m.proj).dtype if m.proj is not None else fh.dtype
    h, w, b = m.h, m.weight, m.bias
    for index in m.row_index:
        h = graph.call_function(operator.getitem, (h, index))
    h = graph.call_method("reshape", (h, -1, fh.shape[-1] if not isinstance(fh.shape[-1], torch.SymInt)
                                      else graph.call_method("size", (m.h, -1))))
    if m.weight_transposed:
        w = graph.call_method("t", (w,))
    # Autocast (or a mixed-dtype model) computes the projection in proj_dtype: do the same.
    if fh.dtype != proj_dtype:
        h = graph.call_method("to", (h, proj_dtype))
    if fw.dtype != proj_dtype:
        w = graph.call_method("to", (w, proj_dtype))
    if b is not None and fake(b).dtype != proj_dtype:
        b = graph.call_method("to", (b, proj_dtype))
    target = m.target
    if fake(target).dim() != 1:
        target = graph.call_method("reshape", (target, -1))
    opts = ctx.options
    eps = opts.cce_filter_eps if opts.cce_filter_eps is not None else default_filter_eps(proj_dtype)
    fused = graph.call_function(torch.ops.comera.linear_cross_entropy.default, (
        h, w, target, b, float(m.softcap), int(m.ignore_index), float(m.label_smoothing), m.reduction,
        opts.cce_backward, float(eps), bool(opts.cce_deterministic), "auto"))
    loss = graph.call_function(operator.getitem, (fused, 0))
    expected = fake(m.loss)
    if expected is not None and expected.dtype != torch.float32:
        loss = graph.call_method("to", (loss, expected.dtype))
    if m.reduction == "none" and expected is not None and expected.dim() != 1:
        loss = graph.call_method("reshape", (loss, *[int(s) for s in expected.shape]))
    return loss


def cce_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite every LM-head + cross-entropy in ``gm`` into one fused op; returns the count."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.graph is None:
            continue
        try:
            m = _match(node)
        except _Skip as reason:
            ctx.skip(KIND, str(reason), module_name(node))
            continue
        if m is None:
            continue
        fw = fake(m.weight)
        vocab = fw.shape[1] if m.weight_transposed else fw.shape[0]
        if isinstance(vocab, int) and vocab < ctx.options.cce_min_vocab:
            ctx.skip(KIND, f"vocabulary {vocab} < cce_min_vocab={ctx.options.cce_min_vocab}", module_name(node))
            continue
        where = module_name(m.proj) if m.proj is not None else module_name(node)
        with gm.graph.inserting_before(node):
            new = _build(gm.graph, m, ctx)
        try:
            checked_replace(node, new, erase=m.chain)
        except RewriteRejected as exc:
            ctx.skip(KIND, str(exc), where)
            continue
        fh = fake(m.h)
        detail = (f"{m.pattern}: D={fh.shape[-1]}, V={vocab}, reduction={m.reduction}, "
                  f"ignore_index={m.ignore_index}, label_smoothing={m.label_smoothing}, "
                  f"softcap={m.softcap or 'none'}, bias={'yes' if m.bias is not None else 'no'}, "
                  f"shifted={'yes' if m.row_index else 'no'}, upcast={'yes' if m.upcast else 'no'}, "
                  f"backward={ctx.options.cce_backward}")
        ctx.rewrite(KIND, where, detail)
        count += 1
    return count


REGISTRY.register(KIND, cce_pass, builtin=True)
