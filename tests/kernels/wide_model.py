"""A one-layer model wide enough for the planner to contract the tokens, and the check that a compiled
training step of it matches eager (shared by the btt and TT-matrix contraction tests)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from comera_compile import explain


class Wide(nn.Module):
    """``fc`` (features -> features, the layer to tensorize), GELU, a 3-class head."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.out = nn.Linear(features, 3)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


def compiled_step_matches_eager(eager: nn.Module, x: torch.Tensor, **options) -> str:
    """Loss and every gradient of one step under ``backend="comera"`` (aot_eager inside, fullgraph;
    ``options``: more backend options) against eager; returns ``explain``'s text."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(compiled_model, backend="comera", options={"inner": "aot_eager", **options},
                         fullgraph=True)
    target = torch.randint(0, 3, x.shape[:-1], generator=torch.Generator().manual_seed(0))

    def run(model, fn):
        model.zero_grad()
        loss = F.cross_entropy(fn(x).flatten(0, 1), target.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = run(eager, eager)
    got_loss, got = run(compiled_model, step)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        scale = want[name].abs().max().item() or 1.0
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    return str(explain(compiled_model, x))
