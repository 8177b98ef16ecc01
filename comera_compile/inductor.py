"""The comera passes inside plain ``torch.compile`` (Inductor, the default backend).

``cc.use_with_inductor(options)`` installs the passes as Inductor's pre-grad custom pass
(``torch._inductor.config.pre_grad_custom_pass``), so that ``torch.compile(model)`` with the default
backend, and every framework that compiles that way (torchtitan, accelerate, transformers'
``Trainer(torch_compile=True)``), gets the rewrites of ``backend="comera"``::

    with cc.use_with_inductor({"cce_min_vocab": 0}) as passes:   # for a block
        loss = torch.compile(model)(x, y)
    print(passes.report)                                           # what was rewritten, per graph

    passes = cc.use_with_inductor()                                # or for the rest of the process
    ...
    passes.close()                                                 # or cc.use_with_inductor.off()

How torch 2.13 calls the hook: ``compile_fx`` hands Dynamo's torch-level graph to AOTAutograd, whose
``aot_module_simplified`` runs the pre-grad passes (``_recursive_pre_grad_passes``: each
higher-order-op subgraph first, then the root) before it traces the joint graph. A pass with a
``uuid()`` runs "late": after the AOTAutograd cache lookup, on a miss only, and its ``uuid()`` enters
the AOTAutograd and FX graph cache keys. Ours hashes the package's sources (with torch's version),
the validated options and the enabled passes in running order (a registered pass of your own by its
name, its qualified name and its code object), so a change to any of them misses the caches.

torch 2.11 calls it earlier: ``compile_fx`` runs the pre-grad passes itself, before it calls
AOTAutograd, so on every compile (a cache hit included, where the pass runs and records its rewrites),
and the AOTAutograd and FX graph caches key the graph the passes rewrote; 2.11 keys no
``pre_grad_custom_pass`` (no ``uuid()`` is asked). The options reach that graph (the fused ops take
them as arguments), so different options still never share an entry there.

What differs from ``backend="comera"`` is listed in docs/guide.md ("Plain torch.compile (Inductor)
and frameworks"): settings that a pass asks for (CUDA graphs, Inductor config) cannot change a
compile that is already under way, and a graph served from a warm cache runs no pass and records
nothing (torch 2.13; on torch 2.11 the pass runs and records before the cache lookup, see above).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import marshal
import threading
import time
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from comera_compile._logging import logger
from comera_compile.options import CompileOptions, OptionsError
from comera_compile.pass_manager import REGISTRY, PassContext, enabled_pass_names, load_builtin_passes, \
    run_passes, validated_options
from comera_compile.report import GraphReport, Report, active_report

__all__ = ["InductorPasses", "use_with_inductor"]

_HOOK = "pre_grad_custom_pass"
_lock = threading.RLock()
_open: list["InductorPasses"] = []  # handles that installed the pass and are not closed, oldest first


def _config():
    from torch._inductor import config

    return config


class PassChain(CustomGraphPass):
    """Pre-grad passes run one after the other, as one (torch 2.13 also takes a list there; older
    torch, e.g. 2.11, takes a single pass): what ``use_with_inductor`` installs beside a pre-grad pass
    that was there before it. Keyed on every pass's ``uuid()``; ``None`` (uncacheable, as Inductor
    treats such a pass) when one has none."""

    def __init__(self, passes: tuple[Any, ...]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        uuids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes)
        return None if any(u is None for u in uuids) else ("comera_compile.PassChain", uuids)


def _passes_in(value: Any) -> tuple[Any, ...]:
    """The passes an Inductor custom-pass setting holds: none, one, a list or tuple, or our chain."""
    if value is None:
        return ()
    if isinstance(value, PassChain):
        return value.passes
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _setting_of(passes: list[Any]) -> Any:
    return None if not passes else passes[0] if len(passes) == 1 else PassChain(tuple(passes))


def _config_value(config: Any, key: str) -> Any:
    try:
        return getattr(config, key)
    except AttributeError:  # a key this torch does not know
        return None


def _readable(gm: fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    except TypeError:  # older signatures
        return gm.print_readable(print_output=False)


def _code_digest(fn: Any) -> str:
    """A digest of a pass's code: its code object (bytecode, constants, names, file and lines)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    if code is None:
        return "no-code"
    try:
        return hashlib.sha256(marshal.dumps(code)).hexdigest()[:16]
    except ValueError:  # a code object marshal cannot write
        return hashlib.sha256(repr(code).encode()).hexdigest()[:16]


def _options_key(opts: CompileOptions) -> str:
    return json.dumps(dataclasses.asdict(opts), sort_keys=True, default=repr)


