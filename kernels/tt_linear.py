"""`comera::tt_linear`: ``x @ M[:rows, :cols] + bias`` for a tensor-train matrix M, never forming M.

``M`` is stored as TT cores and rank gates in the formats of DESIGN.md (``"tt"`` or ``"ttm"``);
for ``nn.Linear(in, out)`` rows = in, cols = out and the weight is ``M.T``, so the op equals
``F.linear(x, M[:rows, :cols].T, bias)``.

The contraction order comes from ``comera_compile.planner.plan_tt_linear`` (forward and backward
planned together). The op runs the plan:

* gates are absorbed into the core on their left (fp32, token-independent);
* token-independent merges (e.g. CoMERA's L = G1·G2·G3 and R = G4·G5·G6) are small GEMMs (one
  ``torch.mm`` per pairwise step, over strided views);
* token-sized steps: when the plan is the fused (x·L)·R chain (the ``"tt"`` format split at the
  bond between row and column cores, rank ≤ 128) and Triton applies, ``_xlr_fwd_kernel`` computes
  ``Y = (X L) R (+ bias)`` per token block with the ``[BLOCK_M, r]`` intermediate in registers, and
  ``_xlr_bwd_kernel`` computes ``T = X L``, ``U = dY Rᵀ`` and ``dX = U Lᵀ`` in one pass (T and U
  are written, they are rank-sized); ``dL = Xᵀ U`` and ``dR = Tᵀ dY`` are two cuBLAS GEMMs. Inputs
  bf16/fp16/fp32, fp32 accumulation. Other plans run their pairwise steps as torch GEMMs.
* the backward of every token-independent step is the mirrored pair of small GEMMs, then the
  gate gradients. ``use_program(True)`` (or ``COMERA_TT_PROGRAM=1``) runs all token-independent
  steps of a phase as one ``_program_kernel`` launch instead (fewer launches; slower under CUDA
  graphs on the H200, see ``use_program``).

Triton is used for CUDA tensors, or under ``TRITON_INTERPRET=1`` when ``COMERA_FORCE_TRITON=1``
(or inside ``use_impl("triton")``); otherwise the torch path (any float dtype, float64 included).
Nothing in the op reads device values on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from typing import Optional, Sequence

import torch

from comera_compile.planner import _ORDER as _SYMBOL_ORDER
from comera_compile.planner import Plan, core_ranks, plan_tt_linear, token_bucket

try:  # Triton is optional on CPU-only installs.
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover
    _HAS_TRITON = False

__all__ = ["tt_linear", "use_impl", "use_program", "plan_for"]

_IMPLS = ("auto", "triton", "torch")
_IMPL = ["auto"]


@contextlib.contextmanager
def use_impl(impl: str):
    """Select the implementation of the TT ops inside the block: "auto", "triton" or "torch"."""
    if impl not in _IMPLS:
        raise ValueError(f"TT op impl must be one of {_IMPLS}, got {impl!r}")
    old = _IMPL[0]
    _IMPL[0] = impl
    try:
        yield
    finally:
        _IMPL[0] = old


def _use_triton(t: torch.Tensor) -> bool:
    """Triton for CUDA tensors; under the interpreter only when asked (COMERA_FORCE_TRITON=1)."""
    impl = _IMPL[0]
    if impl == "torch" or not _HAS_TRITON or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "triton":
        return t.is_cuda or interpret
    return t.is_cuda or (interpret and os.environ.get("COMERA_FORCE_TRITON") == "1")


# ----------------------------------------------------------------------------- shared helpers


def merge_dtype(cores: Sequence[torch.Tensor]) -> torch.dtype:
    """Token-independent steps run in fp32 (float64 for float64 cores)."""
    return torch.promote_types(cores[0].dtype, torch.float32)


def gated_core_views(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], dtype: torch.dtype,
                     return_converted: bool = False):
    """Cores with each gate absorbed into the core on its left and the boundary ranks squeezed
    (and, with ``return_converted``, the cores and gates in ``dtype``, for ``gated_core_grads``).

    Cores and gates of another dtype are converted together (one concatenation, one cast) rather
    than one launch per tensor."""
    d = len(cores)
    if any(t.dtype != dtype for t in list(cores) + list(gates)):
        flat = torch.cat([t.reshape(-1) for t in list(cores) + list(gates)]).to(dtype)
        parts = torch.split(flat, [t.numel() for t in list(cores) + list(gates)])
        cores = [p.view(c.shape) for p, c in zip(parts[:d], cores)]
        gates = list(parts[d:])
    out = []
    for k, core in enumerate(cores):
        c = core * gates[k] if k < d - 1 else core
        out.append(c.reshape(c.shape[1:] if k == 0 else c.shape[:-1] if k == d - 1 else c.shape))
    return (out, (list(cores), list(gates))) if return_converted else out


def gated_core_grads(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], dviews: Sequence[torch.Tensor],
                     converted=None):
    """Gradients of the cores and gates from the gradients of ``gated_core_views`` (the views may
    be permuted: each result is written once, contiguous, in the parameter's dtype).
    ``converted``: the (cores, gates) in the views' dtype from ``gated_core_views``."""
    d = len(cores)
    ccores, cgates = converted if converted is not None else (cores, gates)
    dcores, dgates = [], []
    for k, (core, dv) in enumerate(zip(cores, dviews)):
        if k == 0:
            dv = dv.unsqueeze(0)
        if k == d - 1:
            dv = dv.unsqueeze(-1)
        out = torch.empty(core.shape, device=core.device, dtype=core.dtype)
        if k < d - 1:
            c, g = ccores[k], cgates[k]
            c = c if c.dtype == dv.dtype else c.to(dv.dtype)
            g = g if g.dtype == dv.dtype else g.to(dv.dtype)
            dgates.append((dv * c).sum(dim=tuple(range(dv.dim() - 1))).to(gates[k].dtype))
            torch.mul(dv, g, out=out)
        else:
            out.copy_(dv)
        dcores.append(out)
    return dcores, dgates


def _check_meta(name, cores, gates, fmt, row_modes, col_modes, rows, cols):
    d = len(cores)
    if fmt not in ("tt", "ttm"):
        raise ValueError(f"{name}: fmt must be 'tt' or 'ttm', got {fmt!r}")
    want_d = len(row_modes) + len(col_modes) if fmt == "tt" else len(row_modes)
    if d != want_d:
        raise ValueError(f"{name}: {fmt!r} with row_modes {list(row_modes)} and col_modes {list(col_modes)} "
                         f"needs {want_d} cores, got {d}")
    if len(gates) != d - 1:
        raise ValueError(f"{name}: needs {d - 1} gates (one per internal bond), got {len(gates)}")
    if rows > math.prod(row_modes) or cols > math.prod(col_modes):
        raise ValueError(f"{name}: rows={rows}, cols={cols} exceed the padded shape "
                         f"{math.prod(row_modes)}x{math.prod(col_modes)}")


def plan_for(x_tokens: int, cores: Sequence[torch.Tensor], fmt: str, row_modes, col_modes, dtype_bytes: int,
             fused: bool) -> Plan:
    """The cached plan the op uses (token counts are bucketed to powers of two)."""
    ranks = core_ranks(fmt, [c.shape for c in cores])
    return plan_tt_linear(fmt, row_modes, col_modes, ranks, token_bucket(x_tokens), dtype_bytes, fused=fused)


# ----------------------------------------------------------------------------- Triton kernels

if _HAS_TRITON:

    @triton.jit
    def _xlr_fwd_kernel(X, L, R, B, Y, N, I, O, RANK,
                        sxn, sxi, sli, slr, sro, srr, syn, syo,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, O_PER_PROG: tl.constexpr,
                        PRECISION: tl.constexpr):
        """Y[m, o] = sum_r (sum_i X[m, i] L[i, r]) R[o, r] (+ B[o]); the [BLOCK_M, r] tile stays on chip."""
        pid_m = tl.program_id(0)
        pid_o = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.arange(0, BLOCK_R)
        m_ok = rm < N
        r_ok = rr < RANK
        t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < I
            xb = tl.load(X + rm[:, None] * sxn + rk[None, :] * sxi, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            lb = tl.load(L + rk[:, None] * sli + rr[None, :] * slr, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            t += tl.dot(xb, lb.to(X.dtype.element_ty), input_precision=PRECISION)
        tc = t.to(X.dtype.element_ty)
        o_start = pid_o * O_PER_PROG
        for n0 in range(0, O_PER_PROG, BLOCK_N):
            rn = o_start + n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < O
            rb = tl.load(R + rn[None, :] * sro + rr[:, None] * srr, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            y = tl.dot(tc, rb.to(X.dtype.element_ty), input_precision=PRECISION)
            if HAS_BIAS:
                y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rm[:, None] * syn + rn[None, :] * syo, y.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _xlr_bwd_kernel(X, DY, L, R, DX, T, U, N, I, O, RANK,
                        sxn, sxi, sdn, sdo, sli, slr, sro, srr, sdxn, sdxi, stn, str_,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, I_PER_PROG: tl.constexpr, PRECISION: tl.constexpr):
        """T = X L, U = dY R, dX = U Lᵀ for one token block (program column 0 also writes T and U)."""
        pid_m = tl.program_id(0)
        pid_i = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.arange(0, BLOCK_R)
        m_ok = rm < N
        r_ok = rr < RANK
        u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for n0 in range(0, O, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < O
            db = tl.load(DY + rm[:, None] * sdn + rn[None, :] * sdo, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            rb = tl.load(R + rn[:, None] * sro + rr[None, :] * srr, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            u += tl.dot(db, rb.to(DY.dtype.element_ty), input_precision=PRECISION)
        uc = u.to(X.dtype.element_ty)
        if pid_i == 0:
            t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < I
                xb = tl.load(X + rm[:, None] * sxn + rk[None, :] * sxi, mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)
                lb = tl.load(L + rk[:, None] * sli + rr[None, :] * slr, mask=k_ok[:, None] & r_ok[None, :],
                             other=0.0)
                t += tl.dot(xb, lb.to(X.dtype.element_ty), input_precision=PRECISION)
            tu_mask = m_ok[:, None] & r_ok[None, :]
            tl.store(T + rm[:, None] * stn + rr[None, :] * str_, t.to(T.dtype.element_ty), mask=tu_mask)
            tl.store(U + rm[:, None] * stn + rr[None, :] * str_, uc, mask=tu_mask)
        i_start = pid_i * I_PER_PROG
        for k0 in range(0, I_PER_PROG, BLOCK_K):
            rk = i_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < I
            lt = tl.load(L + rk[None, :] * sli + rr[:, None] * slr, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            dx = tl.dot(uc, lt.to(X.dtype.element_ty), input_precision=PRECISION)
            tl.store(DX + rm[:, None] * sdxn + rk[None, :] * sdxi, dx.to(DX.dtype.element_ty),
                     mask=m_ok[:, None] & k_ok[None, :])

    @triton.jit
    def _program_kernel(S, P, NSTEPS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        PRECISION: tl.constexpr):
        """Runs a list of small steps over one fp32 scratch buffer ``S``; program ``lane`` runs the
        steps of its lane (the two halves of a split are independent). A step row of ``P`` is
        [type, lane, M, N, K, a_off, a_s0, a_s1, b_off, b_s0, b_s1, c_off, c_s0, c_s1, 0, 0]:
        0 MM C[M,N] = A[M,K] @ B[K,N]; 1 SCALE C = A * B[None, :]; 2 COLDOT C[n] = sum_m A*B;
        3 COPY C = A. A barrier separates the steps (later steps read what earlier ones wrote)."""
        lane = tl.program_id(0)
        am = tl.arange(0, BM)
        an = tl.arange(0, BN)
        ak = tl.arange(0, BK)
        for s in range(0, NSTEPS):
            row = P + s * 16
            typ = tl.load(row)
            ln = tl.load(row + 1)
            M = tl.load(row + 2)
            N = tl.load(row + 3)
            K = tl.load(row + 4)
            a_off = tl.load(row + 5)
            a_s0 = tl.load(row + 6)
            a_s1 = tl.load(row + 7)
            b_off = tl.load(row + 8)
            b_s0 = tl.load(row + 9)
            b_s1 = tl.load(row + 10)
            c_off = tl.load(row + 11)
            c_s0 = tl.load(row + 12)
            c_s1 = tl.load(row + 13)
            if ln == lane:
                if typ == 0:
                    for m0 in range(0, M, BM):
                        rm = m0 + am
                        for n0 in range(0, N, BN):
                            rn = n0 + an
                            acc = tl.zeros((BM, BN), dtype=tl.float32)
                            for k0 in range(0, K, BK):
                                rk = k0 + ak
                                a = tl.load(S + a_off + rm[:, None] * a_s0 + rk[None, :] * a_s1,
                                            mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
                                b = tl.load(S + b_off + rk[:, None] * b_s0 + rn[None, :] * b_s1,
                                            mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
                                acc += tl.dot(a, b, input_precision=PRECISION)
                            tl.store(S + c_off + rm[:, None] * c_s0 + rn[None, :] * c_s1, acc,
                                     mask=(rm[:, None] < M) & (rn[None, :] < N))
                elif typ == 2:
                    for n0 in range(0, N, BN):
                        rn = n0 + an
                        acc1 = tl.zeros((BN,), dtype=tl.float32)
                        for m0 in range(0, M, BM):
                            rm = m0 + am
                            msk = (rm[:, None] < M) & (rn[None, :] < N)
                            a = tl.load(S + a_off + rm[:, None] * a_s0 + rn[None, :] * a_s1, mask=msk, other=0.0)
                            b = tl.load(S + b_off + rm[:, None] * b_s0 + rn[None, :] * b_s1, mask=msk, other=0.0)
                            acc1 += tl.sum(a * b, axis=0)
                        tl.store(S + c_off + rn * c_s1, acc1, mask=rn < N)
                else:
                    for m0 in range(0, M, BM):
                        rm = m0 + am
                        for n0 in range(0, N, BN):
                            rn = n0 + an
                            msk = (rm[:, None] < M) & (rn[None, :] < N)
                            a = tl.load(S + a_off + rm[:, None] * a_s0 + rn[None, :] * a_s1, mask=msk, other=0.0)
                            if typ == 1:
                                a = a * tl.load(S + b_off + rn * b_s1, mask=rn < N, other=0.0)[None, :]
                            tl.store(S + c_off + rm[:, None] * c_s0 + rn[None, :] * c_s1, a, mask=msk)
            tl.debug_barrier()


def _blocks(n: int, width: int, rank: int, block_n: int) -> tuple[int, int, int]:
    """(BLOCK_M, splits of the wide dimension, columns per program): enough programs to fill ~2
    waves of an H200's 132 SMs; each extra split re-reads its token block (from L2)."""
    block_m = 64 if n >= 64 * 264 else 32 if n >= 32 * 132 else 16
    m_progs = triton.cdiv(n, block_m)
    chunks = triton.cdiv(width, block_n)
    splits = max(1, min(chunks, triton.cdiv(264, m_progs)))
    per = triton.cdiv(chunks, splits) * block_n
    return block_m, triton.cdiv(width, per), per


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def xlr_forward(x2: torch.Tensor, L: torch.Tensor, R: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``(x2 @ L) @ R.T + bias`` with x2 [N, I], L [I, r], R [O, r] in one Triton launch."""
    n, i = x2.shape
    o, r = R.shape
    y = torch.empty((n, o), device=x2.device, dtype=x2.dtype)
    if n == 0:
        return y
    block_r = max(16, triton.next_power_of_2(r))
    block_k, block_n = 64, 64
    block_m, splits, per = _blocks(n, o, r, block_n)
    grid = (triton.cdiv(n, block_m), splits)
    _xlr_fwd_kernel[grid](x2, L, R, bias if bias is not None else y, y, n, i, o, r,
                          x2.stride(0), x2.stride(1), L.stride(0), L.stride(1), R.stride(0), R.stride(1),
                          y.stride(0), y.stride(1), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_K=block_k,
                          BLOCK_N=block_n, BLOCK_R=block_r, O_PER_PROG=per, PRECISION=_precision(x2.dtype),
                          num_warps=4, num_stages=3)
    return y


def xlr_backward(x2: torch.Tensor, dy: torch.Tensor, L: torch.Tensor, R: torch.Tensor):
    """``T = x2 L``, ``U = dy R``, ``dx = U Lᵀ`` (one Triton launch); returns (dx, T, U)."""
    n, i = x2.shape
    o, r = R.shape
    dx = torch.empty_like(x2)
    t = torch.empty((n, r), device=x2.device, dtype=x2.dtype)
    u = torch.empty((n, r), device=x2.device, dtype=x2.dtype)
    if n == 0:
        return dx, t, u
    block_r = max(16, triton.next_power_of_2(r))
    block_k, block_n = 64, 64
    block_m, splits, per = _blocks(n, i, r, block_k)
    grid = (triton.cdiv(n, block_m), splits)
    _xlr_bwd_kernel[grid](x2, dy, L, R, dx, t, u, n, i, o, r,
                          x2.stride(0), x2.stride(1), dy.stride(0), dy.stride(1), L.stride(0), L.stride(1),
                          R.stride(0), R.stride(1), dx.stride(0), dx.stride(1), t.stride(0), t.stride(1),
                          BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_R=block_r, I_PER_PROG=per,
                          PRECISION=_precision(x2.dtype), num_warps=4, num_stages=3)
    return dx, t, u


# ----------------------------------------------------------------------------- plan execution


@functools.lru_cache(maxsize=4096)
def _pair_program(eq: str):
    """How to run a pairwise contraction ``"ab,bc->ac"`` as one matrix product.

    In a TT chain every index belongs to exactly two tensors, so a pairwise step has no batch
    indices: A as [free_a, shared], B as [shared, free_b], one GEMM, and a permuted view of the
    result. Returns (a_free, shared, b_free, output permutation of a_free + b_free)."""
    ins, out = eq.split("->")
    ia, ib = ins.split(",")
    shared = "".join(s for s in ia if s in ib)
    assert not any(s in out for s in shared), f"batch index in {eq}"
    fa = "".join(s for s in ia if s not in shared)
    fb = "".join(s for s in ib if s not in shared)
    free = fa + fb
    return ia, ib, fa, shared, fb, tuple(free.index(s) for s in out)


def _as_matrix(t: torch.Tensor, idx: str, first: str, second: str) -> torch.Tensor:
    """``t`` (dims named by ``idx``) as a [prod(first), prod(second)] matrix: a view (possibly
    transposed, which cuBLAS takes as is) whenever the strides allow, else a copy."""
    size = dict(zip(idx, t.shape))
    m = math.prod(size[s] for s in first)
    n = math.prod(size[s] for s in second)
    try:
        return t.permute([idx.index(s) for s in first + second]).view(m, n)
    except RuntimeError:
        pass
    try:
        return t.permute([idx.index(s) for s in second + first]).view(n, m).t()
    except RuntimeError:
        return t.permute([idx.index(s) for s in first + second]).reshape(m, n)


def _einsum(eq: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a = a if a.dtype == dtype else a.to(dtype)
    b = b if b.dtype == dtype else b.to(dtype)
    ia, ib, fa, shared, fb, perm = _pair_program(eq)
    out = torch.mm(_as_matrix(a, ia, fa, shared), _as_matrix(b, ib, shared, fb))
    sizes = [a.shape[ia.index(s)] for s in fa] + [b.shape[ib.index(s)] for s in fb]
    return out.view(sizes).permute(perm)


def _leaf_views(plan: Plan, x2: torch.Tensor, views: Sequence[torch.Tensor], row_modes, rows: int) -> dict:
    env = {f"G{k + 1}": v for k, v in enumerate(views)}
    i_pad = math.prod(row_modes)
    if rows < i_pad:
        x2 = torch.nn.functional.pad(x2, (0, i_pad - rows))
    env["x"] = x2.reshape(x2.shape[0], *row_modes)
    return env


def _run(plan: Plan, env: dict, phases: tuple, tdtype: torch.dtype, mdtype: torch.dtype) -> dict:
    for s in plan.steps:
        if s.phase in phases:
            env[s.out] = _einsum(s.equation, env[s.inputs[0]], env[s.inputs[1]], tdtype if s.token_sized else mdtype)
    return env


def canonical(plan, name: str, t: torch.Tensor) -> torch.Tensor:
    """A merged tensor's dims are in canonical order (rows, cols, ranks); a single core's are not
    (its left rank comes first): permute a leaf to canonical order."""
    idx = dict(plan.leaf_indices).get(name)
    if idx is None:
        return t
    order = sorted(range(len(idx)), key=lambda i: _SYMBOL_ORDER[idx[i]])
    return t.permute(order)


def _uncanonical(plan, name: str, t: torch.Tensor) -> torch.Tensor:
    idx = dict(plan.leaf_indices).get(name)
    if idx is None:
        return t
    order = sorted(range(len(idx)), key=lambda i: _SYMBOL_ORDER[idx[i]])
    inverse = [order.index(i) for i in range(len(order))]
    return t.permute(inverse)


def _fused_halves(plan: Plan, env: dict, rows: int, cols: int, tdtype: torch.dtype):
    """L [rows, r] and R [cols, r] (both views of the merged halves) of a fused xlr plan."""
    step = plan.steps_in("forward")[0]
    _, a_name, b_name = step.inputs
    A, B = canonical(plan, a_name, env[a_name]), canonical(plan, b_name, env[b_name])
    r = A.shape[-1]
    # the fused kernels take L and R in the activation dtype: fp32 tiles cost the 32768-token
    # layers 2-3x (measured on the H200, results_tt.md run C)
    L = A.reshape(-1, r)[:rows].to(tdtype)
    R = B.reshape(-1, r)[:cols].to(tdtype)
    return a_name, b_name, A, B, L, R


# ----------------------------------------------------------------------------- token-independent program
#
# Gating, merging the two halves of a split and the backward of both (core and gate gradients) are
# tiny, but as torch ops they are ~60 launches per training step, which dominates a layer at a few
# thousand tokens even inside a CUDA graph. ``_program_kernel`` runs them all from one launch per
# phase, over one fp32 scratch buffer, with the step list built here once per plan.

_MM, _SCALE, _COLDOT, _COPY = 0, 1, 2, 3


class _Program:
    """Step rows and scratch layout of the token-independent work of one split plan."""

    def __init__(self):
        self.total = 0
        self.layout: dict[str, tuple[int, str]] = {}  # tensor -> (offset, index order in memory)
        self.lane: dict[str, int] = {}
        self.fwd: list[list[int]] = []
        self.bwd: list[list[int]] = []
        self.rows: dict = {}

    def alloc(self, n: int, packed: bool = False) -> int:
        off = self.total
        self.total += n if packed else (n + 3) // 4 * 4
        return off

    def device_rows(self, device):
        hit = self.rows.get(device)
        if hit is None:
            hit = self.rows[device] = tuple(
                torch.tensor(r or [[0] * 16], dtype=torch.int32, device=device).reshape(-1, 16) for r in
                (self.fwd, self.bwd))
        return hit


def _row(typ, lane, m, n, k, a=(0, 0, 0), b=(0, 0, 0), c=(0, 0, 0)):
    return [typ, lane, m, n, k, *a, *b, *c, 0, 0]


def _matrix_strides(layout: str, first: str, second: str, size: dict):
    """Strides (s_first, s_second) of a contiguous tensor with dims ``layout`` seen as the matrix
    [prod(first), prod(second)], or None when the two groups are not contiguous blocks."""
    nf = math.prod(size[c] for c in first)
    ns = math.prod(size[c] for c in second)
    if layout == first + second:
        return ns, 1
    if layout == second + first:
        return 1, nf
    return None


def _split_orders(la: str, lb: str, out: str):
    shared = [c for c in la if c in lb]
    fa = "".join(c for c in la if c not in shared)
    fb = "".join(c for c in lb if c not in shared)
    return fa, "".join(shared), fb


def _mode_inversions(layout: str) -> int:
    """How far the mode indices of ``layout`` are from canonical order (a merged half is consumed as
    [modes in canonical order, rank])."""
    modes = [_SYMBOL_ORDER[c] for c in layout if not c.isupper()]
    return sum(1 for i in range(len(modes)) for j in range(i + 1, len(modes)) if modes[i] > modes[j])


def _mm_row(prog, size, a, b, out_name, lane, dest=None, dest_layout=None, flip=False):
    (oa, la), (ob, lb) = prog.layout[a], prog.layout[b]
    fa, sh, fb = _split_orders(la, lb, "")
    sa = _matrix_strides(la, fa, sh, size)
    sb = _matrix_strides(lb, sh, fb, size)
    if sa is None or sb is None:  # try the shared indices in b's order
        sh = "".join(c for c in lb if c in la)
        sa = _matrix_strides(la, fa, sh, size)
        sb = _matrix_strides(lb, sh, fb, size)
    if sa is None or sb is None:
        return None
    m = math.prod(size[c] for c in fa)
    n = math.prod(size[c] for c in fb)
    k = math.prod(size[c] for c in sh)
    if dest_layout is None:
        options = sorted((fa + fb, fb + fa), key=_mode_inversions)
        layout = options[1] if flip else options[0]
    else:
        layout = dest_layout
    sc = _matrix_strides(layout, fa, fb, size)
    if sc is None:
        return None
    off = prog.alloc(m * n) if dest is None else dest
    prog.layout[out_name] = (off, layout)
    prog.lane[out_name] = lane
    return _row(_MM, lane, m, n, k, (oa, *sa), (ob, *sb), (off, *sc))


@functools.lru_cache(maxsize=256)
def _build_program(plan: Plan, core_shapes: tuple, a_name: str, b_name: str):
    """The program of a split plan whose halves are A = cores[:split], B = cores[split:]; None when
    no choice of intermediate layouts fits the 2-D strided steps (the torch path runs then).
    Each intermediate is stored as [free of A, free of B] or the transpose: try the choices (mode
    indices closest to canonical order first) until every step, leaf gradients included, fits."""
    k = len(plan.steps_in("merge")) + sum(1 for st in plan.steps_in("merge_backward")
                                          if st.out[1:] not in dict(plan.leaf_indices))
    for flips in itertools.islice(itertools.product((False, True), repeat=k), 4096):
        prog = _try_program(plan, core_shapes, a_name, b_name, iter(flips))
        if prog is not None:
            return prog
    return None


def _try_program(plan: Plan, core_shapes: tuple, a_name: str, b_name: str, flips):
    size = {k.split(":")[1]: v for k, v in plan.sizes}
    leaf = dict(plan.leaf_indices)
    d = len(core_shapes)
    split = plan.split
    prog = _Program()
    # the inputs are packed exactly as torch.cat(cores + gates) lays them out
    in_off = [prog.alloc(math.prod(sh), packed=True) for sh in core_shapes]
    gate_off = [prog.alloc(core_shapes[k][-1], packed=True) for k in range(d - 1)]
    prog.n_in = prog.total
    # gating: G'_k = G_k * g_k (the last core has no gate)
    for k in range(d):
        name, lane = f"G{k + 1}", 0 if k < split else 1
        prog.lane[name] = lane
        if k < d - 1:
            r = core_shapes[k][-1]
            m = math.prod(core_shapes[k]) // r
            off = prog.alloc(m * r)
            prog.fwd.append(_row(_SCALE, lane, m, r, 0, (in_off[k], r, 1), (gate_off[k], 0, 1), (off, r, 1)))
            prog.layout[name] = (off, leaf[name])
        else:
            prog.layout[name] = (in_off[k], leaf[name])
    for st in plan.steps_in("merge"):
        a, b = st.inputs
        r = _mm_row(prog, size, a, b, st.out, prog.lane[a], flip=next(flips))
        if r is None:
            return None
        prog.fwd.append(r)
    # backward: external gradients of A and B land in regions with A's and B's layouts
    for nm in (a_name, b_name):
        off, lay = prog.layout[nm]
        prog.layout["d" + nm] = (prog.alloc(math.prod(size[c] for c in lay)), lay)
        prog.lane["d" + nm] = prog.lane[nm]
    prog.alloc(0)
    grad_base = prog.alloc(prog.n_in)
    prog.grad_base = grad_base
    dleaf_off = {}
    for st in plan.steps_in("merge_backward"):
        dp, q = st.inputs
        tgt = st.out[1:]
        lane = prog.lane[dp]
        if tgt in leaf:
            k = int(tgt[1:]) - 1
            dest = grad_base + in_off[k] if k == d - 1 else None
            r = _mm_row(prog, size, dp, q, st.out, lane, dest=dest, dest_layout=leaf[tgt])
        else:
            r = _mm_row(prog, size, dp, q, st.out, lane, flip=next(flips))
        if r is None:
            return None
        prog.bwd.append(r)
    for k in range(d):
        name, lane = f"dG{k + 1}", 0 if k < split else 1
        off, lay = prog.layout[name]
        if lay != leaf[name[1:]]:
            return None
        numel = math.prod(core_shapes[k])
        r = core_shapes[k][-1]
        if k < d - 1:
            prog.bwd.append(_row(_SCALE, lane, numel // r, r, 0, (off, r, 1), (gate_off[k], 0, 1),
                                 (grad_base + in_off[k], r, 1)))
            prog.bwd.append(_row(_COLDOT, lane, numel // r, r, 0, (off, r, 1), (in_off[k], r, 1),
                                 (grad_base + gate_off[k], 0, 1)))
        elif off != grad_base + in_off[k]:
            prog.bwd.append(_row(_COPY, lane, numel // r, r, 0, (off, r, 1), c=(grad_base + in_off[k], r, 1)))
    prog.in_off, prog.gate_off = in_off, gate_off
    return prog


_PROGRAM = [os.environ.get("COMERA_TT_PROGRAM") == "1"]


@contextlib.contextmanager
def use_program(enabled: bool):
    """Run the token-independent work as ``_program_kernel`` launches (off by default).

    Measured on the H200 (benchmarks/results_tt.md): one launch per phase instead of ~60 cuts the
    eager time, but the single-CTA step interpreter is latency-bound (tiles run one after another,
    each waiting on its global loads), so under CUDA graphs it is 2-5x slower than the torch ops."""
    old = _PROGRAM[0]
    _PROGRAM[0] = bool(enabled)
    try:
        yield
    finally:
        _PROGRAM[0] = old


def _program_for(plan: Plan, cores, a_name: str, b_name: str):
    if not _PROGRAM[0] or not _HAS_TRITON or plan.split is None:
        return None
    prog = _build_program(plan, tuple(tuple(c.shape) for c in cores), a_name, b_name)
    if prog is not None and cores[0].is_cuda and cores[0].device not in prog.rows \
            and torch.cuda.is_current_stream_capturing():
        return None  # the step rows are uploaded on the first call, which must not be a capture
    return prog


def _run_program(prog: _Program, S: torch.Tensor, phase: str, precision: str):
    rows = prog.device_rows(S.device)[0 if phase == "fwd" else 1]
    n = len(prog.fwd if phase == "fwd" else prog.bwd)
    if n:
        _program_kernel[(2,)](S, rows, n, BM=32, BN=32, BK=32, PRECISION=precision, num_warps=4)


def _program_inputs(prog: _Program, cores, gates) -> torch.Tensor:
    S = torch.empty(prog.total, device=cores[0].device, dtype=torch.float32)
    S[:prog.n_in].copy_(torch.cat([c.reshape(-1) for c in cores] + [g.reshape(-1) for g in gates]))
    return S


def _program_matrix(prog: _Program, plan: Plan, S: torch.Tensor, name: str, n_keep: int) -> torch.Tensor:
    """The merged half ``name`` as a [rows or cols, r] strided view of the scratch (cut to n_keep)."""
    size = {k.split(":")[1]: v for k, v in plan.sizes}
    off, lay = prog.layout[name]
    rank = [c for c in lay if c.isupper()]
    modes = "".join(sorted((c for c in lay if not c.isupper()), key=_SYMBOL_ORDER.__getitem__))
    st = _matrix_strides(lay, modes, "".join(rank), size)
    if len(rank) != 1 or st is None:
        return None
    m = math.prod(size[c] for c in modes)
    return S.as_strided((m, size[rank[0]]), st, off)[:n_keep]


def _forward_impl(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, rows)
    n = x2.shape[0]
    triton_ok = _use_triton(x)
    plan = plan_for(n, cores, fmt, row_modes, col_modes, x.element_size(), fused=triton_ok)
    tdtype, mdtype = x.dtype, merge_dtype(cores)
    if plan.fused == "xlr" and triton_ok:
        b = bias.to(tdtype) if bias is not None else None
        _, a_name, b_name = plan.steps_in("forward")[0].inputs
        prog = _program_for(plan, cores, a_name, b_name)
        if prog is not None:
            S = _program_inputs(prog, cores, gates)
            _run_program(prog, S, "fwd", _precision(tdtype))
            L = _program_matrix(prog, plan, S, a_name, rows)
            R = _program_matrix(prog, plan, S, b_name, cols)
            if L is not None and R is not None:
                return xlr_forward(x2.contiguous(), L, R, b).reshape(*lead, cols)
        env = {f"G{k + 1}": v for k, v in enumerate(gated_core_views(cores, gates, mdtype))}
        _run(plan, env, ("merge",), tdtype, mdtype)
        *_, L, R = _fused_halves(plan, env, rows, cols, tdtype)
        y = xlr_forward(x2.contiguous(), L, R, b)
        return y.reshape(*lead, cols)
    env = _leaf_views(plan, x2, gated_core_views(cores, gates, mdtype), row_modes, rows)
    _run(plan, env, ("merge", "forward"), tdtype, mdtype)
    y = env["y"].reshape(n, math.prod(col_modes))[:, :cols]
    if bias is not None:
        y = y + bias.to(tdtype)
    return y.reshape(*lead, cols).contiguous()


def _backward_impl(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols):
    x2 = x.reshape(-1, rows)
    n = x2.shape[0]
    dy = grad.reshape(-1, cols).to(x.dtype)
    triton_ok = _use_triton(x)
    plan = plan_for(n, cores, fmt, row_modes, col_modes, x.element_size(), fused=triton_ok)
    tdtype, mdtype = x.dtype, merge_dtype(cores)
    if plan.fused == "xlr" and triton_ok:
        _, a_name, b_name = plan.steps_in("forward")[0].inputs
        prog = _program_for(plan, cores, a_name, b_name)
        if prog is not None:
            S = _program_inputs(prog, cores, gates)
            _run_program(prog, S, "fwd", _precision(tdtype))
            L = _program_matrix(prog, plan, S, a_name, rows)
            R = _program_matrix(prog, plan, S, b_name, cols)
            dL = _program_matrix(prog, plan, S, "d" + a_name, 1 << 62)
            dR = _program_matrix(prog, plan, S, "d" + b_name, 1 << 62)
            if L is not None and R is not None:
                dx2, t, u = xlr_backward(x2.contiguous(), dy.contiguous(), L, R)
                dL[:rows].copy_(torch.matmul(x2.t(), u))
                dR[:cols].copy_(torch.matmul(dy.t(), t))
                if rows < dL.shape[0]:
                    dL[rows:].zero_()
                if cols < dR.shape[0]:
                    dR[cols:].zero_()
                _run_program(prog, S, "bwd", _precision(tdtype))
                flat = S[prog.grad_base:prog.grad_base + prog.n_in].to(cores[0].dtype, copy=True)
                return dx2.reshape(x.shape), flat
        views, converted = gated_core_views(cores, gates, mdtype, return_converted=True)
        env = {f"G{k + 1}": v for k, v in enumerate(views)}
        _run(plan, env, ("merge",), tdtype, mdtype)
        a_name, b_name, A, B, L, R = _fused_halves(plan, env, rows, cols, tdtype)
        dx2, t, u = xlr_backward(x2.contiguous(), dy.contiguous(), L, R)
        r = A.shape[-1]
        dA = torch.matmul(x2.t(), u).to(mdtype)
        dB = torch.matmul(dy.t(), t).to(mdtype)
        if dA.shape[0] * r != A.numel():  # padded rows / columns get zero gradient
            dA = torch.nn.functional.pad(dA, (0, 0, 0, A.numel() // r - dA.shape[0]))
        if dB.shape[0] * r != B.numel():
            dB = torch.nn.functional.pad(dB, (0, 0, 0, B.numel() // r - dB.shape[0]))
        env["d" + a_name] = _uncanonical(plan, a_name, dA.reshape(A.shape))
        env["d" + b_name] = _uncanonical(plan, b_name, dB.reshape(B.shape))
        _run(plan, env, ("merge_backward",), tdtype, mdtype)
        dx = dx2
    else:
        views, converted = gated_core_views(cores, gates, mdtype, return_converted=True)
        env = _leaf_views(plan, x2, views, row_modes, rows)
        _run(plan, env, ("recompute",), tdtype, mdtype)
        dy_pad = dy
        o_pad = math.prod(col_modes)
        if cols < o_pad:
            dy_pad = torch.nn.functional.pad(dy, (0, o_pad - cols))
        env["dy"] = dy_pad.reshape(n, *col_modes)
        _run(plan, env, ("backward", "merge_backward"), tdtype, mdtype)
        dx = env["dx"].reshape(n, math.prod(row_modes))[:, :rows]
    dviews = [env[f"dG{k + 1}"] for k in range(len(cores))]
    dcores, dgates = gated_core_grads(cores, gates, dviews, converted)
    flat = torch.cat([t.reshape(-1).to(cores[0].dtype) for t in dcores + dgates])
    return dx.reshape(x.shape).to(x.dtype).contiguous(), flat


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("comera::tt_linear", mutates_args=())
def _tt_linear_op(x: torch.Tensor, cores: list[torch.Tensor], gates: list[torch.Tensor], bias: Optional[torch.Tensor],
                  fmt: str, row_modes: list[int], col_modes: list[int], rows: int, cols: int) -> torch.Tensor:
    _check_meta("comera::tt_linear", cores, gates, fmt, row_modes, col_modes, rows, cols)
    return _forward_impl(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols)


@_tt_linear_op.register_fake
def _(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols):
    return x.new_empty((*x.shape[:-1], cols))


@torch.library.custom_op("comera::tt_linear_backward", mutates_args=())
def _tt_linear_backward_op(grad: torch.Tensor, x: torch.Tensor, cores: list[torch.Tensor],
                           gates: list[torch.Tensor], fmt: str, row_modes: list[int], col_modes: list[int],
                           rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, every core and gate gradient packed flat like ``torch.cat(cores + gates)``, cores' dtype)."""
    dx, flat = _backward_impl(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols)
    return dx, flat


@_tt_linear_backward_op.register_fake
def _(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols):
    n = sum(c.numel() for c in cores) + sum(g.numel() for g in gates)
    return torch.empty_like(x), cores[0].new_empty((n,))


def unpack_grads(flat: torch.Tensor, cores, gates):
    """Views of the packed core and gate gradients, shaped (and typed) like the parameters."""
    out, off = [], 0
    for t in list(cores) + list(gates):
        g = flat[off:off + t.numel()].view(t.shape)
        out.append(g if g.dtype == t.dtype else g.to(t.dtype))
        off += t.numel()
    return out[:len(cores)], out[len(cores):]


def _setup_context(ctx, inputs, output):
    x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols = inputs
    ctx.save_for_backward(x, *cores, *gates)
    ctx.meta = (len(cores), fmt, list(row_modes), list(col_modes), rows, cols,
                None if bias is None else bias.dtype)


def _backward(ctx, grad):
    d, fmt, row_modes, col_modes, rows, cols, bias_dtype = ctx.meta
    saved = ctx.saved_tensors
    x, cores, gates = saved[0], list(saved[1:1 + d]), list(saved[1 + d:])
    dx, flat = _tt_linear_backward_op(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols)
    dcores, dgates = unpack_grads(flat, cores, gates)
    dbias = None if bias_dtype is None else grad.reshape(-1, cols).sum(0).to(bias_dtype)
    return dx, dcores, dgates, dbias, None, None, None, None, None


_tt_linear_op.register_autograd(_backward, setup_context=_setup_context)


def tt_linear(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], fmt: str, row_modes: Sequence[int], col_modes: Sequence[int],
              rows: int, cols: int) -> torch.Tensor:
    """``x @ M[:rows, :cols] + bias`` for the TT matrix given by ``cores``/``gates`` (DESIGN.md)."""
    return torch.ops.comera.tt_linear(x, list(cores), list(gates), bias, fmt, list(row_modes), list(col_modes),
                                      int(rows), int(cols))
