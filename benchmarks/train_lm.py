"""Train a small GPT-style language model on the Python sources installed with the interpreter, through comera.

    python benchmarks/train_lm.py                                    # CPU or GPU, byte tokens, backend "comera"
    python benchmarks/train_lm.py --backend eager                    # the same model without torch.compile
    python benchmarks/train_lm.py --tokenizer bpe --vocab-size 4096 --device cuda --steps 2000
    python benchmarks/train_lm.py --preset gpu                       # d_model 768, 6 layers, BPE 16k, bf16 (one GPU)
    python benchmarks/train_lm.py --preset gpu --tensorize 32 --fmt ttm      # TT-matrix blocks of rank 32
    python benchmarks/train_lm.py --preset gpu --lowrank 37                  # blocks as plain rank-37 products
    python benchmarks/train_lm.py --preset gpu --btt 1                       # blocks as Monarch (BTT rank 1) matrices

The model is written the way users write one (pre-LN blocks, causal attention through
F.scaled_dot_product_attention, a tied LM head and F.cross_entropy on shifted logits): the backend finds
the patterns it rewrites by itself. The corpus is read from the running interpreter, so nothing is downloaded:
--corpus stdlib (its standard library) or python (the standard library and every installed package's
*.py files, deduplicated by content; --max-corpus-mb takes a random-like sample of files, split into
train and validation by file). The corpus' manifest (every file, its sha1 and split) is written next to
the token cache. Training visits the train split's non-overlapping windows of --seq-len tokens in a
seeded random order, each once: a run that needs more than one epoch stops before it starts unless
--allow-repeat. Validation is a fixed set of evenly spaced windows of the validation files.

Presets set the defaults that flags given on the command line override:
  cpu (default): d_model 128, 2 layers, 4 heads, fused qkv, byte tokens, seq 128, batch 16, lr 3e-3, 150 steps,
       corpus stdlib (all of it, ~30 MB)
  gpu: d_model 768, 6 layers, 12 heads, separate q/k/v, BPE vocabulary 16384, seq 512, batch 32,
       1000 steps, bf16 autocast on CUDA, fused AdamW; validation every 100 steps on 16 fixed batches;
       lr by what is compressed (the best of each in the quality benchmark: dense 6e-4, TT-matrix 4.8e-3,
       BTT 9.6e-3, rank-adaptive 2.4e-3, "tt" 1.2e-3, low-rank 2.4e-3, low-rank + activation 1.2e-3);
       corpus python capped at 200 MB (the run prints its token counts)

Compression: --tensorize RANK tensorizes the kinds of layer --compress names (attn, mlp, tok, pos, head;
default attn,mlp: the transformer blocks). --tensorize, --fmt and --tt-init-std take one value for every
kind or KIND=VALUE pairs, e.g. --tensorize attn=32,mlp=16 --fmt attn=tt,mlp=ttm,emb=ttm (emb: tok and pos).
The plain low-rank baseline: --lowrank RANK replaces each Linear of the --compress kinds (attn, mlp; head
when untied) by two Linears, d_in -> RANK -> d_out, with no nonlinearity between (--lowrank-act silu puts
one there: CoLA's low-rank activation). --btt RANK replaces them by two-core block tensor-trains (Monarch
at rank 1), two batched GEMMs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling data.py, also when imported by tests
from data import CORPORA, TokenData, load_token_data  # noqa: E402

try:  # registers the "comera" backend in a source checkout; an installed package registers it by entry point
    import comera_compile as cc
except ImportError:  # pragma: no cover - the example still runs with torch's own backends
    cc = None

KINDS = ("attn", "mlp", "tok", "pos", "head")  # the layer kinds --compress selects
KIND_KEYS = KINDS + ("emb",)  # keys of KIND=VALUE options; emb: tok and pos

PRESETS = {
    "cpu": dict(steps=150, batch_size=16, seq_len=128, lr=3e-3, d_model=128, n_layers=2, n_heads=4, qkv="fused",
                tokenizer="bytes", vocab_size=None, precision="auto", device="auto", eval_every=50, eval_batches=8,
                corpus="stdlib", max_corpus_mb=None),
    "gpu": dict(steps=1000, batch_size=32, seq_len=512, lr=None, d_model=768, n_layers=6, n_heads=12,
                qkv="separate", tokenizer="bpe", vocab_size=16384, precision="bf16", device="cuda", eval_every=100,
                eval_batches=16, corpus="python", max_corpus_mb=200.0),
}


class CausalSelfAttention(nn.Module):
    """``qkv="fused"``: one ``qkv`` Linear (GPT-2); ``"separate"``: ``q``, ``k``, ``v`` Linears (Llama),
    which a tensor-train layer compresses separately instead of into one shared subspace."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, qkv: str = "fused"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"--d-model {d_model} must be divisible by --n-heads {n_heads}")
        if qkv not in ("fused", "separate"):
            raise ValueError(f"--qkv must be 'fused' or 'separate', got {qkv!r}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.fused = qkv == "fused"
        if self.fused:
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        else:
            self.q = nn.Linear(d_model, d_model, bias=False)
            self.k = nn.Linear(d_model, d_model, bias=False)
            self.v = nn.Linear(d_model, d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2) if self.fused else (self.q(x), self.k(x), self.v(x))
        q = q.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, qkv: str = "fused"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, qkv)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


ACTIVATIONS = {"none": None, "silu": F.silu, "gelu": F.gelu}  # --lowrank-act


class LowRankLinear(nn.Module):
    """A Linear of rank ``rank``: ``up(act(down(x)))``, ``d_in -> rank -> d_out`` (the bias, if any, on
    ``up``). With ``act="none"`` (the plain low-rank baseline) the dense map it computes is
    ``up.weight @ down.weight``; with ``"silu"`` or ``"gelu"`` the layer is CoLA's low-rank activation
    (Liu et al. 2025: a nonlinearity in the bottleneck), no longer a linear map."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device=None, dtype=None, act: str = "none"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        self.act = act
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        fn = ACTIVATIONS[self.act]
        return self.up(h if fn is None else fn(h))

    def extra_repr(self) -> str:
        return f"act={self.act}"

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Both factors N(0, s^2) with ``s = (std^2 / rank) ** 0.25``: each entry of the product
        (a sum of ``rank`` products of two factors' entries) then has the std ``std`` of the dense
        layer it replaces; the bias zero."""
        factor_std = (std**2 / self.down.out_features) ** 0.25
        nn.init.normal_(self.down.weight, std=factor_std)
        nn.init.normal_(self.up.weight, std=factor_std)
        if self.up.bias is not None:
            nn.init.zeros_(self.up.bias)


