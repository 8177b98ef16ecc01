"""Rank-adaptive training: a tensorized MLP fits a low-rank teacher while ``cc.RankAdaptation`` pushes
its TT ranks down and prunes them physically (cores, gradients and optimizer state sliced in place).

    python examples/rank_adaptation.py                  # CPU: under a minute
    python examples/rank_adaptation.py --plot ranks.png # the ranks and the size over the steps

The loss code is unchanged: the ranker works through optimizer-step hooks and reads the loss the model
returns (or ``ranker.observe(loss)``).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import comera_compile as cc


class Student(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.down(F.gelu(self.up(x))), y)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--target-compression", type=float, default=4.0)
    p.add_argument("--backend", default="comera", help="torch.compile backend, or 'eager' for none")
    p.add_argument("--plot", default=None, help="write the rank and size evolution to this PNG")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    d = 64
    teacher = nn.Sequential(nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False))  # rank 2
    model = Student(d)
    cc.tensorize_(model, cc.TTConfig(rank=16, fmt="tt"))
    opt = torch.optim.AdamW(cc.param_groups(model, lr=3e-3))  # the gates in a group of their own
    ranker = cc.RankAdaptation(model, opt, target_compression=args.target_compression, prune_every=50)
    step_fn = model if args.backend == "eager" else torch.compile(model, backend=args.backend)

    print("ranks before:", ranker.ranks())
    for step in range(args.steps):
        x = torch.randn(128, d)
        with torch.no_grad():
            y = teacher(x)
        loss = step_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.5f}  ranks {ranker.ranks()}")
    print("ranks after:", ranker.ranks())
    print(cc.compression_report(model))
    if args.plot:
        ranker.plot(args.plot)
    return {"ranks": ranker.ranks(), "loss": loss.item(), "history": ranker.history}


if __name__ == "__main__":
    main()
