"""The TT executor: what a tensor-train layer computes, shared by eager calls and compiled graphs;
and ``comera::tt_index_split``, the embedding lookup's range check.

The executor's ops live in their own modules: the merges of a layer group as one opaque op
(``comera::tt_group_merge``, :func:`~comera_compile.kernels.tt_group_merge.group_outputs_opaque`) in
:mod:`comera_compile.kernels.tt_group_merge`, which builds on the stacked merges here
(:func:`group_stacked`, :func:`merge_args`, :func:`stacked_layout`); a btt layer's blocks path
(``comera::btt_blocks``) in :mod:`comera_compile.kernels.btt_blocks`.

Everything here is plain, differentiable torch, so the same functions serve three callers:

* the ``tensor_network`` pass puts calls to them into the Dynamo graph (AOTAutograd then traces them:
  their backward is derived, and Inductor fuses the elementwise work around the GEMMs);
* :func:`comera_compile.tt_linear` / :func:`comera_compile.tt_embedding` call them eagerly;
* tests and benchmarks.

A layer is described by its :class:`~comera_compile.tt.format.TTSpec` and the part of its plan that
does not depend on the tokens, a :class:`~comera_compile.tt.planner.Cut` (``TTPlan.cut``, or the plan
itself). The work of a layer splits into two parts (the plan of :mod:`comera_compile.tt.planner`):

1. **token-independent**: fold each rank gate into the core on its left, cut the chain at bond
   ``split`` and merge each half in the planned order (:func:`group_outputs`). Layers with the same
   structure are stacked and merged together, one batched GEMM per merge step for the whole group.
   Each layer then gets what its token-sized step needs: the two factors of a low-rank product
   (``"factors"``), its dense weight exactly as ``comera::tt_materialize`` returns it (``"dense"``), or
   the two gather tables of an embedding lookup (``"tables"``).
2. **token-sized**: :func:`project` (``x @ F1``, then the caller's own ``F.linear(t, F2, bias)``), a
   plain ``linear``/``embedding`` with the dense weight, or :func:`lookup`.

A block tensor-train (``"btt"``) layer is no chain: :func:`btt_linear` contracts the tokens through its
two cores as two batched GEMMs (the plan's ``"blocks"`` strategy), straight from the flat storage.

Merges run in the site's compute dtype (bf16 under autocast: tensor cores, fp32 accumulation), with
autocast switched off inside so the dtypes are exactly the ones written here.

``comera::tt_index_split(indices, rows, ir)`` splits row indices into ``(i // ir, i % ir)`` after
checking them the way ``nn.Embedding`` does: an index outside ``[0, rows)`` raises IndexError on the
CPU and fails a device-side assert on the GPU (no host sync, so it is safe inside a CUDA graph). The
rows of the padding (``rows <= i < prod(row_modes)``) are out of range too.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Literal, Sequence, Union, get_args

import torch

from comera_compile.tt.format import TTSpec, chain_modes, join_flat, materialize, split_flat
from comera_compile.tt.planner import Bracket, Cut
from comera_compile.kernels import btt_blocks as _btt_blocks_op  # noqa: F401 (defines comera::btt_blocks)

if TYPE_CHECKING:
    from comera_compile.tt.planner import TTPlan

__all__ = ["OUTPUTS", "Output", "btt_linear", "btt_linear_shared", "btt_weight", "chain_modes", "ttm_contract", "group_outputs",
           "layer_outputs", "layer_spec",
           "lookup", "project"]
# Not in __all__, shared with the op modules beside this one (kernels/tt_group_merge.py): stack_flats,
# group_stacked, per_layer, static_shape, stacked_layout, merge_args, read_args, hashable_args.

#: What :func:`group_outputs` returns per layer (see there).
Output = Literal["factors", "factors_t", "dense", "dense_t", "tables"]
OUTPUTS: tuple[str, ...] = get_args(Output)
RANK_ALIGN = 8  # bond sizes of the factors and tables are padded to a multiple of this (16 bytes in bf16)
_INDEX_MESSAGE = "index out of range in self"


@torch.library.custom_op("comera::tt_index_split", mutates_args=())
def _tt_index_split(indices: torch.Tensor, rows: int, ir: int) -> tuple[torch.Tensor, torch.Tensor]:
    if indices.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"Expected tensor for argument #1 'indices' to have one of the following scalar "
                           f"types: Long, Int; but got {indices.dtype} instead")
    ok = (indices >= 0) & (indices < rows)
    if indices.is_cuda:
        torch._assert_async(ok.all(), _INDEX_MESSAGE)
    elif indices.numel() and not bool(ok.all()):
        raise IndexError(_INDEX_MESSAGE)
    idx = indices.long()
    return torch.div(idx, ir, rounding_mode="floor"), torch.remainder(idx, ir)


@_tt_index_split.register_fake
def _(indices, rows, ir):
    return indices.new_empty(indices.shape, dtype=torch.int64), indices.new_empty(indices.shape, dtype=torch.int64)


def layer_spec(op: str, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], fmt: str,
               row_modes: Sequence[int], col_modes: Sequence[int], rows: int, cols: int,
               transpose: bool = False) -> TTSpec:
    """The spec of one layer given as lists of cores and gates (ranks read off the cores), every
    count and shape checked (:meth:`TTSpec.from_cores`); a ValueError names ``op``. One core is
    refused: it is the dense matrix itself."""
    try:
        spec = TTSpec.from_cores(cores, fmt, row_modes, col_modes, rows, cols, transpose, gates=gates)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    if spec.n_cores < 2:
        raise ValueError(f"{op}: a single core is the dense matrix itself; use it directly")
    return spec


def _no_autocast(t: torch.Tensor):
    if t.device.type == "meta":  # shapes only (:func:`stacked_layout`): autocast has no meta device
        import contextlib

        return contextlib.nullcontext()
    return torch.autocast(device_type=t.device.type, enabled=False)


def _stacked_chain(core_flats: Sequence[torch.Tensor], gate_flats: Sequence[torch.Tensor],
                   modes: Sequence[tuple[int, int]], ranks: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Per core position: the K layers' cores as [K, r, s, r] (s = m * n), each gate folded into its
    left core, in ``dtype``. The layers' flat storages are stacked once ([K, numel]); every core is a
    strided view of that stack, so the whole group costs one stack per storage, not one per core."""
    return _chain_of_stack(stack_flats(core_flats), stack_flats(gate_flats), modes, ranks, dtype)