def near_sqrt_factor(n: int) -> int:
    """The divisor of ``n`` closest to its square root in ratio (the larger of two equally close)."""
    from fractions import Fraction  # exact: 24 and 32 are equally close to sqrt(768)

    return min((d for d in range(1, n + 1) if n % d == 0),
               key=lambda d: (Fraction(max(d * d, n), min(d * d, n)), -d))


class BTTLinear(nn.Module):
    """A Linear as a two-core block tensor-train of rank ``rank`` (BTT, Qiu et al. 2024; Monarch at rank 1).

    The input splits into ``b1 x b2`` (``b1`` blocks), the output into ``c x a`` (``c`` blocks), each near
    the square root. Core ``R`` ``[b1, b2, c * rank]`` maps each input block's ``b2`` entries to ``c * rank``
    values; core ``L`` ``[c, b1 * rank, a]`` maps, for each output block, the ``b1 * rank`` values routed to
    it to its ``a`` outputs: two batched GEMMs, ``2 * tokens * (R.numel() + L.numel())`` FLOPs. The dense
    weight is ``W[(c, a), (b1, b2)] = sum_k L[c, (b1, k), a] * R[b1, b2, (c, k)]`` (:meth:`dense_weight`);
    it is full-rank in general, even at rank 1."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.b1 = near_sqrt_factor(in_features)
        self.b2 = in_features // self.b1
        self.c = near_sqrt_factor(out_features)
        self.a = out_features // self.c
        self.R = nn.Parameter(torch.empty(self.b1, self.b2, self.c * rank, device=device, dtype=dtype))
        self.L = nn.Parameter(torch.empty(self.c, self.b1 * rank, self.a, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters(GPT.INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        n = x.numel() // self.in_features
        t = torch.bmm(x.reshape(n, self.b1, self.b2).transpose(0, 1), self.R)  # [b1, n, c * rank]
        t = t.view(self.b1, n, self.c, self.rank).permute(2, 1, 0, 3).reshape(self.c, n, self.b1 * self.rank)
        y = torch.bmm(t, self.L).transpose(0, 1).reshape(*lead, self.out_features)  # [c, n, a] -> [..., c * a]
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight this layer applies."""
        R = self.R.view(self.b1, self.b2, self.c, self.rank)
        L = self.L.view(self.c, self.b1, self.rank, self.a)
        return torch.einsum("cjka,jbck->cajb", L, R).reshape(self.out_features, self.in_features)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Each core N(0, g^2 / fan_in), its fan-in ``b2`` for ``R`` and ``b1 * rank`` for ``L``, with
        ``g = (std^2 * in_features) ** 0.25``: the output then has the variance a dense layer of init std
        ``std`` gives it; the bias zero."""
        gain = (std**2 * self.in_features) ** 0.25
        nn.init.normal_(self.R, std=gain / math.sqrt(self.b2))
        nn.init.normal_(self.L, std=gain / math.sqrt(self.b1 * self.rank))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, rank={self.rank}, "
                f"blocks in {self.b1}x{self.b2}, out {self.c}x{self.a}")


class GPT(nn.Module):
    INIT_STD = 0.02  # every Linear and Embedding starts at N(0, INIT_STD^2)

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int,
                 dropout: float = 0.0, qkv: str = "fused", tie_head: bool = True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout, qkv) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_head:
            self.lm_head.weight = self.tok_emb.weight  # tied input/output embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=GPT.INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]``, or with ``labels`` the mean next-token cross-entropy."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        shift_logits = logits[:, :-1, :]
        shift_labels = labels[:, 1:]
        return F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]).float(), shift_labels.reshape(-1))


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device | str = "cpu") -> GPT:
    """The example's model as the flags describe it (dense; :func:`compress` tensorizes it)."""
    with torch.device(device):
        return GPT(vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads, args.dropout, args.qkv,
                   tie_head=args.head == "tied")


def layer_kind(fqn: str) -> str | None:
    """Which of :data:`KINDS` the module ``fqn`` of :class:`GPT` is (None: not a compressible layer)."""
    parts = fqn.split(".")
    if fqn in ("tok_emb", "pos_emb"):
        return fqn[:3]
    if fqn == "lm_head":
        return "head"
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] in ("attn", "mlp"):
        return parts[2]
    return None


def factor_linears_(model: nn.Module, ranks: dict, kinds: tuple[str, ...], act: str = "none",
                    structure: str = "lowrank") -> list[str]:
    """Replace each ``nn.Linear`` of the given kinds by a :class:`LowRankLinear` (``structure="lowrank"``,
    with ``act`` between its factors) or a :class:`BTTLinear` (``"btt"``) of its kind's rank (from
    :func:`per_kind`), started at the model's init std; returns the names replaced."""
    if structure not in ("lowrank", "btt"):
        raise ValueError(f"structure must be 'lowrank' or 'btt', got {structure!r}")
    replaced = []
    for fqn, module in list(model.named_modules()):
        kind = layer_kind(fqn)
        if kind not in kinds or not isinstance(module, nn.Linear):
            continue
        rank = for_kind(ranks, kind)
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        where = dict(bias=module.bias is not None, device=module.weight.device, dtype=module.weight.dtype)
        if structure == "btt":
            low = BTTLinear(module.in_features, module.out_features, rank, **where)
        else:
            low = LowRankLinear(module.in_features, module.out_features, rank, act=act, **where)
            low.reset_parameters(GPT.INIT_STD)
        setattr(parent, child, low)
        replaced.append(fqn)
    return replaced


# ------------------------------------------------------------------------------------------------ options


def per_kind(cast: Callable[[str], object], what: str) -> Callable[[str], dict]:
    """An argparse type for ``VALUE`` (every kind) or ``KIND=VALUE,KIND=VALUE`` (those kinds)."""

    def parse(text: str) -> dict:
        if "=" not in text:
            return {"*": _cast(cast, text, what)}
        out = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep or key not in KIND_KEYS:
                raise argparse.ArgumentTypeError(
                    f"{item!r}: expected KIND={what} with KIND one of {', '.join(KIND_KEYS)} (emb: tok and pos)")
            out[key] = _cast(cast, value, what)
        return out

    return parse


