"""torchtitan 0.3.0 config functions for the comera demo (``--module comera_configs --config <name>``).

Offline: a synthetic token stream (:class:`SyntheticDataLoader`, no dataset download) and no tokenizer
files (:class:`NullTokenizer`), so nothing is fetched from a hub. The stream is learnable (each token
follows from the one before by a fixed random table of ``vocab`` entries, with 10 % noise: a loss floor
near 0.1 x ln(vocab) + 0.33), so the loss curve falls within a few hundred steps.

Four variants of each model, the same data, schedule and batch:

* ``*_dense``: torchtitan's own setup (its ``ChunkedLossWrapper`` over the dense head; on torch 2.11 it
  fails in its backward, inside torchtitan and torch: "The tensor has a non-zero number of elements,
  but its data is not allocated yet" on the GPU, a segmentation fault on the CPU);
* ``*_dense_ce``: torchtitan's plain ``CrossEntropyLoss`` over the dense head (the logits formed), the
  dense baseline that runs on every torch here;
* ``*_fused``: the fused LM-head loss (``comera_compile.titan.FusedCrossEntropyLoss``);
* ``*_comera``: the fused loss and the blocks' Linears as tensor trains (``TTConverter``), with
  ``cc.param_groups``' learning-rate groups;
* ``llama3_2048_fused_chunked``: ``*_fused`` on the fused loss's chunked path only (no host syncs);
* ``llama3_2048_{dense_ce,fused,comera}_cg``: the same with torchtitan's CUDA graph of the forward and
  backward (its default; off in the variants above);
  ``llama3_2048_comera_cg`` is ``titan.configure``'s default for a captured step: its activation
  checkpointing (``titan.SelectiveAC``) saves the comera ops' outputs instead of recomputing them in the
  backward as torchtitan's own selective checkpointing does; ``llama3_2048_comera_recompute_cg`` keeps
  torchtitan's (``save_ops=False``);
* ``llama3_2048_comera_save``: ``*_comera`` (no CUDA graph) with the comera ops saved (``save_ops=True``);
* ``llama3_2048_{dense_ce,comera}_noac_cg``: the CUDA-graph variants without activation checkpointing
  (nothing recomputed; more memory).

Models: ``llama3_2048_*`` (Llama-3 style, d 2048, 16 layers, 32 heads, 8 KV heads, vocab 32768, seq
2048; for one GPU) and ``llama3_tiny_*`` (d 64, 2 layers, vocab 256, seq 32; the CPU smoke run, with
PyTorch's SDPA attention since FlexAttention has no backward on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import IterableDataset

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.validate import Validator
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import _build_llama3_layers, parallelize_llama
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from comera_compile import RankConfig, titan


class NullTokenizer(BaseTokenizer):
    """A tokenizer with a vocabulary size and nothing to load (the data are token ids already)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("NullTokenizer has no text vocabulary: the synthetic data are token ids")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("NullTokenizer has no text vocabulary")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _Tokens(IterableDataset):
    """An endless stream of ([seq_len] input, [seq_len] labels): x[t] = rule[x[t-1]] (a fixed random
    table of ``vocab`` entries, the same for every seed), a uniform random token instead 10 % of the time;
    ``seed`` draws the samples (the validator's stream: seed 1); one stream per data-parallel rank,
    resumable (its state is the number of samples drawn)."""

    def __init__(self, vocab: int, seq_len: int, seed: int, rank: int):
        self.vocab, self.seq_len, self.seed, self.rank = vocab, seq_len, seed, rank
        self.step = 0

    def __iter__(self):
        # Python lists, not tensors, in the per-token loop: indexing a tensor element by element cost ~15 ms
        # per 2048-token sample on the training process's CPU (60 ms of every 4 x 2048-token step), enough
        # to bound a fast step; the lists give the same tokens in ~0.4 ms
        rule = torch.randint(0, self.vocab, (self.vocab,), generator=torch.Generator().manual_seed(0)).tolist()
        while True:  # sample i from its own seed: a resumed run (load_state_dict) continues the same stream
            g = torch.Generator().manual_seed((self.seed * 1000 + self.rank + 1) * 1_000_003 + self.step)
            token = int(torch.randint(0, self.vocab, (1,), generator=g))
            noise = (torch.rand(self.seq_len + 1, generator=g) < 0.1).tolist()
            rand = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g).tolist()
            tokens = [token]
            for t in range(1, self.seq_len + 1):
                token = rand[t] if noise[t] else rule[token]
                tokens.append(token)
            x = torch.tensor(tokens, dtype=torch.long)
            self.step += 1
            yield {"input": x[:-1]}, x[1:]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class SyntheticDataLoader(ParallelAwareDataloader):
    """torchtitan's dataloader slot over :class:`_Tokens`. ``num_workers=1`` draws the samples in a worker
    process, ahead of the step (the same samples; the d 2048 configs: a 4 x 2048-token batch takes ~4 ms of
    Python, which the training process would otherwise spend between CUDA-graph replays)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 256
        seed: int = 0
        infinite: bool = True  # the validator sets it; the stream is endless either way

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer=None, seq_len: int,
                 local_batch_size: int, **kwargs):
        dataset = _Tokens(config.vocab_size, seq_len, config.seed, dp_rank)
        workers = {}
        if config.num_workers > 0:  # at most one: more would each draw the same stream
            if config.num_workers > 1:
                raise ValueError(f"SyntheticDataLoader: num_workers={config.num_workers}; the stream is one "
                                 f"sequence of samples per rank: 0 (the training process) or 1")
            workers = dict(num_workers=1, persistent_workers=config.persistent_workers,
                           prefetch_factor=config.prefetch_factor or 2)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                         pin_memory=config.pin_memory, **workers)


def _model(dim: int, n_layers: int, n_heads: int, n_kv_heads: int | None, vocab: int, max_seq_len: int,
           attn_backend: str, ffn_multiple: int) -> Llama3Model.Config:
    s = dim ** -0.5
    layers = _build_llama3_layers(
        n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=ffn_multiple),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=max_seq_len, theta=500000, scaling="llama"),
        attn_backend="flex" if attn_backend == "sdpa" else attn_backend)
    if attn_backend == "sdpa":  # causal SDPA (no document masks: the synthetic stream has none)
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init={"weight": lambda w: nn.init.trunc_normal_(w, std=s, a=-3 * s, b=3 * s)}),
        layers=layers)


def _trainer(model: Llama3Model.Config, *, vocab: int, seq_len: int, batch: int, steps: int, lr: float,
             dtype: str, log_freq: int, ac: bool, compile: bool, chunked: bool = True,
             data_workers: int = 0) -> Trainer.Config:
    spec = ModelSpec(name="llama3", flavor="comera_demo", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path="",
        tokenizer=NullTokenizer.Config(vocab_size=vocab),
        dataloader=SyntheticDataLoader.Config(vocab_size=vocab, num_workers=data_workers,
                                              persistent_workers=data_workers > 0),
        loss=(ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)) if chunked
              else CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=max(1, steps // 20), decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps, disable_cuda_graphs=True,
                                mixed_precision_param=dtype),
        metrics=MetricsProcessor.Config(log_freq=log_freq, disable_color_printing=True),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=SelectiveAC.Config() if ac else None,
        compile=CompileConfig(enable=compile),  # blocks and loss; TT layers lowered inside it (TTConverter)
        # --validator.enable: 4 batches of another synthetic stream (the same rule, other samples)
        validator=Validator.Config(steps=4, freq=max(1, steps // 4),
                                   dataloader=SyntheticDataLoader.Config(vocab_size=vocab, seed=1)),
    )
    return config


# ---------------------------------------------------------------------------------------------
# The d 2048 Llama-3-style model, one GPU (FSDP2 at world size 1, bf16 parameters)
# ---------------------------------------------------------------------------------------------

# Causal SDPA, as in the tiny configs: torchtitan builds flex attention's block masks only from the positions a
# document-aware loader hands it, and the synthetic stream has no documents (flex got no mask: an AssertionError).
D2048 = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab=32768, max_seq_len=2048, attn_backend="sdpa",
             ffn_multiple=1024)
TRAIN_2048 = dict(vocab=32768, seq_len=2048, batch=4, steps=300, dtype="bfloat16", log_freq=5, ac=True,
                  compile=True, data_workers=1)  # the batches drawn in a worker, ahead of the step
TT_2048 = titan.TTConverter.Config(fmt="btt", min_size=0)  # rank 1: the d 2048 width study's winning format


def llama3_2048_dense() -> Trainer.Config:
    return _trainer(_model(**D2048), lr=6e-4, **TRAIN_2048)


def llama3_2048_dense_ce() -> Trainer.Config:
    return _trainer(_model(**D2048), lr=6e-4, chunked=False, **TRAIN_2048)


def llama3_2048_fused() -> Trainer.Config:
    return titan.configure(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048), fused_loss=True)


def llama3_2048_fused_chunked() -> Trainer.Config:
    # the fused loss pinned to its chunked path: no sparse rounds, so no host synchronization inside the step
    # ("auto" may pick sparse rounds once it has seen the kept fraction of peaked logits)
    return titan.configure(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048),
                           fused_loss=titan.FusedCrossEntropyLoss.Config(strategy="chunked"))


def llama3_2048_comera() -> Trainer.Config:
    # btt r1 trains best at a higher lr than its dense twin (cc.param_groups' docs: 4.8e-3 to 9.6e-3 at d 2048)
    return titan.configure(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048), tt=TT_2048, fused_loss=True, lr=4.8e-3)


def _cuda_graphs(config: Trainer.Config) -> Trainer.Config:
    # torchtitan's default: the forward and backward captured in one CUDA graph after an uncaptured step
    config.training.disable_cuda_graphs = False
    return config


def llama3_2048_dense_ce_cg() -> Trainer.Config:
    return _cuda_graphs(llama3_2048_dense_ce())


def llama3_2048_fused_cg() -> Trainer.Config:
    # set before configure, which then picks the fused loss's capturable path (backward="exact")
    return titan.configure(_cuda_graphs(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048)), fused_loss=True)


def llama3_2048_comera_cg() -> Trainer.Config:
    return titan.configure(_cuda_graphs(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048)), tt=TT_2048,
                           fused_loss=True, lr=4.8e-3)


def llama3_2048_comera_recompute_cg() -> Trainer.Config:
    # torchtitan's own selective checkpointing, which recomputes the comera ops in the backward
    return titan.configure(_cuda_graphs(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048)), tt=TT_2048,
                           fused_loss=True, lr=4.8e-3, save_ops=False)


def llama3_2048_comera_save() -> Trainer.Config:
    # without the CUDA graph configure keeps torchtitan's checkpointing; this saves the comera ops anyway
    return titan.configure(_trainer(_model(**D2048), lr=6e-4, **TRAIN_2048), tt=TT_2048, fused_loss=True,
                           lr=4.8e-3, save_ops=True)


def _no_ac(config: Trainer.Config) -> Trainer.Config:
    config.activation_checkpoint = None
    return config


def llama3_2048_dense_ce_noac_cg() -> Trainer.Config:
    return _no_ac(llama3_2048_dense_ce_cg())


def llama3_2048_comera_noac_cg() -> Trainer.Config:
    return _no_ac(llama3_2048_comera_cg())


# ---------------------------------------------------------------------------------------------
# The tiny model, for the CPU smoke run (fp32, SDPA attention)
# ---------------------------------------------------------------------------------------------

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=None, vocab=256, max_seq_len=256, attn_backend="sdpa",
            ffn_multiple=64)
TRAIN_TINY = dict(vocab=256, seq_len=32, batch=4, steps=2, dtype="float32", log_freq=1, ac=False,
                  compile=False)  # --compile.enable compiles it too (slow on the CPU)
TT_TINY = titan.TTConverter.Config(rank=4, min_size=0)


def llama3_tiny_dense() -> Trainer.Config:
    return _trainer(_model(**TINY), lr=1e-3, **TRAIN_TINY)


def llama3_tiny_dense_ce() -> Trainer.Config:
    return _trainer(_model(**TINY), lr=1e-3, chunked=False, **TRAIN_TINY)


def llama3_tiny_fused() -> Trainer.Config:
    return titan.configure(_trainer(_model(**TINY), lr=1e-3, **TRAIN_TINY), fused_loss=True)


def llama3_tiny_comera() -> Trainer.Config:
    return titan.configure(_trainer(_model(**TINY), lr=1e-3, **TRAIN_TINY), tt=TT_TINY, fused_loss=True, lr=4e-3)


def llama3_tiny_comera_sac() -> Trainer.Config:
    # selective activation checkpointing on the TT model, the comera ops' outputs saved (titan.SelectiveAC)
    config = _trainer(_model(**TINY), lr=1e-3, **TRAIN_TINY)
    config.activation_checkpoint = SelectiveAC.Config()  # torchtitan's, which configure replaces
    return titan.configure(config, tt=TT_TINY, fused_loss=True, lr=4e-3, save_ops=True)


def llama3_tiny_comera_ranks() -> Trainer.Config:
    # rank adaptation under torchtitan's FSDP2: pruning masks the gates (the shapes stay); a threshold above
    # every gate, so that the first event (step 2) takes each bond to rank 1
    ranks = RankConfig(target_compression=2.0, prune_every=2, threshold=2.0, switch="manual")
    return titan.configure(_trainer(_model(**TINY), lr=1e-3, **TRAIN_TINY), tt=TT_TINY, fused_loss=True, lr=4e-3,
                           rank_adaptation=ranks)
