"""Lower tensor-train layers into batched merges and GEMMs that Inductor compiles with the rest.

A tensorized layer's weight is one ``comera.tt_materialize(core_flat, gate_flat, ...)`` call (see
``comera_compile.tensorize``), so the Dynamo graph shows one of

    linear(x, tt_materialize(..., transpose=True), bias)     nn.Linear            x @ M
    linear(x, tt_materialize(..., transpose=False), bias)    a tied TT head       x @ Mᵀ
    addmm(bias, x, tt_materialize(..., transpose=False))     GPT-2's Conv1D       x @ M
    matmul(x, tt_materialize(...)) / x @ ...                                      x @ M or x @ Mᵀ
    embedding(idx, tt_materialize(..., transpose=False))     nn.Embedding         M[idx]

Each site's layer is read back from the marker op as a :class:`~comera_compile.tt.format.TTSpec`
(``TTSpec.from_materialize_node``); the planner (:mod:`comera_compile.tt.planner`) picks a strategy
for the traced token count, and the site is rewritten into calls of
:mod:`comera_compile.kernels.tt_runtime`:

* the token-independent work (gates folded into the cores, the two halves of the chain merged in the
  planned order) of every layer with the same structure, dtype and strategy is **one batched call**
  (:func:`~comera_compile.kernels.tt_runtime.group_outputs` of the spec and the plan's cut, up to
  ``MAX_GROUP`` layers): one batched GEMM per
  merge step for the whole group instead of a few launches per layer;
* the token-sized work is ``linear(project(x, F1), F2, bias)`` (the low-rank ``"factored"`` path: the
  second factor stays a plain ``linear``, so a TT LM head is then fused with its loss by the ``cce``
  pass, over the rank-sized activations), the original ``linear``/``embedding``/``addmm`` with the
  group's dense weight (``"dense"``), or a gathered-table ``lookup`` (``"tables"``);
* a block tensor-train Linear whose plan forms its weight is a ``"dense"`` site like the others: the
  weights of the btt layers of one structure are formed by one batched product;
* sites with nothing to share (:data:`ALONE`) read their flat cores where they are: a TT-matrix whose
  plan contracts the tokens through its cores (``"contract"``), a block tensor-train on its two batched
  block GEMMs (``"blocks"``; btt layers that read the same input with the same row blocks, rank and
  column block size, such as Q, K and V, as one wider layer: their cores concatenated), and a btt
  embedding with its table formed in the graph (``"btt_dense"``).

Every argument of a matched node is checked; anything else is left alone with its reason in
``explain``. The rewritten graph never forms a weight the plan does not call for.

What is shared keeps eager's numbers and gradients: a batched call reads what its members read (input,
cores, bias) where the first of them is, so a member joins only if nothing writes into those in between
(by any op: ``torch._foreach_*``, an ``autograd.Function`` marking its input dirty, an op whose writes are
unknown); frozen layers share nothing with trainable ones (a frozen layer's site would save its input
for a gradient eager never computes); and a layer whose output no gradient reaches shares nothing (the
batched backward would give its cores zeros where eager gives none).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from comera_compile import matching as M
from comera_compile.fx_utils import (
    Declined,
    RewriteRejected,
    check_eager_dtypes,
    checked_replace,
    erase_unused,
    fake,
    fake_call,
    inherit_source_meta,
    module_name,
    size_hint,
)
from comera_compile.kernels import tt_materialize as _tt_materialize_op  # noqa: F401 (defines the op)
from comera_compile.kernels import tt_group_merge  # defines comera::tt_group_merge (group_outputs_opaque)
from comera_compile.kernels import tt_runtime
from comera_compile.tt.format import TTSpec
from comera_compile.tt.planner import TTPlan, contraction_path, plan_btt_linear, plan_embedding, plan_linear

if TYPE_CHECKING:  # the pass manager runs the passes; they only name its context type
    from comera_compile.pass_manager import PassContext

NAME = "tensor_network"
MAX_GROUP = 32  # layers merged by one batched call (Inductor stacks their cores in one pointwise kernel)
# Sites whose token-sized work reads the flat cores directly (no token-independent merge to share), each
# rewritten on its own: a TT-matrix contracted through its cores, a btt layer's blocks, a btt embedding's
# table.
ALONE = ("contract", "blocks", "btt_dense")


@dataclasses.dataclass
class _Site:
    node: fx.Node  # the consumer of the TT weight
    w: fx.Node  # the tt_materialize node
    spec: TTSpec  # the layer, as the tt_materialize node describes it
    kind: str  # "tt_linear" | "tt_embedding"
    x: Any  # activations or indices
    bias: Any = None
    x_times_m: bool = True  # y = x @ M (nn.Linear, Conv1D); False: y = x @ Mᵀ (a tied head)
    padding_idx: int | None = None
    plan: TTPlan | None = None
    output: tt_runtime.Output | str | None = None  # or one of ALONE: a site rewritten on its own
    pin_note: str = ""  # why the tt_strategy option did not apply at this site
    frozen: bool = False  # the layer's weight needs no gradient (its cores are frozen, or no_grad)
    dead: bool = False  # the weight needs a gradient, but none reaches the site's output

    @property
    def flats(self) -> tuple[fx.Node, fx.Node]:
        """The layer's flat cores and gates (the marker op's two tensors)."""
        return self.w.args[0], self.w.args[1]


def _materialize_targets() -> set:
    packet = torch.ops.comera.tt_materialize
    return {packet, packet.default}


def _spec(w: fx.Node) -> TTSpec:
    """The layer a ``tt_materialize`` node materializes (a call that does not describe one is declined)."""
    try:
        return TTSpec.from_materialize_node(w)
    except (TypeError, ValueError) as exc:
        raise Declined(f"{M.describe(w)} does not describe a TT layer: {exc}") from None


def _is_tt(value: Any, materialize: set) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and value.target in materialize


def _match(node: fx.Node, materialize: set) -> _Site | None:
    """The TT site at ``node``, or None when ``node`` does not consume a TT weight (raises Declined
    for a TT consumer that cannot be rewritten exactly: every argument is checked)."""
    if node.op not in ("call_function", "call_method") or not any(
            _is_tt(v, materialize) for v in list(node.args) + list(node.kwargs.values())):
        return None  # (a TT weight's other users keep the dense weight: reported at the end)
    call = M.bind(node)
    if call is None:
        return None
    if M.is_call(node, M.LINEAR) and _is_tt(call["weight"], materialize):
        _understood(call, "input", "weight", "bias")
        w, spec = call["weight"], _spec(call["weight"])
        return _Site(node, w, spec, "tt_linear", call["input"], call["bias"], x_times_m=spec.transpose)
    if M.is_call(node, M.ADDMM) and _is_tt(call["mat2"], materialize):
        _understood(call, "input", "mat1", "mat2")
        w, spec = call["mat2"], _spec(call["mat2"])
        return _Site(node, w, spec, "tt_linear", call["mat1"], call["input"], x_times_m=not spec.transpose)
    if M.is_call(node, M.MATMUL) and _is_tt(call["other" if "other" in call else "mat2"], materialize):
        second = "other" if "other" in call else "mat2"
        _understood(call, "input", second)
        w, spec = call[second], _spec(call[second])
        return _Site(node, w, spec, "tt_linear", call["input"], None, x_times_m=not spec.transpose)
    if M.is_call(node, M.EMBEDDING) and node.target is F.embedding and _is_tt(call["weight"], materialize):
        _understood(call, "input", "weight", "padding_idx")
        w = call["weight"]
        return _Site(node, w, _spec(w), "tt_embedding", call["input"], padding_idx=call["padding_idx"])
    raise Declined(f"{M.describe(node)} takes the TT weight in a way the lowering does not handle "
                   "(e.g. as its first operand, or through torch.embedding's raw op)")


def _understood(call: M.Bound, *names: str) -> None:
    """Decline a call with an argument the lowering does not reproduce (max_norm=, alpha=, out=, ...)."""
    problem = call.blocking(*names)
    if problem is not None:
        raise Declined(f"{M.describe(call.node)}: {problem} is not supported with a tensor-train weight")


def _check_shapes(site: _Site) -> None:
    spec = site.spec
    rows, cols = spec.rows, spec.cols
    if spec.n_cores < 2:
        raise Declined("a single core is its own dense matrix: nothing to contract")
    fx_, fw = fake(site.x), fake(site.w)
    if not isinstance(fx_, torch.Tensor) or not isinstance(fw, torch.Tensor):
        raise Declined("no fake value for the input or the weight")
    if site.kind == "tt_embedding":
        if spec.transpose:
            raise Declined("the TT weight reaches embedding transposed")
        if fx_.dtype not in (torch.int32, torch.int64):
            raise Declined(f"indices of dtype {fx_.dtype}")
        if site.padding_idx is not None and not isinstance(site.padding_idx, int):
            raise Declined("padding_idx is a traced value, not a constant")
        return
    in_features = rows if site.x_times_m else cols
    if fx_.dim() < 1 or not fx_.is_floating_point() or fx_.shape[-1] != in_features:
        raise Declined(f"the input {tuple(fx_.shape)} is not a floating-point tensor with {in_features} features")
    if M.call_name(site.node) in ("addmm", "mm") and fx_.dim() != 2:
        raise Declined(f"{M.call_name(site.node)} of a {fx_.dim()}-D input")
    if site.bias is not None:
        fb = fake(site.bias)
        out_features = cols if site.x_times_m else rows
        if not isinstance(fb, torch.Tensor) or tuple(fb.shape) != (out_features,):
            raise Declined(f"bias of shape {tuple(getattr(fb, 'shape', ()))}; expected ({out_features},)")
    check_eager_dtypes(site.node, [site.x, site.w, site.bias])


def _check_no_write(site: _Site, graph_writes: list[tuple[fx.Node, fx.Node]]) -> None:
    """Decline a site whose flat cores or gates are written in place anywhere in the graph: the
    lowering forms the weight (or its factors) in one batched call before the group's first site,
    not where eager materialized it, so a write in between would change what it reads."""
    hit = M.first_alias(graph_writes, list(site.flats))
    if hit is not None:
        raise Declined(f"{M.describe_write(*hit)} (the layer's cores or gates): "
                       "the lowering reads them in one batched call ahead of the layer, eager where it "
                       "materialized the weight")


def _needs_grad(node: Any) -> bool:
    """Whether the value of ``node`` (a tensor, or any tensor of a tuple) needs a gradient."""
    leaves = torch.utils._pytree.tree_leaves(fake(node))
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def _reached_by_gradients(graph: fx.Graph, graph_writes: list[tuple[fx.Node, fx.Node]]) -> set[fx.Node]:
    """The nodes a gradient can reach from the graph's outputs: back from them along inputs that need
    a gradient (a ``detach``, a ``no_grad`` region, an integer result stop it), and from a value that
    one reaches to what a write put into it (``h.add_(k(x))``, also through a view of the value)."""
    reached: set[fx.Node] = set()
    memories: set[Any] = set()  # the memory of the reached values: a write into a view of one reaches it
    pending = [(writer, value, M.memory_of(value)) for writer, value in graph_writes]
    stack = [n for n in graph.output_node().all_input_nodes if _needs_grad(n)]
    while stack:
        while stack:
            node = stack.pop()
            if node not in reached:
                reached.add(node)
                memories.add(M.memory_of(node))
                stack.extend(n for n in node.all_input_nodes if _needs_grad(n))
        hit = [p for p in pending if p[1] in reached or (p[2] is not None and p[2] in memories)]
        pending = [p for p in pending if p not in hit]
        stack = [n for writer, _, _ in hit for n in writer.all_input_nodes if _needs_grad(n)]
    return reached


def _mark_gradients(sites: list[_Site], graph: fx.Graph, graph_writes: list[tuple[fx.Node, fx.Node]]) -> None:
    """Set each site's ``frozen`` (its weight needs no gradient) and ``dead`` (it needs one, but no
    gradient reaches the site's output: unused, or used only through values that need none)."""
    reached = _reached_by_gradients(graph, graph_writes) if sites else set()
    for site in sites:
        site.frozen = not _needs_grad(site.w)
        site.dead = not site.frozen and site.node not in reached


