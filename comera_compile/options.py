"""The backend's options: one typed, validated dataclass.

``torch.compile(model, backend="comera", options={...})`` hands the dict to the backend; it is
validated into :class:`CompileOptions` before any pass runs or the inner compiler traces.
``comera_compile.CompileOptions(**d)`` (or :func:`comera_compile.compile`) validates eagerly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CCE_BACKWARD = ("filtered", "exact")
CCE_STRATEGIES = ("auto", "chunked", "sparse", "static", "fused")
CCE_POLICIES = ("memory", "speed")
TT_MERGES = ("auto", "inductor", "opaque")
TT_STRATEGIES = ("auto", "dense", "factored", "contract", "blocks", "tables")
MIB = 1 << 20


class OptionsError(ValueError):
    """A bad option key or value given to the comera backend."""


@dataclass(frozen=True)
class CompileOptions:
    """Options of the ``comera`` backend.

    Attributes:
        inner: the compiler that receives the rewritten graph: ``"inductor"`` (default),
            ``"aot_eager"`` or ``"eager"``.
        passes: switch passes on or off by name, e.g. ``{"cce": False}``. Unnamed passes keep their
            default (built-in and registered passes are on).
        strict: re-raise an error from a pass instead of rolling the pass back with a warning.
        cudagraphs: run the compiled graph under CUDA graphs. ``None`` (default): on for a graph on the
            GPU in which the ``tensor_network`` pass lowered tensor-train layers (their many small kernels
            make a step launch-bound without CUDA graphs), off otherwise. ``True`` / ``False`` force it;
            ``mode="reduce-overhead"`` sets ``True``, ``mode="max-autotune-no-cudagraphs"`` ``False``.
            Under CUDA graphs an output is overwritten by the next call of the same graph: clone what
            you keep across steps (``loss.item()`` or ``loss.detach().clone()``). ``.grad`` tensors are
            allocated inside the captured backward too: set them to ``None`` before each step's first
            backward (``zero_grad()``), or allocate them outside the graph to accumulate.
        max_autotune: Inductor's max-autotune (``mode="max-autotune"`` sets it).
        cce_backward: ``"filtered"`` skips vocabulary blocks whose softmax is below
            ``cce_filter_eps`` in the backward (Cut-Cross-Entropy); ``"exact"`` never skips.
        cce_filter_eps: the filtering threshold; ``None`` picks the kernel default (2**-12).
        cce_deterministic: a backward whose result does not depend on atomics order.
        cce_min_vocab: fuse the LM head only when the vocabulary has at least this many entries.
            ``None`` (default): the fused op's cost rule decides by ``cce_policy`` (small
            vocabularies, e.g. a 3-class classifier head, are left alone); ``0`` fuses every head.
        cce_policy: what the cost rule fuses for. ``"memory"`` (default): every head whose logits
            (tokens x vocabulary x the logits' element size, what the unfused loss holds from the
            forward to the backward) take more than ``cce_memory_threshold``, unless the fused
            loss is estimated more than 1.15x slower than the unfused one; smaller heads when it is
            not slower. ``"speed"``: only heads whose fused loss is not estimated slower. The
            estimates model the device: the Triton paths at an H200's rates on the GPU, the torch
            reference at a CPU's rates on the CPU. ``explain`` states the logits' memory either way.
        cce_memory_threshold: bytes of logits above which the memory policy fuses; default 64 MiB
            (the fused loss's least working memory: smaller logits fit in one chunk of it, so
            fusing them saves nothing).
        cce_memory_budget: bytes of working memory the fused loss may use beyond its inputs and
            gradients; ``None`` (default): 1/16 of the fp32 logits it replaces, at least 64 MiB.
            More memory buys larger chunks (faster); the path is chosen within the budget.
        cce_strategy: the fused loss's path. ``"auto"`` (default): the fastest by the op's cost
            model within the budget; ``"chunked"`` (gradient formed in the forward, exact),
            ``"sparse"`` (filtered rounds; exact with ``cce_backward="exact"``), ``"static"``
            (exact recompute) or ``"fused"`` (small hidden sizes) pin one. A pinned path that
            cannot run in a call (``"sparse"`` under CUDA graphs, ``"chunked"`` with
            ``reduction="none"``) falls back to an exact recompute path.
        tt_merges: how the token-independent merges of the tensor-train layers (the cores of every
            group of same-structure layers merged into factors, weights or tables) are compiled.
            ``"inductor"``: as plain ops that Inductor fuses with the rest. ``"opaque"``: one custom op
            per group forward and one backward (the backward recomputes the merges), which Inductor
            does not compile: fewer generated kernels and a shorter compile (35-40 % on an H200), the
            merges then running unfused; no double backward through them. ``"auto"`` (default):
            opaque for ``"tt"`` groups and for embedding groups of any format, whose training step
            measured the same or faster that way (an embedding's table merges were most of a
            tensorized encoder's extra compile time under Inductor); inductor for ``"ttm"`` and
            ``"btt"`` Linear groups, whose merges form dense weights and whose step measured 3-12 %
            slower opaque.
        tt_strategy: the token-sized path of every tensor-train site. ``"auto"`` (default): the
            planner's cheapest estimate. A pin applies where the site has that candidate (``"dense"``:
            form the weight; ``"factored"``: a ``"tt"`` layer through its bottleneck; ``"contract"``: a
            TT-matrix's tokens through its cores; ``"blocks"``: a block tensor-train's batched block
            GEMMs; ``"tables"``: an embedding's gathered tables); elsewhere the planner chooses and
            ``explain`` says the pin did not apply.
        precompile: on the GPU, compile the fused loss's Triton kernels for the graph's shapes in a
            separate Python process while Inductor compiles the graph (``True``, default), so the first
            step finds them in Triton's cache instead of compiling them (about 3 s at a rank-32 TT
            head's shapes on an H200). The process runs the loss once on random tensors of the same
            shapes, and holds a CUDA context and at most 1 GiB of them for a few seconds; its values
            are not used. ``False``: the kernels compile at their first call.
        inductor_config: extra Inductor config patches, passed through unchanged; they win over the
            settings the backend chooses for a graph with tensor-train layers (one configuration per
            pointwise kernel, ``triton.autotune_pointwise=False``, instead of timing six at each
            kernel's first call; ``max_pointwise_cat_inputs`` raised so that a group's cores stack in
            one kernel).
    """

    inner: str = "inductor"
    passes: Mapping[str, bool] = field(default_factory=dict)
    strict: bool = False
    cudagraphs: bool | None = None
    max_autotune: bool = False
    cce_backward: str = "filtered"
    cce_filter_eps: float | None = None
    cce_deterministic: bool = False
    cce_min_vocab: int | None = None
    cce_policy: str = "memory"
    cce_memory_threshold: int = 64 * MIB
    cce_memory_budget: int | None = None
    cce_strategy: str = "auto"
    tt_merges: str = "auto"
    tt_strategy: str = "auto"
    precompile: bool = True
    inductor_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_choice("cce_backward", self.cce_backward, CCE_BACKWARD)
        _check_choice("cce_strategy", self.cce_strategy, CCE_STRATEGIES)
        _check_choice("cce_policy", self.cce_policy, CCE_POLICIES)
        _check_choice("tt_merges", self.tt_merges, TT_MERGES)
        _check_choice("tt_strategy", self.tt_strategy, TT_STRATEGIES)
        for name in ("strict", "max_autotune", "cce_deterministic", "precompile"):
            _check_type(name, getattr(self, name), bool, "a bool")
        if self.cudagraphs is not None:
            _check_type("cudagraphs", self.cudagraphs, bool, "a bool or None")
        if self.cce_filter_eps is not None:
            _check_type("cce_filter_eps", self.cce_filter_eps, (int, float), "a float or None")
            if not 0.0 <= float(self.cce_filter_eps) < 1.0:
                raise OptionsError(f"option 'cce_filter_eps' must be in [0, 1); got {self.cce_filter_eps!r}")
        if self.cce_min_vocab is not None:
            _check_type("cce_min_vocab", self.cce_min_vocab, int, "an int or None")
            if self.cce_min_vocab < 0:
                raise OptionsError(f"option 'cce_min_vocab' must be >= 0; got {self.cce_min_vocab}")
        _check_type("cce_memory_threshold", self.cce_memory_threshold, int, "a byte count (int)")
        if self.cce_memory_threshold < 0:
            raise OptionsError(f"option 'cce_memory_threshold' must be >= 0 bytes; got {self.cce_memory_threshold}")
        if self.cce_memory_budget is not None:
            _check_type("cce_memory_budget", self.cce_memory_budget, int, "a byte count (int) or None")
            if self.cce_memory_budget < 0:
                raise OptionsError(f"option 'cce_memory_budget' must be >= 0 bytes; got {self.cce_memory_budget}")
        _check_type("passes", self.passes, Mapping, "a dict of pass name -> bool")
        for key, value in self.passes.items():
            if not isinstance(key, str) or not isinstance(value, bool):
                raise OptionsError(
                    f"option 'passes' maps pass names to True/False; got {key!r}: {value!r}"
                )
        _check_type("inductor_config", self.inductor_config, Mapping, "a dict of Inductor config patches")
        object.__setattr__(self, "passes", dict(self.passes))
        object.__setattr__(self, "inductor_config", dict(self.inductor_config))

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | "CompileOptions" | None = None,
                  mode: str | None = None) -> "CompileOptions":
        """Validate what ``torch.compile`` hands the backend (``options=`` or ``mode=``)."""
        if isinstance(options, CompileOptions):
            opts = options
        elif options is None:
            opts = cls()
        elif isinstance(options, Mapping):
            unknown = sorted(set(options) - set(cls.keys()))
            if unknown:
                raise OptionsError(
                    f"unknown comera option(s) {unknown}; valid keys: {cls.keys()}"
                )
            opts = cls(**options)
        else:
            raise OptionsError(f"options must be a dict or CompileOptions; got {type(options).__name__}")
        if mode is None or mode == "default":
            return opts
        _check_choice("mode", mode, MODES)
        cudagraphs = opts.cudagraphs
        if mode in ("reduce-overhead", "max-autotune"):
            cudagraphs = True
        elif mode == "max-autotune-no-cudagraphs" and cudagraphs is None:
            cudagraphs = False
        return dataclasses.replace(opts, cudagraphs=cudagraphs,
                                   max_autotune=opts.max_autotune or mode.startswith("max-autotune"))

    def pass_enabled(self, name: str, default: bool = True) -> bool:
        return self.passes.get(name, default)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionsError(f"option {name!r} got {value!r}; valid values: {list(choices)}")


def _check_type(name: str, value: Any, types: Any, what: str) -> None:
    if isinstance(value, bool) and types in (int, (int, float)):
        raise OptionsError(f"option {name!r} must be {what}; got {value!r}")
    if not isinstance(value, types):
        raise OptionsError(f"option {name!r} must be {what}; got {value!r} ({type(value).__name__})")
