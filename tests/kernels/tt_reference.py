"""Test helpers for the TT ops: a tiny core generator and an independent dense reference.

The reference materializes the TT matrix with plain tensordots, written here without the package's
planner or format code, then applies F.linear / F.embedding.
"""

from __future__ import annotations

import math

import torch


def make_cores(fmt, row_modes, col_modes, ranks, dtype=torch.float64, seed=0, gate_jitter=True):
    g = torch.Generator().manual_seed(seed)
    d = len(ranks) - 1
    ns = list(row_modes) + list(col_modes)
    cores = []
    for k in range(d):
        shape = (ranks[k], ns[k], ranks[k + 1]) if fmt == "tt" else (ranks[k], row_modes[k], col_modes[k], ranks[k + 1])
        cores.append((torch.randn(shape, generator=g, dtype=torch.float64) / math.sqrt(ranks[k + 1])).to(dtype))
    gates = []
    for k in range(d - 1):
        gk = torch.ones(ranks[k + 1], dtype=torch.float64)
        if gate_jitter:
            gk = gk + 0.5 * torch.rand(ranks[k + 1], generator=g, dtype=torch.float64)
        gates.append(gk.to(dtype))
    return cores, gates


def dense_matrix(cores, gates, fmt, row_modes, col_modes):
    """M [prod(row_modes), prod(col_modes)] from the cores: G1 g1 G2 g2 ... Gd, reshaped row-major."""
    cur = cores[0]
    for k in range(1, len(cores)):
        cur = torch.tensordot(cur * gates[k - 1], cores[k], dims=([cur.dim() - 1], [0]))
    t = cur.squeeze(0).squeeze(-1)
    if fmt == "ttm":
        a = len(row_modes)
        t = t.permute([2 * i for i in range(a)] + [2 * i + 1 for i in range(a)])
    return t.reshape(math.prod(row_modes), math.prod(col_modes))


def linear_reference(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols):
    w = dense_matrix(cores, gates, fmt, row_modes, col_modes)[:rows, :cols]
    return torch.nn.functional.linear(x, w.T, bias)


def embedding_reference(indices, cores, gates, fmt, row_modes, col_modes, rows, cols):
    w = dense_matrix(cores, gates, fmt, row_modes, col_modes)[:rows, :cols]
    return torch.nn.functional.embedding(indices, w)