def _check_factored_bias(site: _Site, graph_writes: list[tuple[fx.Node, fx.Node]]) -> None:
    """Decline a factored site (``linear(x @ F1, F2, bias)``) whose bias is written in place in the graph:
    on that form torch's AOTAutograd (2.13) saves the bias and recomputes the bias add in the backward
    after the write, so the gradients of what multiplies the layer's output come out wrong (the site
    as written compiles right)."""
    if site.output not in ("factors", "factors_t") or site.bias is None:
        return
    hit = M.first_alias(graph_writes, [site.bias])
    if hit is not None:
        raise Declined(f"{M.describe_write(*hit)} (the layer's bias): the factored form would let AOTAutograd "
                       "recompute the bias add in the backward from the written bias (wrong gradients); left "
                       "as it is")


def _plan(site: _Site, ctx: PassContext) -> None:
    out = fake(site.node)
    nbytes = out.element_size()
    cudagraphs = ctx.options.cudagraphs if ctx.options.cudagraphs is not None else out.is_cuda  # auto: on
    pin = None if ctx.options.tt_strategy == "auto" else ctx.options.tt_strategy
    if site.spec.fmt == "btt" and site.kind == "tt_embedding":
        site.output = "btt_dense"  # the table formed in the graph (one batched GEMM), then the lookup
        if pin not in (None, "dense"):
            site.pin_note = f"tt_strategy={pin!r} does not apply here (a btt embedding forms its table)"
        return
    if site.kind == "tt_embedding":
        n = size_hint(fake(site.x).numel())
        site.plan = plan_embedding(site.spec, max(n, 1), nbytes, cudagraphs=cudagraphs, strategy=pin)
        site.output = "tables" if site.plan.strategy == "tables" else "dense"
    else:
        fx_ = fake(site.x)
        n = 1
        for s in fx_.shape[:-1]:
            n *= size_hint(s)
        if site.spec.fmt == "btt":
            site.plan = plan_btt_linear(site.spec, max(n, 1), nbytes, cudagraphs=cudagraphs, strategy=pin)
            # the weight formed in the graph, batched with the other btt layers of the structure
            site.output = "blocks" if site.plan.strategy == "blocks" else ("dense_t" if site.spec.transpose
                                                                           else "dense")
        else:
            site.plan = plan_linear(site.spec, max(n, 1), nbytes, cudagraphs=cudagraphs, strategy=pin)
            if site.plan.strategy == "contract":
                site.output = "contract"
            elif site.plan.strategy == "factored":
                site.output = "factors" if site.x_times_m else "factors_t"
            else:
                site.output = "dense_t" if site.spec.transpose else "dense"
    if pin is not None and site.plan.strategy != pin:
        names = ", ".join(k for k, _ in site.plan.candidates)
        site.pin_note = f"tt_strategy={pin!r} does not apply here (candidates: {names}); the planner chose"


