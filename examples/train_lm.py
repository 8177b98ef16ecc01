"""Train a small GPT-style language model on the Python standard library's own sources, through comera.

    PYTHONPATH=. python examples/train_lm.py                       # CPU or GPU, byte tokens, backend "comera"
    PYTHONPATH=. python examples/train_lm.py --backend eager       # the same model without torch.compile
    PYTHONPATH=. python examples/train_lm.py --tokenizer bpe --vocab-size 4096 --device cuda --steps 2000

The model is written the way users write one (pre-LN blocks, causal attention through
F.scaled_dot_product_attention, a tied LM head and F.cross_entropy on shifted logits): the backend finds
the patterns it rewrites by itself. The corpus is read from the running interpreter, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling data.py, also when imported by tests
from data import TokenData, load_token_data  # noqa: E402

try:  # registers the "comera" backend in a source checkout; an installed package registers it by entry point
    import comera_compile as cc
except ImportError:  # pragma: no cover - the example still runs with torch's own backends
    cc = None


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"--d-model {d_model} must be divisible by --n-heads {n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
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

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied input/output embeddings
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=150)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--n-layers", type=int, default=2)
    g.add_argument("--n-heads", type=int, default=4)
    g.add_argument("--dropout", type=float, default=0.0)
    g = p.add_argument_group("data")
    g.add_argument("--tokenizer", choices=["bytes", "bpe"], default="bytes",
                   help="bytes: vocabulary 256, no dependency; bpe: trained here on the corpus (needs `tokenizers`)")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (default 4096)")
    g.add_argument("--max-corpus-mb", type=float, default=None, help="read at most this much of the stdlib (quick runs)")
    g = p.add_argument_group("compilation and device")
    g.add_argument("--backend", default="comera",
                   help='torch.compile backend: "comera" (default), any torch backend name, or "eager" for no torch.compile')
    g.add_argument("--compile-options", type=json.loads, default=None, metavar="JSON",
                   help='passed to torch.compile(options=...), e.g. \'{"inner": "aot_eager"}\'')
    g.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    g.add_argument("--explain", action="store_true",
                   help="backend comera: print cc.explain's report (rewrites, skipped candidates, graphs) first")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on GPU, fp32 on CPU")
    g = p.add_argument_group("compression (issues 4 and 6)")
    g.add_argument("--tensorize", type=int, default=None, metavar="RANK",
                   help="tensorize Linear and Embedding layers to tensor trains of this rank (cc.tensorize_)")
    g.add_argument("--rank-adapt", type=float, default=None, metavar="TARGET_COMPRESSION",
                   help="rank-adaptive training toward this compression ratio (cc.RankAdaptation); needs --tensorize")
    g.add_argument("--rank-adapt-options", type=json.loads, default=None, metavar="JSON",
                   help='more RankAdaptation options, e.g. \'{"gamma": 0.002, "prune_every": 25, "switch": 200}\'')
    g.add_argument("--rank-plot", type=Path, default=None, metavar="PNG",
                   help="with --rank-adapt: plot ranks, compression and loss over training here (needs matplotlib)")
    g = p.add_argument_group("logging")
    g.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps and at the end; 0: end only")
    g.add_argument("--eval-batches", type=int, default=8)
    g.add_argument("--log-every", type=int, default=None, help="without tqdm: print a line every N steps")
    g.add_argument("--sample-tokens", type=int, default=0, help="after training, print this many sampled tokens")
    g.add_argument("--no-progress", action="store_true", help="plain lines instead of a tqdm progress bar")
    g.add_argument("--out", type=Path, default=None, help="write a JSON log (per-step loss, tokens/s, evals) here")
    args = p.parse_args(argv)
    if args.rank_adapt is not None and args.tensorize is None:
        p.error("--rank-adapt needs --tensorize RANK")
    if (args.rank_adapt_options or args.rank_plot) and args.rank_adapt is None:
        p.error("--rank-adapt-options and --rank-plot need --rank-adapt TARGET_COMPRESSION")
    if args.backend == "eager" and (args.compile_options or args.dynamic):
        p.error("--compile-options and --dynamic apply to torch.compile; --backend eager does not compile")
    if args.explain and args.backend != "comera":
        p.error("--explain reports what the comera backend rewrites; it needs --backend comera")
    return args


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False")
    return torch.device(choice)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated by torch, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def learning_rate(step: int, args: argparse.Namespace) -> float:
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def compress(model: nn.Module, args: argparse.Namespace) -> None:
    """Hook for issue 4: tensorize before the optimizer is built, so it sees the cores."""
    if args.tensorize is None:
        return
    if cc is None or not hasattr(cc, "tensorize_"):
        raise NotImplementedError("--tensorize needs comera_compile.tensorize_ (issue 4), not available in this build")
    cc.tensorize_(model, cc.TTConfig(rank=args.tensorize))
    if hasattr(cc, "compression_report"):
        print(cc.compression_report(model))


def optimizer_groups(model: nn.Module, args: argparse.Namespace) -> list[dict]:
    """Weight decay on matrices, embeddings and TT cores, none on vectors and rank gates, all at
    ``--lr``. A TT layer's cores are one flat Parameter, so cc.param_groups finds them by identity
    (their shape would put them with the vectors)."""
    if cc is not None and hasattr(cc, "param_groups"):
        return cc.param_groups(model, args.lr, weight_decay=args.weight_decay, gate_lr=args.lr,
                               core_weight_decay=args.weight_decay)
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def rank_adaptation(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace):
    """Hook for issue 6: the ranker registers optimizer step hooks; the training loop is unchanged."""
    if args.rank_adapt is None:
        return None
    try:
        from comera_compile.rank_adaptation import RankAdaptation
    except ImportError:
        raise NotImplementedError("--rank-adapt needs comera_compile.RankAdaptation (issue 6), not available in this build") from None
    ranker = RankAdaptation(model, opt, target_compression=args.rank_adapt, **(args.rank_adapt_options or {}))
    print(f"rank adaptation: target {args.rank_adapt:g}x of {ranker.dense_params:,} dense parameters "
          f"(<= {ranker.target_params:,.0f}); gamma {ranker.gamma:g}, prune every {ranker.prune_every} steps, "
          f"switch {ranker.switch}")
    return ranker


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
def evaluate(model: nn.Module, data: TokenData, args: argparse.Namespace, device: torch.device, autocast) -> float:
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)  # the same validation batches every time
    losses = []
    for _ in range(args.eval_batches):
        batch = data.batch("val", args.batch_size, args.seq_len, generator).to(device)
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


def main(argv: list[str] | None = None) -> dict:
    """Train and return the log (the same dict ``--out`` writes)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    max_bytes = int(args.max_corpus_mb * 1e6) if args.max_corpus_mb else None
    data = load_token_data(args.tokenizer, args.vocab_size, max_bytes=max_bytes)
    print(f"corpus: {data.corpus.num_train_files} train / {data.corpus.num_val_files} val files from "
          f"{data.corpus.root}; {data.train.numel():,} / {data.val.numel():,} tokens "
          f"({data.tokenizer.name}, vocab {data.tokenizer.vocab_size}) in {data.seconds:.1f}s")

    model = GPT(data.tokenizer.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads, args.dropout)
    model.to(device)
    dense_params = sum(p.numel() for p in model.parameters())
    compress(model, args)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(optimizer_groups(model, args), lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda" or None)
    ranker = rank_adaptation(model, opt, args)

    if args.backend == "eager":
        compiled = model
    else:
        compiled = torch.compile(model, backend=args.backend, options=args.compile_options, dynamic=args.dynamic or None)
    print(f"model: {n_params / 1e6:.2f}M parameters, d_model {args.d_model}, {args.n_layers} layers, "
          f"{args.n_heads} heads | backend {args.backend} | device {device}{' (bf16 autocast)' if bf16 else ''}")
    if args.explain:
        example = data.batch("train", args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed))
        with autocast():
            print(cc.explain(compiled, example.to(device), example.to(device)))

    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "device": str(device), "dense_parameters": dense_params, "parameters": n_params, "steps": [], "evals": []}
    generator = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    progress = Progress(args.steps, args.log_every, enabled=not args.no_progress)
    timed_tokens, timed_seconds = 0, 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        lr = learning_rate(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = data.batch("train", args.batch_size, args.seq_len, generator).to(device, non_blocking=True)
        t0 = time.perf_counter()
        with autocast():
            loss = compiled(batch, batch)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # synchronizes, so the timing below is the step's real time
        seconds = time.perf_counter() - t0
        if step > 0:  # the first step includes compilation
            timed_tokens += tokens_per_step
            timed_seconds += seconds
        else:
            log["first_step_s"] = seconds
        if not math.isfinite(loss_value):
            progress.close()
            raise FloatingPointError(f"loss became {loss_value} at step {step + 1}")
        log["steps"].append({"step": step + 1, "loss": loss_value, "lr": lr, "seconds": seconds,
                             "tokens_per_s": tokens_per_step / seconds})
        avg_rate = timed_tokens / timed_seconds if timed_seconds else tokens_per_step / seconds
        if ranker is not None:
            rank_state = ranker.history[-1]
            log["steps"][-1].update(params=rank_state["params"], compression=rank_state["compression"],
                                    stage=rank_state["stage"])
            progress.update(step, loss=f"{loss_value:.3f}", tok_s=f"{avg_rate:,.0f}",
                            ratio=f"{rank_state['compression']:.1f}x", stage=rank_state["stage"])
        else:
            progress.update(step, loss=f"{loss_value:.3f}", tok_s=f"{avg_rate:,.0f}")
        last = step + 1 == args.steps
        if last or (args.eval_every and (step + 1) % args.eval_every == 0):
            val_loss = evaluate(compiled, data, args, device, autocast)
            log["evals"].append({"step": step + 1, "val_loss": val_loss})
            progress.write(f"step {step + 1:>5}: train loss {loss_value:.4f}  val loss {val_loss:.4f}  "
                           f"({val_loss / math.log(2):.3f} bits/token)")
    progress.close()

    log["total_s"] = time.perf_counter() - start
    log["tokens_per_s"] = timed_tokens / timed_seconds if timed_seconds else None
    log["peak_memory_bytes"] = peak_memory_bytes(device)
    memory_kind = "GPU memory allocated" if device.type == "cuda" else "RSS"
    rate = f"{log['tokens_per_s']:,.0f} tokens/s" if log["tokens_per_s"] else "n/a tokens/s"
    first = "first step (compiling)" if compiled is not model else "first step"
    print(f"done: {args.steps} steps in {log['total_s']:.1f}s ({first} {log['first_step_s']:.1f}s) | {rate} | loss {log['steps'][0]['loss']:.3f} -> {log['steps'][-1]['loss']:.3f} "
          f"| val {log['evals'][-1]['val_loss']:.3f} | peak {memory_kind} {log['peak_memory_bytes'] / 2**20:,.0f} MiB")
    log["final_parameters"] = sum(p.numel() for p in model.parameters())
    log["compression"] = dense_params / log["final_parameters"]
    if ranker is not None:
        log["rank_history"] = ranker.history
        log["prune_events"] = ranker.prune_events
        print(f"rank adaptation: {ranker.prune_events} pruning events, stage {ranker.stage}, "
              f"{log['final_parameters']:,} parameters ({log['compression']:.1f}x); ranks {ranker.ranks()}")
        if args.rank_plot is not None:
            args.rank_plot.parent.mkdir(parents=True, exist_ok=True)
            ranker.plot(str(args.rank_plot), losses=[(e["step"], e["loss"]) for e in log["steps"]])
            print(f"rank plot written to {args.rank_plot}")
    if args.sample_tokens:
        text = sample(model, data, args, device, prompt="def ")
        print("sample:\n" + text)
        log["sample"] = text
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(log, indent=1, default=str))
        print(f"log written to {args.out}")
    return log


if __name__ == "__main__":
    main()