def _passes_key(opts: CompileOptions) -> str:
    """The enabled passes in running order; a pass of the user's also by its code (the package's own
    are covered by the source fingerprint)."""
    load_builtin_passes()
    parts = []
    for entry in REGISTRY.enabled(opts):
        fn = entry.fn
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        parts.append([entry.name, name, "builtin" if entry.builtin else _code_digest(fn)])
    return json.dumps(parts)


def pass_uuid(opts: CompileOptions) -> str:
    """The cache key part of the pre-grad pass run with ``opts``: the package's sources (passes and
    kernels included) and torch's version, the options, the enabled passes, and the environment settings
    read while tracing (``cache.TRACE_ENV``)."""
    from comera_compile.cache import source_fingerprint, trace_settings

    digest = hashlib.sha256()
    for part in (source_fingerprint(), _options_key(opts), _passes_key(opts), trace_settings()):
        digest.update(part.encode())
        digest.update(b"\0")
    return "comera_compile-pre-grad-" + digest.hexdigest()


def _compiled_by_comera_backend() -> bool:
    """Whether the compile under way is the comera backend's own (``backend="comera"`` or ``explain``
    inside a ``use_with_inductor`` block): its graph has been through the passes already. The backend
    hands Inductor its ``SourceKeyedPass`` as ``post_grad_custom_post_pass``, which ``compile_fx``
    has applied by the time the pre-grad passes run."""
    from comera_compile.cache import SourceKeyedPass

    return any(isinstance(p, SourceKeyedPass)
               for p in _passes_in(_config().post_grad_custom_post_pass))


def _is_dynamo_root(gm: fx.GraphModule) -> bool:
    """Dynamo's graph (not one of its higher-order-op subgraphs, which Inductor hands the hook first
    and ``run_passes`` reaches from the root)."""
    return "dynamo_compile_id" in gm.meta or "dynamo_flat_name_to_original_fqn" in gm.meta


class ComeraPreGradPass(CustomGraphPass):
    """Inductor's pre-grad custom pass that runs the comera passes over Dynamo's graph."""

    def __init__(self, options: CompileOptions, report: Report) -> None:
        self.options = options
        self.report = report
        self._warned: set[str] = set()  # each warning once per installed pass

    def uuid(self) -> str:
        return pass_uuid(self.options)

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not isinstance(gm, fx.GraphModule) or not _is_dynamo_root(gm):
            return  # a subgraph (its root's run reaches it) or a graph Dynamo did not make
        if _compiled_by_comera_backend():
            return
        self.run(gm)

    def run(self, gm: fx.GraphModule) -> GraphReport:
        """The passes over ``gm`` and its subgraphs, recorded as the backend records them."""
        opts = self.options
        collector = active_report()
        index = len((collector or self.report).graph_reports)
        report = GraphReport(index=index)
        if collector is not None:
            report.before = _readable(gm)
        example_inputs = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        # the same rule as backend.compile_graph: the grad mode of the call that compiles (Inductor runs
        # this hook in it)
        ctx = PassContext(options=opts, training=torch.is_grad_enabled(), report=report,
                          example_inputs=example_inputs)
        start = time.perf_counter()
        logger.info("comera (Inductor pre-grad pass): graph %d: passes %s", index,
                    ", ".join(enabled_pass_names(opts)) or "none")
        n = run_passes(gm, ctx)
        logger.info("graph %d: %d rewrite(s), %d candidate(s) left alone in %.2f s", index, n,
                    len(report.skipped), time.perf_counter() - start)
        self._settings(ctx, report)
        if collector is not None:
            report.after = _readable(gm)
            report.gm = gm
            collector.graph_reports.append(report)
        if collector is not self.report:
            self.report.graph_reports.append(report)
        return report

    def _settings(self, ctx: PassContext, report: GraphReport) -> None:
        """Record the CUDA graphs and Inductor settings this compile runs with, and say which of those
        the passes asked for it cannot have: the compile under way has read its config already."""
        config = _config()
        cuda = torch.cuda.is_available()
        report.cudagraphs = bool(config.triton.cudagraphs and cuda)
        if cuda and ctx.cudagraphs() and not report.cudagraphs:
            reasons = "; ".join(getattr(ctx, "cudagraph_requests", None) or ["the cudagraphs option"])
            self._warn_once("cudagraphs", "comera: graph %d: the passes ask for CUDA graphs (%s), which "
                            "backend='comera' would turn on for this graph; a pre-grad pass cannot turn them "
                            "on for a compile under way: compile with torch.compile(model, "
                            "mode='reduce-overhead'), or pass options={'cudagraphs': True} to "
                            "use_with_inductor", report.index, reasons)
        elif self.options.cudagraphs is False and report.cudagraphs:
            self._warn_once("cudagraphs-off", "comera: graph %d runs under CUDA graphs despite the option "
                            "cudagraphs=False: torch.compile's mode= turned them on for this compile",
                            report.index)
        requested = dict(ctx.inductor_config)
        keys = list(requested) + [k for k in self.options.inductor_config if k not in requested]
        effective = {key: _config_value(config, key) for key in keys}
        missing = {k: v for k, v in requested.items()
                   if k not in self.options.inductor_config and effective[k] != v}
        if missing:
            self._warn_once("settings:" + repr(sorted(missing.items(), key=repr)),
                            "comera: graph %d: the passes ask for Inductor settings %s, which backend='comera' "
                            "sets per graph; a pre-grad pass cannot change them for a compile under way: "
                            "pass use_with_inductor({'inductor_config': %r}) to set them for every compile in "
                            "its scope", report.index, missing, missing)
        # what this compile runs with, for the keys that the passes or the options name
        report.inductor_config = effective

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