def _cast(cast, value: str, what: str):
    try:
        return cast(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a valid {what}") from None


def _rank(value: str) -> int | str:
    """A positive int, or "default": TTConfig's own default rank."""
    if value == "default":
        return value
    rank = int(value)
    if rank < 1:
        raise ValueError(value)
    return rank


def _fmt(value: str) -> str:
    if value not in ("auto", "tt", "ttm", "btt"):
        raise ValueError(value)
    return value


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown kinds {bad}; valid: {', '.join(KINDS)}")
    return kinds


def for_kind(mapping: dict | None, kind: str):
    """The value of ``mapping`` (from :func:`per_kind`) for one layer kind, or None."""
    if not mapping:
        return None
    for key in (kind, "emb" if kind in ("tok", "pos") else None, "*"):
        if key in mapping:
            return mapping[key]
    return None


# --preset gpu's learning rate when --lr is not given: each the best of its row in the quality benchmark
# (GPT d 768, batch 32 x 512, 31 M tokens; a sweep of three, factor 2 apart, then its follow-ups past the
# edges). TT-matrix learned best at 8x dense's lr (4.8e-3; 9.6e-3 was worse), BTT at 16x (9.6e-3 through
# the package: 2.595 / 2.572 over two seeds against 2.685 at 4.8e-3 and 2.710 at 1.92e-2).
GPU_LRS = {"dense": 6e-4, "ttm": 4.8e-3, "btt": 9.6e-3, "rank-adapt": 2.4e-3, "tt": 1.2e-3, "lowrank": 2.4e-3,
           "lowrank-act": 1.2e-3}


def gpu_default_lr(args: argparse.Namespace) -> float:
    """The learning rate ``--preset gpu`` gives the run the flags describe (:data:`GPU_LRS`); a
    tensorized run with several formats takes the smallest of theirs."""
    if args.btt is not None:
        return GPU_LRS["btt"]
    if args.lowrank is not None:
        return GPU_LRS["lowrank" if args.lowrank_act == "none" else "lowrank-act"]
    if args.tensorize is None:
        return GPU_LRS["dense"]
    if args.rank_adapt is not None:
        return GPU_LRS["rank-adapt"]
    formats = {for_kind(args.fmt, kind) or "auto" for kind in args.compress}
    return min(GPU_LRS[fmt if fmt in ("tt", "btt") else "ttm"] for fmt in formats)  # "auto": TT-matrix everywhere


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="defaults for the flags below (see above)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--lr", type=float, help="peak learning rate (linear warmup, cosine decay to 10%%); "
                                            "--preset gpu: by what is compressed (see above)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    g.add_argument("--weight-decay", type=float, default=0.1, help="on dense matrices and embeddings")
    g.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=0,
                   help="initialization and the order of the training windows (not the validation set)")
    g.add_argument("--allow-repeat", action="store_true",
                   help="let a run that needs more than one epoch of the train split go on into a second "
                        "(a new order of the same windows); without it such a run stops before training")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--qkv", choices=["fused", "separate"], help="one qkv projection or separate q, k, v")
    g.add_argument("--head", choices=["tied", "untied"], default="tied",
                   help="LM head tied to the token embedding (default) or its own matrix")
    g.add_argument("--dropout", type=float, default=0.0)
    g = p.add_argument_group("data")
    g.add_argument("--tokenizer", choices=["bytes", "bpe"],
                   help="bytes: vocabulary 256, no dependency; bpe: trained here on the corpus (needs `tokenizers`)")
    g.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default 4096)")
    g.add_argument("--corpus", choices=CORPORA,
                   help="stdlib: the standard library's *.py files; python: those and every installed package's "
                        "(site-packages), deduplicated by content")
    g.add_argument("--max-corpus-mb", type=float,
                   help="read at most this many MB of the corpus' files, taken in the order of a hash of their "
                        "paths (a random-like sample); 0: all")
    g.add_argument("--cache-dir", type=Path, default=_default_cache_dir(),
                   help="BPE tokenizer and tokenized corpus cache, shared by concurrent runs (default: %(default)s)")
    g.add_argument("--no-cache", action="store_true", help="train and tokenize again, write no cache")
    g = p.add_argument_group("compilation and device")
    g.add_argument("--backend", default="comera",
                   help='torch.compile backend: "comera" (default), any torch backend name, or "eager" for no torch.compile')
    g.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON",
                   help='passed to torch.compile(options=...), e.g. \'{"inner": "aot_eager"}\'')
    g.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA graphs in the compiled model (backends comera and inductor); pays off when kernel "
                        "launches dominate, e.g. tensor-train layers")
    g.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    g.add_argument("--explain", action="store_true",
                   help="backend comera: print cc.explain's report (rewrites, skipped candidates, graphs) first")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], help="auto: bf16 autocast on GPU, fp32 on CPU")
    g = p.add_argument_group("compression")
    g.add_argument("--tensorize", type=per_kind(_rank, "RANK"), default=None, metavar="RANK",
                   help="tensorize the --compress layers to tensor trains of this rank (cc.tensorize_), "
                        "'default' (TTConfig's default rank), or per kind: attn=32,mlp=16")
    g.add_argument("--compress", type=_kinds, default=("attn", "mlp"), metavar="KINDS",
                   help=f"which layers --tensorize compresses, from {','.join(KINDS)} (default: attn,mlp); "
                        "tok or head with the tied head needs --tied share or untie (or --head untied)")
    g.add_argument("--lowrank", type=per_kind(_rank, "RANK"), default=None, metavar="RANK",
                   help="the plain low-rank baseline: each Linear of the --compress kinds (attn, mlp; head when "
                        "untied) as two Linears d_in -> RANK -> d_out (no nonlinearity), each factor started so "
                        "their product has the dense init's std; or per kind: attn=32,mlp=48")
    g.add_argument("--lowrank-act", choices=sorted(ACTIVATIONS), default="none",
                   help="with --lowrank: a nonlinearity between the two factors (silu: CoLA's low-rank "
                        "activation); default none, the plain low-rank baseline")
    g.add_argument("--btt", type=per_kind(_rank, "RANK"), default=None, metavar="RANK",
                   help="each Linear of the --compress kinds (attn, mlp; head when untied) as a two-core block "
                        "tensor-train of this rank (BTT; rank 1 is a Monarch matrix): two batched GEMMs, blocks "
                        "near the square root of each side; or per kind: attn=1,mlp=2")
    g.add_argument("--tied", choices=["skip", "share", "untie"], default="skip",
                   help="tensorize_(tied=...) for the tied token embedding and head: skip (stay dense), share "
                        "(one TT for both), untie (a TT each)")
    g.add_argument("--fmt", type=per_kind(_fmt, "FMT"), default=None, metavar="FMT",
                   help="TTConfig.fmt: auto (default), tt, ttm or btt (the package's block tensor-train; --btt is "
                        "the example's plain-torch one); or per kind: attn=tt,mlp=ttm,emb=ttm")
    g.add_argument("--tt-cores", type=per_kind(int, "N"), default=None, metavar="N",
                   help="TTConfig.n_cores: cores per tensorized layer (default: tensorize_'s, 3 at d 768); or per "
                        "kind: attn=2,mlp=4")
    g.add_argument("--tt-activation", choices=["none", "relu", "gelu", "silu"], default="none",
                   help="TTConfig.activation: a nonlinearity at the rank bottleneck of the fmt tt layers "
                        "(act(x L) R, CoLA's low-rank activation in the TT format); needs --fmt tt for those kinds")
    g.add_argument("--tt-init", choices=["random", "balanced", "svd"], default="random",
                   help="TTConfig.init: random (CoMERA's), balanced (every core at the same std), svd (TT-SVD of "
                        "the current weights; with --init-from: of a trained dense model)")
    g.add_argument("--tt-init-std", type=per_kind(float, "STD"), default=None, metavar="STD",
                   help="TTConfig.init_std: std of the initial weight (default: tensorize_'s); or per kind")
    g.add_argument("--gate-init", type=float, default=1.0,
                   help="start the rank gates at this value, the cores rescaled so the weights do not change")
    g.add_argument("--core-lr-scale", type=float, default=1.0, help="learning rate of the TT cores / --lr")
    g.add_argument("--core-lr-rule", choices=["none", "fan-in"], default="none",
                   help="fan-in: each core's step scaled by the layer's mean core fan-in over its own (r_{k-1} * "
                        "m_k; CoreStepScale)")
    g.add_argument("--gate-lr-scale", type=float, default=1.0,
                   help="learning rate of the rank gates / --lr (default 1: at 10 the quality benchmark's TT-matrix "
                        "model ended 0.19 nats worse; with --rank-adapt the ranker steps the gates at 10x itself)")
    g.add_argument("--core-weight-decay", type=float, default=0.0, help="weight decay on the TT cores")
    g.add_argument("--rank-adapt", type=float, default=None, metavar="TARGET_COMPRESSION",
                   help="rank-adaptive training toward this compression ratio (cc.RankAdaptation); needs --tensorize")
    g.add_argument("--rank-adapt-options", type=json.loads, default=None, metavar="JSON",
                   help='more RankAdaptation options, e.g. \'{"gamma": 0.002, "prune_every": 25, "switch": 200}\'')
    g.add_argument("--rank-plot", type=Path, default=None, metavar="PNG",
                   help="with --rank-adapt: plot ranks, compression and loss over training here (needs matplotlib)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--init-from", type=Path, default=None, metavar="PT",
                   help="start from a model --save wrote: a dense one before --tensorize (with --tt-init svd: "
                        "TT-SVD of it), a tensorized one (its ranks) after. With --rank-adapt, a checkpoint of a "
                        "rank-adaptive run with steps left before --steps resumes it: the optimizer and the ranker "
                        "continue from their saved state at the saved step (same lr schedule and batches)")
    g.add_argument("--save", type=Path, default=None, metavar="PT",
                   help="save the trained model's state_dict here, with the optimizer's and the ranker's state "
                        "and the step (what --init-from resumes from)")
    g.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop after this step of the --steps schedule (then eval, --save: a run to resume)")
    g = p.add_argument_group("logging")
    g.add_argument("--eval-every", type=int,
                   help="validation loss (of the uncompiled model) every N steps and at the end; 0: end only")
    g.add_argument("--eval-batches", type=int, help="size of the fixed validation set, in batches")
    g.add_argument("--log-every", type=int, default=None, help="without tqdm: print a line every N steps")
    g.add_argument("--sample-tokens", type=int, default=0, help="after training, print this many sampled tokens")
    g.add_argument("--no-progress", action="store_true", help="plain lines instead of a tqdm progress bar")
    g.add_argument("--barrier", type=Path, default=None, metavar="DIR",
                   help="time this run alone among --barrier-parties runs sharing a GPU: each compiles and warms "
                        "up side by side, waits at --barrier-step until all are there, then takes the GPU in turn "
                        "(a lock in DIR) for its remaining steps; the step time is the median of those")
    g.add_argument("--barrier-parties", type=int, default=1, help="runs meeting at --barrier")
    g.add_argument("--barrier-step", type=int, default=10, help="steps before the barrier (compile, warm-up)")
    g.add_argument("--out", type=Path, default=None,
                   help="write a JSON log (per-step loss, evals, sizes, step time, memory) here, updated at every eval")
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**PRESETS[preset])
    args = p.parse_args(argv)
    given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
    if args.tokenizer == "bytes" and "--vocab-size" not in given:
        args.vocab_size = None  # the preset's BPE vocabulary size does not apply to byte tokens
    _check_args(p, args)
    if args.lr is None:
        args.lr = gpu_default_lr(args)
    return args


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "comera-compile" / "train_lm"


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rank_adapt is not None and args.tensorize is None:
        p.error("--rank-adapt needs --tensorize RANK")
    given = [f"--{name}" for name in ("tensorize", "lowrank", "btt") if getattr(args, name) is not None]
    if len(given) > 1:
        p.error(f"{' and '.join(given)} are ways to compress the same layers: give one")
    if args.lowrank_act != "none" and args.lowrank is None:
        p.error("--lowrank-act needs --lowrank RANK")
    for flag in ("lowrank", "btt"):
        ranks = getattr(args, flag)
        if ranks is None:
            continue
        if "default" in ranks.values():
            p.error(f"--{flag} needs a number for its rank")
        embeddings = [k for k in args.compress if k in ("tok", "pos")]
        if embeddings or ("head" in args.compress and args.head == "tied"):
            p.error(f"--{flag} factors Linear layers: --compress {','.join(args.compress)} names embeddings "
                    "(or the head tied to the token embedding; --head untied makes it a Linear of its own)")
        missing = [k for k in args.compress if for_kind(ranks, k) is None]
        if missing:
            p.error(f"--{flag} gives no rank for the compressed kinds {missing} "
                    f"(--compress {','.join(args.compress)})")
    if args.barrier is not None and not (args.barrier_parties >= 1 and 1 <= args.barrier_step < args.steps):
        p.error(f"--barrier needs --barrier-parties >= 1 and --barrier-step in 1..--steps - 1 ({args.steps - 1}), "
                f"got {args.barrier_parties} and {args.barrier_step}")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after must be a step in 1..--steps ({args.steps}), got {args.stop_after}")
    if (args.rank_adapt_options or args.rank_plot) and args.rank_adapt is None:
        p.error("--rank-adapt-options and --rank-plot need --rank-adapt TARGET_COMPRESSION")
    if args.tensorize is not None:
        missing = [k for k in args.compress if for_kind(args.tensorize, k) is None]
        if missing:
            p.error(f"--tensorize gives no rank for the compressed kinds {missing} "
                    f"(--compress {','.join(args.compress)})")
    elif (args.tt_init != "random" or args.fmt or args.tt_init_std or args.tt_cores or args.core_lr_rule != "none"
          or args.tt_activation != "none"):
        p.error("--fmt, --tt-cores, --tt-init, --tt-init-std, --tt-activation and --core-lr-rule need --tensorize RANK")
    if args.tt_activation != "none" and not any(for_kind(args.fmt, k) == "tt" for k in args.compress
                                                if k not in ("tok", "pos")):
        p.error(f"--tt-activation {args.tt_activation} applies to fmt tt Linear layers, and --fmt makes none of "
                f"--compress {','.join(args.compress)} tt (e.g. --fmt tt, or attn=tt,mlp=tt)")
    if args.backend == "eager" and (args.compile_options or args.dynamic or args.cuda_graphs):
        p.error("--compile-options, --dynamic and --cuda-graphs apply to torch.compile; "
                "--backend eager does not compile")
    if args.cuda_graphs and args.backend not in ("comera", "inductor"):
        p.error("--cuda-graphs needs --backend comera or inductor")
    if args.explain and args.backend != "comera":
        p.error("--explain reports what the comera backend rewrites; it needs --backend comera")


