"""Physical pruning of ranks: which gates of a bond survive, and a layer re-laid out to them.

Per bond, the gates with ``|g| >= threshold`` survive, at least ``min_rank`` of them (the largest),
rounded up to ``rank_multiple`` (largest gates first, never above the current rank). The cores on
both sides are sliced physically: each layer's flat core and gate Parameters re-laid out by one
gather (the same Parameter objects, see ``TTParametrization.relayout_``), together with their
gradients and every optimizer state tensor of their shape. The surviving gates keep their values,
so the layer computes exactly what it computed with the pruned gates set to zero. A bond that
keeps no gate (only with ``min_rank=0``) zeroes its layer: rank 1 on every bond, cores, gates and
their optimizer state zero (the TT kernels need ranks >= 1).
"""

from __future__ import annotations

import logging

import torch

from comera_compile.rank_adaptation import distributed, sharded
from comera_compile.tensorize import TTParametrization

log = logging.getLogger(__name__)

__all__ = ["decision_magnitudes", "floored_bond", "is_zeroed", "kept_rank", "keep_mask", "raise_recompile_limit",
           "shrink_", "slice_bonds", "surviving", "zero_layer"]


def kept_rank(above: int, size: int, min_rank: int, rank_multiple: int) -> int:
    """The rank a bond of ``size`` gates keeps when ``above`` of them are >= the threshold: at
    least ``min_rank`` (never more than it has), rounded up to ``rank_multiple``."""
    n = max(above, min_rank)
    if n == 0:
        return 0
    m = rank_multiple
    return min(size, -(-n // m) * m)


def surviving(mag: torch.Tensor, threshold: float, min_rank: int, rank_multiple: int) -> torch.Tensor:
    """Indices (ascending) of the gates of one bond that survive (the largest); empty: the bond
    is gone (only with ``min_rank=0``)."""
    n = kept_rank(int((mag >= threshold).sum()), mag.numel(), min_rank, rank_multiple)
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    order = torch.sort(mag, descending=True, stable=True).indices[:n]
    return torch.sort(order).values


def decision_magnitudes(params: list[TTParametrization]) -> list[list[torch.Tensor]]:
    """Every layer's gate magnitudes per bond (CPU, float32) that a pruning event decides on: rank
    0's under torch.distributed."""
    mags = [[g.abs().float().cpu() for g in sharded.full(param.gate_flat.detach()).split(param.gate_sizes)]
            for param in params]
    dist = distributed.world()
    if dist is not None:
        mags = distributed.broadcast_from_first(dist, mags, params[0].gate_flat.device)
    return mags


def _keep_bond(positions: tuple[list[torch.Tensor], list[torch.Tensor]], k: int, keep: torch.Tensor) -> None:
    """Keep the ranks ``keep`` of bond ``k + 1`` in the index maps: core k's last dim, gate k, core
    k + 1's first dim."""
    cores, gates = positions
    keep = keep.to(cores[k].device)
    cores[k] = cores[k].index_select(cores[k].dim() - 1, keep)
    gates[k] = gates[k].index_select(0, keep)
    cores[k + 1] = cores[k + 1].index_select(0, keep)


def slice_bonds(param: TTParametrization, keeps: list[torch.Tensor],
                optimizer: torch.optim.Optimizer | None) -> bool:
    """Keep the gates ``keeps[k]`` of every bond (and the cores' ranks with them) in one re-layout, with
    ``optimizer``'s state; returns whether any bond lost a gate."""
    positions = param.positions()
    cut = False
    for k, keep in enumerate(keeps):
        if keep.numel() < param.gate_sizes[k]:
            _keep_bond(positions, k, keep)
            cut = True
    if cut:
        param.relayout_(*positions, optimizers=[] if optimizer is None else [optimizer])
    return cut


def keep_mask(param: TTParametrization, keeps: list[torch.Tensor]) -> torch.Tensor:
    """``gate_flat``'s entries as 1 where bond k keeps the gates ``keeps[k]``, else 0 (CPU, float32)."""
    masks = []
    for keep, size in zip(keeps, param.gate_sizes):
        mask = torch.zeros(size)
        mask[keep] = 1.0
        masks.append(mask)
    return torch.cat(masks) if masks else torch.zeros(0)


@torch.no_grad()
def shrink_(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, list[int]]:
    """Slice every tensor-train layer of ``model`` to its gates that are not exactly zero (what
    ``prune_mode="mask"`` leaves), keeping at least one per bond (a bond whose every gate is zero
    zeroes its layer, as :func:`zero_layer`); ``optimizer``: its state tensors are sliced too. For a
    model trained under FSDP2, call it on the unsharded model (e.g. loaded from the checkpoint), before
    the sharding. Returns every layer's ranks after it. The layers compute what they computed."""
    from comera_compile.tensorize import iter_tt_layers, require_unsharded

    require_unsharded(model, "shrink_")
    ranks = {}
    for layer in iter_tt_layers(model):
        param = layer.param
        keeps = [g.detach().ne(0).nonzero().flatten().cpu() for g in param.gates]
        if any(k.numel() == 0 for k in keeps):
            zero_layer(param, optimizer)
            ranks[layer.fqn] = [0] * len(param.gate_sizes)
        else:
            slice_bonds(param, keeps, optimizer)
            ranks[layer.fqn] = list(param.gate_sizes)
    return ranks


def zero_layer(param: TTParametrization, optimizer: torch.optim.Optimizer | None) -> None:
    """Rank 1 on every bond, everything zero (cores, gates, their gradients and ``optimizer``'s state):
    the layer's weight is zero for good."""
    positions = param.positions()
    for k in range(len(param.gate_sizes)):
        _keep_bond(positions, k, torch.zeros(1, dtype=torch.long))
    param.relayout_(*positions, optimizers=[] if optimizer is None else [optimizer])
    for p in (param.core_flat, param.gate_flat):
        p.data.zero_()
        if p.grad is not None:
            p.grad.zero_()
        for value in ({} if optimizer is None else optimizer.state.get(p, {})).values():
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                value.zero_()


def is_zeroed(param: TTParametrization) -> bool:
    """Whether the layer's weight is zero for good: a bond with every gate exactly zero (what
    :func:`zero_layer` leaves)."""
    gates = sharded.full(param.gate_flat.detach())
    return bool(gates.numel()) and any(not bool(g.any()) for g in gates.split(param.gate_sizes))


def floored_bond(mags: list[torch.Tensor], threshold: float) -> int | None:
    """The first bond (0-based) whose every gate is below the threshold, so that only ``min_rank``
    keeps it; None if there is none."""
    for k, mag in enumerate(mags):
        if mag.numel() and float(mag.max()) < threshold:
            return k
    return None


def raise_recompile_limit(base: int | None, extra: int) -> int | None:
    """Raise ``torch._dynamo.config``'s recompile limits to ``base + extra`` where they are lower
    (``base``: the limit before the first event, read now when None); returns ``base``."""
    config = torch._dynamo.config
    names = [n for n in ("recompile_limit", "cache_size_limit") if hasattr(config, n)][:1]
    names += [n for n in ("accumulated_recompile_limit", "accumulated_cache_size_limit") if hasattr(config, n)][:1]
    if not names:
        return base
    if base is None:
        base = int(getattr(config, names[0]))
    needed = base + extra
    for name in names:
        current = int(getattr(config, name))
        if current < needed:
            setattr(config, name, needed)
            log.info("RankAdaptation: torch._dynamo.config.%s raised %d -> %d (one recompile per pruning "
                     "event)", name, current, needed)
    return base
