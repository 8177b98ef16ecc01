"""Fuse the language-model head and its cross-entropy into ``comera::linear_cross_entropy``.

The pattern, matched on the Dynamo (torch-level) graph from the loss back to the projection:

    loss  = cross_entropy(path(proj), target, ...)  |  nll_loss(path(log_softmax(...)), target, ...)
            | torch's own F.linear_cross_entropy(h, W, target, ...)
    proj  = linear(h, W[, b]) | h @ W.T | matmul(h, W.t()) | mm | addmm(b, h, W.t())
    path  = any mix of
            row ops:   view/reshape/flatten/unflatten, getitem with ints/slices/index tensors, select,
                       narrow, transpose/permute, (un)squeeze, contiguous: none may touch the
                       vocabulary dimension (the last one);
            value ops: a bias add (+ b, b of shape [V]), scaling by a Python number (temperature),
                       soft-capping c * tanh(z / c), an fp32 upcast, log_softmax over the last dim.

The fused op gets the rows of ``h`` that reach the loss: the row ops of the path are applied to
``h`` itself (``[..., D]`` in place of ``[..., V]``). Since none of them touches the last dimension,
they commute with the projection, so row ``r`` of the result is the hidden state whose logits the
loss pairs with target ``r``, in the same order. Scalings are folded into ``h`` and the bias.

The fused op reads ``h``, ``W``, the bias and any index tensor of the row ops where the loss is, not
where the projection was. So a write between the two into any of them, or into a view or alias of
one (``h += 1``, ``h[0] = 0``, ``F.relu(h, inplace=True)`` on an aux branch, ``torch._foreach_mul_([h], c)``,
an ``autograd.Function`` that marks ``h`` dirty; an op whose writes are unknown counts as writing its
inputs), leaves the loss as it is, naming the write: eager computed the logits before it. In training a
write after the loss does too: the op saves what it reads for its backward, where eager's projection
may have saved none of it.

Anything else on the path (an ``alpha=``, a ``rounding_mode=``, an in-place op, a cast other than an
fp32 upcast, an op that touches the vocabulary dimension, an unknown op) leaves the loss as it is,
and ``explain`` shows the argument or node that blocked it. So does the cost rule
(``comera_compile.cce.decide_fused_loss``) for heads not worth fusing under the
``cce_policy`` option (by default "memory": heads whose logits exceed ``cce_memory_threshold``, at a
small stated slowdown at most), unless the ``cce_min_vocab`` option sets the threshold instead. The
rule runs once per head, at the device profile of what will run the op
(``comera_compile.cce.op_profile``: its Triton paths at the GPU's, its torch reference at the CPU's):
its decision (whether fusing pays, the op's path, the logits' memory) serves the rewrite and the
detail ``explain`` shows.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from comera_compile import matching as M
from comera_compile.fx_utils import (
    Declined,
    RewriteRejected,
    check_eager_dtypes,
    checked_replace,
    fake,
    fake_node,
    inherit_source_meta,
    module_name,
    size_hint,
)
from comera_compile.cce.options import LCEOptions
from comera_compile.devices import DeviceProfile
from comera_compile.cce.planner import (
    FusedLossDecision,
    adaptive_plan,
    decide_fused_loss,
    describe_logits,
    logits_bytes,
    op_profile,
)
import comera_compile.kernels.linear_cross_entropy  # noqa: F401  (defines the op)
from comera_compile.kernels import precompile
from comera_compile.kernels.dispatch import use_triton

if TYPE_CHECKING:  # the pass manager runs the passes; they only name its context type
    from comera_compile.pass_manager import PassContext

KIND = "cce"
_HIDDEN = object()  # placeholder in a re-applied reshape: the hidden size D replaces the vocabulary size V
_UPCAST_FROM = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class _Projection:
    """``h @ W.T + bias``: the weight as the op wants it ([V, D]) or transposed ([D, V])."""

    node: fx.Node
    h: Any
    weight: Any
    transposed: bool = False
    bias: Any = None
    erase: list[fx.Node] = field(default_factory=list)

    def vocab(self) -> Any:
        return fake(self.weight).shape[1 if self.transposed else 0]


@dataclass
class _Values:
    """The value ops of the path in normal form: ``softcap(k * (h @ W.T + bias))``, then upcast."""

    bias: Any = None
    scale: float = 1.0
    softcap: float = 0.0
    upcast: bool = False
    log_softmax: bool = False


@dataclass
class _Head:
    loss: fx.Node
    pattern: str
    target: fx.Node
    proj: _Projection
    logits: Any  # the loss input ([N, V]; the loss node itself for F.linear_cross_entropy)
    rows: list[tuple[str, tuple]]  # row ops to re-apply on h, innermost first: (method or "getitem", args)
    values: _Values
    reduction: str = "mean"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    chain: list[fx.Node] = field(default_factory=list)  # pattern nodes to erase once unused


# ---------------------------------------------------------------------------------------------
# The projection
# ---------------------------------------------------------------------------------------------

def _bound(node: fx.Node) -> M.Bound:
    call = M.bind(node)
    if call is None:
        raise Declined(f"{M.describe(node)}: its arguments do not fit the known signature")
    return call


def _require(call: M.Bound, *understood: str) -> None:
    problem = call.blocking(*understood)
    if problem is not None:
        raise Declined(f"{M.describe(call.node)}: {problem} is not supported by the fused op")


def _strip_transpose(w: Any) -> fx.Node | None:
    """``W.t()`` / ``W.T`` / ``W.mT`` / ``W.transpose(0, 1)`` / ``W.permute(1, 0)`` of a 2-D W -> W."""
    if not isinstance(w, fx.Node) or getattr(fake(w), "ndim", 0) != 2:
        return None
    if w.op == "call_function" and w.target is getattr and w.args[1] in ("T", "mT"):
        return w.args[0]
    call = M.bind(w) if M.is_call(w, M.TRANSPOSE | M.PERMUTE | {"t", torch.t}) else None
    if call is None or call.inplace:
        return None
    if "dims" in call:
        dims = [d % 2 for d in call["dims"] if isinstance(d, int)]
        return call["input"] if dims == [1, 0] else None
    if "dim0" in call or "axis0" in call:
        d0, d1 = list(call.values())[1:3]
        ok = isinstance(d0, int) and isinstance(d1, int) and {d0 % 2, d1 % 2} == {0, 1}
        return call["input"] if ok else None
    return call["input"]


def _matrix_weight(w: Any, proj: fx.Node) -> tuple[Any, bool, list[fx.Node]]:
    """The ``[D, V]`` right operand of a matmul as (weight, transposed, nodes to erase)."""
    fw = fake(w)
    if not isinstance(fw, torch.Tensor) or fw.dim() != 2:
        raise Declined(f"{M.describe(proj)}: the projection's weight is not a 2-D matrix")
    base = _strip_transpose(w)
    if base is None:
        return w, True, []
    return base, False, [w] if len(w.users) == 1 else []


def _projection(node: fx.Node) -> _Projection | None:
    """``node`` as a projection ``h @ W.T (+ b)``, or ``None`` if it is none."""
    if M.is_call(node, M.LINEAR):
        call = _bound(node)
        _require(call, "input", "weight", "bias")
        if getattr(fake(call["weight"]), "ndim", 0) != 2:
            raise Declined(f"{M.describe(node)}: the projection's weight is not a 2-D matrix")
        return _Projection(node, call["input"], call["weight"], bias=call["bias"])
    if M.is_call(node, M.MATMUL):
        call = _bound(node)
        h, w = list(call.values())[:2]
        _require(call, "input", "other", "mat2")
        weight, transposed, erase = _matrix_weight(w, node)
        return _Projection(node, h, weight, transposed, erase=erase)
    if M.is_call(node, M.ADDMM):
        call = _bound(node)
        _require(call, "input", "mat1", "mat2")
        weight, transposed, erase = _matrix_weight(call["mat2"], node)
        return _Projection(node, call["mat1"], weight, transposed, bias=_vector_bias(call["input"], node), erase=erase)
    return None


def _vector_bias(bias: Any, node: fx.Node) -> fx.Node:
    fb, fo = fake(bias), fake(node)
    if not (isinstance(bias, fx.Node) and isinstance(fb, torch.Tensor)):
        raise Declined(f"{M.describe(node)}: adds a constant ({bias!r}) to the logits, not a bias vector")
    leading = [n for n in fb.shape[:-1]] if fb.dim() else [0]
    if (fb.dim() == 0 or fb.dim() > fo.dim() or not M.same_size(fb.shape[-1], fo.shape[-1])
            or not all(M.same_size(n, 1) for n in leading)):
        raise Declined(f"{M.describe(node)}: the added tensor has shape {tuple(fb.shape)}, not a [V] bias "
                       "(or [1, ..., 1, V], as BART's final_logits_bias)")
    if fb.dtype != fo.dtype:
        raise Declined(f"{M.describe(node)}: the bias ({fb.dtype}) changes the logits' dtype to {fo.dtype}")
    return bias


# ---------------------------------------------------------------------------------------------
# Row ops: the same op on h selects the same rows, since none touches the last dimension
# ---------------------------------------------------------------------------------------------

def _dim(value: Any, ndim: int, node: fx.Node) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise Declined(f"{M.describe(node)}: dimension {value!r} is not a constant")
    return value % ndim if ndim else 0


def _vocab_untouched(node: fx.Node, *dims: int) -> None:
    last = fake(node.args[0] if node.args else node.kwargs["input"]).dim() - 1
    if last in dims:
        raise Declined(f"{M.describe(node)} moves or indexes the vocabulary dimension (the last one)")


def _reshape_args(call: M.Bound, vocab: Any) -> tuple[str, tuple]:
    shape = call["size"] if "size" in call else call["shape"]
    node = call.node
    if not shape or any(not isinstance(s, (int, torch.SymInt, fx.Node)) or isinstance(s, bool) for s in shape):
        raise Declined(f"{M.describe(node)}: size={shape!r} is not a shape (a view as another dtype?)")
    last = shape[-1]
    if isinstance(last, int) and last == -1:
        return "reshape", tuple(shape)
    if isinstance(last, fx.Node):
        last = fake(last)
    if not M.same_size(last, vocab):
        raise Declined(f"{M.describe(node)} merges the vocabulary dimension with others")
    return "reshape", (*shape[:-1], _HIDDEN)


def _row_args(call: M.Bound, vocab: Any) -> tuple[str, tuple]:
    """(method, args) re-applying the row op ``call`` to ``h``; raises ``Declined`` if it touches V."""
    node = call.node
    ndim = fake(call["input"]).dim()
    if M.is_call(node, M.RESHAPE):
        return _reshape_args(call, vocab)
    if M.is_call(node, M.FLATTEN):
        start, end = _dim(call["start_dim"], ndim, node), _dim(call["end_dim"], ndim, node)
        if end == ndim - 1 and start < end:
            raise Declined(f"{M.describe(node)} flattens the vocabulary dimension into the rows")
        return "flatten", (start, end)
    if M.is_call(node, M.TRANSPOSE):
        d0, d1 = (_dim(d, ndim, node) for d in list(call.values())[1:3])
        if d0 != d1:
            _vocab_untouched(node, d0, d1)
        return "transpose", (d0, d1)
    if M.is_call(node, M.PERMUTE):
        dims = [_dim(d, ndim, node) for d in call["dims"]]
        if dims[-1] != ndim - 1:
            _vocab_untouched(node, ndim - 1)
        return "permute", (dims,)
    return _row_args_indexing(call, ndim)


def _row_args_indexing(call: M.Bound, ndim: int) -> tuple[str, tuple]:
    node = call.node
    if M.is_call(node, M.SELECT | M.NARROW | M.UNFLATTEN):
        _vocab_untouched(node, _dim(call["dim"], ndim, node))
        return M.call_name(node), tuple(call.values())[1:]
    if M.is_call(node, M.SQUEEZE):
        dims = call["dim"]
        if dims is None:
            raise Declined(f"{M.describe(node)}: squeeze() without dim= is not supported")
        dims = dims if isinstance(dims, (tuple, list)) else [dims]
        _vocab_untouched(node, *[_dim(d, ndim, node) for d in dims])
        return "squeeze", (call["dim"],)
    if M.is_call(node, M.UNSQUEEZE):
        if _dim(call["dim"], ndim + 1, node) == ndim:
            raise Declined(f"{M.describe(node)} adds a dimension after the vocabulary dimension")
        return "unsqueeze", (call["dim"],)
    if M.is_call(node, M.GETITEM):
        _check_index(node, call["index"], ndim)
        return "getitem", (call["index"],)
    raise Declined(f"{M.describe(node)} is not a supported row operation")


def _index_dims(item: Any, node: fx.Node) -> int:
    """How many input dimensions one getitem index item consumes."""
    if item is None:
        return 0
    if isinstance(item, (slice, int, torch.SymInt)) and not isinstance(item, bool):
        return 1
    value = fake(item)
    if isinstance(item, fx.Node) and isinstance(value, (int, torch.SymInt)):
        return 1
    if isinstance(item, fx.Node) and isinstance(value, torch.Tensor):
        if value.dtype in (torch.bool, torch.uint8):
            return value.dim()
        if not value.dtype.is_floating_point and not value.dtype.is_complex:
            return 1
    raise Declined(f"{M.describe(node)}: index {item!r} is not an int, slice, None, Ellipsis or index tensor")


def _check_index(node: fx.Node, index: Any, ndim: int) -> None:
    """The index leaves the last (vocabulary) dimension whole: ``:``, ``...`` or not indexed at all."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        raise Declined(f"{M.describe(node)}: more than one Ellipsis")
    used = sum(_index_dims(item, node) for item in items if item is not Ellipsis)
    dim = 0
    for item in items:
        width = ndim - used if item is Ellipsis else _index_dims(item, node)
        if dim + width >= ndim and width and not (item is Ellipsis or item == slice(None)):
            raise Declined(f"{M.describe(node)} indexes the vocabulary dimension (the last one)")
        dim += width