# ------------------------------------------------------------------------------------------------ setup


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
    return torch.device(choice)


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak GPU memory allocated and reserved by torch, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
    return {"allocated": rss, "reserved": rss}


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to 1, then cosine decay to 0.1: each parameter group's lr is its base lr times this."""
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def tt_configs(model: nn.Module, args: argparse.Namespace) -> dict:
    """``{module name: cc.TTConfig}`` for the layers of the ``--compress`` kinds. A tie that
    tensorize_ shares or unties (``--tied``) is one weight: selecting either module selects both,
    with the token embedding's config."""
    kinds = set(args.compress)
    tie = args.head == "tied" and args.tied != "skip" and kinds & {"tok", "head"}
    configs = {}
    for fqn, module in model.named_modules():
        kind = layer_kind(fqn)
        if kind not in kinds and not (tie and kind in ("tok", "head")):
            continue
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if tie and kind in ("tok", "head"):
            kind = "tok" if "tok" in kinds else "head"
        options = dict(fmt=for_kind(args.fmt, kind) or "auto", init=args.tt_init,
                       init_std=for_kind(args.tt_init_std, kind))
        if for_kind(args.tt_cores, kind) is not None:
            options["n_cores"] = for_kind(args.tt_cores, kind)
        if args.tt_activation != "none" and options["fmt"] == "tt" and kind not in ("tok", "pos"):
            options["activation"] = args.tt_activation
        rank = for_kind(args.tensorize, kind)
        configs[fqn] = cc.TTConfig(**options) if rank == "default" else cc.TTConfig(rank=rank, **options)
    return configs


