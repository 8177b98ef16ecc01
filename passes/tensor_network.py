"""Rewrite tensor-train layers into tensor-network nodes that never form the dense weight.

A tensorized layer's weight is one ``comera.tt_materialize(cores, gates, ...)`` call (see
``comera_compile.tensorize``), so the Dynamo graph shows

    linear(x, tt_materialize(cores, gates, fmt, rows, cols, transpose=True), bias)
    embedding(idx, tt_materialize(cores, gates, fmt, rows, cols, transpose=False))

which become ``comera.tt_linear(x, cores, gates, bias, ...)`` and ``comera.tt_embedding(idx, ...)``.
Their contraction orders (forward and backward) come from :mod:`comera_compile.planner`; the plan
chosen for the traced token count is printed in ``explain``.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from comera_compile.fx_utils import RewriteRejected, checked_replace, fake, module_name
from comera_compile.pass_manager import REGISTRY, PassContext
from comera_compile.planner import size_hint

NAME = "tensor_network"
_LINEAR = {torch._C._nn.linear, F.linear}
_EMBEDDING = {F.embedding, torch.embedding}


def _materialize_targets() -> set:
    import comera_compile.kernels.tt_materialize  # noqa: F401  (defines the op)

    packet = torch.ops.comera.tt_materialize
    return {packet, packet.default}


def _meta(node: fx.Node):
    cores, gates, fmt, row_modes, col_modes, rows, cols, transpose = node.args
    return list(cores), list(gates), fmt, list(row_modes), list(col_modes), int(rows), int(cols), bool(transpose)


def _plan_text(kind: str, n_tokens, cores, fmt, row_modes, col_modes, dtype, on_gpu: bool) -> str:
    from comera_compile.planner import core_ranks, plan_tt_embedding, plan_tt_linear, token_bucket

    ranks = core_ranks(fmt, [fake(c).shape for c in cores])
    n = token_bucket(size_hint(n_tokens))
    nbytes = torch.empty((), dtype=dtype).element_size()
    if kind == "tt_linear":
        plan = plan_tt_linear(fmt, row_modes, col_modes, ranks, n, nbytes, fused=on_gpu)
    else:
        plan = plan_tt_embedding(fmt, row_modes, col_modes, ranks, n, nbytes)
    return plan.describe()


def _commit(kind: str, node: fx.Node, new: fx.Node, w: fx.Node, ctx: PassContext, summary: str,
            n_tokens, dtype: torch.dtype, on_gpu: bool) -> bool:
    """Check and commit ``new`` in place of ``node``; record the rewrite with its plan, or the skip."""
    cores, _, fmt, row_modes, col_modes, *_ = _meta(w)
    where = module_name(node)
    try:
        checked_replace(node, new, erase=[w])
    except RewriteRejected as exc:
        ctx.skip(kind, str(exc), where)
        return False
    shared = " (the dense weight is still formed for its other users)" if w.graph is not None and w.users else ""
    ctx.rewrite(kind, where, f"{summary}, {len(cores)} cores{shared}\n" + _plan_text(
        kind, n_tokens, cores, fmt, row_modes, col_modes, dtype, on_gpu))
    return True


def _rewrite_linear(gm: fx.GraphModule, node: fx.Node, w: fx.Node, ctx: PassContext) -> bool:
    cores, gates, fmt, row_modes, col_modes, rows, cols, transpose = _meta(w)
    where = module_name(node)
    if not transpose:
        ctx.skip("tt_linear", "the TT weight is used untransposed by linear (a tied embedding used as a "
                 "head); tt_linear computes x @ M, not x @ M.T", where)
        return False
    x = node.args[0]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    out_dtype = fake(node).dtype
    with gm.graph.inserting_before(node):
        if fake(x).dtype != out_dtype:  # autocast: the dense linear ran in out_dtype
            x = gm.graph.call_method("to", (x, out_dtype))
        if bias is not None and fake(bias).dtype != out_dtype:
            bias = gm.graph.call_method("to", (bias, out_dtype))
        new = gm.graph.call_function(torch.ops.comera.tt_linear.default,
                                     (x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols))
    fx_ = fake(node.args[0])
    n_tokens = math.prod(fx_.shape[:-1]) if fx_.dim() > 1 else 1
    return _commit("tt_linear", node, new, w, ctx, f"{fmt} {rows}->{cols}", n_tokens, out_dtype,
                   fx_.device.type == "cuda")


def _rewrite_embedding(gm: fx.GraphModule, node: fx.Node, w: fx.Node, ctx: PassContext) -> bool:
    cores, gates, fmt, row_modes, col_modes, rows, cols, transpose = _meta(w)
    where = module_name(node)
    args = list(node.args) + [None] * (7 - len(node.args))
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    opts = {n: node.kwargs.get(n, a) for n, a in zip(names, args)}
    if transpose:
        ctx.skip("tt_embedding", "the TT weight is materialized transposed", where)
        return False
    if opts["padding_idx"] is not None:
        ctx.skip("tt_embedding", f"padding_idx={opts['padding_idx']} (its zero-gradient row has no TT "
                 "equivalent)", where)
        return False
    if opts["max_norm"] is not None or opts["scale_grad_by_freq"] or opts["sparse"]:
        ctx.skip("tt_embedding", "max_norm / scale_grad_by_freq / sparse are not supported", where)
        return False
    idx = opts["input"]
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.comera.tt_embedding.default,
                                     (idx, cores, gates, fmt, row_modes, col_modes, rows, cols))
    return _commit("tt_embedding", node, new, w, ctx, f"{fmt} {rows}x{cols}", math.prod(fake(idx).shape),
                   fake(node).dtype, False)


def tensor_network_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Replace linear/embedding of a ``tt_materialize`` weight by ``tt_linear``/``tt_embedding``."""
    import comera_compile.kernels.tt_embedding  # noqa: F401  (define the ops)
    import comera_compile.kernels.tt_linear  # noqa: F401

    materialize = _materialize_targets()
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        is_linear, is_embedding = node.target in _LINEAR, node.target in _EMBEDDING
        if not (is_linear or is_embedding):
            continue
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if not (isinstance(w, fx.Node) and w.op == "call_function" and w.target in materialize):
            continue
        done = _rewrite_linear(gm, node, w, ctx) if is_linear else _rewrite_embedding(gm, node, w, ctx)
        count += int(done)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in materialize:
            users = ", ".join(u.name for u in node.users)
            ctx.skip("tensor_network", f"tt_materialize still forms a dense weight for: {users}",
                     module_name(node))
    return count


REGISTRY.register(NAME, tensor_network_pass, builtin=True)
