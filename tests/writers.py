"""Writes that the passes must see, shared by the tests and the fuzzers."""

import torch


class ScaleInPlace(torch.autograd.Function):
    """Halves its input in place and says so (``ctx.mark_dirty``); Dynamo traces it where the input
    needs a gradient."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(0.5)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


@torch.compiler.allow_in_graph
def opaque_scale(t):
    """A function Dynamo keeps whole in the graph: its writes are unknown to the passes."""
    t.mul_(0.5)
    return t