def compress(model: nn.Module, args: argparse.Namespace) -> None:
    """Tensorize (or factor, --lowrank) before the optimizer is built, so it sees the new parameters."""
    if args.lowrank is not None or args.btt is not None:
        structure = "lowrank" if args.lowrank is not None else "btt"
        rank_of = args.lowrank if args.lowrank is not None else args.btt
        before = block_parameters(model)
        replaced = factor_linears_(model, rank_of, args.compress, act=args.lowrank_act, structure=structure)
        ranks = sorted({for_kind(rank_of, layer_kind(f)) for f in replaced})
        what = ("two-core block tensor-trains" if structure == "btt" else
                f"d_in -> r -> d_out products{'' if args.lowrank_act == 'none' else ' with ' + args.lowrank_act}")
        print(f"{structure}: {len(replaced)} Linear layers of {','.join(args.compress)} as {what} "
              f"(r {', '.join(map(str, ranks))}); block parameters {before:,} -> {block_parameters(model):,}")
        return
    if args.tensorize is None:
        return
    if cc is None:
        raise RuntimeError("--tensorize needs the comera_compile package (pip install -e .)")
    cc.tensorize_(model, tt_configs(model, args), tied=args.tied)
    report = cc.compression_report(model)
    print(report)
    skipped = [s.fqn for s in report.skipped if layer_kind(s.fqn) in args.compress]
    if skipped:
        warnings.warn(f"--compress {','.join(args.compress)}: {skipped} stayed dense (reasons above)", stacklevel=2)
    if args.gate_init != 1.0:
        set_gate_init(model, args.gate_init)


@torch.no_grad()
def set_gate_init(model: nn.Module, value: float) -> None:
    """Gates at ``value``, the core right of each gate divided by it: every weight stays the same."""
    if not value > 0:
        raise ValueError(f"--gate-init must be > 0, got {value}")
    for layer in cc.iter_tt_layers(model):
        for k, gate in enumerate(layer.gates):
            core = layer.cores[k + 1]  # gate k sits between cores k and k + 1, on the next core's first dim
            core.mul_((gate / value).view(-1, *[1] * (core.dim() - 1)))
            gate.fill_(value)


def block_parameters(model: nn.Module) -> int:
    """Parameters of the transformer blocks (attention, MLP and norms)."""
    return sum(p.numel() for p in model.blocks.parameters())


