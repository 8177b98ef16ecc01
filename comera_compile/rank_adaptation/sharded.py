"""Gates and gradients that FSDP2 holds as ``DTensor`` s: what rank adaptation reads in full and writes
back into each process's shard.

The gates are a few entries per layer, so the objective and the pruning decisions read them whole
(``full_tensor()``: one all-gather each, every process calls it in the same order); what they write
(the penalty's gradient, a pruning mask) is a full tensor that every process computed alike, laid out
as the parameter is (``like``: each process keeps its own shard of it, no communication).
"""

from __future__ import annotations

import torch

__all__ = ["full", "is_dtensor", "like", "local"]


def is_dtensor(t: torch.Tensor | None) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one plain tensor: a ``DTensor`` gathered (every process must call), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's entries of ``t`` (its shard's local tensor, sharing storage), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The full tensor ``value`` (the same on every process) laid out as ``ref``: for a ``DTensor`` the
    same mesh and placements, each process keeping its shard; else ``value`` itself."""
    if not is_dtensor(ref):
        return value
    from torch.distributed.tensor import DTensor, Replicate

    mesh = ref.device_mesh
    value = value.to(device=ref.device, dtype=ref.dtype)
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
        mesh, ref.placements)
