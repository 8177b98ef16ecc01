"""Quick start: tensorize a small GPT's blocks, compile it with the comera backend, see what was
rewritten, and train it for a few steps.

    python examples/quickstart.py            # CPU: about a minute; uses a GPU when there is one

It prints the compression of each tensorized layer, what the backend rewrote (``cc.explain``: the
tensor-train layers lowered, the LM head and its loss fused into one op), the training loss, and the
compiled model's loss against the same model run eagerly.
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """A byte-level GPT: token and position embeddings, blocks, and an LM head with its loss."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 2, heads: int = 4, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def batches(text: bytes, batch: int, seq: int, device: str, seed: int = 0):
    """Random windows of ``text`` (bytes) as (inputs, next-byte targets), forever."""
    data = torch.tensor(list(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s:s + seq + 1] for s in start.tolist()]).to(device)
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rank", type=int, default=8, help="TTConfig rank of the blocks' Linears")
    p.add_argument("--fmt", default="auto", help="TTConfig format: auto (TT-matrix), tt, ttm, btt")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyLM().to(device)

    # 1. Tensor-train weights for the blocks' Linears (the embeddings and the LM head stay dense).
    cc.tensorize_(model, cc.TTConfig(rank=args.rank, fmt=args.fmt),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.startswith("blocks"))
    print(cc.compression_report(model))

    # 2. The optimizer after tensorize_, with the learning-rate rules of the TT cores; then compile.
    # At this toy size the cost rule would keep the plain loss (its logits are small); cce_min_vocab=0
    # fuses the LM head with its loss anyway, to show the rewrite.
    opt = torch.optim.AdamW(cc.param_groups(model, lr=3e-3))
    options = {"cce_min_vocab": 0}
    compiled = torch.compile(model, backend="comera", options=options)

    text = inspect.getsource(torch.nn.functional).encode()  # nothing to download
    data = batches(text, batch=16, seq=64, device=device)
    x, y = next(data)
    report = cc.explain(model, x, y, options=options)  # what the backend rewrote, and what it left alone
    print(report)

    # 3. Train.
    losses = []
    for step in range(args.steps):
        x, y = next(data)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")

    # 4. The compiled model computes what the eager model does.
    x, y = next(data)
    with torch.no_grad():
        eager, fused = model(x, y).item(), compiled(x, y).item()
    print(f"loss on a new batch: compiled {fused:.5f}, eager {eager:.5f}")
    return {"losses": losses, "eager": eager, "compiled": fused, "rewrites": [r.kind for r in report.rewrites]}


if __name__ == "__main__":
    main()
