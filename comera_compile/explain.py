"""``explain``: capture a model with the comera backend, run it once, and report every rewrite."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from comera_compile import matching
from comera_compile.fx_utils import iter_graph_modules, logits_source
from comera_compile.options import CompileOptions
from comera_compile.report import Report, SkipRecord, collecting

_LOSSES = {F.cross_entropy, F.nll_loss}


def _options_of_compiled(model: Any) -> Any:
    """The ``options=`` a model was compiled with: ``torch.compile(m, backend="comera", options=...)``,
    or in place by ``m.compile(...)`` / :func:`comera_compile.hf.compile`."""
    context = getattr(model, "dynamo_ctx", None) or _in_place_context(model)
    callback = getattr(context, "callback", None)
    for _ in range(4):  # unwrap Dynamo's callback wrappers down to torch's _TorchCompileWrapper
        if callback is None:
            break
        kwargs = getattr(callback, "kwargs", None)
        if isinstance(kwargs, dict):
            return kwargs.get("options")
        callback = getattr(callback, "_torchdynamo_orig_backend", None) or getattr(callback, "compiler_fn", None)
    return None


def _in_place_context(model: Any) -> Any:
    """The Dynamo context of ``nn.Module.compile``'s ``_compiled_call_impl`` (held in its closure)."""
    function = getattr(model, "_compiled_call_impl", None) if isinstance(model, nn.Module) else None
    function = inspect.unwrap(function) if callable(function) else function  # cc.hf.compile's config scope
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch._dynamo.eval_frame._TorchDynamoContext):
            return value
    return None


def explain(model: Any, *example_args: Any, options: Any = None, **example_kwargs: Any) -> Report:
    """Compile ``model`` with the comera backend, run it once on the example inputs, and report.

    ``model`` may be a module, a function, or a model already compiled by ``torch.compile`` or in
    place (``model.compile(...)``, :func:`comera_compile.hf.compile`); a compiled model's comera
    options are reused unless ``options=`` is given. The run happens in the caller's grad mode, so
    call it under ``torch.no_grad()`` to see the inference rewrite.

    Returns a :class:`~comera_compile.report.Report`: ``print(report)`` shows, per graph, every rewrite
    applied and every candidate left alone with the reason; ``report.show(graphs=True)`` also prints
    the graph before and after the passes. ``report.rewrites``, ``report.skipped`` and
    ``report.graphs`` hold the same as data, and ``report.output`` the model's output.
    """
    from comera_compile.backend import compile_graph

    target = model
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        target = model._orig_mod
    if options is None:
        options = _options_of_compiled(model)
    opts = CompileOptions.from_user(options)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_graph(gm, example_inputs, opts)

    report = Report()
    compiled = torch.compile(target, backend=backend)
    # A module compiled in place would run its own compiled call inside this one (and answer from
    # that call's cache): explain traces the module's plain call instead, for this run only.
    in_place = target.__dict__.get("_compiled_call_impl") if isinstance(target, nn.Module) else None
    try:
        if in_place is not None:
            target._compiled_call_impl = None
        with collecting(report):
            report.output = compiled(*example_args, **example_kwargs)
    finally:
        if in_place is not None:
            target._compiled_call_impl = in_place
    _use_user_names(report, _wrapper_prefix(target))
    _note_separated_losses(report)
    return report


def _wrapper_prefix(model: Any) -> str:
    """The names wrappers put in front of the user's module names: ``0.`` of an ``nn.Sequential``
    holding only the model, ``module.`` of DDP / DataParallel (``_orig_mod`` is dropped everywhere)."""
    prefix = ""
    while isinstance(model, nn.Module):
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, nn.Sequential) and len(model) == 1:
            prefix, model = prefix + "0.", model[0]
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            prefix, model = prefix + "module.", model.module
        else:
            break
    return prefix


def _use_user_names(report: Report, prefix: str) -> None:
    if not prefix:
        return
    for record in report.rewrites + report.skipped:
        if record.module is not None and (record.module + ".").startswith(prefix):
            record.module = record.module[len(prefix):] or None


def _note_separated_losses(report: Report) -> None:
    """A cross-entropy whose logits are an input of its graph cannot be fused with the projection
    that made them; say so, and say which graph breaks the run saw."""
    for graph in report.graph_reports:
        if graph.gm is None:
            continue
        for _, gm in iter_graph_modules(graph.gm):
            for node in gm.graph.nodes:
                if node.op != "call_function" or node.target not in _LOSSES:
                    continue
                bound = matching.bind(node)
                logits = bound["input"] if bound is not None else None
                if isinstance(logits, fx.Node):
                    source = logits_source(logits)
                    if source.op == "placeholder":
                        graph.skipped.append(SkipRecord("graph break", _separated_reason(
                            source, graph.index, report.graph_breaks), None, graph.index))


def _separated_reason(source: fx.Node, index: int, breaks: list[str]) -> str:
    where = (f"the loss's logits enter graph {index} as its input {source.target!r}, so the loss is not in the "
             "graph of the projection that made them and cannot be fused with it")
    if breaks:
        return where + f"; graph break(s) in this run: {' | '.join(breaks)} (TORCH_LOGS=graph_breaks shows where)"
    return where + "; no graph break was recorded, so the compiled function itself takes the logits as an argument"
