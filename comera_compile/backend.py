"""The ``comera`` backend: rewrite the Dynamo graph with our passes, then hand it to an inner compiler.

``torch.compile(model, backend="comera", options={...})`` finds this function through the
``torch_dynamo_backends`` entry point (or the guarded fallback registration in ``__init__``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from comera_compile._logging import logger
from comera_compile._scope import scoped
from comera_compile.fx_utils import iter_graph_modules
from comera_compile.options import CompileOptions, OptionsError
from comera_compile.pass_manager import PassContext, enabled_pass_names, run_passes
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
    start = time.perf_counter()
    nodes = _node_count(gm)
    logger.info("comera: compiling graph %d (%d nodes): passes %s, then %s", index, nodes,
                ", ".join(enabled_pass_names(opts)) or "none", opts.inner)
    n = run_passes(gm, ctx)
    passes_s = time.perf_counter() - start
    logger.info("graph %d: %d rewrite(s), %d candidate(s) left alone; inner compiler %s",
                index, n, len(report.skipped), opts.inner)
    if opts.cudagraphs is None:
        opts = dataclasses.replace(opts, cudagraphs=ctx.cudagraphs())
        if opts.cudagraphs:
            logger.info("graph %d: CUDA graphs on, asked for by the passes (%s; options={'cudagraphs': "
                        "False} turns them off)", index, "; ".join(ctx.cudagraph_requests))
    report.cudagraphs = bool(opts.cudagraphs and _cuda_available())
    settings = {**ctx.inductor_config, **opts.inductor_config}  # the user's inductor_config wins
    if opts.inner == "inductor":
        report.inductor_config = settings
    if collector is not None:
        report.after = _readable(gm)
        report.gm = gm
        collector.graph_reports.append(report)
    hits_before = _aot_cache_hits()
    compiled = compile_inner(gm, example_inputs, opts, settings, graph=index)
    total_s = time.perf_counter() - start
    lazy = ""
    if _aot_cache_hits() > hits_before:
        lazy = " (forward and backward loaded from the AOTAutograd cache)"
    elif ctx.training and opts.inner != "eager" and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        lazy = " (its backward compiles at the first backward)"
    logger.info("comera: graph %d compiled in %.1f s (passes %.2f s)%s", index, total_s, passes_s, lazy,
                extra={"comera_timing": {"graph": index, "nodes": nodes, "passes_s": passes_s,
                                         "compile_s": total_s}})
    return compiled


def _aot_cache_hits() -> int:
    """How many graphs AOTAutograd has loaded from its cache in this process (a hit brings the compiled
    backward with it, so no backward compile follows)."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


def _node_count(gm: fx.GraphModule) -> int:
    """Nodes of the graph and its higher-order-op subgraphs."""
    return sum(len(sub.graph.nodes) for _, sub in iter_graph_modules(gm))


def _timed_backward(inner_compile: Callable, index: int) -> Callable:
    """``inner_compile`` that logs how long the backward graph took (AOTAutograd compiles it at the
    first backward, after the backend has returned)."""

    def compile_logged(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            return inner_compile(*args, **kwargs)
        start = time.perf_counter()
        logger.info("comera: compiling graph %d's backward", index)
        compiled = inner_compile(*args, **kwargs)
        seconds = time.perf_counter() - start
        logger.info("comera: graph %d's backward compiled in %.1f s", index, seconds,
                    extra={"comera_timing": {"graph": index, "backward_s": seconds}})
        return compiled

    return compile_logged


def _torch_cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the backend asks of the machine: ``cuda_available()``, whether CUDA graphs can be used
    (default: ``torch.cuda.is_available()``, asked at each compile). Swap one in for a block with
    :func:`use_platform`."""

    cuda_available: Callable[[], bool] = _torch_cuda_available


_PLATFORM: contextvars.ContextVar[Platform] = contextvars.ContextVar("comera_platform", default=Platform())


@contextlib.contextmanager
def use_platform(platform: Platform) -> Iterator[Platform]:
    """Within the block, graphs this thread compiles ask ``platform`` (e.g. ``Platform(cuda_available=lambda:
    True)`` to see what a GPU machine would hand Inductor); on exit the previous one is back."""
    with scoped(_PLATFORM, platform):
        yield platform


def _cuda_available() -> bool:
    return _PLATFORM.get().cuda_available()


def compile_inner(gm: fx.GraphModule, example_inputs: list[Any], opts: CompileOptions,
                  settings: dict[str, Any] | None = None, graph: int | None = None) -> Callable:
    """Hand the rewritten graph to the inner compiler; ``settings``: the Inductor config patches (those
    the passes asked for, with the user's ``inductor_config`` over them); ``graph``: the index the log
    names."""
    from torch._dynamo.backends.registry import lookup_backend

    cudagraphs = opts.cudagraphs and _cuda_available()
    if opts.cudagraphs and not cudagraphs:
        logger.info("cudagraphs requested but CUDA is not available: running without CUDA graphs")
    if opts.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from comera_compile.cache import inductor_config_patches

        patches = dict(settings or {})
        if cudagraphs:
            patches["triton.cudagraphs"] = True
        if opts.max_autotune:
            patches.setdefault("max_autotune", True)
        inner_compile = compile_fx_inner if graph is None else _timed_backward(compile_fx_inner, graph)
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches=inductor_config_patches(patches, gm))
    if cudagraphs:
        # aot_eager / eager + CUDA graphs: Dynamo's AOT-autograd cudagraphs backend.
        return lookup_backend("cudagraphs")(gm, example_inputs)
    if opts.inner == "aot_eager":
        return lookup_backend("aot_eager")(gm, example_inputs)
    return gm.forward
