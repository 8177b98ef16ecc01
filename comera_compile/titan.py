"""torchtitan integration (written against torchtitan 0.3.0): a tensor-train model converter and the
fused LM-head loss, for torchtitan's own trainer.

Importing this module needs torchtitan (``pip install -e ".[titan]"``); nothing else in the package
imports it. torchtitan 0.3.0 configures a job with Python config functions (``--module M --config
F``, each returning a ``Trainer.Config``) rather than TOML files, and its model converters
(``ModelConfigConverter``: Float8, LoRA) rewrite the model's *config tree* before the model is built.
:func:`configure` applies everything below to such a config::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from comera_compile import titan

    def llama3_comera():                 # a config function: --module <this module> --config llama3_comera
        config = llama3_debugmodel()
        return titan.configure(config, tt=titan.TTConverter.Config(rank=16, min_size=0), lr=4e-3)

* :class:`TTConverter` (a ``ModelConfigConverter``, usable in ``model_registry(flavor,
  converters=[...])`` like Float8/LoRA): the built model's block Linears (under ``layers.``, never the
  LM head or the embedding) are tensorized by :func:`comera_compile.tensorize_` with the converter's
  :class:`~comera_compile.TTConfig` fields. The model is built on the meta device, so only
  ``init="random"``/``"balanced"`` apply (TT-SVD needs real weights); the cores are drawn when
  torchtitan initializes the weights (``init_states``), identically on every rank.
* **TT cores replicated under FSDP2**: :func:`wrap_parallelize` applies FSDP2's ``replicate`` to every
  TT layer's parametrization before the model's ``parallelize_fn`` shards the blocks, so the cores and
  gates (a few KB per layer) are ``DTensor``s with ``Replicate()`` placement whose gradients are
  all-reduced, while the rest of each block is sharded. torchtitan's gradient clipping and optimizer
  see one mesh. (``TTConverter.Config.tt_params="shard"`` leaves them to FSDP's sharding, as "auto",
  the default, does where torchtitan compiles the blocks: replicate's hooks there would sit inside the
  compiled block.) Where torchtitan compiles the blocks (``--compile.enable``) the comera passes run
  inside that Inductor compile (:func:`comera_compile.use_with_inductor`), so the TT layers run as the
  lowered TT ops; eager blocks form each TT layer's dense weight every forward. With more
  than one rank, torchtitan's ``parallelism.spmd_backend`` must be ``"partial_dtensor"``: its
  ``"spmd_types"`` (the default) and ``"full_dtensor"`` hand FSDP2 and the model DTensors on the full
  mesh, which the TT ops do not take; :func:`wrap_parallelize` refuses them, naming the option.
* **selective activation checkpointing**: torchtitan's ``SelectiveAC`` saves the outputs of the ops it
  knows as compute-intensive (matmuls, attention) and recomputes every other op in the backward, the
  comera ops among them (a btt layer's block GEMMs run again). :class:`SelectiveAC` saves
  :data:`SAVED_OPS` as well. :func:`configure` puts it in place of torchtitan's per-op config where the
  job is tensorized and torchtitan captures the step in a CUDA graph (its default): at d 2048 x 16
  layers, 4 x 2048 tokens on one H100 the step went from 95.7 to 83.8 ms (dense: 128.0 ms) and the peak
  from 6.1 to 14.9 GiB (dense: 19.1 GiB). Without the graph the step is host-bound and saving them
  bought no time (5.6 against 14.9 GiB), so torchtitan's policy stays there. ``save_ops`` overrides.
* **learning rates**: :func:`param_group_configs` gives torchtitan's optimizer
  (``OptimizersContainer.Config.param_groups``, regexes over parameter names) the groups of
  :func:`comera_compile.param_groups`: TT cores, TT gates, decay, no decay.
* **checkpoints**: :class:`CheckpointManager` is torchtitan's DCP checkpoint manager that also writes
  ``comera_tt.json`` (the TT layout: formats, modes, core shapes) into every ``step-N`` folder it
  saves, and on resume reads the file of the step it loads and refuses a layout other than the
  model's (naming the layer and the field) before DCP loads the tensors.
* **the fused loss**: :class:`FusedCrossEntropyLoss`, a ``ChunkedLossWrapper`` subclass (so the
  trainer hands it ``model.lm_head`` and the model skips its head) that computes
  :func:`comera_compile.linear_cross_entropy` on the hidden states: the logits are never formed
  (:class:`comera_compile.losses.FusedLinearCrossEntropyLoss`).
* **rank adaptation**: :func:`attach_rank_adaptation` registers :class:`comera_compile.RankAdaptation`'s
  step hooks on the torchtitan optimizer that holds the TT parameters (``configure(...,
  rank_adaptation=RankConfig(...))`` sets it as the model spec's ``post_optimizer_build_fn``). FSDP2,
  which torchtitan always applies (also on one GPU), fixes the parameters' shapes, so the ranker prunes
  by masking there (the pruned gates held at zero; ``rank_adaptation.shrink_`` slices them off the
  unsharded model afterwards).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import torchtitan  # noqa: F401  (a clear ImportError when torchtitan is not installed)
from torchtitan.components.checkpoint import CheckpointManager as _TitanCheckpointManager
from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.config import CompileConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC as _TitanSelectiveAC
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from comera_compile import tt
from comera_compile._logging import logger
from comera_compile.losses import IGNORE_INDEX, FusedLinearCrossEntropyLoss
from comera_compile.tensorize import TTConfig, iter_tt_layers, tensorize_
from comera_compile.tensorize.checkpoint import TT_FILE, read_layout, save_with_layout, tt_layout

__all__ = [
    "CheckpointManager",
    "FusedCrossEntropyLoss",
    "INDUCTOR_OPTIONS",
    "SAVED_OPS",
    "SelectiveAC",
    "TTConverter",
    "attach_rank_adaptation",
    "check_layout",
    "configure",
    "init_tt_cores_",
    "param_group_configs",
    "replicate_tt_params",
    "saved_ops",
    "wrap_parallelize",
    "write_layout",
]

CORE_PATTERN = r"\.parametrizations\.weight\.0\.core_flat$"
GATE_PATTERN = r"\.parametrizations\.weight\.0\.gate_flat$"
NO_DECAY_PATTERN = r"(\.bias|norm\.weight)$"  # torchtitan's 1-d parameters: biases, RMSNorm weights


# ------------------------------------------------------------------------------------------------
# The fused loss
# ------------------------------------------------------------------------------------------------


class FusedCrossEntropyLoss(ChunkedLossWrapper):
    """torchtitan's loss slot, fused: ``loss_fn(pred, labels, global_valid_tokens)`` with ``pred`` the
    hidden states. A ``ChunkedLossWrapper`` subclass only so that torchtitan's trainer wires it as it
    wires its chunked loss (``set_lm_head(model.lm_head)``, ``model._skip_lm_head = True``); nothing of
    the chunked wrapper runs. Values, ``ignore_index`` (-100) and the division by
    ``global_valid_tokens`` are torchtitan's ``CrossEntropyLoss``'s; see
    :class:`comera_compile.losses.FusedLinearCrossEntropyLoss`."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        memory_budget: Optional[int] = None
        """Bytes of working memory of the fused op (None: 1/16 of the fp32 logits, at least 64 MiB)."""

        strategy: str = "auto"
        """The op's path: "auto", "chunked", "sparse", "static" or "fused" (see linear_cross_entropy)."""

        backward: str = "filtered"
        """"filtered" (skip negligible gradient tiles on the sparse path) or "exact"."""

        deterministic: bool = False
        """Bitwise repeatable gradients."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        del compile_config  # the fused op is its own kernel; there is no logits graph to compile
        self.num_chunks = 1
        self.lm_head = None
        self.loss = FusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, memory_budget=config.memory_budget,
                                                strategy=config.strategy, backward=config.backward,
                                                deterministic=config.deterministic)

    def set_lm_head(self, lm_head: nn.Module) -> None:
        self.lm_head = lm_head
        self.loss.set_lm_head(lm_head)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor,
                 global_valid_tokens: torch.Tensor | None = None,
                 **loss_inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.loss(pred, labels, global_valid_tokens, **loss_inputs)


# ------------------------------------------------------------------------------------------------
# The model converter
# ------------------------------------------------------------------------------------------------


def _selects(converter: "TTConverter.Config") -> Callable[[nn.Module, str], bool]:
    targets = None if converter.target_modules is None else set(converter.target_modules)

    def select(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and fqn.startswith("layers.")
                and (targets is None or fqn.rsplit(".", 1)[-1] in targets))

    return select


_model_classes: dict[type, type] = {}


def _tt_model_class(cls: type) -> type:
    """``cls`` whose ``verify_module_protocol`` allows the parametrization modules of TT layers
    (``torch.nn.utils.parametrize``'s, plain ``nn.Module``s) and whose ``init_states`` draws the TT
    cores after torchtitan's own initialization."""
    if cls in _model_classes:
        return _model_classes[cls]

    def verify_module_protocol(self) -> None:
        failures = [(fqn, type(m).__name__) for fqn, m in self.named_modules()
                    if not isinstance(m, Module) and ".parametrizations" not in f".{fqn}"]
        if failures:
            details = ", ".join(f"'{fqn}' ({name})" for fqn, name in failures)
            raise RuntimeError(f"The following modules do not satisfy the Module protocol: {details}")

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        cls.init_states(self, buffer_device=buffer_device)
        init_tt_cores_(self, seed=self._comera_tt_seed, std=self._comera_tt_std,
                       balanced=self._comera_tt_balanced)

    new = type(f"TT{cls.__name__}", (cls,), {"verify_module_protocol": verify_module_protocol,
                                             "init_states": init_states})
    _model_classes[cls] = new
    return new


class TTConverter(ModelConfigConverter):
    """Tensorize the blocks' Linears (``layers.*``) when the model is built; see the module docs.

    The converted root config builds the model as before, then calls :func:`comera_compile.tensorize_`
    with the :class:`~comera_compile.TTConfig` of these fields on the Linears under ``layers.`` (those
    whose last name is in ``target_modules``, when given: e.g. ``["w1", "w2", "w3"]``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        rank: Optional[int] = None
        """TT rank of every internal bond (TTConfig.rank; None: the format's own, 32 for TT-matrix, 1 for btt)."""

        fmt: str = "auto"
        """"auto" (btt at rank 1 for Linears at least 2048 wide when rank is None, else TT-matrix), "ttm",
        "tt" or "btt" (TTConfig.fmt)."""

        n_cores: Optional[int] = None
        """Number of cores (TTConfig.n_cores; None: modes near 10)."""

        min_size: int = 16384
        """Linears with fewer weight elements stay dense (TTConfig.min_size)."""

        init: str = "random"
        """"random" or "balanced" (the model is built on the meta device: no "svd")."""

        init_std: Optional[float] = None
        """Std of the reconstructed weight (TTConfig.init_std; None: sqrt(1 / (in + out)))."""

        target_modules: Optional[list[str]] = None
        """Last FQN segments of the Linears to tensorize (None: every Linear under ``layers.``)."""

        tt_params: str = "auto"
        """"replicate": TT cores and gates replicated under FSDP2 (``wrap_parallelize``); "shard": sharded
        with the rest of their block; "auto": "replicate", or "shard" where torchtitan compiles the
        blocks (replicate's FSDP2 hooks on each TT parametrization would sit inside the compiled block,
        which torchtitan compiles with ``fullgraph=True``, and Dynamo cannot trace them)."""

        seed: int = 0
        """Seed of the cores' random init (the same on every rank)."""

        inductor_passes: bool = True
        """When torchtitan compiles the blocks (``compile.enable``, "model" in ``compile.components``,
        backend "inductor"), run the comera passes inside that compile (``cc.use_with_inductor`` with
        :data:`INDUCTOR_OPTIONS`), so that the TT layers run as the
        lowered TT ops (btt: block GEMMs, no dense weight). Eager blocks form each TT layer's dense
        weight every forward (logged at WARNING)."""

        def __post_init__(self) -> None:
            if self.init == "svd":
                raise ValueError("TTConverter: init='svd' needs real weights; torchtitan builds the model on the "
                                 "meta device. Use init='random' or 'balanced'")
            if self.tt_params not in ("auto", "replicate", "shard"):
                raise ValueError(f"TTConverter: tt_params must be 'auto', 'replicate' or 'shard', got "
                                 f"{self.tt_params!r}")
            self.tt_config()  # every TTConfig field checked here, before any model is built

        def tt_config(self) -> TTConfig:
            return TTConfig(rank=self.rank, fmt=self.fmt, n_cores=self.n_cores, min_size=self.min_size,
                            init=self.init, init_std=self.init_std)

    def __init__(self, config: Config, **kwargs: Any):
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        """The root config, as a subclass whose ``build()`` tensorizes the built model."""
        converter = self.config
        base = type(model_config)

        def build(cfg, **kwargs):
            model = base.build(cfg, **kwargs)
            tensorize_(model, converter.tt_config(), filter_fn=_selects(converter))
            model.__class__ = _tt_model_class(type(model))
            model._comera_tt_seed = converter.seed
            model._comera_tt_std = converter.init_std
            model._comera_tt_balanced = converter.init == "balanced"
            model._comera_tt_params = converter.tt_params
            model._comera_inductor_passes = converter.inductor_passes
            return model

        new_cls = type(f"TT{base.__name__}", (base,), {"build": build, "_comera_tt_converter": converter})
        fields = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init}
        return new_cls(**fields)


@torch.no_grad()
def init_tt_cores_(model: nn.Module, *, seed: int = 0, std: float | None = None, balanced: bool = False) -> None:
    """Draw every TT layer's cores (CoMERA's init, :func:`comera_compile.tt.random_cores`) and set its
    gates to 1, from a generator seeded by ``seed`` and the layer's index, so that every rank draws
    the same values; works on plain, replicated and sharded (``DTensor``) parameters."""
    for i, layer in enumerate(iter_tt_layers(model)):
        p = layer.param
        spec = p.spec
        layer_std = std if std is not None else math.sqrt(1.0 / (spec.rows + spec.cols))
        g = torch.Generator().manual_seed(seed * 100003 + i)
        cores = tt.random_cores(spec, layer_std, dtype=torch.float32, generator=g, balanced=balanced)
        gates = [torch.ones(n) for n in p.gate_sizes]
        core_flat, gate_flat = tt.join_flat(cores, gates)
        _copy_into(p.core_flat, core_flat)
        _copy_into(p.gate_flat, gate_flat)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                      src_data_rank=None))
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))


