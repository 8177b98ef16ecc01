"""The size objective: ``S(g)``, its normalization ``W_0``, its gradient (the penalty) and the
effective size.

``S = sum_layers sum_k c_k * rho_{k-1} * rho_k`` with ``rho_k = ||g_k||_1`` (the l0 "rank" of bond k
relaxed to l1; ``rho_0 = rho_d = 1``) and ``c_k`` from :func:`size_coefficients`. ``W_0`` is the mean
over all gates of ``dS/d|g|`` when the objective was built. The penalty gradient of
``gamma * S / W_0`` is ``gamma * sign(g_{k,i}) * (c_k rho_{k-1} + c_{k+1} rho_{k+1}) / W_0`` on every
bond that holds more than ``min_rank`` gates (a bond at its floor cannot be pruned further: it is
not pushed). Every layer's gates are handled as one vector, so that the penalty and the effective
size are a few tensor ops per step whatever the number of layers and bonds.
"""

from __future__ import annotations

import math
from typing import Collection, NamedTuple, Sequence

import torch

from comera_compile import tt
from comera_compile.rank_adaptation import sharded
from comera_compile.rank_adaptation.config import WEIGHTS
from comera_compile.rank_adaptation.pruning import kept_rank
from comera_compile.tensorize import TTParametrization

__all__ = ["GateLayout", "SizeObjective", "mean_abs", "size_coefficients"]


def size_coefficients(spec: tt.TTSpec, weight: str = "params") -> list[float]:
    """``c_k`` of every core: the size of a layer is ``sum_k c_k * r_{k-1} * r_k``.

    ``"params"``: the core's chain mode ``s_k`` (its parameters per unit of ``r_{k-1} * r_k``).
    ``"flops"``: 2x the multiply-adds per token of contracting core k when the input streams
    through the cores in order (TT Linear: the input modes one by one, then the output modes grow;
    TT-matrix Linear: input mode k out, output mode k in; Embedding: the left-to-right product of
    the looked-up slices, ``prod(col_modes[:k+1])`` wide; BTT: ``2 s_k``, its two batched GEMMs).
    """
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")
    if weight == "params":
        return [float(s) for s in spec.sizes]
    if spec.fmt == "btt":  # run as two batched GEMMs over the blocks: 2 FLOPs per parameter per token
        return [2.0 * s for s in spec.sizes]
    rm, cm, d = spec.row_modes, spec.col_modes, spec.n_cores
    embedding = not spec.transpose  # Linear layers are stored transposed (rows = in_features)
    if embedding:
        if spec.fmt == "tt":
            modes = [1] * len(rm) + list(cm)  # row cores are gathered; column cores spread out
            return [2.0 * math.prod(modes[: k + 1]) for k in range(d)]
        return [2.0 * math.prod(cm[: k + 1]) for k in range(d)]
    if spec.fmt == "tt":
        a = len(rm)
        out = [2.0 * rm[k] * math.prod(rm[k + 1:]) for k in range(a)]
        out += [2.0 * math.prod(cm[: k - a + 1]) for k in range(a, d)]
        return out
    return [2.0 * math.prod(cm[: k + 1]) * rm[k] * math.prod(rm[k + 1:]) for k in range(d)]


