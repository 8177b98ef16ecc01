"""torchtitan integration (``comera_compile.titan``) on a tiny torchtitan Llama-3 (d 64, 2 layers, vocab
256, PyTorch SDPA attention: torchtitan's FlexAttention has no backward on the CPU): the TT converter,
the fused loss in torchtitan's loss slot, the learning-rate groups, the checkpoint layout file, rank
adaptation's hooks, the example's configs, and FSDP2 (torchtitan's own ``apply_fsdp_to_decoder``) on 2
CPU processes over gloo. Skipped without torchtitan (CI runs it in a venv with the `titan` extra)."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan.trainer")  # a submodule: examples/torchtitan/ is no stand-in for the package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "torchtitan"))

import comera_configs  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.config import CompileConfig  # noqa: E402

import comera_compile as cc  # noqa: E402
from comera_compile import titan  # noqa: E402
from comera_compile.losses import IGNORE_INDEX  # noqa: E402
from ports import free_port, spawn_results  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, DIM = 256, 64


def build(tt: titan.TTConverter.Config | None = None, seed: int = 0):
    """The tiny model as torchtitan builds it: on the meta device, verified, materialized, initialized."""
    config = comera_configs._model(**comera_configs.TINY)
    if tt is not None:
        config = titan.TTConverter(tt).convert(config)
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(seed: int, ignored: float = 0.2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[torch.rand(labels.shape, generator=g) < ignored] = IGNORE_INDEX
    return tokens, labels


def test_the_converter_tensorizes_the_blocks_linears_only():
    model = build(titan.TTConverter.Config(rank=4, min_size=0))
    layers = {layer.fqn: layer for layer in cc.iter_tt_layers(model)}
    linears = {f"layers.{i}.{name}" for i in range(2) for name in
               ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert set(layers) == linears
    assert type(model.lm_head.weight) is torch.nn.Parameter and "tok_embeddings.weight" in dict(model.named_parameters())
    for layer in layers.values():  # drawn at init_states, not left as to_empty's garbage
        assert torch.isfinite(layer.param.core_flat).all() and layer.param.core_flat.abs().sum() > 0
        assert torch.equal(layer.param.gate_flat, torch.ones_like(layer.param.gate_flat))
        assert max(layer.spec.ranks) <= 4
    again = build(titan.TTConverter.Config(rank=4, min_size=0), seed=123)  # every rank draws the same cores
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        if "parametrizations" in name:
            assert torch.equal(p, q), name
    only_mlp = build(titan.TTConverter.Config(rank=4, min_size=0, target_modules=["w1", "w2", "w3"]))
    assert {layer.fqn.rsplit(".", 1)[-1] for layer in cc.iter_tt_layers(only_mlp)} == {"w1", "w2", "w3"}
    with pytest.raises(ValueError, match="meta device"):
        titan.TTConverter.Config(init="svd")


def _losses_and_grads(model, loss_fn, batches):
    model.zero_grad()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    valid = sum((labels != IGNORE_INDEX).sum() for _, labels in batches)
    total = 0.0
    for tokens, labels in batches:
        loss, _ = loss_fn(model(tokens), labels, valid)
        loss.backward()
        total = total + loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tt", [None, titan.TTConverter.Config(rank=4, min_size=0)], ids=["dense", "tt"])
def test_the_fused_loss_in_torchtitans_slot_equals_its_chunked_loss(tt):
    """Gradient accumulation over two microbatches, ignore_index included: torchtitan's own
    ChunkedLossWrapper (logits per chunk) and the fused loss give the same losses and gradients."""
    model = build(tt)
    batches = [batch(1), batch(2, ignored=0.6)]
    fused = titan.FusedCrossEntropyLoss.Config().build()
    chunked = ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config()).build()
    assert isinstance(fused, ChunkedLossWrapper)  # torchtitan's trainer wires it as it wires its chunked loss
    loss_a, grads_a = _losses_and_grads(model, fused, batches)
    loss_b, grads_b = _losses_and_grads(copy.deepcopy(model), chunked, batches)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and "lm_head.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _dims(backend: str = "partial_dtensor", world_size: int = 1):
    def get_mesh(names):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (1,), mesh_dim_names=tuple(names))

    return SimpleNamespace(tp_enabled=False, cp_enabled=False, pp_enabled=False, dp_replicate_enabled=False,
                           spmd_backend=backend, world_size=world_size, get_mesh=get_mesh)


@pytest.fixture
def one_rank_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tt_params", ["auto", "replicate", "shard"])
def test_wrap_parallelize_places_the_tt_params_by_whether_torchtitan_compiles_the_blocks(tt_params, one_rank_group):
    """Compiled blocks (fullgraph) cannot hold replicate's FSDP2 hooks: "auto" shards the TT parameters
    there (leaves them to the blocks' fully_shard), "replicate" is refused before anything is applied;
    eager blocks get them replicated ("auto")."""
    from torch.distributed.tensor import DTensor

    for compiled in (True, False):
        model = build(titan.TTConverter.Config(rank=4, min_size=0, tt_params=tt_params, inductor_passes=False))
        seen = []
        parallelize = titan.wrap_parallelize(lambda m, **kw: seen.append(m) or m)
        cores = lambda: [layer.param.core_flat for layer in cc.iter_tt_layers(model)]  # noqa: E731
        if compiled and tt_params == "replicate":
            with pytest.raises(ValueError, match="tt_params='auto' or 'shard'"):
                parallelize(model, parallel_dims=_dims(), compile_config=CompileConfig(enable=True))
            assert not seen and not any(isinstance(p, DTensor) for p in cores())
            continue
        parallelize(model, parallel_dims=_dims(), compile_config=CompileConfig(enable=compiled))
        assert seen == [model]
        replicated = tt_params == "replicate" or (tt_params == "auto" and not compiled)
        assert all(isinstance(p, DTensor) == replicated for p in cores()), (tt_params, compiled)


@pytest.mark.parametrize("backend,world_size", [("full_dtensor", 1), ("full_dtensor", 2), ("spmd_types", 2)])
def test_wrap_parallelize_refuses_full_mesh_dtensor_backends(backend, world_size):
    model = build(titan.TTConverter.Config(rank=4, min_size=0, inductor_passes=False))
    parallelize = titan.wrap_parallelize(lambda m, **kw: pytest.fail("parallelize_fn ran"))
    with pytest.raises(NotImplementedError, match="spmd_backend='partial_dtensor'"):
        parallelize(model, parallel_dims=_dims(backend, world_size), compile_config=CompileConfig())


class _FFN(torch.nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.w2 = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


def _sac_step(policy_cls, model, x):
    """One compiled forward and backward of ``model`` under ``policy_cls``'s selective checkpointing, the
    comera passes inside Inductor (as torchtitan runs them); the comera ops of each post-grad graph."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC as TitanSAC  # noqa: F401

    wrapped = policy_cls(policy_cls.Config())._wrap_block(model)
    graphs = []
    torch._dynamo.reset()
    with cc.use_with_inductor(titan.INDUCTOR_OPTIONS), \
            torch._inductor.config.patch(post_grad_custom_post_pass=graphs.append):
        torch.compile(wrapped)(x).sum().backward()
    return [sorted(str(n.target) for n in g.nodes if n.op == "call_function" and "comera" in str(n.target))
            for g in graphs]


def test_selective_checkpointing_saves_the_btt_blocks_instead_of_recomputing_them():
    """torchtitan's SelectiveAC recomputes every op it does not know as compute-intensive: a btt FFN's
    block GEMMs (the planner's "blocks" path at d 2048) run again in the backward. comera's SelectiveAC
    saves them: its backward holds no forward op, and the gradients are those without checkpointing."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC as TitanSAC

    torch.manual_seed(0)
    base = _FFN(2048, 6144)
    cc.tensorize_(base, cc.TTConfig(fmt="btt", rank=1, min_size=0))
    x = torch.randn(16, 2048, generator=torch.Generator().manual_seed(1))
    grads = {}
    for name, policy in (("titan", TitanSAC), ("comera", titan.SelectiveAC)):
        model = copy.deepcopy(base)
        fwd, bwd = _sac_step(policy, model, x)
        assert fwd.count("comera.btt_blocks.default") == 2, fwd  # w1 and w3 as one group, then w2
        assert bwd.count("comera.btt_blocks.default") == (2 if name == "titan" else 0), (name, bwd)
        assert bwd.count("comera.btt_blocks_backward.default") == 2, bwd
        grads[name] = [p.grad for p in model.parameters()]
    model = copy.deepcopy(base)
    model(x).sum().backward()  # eager, no checkpointing
    for got in grads.values():
        for a, b in zip(got, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_comera_selective_ac_saves_torchtitans_ops_and_the_comera_ops():
    from torchtitan.distributed.activation_checkpoint import SelectiveAC as TitanSAC

    ours, theirs = titan.SelectiveAC(titan.SelectiveAC.Config()), TitanSAC(TitanSAC.Config())
    assert ours.get_save_ops() == set(theirs.get_save_ops()) | titan.saved_ops()
    assert {str(op) for op in titan.saved_ops()} == {f"{name}.default".replace("::", ".") for name in titan.SAVED_OPS}
    assert isinstance(titan.SelectiveAC.Config(), TitanSAC.Config)  # torchtitan's checks of SAC apply to it


def test_wrap_parallelize_hands_the_checkpointing_config_on_as_given(caplog):
    """The activation-checkpointing config reaches torchtitan's parallelize as the user set it, for a
    tensorized model and a dense one alike: torchtitan's own SelectiveAC (which recomputes the comera ops),
    comera's, a subclass of the user's, FullAC or none; nothing is logged about it."""
    import logging

    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC as TitanSAC

    class Mine(TitanSAC):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(TitanSAC.Config):
            pass

    def handed(model, ac_config):
        seen = []
        parallelize = titan.wrap_parallelize(lambda m, **kw: seen.append(kw["ac_config"]) or m)
        parallelize(model, parallel_dims=_dims(), compile_config=CompileConfig(), ac_config=ac_config)
        return seen[0]

    tt = titan.TTConverter.Config(rank=4, min_size=0, inductor_passes=False, tt_params="shard")
    given = TitanSAC.Config(preserve_rng_state=False, force_recompute_mm_shapes_by_fqns=["w2"])
    with caplog.at_level(logging.DEBUG, logger="comera_compile"):
        for config in (given, titan.SelectiveAC.Config(), Mine.Config(), FullAC.Config(), None):
            assert handed(build(tt), config) is config
            assert handed(build(), config) is config
    assert "SelectiveAC" not in caplog.text and "save" not in caplog.text


def test_converter_config_refuses_an_unknown_tt_params():
    with pytest.raises(ValueError, match="'auto', 'replicate' or 'shard'"):
        titan.TTConverter.Config(tt_params="mirror")


def test_param_group_configs_give_torchtitans_optimizer_cc_param_groups():
    model = build(titan.TTConverter.Config(rank=4, min_size=0))
    config = OptimizersContainer.Config(param_groups=titan.param_group_configs(1e-3, gate_lr=5e-3),
                                        implementation="for-loop")
    container = config.build(model_parts=[model])
    got = [(frozenset(map(id, g["params"])), g["lr"], g["weight_decay"])
           for opt in container for g in opt.param_groups]
    want = [(frozenset(map(id, g["params"])), g["lr"], g["weight_decay"])
            for g in cc.param_groups(model, 1e-3, gate_lr=5e-3)]
    assert sorted(got, key=str) == sorted(want, key=str)


def test_the_layout_file_is_written_beside_a_checkpoint_and_checked_on_resume(tmp_path):
    model = build(titan.TTConverter.Config(rank=4, min_size=0))
    step = tmp_path / "step-2"
    assert titan.write_layout([model], str(step))
    assert (step / "comera_tt.json").exists()
    assert titan.check_layout([model], str(step))
    other = build(titan.TTConverter.Config(rank=2, min_size=0))
    with pytest.raises(ValueError, match="field 'core_shapes'"):
        titan.check_layout([other], str(step))
    with pytest.raises(ValueError, match="no comera_tt.json"):
        titan.check_layout([model], str(tmp_path / "step-1"))
    assert not titan.check_layout([build()], str(tmp_path / "step-1"))  # a dense model needs none


def test_rank_adaptation_hooks_on_torchtitans_optimizer_prune_without_fsdp():
    model = build(titan.TTConverter.Config(rank=4, min_size=0))
    model._skip_lm_head = True
    container = OptimizersContainer.Config(param_groups=titan.param_group_configs(1e-2),
                                           implementation="for-loop").build(model_parts=[model])
    ranker = titan.attach_rank_adaptation(container, [model], cc.RankConfig(
        target_compression=2.0, prune_every=2, threshold=2.0, switch="manual"))
    before = ranker.ranks()
    loss_fn = titan.FusedCrossEntropyLoss.Config().build()
    loss_fn.set_lm_head(model.lm_head)
    for step in range(2):
        tokens, labels = batch(step)
        loss, _ = loss_fn(model(tokens), labels, (labels != IGNORE_INDEX).sum())
        loss.backward()
        ranker.observe(loss)
        container.step()  # the container's step runs the inner optimizer's hooks
        container.zero_grad()
    assert ranker.prune_events == 1 and ranker.ranks() != before
    assert all(max(r) < max(b) for r, b in zip(ranker.ranks().values(), before.values()))


def test_the_example_configs_parse_with_torchtitans_config_manager():
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    config = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera",
                                         "--training.steps", "7", "--dump_folder", "/tmp/x"])
    assert config.training.steps == 7 and isinstance(config.loss, titan.FusedCrossEntropyLoss.Config)
    assert isinstance(config.checkpoint, titan.CheckpointManager.Config)
    converter = config.model_spec.model._comera_tt_converter
    assert (converter.fmt, converter.rank, config.model_spec.model.dim) == ("btt", None, 2048)
    assert converter.tt_config().resolve("Linear", 2048, 8192)[:2] == ("btt", 1)
    assert [g.optimizer_kwargs["lr"] for g in config.optimizer.param_groups] == [4.8e-3] * 4
    assert type(config.activation_checkpoint) is SelectiveAC.Config  # no CUDA graph: torchtitan's own is kept
    chunked = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_fused_chunked"])
    assert chunked.loss.strategy == "chunked"
    save = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera_save"])
    assert type(save.activation_checkpoint) is titan.SelectiveAC.Config
    dense = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_dense"])
    assert isinstance(dense.loss, ChunkedLossWrapper.Config) and not hasattr(dense.model_spec.model,
                                                                              "_comera_tt_converter")
    assert config.training.disable_cuda_graphs and config.loss.backward == "filtered"
    for name in ("dense_ce_cg", "fused_cg", "comera_cg"):  # torchtitan's CUDA graph of the step, its default
        cg = ConfigManager().parse_args(["--module", "comera_configs", "--config", f"llama3_2048_{name}"])
        assert not cg.training.disable_cuda_graphs, name
        if name != "dense_ce_cg":
            assert isinstance(cg.loss, titan.FusedCrossEntropyLoss.Config) and cg.loss.backward == "exact", name
    assert hasattr(ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera_cg"]
                                              ).model_spec.model, "_comera_tt_converter")
    cg = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera_cg"])
    assert type(cg.activation_checkpoint) is titan.SelectiveAC.Config  # configure's default with the graph
    recompute = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera_recompute_cg"])
    assert type(recompute.activation_checkpoint) is SelectiveAC.Config  # save_ops=False: torchtitan's
    assert not recompute.training.disable_cuda_graphs and recompute.loss.backward == "exact"
    assert hasattr(recompute.model_spec.model, "_comera_tt_converter")
    for name in ("dense_ce_noac_cg", "comera_noac_cg"):  # nothing recomputed
        noac = ConfigManager().parse_args(["--module", "comera_configs", "--config", f"llama3_2048_{name}"])
        assert noac.activation_checkpoint is None and not noac.training.disable_cuda_graphs, name
        assert hasattr(noac.model_spec.model, "_comera_tt_converter") == name.startswith("comera"), name


def test_configure_save_ops_saves_the_comera_ops_where_the_step_is_captured(caplog):
    """save_ops=None: torchtitan's per-op SelectiveAC becomes titan.SelectiveAC (its settings kept, said at
    INFO) only for a tensorized job whose step is captured in a CUDA graph; True: for any job with
    torchtitan's per-op config, and a ValueError naming the config otherwise; False: left as given. A
    subclass of torchtitan's config, FullAC, no checkpointing and comera's own are never replaced."""
    import logging

    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC as TitanSAC

    class Mine(TitanSAC):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(TitanSAC.Config):
            pass

    tt = titan.TTConverter.Config(rank=4, min_size=0)

    def configured(ac, cuda_graphs=True, **kwargs):
        config = comera_configs._trainer(comera_configs._model(**comera_configs.TINY), lr=1e-3,
                                         **comera_configs.TRAIN_TINY)
        config.activation_checkpoint = ac
        config.training.disable_cuda_graphs = not cuda_graphs
        return titan.configure(config, **kwargs).activation_checkpoint

    given = TitanSAC.Config(preserve_rng_state=True, force_recompute_mm_shapes_by_fqns=["w2"])
    with caplog.at_level(logging.INFO, logger="comera_compile"):
        saved = configured(given, tt=tt)
    assert type(saved) is titan.SelectiveAC.Config and saved is not given
    assert {f.name: getattr(saved, f.name) for f in dataclasses.fields(given)} == \
        {f.name: getattr(given, f.name) for f in dataclasses.fields(given)}
    assert "saves the comera ops' outputs" in caplog.text and "save_ops=False" in caplog.text
    for kwargs, cuda_graphs in (({"tt": tt}, False), ({}, True), ({"tt": tt, "save_ops": False}, True)):
        ac = TitanSAC.Config()
        assert configured(ac, cuda_graphs, **kwargs) is ac, (kwargs, cuda_graphs)
    for ac in (Mine.Config(), FullAC.Config(), None, titan.SelectiveAC.Config()):
        assert configured(ac, tt=tt) is ac
    assert type(configured(TitanSAC.Config(), False, save_ops=True)) is titan.SelectiveAC.Config
    comera = titan.SelectiveAC.Config()
    assert configured(comera, save_ops=True) is comera
    for ac, name in ((FullAC.Config(), "FullAC"), (None, "None"), (Mine.Config(), "Mine")):
        with pytest.raises(ValueError, match=f"save_ops=True.*{name}.*not torchtitan's per-op SelectiveAC"):
            configured(ac, tt=tt, save_ops=True)
    with pytest.raises(ValueError, match="save_ops must be None"):
        configured(TitanSAC.Config(), tt=tt, save_ops="yes")


def test_configure_gives_a_captured_step_the_fused_loss_path_it_can_run(caplog):
    """torchtitan captures the step in a CUDA graph after one uncaptured step: the default fused loss then
    has its exact backward (no sparse rounds, which read a count on the host, in either step); without
    the graph, the filtered one. A given config is kept; a filtered one that may take the sparse path
    warns, naming the option."""
    import logging

    def trainer(cuda_graphs):
        config = comera_configs._trainer(comera_configs._model(**comera_configs.TINY), lr=1e-3,
                                         **comera_configs.TRAIN_TINY)
        config.training.disable_cuda_graphs = not cuda_graphs
        return config

    assert titan.configure(trainer(True)).loss.backward == "exact"
    assert titan.configure(trainer(False)).loss.backward == "filtered"
    exact = titan.FusedCrossEntropyLoss.Config(backward="exact")
    chunked = titan.FusedCrossEntropyLoss.Config(strategy="chunked")
    with caplog.at_level(logging.WARNING, logger="comera_compile"):
        assert titan.configure(trainer(True), fused_loss=exact).loss is exact
        assert titan.configure(trainer(True), fused_loss=chunked).loss is chunked
        default = titan.FusedCrossEntropyLoss.Config()
        assert titan.configure(trainer(False), fused_loss=default).loss.backward == "filtered"
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("comera_compile")]
    assert ours == []
    filtered = titan.FusedCrossEntropyLoss.Config()
    with caplog.at_level(logging.WARNING, logger="comera_compile"):
        assert titan.configure(trainer(True), fused_loss=filtered).loss is filtered
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("comera_compile")]
    assert len(ours) == 1 and "CUDA graph" in ours[0] and "backward='exact'" in ours[0], ours


# ------------------------------------------------------------------------------------------------
# FSDP2 (torchtitan's apply_fsdp_to_decoder) on 2 CPU processes over gloo
# ------------------------------------------------------------------------------------------------

WORLD = 2


def _fsdp_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(_fsdp_scenario(rank), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # every rank's collectives done before any tears its group down (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


def _fsdp_run(rank: int, loss_fn, batches) -> dict:
    """The tiny TT model under torchtitan's FSDP2 layout (TT parametrizations replicated first), this
    rank's microbatches through ``loss_fn``; the gathered gradients and torchtitan's clipped norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.utils import clip_grad_norm_

    model = build(titan.TTConverter.Config(rank=4, min_size=0))
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    assert titan.replicate_tt_params(model, mesh) == 10
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (torchtitan's divide factor 1)
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    valid = sum((lab != IGNORE_INDEX).sum() for r in range(WORLD) for _, lab in batches[r])
    model.zero_grad()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    loss = 0.0
    for tokens, labels in batches[rank]:  # torchtitan's accumulation: each over the step's global count
        part, _ = loss_fn(model(tokens), labels, valid)
        part.backward()
        loss = loss + part.detach()
    dist.all_reduce(loss)
    norm = clip_grad_norm_([p for p in model.parameters()], max_norm=1e9, foreach=True)
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    container = OptimizersContainer.Config(param_groups=titan.param_group_configs(1e-3),
                                           implementation="for-loop").build(model_parts=[model])
    container.step()  # AdamW over sharded and replicated DTensors on one mesh
    container.zero_grad()
    # rank adaptation over the DTensor gates: masked pruning (every gate below the threshold: each bond keeps 1)
    ranker = titan.attach_rank_adaptation(container, [model], cc.RankConfig(
        target_compression=2.0, prune_every=1, threshold=2.0, switch="manual"))
    sizes = {layer.fqn: list(layer.param.gate_sizes) for layer in cc.iter_tt_layers(model)}
    for tokens, labels in batches[rank][:1]:
        part, _ = loss_fn(model(tokens), labels, valid)
        part.backward()
        ranker.observe(part.detach())
    container.step()
    live = {layer.fqn: [int(g.ne(0).sum()) for g in layer.param.gate_flat.detach().full_tensor().split(
        layer.param.gate_sizes)] for layer in cc.iter_tt_layers(model)}
    ranking = {"mode": ranker.prune_mode, "events": ranker.prune_events, "ranks": ranker.ranks(), "live": live,
               "sizes": sizes, "sizes_after": {layer.fqn: list(layer.param.gate_sizes)
                                               for layer in cc.iter_tt_layers(model)}}
    return {"placements": placements, "loss": loss, "grads": grads, "norm": norm, "ranking": ranking}


def _fsdp_scenario(rank: int) -> dict:
    batches = [[batch(10 * r + m, ignored=0.1 + 0.3 * m) for m in range(2)] for r in range(WORLD)]
    fused = _fsdp_run(rank, titan.FusedCrossEntropyLoss.Config().build(), batches)
    chunked = _fsdp_run(rank, ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config()).build(),
                        batches)
    ref = build(titan.TTConverter.Config(rank=4, min_size=0)).double()
    ref._skip_lm_head = True  # the hidden states, then the head and the loss in float64 eager
    h = torch.cat([ref(tok).reshape(-1, DIM) for r in range(WORLD) for tok, _ in batches[r]])
    y = torch.cat([lab.reshape(-1) for r in range(WORLD) for _, lab in batches[r]])
    ref_loss = F.cross_entropy(F.linear(h, ref.lm_head.weight), y, ignore_index=IGNORE_INDEX)
    ref_loss.backward()
    return {"fused": fused, "chunked": chunked, "ref_loss": ref_loss.detach(),
            "ref_grads": {n: p.grad for n, p in ref.named_parameters()}}


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    return spawn_results(_fsdp_worker, tmp_path_factory.mktemp("titan_fsdp2"), WORLD)