# ------------------------------------------------------------------------------------------------
# FSDP2: the TT parameters replicated
# ------------------------------------------------------------------------------------------------


def replicate_tt_params(model: nn.Module, mesh, dp_mesh_dims=None) -> int:
    """FSDP2's ``replicate`` (DDP-style, ``Replicate()`` DTensors on ``mesh``, gradients all-reduced)
    on every TT layer's parametrization module; call before ``fully_shard`` of the blocks, which then
    leaves those parameters alone. ``dp_mesh_dims``: as ``replicate`` takes it, for a multi-axis SPMD
    mesh. Returns the number of layers."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    layers = list(iter_tt_layers(model))
    for layer in layers:
        if dp_mesh_dims is None:
            replicate(layer.param, mesh=mesh)
        else:
            replicate(layer.param, mesh=mesh, dp_mesh_dims=dp_mesh_dims)
    return len(layers)


def _check_spmd_backend(parallel_dims) -> None:
    """torchtitan's ``full_dtensor`` backend, and its ``spmd_types`` backend beyond one rank, hand FSDP2
    every parameter and activation as a ``DTensor`` on the full mesh; the tensor-train ops run on plain
    tensors. Refused here, before anything is sharded, naming the setting that works."""
    backend = getattr(parallel_dims, "spmd_backend", "partial_dtensor")
    if backend == "full_dtensor" or (backend == "spmd_types" and parallel_dims.world_size > 1):
        raise NotImplementedError(
            f"TTConverter: parallelism.spmd_backend={backend!r} (world size {parallel_dims.world_size}) gives every "
            "parameter and activation to FSDP2 as a DTensor on the full mesh, which the tensor-train ops do not "
            "take; use parallelism.spmd_backend='partial_dtensor' (--parallelism.spmd_backend partial_dtensor), "
            "FSDP2 over the data-parallel mesh")


def _replicate_mesh(parallel_dims) -> Any:
    """The mesh that torchtitan's FSDP shards the blocks over, for ``replicate``: the TT parameters
    then live on the same mesh as the sharded ones (one mesh for clipping)."""
    if parallel_dims.dp_replicate_enabled:
        raise NotImplementedError("TTConverter(tt_params='replicate') with HSDP (data_parallel_replicate_degree > 1) "
                                  "is not supported; use tt_params='shard'")
    if getattr(parallel_dims, "spmd_backend", "partial_dtensor") == "spmd_types":  # one rank (_check_spmd_backend)
        from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh

        return resolve_fsdp_mesh(parallel_dims)[0]
    return parallel_dims.get_mesh(["fsdp"])


INDUCTOR_OPTIONS = {"cudagraphs": False, "inductor_config": {"triton.autotune_pointwise": False}}
"""The options :class:`TTConverter` runs the comera passes with inside torchtitan's Inductor compile
(``cc.use_with_inductor``): no CUDA graphs of Inductor's own per block (FSDP2 swaps the parameters' storage
every step; torchtitan captures the whole forward and backward itself unless ``training.disable_cuda_graphs``), and the
Inductor setting the TT pass asks of ``backend="comera"`` for a graph with TT layers (one configuration
per pointwise kernel), which a pre-grad pass cannot set for the compile under way. Another
``use_with_inductor`` in the same process must use the same options."""


def _compiles_blocks(compile_config) -> bool:
    return compile_config is not None and compile_config.enable and "model" in compile_config.components


def _inductor_passes(model: nn.Module, compile_config) -> None:
    """The comera passes inside torchtitan's per-block Inductor compile, or a warning naming why the TT
    layers run eagerly."""
    if not _compiles_blocks(compile_config):
        logger.warning("TTConverter: torchtitan does not compile the blocks (compile.enable with 'model' in "
                       "compile.components), so every TT layer forms its dense weight each forward; pass "
                       "--compile.enable for the lowered TT ops")
        return
    if compile_config.backend != "inductor":
        logger.warning("TTConverter: compile.backend=%r: the comera passes run inside Inductor only "
                       "(compile.backend='inductor'); the TT layers form their dense weight each forward",
                       compile_config.backend)
        return
    from comera_compile.inductor import use_with_inductor

    model._comera_inductor_handle = use_with_inductor(INDUCTOR_OPTIONS)


def wrap_parallelize(parallelize_fn: Callable) -> Callable:
    """``parallelize_fn`` (a ``ModelSpec``'s) that, for a model built by :class:`TTConverter` (nothing
    for other models), first checks the parallelism it supports, replicates the TT parameters
    (``tt_params``), installs the comera passes in torchtitan's Inductor compile of the blocks
    (``inductor_passes``). The activation-checkpointing config is handed on as given. torchtitan applies
    FSDP2 whatever the number of GPUs, so this always runs for such a model."""
    if getattr(parallelize_fn, "_comera_wrapped", False):
        return parallelize_fn

    def parallelize(model: nn.Module, *, parallel_dims, **kwargs: Any) -> nn.Module:
        tt_params = getattr(model, "_comera_tt_params", None)
        if tt_params is not None:
            if parallel_dims.tp_enabled or parallel_dims.cp_enabled or parallel_dims.pp_enabled:
                raise NotImplementedError("TTConverter: tensor-train layers with tensor, context or pipeline "
                                          "parallelism are not supported; use data parallel (FSDP2) only")
            _check_spmd_backend(parallel_dims)
            compile_config = kwargs.get("compile_config")
            compiled = _compiles_blocks(compile_config)
            if tt_params == "auto":
                tt_params = "shard" if compiled else "replicate"
                logger.info("TTConverter(tt_params='auto'): the TT cores and gates are %s", "sharded with their "
                            "block (torchtitan compiles the blocks)" if compiled else "replicated")
            elif tt_params == "replicate" and compiled:
                raise ValueError("TTConverter(tt_params='replicate') with compile.enable: FSDP2's replicate hooks on "
                                 "each TT parametrization sit inside the block torchtitan compiles with "
                                 "fullgraph=True, which Dynamo cannot trace; use tt_params='auto' or 'shard'")
            if tt_params == "replicate":
                replicate_tt_params(model, _replicate_mesh(parallel_dims))
            if getattr(model, "_comera_inductor_passes", False):
                _inductor_passes(model, compile_config)
        return parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)

    parallelize._comera_wrapped = True
    parallelize.__wrapped__ = parallelize_fn
    return parallelize


# ------------------------------------------------------------------------------------------------
# Selective activation checkpointing that saves the comera ops' outputs
# ------------------------------------------------------------------------------------------------

SAVED_OPS = ("comera::btt_blocks", "comera::tt_linear", "comera::linear_cross_entropy")
"""The comera ops that :class:`SelectiveAC` saves: those that run a layer's GEMMs (a btt layer's block
products, a TT layer's contraction chain, the fused loss). The ops that form a TT layer's dense weight
are left to recompute: their cost is a weight's size, not the tokens'."""


def saved_ops() -> set:
    """:data:`SAVED_OPS` as the op overloads a checkpoint policy compares against."""
    import comera_compile.kernels.btt_blocks  # noqa: F401  (registers the ops)
    import comera_compile.kernels.linear_cross_entropy  # noqa: F401
    import comera_compile.kernels.tt_linear  # noqa: F401

    return {getattr(torch.ops.comera, name.split("::")[1]).default for name in SAVED_OPS}


class SelectiveAC(_TitanSelectiveAC):
    """torchtitan's per-op selective activation checkpointing, saving :data:`SAVED_OPS` too, as it saves
    its batched matmuls (torchtitan's own policy recomputes every comera op in the backward: for a btt
    layer, both block GEMMs of its forward). :func:`configure` puts it in place of torchtitan's per-op
    config where the job is tensorized and its step is captured in a CUDA graph (``save_ops``); elsewhere
    set ``activation_checkpoint = SelectiveAC.Config(...)``. The cost is the comera ops' outputs' memory
    (per btt FFN layer at rank 1, its outputs and an intermediate no larger than its input)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanSelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return set(super().get_save_ops()) | saved_ops()