def stack_flats(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """The K layers' flat storages as one [K, numel] tensor (a view for one layer)."""
    return torch.stack(list(flats)) if len(flats) > 1 else flats[0][None]


def _chain_of_stack(cores: torch.Tensor, gates: torch.Tensor, modes: Sequence[tuple[int, int]],
                    ranks: Sequence[int], dtype: torch.dtype, split: bool = False) -> list[torch.Tensor]:
    """:func:`_stacked_chain` of storages already stacked, ``cores`` [K, numel] and ``gates`` [K, n_gates].

    The cores are slices of the storage, or with ``split`` the pieces of one ``torch.split``. The two
    differ only in their backward: a slice's backward is a zero-filled copy of the whole storage per
    core, summed, a split's one concatenation. Slices are the default: traced by Inductor their backward
    fuses into fewer kernels. The split is for a backward run eagerly (the opaque merges' backward op),
    where it takes fewer ops."""
    K, d = cores.shape[0], len(modes)
    pieces = _cut(cores, [ranks[k] * m * n * ranks[k + 1] for k, (m, n) in enumerate(modes)], split)
    bond_gates = _cut(gates, list(ranks[1:d]), split)
    chain = []
    for k, (m, n) in enumerate(modes):
        core = pieces[k].view(K, ranks[k], m * n, ranks[k + 1])
        if k < d - 1:
            core = core * bond_gates[k][:, None, None, :]
        chain.append(core.to(dtype))
    return chain


def _cut(t: torch.Tensor, sizes: Sequence[int], split: bool) -> Sequence[torch.Tensor]:
    """``t`` [K, n] cut along its second axis into pieces of ``sizes`` (any rest beyond them dropped):
    by one ``torch.split`` or by slices (see :func:`_chain_of_stack`)."""
    if split:
        return torch.split(t, list(sizes) + [t.shape[1] - sum(sizes)], dim=1)[:len(sizes)]
    starts = [0, *itertools.accumulate(sizes)]
    return [t[:, a:b] for a, b in zip(starts, starts[1:])]


def _merge(chain: list[torch.Tensor], bracket: Bracket) -> torch.Tensor:
    """Contract a run of stacked chain cores in the bracket's order: [K, r_lo, S, r_hi]."""
    if isinstance(bracket, int):
        return chain[bracket]
    a, b = _merge(chain, bracket[0]), _merge(chain, bracket[1])
    K, r0, sa, r1 = a.shape
    sb, r2 = b.shape[2], b.shape[3]
    out = torch.bmm(a.reshape(K, r0 * sa, r1), b.reshape(K, r1, sb * r2))
    return out.reshape(K, r0, sa * sb, r2)


def _to_rows_cols(t: torch.Tensor, modes: Sequence[tuple[int, int]], rank_first: bool) -> torch.Tensor:
    """A merged half [K, (m1 n1 m2 n2 ...), r] (or [K, r, ...] when ``rank_first``) as
    [K, prod m, prod n, r]: the modes regrouped rows first (a view for ``"tt"``, a copy for ``"ttm"``)."""
    K, r = t.shape[0], t.shape[1] if rank_first else t.shape[-1]
    shape = [K] + ([r] if rank_first else []) + [v for mn in modes for v in mn] + ([] if rank_first else [r])
    t = t.reshape(shape)
    first = 2 if rank_first else 1
    rows = [first + 2 * i for i in range(len(modes))]
    cols = [first + 2 * i + 1 for i in range(len(modes))]
    rank = [1] if rank_first else [len(shape) - 1]
    t = t.permute([0] + rows + cols + rank)
    return t.reshape(K, math.prod(m for m, _ in modes), math.prod(n for _, n in modes), r)


def group_outputs(core_flats: Sequence[torch.Tensor], gate_flats: Sequence[torch.Tensor], spec: TTSpec,
                  plan: Union[Cut, "TTPlan"], output: Output, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The token-independent work of K layers of one structure ``spec`` (their cores and gates in flat
    storage, as ``comera::tt_materialize`` takes them), cut and merged as ``plan`` says (its ``split``,
    ``left`` and ``right``: a :class:`~comera_compile.tt.planner.Cut` or a ``TTPlan``), batched; per
    layer, in order:

    * ``"factors"``: ``(F1, F2)`` with ``x @ M = linear(x @ F1, F2)``: F1 = L[:rows] [rows, r],
      F2 = R[:, :cols]ᵀ [cols, r] (cut at the spec's ``bottleneck``; r zero-padded to a multiple of
      ``RANK_ALIGN``, as for the tables);
    * ``"factors_t"``: the same for ``x @ Mᵀ`` (a tied head): F1 = R[:, :cols]ᵀ, F2 = L[:rows];
    * ``"dense"`` / ``"dense_t"``: ``M[:rows, :cols]`` / its transpose, as ``tt_materialize`` gives it;
    * ``"tables"``: ``(A, B)``, A [I_L, O_L, r] and B [I_R, O_R, r] for :func:`lookup`.

    ``output`` says which product is wanted; ``spec.transpose`` is not read. A block tensor-train
    (``spec.fmt == "btt"``) has no chain to cut: ``plan`` is not read and only ``"dense"`` /
    ``"dense_t"`` apply (its K weights formed by one batched product, :func:`_btt_group_weights`).
    """
    if output not in OUTPUTS:
        raise ValueError(f"group_outputs: output={output!r}; valid values: {list(OUTPUTS)}")
    if spec.fmt == "btt" and output not in ("dense", "dense_t"):
        raise ValueError(f"group_outputs: a btt layer gives output 'dense' or 'dense_t', got {output!r}")
    return per_layer(*group_stacked(stack_flats(core_flats), stack_flats(gate_flats), spec, plan, output, dtype))


def group_stacked(cores: torch.Tensor, gates: torch.Tensor, spec: TTSpec, plan: Union[Cut, "TTPlan"],
                  output: Output, dtype: torch.dtype, split: bool = False) -> tuple[torch.Tensor, ...]:
    """:func:`group_outputs` of the stacked storages ``cores`` [K, numel] and ``gates`` [K, n_gates]:
    each of the output's tensors stacked over the K layers ([K, ...]; layer k's is index k).
    ``split``: the cores cut from the storage by one split (:func:`_chain_of_stack`; for eager autograd)."""
    if spec.fmt == "btt":
        with _no_autocast(cores):
            return (_btt_group_weights(cores, gates, spec, dtype, output == "dense_t"),)
    modes, ranks, rows, cols = spec.chain_modes, spec.ranks, spec.rows, spec.cols
    with _no_autocast(cores):
        chain = _chain_of_stack(cores, gates, modes, ranks, dtype, split)
        L = _merge(chain, plan.left).squeeze(1)  # [K, S_L, r] (squeezed: its backward is a view, a select's a copy)
        R = _merge(chain, plan.right).squeeze(-1)  # [K, r, S_R]
        if output in ("factors", "factors_t", "tables"):
            L, R = _pad_rank(L, R)
        if output in ("factors", "factors_t"):
            f1, f2 = _crop(L, 1, rows), _crop(R, 2, cols).transpose(1, 2)
            return (f2, f1) if output == "factors_t" else (f1, f2)
        if output == "tables":
            return (_to_rows_cols(L, modes[:plan.split], rank_first=False),
                    _to_rows_cols(R, modes[plan.split:], rank_first=True))
        P, Q = spec.padded_rows, spec.padded_cols
        K = L.shape[0]
        full = torch.bmm(L, R)  # [K, S_L, S_R]: chain order
        if spec.interleaved:
            full = _to_rows_cols(full.reshape(K, -1, 1), modes, rank_first=False)
        m = _crop(_crop(full.reshape(K, P, Q), 1, rows), 2, cols)
        return (m.transpose(1, 2) if output == "dense_t" else m,)


@functools.lru_cache(maxsize=1024)
def stacked_layout(args: tuple, cores: tuple[tuple[int, ...], torch.dtype],
                   gates: tuple[tuple[int, ...], torch.dtype]) -> tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]:
    """(shape, stride, dtype) of each tensor :func:`group_stacked` returns for stacked storages of
    these (shape, dtype) and merge arguments (:func:`merge_args`, lists as tuples), computed once on the meta
    device with every dispatch mode off. Fake propagation (the pass's, AOTAutograd's, Inductor's) then costs
    one allocation per output instead of running the merges under a fake mode each time."""
    from torch.utils._python_dispatch import _disable_current_modes

    spec, cut, output, dtype = read_args(*args)
    with _disable_current_modes():
        c = torch.empty(cores[0], dtype=cores[1], device="meta")
        g = torch.empty(gates[0], dtype=gates[1], device="meta")
        outs = group_stacked(c, g, spec, cut, output, dtype)
    return tuple((tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs)


def static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s shape as ints, or None where a size is symbolic."""
    return tuple(t.shape) if all(isinstance(v, int) for v in t.shape) else None


def group_outputs_like(core_flats: Sequence[torch.Tensor], gate_flats: Sequence[torch.Tensor], spec: TTSpec,
                       plan: Union[Cut, "TTPlan"], output: Output, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Uninitialised tensors with the shapes, strides, dtypes and device of :func:`group_outputs`'
    (on fake inputs: fake tensors of their mode), views of one stacked tensor per output kind as
    there. For fake propagation; symbolic sizes fall back to :func:`group_outputs` itself."""
    cores, gates = static_shape(core_flats[0]), static_shape(gate_flats[0])
    if cores is None or gates is None or spec.fmt == "btt" and output not in ("dense", "dense_t"):
        return group_outputs(core_flats, gate_flats, spec, plan, output, dtype)
    K = len(core_flats)
    layout = stacked_layout(hashable_args(merge_args(spec, plan, output, dtype)), ((K, *cores), core_flats[0].dtype),
                            ((K, *gates), gate_flats[0].dtype))
    device = core_flats[0].device
    return per_layer(*(torch.empty_strided(shape, stride, dtype=dt, device=device) for shape, stride, dt in layout))


def _btt_group_weights(cores: torch.Tensor, gates: torch.Tensor, spec: TTSpec, dtype: torch.dtype,
                       transpose: bool) -> torch.Tensor:
    """K block tensor-trains of one structure, their flat storages stacked (``cores`` [K, numel],
    ``gates`` [K, r]), as their matrices ``M[:rows, :cols]`` ([K, rows, cols]; ``transpose``: [K, cols,
    rows]) in ``dtype``: one batched product over every layer and block,
    ``M[z, (j, b), (c, a)] = sum_k R[z, j, b, c, k] g[z, k] L[z, k, c, j, a]`` (what :func:`btt_weight`
    forms for one layer)."""
    (b1, b2), (c, a), r = spec.row_modes, spec.col_modes, spec.ranks[1]
    K, n_r = cores.shape[0], b1 * b2 * c * r
    R = cores[:, :n_r].view(K, b1, b2, c, r).to(dtype) * gates.to(dtype)[:, None, None, None, :]
    L = cores[:, n_r:].view(K, r, c, b1, a).to(dtype)
    full = torch.einsum("zjbck,zkcja->zjbca", R, L).reshape(K, spec.padded_rows, spec.padded_cols)
    m = _crop(_crop(full, 1, spec.rows), 2, spec.cols)
    return m.transpose(1, 2) if transpose else m


def _crop(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` cut to ``size`` along ``dim`` (the padding of a factorized size); no op when it fits."""
    return t if t.shape[dim] == size else t.narrow(dim, 0, size)


def _pad_rank(L: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the bond between the halves to a multiple of ``RANK_ALIGN``: the rank-sized GEMM
    operands then have 16-byte aligned rows (cuBLAS takes slow paths for a rank of 30); the padded
    rank carries zeros, so every product is unchanged."""
    r = L.shape[-1]
    pad = -r % RANK_ALIGN
    if pad == 0:
        return L, R
    return torch.nn.functional.pad(L, (0, pad)), torch.nn.functional.pad(R, (0, 0, 0, pad))


def per_layer(*stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Layer k's slices of each stacked tensor, interleaved: ``unbind`` (whose backward is one ``stack``,
    so every layer's gradient lands in one buffer for the batched merge backward)."""
    parts = [t.unbind(0) for t in stacked]
    return tuple(p[k] for k in range(stacked[0].shape[0]) for p in parts)


def project(x: torch.Tensor, f1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first factor of a low-rank product: ``x @ F1`` in ``dtype`` (the rank-sized activations)."""
    with _no_autocast(x):
        return torch.matmul(x.to(dtype), f1)


def lookup(indices: torch.Tensor, A: torch.Tensor, B: torch.Tensor, rows: int, cols: int,
           padding_idx: int | None = None) -> torch.Tensor:
    """Embedding rows ``M[indices, :cols]`` from the tables of :func:`group_outputs`: row ``i = iL * I_R +
    iR`` is ``A[iL] · B[iR]ᵀ`` ([O_L, O_R] flattened row-major). Indices outside ``[0, rows)`` raise
    like ``nn.Embedding``'s (IndexError on the CPU, a device-side assert on the GPU). Lookups of
    ``padding_idx`` pass no gradient, as in ``F.embedding``."""
    ir, orr = B.shape[0], B.shape[1]
    flat = indices.reshape(-1)
    il_idx, ir_idx = _split_indices(flat, rows, ir)
    with _no_autocast(A):
        if ir == 1 and A.shape[1] == 1:  # "tt" cut between rows and columns: one GEMM
            out = torch.matmul(A[il_idx, 0], B[0].t())
        else:
            out = torch.bmm(A[il_idx], B[ir_idx].transpose(1, 2)).reshape(flat.shape[0], A.shape[1] * orr)
    out = _crop(out, 1, cols)
    if padding_idx is not None:
        pad = padding_idx + rows if padding_idx < 0 else padding_idx
        out = torch.where((flat == pad)[:, None], out.detach(), out)
    return out.reshape(*indices.shape, cols)


def _split_indices(flat: torch.Tensor, rows: int, ir: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i // ir, i % ir)`` after nn.Embedding's range check. On the GPU: a device-side assert, as
    nn.Embedding's CUDA kernel does (no host sync, capture-safe), in plain ops Inductor fuses; on the
    CPU: ``comera::tt_index_split``, which raises eager's IndexError."""
    if flat.is_cuda:
        torch._assert_async(((flat >= 0) & (flat < rows)).all(), _INDEX_MESSAGE)
        idx = flat.long()
        return torch.div(idx, ir, rounding_mode="floor"), torch.remainder(idx, ir)
    return torch.ops.comera.tt_index_split(flat, rows, ir)


def layer_outputs(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], spec: TTSpec,
                  plan: Union[Cut, "TTPlan"], output: Output, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`group_outputs` for one layer given as lists of cores and gates."""
    core_flat, gate_flat = join_flat(cores, gates)
    return group_outputs([core_flat], [gate_flat], spec, plan, output, dtype)


def btt_linear(x: torch.Tensor, core_flat: torch.Tensor, gate_flat: torch.Tensor, spec: TTSpec, x_times_m: bool,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x @ M + bias`` (``x_times_m``; ``x @ Mᵀ + bias`` otherwise) for the block tensor-train layer
    ``spec``, its cores in flat storage, without forming ``M``: the ``"blocks"`` plan of
    :func:`~comera_compile.tt.planner.plan_btt_linear`, in ``dtype`` (autocast off inside).

    With ``M[(j, b), (c, a)] = sum_k R[j, b, c, k] g[k] L[k, c, j, a]``: ``T[j] = X[:, j, :] @ (R g)[j]``
    (one GEMM per row block ``j``, batched), then ``Y[c] = T[:, :, c, :] @ L[:, c]`` (one per column
    block ``c``, batched). ``x @ Mᵀ`` is the same product with the roles of the cores swapped:
    ``Mᵀ[(c, a), (j, b)] = sum_k L'[c, a, j, k] g[k] R'[k, j, c, b]``, L' and R' permuted views.
    The two GEMMs and the regrouping between them run as one op, ``comera::btt_blocks``
    (:mod:`comera_compile.kernels.btt_blocks`), whose GEMMs read and write the token-major activations
    in place (strided batches), so no copy moves them into or out of block-major order."""
    (R, L), gates = split_flat(core_flat, gate_flat, spec)
    rows, cols = spec.rows, spec.cols
    first, second = R, L
    if not x_times_m:
        first, second = L.permute(1, 3, 2, 0), R.permute(3, 0, 2, 1)
        rows, cols = cols, rows
    with _no_autocast(x):
        first = (first * gates[0].to(first.dtype)).to(dtype)
        (y,) = _btt_apply(x.to(dtype), first, [second.to(dtype)], rows)
        return _finish(y, cols, None if bias is None else bias.to(dtype))


def btt_linear_shared(x: torch.Tensor, core_flats: Sequence[torch.Tensor], gate_flats: Sequence[torch.Tensor],
                      specs: Sequence[TTSpec], biases: Sequence[torch.Tensor | None],
                      dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`btt_linear` (``x @ M + bias``) for several block tensor-train layers that read the same
    ``x`` and have the same row blocks, rank and column block size (``b1 x b2``, ``r``, ``a``; the
    number of column blocks ``c`` may differ: Q, K and V; an MLP's gate and up projections): their
    first cores concatenated along the column blocks, one ``comera::btt_blocks`` call that writes each
    layer's output on its own. Returns one output per layer, in order."""
    firsts, seconds = [], []
    for core_flat, gate_flat, spec in zip(core_flats, gate_flats, specs):
        (R, L), gates = split_flat(core_flat, gate_flat, spec)
        firsts.append(R * gates[0].to(R.dtype))
        seconds.append(L)
    with _no_autocast(x):
        R = torch.cat([f.to(dtype) for f in firsts], dim=2)  # [b1, b2, C, r]
        ys = _btt_apply(x.to(dtype), R, [t.to(dtype) for t in seconds], specs[0].rows)
        return tuple(_finish(y, spec.cols, None if bias is None else bias.to(dtype))
                     for y, spec, bias in zip(ys, specs, biases))


def _btt_apply(x: torch.Tensor, R: torch.Tensor, Ls: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """``x [..., rows] -> [..., c_i a]`` per second core ``Ls[i]`` [r, c_i, b1, a] through ``R`` [b1, b2,
    C, r] (gate folded in; ``C = sum c_i``), one ``comera::btt_blocks`` call; each output uncropped."""
    b1, b2, c, r = R.shape
    lead = x.shape[:-1]
    xt = x.reshape(-1, x.shape[-1])
    if rows < b1 * b2:  # the padding rows of M meet zero features
        xt = torch.nn.functional.pad(xt, (0, b1 * b2 - rows))
    seconds = [L.permute(1, 2, 0, 3).reshape(L.shape[1], b1 * r, L.shape[3]) for L in Ls]
    ys = torch.ops.comera.btt_blocks(xt.contiguous(), R.reshape(b1, b2, c * r), seconds, r)[:-1]
    return [y.reshape(*lead, y.shape[-1]) for y in ys]


def _finish(y: torch.Tensor, cols: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``y`` cropped to its layer's ``cols`` outputs, plus the bias."""
    y = _crop(y, y.dim() - 1, cols)
    return y if bias is None else y + bias


def btt_weight(core_flat: torch.Tensor, gate_flat: torch.Tensor, spec: TTSpec, dtype: torch.dtype) -> torch.Tensor:
    """The block tensor-train's weight exactly as ``comera::tt_materialize`` returns it (``M`` or, with
    ``spec.transpose``, ``Mᵀ``), formed in ``dtype`` from plain torch ops (the planner's ``"dense"``
    strategy): in a compiled graph Inductor fuses the block products and their backward with the rest,
    where the marker op would run them opaquely, outside any CUDA graph."""
    cores, gates = split_flat(core_flat, gate_flat, spec)
    with _no_autocast(core_flat):
        return materialize([c.to(dtype) for c in cores], [g.to(dtype) for g in gates], spec)


def ttm_contract(x: torch.Tensor, core_flat: torch.Tensor, gate_flat: torch.Tensor, spec: TTSpec, x_times_m: bool,
                 bias: torch.Tensor | None, dtype: torch.dtype, equation: str, path: Sequence) -> torch.Tensor:
    """``x @ M + bias`` (``x_times_m``; ``x @ Mᵀ + bias`` otherwise) for the TT-matrix layer ``spec`` with
    the tokens contracted through its cores in ``path``'s pairwise order (the planner's ``"contract"``
    strategy, :func:`~comera_compile.tt.planner.contraction_path`): the weight is never formed. For
    ``x @ Mᵀ`` the chain is read with each core's row and column modes exchanged, ``equation`` and
    ``path`` being those of that transposed chain. In ``dtype``, autocast off inside."""
    import opt_einsum as oe

    rows, cols = spec.rows, spec.cols
    row_modes = spec.row_modes
    with _no_autocast(x):
        # gates folded into their left cores (in the cores' dtype), then [r, m, n, r] in the compute dtype
        chain = _stacked_chain([core_flat], [gate_flat], spec.chain_modes, spec.ranks, dtype)
        folded = [c[0].reshape(shape) for c, shape in zip(chain, spec.core_shapes)]
        if not x_times_m:
            folded = [c.permute(0, 2, 1, 3) for c in folded]
            rows, cols, row_modes = cols, rows, spec.col_modes
        folded[0], folded[-1] = folded[0][0], folded[-1][..., 0]  # the boundary ranks (1) squeezed
        lead = x.shape[:-1]
        xt = x.to(dtype).reshape(-1, x.shape[-1])
        padded = math.prod(row_modes)
        if rows < padded:
            xt = torch.nn.functional.pad(xt, (0, padded - rows))
        y = oe.contract(equation, xt.reshape(xt.shape[0], *row_modes), *folded, optimize=[tuple(p) for p in path],
                        backend="torch")
        y = _crop(y.reshape(xt.shape[0], -1), 1, cols).reshape(*lead, cols)
        return y if bias is None else y + bias.to(dtype)


# ------------------------------------------------------------ the merge ops' arguments (kernels/tt_group_merge.py)


def merge_args(spec: TTSpec, plan: Union[Cut, "TTPlan"], output: str, dtype: torch.dtype) -> tuple:
    """What :func:`group_outputs` takes besides the tensors, as the merge ops' arguments: the :class:`TTSpec`'s
    fields (fmt, row_modes, col_modes, ranks, rows, cols, transpose), the cut (its split, and its two merge
    orders as bracket strings, e.g. ``"((0, 1), 2)"``), the output kind and the dtype."""
    return (spec.fmt, [int(m) for m in spec.row_modes], [int(m) for m in spec.col_modes], [int(r) for r in spec.ranks],
            int(spec.rows), int(spec.cols), bool(spec.transpose), int(plan.split), repr(plan.left), repr(plan.right),
            output, dtype)


def read_args(*args) -> tuple[TTSpec, Cut, str, torch.dtype]:
    """:func:`merge_args` read back (once per distinct arguments: the op runs it at every call)."""
    return _read_hashable(hashable_args(args))


@functools.lru_cache(maxsize=1024)
def _read_hashable(args: tuple) -> tuple[TTSpec, Cut, str, torch.dtype]:
    import ast

    fmt, row_modes, col_modes, ranks, rows, cols, transpose, split, left, right, output, dtype = args

    def bracket(b):
        return b if isinstance(b, int) else tuple(bracket(x) for x in b)

    return (TTSpec(fmt, tuple(row_modes), tuple(col_modes), tuple(ranks), rows, cols, transpose),
            Cut(split, bracket(ast.literal_eval(left)), bracket(ast.literal_eval(right))), output, dtype)


def hashable_args(args: tuple) -> tuple:
    """:func:`merge_args` with its lists as tuples (a cache key)."""
    return tuple(tuple(a) if isinstance(a, list) else a for a in args)