def make_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over cc.param_groups (TT cores, rank gates, decayed matrices, undecayed vectors); fused on GPU."""
    if cc is not None:
        groups = cc.param_groups(model, args.lr, weight_decay=args.weight_decay,
                                 core_lr=args.lr * args.core_lr_scale, gate_lr=args.lr * args.gate_lr_scale,
                                 core_weight_decay=args.core_weight_decay)
    else:  # pragma: no cover - without the package: no TT layers either
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda" or None)


class CoreStepScale:
    """``--core-lr-rule fan-in``: each TT core's optimizer step scaled by ``F / f_k``, ``f_k = r_{k-1} * m_k``
    the core's fan-in in ``x @ M`` (its left bond times its row mode) and ``F`` the geometric mean of the
    layer's ``f_k``: cores that sum over more inputs take smaller steps, the layer's mean step is kept.
    For SGD and Adam(W) a step scaled by ``s`` is exactly the step at ``s`` times the lr (the way the
    rank gates' lr is scaled). The scales are re-read when rank adaptation resizes a layer."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer):
        self.layers = list(cc.iter_tt_layers(model))
        self._scales: dict[int, torch.Tensor] = {}
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        opt.register_step_pre_hook(self._pre)
        opt.register_step_post_hook(self._post)

    @staticmethod
    def fan_in_scales(spec) -> list[float]:
        """One scale per core of ``spec`` (a chain: ``"tt"`` or ``"ttm"``; ``"btt"``: R's fan-in ``b2``,
        L's ``b1 * r``)."""
        if spec.fmt == "btt":
            fans = [spec.row_modes[1], spec.row_modes[0] * spec.ranks[1]]
        else:
            fans = [spec.ranks[k] * m for k, (m, _) in enumerate(spec.chain_modes)]
        mean = math.exp(sum(math.log(f) for f in fans) / len(fans))
        return [mean / f for f in fans]

    def _scale_of(self, layer) -> torch.Tensor:
        flat = layer.param.core_flat
        scale = self._scales.get(id(flat))
        if scale is None or scale.numel() != flat.numel():
            spec = layer.param.spec
            sizes = [math.prod(s) for s in spec.core_shapes]
            scale = torch.repeat_interleave(torch.tensor(self.fan_in_scales(spec), dtype=flat.dtype),
                                            torch.tensor(sizes)).to(flat.device)
            self._scales[id(flat)] = scale
        return scale

    def _pre(self, opt, args, kwargs) -> None:
        self._before = [(lay.param.core_flat, lay.param.core_flat.detach().clone()) for lay in self.layers
                        if lay.param.core_flat.requires_grad]

    @torch.no_grad()
    def _post(self, opt, args, kwargs) -> None:
        for layer, (flat, before) in zip([lay for lay in self.layers if lay.param.core_flat.requires_grad],
                                         self._before):
            if flat.shape != before.shape:  # resized inside the step: leave it
                continue
            flat.copy_(before + self._scale_of(layer) * (flat - before))
        self._before = []


def rank_adaptation(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace):
    """The ranker registers optimizer step hooks; the training loop is unchanged."""
    if args.rank_adapt is None:
        return None
    ranker = cc.RankAdaptation(model, opt, target_compression=args.rank_adapt, **(args.rank_adapt_options or {}))
    print(f"rank adaptation: target {args.rank_adapt:g}x of {ranker.dense_params:,} dense parameters "
          f"(<= {ranker.target_params:,.0f}); gamma {ranker.gamma:g}, prune every {ranker.prune_every} steps, "
          f"threshold {ranker.threshold:g}, switch {ranker.switch}")
    return ranker


def compile_model(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    if args.backend == "eager":
        return model
    options = dict(args.compile_options or {})
    if args.cuda_graphs:
        options["cudagraphs" if args.backend == "comera" else "triton.cudagraphs"] = True
    return torch.compile(model, backend=args.backend, options=options or None, dynamic=args.dynamic or None)


def read_checkpoint(path: Path, device: torch.device) -> tuple[dict, dict | None]:
    """The model state --save wrote, and the training state saved with it (None in a checkpoint
    that has none)."""
    checkpoint = torch.load(path, map_location=device, weights_only=True)
    return checkpoint["model"], checkpoint.get("train_state")


def train_state(step: int, opt: torch.optim.Optimizer, ranker, device: torch.device) -> dict:
    """What resuming needs besides the model: the steps done (they fix where the training windows go
    on: the sampler's order depends on the seed alone), the optimizer's and the ranker's state and
    the RNG states (dropout)."""
    state = {"step": step, "optimizer": opt.state_dict(), "ranker": None if ranker is None else ranker.state_dict(),
             "rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def resume_from(state: dict | None, opt: torch.optim.Optimizer, ranker, args: argparse.Namespace,
                device: torch.device) -> int:
    """Restore a rank-adaptive run from its checkpoint's training state; returns the step to go on
    from (0: nothing to resume, the checkpoint's weights only: no --rank-adapt, a checkpoint without a
    ranker's state, or no steps left before --steps)."""
    if state is None or ranker is None or state.get("ranker") is None:
        return 0
    if state["step"] >= args.steps:
        print(f"--init-from {args.init_from}: saved at step {state['step']}, not before --steps {args.steps}: "
              "its weights only (the optimizer and the ranker start anew)")
        return 0
    opt.load_state_dict(state["optimizer"])
    ranker.load_state_dict(state["ranker"])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], device)
    print(f"resuming at step {state['step']} of {args.steps}: optimizer and ranker state restored "
          f"(stage {ranker.stage}, {ranker.prune_events} pruning events, ranks {ranker.ranks()})")
    return int(state["step"])


def is_compressed(state: dict) -> bool:
    """A checkpoint of a tensorized (or --lowrank, --btt) model: it loads after :func:`compress`."""
    return any(".parametrizations.weight." in key or key.endswith((".down.weight", ".up.weight", ".R", ".L"))
               for key in state)


def load_checkpoint(model: nn.Module, state: dict, path: Path) -> None:
    """Load a dense checkpoint into the dense model, or a tensorized one (ranks pruned or not) into
    the model tensorized by the same flags."""
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise RuntimeError(f"--init-from {path}: not a checkpoint of this model (same --d-model, --n-layers, --qkv, "
                           f"--head, vocabulary; a tensorized one also the same --tensorize, --compress and --fmt, "
                           f"a low-rank one the same --lowrank (--btt) and --compress): {error}") from None