# ------------------------------------------------------------------------------------------------
# Learning rates: cc.param_groups' rules as torchtitan's ParamGroupConfigs
# ------------------------------------------------------------------------------------------------


def param_group_configs(lr: float, *, weight_decay: float = 0.1, core_lr: float | None = None,
                        gate_lr: float | None = None, core_weight_decay: float = 0.0,
                        gate_weight_decay: float = 0.0, tensorized: bool = True, optimizer_name: str = "AdamW",
                        **optimizer_kwargs: Any) -> list[ParamGroupConfig]:
    """torchtitan ``ParamGroupConfig``s (first match wins, by parameter name) for the groups of
    :func:`comera_compile.param_groups`: ``core_flat`` (``core_lr``, default ``lr``; ``core_weight_decay``),
    ``gate_flat`` (``gate_lr``; ``gate_weight_decay``), biases and norm weights (no decay), the rest
    (``weight_decay``). ``optimizer_kwargs`` (e.g. ``betas``, ``eps``) go to every group. With
    ``tensorized=False`` the TT groups are left out (torchtitan refuses a pattern that matches nothing)."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("core_lr", core_lr), ("gate_lr", gate_lr),
                        ("core_weight_decay", core_weight_decay), ("gate_weight_decay", gate_weight_decay)):
        if value is not None and not value >= 0:
            raise ValueError(f"param_group_configs: {name} must be >= 0, got {value}")

    def group(pattern: str, group_lr: float, decay: float) -> ParamGroupConfig:
        return ParamGroupConfig(pattern=pattern, optimizer_name=optimizer_name,
                                optimizer_kwargs={**optimizer_kwargs, "lr": group_lr, "weight_decay": decay})

    groups = []
    if tensorized:
        groups += [group(CORE_PATTERN, lr if core_lr is None else core_lr, core_weight_decay),
                   group(GATE_PATTERN, lr if gate_lr is None else gate_lr, gate_weight_decay)]
    return groups + [group(NO_DECAY_PATTERN, lr, 0.0), group(r".*", lr, weight_decay)]


# ------------------------------------------------------------------------------------------------
# Checkpoints: comera_tt.json beside torchtitan's
# ------------------------------------------------------------------------------------------------


def write_layout(model_parts: list[nn.Module], directory: str) -> bool:
    """Write ``comera_tt.json`` (the TT layout of ``model_parts``) into ``directory``; False when the
    model has no TT layer (and a stale file there is removed). Rank 0 writes where distributed."""
    layout = [entry for part in model_parts for entry in tt_layout(part)]
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return bool(layout)
    path = os.path.join(directory, TT_FILE)
    if not layout:
        if os.path.exists(path):
            os.remove(path)
        return False
    os.makedirs(directory, exist_ok=True)

    def save(root, save_directory, state_dict=None, **kwargs):  # the layout only: DCP writes the tensors
        pass

    for part in model_parts:
        if tt_layout(part):
            save_with_layout(part, save, directory, state_dict={})
    return True


_COMPARED = ("fmt", "row_modes", "col_modes", "rows", "cols", "transpose", "core_shapes", "gate_sizes", "kind")


def check_layout(model_parts: list[nn.Module], directory: str) -> bool:
    """Check the ``comera_tt.json`` in ``directory`` (written by :func:`write_layout`) against the model:
    the same TT layers with the same formats, modes and core shapes (ranks). Raises ValueError naming
    the first difference; returns False when the directory has no such file."""
    path = os.path.join(directory, TT_FILE)
    if not os.path.exists(path):
        if any(tt_layout(part) for part in model_parts):
            raise ValueError(f"{directory}: no {TT_FILE}, but the model has tensor-train layers: the checkpoint was "
                             "saved by a dense model or by torchtitan's own checkpoint manager (use "
                             "comera_compile.titan.CheckpointManager)")
        return False
    saved = {entry["fqn"]: entry for entry in read_layout(path)}
    now = {entry["fqn"]: entry for part in model_parts for entry in tt_layout(part)}
    if saved.keys() != now.keys():
        raise ValueError(f"{path}: the checkpoint's tensor-train layers {sorted(saved)} are not the model's "
                         f"{sorted(now)}: build the model with the converter settings it was saved with")
    for fqn, entry in saved.items():
        for field in _COMPARED:
            if entry[field] != now[fqn][field]:
                raise ValueError(f"{path}: layer '{fqn}' field '{field}' is {json.dumps(entry[field])} in the "
                                 f"checkpoint and {json.dumps(now[fqn][field])} in the model built now: build the "
                                 "model with the converter settings (rank, fmt, n_cores) it was saved with")
    return True


class CheckpointManager(_TitanCheckpointManager):
    """torchtitan's DCP checkpoint manager, also writing ``comera_tt.json`` into every ``step-N``
    folder it saves and checking it against the model before loading one."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanCheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._comera_parts = kwargs.get("model_parts") or []

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if saved:
            write_layout(self._comera_parts, self._create_checkpoint_id(curr_step))
        return saved

    def _load(self, step: int = -1) -> bool:
        load_step = step
        if load_step == -1 and os.path.isdir(self.folder):
            load_step = self._find_load_step()
        if load_step != -1:
            check_layout(self._comera_parts, self._create_checkpoint_id(load_step))
        return super()._load(step)