# ---------------------------------------------------------------------------------------------
# Value ops
# ---------------------------------------------------------------------------------------------

def _chain_operand(call: M.Bound, first: str, second: str) -> tuple[fx.Node, Any]:
    """(the operand carrying the logits, the other one) of a binary op."""
    a, b = call[first], call[second]
    fo = fake(call.node)
    for x, y in ((a, b), (b, a)):
        fx_ = fake(x)
        if isinstance(x, fx.Node) and isinstance(fx_, torch.Tensor) and fx_.dim() == fo.dim() and all(
                M.same_size(p, q) for p, q in zip(fx_.shape, fo.shape)):
            if not (isinstance(y, fx.Node) and isinstance(fake(y), torch.Tensor) and fake(y).dim() == fo.dim()):
                return x, y
    raise Declined(f"{M.describe(call.node)} combines two tensors of logits' shape")


def _number(value: Any, node: fx.Node, what: str) -> float:
    if isinstance(value, fx.Node) or isinstance(value, torch.Tensor):
        raise Declined(f"{M.describe(node)} {what} the logits by a tensor, not a Python number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Declined(f"{M.describe(node)} {what} the logits by {value!r}")
    return float(value)


def _value_op(node: fx.Node) -> tuple[fx.Node, tuple]:
    """(the logits input, (kind, argument)) of a value op; raises ``Declined`` on anything else."""
    fout = fake(node)
    if M.is_call(node, M.CAST):
        src = node.args[0]
        fin = fake(src)
        if fout.dtype != torch.float32 or fin.dtype not in _UPCAST_FROM or fin.device != fout.device:
            raise Declined(f"{M.describe(node)}: a cast from {fin.dtype} to {fout.dtype}; only an fp32 upcast "
                        "is fused")
        return src, ("upcast", None)
    call = _bound(node)
    if M.is_call(node, M.ADD):
        _require(call, "input", "other")
        src, bias = _chain_operand(call, "input", "other")
        if fake(src).dtype != fout.dtype:
            raise Declined(f"{M.describe(node)}: adding the bias promotes the logits from {fake(src).dtype} "
                        f"to {fout.dtype}")
        return src, ("bias", _vector_bias(bias, node))
    if M.is_call(node, M.MUL):
        _require(call, "input", "other")
        src, factor = _chain_operand(call, "input", "other")
        return src, ("mul", _number(factor, node, "multiplies"))
    if M.is_call(node, M.DIV):
        _require(call, "input", "other")
        divisor = _number(call["other"], node, "divides")
        if divisor == 0.0:
            raise Declined(f"{M.describe(node)} divides the logits by zero")
        return call["input"], ("div", divisor)
    if M.is_call(node, M.TANH):
        _require(call, "input")
        return call["input"], ("tanh", None)
    if M.is_call(node, M.LOG_SOFTMAX):
        return call["input"], ("log_softmax", _log_softmax_upcast(call))
    raise Declined(f"the logits reach the loss through {M.describe(node)}, which the fused op does not compute")


def _log_softmax_upcast(call: M.Bound) -> bool:
    _require(call, "input", "dim", "dtype", "_stacklevel")
    node, fin = call.node, fake(call["input"])
    dim = call["dim"]
    if dim is None:  # torch's implicit dim for the legacy call without dim=
        dim = 0 if fin.dim() in (0, 1, 3) else 1
    if _dim(dim, fin.dim(), node) != fin.dim() - 1:
        raise Declined(f"{M.describe(node)}: log_softmax over dim={dim}, not the last (vocabulary) dimension")
    dtype = call["dtype"]
    if dtype is not None and (dtype != torch.float32 or fin.dtype not in _UPCAST_FROM):
        raise Declined(f"{M.describe(node)}: dtype={dtype} is not an fp32 upcast")
    return dtype is not None


def _cancel(num: list[float], den: list[float]) -> float:
    """``prod(num) / prod(den)``, exactly 1.0 when the two cancel (``tanh(z / c) * c``)."""
    num, den = list(num), list(den)
    for value in list(num):
        if value in den:
            num.remove(value)
            den.remove(value)
    return math.prod(num) / math.prod(den)


def _fold(values: list[tuple[str, Any, fx.Node]], bias: Any) -> _Values:
    """The value ops (innermost first) as ``softcap(k * (z + bias))``, or ``Declined``."""
    out = _Values(bias=bias)
    scales: dict[str, list[float]] = {"mul": [], "div": []}
    post: dict[str, list[float]] = {"mul": [], "div": []}
    tanh = False
    for kind, arg, node in values:
        if out.log_softmax and kind != "upcast":
            raise Declined(f"{M.describe(node)} comes after log_softmax")
        if kind == "upcast":
            out.upcast = True
        elif kind == "bias":
            if out.bias is not None or tanh or scales["mul"] or scales["div"]:
                raise Declined(f"{M.describe(node)}: a bias added after another bias, a scaling or a tanh")
            out.bias = arg
        elif kind in ("mul", "div"):
            (post if tanh else scales)[kind].append(arg)
        elif kind == "tanh":
            if tanh:
                raise Declined(f"{M.describe(node)}: tanh applied twice")
            tanh = True
        else:
            out.log_softmax = True
            out.upcast = out.upcast or arg
    if tanh:
        out.softcap = _cancel(post["mul"], post["div"])
        if not out.softcap > 0.0:
            raise Declined(f"soft-cap scale {out.softcap} is not positive")
    out.scale = _cancel(scales["mul"] + post["mul"], scales["div"] + post["div"])
    return out


# ---------------------------------------------------------------------------------------------
# The candidate: loss back to projection
# ---------------------------------------------------------------------------------------------

def _only_user(node: fx.Node, user: fx.Node) -> None:
    others = [u for u in node.users if u is not user]
    if others:
        raise Declined(f"the logits ({node.name}) have other users ({', '.join(M.describe(u) for u in others)}); "
                    "left alone: fusing would compute them twice and keep them in memory anyway")


def _walk(logits: fx.Node, user: fx.Node, rows: list, values: list) -> tuple[_Projection, list[fx.Node]]:
    """From the loss input back to the projection: fills ``rows`` and ``values`` (innermost first);
    returns the projection and the path's nodes."""
    chain: list[fx.Node] = []
    cur = logits
    while True:
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            raise Declined(f"the logits come from {M.describe(cur)}, not from a projection in this graph")
        _only_user(cur, user)
        if M.is_inplace(cur):
            raise Declined(f"{M.describe(cur)}: in-place {M.call_name(cur)} on the logits is not supported")
        proj = _projection(cur)
        if proj is not None:
            return proj, chain + [cur, *proj.erase]
        src = _step(cur, rows, values)
        chain.append(cur)
        user, cur = cur, src


def _step(node: fx.Node, rows: list, values: list) -> Any:
    """Record one path node (row op, value op or identity); returns its logits input."""
    if M.is_call(node, M.IDENTITY):
        _require(_bound(node), "input", "memory_format")
        return node.args[0] if node.args else node.kwargs["input"]
    row_ops = (M.RESHAPE | M.FLATTEN | M.UNFLATTEN | M.TRANSPOSE | M.PERMUTE | M.SELECT | M.NARROW
               | M.SQUEEZE | M.UNSQUEEZE | M.GETITEM)
    if M.is_call(node, row_ops):
        call = _bound(node)
        fin, fout = fake(call["input"]), fake(node)
        if fin.dim() == 0:
            raise Declined(f"{M.describe(node)}: the logits have no vocabulary dimension")
        rows.insert(0, _row_args(call, fin.shape[-1]))
        if fout.dim() == 0 or not M.same_size(fin.shape[-1], fout.shape[-1]):
            raise Declined(f"{M.describe(node)} changes the vocabulary dimension (the last one)")
        return call["input"]
    if M.is_call(node, M.LOG_SOFTMAX):  # recorded first: a blocked log_softmax still makes an LM-loss candidate
        values.insert(0, ("log_softmax", False, node))
        src, (_, upcast) = _value_op(node)
        values[0] = ("log_softmax", upcast, node)
        return src
    src, (kind, arg) = _value_op(node)
    values.insert(0, (kind, arg, node))
    return src


def _loss_args(call: M.Bound) -> dict[str, Any]:
    if call["weight"] is not None:
        raise Declined(f"{M.describe(call.node)}: class weights (weight=) are not supported by the fused kernel")
    _require(call, "input", "target", "ignore_index", "reduction", "label_smoothing")
    args = {"reduction": call["reduction"], "ignore_index": call["ignore_index"],
            "label_smoothing": call.get("label_smoothing", 0.0)}
    for key, value in args.items():
        if isinstance(value, fx.Node):
            raise Declined(f"{M.describe(call.node)}: {key} is a traced value, not a constant")
    if args["reduction"] not in ("mean", "sum", "none"):
        raise Declined(f"{M.describe(call.node)}: reduction={args['reduction']!r}")
    return args


def _check_loss_input(logits: Any, target: Any) -> None:
    flog, ftgt = fake(logits), fake(target)
    if not isinstance(flog, torch.Tensor) or flog.dim() != 2:
        shape = tuple(flog.shape) if isinstance(flog, torch.Tensor) else flog
        raise Declined(f"the loss input has shape {shape}: the fused op needs [N, V] logits "
                    "(class dimension must be last)")
    if not isinstance(target, fx.Node) or not isinstance(ftgt, torch.Tensor) or ftgt.dtype != torch.int64:
        raise Declined("the targets are not class indices (int64); probability targets are not supported")


def _match(loss: fx.Node) -> _Head | None:
    if M.is_call(loss, M.LINEAR_CROSS_ENTROPY):
        return _match_linear_cross_entropy(loss)
    if M.is_call(loss, M.CROSS_ENTROPY):
        pattern = "cross_entropy"
    elif M.is_call(loss, M.NLL_LOSS):
        pattern = "log_softmax+nll_loss"
    else:
        return None
    call = _bound(loss)
    rows: list[tuple[str, tuple]] = []
    values: list[tuple[str, Any, fx.Node]] = []
    try:  # the walk first: an nll_loss is a candidate only when a log_softmax feeds it
        proj, chain = _walk(call["input"], loss, rows, values)
        args = _loss_args(call)
        _check_loss_input(call["input"], call["target"])
    except Declined:
        if pattern != "cross_entropy" and not any(v[0] == "log_softmax" for v in values):
            return None  # an nll_loss that is no log_softmax over logits: not an LM head candidate
        raise
    folded = _fold(values, proj.bias)
    if folded.log_softmax != (pattern != "cross_entropy"):
        if pattern == "cross_entropy":
            raise Declined("cross_entropy over log_softmax outputs is not fused")
        return None
    return _Head(loss, pattern, call["target"], proj, call["input"], rows, folded, chain=chain, **args)


def _match_linear_cross_entropy(loss: fx.Node) -> _Head:
    call = _bound(loss)
    if call["weight"] is not None:
        raise Declined(f"{M.describe(loss)}: class weights (weight=) are not supported by the fused kernel")
    _require(call, "input", "linear_weight", "target", "linear_bias", "reduction", "ignore_index",
             "label_smoothing")
    h, w, bias = call["input"], call["linear_weight"], call["linear_bias"]
    if getattr(fake(h), "ndim", 0) != 2 or getattr(fake(w), "ndim", 0) != 2:
        raise Declined(f"{M.describe(loss)}: input and linear_weight must be 2-D")
    if bias is not None and getattr(fake(bias), "ndim", 0) != 1:
        raise Declined(f"{M.describe(loss)}: linear_bias is not a [V] vector")
    ftgt = fake(call["target"])
    if not isinstance(ftgt, torch.Tensor) or ftgt.dtype != torch.int64 or ftgt.dim() != 1:
        raise Declined("the targets are not class indices (int64); probability targets are not supported")
    ignore = call["ignore_index"]
    args = {"reduction": call["reduction"], "ignore_index": -100 if ignore is None else ignore,
            "label_smoothing": call["label_smoothing"]}
    return _Head(loss, "F.linear_cross_entropy", call["target"], _Projection(loss, h, w, bias=bias), loss, [],
                 _Values(bias=bias), **args)


# ---------------------------------------------------------------------------------------------
# The replacement
# ---------------------------------------------------------------------------------------------

class _Emitter:
    """Adds nodes before the loss, computing each one's fake value at once (so a replacement that
    does not trace is refused before anything is committed); ``discard`` removes them again."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node) -> None:
        self.graph, self.anchor, self.created = graph, anchor, []

    def __call__(self, op: str, target: Any, *args: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, {})
        self.created.append(node)
        try:
            node.meta["example_value"] = fake_node(node)
        except Exception as exc:
            raise Declined(f"the replacement does not trace: {M.describe(node)}: {exc}") from exc
        inherit_source_meta([node], self.anchor)
        return node

    def method(self, name: str, *args: Any) -> fx.Node:
        return self("call_method", name, *args)

    def function(self, fn: Callable, *args: Any) -> fx.Node:
        return self("call_function", fn, *args)

    def discard(self) -> None:
        for node in reversed(self.created):
            if not getattr(node, "_erased", False) and not node.users:  # checked_replace may have erased it
                self.graph.erase_node(node)


def _hidden_rows(emit: _Emitter, head: _Head) -> fx.Node:
    """``h`` with the path's row ops applied: row ``r`` is the hidden state behind target ``r``."""
    h = head.proj.h
    hidden = fake(h).shape[-1]
    for method, args in head.rows:
        if method == "getitem":
            h = emit.function(operator.getitem, h, *args)
            continue
        if args and args[-1] is _HIDDEN:
            size = hidden if isinstance(hidden, int) else emit.method("size", head.proj.h, -1)
            args = (*args[:-1], size)
        h = emit.method(method, h, *args)
    fh, flog = fake(h), fake(head.logits)
    if fh.dim() != 2 or not M.same_size(fh.shape[0], flog.shape[0] if flog.dim() else 1):
        raise Declined(f"the hidden rows {tuple(fh.shape)} do not line up with the logits {tuple(flog.shape)}")
    return h


def _projection_dtype(head: _Head) -> torch.dtype:
    """The dtype the projection computes in (autocast may differ from h's and W's)."""
    return fake(head.proj.node).dtype if head.proj.node is not head.loss else fake(head.proj.h).dtype


def _options(head: _Head, ctx: PassContext) -> LCEOptions:
    """The fused op's options for this head (its path and gradients are set by the build)."""
    opts = ctx.options
    try:
        options = LCEOptions(softcap=head.values.softcap, ignore_index=head.ignore_index,
                             label_smoothing=head.label_smoothing, reduction=head.reduction,
                             backward=opts.cce_backward, filter_eps=opts.cce_filter_eps,
                             deterministic=opts.cce_deterministic, memory_budget=opts.cce_memory_budget)
    except (TypeError, ValueError) as exc:
        raise Declined(f"the fused op does not take the loss's arguments: {exc}") from exc
    return options.resolve(_projection_dtype(head))


def _profile(head: _Head) -> DeviceProfile:
    """The device profile the cost model prices this head's op at: its Triton paths' where they will run
    on the hidden states' device, else its torch reference's (``op_profile``)."""
    h = fake(head.proj.h)
    return op_profile(h.device, triton=use_triton(h))


def _decide(head: _Head, ctx: PassContext, options: LCEOptions) -> FusedLossDecision:
    """Whether fusing this head pays and the op's path, decided once (the build and explain's detail
    read it). Pays: by the user's ``cce_min_vocab`` when set, else by the op's cost rule under
    ``cce_policy``, at the profile of what will run the op (its Triton paths or its torch reference:
    ``op_profile``).
    The path: the user's ``cce_strategy`` when pinned; else, in training, the cost model's;
    inference lets the op decide ("auto"). An unpinned path is a plan: the op re-decides between it and
    the sparse path when it runs, from the kept fraction observed on previous steps (``_build`` sets the
    op's ``adaptive`` option; ``comera_compile.cce.planner.runtime_strategy``)."""
    opts = ctx.options
    vocab = head.proj.vocab()
    n_tokens, dtype = math.prod(size_hint(s) for s in fake(head.target).shape), _projection_dtype(head)
    nbytes = logits_bytes(n_tokens, size_hint(vocab), dtype)
    if not isinstance(vocab, int):
        return FusedLossDecision(True, "", opts.cce_strategy, nbytes)
    threshold, pinned = opts.cce_min_vocab, opts.cce_strategy != "auto"
    decision = FusedLossDecision(True, logits_bytes=nbytes)
    if threshold is None or (ctx.training and not pinned):
        decision = decide_fused_loss(n_tokens, size_hint(fake(head.proj.h).shape[-1]), vocab, dtype,
                                     capture=ctx.cudagraphs(), training=ctx.training, upcast=head.values.upcast,
                                     policy=opts.cce_policy, memory_threshold=opts.cce_memory_threshold,
                                     profile=_profile(head), **options.cost_model_args())
    if threshold is not None:
        pays = vocab >= threshold
        reason = "" if pays else f"vocabulary {vocab} < cce_min_vocab={threshold} ({describe_logits(nbytes, dtype)})"
        decision = dataclasses.replace(decision, pays=pays, reason=reason)
    if pinned:
        decision = dataclasses.replace(decision, strategy=opts.cce_strategy)
    return decision


def _build(emit: _Emitter, head: _Head, ctx: PassContext, options: LCEOptions,
           decision: FusedLossDecision) -> fx.Node:
    proj, vals = head.proj, head.values
    dtype = _projection_dtype(head)
    check_eager_dtypes(proj.node, [proj.h, proj.weight, proj.bias])
    if abs(vals.scale) > 1.0 and dtype != torch.float32:
        # h * k can overflow a 16-bit dtype where eager's k * logits (in fp32 after the upcast) does not.
        raise Declined(f"scaling the logits by {vals.scale:g} would be folded into the {dtype} hidden states, where it "
                    "can overflow; scale the hidden states before the projection instead (that form is fused)")
    h, w, b = _hidden_rows(emit, head), proj.weight, vals.bias
    if b is not None and fake(b).dim() != 1:  # [1, ..., 1, V] broadcast over the rows: the same [V] bias
        b = emit.method("reshape", b, -1)
    if vals.scale != 1.0:
        h = emit.function(operator.mul, h, vals.scale)
        b = emit.function(operator.mul, b, vals.scale) if b is not None else None
    if proj.transposed:
        w = emit.method("t", w)
    # Autocast (or a mixed-dtype model) computes the projection in `dtype`: do the same.
    h, w = (x if fake(x).dtype == dtype else emit.method("to", x, dtype) for x in (h, w))
    # The projection's own bias is added in its dtype (autocast casts it); a bias added to the logits
    # after their fp32 upcast stays fp32: the op adds it in fp32, as eager does.
    chain_bias_fp32 = vals.bias is not None and vals.bias is not proj.bias and fake(vals.bias).dtype == torch.float32
    if b is not None and fake(b).dtype != dtype and not chain_bias_fp32:
        b = emit.method("to", b, dtype)
    needs = [ctx.training and isinstance(fake(t), torch.Tensor) and fake(t).requires_grad for t in (h, w, b)]
    adaptive = ctx.options.cce_strategy == "auto"
    strategy = adaptive_plan(decision.strategy, dtype, reduction=options.reduction) if adaptive else decision.strategy
    call = dataclasses.replace(options.with_needs(*needs), strategy=strategy, adaptive=adaptive)
    fused = emit.function(torch.ops.comera.linear_cross_entropy.default, h, w, head.target, b, *call.op_args())
    loss = emit.function(operator.getitem, fused, 0)
    expected = fake(head.loss)
    if expected.dtype != torch.float32:
        loss = emit.method("to", loss, expected.dtype)
    job = None
    if ctx.options.precompile:
        job = precompile.lce_job(fake(h), fake(w), fake(head.target), fake(b) if b is not None else None,
                                 call.op_args(), needs)
    return loss, job


def _detail(head: _Head, ctx: PassContext, decision: FusedLossDecision) -> str:
    vals, fh = head.values, fake(head.proj.h)
    rows = " > ".join(m for m, _ in head.rows) or "all"
    return (f"{head.pattern}: D={fh.shape[-1]}, V={head.proj.vocab()}, reduction={head.reduction}, "
            f"ignore_index={head.ignore_index}, label_smoothing={head.label_smoothing}, "
            f"softcap={vals.softcap or 'none'}, scale={vals.scale:g}, bias={'yes' if vals.bias is not None else 'no'}, "
            f"rows={rows}, upcast={'yes' if vals.upcast else 'no'}, backward={ctx.options.cce_backward}, "
            f"path={decision.strategy}; {_memory_note(head, decision)}")


def _memory_note(head: _Head, decision: FusedLossDecision) -> str:
    """What fusing saves, for explain: the logits' memory, and the estimated cost when it is slower."""
    note = f"{describe_logits(decision.logits_bytes, _projection_dtype(head))} avoided"
    if decision.slowdown > 1.0:
        note += f", for an estimated {decision.slowdown:.2f}x the unfused loss's time"
    return note


def _check_no_write(head: _Head, ctx: PassContext) -> None:
    """Decline when a node between the projection and the loss writes into what the fused op reads
    there (the hidden states, the weight, the bias, an index tensor of the row ops), or into a view or
    alias of it: eager formed the logits from the values before the write. In training, where the op
    saves what it reads for its backward, a write after the loss declines it too: eager's projection
    may have saved none of it (a frozen head saves only its weight), and the backward would refuse."""
    read = [head.proj.h, head.proj.weight, head.proj.bias, head.values.bias]
    read += [n for _, args in head.rows for n in M.graph_values(args)]
    hit = M.first_write(M.nodes_between(head.proj.node, head.loss), read)
    if hit is not None:
        raise Declined(f"{M.describe_write(*hit)} (read by the projection {M.describe(head.proj.node)}, or a view "
                       "of what it reads) before the loss: eager formed the logits before that write, the fused op "
                       "would read after it")
    if not ctx.training or not any(getattr(fake(t), "requires_grad", False) for t in read if t is not None):
        return
    hit = M.first_write(M.nodes_between(head.loss, head.loss.graph.output_node()), read)
    if hit is not None:
        raise Declined(f"{M.describe_write(*hit)} (read by the projection {M.describe(head.proj.node)}, or a view "
                       "of what it reads) after the loss: the fused op saves what it reads for its backward, "
                       "which would then refuse the written value")


def _rewrite(gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> bool:
    """Match, check and commit one candidate loss; records the rewrite or the reason it was left alone."""
    emit = _Emitter(gm.graph, node)
    where = module_name(node)
    try:
        head = _match(node)
        if head is None:
            return False
        where = module_name(head.proj.node) or where
        _check_no_write(head, ctx)
        options = _options(head, ctx)
        decision = _decide(head, ctx, options)
        if not decision.pays:
            raise Declined(decision.reason)
        loss, job = _build(emit, head, ctx, options, decision)
        checked_replace(node, loss, erase=head.chain)
    except (Declined, RewriteRejected) as reason:
        emit.discard()
        ctx.skip(KIND, str(reason), where)
        return False
    ctx.rewrite(KIND, where, _detail(head, ctx, decision))
    if job is not None:  # the op's kernels compile in another process while Inductor compiles
        precompile.schedule(job)
    return True


def cce_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite every LM-head + cross-entropy in ``gm`` into one fused op; returns the count."""
    losses = M.CROSS_ENTROPY | M.NLL_LOSS | M.LINEAR_CROSS_ENTROPY
    candidates = [n for n in gm.graph.nodes if M.is_call(n, losses)]
    return sum(_rewrite(gm, node, ctx) for node in candidates if node.graph is not None)