class InductorPasses:
    """What :func:`use_with_inductor` returns: the comera passes installed in Inductor until
    :meth:`close` (or the end of its ``with`` block, or ``cc.use_with_inductor.off()``).

    Attributes:
        options: the validated :class:`~comera_compile.CompileOptions`.
        report: a :class:`~comera_compile.Report` of every graph the passes ran on while installed
            (rewrites and candidates left alone, as ``explain`` prints them; the graphs' text and
            modules only when a ``cc.report.collecting()`` block was active, as for the backend).
        active: whether this handle still holds the passes installed.
    """

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self._closed = False
        self._owner = False
        self._pass: ComeraPreGradPass | None = None
        self._installed: Any = None
        self._previous: Any = None
        self._patch: Any = None
        self._dynamo_patch: Any = None

    @property
    def active(self) -> bool:
        """Whether this handle is open and its pass installed."""
        return (not self._closed and self._pass is not None
                and any(p is self._pass for p in _passes_in(getattr(_config(), _HOOK))))

    @property
    def report(self) -> Report:
        assert self._pass is not None
        return self._pass.report

    @property
    def graph_reports(self) -> list[GraphReport]:
        return self.report.graph_reports

    def uuid(self) -> str:
        """The cache-key part of these passes (what Inductor's caches key on)."""
        return pass_uuid(self.options)

    def _install(self) -> "InductorPasses":
        config = _config()
        current = getattr(config, _HOOK)
        present = _passes_in(current)
        ours = [p for p in present if isinstance(p, ComeraPreGradPass)]
        if ours:
            if ours[0].options != self.options:
                raise RuntimeError(
                    "comera: use_with_inductor is already on with other options "
                    f"({_options_key(ours[0].options)}); close it first (its handle's close() or "
                    f"cc.use_with_inductor.off()) before turning it on with {_options_key(self.options)}")
            self._pass = ours[0]  # the same options again: share the installed pass, install nothing
            return self
        self._pass = ComeraPreGradPass(self.options, Report())
        patches = _up_front_settings(self.options)
        try:
            self._patch = config.patch(patches) if patches else None
            if self._patch is not None:
                self._patch.__enter__()
        except AttributeError as exc:  # Inductor's config has no such key
            raise OptionsError(f"option 'inductor_config': {exc}") from exc
        self._dynamo_patch = checkpoint_side_effects_scope()
        if self._dynamo_patch is not None:
            self._dynamo_patch.__enter__()
        self._previous = current
        # another pre-grad pass already installed (yours, a framework's): it runs first, on Dynamo's
        # graph as it would without us, then ours
        self._installed = _setting_of([*present, self._pass])
        if present:
            logger.info("comera: use_with_inductor runs after the pre-grad pass(es) already installed: %s",
                        ", ".join(type(p).__qualname__ for p in present))
        setattr(config, _HOOK, self._installed)
        if not getattr(config, "use_pre_grad_passes", True):
            logger.warning("comera: torch._inductor.config.use_pre_grad_passes is False: Inductor runs no "
                           "pre-grad pass, so use_with_inductor rewrites nothing until it is True")
        self._owner = True
        _open.append(self)
        return self

    def close(self) -> None:
        """Uninstall the passes (a no-op when closed already, or for a handle that shared an
        enclosing one's): ``pre_grad_custom_pass`` and the settings applied up front get their
        previous values back. Graphs compiled meanwhile keep their rewrites."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            if not self._owner:
                return
            config = _config()
            current = getattr(config, _HOOK)
            if current is self._installed:
                setattr(config, _HOOK, self._previous)
            else:  # changed since we installed it: take only our pass out of what is there now
                rest = [p for p in _passes_in(current) if p is not self._pass]
                setattr(config, _HOOK, _setting_of(rest))
                logger.warning("comera: pre_grad_custom_pass changed while use_with_inductor was on; "
                               "only the comera pass was taken out of it")
            if self._patch is not None:
                self._patch.__exit__(None, None, None)
            if self._dynamo_patch is not None:
                self._dynamo_patch.__exit__(None, None, None)
            if self in _open:
                _open.remove(self)

    def __enter__(self) -> "InductorPasses":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "on" if self.active else "off"
        return f"<comera passes in Inductor ({state}), {len(self.graph_reports)} graph(s) run>"


_SKIP_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpoint_side_effects_scope() -> Any:
    """Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` on, for the scope (None on a torch
    without the setting): activation-checkpointed layers that set context variables in their forward
    (transformers' layers under ``gradient_checkpointing``: its hub-kernels layer, output capturing) are
    then traced with the rest, those side effects not replayed in the recompute; without it Dynamo runs
    every such layer eagerly, so no pass sees it (no tensor-train lowering, no fused loss) and nothing
    says so. ``cc.hf.compile`` sets the same for its model's calls."""
    if not hasattr(torch._dynamo.config, _SKIP_SIDE_EFFECTS):
        return None
    return torch._dynamo.config.patch(**{_SKIP_SIDE_EFFECTS: True})


def _up_front_settings(opts: CompileOptions) -> dict[str, Any]:
    """The Inductor settings the options ask for, applied for the whole scope (a pre-grad pass runs
    too late to apply them per graph): CUDA graphs when ``cudagraphs`` is set (``torch.compile``'s
    ``mode=`` still wins: it patches the config inside its compile), max-autotune, and the user's
    ``inductor_config``."""
    patches: dict[str, Any] = {}
    if opts.cudagraphs is not None:
        patches["triton.cudagraphs"] = bool(opts.cudagraphs)
    if opts.max_autotune:
        patches["max_autotune"] = True
    patches.update(opts.inductor_config)
    return patches


def use_with_inductor(options: Any = None) -> InductorPasses:
    """Run the comera passes inside plain ``torch.compile`` (Inductor, the default backend).

    Installs them as Inductor's pre-grad custom pass, now, and returns the handle: use it as a
    context manager (the passes are on in the block) or keep it (on until ``handle.close()`` or
    ``cc.use_with_inductor.off()``)::

        with cc.use_with_inductor({"cce_min_vocab": 0}) as passes:
            trainer.train()            # Trainer(torch_compile=True), accelerate, torchtitan, ...
        print(passes.report)

    ``options`` are the backend's (:class:`~comera_compile.CompileOptions`), validated at once (a bad key
    or value, or an unknown pass name, raises :class:`~comera_compile.OptionsError`); ``inner`` must be
    ``"inductor"``. ``cudagraphs``, ``max_autotune`` and ``inductor_config`` are applied to Inductor's
    config for the whole scope, and Dynamo traces activation-checkpointed layers whose forward sets
    context variables (transformers' ``gradient_checkpointing``) instead of running them eagerly: such a
    side effect is not replayed in the backward's recompute (Dynamo's
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``). Turning it on again with the same options shares the installed pass;
    with other options it raises ``RuntimeError``. A pre-grad pass installed before it keeps running,
    before ours. Only compiles made while it is on are rewritten: a graph compiled before keeps its
    compiled code (``torch._dynamo.reset()`` drops it), and one compiled inside keeps its rewrites after.
    """
    opts = validated_options(options)
    if opts.inner != "inductor":
        raise OptionsError(f"option 'inner' got {opts.inner!r}: use_with_inductor runs the passes inside "
                           "Inductor, so the inner compiler is Inductor; for another one use "
                           "torch.compile(model, backend='comera', options=...)")
    if _HOOK in opts.inductor_config:
        raise OptionsError(f"option 'inductor_config' may not set {_HOOK!r} under use_with_inductor, "
                           "which installs the comera passes there; install your pass before it instead "
                           "(it then runs first)")
    with _lock:
        return InductorPasses(opts)._install()


def off() -> None:
    """Uninstall every pass that :func:`use_with_inductor` installed and that is still on."""
    with _lock:
        for handle in reversed(list(_open)):
            handle.close()


use_with_inductor.off = off  # type: ignore[attr-defined]