# ------------------------------------------------------------------------------------------------
# Rank adaptation as optimizer hooks
# ------------------------------------------------------------------------------------------------


def attach_rank_adaptation(optimizers, model_parts: list[nn.Module], rank_config) -> Any:
    """:class:`comera_compile.RankAdaptation` on the optimizer of torchtitan's ``OptimizersContainer``
    (``optimizers``) that holds the TT parameters: its step pre- and post-hooks (penalty, pruning).
    Feed it the loss each step (``ranker.observe(loss)``) or leave it to the late stage's switch
    (``switch=<step>``). Where FSDP2 holds the TT parameters (``DTensor`` s of fixed shapes: always, in
    torchtitan's trainer), the ranker prunes by masking (``prune_mode="mask"``: the pruned gates held at
    zero, the shapes kept); :func:`comera_compile.rank_adaptation.shrink_` slices them off the model
    loaded unsharded from the checkpoint."""
    from comera_compile.rank_adaptation import RankAdaptation

    if len(model_parts) != 1:
        raise NotImplementedError("attach_rank_adaptation: one model part (no pipeline parallelism)")
    model = model_parts[0]
    ids = {id(layer.param.core_flat) for layer in iter_tt_layers(model)}
    holders = [opt for opt in getattr(optimizers, "optimizers", [optimizers])
               if any(id(p) in ids for group in opt.param_groups for p in group["params"])]
    if len(holders) != 1:
        raise ValueError(f"attach_rank_adaptation: the TT cores are in {len(holders)} optimizers; one must hold them all")
    options = dataclasses.asdict(rank_config)
    options.setdefault("loss_from", "observe")
    return RankAdaptation(model, holders[0], **options)


