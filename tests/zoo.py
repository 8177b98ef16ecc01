"""Small models written the way users write them, shared by the backend and pass tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, d_in=12, d_hidden=24, n_classes=5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        h = F.relu(self.fc2(h)) + h
        return F.cross_entropy(self.head(h), y)

    @staticmethod
    def example(batch=6, seed=0, seq=None):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)


class Block(nn.Module):
    def __init__(self, d, n_heads, causal):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.n_heads = n_heads
        self.causal = causal

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Tied input/output embeddings, next-token loss on shifted logits."""

    def __init__(self, vocab=61, d=32, n_layers=1, n_heads=4, max_len=32, use_checkpoint=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, n_heads, causal=True) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.use_checkpoint = use_checkpoint

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))

    @staticmethod
    def example(batch=3, seq=17, vocab=61, seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)


class BertMLM(nn.Module):
    """A BERT-like encoder with an MLM head (transform + decoder with bias), labels -100 where unmasked."""

    def __init__(self, vocab=53, d=32, n_layers=1, n_heads=4, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.ln_emb = nn.LayerNorm(d)
        self.layers = nn.ModuleList([Block(d, n_heads, causal=False) for _ in range(n_layers)])
        self.transform = nn.Linear(d, d)
        self.ln_head = nn.LayerNorm(d)
        self.decoder = nn.Linear(d, vocab)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, idx, labels):
        x = self.ln_emb(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for layer in self.layers:
            x = layer(x)
        h = self.ln_head(F.gelu(self.transform(x)))
        logits = self.decoder(h)
        return self.loss_fn(logits.view(-1, logits.size(-1)), labels.view(-1))

    @staticmethod
    def example(batch=3, seq=15, vocab=53, seed=0):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.3, idx, torch.full_like(idx, -100))
        labels[0, 0] = idx[0, 0]
        return idx, labels


class CheckpointedGPT(GPT):
    def __init__(self, **kw):
        super().__init__(use_checkpoint=True, **kw)


class AutocastMLP(MLP):
    """The MLP under autocast (bf16 on CPU, upcast logits before the loss)."""

    def forward(self, x, y):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            h = F.gelu(self.fc1(x))
            h = F.relu(self.fc2(h)) + h
            logits = self.head(h)
        return F.cross_entropy(logits.float(), y)


ZOO = {
    "mlp": MLP,
    "gpt_tied": GPT,
    "bert_mlm": BertMLM,
    "checkpoint": CheckpointedGPT,
    "autocast": AutocastMLP,
}


def loss_and_grads(model, inputs, params_of=None):
    """Run ``model`` (maybe compiled) and backprop; gradients are read from ``params_of`` (default ``model``)."""
    owner = params_of if params_of is not None else model
    owner.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in owner.named_parameters() if p.grad is not None}
