"""The collectives that make every process of a ``torch.distributed`` run decide alike: the observed
loss averaged over the processes, the gate values that decide a pruning event taken from rank 0."""

from __future__ import annotations

import torch

__all__ = ["broadcast_from_first", "collective_device", "mean_over_processes", "world"]


def world():
    """``torch.distributed`` when it is initialized with more than one process, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def collective_device(dist, default: torch.device) -> torch.device:
    """NCCL only reduces CUDA tensors; gloo takes CPU tensors (and CUDA ones)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if default.type != "cuda" else default


def mean_over_processes(dist, value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The mean of the processes' scalar ``value`` (None where a process has none; None when none has).
    Every process must call: one without a value contributes NaN-free zeros and a count of 0."""
    t = torch.zeros(2, dtype=torch.float64, device=collective_device(dist, device))
    if value is not None:
        t[0], t[1] = value.detach().reshape(()).to(t), 1.0
    dist.all_reduce(t)
    return None if t[1] == 0 else t[0] / t[1]


def broadcast_from_first(dist, groups: list[list[torch.Tensor]], device: torch.device) -> list[list[torch.Tensor]]:
    """Rank 0's values of the (CPU) tensors ``groups``, one broadcast for all of them."""
    flat = torch.cat([t for group in groups for t in group]).to(collective_device(dist, device))
    dist.broadcast(flat, src=0)
    flat, i = flat.cpu(), 0
    out = []
    for group in groups:
        out.append([])
        for t in group:
            out[-1].append(flat[i:i + t.numel()])
            i += t.numel()
    return out