def mean_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mean ``|x|`` over every entry of ``tensors`` (a 0-d float32 tensor; no host sync; ``DTensor`` s
    are gathered first)."""
    tensors = [sharded.full(t) for t in tensors]
    total = torch.stack(torch._foreach_norm(tensors, 1)).float().sum()
    return total / sum(t.numel() for t in tensors)


class GateLayout(NamedTuple):
    """Every layer's ``gate_flat`` laid end to end (``key``: their sizes, device and ``min_rank``):
    the bond of each gate entry, and per bond its coefficients and neighbours."""

    key: tuple
    bond_of: torch.Tensor  # [entries] global bond index of each gate entry
    left: torch.Tensor  # [bonds] position of the left neighbour's l1 norm in [1, rho...] (0: none, rho = 1)
    right: torch.Tensor  # [bonds] the same for the right neighbour
    c_left: torch.Tensor  # [bonds] c_k of the core on the bond's left
    c_right: torch.Tensor  # [bonds] c_{k+1} of the core on its right
    active: torch.Tensor  # [bonds] 1.0 where the bond holds more than min_rank gates (0: nothing to prune)
    entries: list[int]  # gate entries per layer


class SizeObjective:
    """``S(g)`` of the layers ``params`` (their ``cores``, ``gates`` and sizes are read afresh after
    every pruning event), weighted by ``weight`` (``"params"`` or ``"flops"``); ``size_ref`` is
    ``W_0``, taken now."""

    def __init__(self, params: Sequence[TTParametrization], weight: str, min_rank: int) -> None:
        self.params = list(params)
        specs = [param.spec for param in self.params]
        self.coeffs = [size_coefficients(spec, weight) for spec in specs]
        self.chain_modes = [spec.sizes for spec in specs]  # core k holds r_{k-1} * s_k * r_k parameters
        self._layout: GateLayout | None = None
        self.size_ref = max(self.mean_gate_weight(min_rank), 1e-30)

    def layout(self, min_rank: int, live: tuple | None = None) -> GateLayout:
        """The index maps over all layers' gates, rebuilt when a pruning event changed the sizes.
        ``live``: per layer, per bond, the gates not masked (``prune_mode="mask"``; None: all), which
        decide whether a bond is above ``min_rank``."""
        device = self.params[0].gate_flat.device
        sizes_now = tuple(tuple(param.gate_sizes) for param in self.params)
        key = (device, sizes_now, min_rank, live)
        if self._layout is not None and self._layout.key == key:
            return self._layout
        bond_of, left, right, c_left, c_right, active = [], [], [], [], [], []
        for sizes, alive, coeffs in zip(sizes_now, live or sizes_now, self.coeffs):
            first = len(left)  # rho of global bond j sits at j + 1 in [1, rho...]
            for k, size in enumerate(sizes):  # gate k sits on bond k + 1, between cores k and k + 1
                bond_of += [first + k] * size
                left.append(first + k if k > 0 else 0)
                right.append(first + k + 2 if k + 1 < len(sizes) else 0)
                c_left.append(coeffs[k])
                c_right.append(coeffs[k + 1])
                active.append(1.0 if alive[k] > min_rank else 0.0)
        self._layout = GateLayout(
            key, *(torch.tensor(v, dtype=torch.long, device=device) for v in (bond_of, left, right)),
            *(torch.tensor(v, dtype=torch.float32, device=device) for v in (c_left, c_right, active)),
            [sum(sizes) for sizes in sizes_now])
        return self._layout

    def gates(self) -> torch.Tensor:
        """Every layer's gates, end to end (detached)."""
        return torch.cat([sharded.full(param.gate_flat.detach()) for param in self.params])

    @staticmethod
    def bond_weights(layout: GateLayout, gates: torch.Tensor) -> torch.Tensor:
        """``dS / d|g|`` per bond: ``c_k rho_{k-1} + c_{k+1} rho_{k+1}`` (``rho``: the gates' l1 norms)."""
        mags = gates.abs().float()
        rho = mags.new_zeros(len(layout.left)).index_add_(0, layout.bond_of, mags)
        rho = torch.cat([rho.new_ones(1), rho])
        return layout.c_left * rho[layout.left] + layout.c_right * rho[layout.right]

    def mean_gate_weight(self, min_rank: int) -> float:
        """Mean over all gates of ``dS / d|g_{k,i}| = c_k rho_{k-1} + c_{k+1} rho_{k+1}``."""
        layout = self.layout(min_rank)
        if not layout.bond_of.numel():
            return 0.0
        return float(self.bond_weights(layout, self.gates())[layout.bond_of].double().mean())

    def relaxed_size(self) -> float:
        """``S(g)``: ``sum c_k * rho_{k-1} * rho_k`` over the layers, ``rho = ||g||_1`` (unnormalized)."""
        total = 0.0
        for param, coeffs in zip(self.params, self.coeffs):
            gates = sharded.full(param.gate_flat.detach()).split(param.gate_sizes)
            rho = [1.0] + [float(g.abs().sum()) for g in gates] + [1.0]
            total += sum(c * rho[k] * rho[k + 1] for k, c in enumerate(coeffs))
        return total

    def penalty(self, gamma: float | torch.Tensor, min_rank: int, live: tuple | None = None) -> list[torch.Tensor]:
        """``d(gamma * S(g) / W_0) / dg`` of each layer, laid out like its ``gate_flat`` (float32);
        tensors throughout, a fixed number of ops per step: no host synchronization on the GPU.
        ``live``: as for :meth:`layout`."""
        layout = self.layout(min_rank, live)
        gates = self.gates()
        weights = self.bond_weights(layout, gates) * layout.active * (gamma / self.size_ref)
        return list((torch.sign(gates).float() * weights[layout.bond_of]).split(layout.entries))

    def effective_params(self, total: int, *, threshold: float, min_rank: int, rank_multiple: int,
                         zeroed: Collection[int] = ()) -> int:
        """``total`` parameters with each bond's rank counted as the rank a pruning event would leave
        it now (:func:`~comera_compile.rank_adaptation.pruning.kept_rank` of its gates >= threshold);
        the layers ``zeroed`` (indices) and those that would lose a bond count 0."""
        layout = self.layout(min_rank)
        above = (self.gates().abs() >= threshold).long()
        per_bond = above.new_zeros(len(layout.left)).index_add_(0, layout.bond_of, above)
        counts = iter(per_bond.tolist())  # one host sync
        for i, (param, modes) in enumerate(zip(self.params, self.chain_modes)):
            total -= param.core_flat.numel() + param.gate_flat.numel()
            ranks = [1] + [kept_rank(next(counts), size, min_rank, rank_multiple) for size in param.gate_sizes]
            ranks.append(1)
            if i not in zeroed and all(ranks):  # cores and gates at those ranks
                total += sum(r * s * q for r, s, q in zip(ranks, modes, ranks[1:])) + sum(ranks[1:-1])
        return total
