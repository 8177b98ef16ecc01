"""The pass manager: an ordered registry of graph passes, run with rollback on failure.

A pass is ``fn(gm, ctx) -> int`` (the number of rewrites it made). Built-in passes run in their
declared order; user passes are placed with ``before=``/``after=``. The manager runs each enabled
pass on the root graph and on every nested higher-order-op subgraph. A pass that raises is rolled
back (every graph as it was before that pass), logged and warned about (``warnings.warn``, so test
suites and notebooks see it), or re-raised under ``strict=True``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from comera_compile._logging import logger
from comera_compile.fx_utils import iter_graph_modules
from comera_compile.options import CompileOptions, OptionsError
from comera_compile.report import GraphReport, RewriteRecord, SkipRecord

PassFn = Callable[[fx.GraphModule, "PassContext"], int]


@dataclass
class PassContext:
    """What a pass sees besides the graph."""

    options: CompileOptions
    training: bool
    report: GraphReport
    example_inputs: list[Any] = field(default_factory=list)
    pass_name: str = ""
    subgraph: str = ""
    #: Inductor settings the passes ask for (see :meth:`request_inductor_config`).
    inductor_config: dict[str, Any] = field(default_factory=dict)
    #: Why passes asked for CUDA graphs (see :meth:`request_cudagraphs`).
    cudagraph_requests: list[str] = field(default_factory=list)

    def rewrite(self, kind: str, module: str | None, detail: str = "") -> None:
        """Record a rewrite for ``explain``."""
        self.report.rewrites.append(RewriteRecord(kind, module, detail, self.report.index))
        logger.info("rewrite [%s] %s: %s", kind, module, detail)

    def request_cudagraphs(self, reason: str) -> None:
        """Ask for CUDA graphs for this graph, saying why (e.g. a pass lowered layers into many small
        kernels, which make a step launch-bound without them). The ``cudagraphs`` option, when set,
        wins."""
        self.cudagraph_requests.append(reason)

    def cudagraphs(self) -> bool:
        """Whether the graph is meant to run under CUDA graphs: the ``cudagraphs`` option when set,
        else (``None``) on for a GPU graph for which a pass asked (:meth:`request_cudagraphs`; the
        tensor-network pass does when it lowers tensor-train layers). Passes after the one that
        asked see the final answer; the backend asks once all passes ran."""
        if self.options.cudagraphs is not None:
            return bool(self.options.cudagraphs)
        on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in self.example_inputs)
        return bool(on_gpu and self.cudagraph_requests)

    def request_inductor_config(self, key: str, value: Any) -> None:
        """Ask for an Inductor setting that the rewritten graph needs (e.g. how many inputs one
        pointwise concatenation may take). The user's ``inductor_config`` option wins; of two passes
        asking for the same key, the larger value is kept."""
        old = self.inductor_config.get(key)
        self.inductor_config[key] = value if old is None else max(old, value)

    def skip(self, kind: str, reason: str, module: str | None = None) -> None:
        """Record a candidate left alone, and why."""
        self.report.skipped.append(SkipRecord(kind, reason, module, self.report.index))
        logger.info("left alone [%s] %s: %s", kind, module, reason)


@dataclass
class RegisteredPass:
    name: str
    fn: PassFn
    builtin: bool
    enabled_by_default: bool = True


class PassRegistry:
    """Passes by name, in running order."""

    def __init__(self) -> None:
        self._passes: list[RegisteredPass] = []

    def names(self) -> list[str]:
        return [p.name for p in self._passes]

    def get(self, name: str) -> RegisteredPass:
        for p in self._passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass named {name!r}; registered passes: {self.names()}")

    def register(self, name: str, fn: PassFn, *, before: str | None = None, after: str | None = None,
                 builtin: bool = False, enabled: bool = True, replace: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a pass name must be a non-empty string; got {name!r}")
        if not callable(fn):
            raise TypeError(f"pass {name!r}: expected a callable (gm, ctx) -> int, got {type(fn).__name__}")
        if before is not None and after is not None:
            raise ValueError(f"pass {name!r}: give before= or after=, not both")
        if name in self.names():
            if not replace:
                raise ValueError(f"a pass named {name!r} is already registered; "
                                 f"pass replace=True to redefine it, or unregister_pass({name!r})")
            self.unregister(name)
        anchor = before or after
        if anchor is not None and anchor not in self.names():
            raise ValueError(f"pass {name!r}: {'before' if before else 'after'}={anchor!r} names no "
                             f"registered pass; registered passes: {self.names()}")
        entry = RegisteredPass(name, fn, builtin, enabled)
        if anchor is None:
            self._passes.append(entry)
        else:
            index = self.names().index(anchor) + (1 if after else 0)
            self._passes.insert(index, entry)

    def unregister(self, name: str) -> None:
        self._passes.remove(self.get(name))

    def enabled(self, options: CompileOptions) -> list[RegisteredPass]:
        unknown = sorted(set(options.passes) - set(self.names()))
        if unknown:
            raise OptionsError(f"option 'passes' names unknown pass(es) {unknown}; "
                               f"registered passes: {self.names()}")
        return [p for p in self._passes if options.pass_enabled(p.name, p.enabled_by_default)]


REGISTRY = PassRegistry()
_builtins_loaded = False


def load_builtin_passes() -> None:
    """Register the built-in passes (``comera_compile.passes.builtin.BUILTIN_PASSES``, in running order) once."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from comera_compile.passes.builtin import BUILTIN_PASSES

        for name, fn in BUILTIN_PASSES:
            REGISTRY.register(name, fn, builtin=True)


