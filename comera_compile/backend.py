"""The ``comera`` backend: rewrite the Dynamo graph with our passes, then hand it to an inner compiler.

``torch.compile(model, backend="comera", options={...})`` finds this function through the
``torch_dynamo_backends`` entry point (or the guarded fallback registration in ``__init__``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx

from comera_compile._logging import logger
from comera_compile.optimizer_check import watch_optimizers
from comera_compile.options import CompileOptions, OptionsError
from comera_compile.pass_manager import PassContext, run_passes
from comera_compile.report import GraphReport, active_report

_graph_counter = 0


def _readable(gm: fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except TypeError:  # older signatures
        return gm.print_readable(print_output=False)


def comera_backend(gm: fx.GraphModule, example_inputs: list[Any], options: Any = None,
                   mode: str | None = None, **unexpected: Any) -> Callable:
    """Dynamo backend entry point. See :class:`comera_compile.CompileOptions` for ``options``."""
    if unexpected:
        raise OptionsError(f"the comera backend got unexpected argument(s) {sorted(unexpected)}; "
                           "it takes options= (a dict of CompileOptions keys) or mode=")
    opts = CompileOptions.from_user(options, mode)
    watch_optimizers()  # warns at the first step of an optimizer built before tensorize_
    return compile_graph(gm, example_inputs, opts)


def compile_graph(gm: fx.GraphModule, example_inputs: list[Any], opts: CompileOptions) -> Callable:
    """Run the passes over ``gm`` with validated options, record the graph's report, hand it to the
    inner compiler (what the backend and ``explain`` do with each Dynamo graph)."""
    global _graph_counter
    collector = active_report()
    index = len(collector.graph_reports) if collector is not None else _graph_counter
    _graph_counter += 1
    report = GraphReport(index=index)
    if collector is not None:
        report.before = _readable(gm)
    ctx = PassContext(options=opts, training=torch.is_grad_enabled(), report=report,
                      example_inputs=list(example_inputs))
    n = run_passes(gm, ctx)
    logger.info("graph %d: %d rewrite(s), %d candidate(s) left alone; inner compiler %s",
                index, n, len(report.skipped), opts.inner)
    if opts.cudagraphs is None:
        opts = dataclasses.replace(opts, cudagraphs=ctx.cudagraphs())
        if opts.cudagraphs:
            logger.info("graph %d: CUDA graphs on for its %d tensor-train site(s) (options={'cudagraphs': "
                        "False} turns them off)", index, ctx.tt_sites())
    report.cudagraphs = bool(opts.cudagraphs and _cuda_available())
    if collector is not None:
        report.after = _readable(gm)
        report.gm = gm
        collector.graph_reports.append(report)
    return compile_inner(gm, example_inputs, opts, ctx.inductor_config)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def compile_inner(gm: fx.GraphModule, example_inputs: list[Any], opts: CompileOptions,
                  requested: dict[str, Any] | None = None) -> Callable:
    """Hand the rewritten graph to the inner compiler; ``requested`` are the Inductor settings the
    passes asked for (the user's ``inductor_config`` wins)."""
    from torch._dynamo.backends.registry import lookup_backend

    cudagraphs = opts.cudagraphs and _cuda_available()
    if opts.cudagraphs and not cudagraphs:
        logger.info("cudagraphs requested but CUDA is not available: running without CUDA graphs")
    if opts.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from comera_compile.cache import inductor_config_patches

        patches = {**(requested or {}), **opts.inductor_config}
        if cudagraphs:
            patches["triton.cudagraphs"] = True
        if opts.max_autotune:
            patches.setdefault("max_autotune", True)
        return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(patches))
    if cudagraphs:
        # aot_eager / eager + CUDA graphs: Dynamo's AOT-autograd cudagraphs backend.
        return lookup_backend("cudagraphs")(gm, example_inputs)
    if opts.inner == "aot_eager":
        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward
