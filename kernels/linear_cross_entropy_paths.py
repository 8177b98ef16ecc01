"""The drivers of ``comera::linear_cross_entropy``'s paths (see :mod:`comera_compile.cce.planner`):
Triton launches, library GEMMs, and the chunked torch reference.

Nothing here reads a device value on the host except the sparse path's one sync per round, so
every other path can run while a CUDA graph is being captured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .dispatch import HAS_TRITON, dot_precision
from comera_compile.cce.observed import observe_kept_fraction
from comera_compile.cce.planner import FORWARD_DX_MAX_D, chunk_plan
from comera_compile.cce.tuning import CCEStats, CCETuning, current_tuning, record

if HAS_TRITON:
    from .linear_cross_entropy_kernels import (
        dw_fused_kernel,
        dw_sparse_kernel,
        dx_fused_kernel,
        dx_sparse_kernel,
        grad_dense_kernel,
        grad_sparse_kernel,
        logits_grad_rows_kernel,
        lse_dx_small_d_kernel,
        lse_forward_kernel,
        scale_kernel,
    )

__all__ = ["FORWARD_DX_MAX_D", "GradCoefs", "LossInputs", "chunked", "forward_dx_small_d", "grad_coefs",
           "recompute_backward", "scale_", "triton_forward"]


@dataclass(frozen=True)
class LossInputs:
    """What every driver reads of one call: the hidden states ``x`` [N, D], the head's ``weight`` [V, D],
    ``target`` [N] (contiguous), ``bias`` [V] or None, and the loss's own scalars (``softcap``, 0: none; the
    ``ignore_index`` target id; ``label_smoothing``)."""

    x: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: float = 0.0
    ignore_index: int = -100
    label_smoothing: float = 0.0

    @property
    def tensors(self) -> tuple:
        return self.x, self.weight, self.target, self.bias


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _tuning(x: torch.Tensor) -> CCETuning:
    return current_tuning().fit(x.dtype, x.is_cuda, x.shape[1])


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The torch reference's arithmetic: fp32, or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Per-token coefficients of the loss being differentiated
# ---------------------------------------------------------------------------------------------


@dataclass
class GradCoefs:
    """``d total / d z_iv = pcoef_i p_iv - tcoef_i [v = t_i] - scoef_i`` (fp32 [N] each), for
    ``total = sum_i pcoef_i lse_i - tcoef_i z_{i,t_i} - scoef_i sum_v z_iv`` over softcapped logits."""

    pcoef: torch.Tensor
    tcoef: torch.Tensor
    scoef: torch.Tensor


def grad_coefs(grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], valid: torch.Tensor,
               reduction: str, label_smoothing: float, vocab: int) -> GradCoefs:
    """Coefficients for ``grad_loss`` (the loss's gradient, a scalar or [N]) and an optional
    gradient of the lse output; ``grad_loss=None`` stands for 1 (the chunked forward)."""
    zero = torch.zeros((), device=valid.device, dtype=torch.float32)
    g = grad_loss.float() if grad_loss is not None else torch.ones((), device=valid.device)
    if reduction == "mean":
        g = g / valid.sum()
    scale = torch.where(valid, g.expand(valid.shape), zero)  # d loss / d nll_i
    pcoef = scale if grad_lse is None else scale + grad_lse.float()
    return GradCoefs(pcoef.contiguous(), (scale * (1.0 - label_smoothing)).contiguous(),
                     (scale * (label_smoothing / vocab)).contiguous())


# ---------------------------------------------------------------------------------------------
# Forward over Triton logits tiles (no gradient)
# ---------------------------------------------------------------------------------------------


def triton_forward(inp: LossInputs, filter_eps: float = 0.0):
    """(lse, softcapped target logit, logit sum or None), fp32 [N], over Triton logits tiles; with
    ``filter_eps > 0`` also the :class:`LogitBounds` of the tiles, for a sparse pass that follows."""
    x, weight, target, bias = inp.tensors
    softcap, label_smoothing = inp.softcap, inp.label_smoothing
    cfg = _tuning(x)
    N, D = x.shape
    V = weight.shape[0]
    BM, BN, BK = cfg.fwd_block_m, cfg.fwd_block_n, cfg.fwd_block_k
    num_tb, nvb = _cdiv(N, BM), _cdiv(V, BN)
    one_k = D <= BK
    sms = _num_sms(x.device)
    want = max(1, _cdiv(4 * sms, num_tb))
    step = sms // math.gcd(num_tb, sms)  # num_tb * splits a multiple of the SM count when possible
    splits = min(nvb, _cdiv(want, step) * step)
    vb_per_split = _cdiv(nvb, splits)
    splits = _cdiv(nvb, vb_per_split)
    f32 = dict(device=x.device, dtype=torch.float32)
    m_part = torch.empty((splits, N), **f32)
    s_part = torch.empty((splits, N), **f32)
    tz_part = torch.empty((splits, N), **f32) if not one_k else m_part
    smooth = label_smoothing > 0.0
    zs_part = torch.empty((splits, N), **f32) if smooth else m_part
    # fp16 (the margin of LogitBounds covers its rounding; beyond its range the bound is infinite and
    # keeps the tiles): 1/(64 BM) of the fp32 logits
    colmax = torch.empty((num_tb, V), device=x.device, dtype=torch.float16) if filter_eps > 0.0 else m_part
    lse_forward_kernel[(num_tb * splits,)](
        x, weight, bias if bias is not None else x, target, m_part, s_part, tz_part, zs_part, colmax,
        N, V, D, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        bias.stride(0) if bias is not None else 0, float(softcap), vb_per_split, num_tb, splits,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.fwd_group_m, EVEN_K=D % BK == 0,
        DOT_PRECISION=dot_precision(x.dtype), HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap > 0.0, HAS_SMOOTH=smooth, ONE_K=one_k, HAS_TZ=not one_k,
        HAS_COLMAX=filter_eps > 0.0, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )
    record(CCEStats(phase="forward", path="triton"))
    tz = _target_logits(x, weight, target, bias, softcap) if one_k else tz_part.sum(0)
    lse = _combine_splits(m_part, s_part)[0]
    bounds = LogitBounds.of(colmax, lse, BM, filter_eps) if filter_eps > 0.0 else None
    return lse, tz, zs_part.sum(0) if smooth else None, bounds


@dataclass
class LogitBounds:
    """Which tiles a sparse pass may keep, from the forward's logits: ``maybe[b, v]`` (uint8) is 0
    where column v's largest logit over token block b (``rows`` tokens) stays so far below the
    block's smallest lse that no softmax entry of the column reaches ``filter_eps`` there (with a
    margin for the recompute's different rounding). A sparse pass then skips, without recomputing
    it, every tile all of whose (block, column) entries are 0: the filter would drop it. NaN and
    infinities compare false, so they always keep their tiles."""

    maybe: torch.Tensor
    rows: int

    @staticmethod
    def of(colmax: torch.Tensor, lse: torch.Tensor, rows: int, filter_eps: float,
           chunk_bytes: int = 16 << 20) -> "LogitBounds":
        """From ``colmax`` [token blocks of ``rows``, V] (any float dtype whose rounding is below
        2**-7 relative) and the lse [N]. A column is ruled out where c + 2**-6 |c| < lo + log(eps) -
        1 - 2**-6 |lo| (lo: the block's smallest lse), i.e. c below lo + log(eps) minus a margin of
        1 nat and 2**-6 of both magnitudes; fp32 arithmetic over column chunks of ``chunk_bytes``."""
        N = lse.shape[0]
        pad = colmax.shape[0] * rows - N
        low = torch.nn.functional.pad(lse, (0, pad), value=float("inf")).view(-1, rows).amin(1)[:, None]
        right = low + (math.log(filter_eps) - 1.0) - 2.0**-6 * low.abs()
        maybe = torch.empty(colmax.shape, device=colmax.device, dtype=torch.uint8)
        step = max(1, chunk_bytes // (4 * colmax.shape[0]))
        for c0 in range(0, colmax.shape[1], step):
            c = colmax[:, c0:c0 + step].float()
            left = c + 2.0**-6 * c.abs()
            torch.logical_not(left < right, out=maybe[:, c0:c0 + step])
        return LogitBounds(maybe, rows)

    def tile_flags(self, order: Optional[torch.Tensor], N: int, BM: int, BN: int) -> torch.Tensor:
        """uint8 [cdiv(N, BM), cdiv(V, BN)]: 0 where every entry of the tile (token block of BM,
        vocabulary block of BN in ``order``'s visiting order) is 0."""
        maybe = self.maybe.index_select(1, order.long()) if order is not None else self.maybe
        V = maybe.shape[1]
        nvb = _cdiv(V, BN)
        cols = torch.nn.functional.pad(maybe, (0, nvb * BN - V)).view(-1, nvb, BN).amax(2)
        if self.rows == BM:
            return cols.contiguous()
        per_row = cols.index_select(0, torch.arange(N, device=cols.device) // self.rows)
        num_tb = _cdiv(N, BM)
        return torch.nn.functional.pad(per_row, (0, 0, 0, num_tb * BM - N)).view(num_tb, BM, nvb).amax(1).contiguous()


def _target_logits(x, weight, target, bias, softcap: float, chunk: int = 4096) -> torch.Tensor:
    """fp32 softcapped logit of each row's target (0 where the target is not a vocabulary id),
    from gathered weight rows: for small D cheaper than a compare and a row sum on every tile."""
    N, V = x.shape[0], weight.shape[0]
    ok = (target >= 0) & (target < V)
    ts = torch.where(ok, target, torch.zeros_like(target))
    tz = torch.empty((N,), device=x.device, dtype=torch.float32)
    for i in range(0, N, chunk):
        j = min(i + chunk, N)
        tz[i:j] = (x[i:j].float() * weight[ts[i:j]].float()).sum(1)
    if bias is not None:
        tz += bias[ts].float()
    if softcap > 0.0:
        tz = softcap * torch.tanh(tz / softcap)
    return torch.where(ok, tz, torch.zeros_like(tz))


def forward_dx_small_d(inp: LossInputs, coefs: GradCoefs):
    """(lse, softcapped target logit, dx) for D <= FORWARD_DX_MAX_D in one pass over the logits
    tiles: dx is formed for the coefficients ``coefs`` (grad_output = 1) as
    ``pcoef_i sum_v p_iv softcap'(z_iv) W_v - tcoef_i softcap'(z_it) W_t`` (no label smoothing)."""
    x, weight, target, bias = inp.tensors
    softcap = inp.softcap
    cfg = _tuning(x)
    N, D = x.shape
    V = weight.shape[0]
    BM, BN, BK = cfg.fused_block_m, cfg.fused_block_n, _pow2(D)
    num_tb, nvb = _cdiv(N, BM), _cdiv(V, BN)
    splits, per_split = _vocab_splits(nvb, num_tb, x.device, cfg.fused_dx_waves,
                                      (32 << 20) // max(1, N * BK * 4))  # partials of dX within 32 MiB
    f32 = dict(device=x.device, dtype=torch.float32)
    m_part = torch.empty((splits, N), **f32)
    s_part = torch.empty((splits, N), **f32)
    acc_part = torch.empty((splits, N, BK), **f32)
    lse_dx_small_d_kernel[(num_tb, splits)](
        x, weight, bias if bias is not None else x, m_part, s_part, acc_part,
        N, V, D, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        bias.stride(0) if bias is not None else 0, float(softcap), per_split,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EVEN_K=D == BK, DOT_PRECISION=dot_precision(x.dtype),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap > 0.0,
        num_warps=cfg.fused_warps, num_stages=cfg.fused_stages)
    lse, share = _combine_splits(m_part, s_part)
    pw = torch.einsum("snk,sn->nk", acc_part, share)[:, :D]  # sum_v p_v softcap'(z_v) W_v
    tz = _target_logits(x, weight, target, bias, softcap)
    tcoef = _target_coef(coefs.tcoef, tz, softcap)
    ts = torch.where((target >= 0) & (target < V), target, torch.zeros_like(target))
    dx = (coefs.pcoef[:, None] * pw - tcoef[:, None] * weight[ts].float()).to(x.dtype)
    record(CCEStats(phase="forward", path="fused"))
    return lse, tz, dx


def _combine_splits(m_part: torch.Tensor, s_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse [N], each split's share of the softmax mass [splits, N]) from per-split running max and
    sum-exp partials [splits, N]."""
    m = m_part.amax(0)
    w = torch.where(m_part == float("-inf"), torch.zeros_like(m_part), torch.exp(m_part - m))
    total = (s_part * w).sum(0)
    return m + torch.log(total), w / total


def _target_coef(tcoef: torch.Tensor, tz: torch.Tensor, softcap: float) -> torch.Tensor:
    """The one-hot term's coefficient on the raw logit: tcoef times softcap' at the (softcapped)
    target logit tz."""
    return tcoef * (1.0 - (tz / softcap) ** 2) if softcap > 0.0 else tcoef


def _vocab_splits(nvb: int, programs: int, device: torch.device, waves: int, cap: int) -> tuple[int, int]:
    """(splits, vocabulary blocks per split) so that ``programs`` x splits fill ``waves`` programs
    per SM, at most ``cap`` splits, every split non-empty."""
    splits = max(1, min(nvb, _cdiv(waves * _num_sms(device), programs), cap))
    per_split = _cdiv(nvb, splits)
    return _cdiv(nvb, per_split), per_split


# ---------------------------------------------------------------------------------------------
# Chunks of tokens with library GEMMs (the chunked path, and the torch reference)
# ---------------------------------------------------------------------------------------------


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc += a @ b (acc = a @ b when ``first``: acc may hold garbage) with acc fp32 and a, b
    possibly half precision, without a half partial."""
    beta = 0.0 if first else 1.0
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, beta=beta, out=acc)
    elif first:
        acc.copy_(torch.mm(a, b))
    else:
        acc += torch.mm(a, b).to(acc.dtype)


def scale_(t: torch.Tensor, scale: torch.Tensor, *, triton: bool) -> None:
    """t *= scale (a one-element fp32 tensor) in fp32 arithmetic, in place, without a host sync.
    With ``triton`` (and t contiguous) one vectorized kernel; torch's ``mul_`` of a half tensor by
    an fp32 tensor takes its casting elementwise kernel, ~4x slower on the H200."""
    if not (triton and t.is_contiguous()) or t.numel() == 0:
        t.mul_(scale)
        return
    block = 4096
    scale_kernel[(_cdiv(t.numel(), block),)](t, scale.reshape(1).float(), t.numel(), BLOCK=block, num_warps=8)


def _rows_torch(z, t, coefs: Optional[GradCoefs], softcap, ignore_index, label_smoothing):
    """The torch step of a chunk: (nll, lse, target logit) of the rows of raw logits ``z`` in the
    compute dtype; ``z`` is scratch, and with ``coefs`` it ends holding their gradient.

    One exponential per entry, taken in place: ``e = exp(z - m)`` (``m`` the row maximum), ``s =
    sum e``, ``lse = m + log s``. The loss is ``log s + (1 - ls)(m - z_t) + ls (m - mean z)``, which
    is eager's ``-log_softmax`` (differences from the maximum, never below 0), and the gradient
    ``pcoef e / s - scoef - tcoef [v = t]``, eager's softmax. Three exponential passes (cross_entropy,
    logsumexp, softmax) and their temporaries took 3x as long on the CPU."""
    zc = softcap * torch.tanh(z / softcap) if softcap > 0.0 else z
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)[:, None]
    tz = torch.where(valid, zc.gather(1, safe_t)[:, 0], 0.0)
    m = zc.amax(1, keepdim=True)
    mean = zc.mean(1) if label_smoothing > 0.0 else None
    if softcap > 0.0 and coefs is not None:
        z.div_(softcap).tanh_().square_().neg_().add_(1.0)  # d zc / d z, for the gradient
    e = zc.sub_(m).exp_()
    s = e.sum(1)
    log_s, m = s.log(), m[:, 0]
    nll = log_s + (1.0 - label_smoothing) * (m - tz)
    if mean is not None:
        nll = nll + label_smoothing * (m - mean)
    nll = torch.where(valid, nll, 0.0)
    if coefs is not None:
        g = e.mul_((coefs.pcoef.to(e.dtype) / s)[:, None]).sub_(coefs.scoef.to(e.dtype)[:, None])
        g.scatter_add_(1, safe_t, -coefs.tcoef.to(e.dtype)[:, None])
        if softcap > 0.0:
            z.mul_(g)
    return nll.float(), (m + log_s).float(), tz.float()


def _rows_triton(z, t, coefs: Optional[GradCoefs], softcap, ignore_index, label_smoothing, out,
                 bias: Optional[torch.Tensor] = None):
    """The rows kernel over a logits chunk; ``bias`` (if given) is added to it in fp32 there."""
    cfg = current_tuning()
    rows, V = z.shape
    nll, lse, tz = out
    pc = coefs.pcoef if coefs is not None else nll
    logits_grad_rows_kernel[(rows,)](
        z, t, pc, coefs.tcoef if coefs is not None else pc, coefs.scoef if coefs is not None else pc,
        nll, lse, tz, bias if bias is not None else nll, V, z.stride(0),
        bias.stride(0) if bias is not None else 0, int(ignore_index), float(softcap), float(label_smoothing),
        BLOCK_V=min(cfg.rows_block_v, _pow2(V)), HAS_SOFTCAP=softcap > 0.0,
        HAS_SMOOTH=label_smoothing > 0.0, WRITE_GRAD=coefs is not None, HAS_BIAS=bias is not None,
        num_warps=cfg.rows_warps)


def chunked(inp: LossInputs, coefs: Optional[GradCoefs], budget: int, *, triton: bool,
            need: tuple[bool, bool, bool] = (False, False, False), phase: str):
    """Loss terms and (with ``coefs``) gradients, a chunk of tokens at a time.

    Returns (nll, lse, target logit) fp32 [N] and dx, dw, db (None when not asked). With
    ``triton`` the GEMMs run in the input dtype (fp32 accumulation inside each) and the rows kernel
    does the softmax; otherwise everything runs in the compute dtype (the torch reference). The
    logits chunk is ``rows x V`` (``chunk_plan``), overwritten by its gradient.
    """
    x, weight, target, bias = inp.tensors
    softcap, ignore_index, label_smoothing = inp.softcap, inp.ignore_index, inp.label_smoothing
    need_dx, need_dw, need_db = need
    N, D = x.shape
    V = weight.shape[0]
    cdt = x.dtype if triton else compute_dtype(x)
    w = weight.to(cdt)
    # An fp32 bias over 16-bit logits is added in fp32 by the rows kernel, not rounded into the chunk.
    row_bias = bias if triton and bias is not None and bias.dtype != cdt else None
    b = bias.to(cdt) if bias is not None and row_bias is None else None
    elem = torch.finfo(cdt).bits // 8
    rows, fp32_acc = chunk_plan(N, D, V, elem, budget, coefs is not None and need_dw)
    f32 = dict(device=x.device, dtype=torch.float32)
    nll, lse, tz = (torch.empty((N,), **f32) for _ in range(3))
    grads = coefs is not None
    dx = torch.empty((N, D), device=x.device, dtype=x.dtype) if grads and need_dx else None
    # dW is written by the first chunk's GEMM (beta = 0: no zero fill of a [V, D] buffer)
    dw_acc = ((torch.empty if N > 0 else torch.zeros)((V, D), device=x.device,
                                                      dtype=torch.float32 if fp32_acc else cdt)
              if grads and need_dw else None)
    db_acc = torch.zeros((V,), **f32) if grads and need_db else None
    zbuf = torch.empty((min(rows, N), V), device=x.device, dtype=cdt)
    for i in range(0, N, rows):
        j = min(i + rows, N)
        xc = x[i:j].to(cdt)
        z = zbuf[: j - i]
        if b is not None:
            torch.addmm(b, xc, w.t(), out=z)
        else:
            torch.mm(xc, w.t(), out=z)
        part = GradCoefs(coefs.pcoef[i:j], coefs.tcoef[i:j], coefs.scoef[i:j]) if grads else None
        if triton:
            _rows_triton(z, target[i:j], part, softcap, ignore_index, label_smoothing,
                         (nll[i:j], lse[i:j], tz[i:j]), row_bias)
        else:
            nll[i:j], lse[i:j], tz[i:j] = _rows_torch(z, target[i:j], part, softcap, ignore_index,
                                                      label_smoothing)
        if dx is not None:
            if cdt == x.dtype:
                torch.mm(z, w, out=dx[i:j])
            else:
                dx[i:j] = torch.mm(z, w)
        if dw_acc is not None:
            addmm_f32_(dw_acc, z.t(), xc, first=i == 0)
        if db_acc is not None:
            db_acc += z.sum(0, dtype=torch.float32)
    record(CCEStats(phase=phase, path="chunked" if triton else "torch", chunks=_cdiv(N, rows)))
    dw = dw_acc.to(weight.dtype) if dw_acc is not None else None
    db = db_acc.to(bias.dtype) if db_acc is not None else None
    return nll, lse, tz, dx, dw, db


# ---------------------------------------------------------------------------------------------
# Recompute backward over Triton tiles: sparse rounds, static vocabulary chunks, fused kernels
# ---------------------------------------------------------------------------------------------


def _vocab_order(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Vocabulary positions by decreasing mean logit: sum_i z_iv = W_v . sum_i x_i + N b_v."""
    xsum = x.sum(0, dtype=torch.float32)
    key = torch.mv(weight, xsum.to(weight.dtype)).float()
    if bias is not None:
        key = key + x.shape[0] * bias.float()
    key = torch.nan_to_num(key, nan=0.0)
    return torch.argsort(key, descending=True, stable=True).to(torch.int32)


def _weighted_row_sum(coef: torch.Tensor, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """sum_i coef_i * x_i in fp32, a few thousand rows at a time (no [N, D] fp32 copy)."""
    out = torch.zeros((x.shape[1],), device=x.device, dtype=torch.float32)
    for i in range(0, x.shape[0], chunk):
        out += coef[i:i + chunk] @ x[i:i + chunk].float()
    return out


class _Backward:
    """State shared by the recompute paths of one backward call: the inputs, the per-token
    coefficients and target positions, the rank-one smoothing terms and the outputs."""

    def __init__(self, x, weight, target, bias, lse, tz, coefs: GradCoefs, softcap, label_smoothing,
                 filter_eps, budget, need_dx, need_dw, need_db, order: bool):
        self.x, self.weight, self.bias, self.lse = x, weight, bias, lse
        self.cfg = _tuning(x)
        self.N, self.D = x.shape
        self.V = weight.shape[0]
        self.softcap, self.filter_eps, self.budget = softcap, filter_eps, budget
        self.need_dx, self.need_dw, self.need_db = need_dx, need_dw, need_db
        self.pcoef, self.scoef = coefs.pcoef, coefs.scoef
        # the tile kernels take softcap' at the target inside tcoef
        self.tcoef = _target_coef(coefs.tcoef, tz, softcap).contiguous()
        self.smooth_in_tile = label_smoothing > 0.0 and softcap > 0.0  # not rank-one then
        self.smooth_vec = label_smoothing > 0.0 and not self.smooth_in_tile
        self.gdtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32
        self.order = _vocab_order(x, weight, bias) if order else None
        self._targets(target)
        self._smoothing_terms()
        dev = x.device
        self.dx = torch.empty((self.N, self.D), device=dev, dtype=x.dtype) if need_dx else None
        self.dw = torch.empty((self.V, self.D), device=dev, dtype=weight.dtype) if need_dw else None
        self.db = torch.empty((self.V,), device=dev, dtype=bias.dtype) if need_db else None

    def _targets(self, target: torch.Tensor) -> None:
        """Target ids with ignored rows at 0, and each target's visiting position (V if ignored)."""
        valid = self.tcoef != 0
        self.tgt_safe = torch.where(valid, target, torch.zeros_like(target))
        if self.order is not None:
            i32 = dict(device=target.device, dtype=torch.int32)
            inv = torch.empty((self.V,), **i32)
            inv[self.order.long()] = torch.arange(self.V, **i32)
            tpos = inv[self.tgt_safe]
        else:
            tpos = self.tgt_safe.to(torch.int32)
        self.tpos = torch.where(valid, tpos, torch.full_like(tpos, self.V)).contiguous()

    def _smoothing_terms(self) -> None:
        """Without softcap, label smoothing's gradient is rank-one: -scoef_i on every logit."""
        vec = self.smooth_vec
        self.wcolsum = self.weight.sum(0, dtype=torch.float32) if vec and self.need_dx else None
        self.xsmooth = _weighted_row_sum(self.scoef, self.x) if vec and self.need_dw else None
        self.bsmooth = self.scoef.sum().reshape(1) if vec and self.need_db else None

    def strides(self) -> tuple:
        b = self.bias
        return (self.x.stride(0), self.x.stride(1), self.weight.stride(0), self.weight.stride(1),
                b.stride(0) if b is not None else 0)

    def tile_args(self, BM: int, BK: int, warps: int, stages: int) -> dict:
        return dict(BLOCK_M=BM, BLOCK_K=BK, EVEN_K=self.D % BK == 0,
                    DOT_PRECISION=dot_precision(self.x.dtype), HAS_BIAS=self.bias is not None,
                    HAS_SOFTCAP=self.softcap > 0.0, SMOOTH_IN_TILE=self.smooth_in_tile,
                    num_warps=warps, num_stages=stages)

    def outputs(self):
        return self.dx, self.dw, self.db


class _SparseRounds:
    """The buffers of the sparse path and its three steps per round: keep tiles, reduce dX, reduce dW."""

    def __init__(self, bw: _Backward, bounds: Optional[LogitBounds] = None):
        cfg = self.cfg = bw.cfg
        self.bw = bw
        self.BM, self.BN, self.BD = cfg.bwd_block_m, cfg.bwd_block_n, cfg.cons_block_d
        self.num_tb, self.nvb = _cdiv(bw.N, self.BM), _cdiv(bw.V, self.BN)
        dev = bw.x.device
        self.i32 = dict(device=dev, dtype=torch.int32)
        # tiles the forward's bounds rule out: 0 (never recomputed); None: every tile is recomputed
        self.maybe = bounds.tile_flags(bw.order, bw.N, self.BM, self.BN) if bounds is not None else None
        elem = torch.finfo(bw.gdtype).bits // 8
        self.capacity = max(self.num_tb, min(cfg.tile_budget_bytes, bw.budget) // (self.BM * self.BN * elem))
        self.G = torch.empty((self.capacity, self.BM, self.BN), device=dev, dtype=bw.gdtype)
        self.gcol = torch.empty((self.capacity, self.BN), device=dev, dtype=torch.float32)
        self.slot_map = torch.empty((self.num_tb * self.nvb,), **self.i32)
        self.counter = torch.zeros((1,), **self.i32)
        if bw.need_dw or bw.need_db:  # tokens grouped by the vocabulary block of their target
            self.toks = torch.argsort(bw.tpos, stable=True).to(torch.int32)
            self.tok_pos = bw.tpos[self.toks.long()].contiguous()
            self.tok_ptr = torch.searchsorted(self.tok_pos, torch.arange(self.nvb + 1, **self.i32) * self.BN
                                              ).to(torch.int32)
        self.cons = dict(BLOCK_M=self.BM, BLOCK_N=self.BN, BLOCK_D=self.BD, HAS_ORDER=True,
                         DOT_PRECISION=dot_precision(bw.x.dtype), num_warps=cfg.cons_warps,
                         num_stages=cfg.cons_stages)

    def keep_tiles(self, vb_start: int) -> tuple[int, int, int, torch.Tensor]:
        """Recompute the tiles from vocabulary block ``vb_start`` on (but those the forward's bounds
        rule out), keep those above the filter while the buffer lasts; (block columns done, tiles
        kept, tiles ruled out by the bounds, slot map [token block, column])."""
        bw, cfg, BN, num_tb = self.bw, self.cfg, self.BN, self.num_tb
        nvr = self.nvb - vb_start
        self.counter.zero_()
        maybe = self.maybe
        grad_sparse_kernel[(num_tb * nvr,)](
            bw.x, bw.weight, bw.bias if bw.bias is not None else bw.x, bw.order, bw.lse, bw.pcoef, bw.lse,
            self.G, self.gcol, self.slot_map, self.counter, maybe if maybe is not None else self.counter,
            bw.N, bw.V, bw.D, *bw.strides(),
            float(bw.softcap), float(bw.filter_eps), self.capacity, vb_start * BN, nvr, num_tb, self.nvb,
            BLOCK_N=BN, HAS_ORDER=True, GROUP_V=cfg.group_v, HAS_MAYBE=maybe is not None,
            **bw.tile_args(self.BM, cfg.bwd_block_k, cfg.bwd_warps, cfg.bwd_stages))
        sm = self.slot_map[: num_tb * nvr].view(num_tb, nvr)
        unresolved = (sm == -2).any(0)
        done_t = torch.where(unresolved.any(), unresolved.int().argmax(), nvr)
        last = (done_t - 1).clamp_min(0)
        kept_cum = torch.cumsum((sm >= 0).sum(0), 0)
        counts = [done_t, torch.where(done_t > 0, kept_cum[last], 0)]
        if maybe is not None:
            ruled_cum = torch.cumsum((maybe[:, vb_start:] == 0).sum(0), 0)
            counts.append(torch.where(done_t > 0, ruled_cum[last], 0))
        done, n_kept, *ruled = torch.stack(counts).tolist()  # the one host sync of a round
        return done, n_kept, (ruled[0] if ruled else 0), sm[:, :done]

    def reduce_dx(self, sm: torch.Tensor, vb_start: int, first: bool) -> None:
        """dX (+)= the kept tiles of the round, token block by token block, plus the round's targets."""
        bw, done = self.bw, sm.shape[1]
        kept = sm >= 0
        rm = torch.argsort((~kept).view(-1).to(torch.int8), stable=True)  # kept tiles first, row-major
        row_ptr = torch.zeros((self.num_tb + 1,), **self.i32)
        row_ptr[1:] = torch.cumsum(kept.sum(1), 0)
        dx_sparse_kernel[(self.num_tb, _cdiv(bw.D, self.BD))](
            self.G, bw.weight, bw.order, row_ptr, (rm % done).to(torch.int32), sm.reshape(-1)[rm],
            bw.tgt_safe, bw.tpos, bw.tcoef, bw.scoef, bw.wcolsum if bw.wcolsum is not None else bw.lse, bw.dx,
            bw.N, bw.V, bw.D, bw.weight.stride(0), bw.weight.stride(1), bw.dx.stride(0), bw.dx.stride(1),
            vb_start, vb_start * self.BN, (vb_start + done) * self.BN,
            SMOOTH_TERMS=bw.smooth_vec and first, LOAD_PREV=not first, **self.cons)

    def reduce_dw(self, sm: torch.Tensor, vb_start: int) -> None:
        """dW and dB rows of the round's block columns, written once."""
        bw, done = self.bw, sm.shape[1]
        kept_t = (sm >= 0).t().contiguous()
        cm = torch.argsort((~kept_t).view(-1).to(torch.int8), stable=True)
        col_ptr = torch.zeros((done + 1,), **self.i32)
        col_ptr[1:] = torch.cumsum(kept_t.sum(1), 0)
        dw, db, dummy = bw.dw, bw.db, bw.lse
        dw_sparse_kernel[(done, _cdiv(bw.D, self.BD) if bw.need_dw else 1)](
            self.G, self.gcol, bw.x, bw.order, col_ptr, (cm % self.num_tb).to(torch.int32),
            sm.t().reshape(-1)[cm], self.tok_ptr, self.toks, self.tok_pos, bw.tcoef,
            bw.xsmooth if bw.xsmooth is not None else dummy, bw.bsmooth if bw.bsmooth is not None else dummy,
            dw if dw is not None else self.G, db if db is not None else self.G,
            bw.N, bw.V, bw.D, bw.x.stride(0), bw.x.stride(1),
            dw.stride(0) if dw is not None else 0, dw.stride(1) if dw is not None else 0,
            db.stride(0) if db is not None else 0, vb_start,
            BLOCK_T=self.cfg.tgt_block, HAS_BIAS=bw.need_db, HAS_SMOOTH_VEC=bw.smooth_vec, HAS_DW=bw.need_dw,
            **self.cons)


def _sparse(bw: _Backward, phase: str = "backward", bounds: Optional[LogitBounds] = None) -> None:
    """Sparse rounds: kept tiles go to a bounded buffer and are reduced by the dx/dw kernels. When
    two rounds in a row keep most tiles, or after ``dense_after_rounds`` rounds, the rest of the
    vocabulary goes through static chunks. One host sync per round (never under capture). The
    fraction of tiles kept over the blocks the rounds covered goes to ``observe_kept_fraction``
    (host integers the rounds' syncs already read: no extra sync)."""
    sp = _SparseRounds(bw, bounds)
    cfg = bw.cfg
    rounds = kept_total = ruled_total = vb_start = dense_streak = 0
    while vb_start < sp.nvb:
        done, n_kept, n_ruled, sm = sp.keep_tiles(vb_start)
        if done == 0:  # not even one block column fitted: the rest goes static
            break
        rounds += 1
        kept_total += n_kept
        ruled_total += n_ruled
        if bw.need_dx:
            sp.reduce_dx(sm, vb_start, first=rounds == 1)
        if bw.need_dw or bw.need_db:
            sp.reduce_dw(sm, vb_start)
        vb_start += done
        # Filtering does not pay when rounds keep most tiles: finish with static chunks. The
        # first blocks (the most frequent words) are often dense, so one dense round is not
        # enough to give up.
        dense_streak = dense_streak + 1 if n_kept > cfg.dense_density * sp.num_tb * done else 0
        if dense_streak >= 2 or rounds >= cfg.dense_after_rounds:
            break
    tiles, nvb, BN, covered = sp.num_tb * sp.nvb, sp.nvb, sp.BN, sp.num_tb * vb_start
    del sp  # free the tile buffer before the static chunks
    chunks = _static(bw, vb_start * BN, continuing=rounds > 0) if vb_start < nvb else 0
    observe_kept_fraction(bw.V, bw.D, bw.x.dtype, bw.filter_eps, kept_total, covered,
                          skipped_tiles=ruled_total if bounds is not None else None)
    record(CCEStats(phase=phase, path="sparse", chunks=chunks, sparse_rounds=rounds, tiles=tiles,
                    kept_tiles=kept_total, sparse_blocks=vb_start, skipped_tiles=ruled_total,
                    bounded=bounds is not None))


def _static(bw: _Backward, p0: int = 0, continuing: bool = False) -> int:
    """Static chunks of the vocabulary from visiting position ``p0``: ``grad_dense_kernel`` writes
    the whole gradient of a chunk, library GEMMs reduce it (dW rows written once, dX accumulated in
    an fp32 buffer). The schedule depends on the shapes only. Returns the number of chunks."""
    cfg, x, weight = bw.cfg, bw.x, bw.weight
    N, V, D = bw.N, bw.V, bw.D
    BM, BND = cfg.bwd_block_m, cfg.dense_block_n
    num_tb = _cdiv(N, BM)
    elem = torch.finfo(bw.gdtype).bits // 8
    acc = None
    if bw.need_dx:
        if continuing:
            acc = bw.dx.float()
        else:
            acc = torch.zeros((N, D), device=x.device, dtype=torch.float32)
            if bw.smooth_vec:
                acc.addr_(bw.scoef, bw.wcolsum, alpha=-1.0)
    room = min(cfg.dense_budget_bytes, max(0, bw.budget - (4 * N * D if bw.need_dx else 0)))
    width = max(BND, room // max(1, N * elem) // BND * BND)
    width = min(width, _cdiv(V - p0, BND) * BND)
    Gd = torch.empty((N, width), device=x.device, dtype=bw.gdtype)
    tiles = dict(bw.tile_args(BM, cfg.bwd_block_k, cfg.bwd_warps, cfg.bwd_stages), GROUP_V=cfg.group_v)
    order = bw.order
    chunks = 0
    for c0 in range(p0, V, width):
        c1 = min(c0 + width, V)
        nvr = _cdiv(c1 - c0, BND)
        chunks += 1
        grad_dense_kernel[(num_tb * nvr,)](
            x, weight, bw.bias if bw.bias is not None else x, order if order is not None else bw.tpos,
            bw.lse, bw.pcoef, bw.scoef, bw.tpos, bw.tcoef, Gd,
            N, V, D, *bw.strides(), float(bw.softcap), c0, nvr, num_tb, width,
            BLOCK_N=BND, HAS_ORDER=order is not None, **tiles)
        _reduce_chunk(bw, Gd[:, : c1 - c0], c0, c1, acc)
    if acc is not None:
        bw.dx.copy_(acc)
    return chunks


def _reduce_chunk(bw: _Backward, gc: torch.Tensor, c0: int, c1: int, acc: Optional[torch.Tensor]) -> None:
    """dX += G_c W_c, dW[c] = G_c^T x (minus smoothing), dB[c] = column sums, for one chunk."""
    cols = bw.order[c0:c1].long() if bw.order is not None else None
    if acc is not None:
        wc = bw.weight.index_select(0, cols) if cols is not None else bw.weight[c0:c1]
        addmm_f32_(acc, gc, wc)
    if bw.need_dw:
        part = torch.mm(gc.t(), bw.x, out=bw.dw[c0:c1]) if cols is None else torch.mm(gc.t(), bw.x)
        if bw.smooth_vec:
            part -= bw.xsmooth
        if cols is not None:
            bw.dw.index_copy_(0, cols, part)
    if bw.need_db:
        part = gc.sum(0, dtype=torch.float32)
        if bw.smooth_vec:
            part = part - bw.bsmooth
        if cols is None:
            bw.db[c0:c1] = part
        else:
            bw.db.index_copy_(0, cols, part.to(bw.db.dtype))


def _fused(bw: _Backward, phase: str = "backward") -> None:
    """dX by token block (vocabulary split across programs, fp32 partials summed on the host) and
    dW/dB by vocabulary block, each recomputing the tiles it needs: nothing gradient-sized is
    written, no atomics, a schedule fixed by the shapes. Fast for small D; larger D is split into
    chunks of ``fused_max_d`` columns, each recomputing the tiles."""
    cfg, x, weight = bw.cfg, bw.x, bw.weight
    N, V, D = bw.N, bw.V, bw.D
    BM, BN = cfg.fused_block_m, cfg.fused_block_n
    BD = min(_pow2(D), _pow2(cfg.fused_max_d))
    num_tb, nvb, nd = _cdiv(N, BM), _cdiv(V, BN), _cdiv(D, BD)
    # One D chunk: the logits take one K step of BD, and each loaded tile serves both products.
    one_k = nd == 1
    tiles = bw.tile_args(BM, BD if one_k else cfg.bwd_block_k, cfg.fused_warps, cfg.fused_stages)
    tiles["ONE_K"] = one_k
    bias_arg = bw.bias if bw.bias is not None else x
    common = (x, weight, bias_arg, bw.lse, bw.pcoef, bw.scoef, bw.tpos, bw.tcoef)
    if bw.need_dx:
        # enough (token block, vocabulary split) programs for ``fused_dx_waves`` per SM
        splits, per_split = _vocab_splits(nvb, num_tb * nd, x.device, cfg.fused_dx_waves, nvb)
        part = torch.empty((splits, N, D), device=x.device, dtype=torch.float32)
        dx_fused_kernel[(num_tb, splits, nd)](
            *common, part, N, V, D, *bw.strides(), float(bw.softcap), per_split,
            BLOCK_N=BN, BLOCK_D=BD, **tiles)
        dxf = part.sum(0)
        if bw.smooth_vec:
            dxf.addr_(bw.scoef, bw.wcolsum, alpha=-1.0)
        bw.dx.copy_(dxf)
    if bw.need_dw or bw.need_db:
        dbf = torch.empty((V,), device=x.device, dtype=torch.float32) if bw.need_db else bw.lse
        dw = bw.dw if bw.need_dw else dbf
        dw_fused_kernel[(nvb, nd if bw.need_dw else 1)](
            *common, bw.xsmooth if bw.xsmooth is not None else bw.lse, dw, dbf,
            N, V, D, *bw.strides(), float(bw.softcap),
            dw.stride(0) if bw.need_dw else 0, dw.stride(1) if bw.need_dw else 0,
            BLOCK_N=BN, BLOCK_D=BD, HAS_SMOOTH_VEC=bw.smooth_vec, HAS_DW=bw.need_dw,
            HAS_DB=bw.need_db, **tiles)
        if bw.need_db:
            bw.db.copy_(dbf - bw.bsmooth if bw.smooth_vec else dbf)
    record(CCEStats(phase=phase, path="fused"))


def recompute_backward(path: str, inp: LossInputs, lse, tz, coefs: GradCoefs, filter_eps: float, budget: int,
                       need: tuple[bool, bool, bool], phase: str = "backward",
                       bounds: Optional[LogitBounds] = None):
    """(dx, dw, db) by one of the Triton recompute paths: "sparse", "static" or "fused". ``phase``
    names the call in its :class:`CCEStats`: "forward" when the forward forms the gradient (for
    ``grad_output = 1``) by sparse rounds in place of the chunked path. ``bounds`` (sparse only):
    the forward's :class:`LogitBounds`, whose ruled-out tiles are not recomputed."""
    bw = _Backward(*inp.tensors, lse, tz, coefs, inp.softcap, inp.label_smoothing, filter_eps,
                   budget, *need, order=path == "sparse")
    if path == "sparse":
        _sparse(bw, phase, bounds)
    elif path == "fused":
        _fused(bw, phase)
    else:
        chunks = _static(bw)
        record(CCEStats(phase=phase, path="static", chunks=chunks))
    return bw.outputs()