def register_pass(name: str, *, before: str | None = None, after: str | None = None,
                  enabled: bool = True, replace: bool = False) -> Callable[[PassFn], PassFn]:
    """Decorator registering a user pass ``fn(gm, ctx) -> int`` under ``name``.

    ``before``/``after`` name an already registered pass (built-in: see :func:`list_passes`).
    ``enabled=False`` registers it switched off (``options={"passes": {name: True}}`` turns it on).
    """
    load_builtin_passes()

    def decorate(fn: PassFn) -> PassFn:
        REGISTRY.register(name, fn, before=before, after=after, enabled=enabled, replace=replace)
        return fn

    return decorate


def unregister_pass(name: str) -> None:
    load_builtin_passes()
    REGISTRY.unregister(name)


def list_passes() -> list[str]:
    """Names of all registered passes, in running order."""
    load_builtin_passes()
    return REGISTRY.names()


def validated_options(options: Any, mode: str | None = None) -> CompileOptions:
    """``options`` validated into :class:`CompileOptions`, its pass names checked against the
    registered passes: what ``cc.compile`` and ``cc.hf.compile`` check before anything is traced."""
    opts = CompileOptions.from_user(options, mode)
    enabled_pass_names(opts)
    return opts


def enabled_pass_names(options: CompileOptions) -> list[str]:
    """The passes ``options`` runs, in running order."""
    load_builtin_passes()
    return [p.name for p in REGISTRY.enabled(options)]


def _snapshot(gm: fx.GraphModule) -> dict[str, fx.Graph]:
    """A copy of every graph (root and subgraphs), meta shallow-copied."""
    snap = {}
    for path, sub in iter_graph_modules(gm):
        graph = fx.Graph(tracer_cls=sub.graph._tracer_cls)
        result, output = graph.graph_copy(sub.graph, {}, return_output_node=True)
        graph.output(result).meta = dict(output.meta)
        snap[path] = graph
    return snap


def _restore(gm: fx.GraphModule, snap: dict[str, fx.Graph]) -> None:
    """Put every graph back as it was, keeping the original placeholder nodes.

    Placeholders carry Dynamo state beyond ``meta`` (``_dynamo_source``), so each graph is rebuilt
    around them rather than swapped for the copy.
    """
    for path, sub in list(iter_graph_modules(gm)):
        saved = snap.get(path)
        if saved is None:
            continue
        graph = sub.graph
        for node in reversed(list(graph.nodes)):
            if node.op != "placeholder":
                graph.erase_node(node)
        placeholders = {n.name: n for n in graph.nodes}
        val_map = {n: placeholders[n.name] for n in saved.nodes if n.op == "placeholder"}
        for node in saved.nodes:
            if node.op != "placeholder":
                val_map[node] = graph.node_copy(node, lambda n: val_map[n])
        sub.recompile()


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Run every enabled pass over ``gm`` and its subgraphs; returns the number of rewrites."""
    load_builtin_passes()
    total = 0
    for entry in REGISTRY.enabled(ctx.options):
        snap = _snapshot(gm)
        n_rewrites_before = len(ctx.report.rewrites)
        count = 0
        start = time.perf_counter()
        try:
            for path, sub in list(iter_graph_modules(gm)):
                ctx.pass_name, ctx.subgraph = entry.name, path
                made = entry.fn(sub, ctx)
                if made is None:
                    made = 0
                if not isinstance(made, int):
                    raise TypeError(f"pass {entry.name!r} returned {made!r}; a pass returns the number "
                                    f"of rewrites it made (int)")
                if made:
                    sub.graph.lint()
                    sub.recompile()
                count += made
        except Exception as exc:
            _restore(gm, snap)
            del ctx.report.rewrites[n_rewrites_before:]
            if ctx.options.strict:
                raise
            message = (f"comera: pass {entry.name!r} raised {type(exc).__name__}: {exc}; the graph is left "
                       "as it was before this pass (options={'strict': True} re-raises)")
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            ctx.report.skipped.append(SkipRecord(entry.name, f"pass raised {type(exc).__name__}: {exc}; "
                                                 "rolled back", None, ctx.report.index))
            ctx.report.passes_run.append((entry.name, 0))
            continue
        # A custom pass that counts rewrites without recording them still shows up in explain.
        recorded = len(ctx.report.rewrites) - n_rewrites_before
        for _ in range(max(0, count - recorded)):
            ctx.rewrite(entry.name, None, "")
        ctx.report.passes_run.append((entry.name, count))
        logger.debug("pass %s: %d rewrite(s) in %.1f ms", entry.name, count,
                     1e3 * (time.perf_counter() - start))
        total += count
    ctx.pass_name = ctx.subgraph = ""
    return total