class Progress:
    """A tqdm bar when tqdm is installed, otherwise a plain line every ``log_every`` steps."""

    def __init__(self, total: int, log_every: int | None, enabled: bool = True):
        self.total = total
        self.log_every = log_every or _round_interval(total // 15)
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, **stats: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(stats, refresh=False)
            self.bar.update(1)
        elif (step + 1) % self.log_every == 0 or step == 0 or step + 1 == self.total:
            self.write(f"step {step + 1:>5}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in stats.items()))

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _round_interval(n: int) -> int:
    """The nearest of 1, 2, 5, 10, 20, 50, ... at or above ``n`` (log lines at round step numbers)."""
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= n:
                return m * scale
        scale *= 10


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device, autocast) -> float:
    """Mean loss over the fixed validation batches."""
    was_training = model.training
    model.eval()
    losses = []
    for batch in batches:
        batch = batch.to(device)
        with autocast():
            losses.append(model(batch, batch).item())
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model: nn.Module, data: TokenData, args: argparse.Namespace, device: torch.device, prompt: str) -> str:
    """Temperature sampling with the uncompiled module (growing lengths would only cause recompiles)."""
    model.eval()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids = data.tokenizer.encode(prompt).long().to(device)[None]
    for _ in range(args.sample_tokens):
        logits = model(ids[:, -args.seq_len :])[:, -1].float()
        probs = F.softmax(logits / 0.8, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return data.tokenizer.decode(ids[0].tolist())


def write_log(log: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(log, indent=1, default=str))
    os.replace(tmp, path)  # a reader (the study runner) never sees half a file


def step_time(steps: list[dict], alone_from: int | None = None) -> float | None:
    """Median step time without the first tenth of the run (compilation, warm-up); with ``alone_from``
    (the step after a --barrier) of the steps from there on."""
    first = max(1, len(steps) // 10) if alone_from is None else alone_from
    seconds = [s["seconds"] for s in steps[first:]]
    return statistics.median(seconds) if seconds else None


class GPUTurn:
    """``--barrier``: the runs sharing a GPU meet at a step (all compiled and warmed up), then each holds
    an exclusive lock on ``DIR/lock`` for the rest of its run, so its timed steps have the GPU alone. A
    run that does not arrive within ``timeout_s`` (failed) is not waited for: the log then says that the
    steps may have shared the GPU."""

    def __init__(self, folder: Path, parties: int, timeout_s: float = 900.0):
        self.folder, self.parties, self.timeout_s = folder, parties, timeout_s
        self.lock = None

    def take(self) -> bool:
        """Wait for the others, then for the GPU; True when all ``parties`` arrived."""
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + self.timeout_s
        while len(list(self.folder.glob("ready-*"))) < self.parties and time.monotonic() < deadline:
            time.sleep(0.2)
        everyone = len(list(self.folder.glob("ready-*"))) >= self.parties
        self.lock = open(self.folder / "lock", "w")  # released when the process ends
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        return everyone


def load_data(args: argparse.Namespace) -> TokenData:
    """The corpus, tokenized (cached), with its manifest written; prints what it holds."""
    max_bytes = int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None
    data = load_token_data(args.tokenizer, args.vocab_size, max_bytes=max_bytes,
                           cache_dir=None if args.no_cache else args.cache_dir, corpus=args.corpus)
    corpus = data.corpus
    if data.manifest is None and args.out is not None:  # --no-cache: next to the run's log
        data.manifest = corpus.write_manifest(args.out.with_name(args.out.stem + ".corpus.tsv"))
    roots = ", ".join(f"{name} {path}" for name, path in corpus.roots.items())
    cap = f", capped at {corpus.max_bytes / 1e6:g} MB" if corpus.max_bytes else ""
    print(f"corpus {corpus.name}: {len(corpus.files):,} files ({corpus.num_train_files:,} train / "
          f"{corpus.num_val_files:,} val), {corpus.num_bytes / 1e6:,.1f} MB{cap}, {corpus.duplicates:,} duplicate "
          f"files left out; from {roots}")
    print(f"corpus manifest: {data.manifest if data.manifest else 'not written (--no-cache and no --out)'}")
    print(f"tokens ({data.tokenizer.name}, vocab {data.tokenizer.vocab_size}): {data.train.numel():,} train / "
          f"{data.val.numel():,} validation, in {data.seconds:.1f}s"
          + (f" ({'cached' if data.from_cache else 'now cached'} in {data.cache})" if data.cache else ""))
    return data


def plan_epochs(data: TokenData, sampler, args: argparse.Namespace, end_step: int) -> dict:
    """The run's share of the train split, printed and returned for the log; stops a run that needs
    more than one epoch unless --allow-repeat."""
    corpus = data.corpus
    seen = end_step * args.batch_size * args.seq_len
    epochs = sampler.epochs_for(end_step)
    print(f"sampler: one epoch = {sampler.num_windows:,} windows of {args.seq_len} tokens "
          f"({sampler.batches_per_epoch:,} batches of {args.batch_size}); this run: {end_step:,} steps = "
          f"{seen:,} train tokens seen = {epochs:.3f} epochs")
    if end_step > sampler.batches_per_epoch:
        if not args.allow_repeat:
            raise SystemExit(
                f"--steps {end_step} x --batch-size {args.batch_size} needs {end_step * args.batch_size:,} windows of "
                f"{args.seq_len} tokens, but one epoch of the train split holds {sampler.batches_per_epoch:,} batches "
                f"({sampler.num_windows:,} windows, {data.train.numel():,} tokens): lower --steps, raise "
                "--max-corpus-mb or use --corpus python, or pass --allow-repeat to see windows again")
        print(f"--allow-repeat: {epochs:.2f} epochs, the windows come again from step "
              f"{sampler.batches_per_epoch + 1} on")
    return {"corpus": corpus.name, "roots": {k: str(v) for k, v in corpus.roots.items()},
            "files": len(corpus.files), "train_files": corpus.num_train_files, "val_files": corpus.num_val_files,
            "duplicates": corpus.duplicates, "bytes": corpus.num_bytes, "max_bytes": corpus.max_bytes,
            "digest": corpus.digest, "manifest": str(data.manifest) if data.manifest else None,
            "tokenizer": data.tokenizer.name, "vocab_size": data.tokenizer.vocab_size,
            "train_tokens": int(data.train.numel()), "val_tokens": int(data.val.numel()),
            "sampler": "epoch", "seq_len": args.seq_len, "train_windows": sampler.num_windows,
            "batches_per_epoch": sampler.batches_per_epoch, "allow_repeat": args.allow_repeat,
            "planned_tokens": seen, "planned_epochs": epochs,
            "val_windows": args.eval_batches * args.batch_size}


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    """Train and return the log (the same dict ``--out`` writes)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.cuda.reset_peak_memory_stats(device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    data = load_data(args)
    sampler = data.sampler(args.batch_size, args.seq_len, seed=args.seed, allow_repeat=args.allow_repeat)
    end_step = args.steps if args.stop_after is None else args.stop_after
    data_log = plan_epochs(data, sampler, args, end_step)

    model = build_model(args, data.tokenizer.vocab_size, device)
    state, saved_training = read_checkpoint(args.init_from, device) if args.init_from is not None else (None, None)
    if state is not None and not is_compressed(state):
        for flag in ("lowrank", "btt"):
            if getattr(args, flag) is not None:
                raise RuntimeError(f"--init-from {args.init_from}: a dense checkpoint; --{flag} starts its factors "
                                   f"anew and would discard it (a --{flag} checkpoint loads)")
        load_checkpoint(model, state, args.init_from)  # before compress: --tt-init svd factors the trained weights
    dense_params, dense_block_params = sum(p.numel() for p in model.parameters()), block_parameters(model)
    compress(model, args)
    if state is not None and is_compressed(state):
        load_checkpoint(model, state, args.init_from)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, args, device)
    base_lrs = [group["lr"] for group in opt.param_groups]
    if args.core_lr_rule == "fan-in":  # before the ranker: its post-hook may resize the cores
        CoreStepScale(model, opt)
    ranker = rank_adaptation(model, opt, args)
    compiled = compile_model(model, args)
    print(f"model: {n_params / 1e6:.2f}M parameters ({dense_params / max(n_params, 1):.1f}x), d_model {args.d_model}, "
          f"{args.n_layers} layers, {args.n_heads} heads, qkv {args.qkv}, head {args.head} | backend {args.backend}"
          f"{' + CUDA graphs' if args.cuda_graphs else ''} | device {device}{' (bf16 autocast)' if bf16 else ''}")
    if args.explain:
        example = data.sampler(args.batch_size, args.seq_len, seed=args.seed).next_batch()  # the first batch
        with autocast():
            print(cc.explain(compiled, example.to(device), example.to(device)))

    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "device": str(device), "dense_parameters": dense_params, "parameters": n_params,
           "block_dense_parameters": dense_block_params, "block_parameters": block_parameters(model),
           "param_groups": [{"name": g.get("name"), "lr": g["lr"], "weight_decay": g["weight_decay"],
                             "parameters": sum(p.numel() for p in g["params"])} for g in opt.param_groups],
           "data": data_log, "train_tokens": data_log["train_tokens"], "val_tokens": data_log["val_tokens"],
           "tokens_seen": 0, "epochs": 0.0, "steps": [], "evals": [], "complete": False}
    val_batches = data.eval_batches(args.batch_size, args.seq_len, args.eval_batches)
    first_step = resume_from(saved_training, opt, ranker, args, device)
    sampler.seek(first_step)  # the windows of the steps before are the ones a run from step 0 drew
    tokens_per_step = args.batch_size * args.seq_len
    progress = Progress(args.steps, args.log_every, enabled=not args.no_progress)
    timed_tokens, timed_seconds, train_seconds = 0, 0.0, 0.0
    turn = GPUTurn(args.barrier, args.barrier_parties) if args.barrier is not None else None
    start = time.perf_counter()
    for step in range(first_step, end_step):
        if turn is not None and step == args.barrier_step:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            log["alone_from_step"], log["alone"] = step - first_step, turn.take()
            timed_tokens, timed_seconds = 0, 0.0
        factor = lr_factor(step, args)
        for group, base in zip(opt.param_groups, base_lrs):
            group["lr"] = base * factor
        if sampler.batches % sampler.batches_per_epoch == 0 and sampler.batches:
            progress.write(f"step {step + 1}: epoch {sampler.epoch + 1} of the train split starts (--allow-repeat): "
                           "its windows again, in a new order")
        batch = sampler.next_batch().to(device, non_blocking=True)
        t0 = time.perf_counter()
        if args.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            loss = compiled(batch, batch)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # synchronizes, so the timing below is the step's real time
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        if step > first_step:  # the first step includes compilation
            timed_tokens += tokens_per_step
            timed_seconds += seconds
        else:
            log["first_step_s"] = seconds
        if not math.isfinite(loss_value):
            progress.close()
            log["error"] = f"loss became {loss_value} at step {step + 1}"
            write_log(log, args.out)
            raise FloatingPointError(log["error"])
        log["steps"].append({"step": step + 1, "loss": loss_value, "lr": args.lr * factor, "seconds": seconds,
                             "tokens_per_s": tokens_per_step / seconds})
        avg_rate = timed_tokens / timed_seconds if timed_seconds else tokens_per_step / seconds
        stats = {"loss": f"{loss_value:.3f}", "tok_s": f"{avg_rate:,.0f}"}
        if ranker is not None:
            rank_state = ranker.history[-1]
            log["steps"][-1].update(params=rank_state["params"], compression=rank_state["compression"],
                                    stage=rank_state["stage"])
            stats.update(ratio=f"{rank_state['compression']:.1f}x", stage=rank_state["stage"])
        progress.update(step, **stats)
        log.update(tokens_seen=sampler.tokens_seen, epochs=sampler.epochs_seen)
        last = step + 1 == end_step
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            val_loss = evaluate(model, val_batches, device, autocast)  # eager: no eval graph to compile, nor to
            # recompile after each pruning event
            log["evals"].append({"step": step + 1, "val_loss": val_loss,
                                 "parameters": sum(p.numel() for p in model.parameters()),
                                 "tokens": sampler.tokens_seen, "epochs": sampler.epochs_seen,
                                 "seconds": time.perf_counter() - start, "train_seconds": train_seconds})
            memory = peak_memory(device)  # so far: a run stopped before the end still reports it
            log.update(peak_memory_bytes=memory["allocated"], peak_memory_reserved_bytes=memory["reserved"])
            progress.write(f"step {step + 1:>5}: train loss {loss_value:.4f}  val loss {val_loss:.4f}  "
                           f"({val_loss / math.log(2):.3f} bits/token)")
            write_log(log, args.out)
    progress.close()
    finish(log, model, compiled, ranker, data, args, device, time.perf_counter() - start,
           timed_tokens / timed_seconds if timed_seconds else None,
           lambda: train_state(end_step, opt, ranker, device))
    return log


def finish(log: dict, model: nn.Module, compiled: nn.Module, ranker, data: TokenData, args: argparse.Namespace,
           device: torch.device, total_s: float, tokens_per_s: float | None, training_state=None) -> None:
    """Sizes, speed and memory into the log; the summary lines; the rank plot, sample, checkpoint and JSON."""
    memory = peak_memory(device)
    final_params = sum(p.numel() for p in model.parameters())
    log.update(total_s=total_s, tokens_per_s=tokens_per_s,
               step_time_s=step_time(log["steps"], log.get("alone_from_step")),
               peak_memory_bytes=memory["allocated"], peak_memory_reserved_bytes=memory["reserved"],
               final_parameters=final_params, compression=log["dense_parameters"] / final_params,
               final_block_parameters=block_parameters(model),
               block_compression=log["block_dense_parameters"] / max(block_parameters(model), 1),
               val_loss=log["evals"][-1]["val_loss"])
    memory_kind = "GPU memory allocated" if device.type == "cuda" else "RSS"
    rate = f"{tokens_per_s:,.0f} tokens/s" if tokens_per_s else "n/a tokens/s"
    first = "first step (compiling)" if compiled is not model else "first step"
    print(f"tokens seen: {log['tokens_seen']:,} of {log['train_tokens']:,} train tokens ({log['epochs']:.3f} epochs)")
    print(f"done: {args.steps} steps in {total_s:.1f}s ({first} {log['first_step_s']:.1f}s) | {rate} | "
          f"loss {log['steps'][0]['loss']:.3f} -> {log['steps'][-1]['loss']:.3f} | val {log['val_loss']:.3f} | "
          f"peak {memory_kind} {memory['allocated'] / 2**20:,.0f} MiB | {final_params:,} parameters "
          f"({log['compression']:.1f}x, blocks {log['block_compression']:.1f}x)")
    if ranker is not None:
        log["rank_history"] = ranker.history
        log["prune_events"] = ranker.prune_events
        log["first_prune_step"] = next((h["step"] for h in ranker.history if h["params"] < log["parameters"]), None)
        print(f"rank adaptation: {ranker.prune_events} pruning events (first at step {log['first_prune_step']}), "
              f"stage {ranker.stage}, ranks {ranker.ranks()}")
        if args.rank_plot is not None:
            args.rank_plot.parent.mkdir(parents=True, exist_ok=True)
            ranker.plot(str(args.rank_plot), losses=[(e["step"], e["loss"]) for e in log["steps"]])
            print(f"rank plot written to {args.rank_plot}")
    saved_state = training_state() if args.save is not None and training_state is not None else None
    if args.sample_tokens:
        text = sample(model, data, args, device, prompt="def ")
        print("sample:\n" + text)
        log["sample"] = text
    if args.save is not None:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = {"model": model.state_dict(), "args": log["args"]}
        if saved_state is not None:  # taken before sampling
            checkpoint["train_state"] = saved_state
        torch.save(checkpoint, args.save)
        print(f"model saved to {args.save}")
    log["complete"] = True
    write_log(log, args.out)
    if args.out is not None:
        print(f"log written to {args.out}")


if __name__ == "__main__":
    main()