def test_fsdp2_replicates_the_tt_cores_and_shards_the_rest(fsdp_results):
    for res in fsdp_results:
        for name, placement in res["fused"]["placements"].items():
            want = "(Replicate(),)" if "parametrizations" in name else "(Shard(dim=0),)"
            assert placement == want, (name, placement)


def test_fsdp2_fused_loss_equals_torchtitans_chunked_loss(fsdp_results):
    """Under torchtitan's FSDP2 layout, gradient accumulation and ignore_index: the fused loss gives the
    losses, gradients and clipped norm of torchtitan's own ChunkedLossWrapper."""
    for res in fsdp_results:
        fused, chunked = res["fused"], res["chunked"]
        torch.testing.assert_close(fused["loss"], chunked["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused["norm"], chunked["norm"], rtol=1e-4, atol=1e-6)
        assert fused["grads"].keys() == chunked["grads"].keys()
        for name, want in chunked["grads"].items():
            torch.testing.assert_close(fused["grads"][name], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_fsdp2_loss_matches_one_process_float64(fsdp_results):
    for res in fsdp_results:
        torch.testing.assert_close(res["fused"]["loss"].double(), res["ref_loss"], rtol=1e-5, atol=1e-6)
        head = res["fused"]["grads"]["lm_head.weight"].double()
        torch.testing.assert_close(head, res["ref_grads"]["lm_head.weight"], rtol=1e-4, atol=1e-6)


def test_fsdp2_decoder_gradients_match_one_process_float64(fsdp_results):
    for res in fsdp_results:
        for name, want in res["ref_grads"].items():
            torch.testing.assert_close(res["fused"]["grads"][name].double(), want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def test_rank_adaptation_masks_the_gates_where_fsdp2_holds_the_cores(fsdp_results):
    """FSDP2 fixes the TT parameters' shapes: the ranker prunes by masking (the exact match with a
    one-process run is tests/rank_adaptation/test_rank_adaptation_mask.py's); every process decides alike."""
    rankings = [res["fused"]["ranking"] for res in fsdp_results]
    for ranking in rankings:
        assert ranking["mode"] == "mask" and ranking["events"] == 1
        assert ranking["sizes_after"] == ranking["sizes"]  # no shape changed
        assert ranking["ranks"] == ranking["live"] == {k: [1] * len(v) for k, v in ranking["sizes"].items()}
        assert any(max(v) > 1 for v in ranking["sizes"].values())
    assert rankings[0]["ranks"] == rankings[1]["ranks"]


def test_the_validators_stream_follows_the_training_streams_rule():
    """Validation measures what training learns: another seed draws other samples of the same rule."""
    def transitions(seed):
        x, _ = next(iter(comera_configs._Tokens(vocab=64, seq_len=512, seed=seed, rank=0)))
        x = x["input"]
        return x, list(zip(x[:-1].tolist(), x[1:].tolist()))

    train, pairs = transitions(0)
    rule = {}
    for a, b in pairs:  # the most frequent successor of each token: the rule, up to the 10 % noise
        rule.setdefault(a, []).append(b)
    rule = {a: max(set(bs), key=bs.count) for a, bs in rule.items()}
    val, val_pairs = transitions(1)
    assert not torch.equal(train, val)
    known = [(a, b) for a, b in val_pairs if a in rule]
    assert len(known) > 300 and sum(rule[a] == b for a, b in known) / len(known) > 0.8


def test_the_synthetic_stream_follows_its_rule_token_by_token_and_resumes():
    """The stream, against the rule written out with tensors (x[t] = rule[x[t-1]], or the noise draw), for
    several samples, and a stream resumed from its state continues with the same samples."""
    vocab, seq_len = 50, 300
    rule = torch.randint(0, vocab, (vocab,), generator=torch.Generator().manual_seed(0))
    stream = comera_configs._Tokens(vocab=vocab, seq_len=seq_len, seed=3, rank=1)
    it = iter(stream)
    got = [next(it) for _ in range(3)]
    for i, (inputs, labels) in enumerate(got):
        g = torch.Generator().manual_seed((3 * 1000 + 1 + 1) * 1_000_003 + i)
        want = torch.empty(seq_len + 1, dtype=torch.long)
        want[0] = torch.randint(0, vocab, (1,), generator=g)
        noise = torch.rand(seq_len + 1, generator=g) < 0.1
        rand = torch.randint(0, vocab, (seq_len + 1,), generator=g)
        for t in range(1, seq_len + 1):
            want[t] = rand[t] if noise[t] else rule[want[t - 1]]
        assert torch.equal(inputs["input"], want[:-1]) and torch.equal(labels, want[1:])
        assert inputs["input"].dtype == labels.dtype == torch.long
    resumed = comera_configs._Tokens(vocab=vocab, seq_len=seq_len, seed=3, rank=1)
    resumed.load_state_dict({"step": 2})
    inputs, labels = next(iter(resumed))
    assert torch.equal(inputs["input"], got[2][0]["input"]) and torch.equal(labels, got[2][1])


def test_the_synthetic_loader_draws_the_same_batches_in_a_worker_and_resumes_there():
    """num_workers=1 (the d 2048 configs): the batches of the training process's own loop, and a loader
    resumed from a worker loader's state continues with the same batches; more workers would repeat the
    stream, so they are refused."""
    def make(workers):
        config = comera_configs.SyntheticDataLoader.Config(vocab_size=50, num_workers=workers,
                                                           persistent_workers=workers > 0)
        return comera_configs.SyntheticDataLoader(config, dp_world_size=1, dp_rank=0, seq_len=64,
                                                  local_batch_size=2)

    it = iter(make(0))
    want = [next(it) for _ in range(4)]
    loader = make(1)
    assert loader.num_workers == 1
    it = iter(loader)
    got = [next(it) for _ in range(2)]
    state = loader.state_dict()
    got += [next(it) for _ in range(2)]
    resumed = make(1)
    resumed.load_state_dict(state)
    it = iter(resumed)
    got += [next(it) for _ in range(2)]
    for (w_in, w_lab), (g_in, g_lab) in zip(want + want[2:], got):
        assert torch.equal(w_in["input"], g_in["input"]) and torch.equal(w_lab, g_lab)
    with pytest.raises(ValueError, match="num_workers=2; the stream is one sequence of samples per rank"):
        make(2)
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "comera_configs", "--config", "llama3_2048_comera_cg"])
    assert config.dataloader.num_workers == 1 and config.validator.dataloader.num_workers == 0


def test_the_launchers_device_busy_time_leaves_out_annotations():
    """examples/torchtitan/launch.py --profile-steps: a step's device busy time and kernel count sum the
    device events but not the user annotations on the device timeline (the optimizer's step, FSDP's
    pre-backward), which span kernels counted already."""
    import launch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(device_type=cuda, self_device_time_total=300.0, count=3, is_user_annotation=False),
              SimpleNamespace(device_type=cuda, self_device_time_total=120.0, count=2, is_user_annotation=False),
              SimpleNamespace(device_type=cuda, self_device_time_total=390.0, count=1, is_user_annotation=True),
              SimpleNamespace(device_type=cpu, self_device_time_total=50.0, count=9, is_user_annotation=False)]
    assert launch._device_totals(events) == (420.0, 5)
    for e, key in zip(events, ("gemm", "copy", "annotation", "host")):
        e.key = key
    rows = launch._kernels_by_count(events, steps=1)
    assert len(rows) == 2 and rows[0].endswith("  gemm") and rows[1].endswith("  copy")  # by launches
    assert rows[0].split()[:4] == ["3.0", "x", "100.0", "us"] and "0.30 ms" in rows[0]


@pytest.mark.parametrize("argv, message", [
    (["--profile-python"], "--profile-python needs --profile-steps A:B"),
    (["--profile-steps", "5"], "--profile-steps takes A:B"),
    (["--profile-steps", "x:y"], "--profile-steps takes A:B"),
])
def test_the_launchers_profiling_flags_refuse_what_they_cannot_do(argv, message, monkeypatch):
    """examples/torchtitan/launch.py: a profiling flag it cannot honour stops the launch with a message
    naming the flag, before torchtitan starts."""
    import launch

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # launch.main rewrites sys.argv
    with pytest.raises(SystemExit, match=message):
        launch.main(argv)
