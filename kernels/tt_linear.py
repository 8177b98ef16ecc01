"""`comera::tt_linear`: ``x @ M[:rows, :cols] + bias`` for a tensor-train matrix M, never forming M.

``M`` is stored as TT cores and rank gates in the formats of DESIGN.md (``"tt"`` or ``"ttm"``);
for ``nn.Linear(in, out)`` rows = in, cols = out and the weight is ``M.T``, so the op equals
``F.linear(x, M[:rows, :cols].T, bias)``.

The contraction order comes from ``comera_compile.planner.plan_tt_linear`` (forward and backward
planned together). The op runs the plan:

* gates are absorbed into the core on their left (fp32, token-independent);
* token-independent merges (e.g. CoMERA's L = G1·G2·G3 and R = G4·G5·G6) are small einsums;
* token-sized steps: when the plan is the fused (x·L)·R chain (the ``"tt"`` format split at the
  bond between row and column cores, rank ≤ 128) and Triton applies, ``_xlr_fwd_kernel`` computes
  ``Y = (X L) R (+ bias)`` per token block with the ``[BLOCK_M, r]`` intermediate in registers, and
  ``_xlr_bwd_kernel`` computes ``T = X L``, ``U = dY Rᵀ`` and ``dX = U Lᵀ`` in one pass (T and U
  are written, they are rank-sized); ``dL = Xᵀ U`` and ``dR = Tᵀ dY`` are two cuBLAS GEMMs. Inputs
  bf16/fp16/fp32, fp32 accumulation. Other plans run their pairwise steps as torch einsums.
* the backward of every token-independent step is the mirrored pair of small einsums, then the
  gate gradients.

Triton is used for CUDA tensors, or under ``TRITON_INTERPRET=1`` when ``COMERA_FORCE_TRITON=1``
(or inside ``use_impl("triton")``); otherwise the torch path (any float dtype, float64 included).
Nothing in the op reads device values on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
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

__all__ = ["tt_linear", "use_impl", "plan_for"]

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


def gated_core_views(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], dtype: torch.dtype):
    """Cores with each gate absorbed into the core on its left and the boundary ranks squeezed."""
    d = len(cores)
    out = []
    for k, core in enumerate(cores):
        c = core if core.dtype == dtype else core.to(dtype)
        if k < d - 1:
            c = c * (gates[k] if gates[k].dtype == dtype else gates[k].to(dtype))
        out.append(c.reshape(c.shape[1:] if k == 0 else c.shape[:-1] if k == d - 1 else c.shape))
    return out


def gated_core_grads(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor], dviews: Sequence[torch.Tensor]):
    """Gradients of the cores and gates from the gradients of ``gated_core_views`` (the views may
    be permuted: each result is written once, contiguous, in the parameter's dtype)."""
    d = len(cores)
    dcores, dgates = [], []
    for k, (core, dv) in enumerate(zip(cores, dviews)):
        if k == 0:
            dv = dv.unsqueeze(0)
        if k == d - 1:
            dv = dv.unsqueeze(-1)
        out = torch.empty(core.shape, device=core.device, dtype=core.dtype)
        if k < d - 1:
            c = core if core.dtype == dv.dtype else core.to(dv.dtype)
            dgates.append((dv * c).sum(dim=tuple(range(dv.dim() - 1))).to(gates[k].dtype))
            torch.mul(dv, gates[k] if gates[k].dtype == dv.dtype else gates[k].to(dv.dtype), out=out)
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
            t += tl.dot(xb, lb, input_precision=PRECISION)
        tc = t.to(R.dtype.element_ty)
        o_start = pid_o * O_PER_PROG
        for n0 in range(0, O_PER_PROG, BLOCK_N):
            rn = o_start + n0 + tl.arange(0, BLOCK_N)
            n_ok = rn < O
            rb = tl.load(R + rn[None, :] * sro + rr[:, None] * srr, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            y = tl.dot(tc, rb, input_precision=PRECISION)
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
            u += tl.dot(db, rb, input_precision=PRECISION)
        uc = u.to(L.dtype.element_ty)
        if pid_i == 0:
            t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                k_ok = rk < I
                xb = tl.load(X + rm[:, None] * sxn + rk[None, :] * sxi, mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)
                lb = tl.load(L + rk[:, None] * sli + rr[None, :] * slr, mask=k_ok[:, None] & r_ok[None, :],
                             other=0.0)
                t += tl.dot(xb, lb, input_precision=PRECISION)
            tu_mask = m_ok[:, None] & r_ok[None, :]
            tl.store(T + rm[:, None] * stn + rr[None, :] * str_, t.to(T.dtype.element_ty), mask=tu_mask)
            tl.store(U + rm[:, None] * stn + rr[None, :] * str_, uc, mask=tu_mask)
        i_start = pid_i * I_PER_PROG
        for k0 in range(0, I_PER_PROG, BLOCK_K):
            rk = i_start + k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < I
            lt = tl.load(L + rk[None, :] * sli + rr[:, None] * slr, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            dx = tl.dot(uc, lt, input_precision=PRECISION)
            tl.store(DX + rm[:, None] * sdxn + rk[None, :] * sdxi, dx.to(DX.dtype.element_ty),
                     mask=m_ok[:, None] & k_ok[None, :])


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
    L = A.reshape(-1, r)[:rows].to(tdtype)
    R = B.reshape(-1, r)[:cols].to(tdtype)
    return a_name, b_name, A, B, L, R


def _forward_impl(x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, rows)
    n = x2.shape[0]
    triton_ok = _use_triton(x)
    plan = plan_for(n, cores, fmt, row_modes, col_modes, x.element_size(), fused=triton_ok)
    tdtype, mdtype = x.dtype, merge_dtype(cores)
    views = gated_core_views(cores, gates, mdtype)
    if plan.fused == "xlr" and triton_ok:
        env = {f"G{k + 1}": v for k, v in enumerate(views)}
        _run(plan, env, ("merge",), tdtype, mdtype)
        *_, L, R = _fused_halves(plan, env, rows, cols, tdtype)
        b = bias.to(tdtype) if bias is not None else None
        y = xlr_forward(x2.contiguous(), L, R, b)
        return y.reshape(*lead, cols)
    env = _leaf_views(plan, x2, views, row_modes, rows)
    _run(plan, env, ("merge", "forward"), tdtype, mdtype)
    y = env["y"].reshape(n, -1)[:, :cols]
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
    views = gated_core_views(cores, gates, mdtype)
    if plan.fused == "xlr" and triton_ok:
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
        env = _leaf_views(plan, x2, views, row_modes, rows)
        _run(plan, env, ("recompute",), tdtype, mdtype)
        dy_pad = dy
        o_pad = math.prod(col_modes)
        if cols < o_pad:
            dy_pad = torch.nn.functional.pad(dy, (0, o_pad - cols))
        env["dy"] = dy_pad.reshape(n, *col_modes)
        _run(plan, env, ("backward", "merge_backward"), tdtype, mdtype)
        dx = env["dx"].reshape(n, -1)[:, :rows]
    dviews = [env[f"dG{k + 1}"] for k in range(len(cores))]
    dcores, dgates = gated_core_grads(cores, gates, dviews)
    return [dx.reshape(x.shape).to(x.dtype).contiguous()] + dcores + dgates


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
                           rows: int, cols: int) -> list[torch.Tensor]:
    """[dx, d cores..., d gates...]"""
    return _backward_impl(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols)


@_tt_linear_backward_op.register_fake
def _(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols):
    return [torch.empty_like(x)] + [torch.empty_like(c) for c in cores] + [torch.empty_like(g) for g in gates]


def _setup_context(ctx, inputs, output):
    x, cores, gates, bias, fmt, row_modes, col_modes, rows, cols = inputs
    ctx.save_for_backward(x, *cores, *gates)
    ctx.meta = (len(cores), fmt, list(row_modes), list(col_modes), rows, cols,
                None if bias is None else bias.dtype)


def _backward(ctx, grad):
    d, fmt, row_modes, col_modes, rows, cols, bias_dtype = ctx.meta
    saved = ctx.saved_tensors
    x, cores, gates = saved[0], list(saved[1:1 + d]), list(saved[1 + d:])
    grads = _tt_linear_backward_op(grad, x, cores, gates, fmt, row_modes, col_modes, rows, cols)
    dx, dcores, dgates = grads[0], list(grads[1:1 + d]), list(grads[1 + d:])
    dbias = None if bias_dtype is None else grad.reshape(-1, cols).sum(0).to(bias_dtype)
    return dx, dcores, dgates, dbias, None, None, None, None, None


_tt_linear_op.register_autograd(_backward, setup_context=_setup_context)


def tt_linear(x: torch.Tensor, cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
              bias: Optional[torch.Tensor], fmt: str, row_modes: Sequence[int], col_modes: Sequence[int],
              rows: int, cols: int) -> torch.Tensor:
    """``x @ M[:rows, :cols] + bias`` for the TT matrix given by ``cores``/``gates`` (DESIGN.md)."""
    return torch.ops.comera.tt_linear(x, list(cores), list(gates), bias, fmt, list(row_modes), list(col_modes),
                                      int(rows), int(cols))