@dataclasses.dataclass
class _Group:
    key: tuple
    anchor: fx.Node
    members: list[fx.Node]  # tt_materialize nodes, one slot each
    sites: list[_Site]
    parts: list[list[fx.Node]] = dataclasses.field(default_factory=list)
    call: fx.Node | None = None


def _group_key(site: _Site) -> tuple:
    """Layers share a batched merge when they have one structure, plan and dtype, and all of them need
    their gradients or none does: a frozen layer's weight formed with trainable ones would need a
    gradient, and its site would then save its input (which eager does not, and which a later write
    may change). A layer whose output no gradient reaches is merged alone (with its own other uses):
    a batched backward would give its cores zeros where eager gives none."""
    spec, core_flat = site.spec, site.flats[0]
    return (spec.fmt, spec.row_modes, spec.col_modes, spec.ranks, spec.rows, spec.cols, site.output, site.plan.cut,
            fake(site.node).dtype, fake(core_flat).dtype, str(fake(core_flat).device), site.frozen,
            site.w if site.dead else None)


def _groups(sites: list[_Site], graph: fx.Graph) -> list[_Group]:
    """Sites with the same key share one batched call, placed before the first of them; a member joins
    only if its flat cores and gates exist by then (graph inputs always do)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: list[_Group] = []
    for site in sorted(sites, key=lambda s: order[s.node]):
        key = _group_key(site)
        inputs = site.w.all_input_nodes
        home = None
        for g in groups:
            if g.key == key and (site.w in g.members or len(g.members) < MAX_GROUP) and all(
                    order[i] < order[g.anchor] for i in inputs):
                home = g
                break
        if home is None:
            home = _Group(key, site.node, [], [])
            groups.append(home)
        if site.w not in home.members:
            home.members.append(site.w)
        home.sites.append(site)
    return groups


def _opaque_merges(choice: str, g: _Group) -> bool:
    """Whether group ``g``'s merges are one opaque op (option ``tt_merges``). "auto": for "tt" groups,
    whose merges end in rank-sized factors or tables, and for embedding groups, whose merges form a
    table once per step that only a gather reads (left to Inductor, an embedding's many-axis
    permutes and their backward's slice-scatters were most of the tensorized model's extra compile
    time); a group of Linears forming dense weights is left to Inductor, which fuses the weight's
    elementwise work."""
    site = g.sites[0]
    return choice == "opaque" or choice == "auto" and (site.spec.fmt == "tt" or site.kind == "tt_embedding")


def _emit_group(graph: fx.Graph, g: _Group, opaque: bool = False) -> None:
    site = g.sites[0]
    core_flats = [w.args[0] for w in g.members]
    gate_flats = [w.args[1] for w in g.members]
    dtype = fake(site.node).dtype
    merge = tt_group_merge.group_outputs_opaque if opaque else tt_runtime.group_outputs
    with graph.inserting_before(g.anchor):
        call = graph.call_function(merge, (
            core_flats, gate_flats, site.spec, site.plan.cut, site.output, dtype))
        # the merges' fake value from their cached layout (running them under the fake mode costs ~50 ops)
        call.meta["example_value"] = fake_call(merge if opaque else tt_runtime.group_outputs_like, call.args, call.kwargs)
        g.call = call
        per = 2 if site.output in ("factors", "factors_t", "tables") else 1
        outs = fake(call)
        for k in range(len(g.members)):
            items = []
            for j in range(per):
                item = graph.call_function(operator.getitem, (call, k * per + j))
                item.meta["example_value"] = outs[k * per + j]
                items.append(item)
            g.parts.append(items)
    inherit_source_meta([call], g.anchor)


def _cast(graph: fx.Graph, value: Any, dtype: torch.dtype) -> Any:
    """``value.to(dtype)`` when it is a tensor of another dtype (autocast's own cast, made explicit)."""
    if isinstance(value, fx.Node) and fake(value) is not None and fake(value).dtype != dtype:
        return graph.call_method("to", (value, dtype))
    return value


def _refresh(site: _Site, materialize: set) -> None:
    """Re-read the site's input and bias where an earlier rewrite replaced the nodes they were (a
    replaced node is no input of the site any more; checking that is cheap, re-matching is not, and
    every site is refreshed once per other site)."""
    inputs = site.node.all_input_nodes
    if all(v is None or v in inputs for v in (site.x, site.bias)):
        return
    fresh = _match(site.node, materialize)
    site.x, site.bias = fresh.x, fresh.bias


def _parts(g: _Group, site: _Site) -> list[fx.Node]:
    return g.parts[g.members.index(site.w)]


def _rewrite_shared_input(graph: fx.Graph, sites: list[tuple[_Group, _Site]]) -> None:
    """Factored sites that read the same activations (Q, K and V; gate and up projections): one GEMM
    ``x @ [F1_a | F1_b | ...]`` for all their first factors, then each site's own ``linear``. The
    backward then also forms dx and the F1 gradients in one GEMM each."""
    first = sites[0][1].node
    dtype = fake(first).dtype
    f1s = [_parts(g, s)[0] for g, s in sites]
    widths = [fake(f).shape[-1] for f in f1s]
    with graph.inserting_before(first):
        stacked = graph.call_function(torch.cat, (f1s, 1))
        t = graph.call_function(tt_runtime.project, (sites[0][1].x, stacked, dtype))
        pieces = graph.call_function(torch.split, (t, widths, -1))
    for i, (g, site) in enumerate(sites):
        with graph.inserting_before(site.node):
            ti = graph.call_function(operator.getitem, (pieces, i))
            new = graph.call_function(F.linear, (ti, _parts(g, site)[1], _cast(graph, site.bias, dtype)))
        checked_replace(site.node, new, erase=[site.w])


def _rewrite_site(graph: fx.Graph, g: _Group, site: _Site, materialize: set) -> None:
    _refresh(site, materialize)
    parts = _parts(g, site)
    node = site.node
    dtype = fake(node).dtype
    with graph.inserting_before(node):
        if site.output in ("dense", "dense_t"):  # the same call, with the group's weight in the site's dtype
            new = _with_weight(graph, site, parts[0], dtype)
        elif site.output == "tables":
            new = graph.call_function(tt_runtime.lookup, (site.x, parts[0], parts[1], site.spec.rows,
                                                          site.spec.cols, site.padding_idx))
        else:
            t = graph.call_function(tt_runtime.project, (site.x, parts[0], dtype))
            new = graph.call_function(F.linear, (t, parts[1], _cast(graph, site.bias, dtype)))
    checked_replace(node, new, erase=[site.w])


def _rewrite_alone(graph: fx.Graph, site: _Site, materialize: set) -> None:
    """A site of :data:`ALONE`, read straight from the layer's flat cores and gates where the site is:
    ``"contract"``: :func:`~comera_compile.kernels.tt_runtime.ttm_contract`; ``"blocks"``:
    :func:`~comera_compile.kernels.tt_runtime.btt_linear` (neither forms the weight); ``"btt_dense"`` (a
    btt embedding): the site's own call with the table from :func:`~comera_compile.kernels.tt_runtime.btt_weight`, in
    the site's dtype (plain ops Inductor compiles, in place of the opaque marker op)."""
    _refresh(site, materialize)
    node = site.node
    dtype = fake(node).dtype
    core_flat, gate_flat = site.flats
    with graph.inserting_before(node):
        if site.output == "contract":
            s = site.spec
            chain = s if site.x_times_m else TTSpec(s.fmt, s.col_modes, s.row_modes, s.ranks, s.cols, s.rows)
            equation, path = contraction_path(chain, site.plan.n_tokens)
            new = graph.call_function(tt_runtime.ttm_contract, (site.x, core_flat, gate_flat, s, site.x_times_m,
                                                                site.bias, dtype, equation, path))
        elif site.output == "blocks":
            new = graph.call_function(tt_runtime.btt_linear, (site.x, core_flat, gate_flat, site.spec, site.x_times_m,
                                                              site.bias, dtype))
        else:
            weight_dtype = dtype if site.kind == "tt_linear" else fake(site.w).dtype
            w = graph.call_function(tt_runtime.btt_weight, (core_flat, gate_flat, site.spec, weight_dtype))
            new = _with_weight(graph, site, w, dtype)
    checked_replace(node, new, erase=[site.w])


def _with_weight(graph: fx.Graph, site: _Site, weight: fx.Node, dtype: torch.dtype) -> fx.Node:
    """The site's own call (linear / addmm / matmul / embedding) with ``weight`` in place of the marker
    op's, a linear's input and bias cast to the site's compute ``dtype`` (autocast's casts, explicit)."""
    swap = {site.w: weight}
    if site.kind == "tt_linear":
        swap[site.x] = _cast(graph, site.x, dtype)
        if site.bias is not None:
            swap[site.bias] = _cast(graph, site.bias, dtype)
    new = graph.node_copy(site.node, lambda n: swap.get(n, n))
    new.meta.pop("example_value", None)
    new.meta.pop("val", None)
    return new


def _detail_alone(site: _Site) -> str:
    return _with_pin_note(site, _describe_alone(site))


def _with_pin_note(site: _Site, text: str) -> str:
    notes = [site.pin_note] * bool(site.pin_note)
    if site.dead:
        notes.append("no gradient reaches its output: rewritten outside the batched calls, so that its cores "
                     "get none, as in eager")
    if not notes:
        return text
    head, sep, rest = text.partition("\n")
    return f"{head}; {'; '.join(notes)}{sep}{rest}"


def _shape(site: _Site) -> str:
    """How explain names the site's map: ``rows x cols`` (embedding), ``in->out`` or ``in->out (x @ Mᵀ)``."""
    s = site.spec
    if site.kind == "tt_embedding":
        return f"{s.rows}x{s.cols}"
    return f"{s.rows}->{s.cols}" if site.x_times_m else f"{s.cols}->{s.rows} (x @ Mᵀ)"


def _describe_alone(site: _Site) -> str:
    s = site.spec
    shape = _shape(site)
    if site.output == "contract":
        return (f"{s.fmt} {shape}, {s.n_cores} cores: {site.plan.summary()} (the tokens contracted through the "
                f"cores; the weight never formed)\n{site.plan.describe()}")
    if site.kind == "tt_embedding":
        return (f"btt {shape}, blocks {s.describe()} at rank {s.ranks[1]}: the table formed in the graph "
                f"({2 * s.ranks[1] * s.padded_rows * s.padded_cols:,} FLOPs, one batched GEMM), then the lookup")
    how = "" if site.output == "blocks" else " (the weight formed in the graph, then a dense GEMM)"
    return (f"btt {shape}, blocks {s.describe()} at rank {s.ranks[1]}: {site.plan.summary()}{how}\n"
            f"{site.plan.describe()}")


def _shared_input(site: _Site, sites: list[_Site], done: set[int], home: dict, order: dict[fx.Node, int],
                  materialize: set) -> list[_Site]:
    """``site`` and the other factored sites not yet rewritten that read the same input in the same
    dtype and whose first factors exist before the earliest of them (in graph order: ``order``
    numbers the sites' nodes and their groups' outputs). A site whose output no gradient reaches
    joins none: the shared GEMM's backward would give its first factor a zero gradient."""
    if site.output not in ("factors", "factors_t") or site.dead:
        return [site]
    _refresh(site, materialize)
    dtype = fake(site.node).dtype
    batch = [site]
    for other in sites:
        if other is site or id(other) in done or other.output not in ("factors", "factors_t") or other.dead:
            continue
        _refresh(other, materialize)
        if other.x is site.x and fake(other.node).dtype == dtype:
            batch.append(other)
    if len(batch) == 1:
        return batch
    batch.sort(key=lambda s: order[s.node])
    first = order[batch[0].node]
    if not all(order[_parts(home[id(s)], s)[0]] < first for s in batch):
        return [site]
    # The shared GEMM reads x before the first site; eager reads it at each one. Stop the batch at the
    # first site that a write into x (or a view of it) separates from the first.
    for k in range(1, len(batch)):
        if M.first_write(M.nodes_between(batch[0].node, batch[k].node), [site.x]) is not None:
            return batch[:k] if site in batch[:k] else [site]
    return batch


def _blocks_key(site: _Site) -> tuple:
    s = site.spec
    return (s.row_modes, s.rows, s.ranks, s.col_modes[1], fake(site.node).dtype, fake(site.flats[0]).dtype)


def _blocks_batch(site: _Site, sites: list[_Site], done: set[int], order: dict[fx.Node, int],
                  materialize: set, graph_writes: list[tuple[fx.Node, fx.Node]]) -> list[_Site]:
    """``site`` and the other btt sites on the blocks path, not yet rewritten, that read the same input
    (``x @ M``) with the same row blocks, rank and column block size, in graph order: one
    :func:`~comera_compile.kernels.tt_runtime.btt_linear_shared` call placed before the first of them.
    A site joins only if its flat cores, gates and bias exist by then, no write into ``x``, its bias, cores
    or gates separates it from the first (the call reads them all there), nothing writes into its output
    (the outputs are views of one buffer), and a gradient reaches its output (else the shared backward
    would give its cores zeros where eager gives none)."""
    if site.output != "blocks" or not site.x_times_m or site.dead:
        return [site]
    _refresh(site, materialize)
    key = _blocks_key(site)
    batch = [site]
    for other in sites:
        if other is site or id(other) in done or other.output != "blocks" or not other.x_times_m or other.dead:
            continue
        _refresh(other, materialize)
        if other.x is site.x and _blocks_key(other) == key:
            batch.append(other)
    if len(batch) == 1:
        return batch
    batch.sort(key=lambda s: order[s.node])
    first = batch[0].node
    kept = [batch[0]]
    for other in batch[1:]:
        inputs = [n for n in other.flats + (other.bias,) if isinstance(n, fx.Node)]
        if any(order.get(n, -1) >= order[first] for n in inputs):
            continue
        between = M.writes(M.nodes_between(first, other.node))
        if M.first_alias(between, [site.x]) is not None:
            break
        if M.first_alias(between, inputs) is not None:  # its bias (or cores) as eager reads them at the site
            continue
        kept.append(other)
    # the pass's one scan of the graph's writes (a write before a site cannot reach its new output)
    kept = [s for s in kept if M.first_alias(graph_writes, [s.node]) is None]
    return kept if site in kept and len(kept) > 1 else [site]


def _rewrite_blocks_shared(graph: fx.Graph, sites: list[_Site]) -> None:
    """Rewrite ``sites`` (a :func:`_blocks_batch`) as one ``btt_linear_shared`` call and its outputs."""
    first = sites[0]
    dtype = fake(first.node).dtype
    with graph.inserting_before(first.node):
        call = graph.call_function(tt_runtime.btt_linear_shared, (
            first.x, [s.flats[0] for s in sites], [s.flats[1] for s in sites], [s.spec for s in sites],
            [s.bias for s in sites], dtype))
    for k, site in enumerate(sites):
        with graph.inserting_before(site.node):
            new = graph.call_function(operator.getitem, (call, k))
        checked_replace(site.node, new, erase=[site.w])


def _detail(site: _Site, group: _Group) -> str:
    fmt, shape = site.spec.fmt, _shape(site)
    share = f"; token-independent merges batched with {len(group.members) - 1} other layer(s)" \
        if len(group.members) > 1 else ""
    if group.call is not None and group.call.target is tt_group_merge.group_outputs_opaque:
        share += " (the merges one opaque op: tt_merges='opaque', or 'auto' for a 'tt' group)"
    if site.spec.fmt == "btt":  # described as the btt sites of ALONE are, plus the batching
        head, sep, rest = _describe_alone(site).partition("\n")
        return _with_pin_note(site, f"{head}{share}{sep}{rest}")
    return _with_pin_note(site, f"{fmt} {shape}, {site.spec.n_cores} cores: {site.plan.summary()}{share}\n"
                                f"{site.plan.describe()}")


def tensor_network_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Lower every TT site of ``gm`` (see the module doc); returns the number of sites rewritten."""
    materialize = _materialize_targets()
    graph = gm.graph
    sites: list[_Site] = []
    graph_writes = M.writes(graph.nodes)  # once: every site checks its cores against them
    for node in list(graph.nodes):
        try:
            site = _match(node, materialize)
            if site is None:
                continue
            _check_shapes(site)
            _check_no_write(site, graph_writes)
            _plan(site, ctx)
            _check_factored_bias(site, graph_writes)
        except Declined as reason:
            ctx.skip(NAME, str(reason), module_name(node))
            continue
        sites.append(site)
    _mark_gradients(sites, graph, graph_writes)
    count = 0
    alone = [s for s in sites if s.output in ALONE]
    order = {n: i for i, n in enumerate(graph.nodes)}
    done: set[int] = set()
    for site in alone:
        if id(site) in done:
            continue
        batch = _blocks_batch(site, alone, done, order, materialize, graph_writes)
        where = module_name(site.node)
        try:
            if len(batch) > 1:
                _rewrite_blocks_shared(graph, batch)
            else:
                _rewrite_alone(graph, site, materialize)
        except RewriteRejected as exc:
            ctx.skip(site.kind, str(exc), where)
            done.update(id(s) for s in batch)
            continue
        for s in batch:
            done.add(id(s))
            shared = f"; one batched call with {len(batch) - 1} other layer(s) reading the same input (their " \
                     "cores concatenated along the column blocks)" if len(batch) > 1 else ""
            ctx.rewrite(s.kind, module_name(s.node) if s.node.graph is not None else where,
                        _detail_alone(s).replace("\n", shared + "\n", 1))
            count += 1
    sites = [s for s in sites if s.output not in ALONE]
    groups = _groups(sites, graph)
    if groups:  # a group stacks up to MAX_GROUP layers' cores: one pointwise kernel, not one copy each
        ctx.request_inductor_config("max_pointwise_cat_inputs", MAX_GROUP)
    for g in groups:
        _emit_group(graph, g, _opaque_merges(ctx.options.tt_merges, g))
    order = {n: i for i, n in enumerate(graph.nodes)}  # inserting nodes keeps the others' order
    home = {id(site): g for g in groups for site in g.sites}
    done: set[int] = set()
    for site in sorted(sites, key=lambda s: order[s.node]):
        if id(site) in done:
            continue
        batch = _shared_input(site, sites, done, home, order, materialize)
        where = module_name(site.node)
        try:
            if len(batch) > 1:
                _rewrite_shared_input(graph, [(home[id(s)], s) for s in batch])
            else:
                _rewrite_site(graph, home[id(site)], site, materialize)
        except RewriteRejected as exc:
            ctx.skip(site.kind, str(exc), where)
            done.update(id(s) for s in batch)
            continue
        for s in batch:
            done.add(id(s))
            shared = f"; first factor computed in one GEMM with {len(batch) - 1} other layer(s) reading the same " \
                     "input" if len(batch) > 1 else ""
            ctx.rewrite(s.kind, module_name(s.node) if s.node.graph is not None else where,
                        _detail(s, home[id(s)]).replace("\n", shared + "\n", 1))
            count += 1
    for g in groups:
        erase_unused([n for items in g.parts for n in items] + [g.call])
    for node in graph.nodes:
        if node.op == "call_function" and node.target in materialize:
            users = ", ".join(u.name for u in node.users)
            ctx.skip(NAME, f"tt_materialize still forms a dense weight for: {users}", module_name(node))
    if count:
        # The token path of a tensor-train layer is a chain of small GEMMs joined by transposes: many
        # pointwise kernels, for each of which Inductor would time six configurations at its first call.
        ctx.request_inductor_config("triton.autotune_pointwise", False)
        ctx.request_cudagraphs(f"{count} tensor-train site(s): many small kernels per step")
    return count