# ------------------------------------------------------------------------------------------------
# One call for a whole Trainer.Config
# ------------------------------------------------------------------------------------------------


def _save_comera_ops(config, *, explicit: bool, tensorized: bool, captured: bool) -> None:
    """:func:`configure`'s ``save_ops``: torchtitan's per-op SelectiveAC config becomes :class:`SelectiveAC`'s."""
    ac = getattr(config, "activation_checkpoint", None)
    if isinstance(ac, SelectiveAC.Config):
        return  # already saving them
    if type(ac) is not _TitanSelectiveAC.Config:
        if explicit:
            name = "None" if ac is None else type(ac).__qualname__
            raise ValueError(f"configure(save_ops=True): the job's activation_checkpoint is {name}, not "
                             "torchtitan's per-op SelectiveAC.Config; set "
                             "activation_checkpoint = comera_compile.titan.SelectiveAC.Config(...) yourself, or "
                             "leave save_ops at None")
        return
    if not explicit and not (tensorized and captured):
        return
    config.activation_checkpoint = SelectiveAC.Config(**{f.name: getattr(ac, f.name)
                                                         for f in dataclasses.fields(ac) if f.init})
    logger.info("configure: activation checkpointing saves the comera ops' outputs too (titan.SelectiveAC%s; "
                "save_ops=False keeps torchtitan's, which recomputes them)",
                "" if explicit else ": the step is captured in a CUDA graph")


def configure(config, *, tt: TTConverter.Config | None = None,
              fused_loss: FusedCrossEntropyLoss.Config | bool = True, lr: float | None = None,
              core_lr: float | None = None, gate_lr: float | None = None, rank_adaptation=None,
              save_ops: bool | None = None):
    """Apply the converter, the fused loss, the learning-rate groups and the checkpoint layout file
    to torchtitan's ``Trainer.Config`` ``config`` (in place; returned).

    * ``tt``: converts ``config.model_spec.model``, wraps its ``parallelize_fn`` (:func:`wrap_parallelize`),
      sets :class:`CheckpointManager` (same settings) and, when ``lr`` is given, the optimizer's param
      groups (:func:`param_group_configs`, AdamW with torchtitan's default betas/eps, ``weight_decay`` 0.1).
    * ``fused_loss``: True or a :class:`FusedCrossEntropyLoss.Config`: the loss slot (torchtitan then
      skips the model's head and hands it to the loss). Where ``config.training.disable_cuda_graphs`` is
      False (torchtitan's default: it captures the forward and backward in a CUDA graph after one
      uncaptured step), True means ``backward="exact"``: the sparse rounds read a count on the host, so a
      captured step cannot run them, and the uncaptured first step must take the captured steps' path for
      its kernels to be built before the capture. A given config with ``backward="filtered"`` is kept,
      with a warning. Set ``disable_cuda_graphs`` before calling this; a later command-line change is not
      seen here.
    * ``rank_adaptation``: a :class:`comera_compile.RankConfig`: :func:`attach_rank_adaptation` as the
      model spec's ``post_optimizer_build_fn`` (masked pruning under FSDP2, see there).
    * ``save_ops``: replace torchtitan's per-op ``SelectiveAC.Config`` in ``config.activation_checkpoint``
      by :class:`SelectiveAC`'s (its settings kept), which also saves the comera ops' outputs instead of
      recomputing them in the backward. ``None`` (default): where ``tt`` is given and torchtitan captures
      the step in a CUDA graph (at d 2048 x 16 layers on one H100 that step went from 95.7 to 83.8 ms,
      the peak from 6.1 to 14.9 GiB, the dense job's 19.1; without the graph the step is host-bound and
      saving them bought no time). ``True``: always (a ``ValueError`` where the job's checkpointing is
      not torchtitan's per-op selective one); ``False``: the checkpointing config is left as given. A
      subclass of torchtitan's config (a policy of your own) is never replaced.
    """
    if save_ops not in (None, True, False):
        raise ValueError(f"configure: save_ops must be None (auto), True or False, got {save_ops!r}")
    spec = config.model_spec
    if spec is None:
        raise ValueError("configure: config.model_spec is None (call it on a config function's Trainer.Config)")
    if tt is not None:
        spec.model = TTConverter(tt).convert(spec.model)
        spec.parallelize_fn = wrap_parallelize(spec.parallelize_fn)
        ckpt = config.checkpoint
        if not isinstance(ckpt, CheckpointManager.Config):
            config.checkpoint = CheckpointManager.Config(**{f.name: getattr(ckpt, f.name)
                                                            for f in dataclasses.fields(ckpt) if f.init})
    if lr is not None:
        config.optimizer.param_groups = param_group_configs(lr, core_lr=core_lr, gate_lr=gate_lr,
                                                            tensorized=tt is not None, betas=(0.9, 0.95), eps=1e-8)
    captured = not getattr(getattr(config, "training", None), "disable_cuda_graphs", True)
    if fused_loss:
        if isinstance(fused_loss, FusedCrossEntropyLoss.Config):
            if captured and fused_loss.backward == "filtered" and fused_loss.strategy in ("auto", "sparse"):
                logger.warning("configure: torchtitan captures the step in a CUDA graph (training.disable_cuda_graphs "
                               "is False) and the fused loss has backward='filtered', strategy=%r: its first, "
                               "uncaptured step may take the sparse path, which a captured step cannot run, so the "
                               "capture builds other kernels; use backward='exact' (or strategy='chunked')",
                               fused_loss.strategy)
            config.loss = fused_loss
        else:
            config.loss = FusedCrossEntropyLoss.Config(backward="exact" if captured else "filtered")
    if save_ops is not False:
        _save_comera_ops(config, explicit=save_ops is True, tensorized=tt is not None, captured=captured)
    if rank_adaptation is not None:
        previous = spec.post_optimizer_build_fn

        def post_optimizer_build(optimizers, model_parts, parallel_dims):
            if previous is not None:
                previous(optimizers, model_parts, parallel_dims)
            optimizers.comera_rank_adaptation = attach_rank_adaptation(optimizers, model_parts, rank_adaptation)

        spec.post_optimizer_build_fn = post_optimizer_build
    return config
