"""``comera::lowrank_linear``: ``y = act(x @ L) @ R + bias``, a rank bottleneck as one fused op.

``x [..., d_in]`` (leading dims are flattened to ``T`` tokens), ``L [d_in, r]``, ``R [r, d_out]``,
``bias [d_out]`` or None, ``act`` one of :data:`ACTIVATIONS`:

* ``"identity"``; ``"relu"``; ``"silu"`` (``x * sigmoid(x)``);
* ``"gelu"``: the exact erf form, ``F.gelu(h)``; ``"gelu_tanh"``: ``F.gelu(h, approximate="tanh")``.

As two library GEMMs the layer is memory-bound (it reads x and writes y; ``[T, r]`` is tiny) but each
GEMM is skinny and reaches only a fraction of the bandwidth. The Triton kernels here keep the
``[BLOCK_T, r]`` tile on chip:

* forward (``_fwd_kernel``), one program per ``BLOCK_T`` rows: ``h = x_blk @ L`` accumulated in fp32
  over ``d_in`` in ``BLOCK_K`` chunks (``r`` padded to ``R_PAD``, a power of two >= 16, with zeros),
  ``h`` stored (fp32 ``[T, r]``, pre-activation, saved for the backward), ``a = act(h)`` cast to the
  input dtype, then ``y_blk = a @ R (+ bias)`` written in ``BLOCK_N`` chunks of ``d_out``. x is read
  once and y written once.
* backward (``_bwd_kernel``), the same shape: ``dA = dy_blk @ Rᵀ`` over ``d_out``,
  ``dH = dA * act'(h)``, ``dx = dH @ Lᵀ`` written over ``d_in``; dH (in the input dtype, ``[T, r8]``,
  r rounded up to a multiple of 8 with zero columns so the library GEMMs get aligned rows) goes out.
  The weight gradients are reductions over T done by library GEMMs on the small tensors:
  ``dL = xᵀ @ dH`` and ``[dR; db] = [a, 1]ᵀ @ dy`` (the bias gradient rides along as a column of ones,
  so dy is read once for both).

Every dot accumulates in fp32 (``tl.dot`` with ``input_precision = dispatch.dot_precision(dtype)``);
fp32, fp16 and bf16 inputs; any T, d_in, d_out (masked); ``1 <= r <= 128``. Block sizes are tuned with
a small ``triton.autotune`` list on GPU (one config under the interpreter, where autotune with several
fails). The dispatch is :func:`comera_compile.kernels.dispatch.use_triton`: CUDA tensors run the
kernels, CPU tensors the torch reference (``impl="torch"``: the same math as two matmuls, h rounded to
the input dtype), except under ``TRITON_INTERPRET=1`` with ``COMERA_FORCE_TRITON=1`` (tests). Under
``impl="auto"`` a kernel that fails to build or launch is reported once and the reference serves; r >
128 always takes the reference under "auto" (``impl="triton"`` raises).

The op returns ``(y, h)``; :func:`lowrank_linear` returns y. It is opaque to ``torch.compile``
(``register_fake``), differentiable (``register_autograd``, the backward is
``comera::lowrank_linear_backward``), and reads nothing on the host (CUDA-graph safe).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from comera_compile.kernels.dispatch import HAS_TRITON, dot_precision, interpreting, use_triton

__all__ = ["ACTIVATIONS", "MAX_RANK", "lowrank_linear"]
logger = logging.getLogger("comera_compile")

OP = "comera::lowrank_linear"
ACTIVATIONS = ("identity", "relu", "gelu", "gelu_tanh", "silu")
MAX_RANK = 128  # the kernels' limit on r (the torch reference has none)
_BROKEN: list[str] = []  # why the kernels could not run here (then the reference serves every later call)

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_K0 = 0.7978845608028654  # sqrt(2 / pi)
_K1 = 0.044715

if HAS_TRITON:
    import triton
    import triton.language as tl

    if interpreting():  # autotune with several configs fails under the interpreter; small blocks, masked edges
        _CONFIGS = [triton.Config({"BLOCK_T": 16, "BLOCK_K": 32, "BLOCK_N": 16})]
    else:
        _CONFIGS = [
            triton.Config({"BLOCK_T": 16, "BLOCK_K": 256, "BLOCK_N": 256}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_T": 32, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_T": 32, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=8, num_stages=4),
            triton.Config({"BLOCK_T": 64, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_T": 64, "BLOCK_K": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_T": 128, "BLOCK_K": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        ]
    _EVEN = {"EVEN_K": lambda a: a["D_IN"] % a["BLOCK_K"] == 0, "EVEN_N": lambda a: a["D_OUT"] % a["BLOCK_N"] == 0}

    @triton.jit
    def _tanh(u):
        """tanh as 1 - 2 / (exp(2u) + 1): saturates to +-1 without inf/inf."""
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def _act(h, ACT: tl.constexpr):
        """act(h) in fp32; ACT is the index in ACTIVATIONS. act(0) = 0 for all (the padding stays 0)."""
        if ACT == 1:
            a = tl.maximum(h, 0.0)
        elif ACT == 2:
            a = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
        elif ACT == 3:
            a = 0.5 * h * (1.0 + _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)))
        elif ACT == 4:
            a = h * tl.sigmoid(h)
        else:
            a = h
        return a

    @triton.jit
    def _dact(h, ACT: tl.constexpr):
        """act'(h) in fp32 (relu: 1 where h > 0, as torch's)."""
        if ACT == 1:
            d = tl.where(h > 0.0, 1.0, 0.0)
        elif ACT == 2:
            d = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476)) + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)
        elif ACT == 3:
            t = _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
            d = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h)
        elif ACT == 4:
            s = tl.sigmoid(h)
            d = s * (1.0 + h * (1.0 - s))
        else:
            d = tl.zeros_like(h) + 1.0
        return d

    @triton.autotune(configs=_CONFIGS, key=["D_IN", "D_OUT", "R_PAD", "T_BUCKET"])
    @triton.heuristics(_EVEN)
    @triton.jit
    def _fwd_kernel(
        X, Lw, Rw, Bias, Y, H, T, D_IN, D_OUT, RANK, T_BUCKET,
        sxt, sxk, slk, slr, srr, srn, syt, syn, sht, shr,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = tl.where(row_ok, rows, 0).to(tl.int64)  # rows past T read row 0 (valid), never stored
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < RANK
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = tl.arange(0, BLOCK_N)

        h = tl.zeros((BLOCK_T, R_PAD), dtype=tl.float32)
        for k0 in range(0, D_IN, BLOCK_K):
            ks = k0 + offs_k
            x_ptrs = X + rows64[:, None] * sxt + ks[None, :] * sxk
            l_ptrs = Lw + ks[:, None] * slk + offs_r[None, :] * slr
            if EVEN_K:
                xt = tl.load(x_ptrs)
                lt = tl.load(l_ptrs, mask=r_ok[None, :], other=0.0)
            else:
                k_ok = ks < D_IN
                xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                lt = tl.load(l_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            h = tl.dot(xt, lt, h, input_precision=DOT_PRECISION)

        tl.store(H + rows64[:, None] * sht + offs_r[None, :] * shr, h, mask=row_ok[:, None] & r_ok[None, :])
        a = _act(h, ACT).to(Y.dtype.element_ty)

        for n0 in range(0, D_OUT, BLOCK_N):
            ns = n0 + offs_n
            r_ptrs = Rw + offs_r[:, None] * srr + ns[None, :] * srn
            n_ok = ns < D_OUT
            if EVEN_N:
                rt = tl.load(r_ptrs, mask=r_ok[:, None], other=0.0)
            else:
                rt = tl.load(r_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, rt, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                if EVEN_N:
                    b = tl.load(Bias + ns)
                else:
                    b = tl.load(Bias + ns, mask=n_ok, other=0.0)
                acc += b.to(tl.float32)[None, :]
            y_ptrs = Y + rows64[:, None] * syt + ns[None, :] * syn
            if EVEN_N:  # (a row mask only: constant along the row, the stores stay vectorized)
                tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None])
            else:
                tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])

    @triton.autotune(configs=_CONFIGS, key=["D_IN", "D_OUT", "R_PAD", "T_BUCKET", "NEED_DX"])
    @triton.heuristics(_EVEN)
    @triton.jit
    def _bwd_kernel(
        DY, Rw, Lw, H, DH, DX, T, D_IN, D_OUT, RANK, DH_W, T_BUCKET,
        sdyt, sdyn, srr, srn, slk, slr, sht, shr, sdht, sdhr, sdxt, sdxk,
        ACT: tl.constexpr, NEED_DX: tl.constexpr, R_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < RANK
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = tl.arange(0, BLOCK_N)

        da = tl.zeros((BLOCK_T, R_PAD), dtype=tl.float32)
        for n0 in range(0, D_OUT, BLOCK_N):
            ns = n0 + offs_n
            dy_ptrs = DY + rows64[:, None] * sdyt + ns[None, :] * sdyn
            rt_ptrs = Rw + ns[:, None] * srn + offs_r[None, :] * srr  # Rᵀ tile [BLOCK_N, R_PAD]
            if EVEN_N:
                dyt = tl.load(dy_ptrs)
                rt = tl.load(rt_ptrs, mask=r_ok[None, :], other=0.0)
            else:
                n_ok = ns < D_OUT
                dyt = tl.load(dy_ptrs, mask=n_ok[None, :], other=0.0)
                rt = tl.load(rt_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            da = tl.dot(dyt, rt, da, input_precision=DOT_PRECISION)

        h = tl.load(H + rows64[:, None] * sht + offs_r[None, :] * shr, mask=r_ok[None, :], other=0.0)
        dh = (da * _dact(h, ACT)).to(DH.dtype.element_ty)  # 0 in the padding: da is 0 there
        tl.store(DH + rows64[:, None] * sdht + offs_r[None, :] * sdhr, dh,
                 mask=row_ok[:, None] & (offs_r < DH_W)[None, :])

        if NEED_DX:
            for k0 in range(0, D_IN, BLOCK_K):
                ks = k0 + offs_k
                lt_ptrs = Lw + offs_r[:, None] * slr + ks[None, :] * slk  # Lᵀ tile [R_PAD, BLOCK_K]
                k_ok = ks < D_IN
                if EVEN_K:
                    lt = tl.load(lt_ptrs, mask=r_ok[:, None], other=0.0)
                else:
                    lt = tl.load(lt_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                dx = tl.dot(dh, lt, input_precision=DOT_PRECISION).to(DX.dtype.element_ty)
                dx_ptrs = DX + rows64[:, None] * sdxt + ks[None, :] * sdxk
                if EVEN_K:
                    tl.store(dx_ptrs, dx, mask=row_ok[:, None])
                else:
                    tl.store(dx_ptrs, dx, mask=row_ok[:, None] & k_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Checks and the torch reference
# ---------------------------------------------------------------------------------------------


def _act_index(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: activation={activation!r} is not supported; valid values: {list(ACTIVATIONS)}")
    return ACTIVATIONS.index(activation)


def _check(x: torch.Tensor, L: torch.Tensor, R: torch.Tensor, bias: Optional[torch.Tensor], activation: str):
    """(T, d_in, r, d_out) after checking every argument (a clear error naming the bad one)."""
    _act_index(activation)
    if x.dim() < 1:
        raise ValueError(f"{OP}: x must have at least 1 dimension [..., d_in], got a 0-d tensor")
    if L.dim() != 2:
        raise ValueError(f"{OP}: L must be 2-D [d_in, r], got shape {tuple(L.shape)}")
    if R.dim() != 2:
        raise ValueError(f"{OP}: R must be 2-D [r, d_out], got shape {tuple(R.shape)}")
    d_in, r = L.shape
    d_out = R.shape[1]
    if x.shape[-1] != d_in:
        raise ValueError(f"{OP}: x has {x.shape[-1]} features (shape {tuple(x.shape)}) but L has shape "
                         f"{tuple(L.shape)}: expected L [d_in={x.shape[-1]}, r]")
    if R.shape[0] != r:
        raise ValueError(f"{OP}: R has shape {tuple(R.shape)}, expected [r={r}, d_out] (L is {tuple(L.shape)})")
    if r < 1:
        raise ValueError(f"{OP}: the rank r (L.shape[1]) must be >= 1, got {r}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != d_out):
        raise ValueError(f"{OP}: bias has shape {tuple(bias.shape)}, expected [d_out={d_out}]")
    for name, t in (("L", L), ("R", R), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"{OP}: {name} is {t.dtype} but x is {x.dtype}; all inputs must share one dtype "
                            "(lowrank_linear casts them to x's)")
        if t.device != x.device:
            raise ValueError(f"{OP}: {name} is on {t.device} but x is on {x.device}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{OP}: x must be a floating-point tensor, got {x.dtype}")
    return x.shape[:-1].numel(), d_in, r, d_out


def _act_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return F.relu(h)
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "silu":
        return F.silu(h)
    return h


def _dact_torch(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return (h > 0).to(h.dtype)
    if activation == "gelu":
        return 0.5 * (1.0 + torch.erf(h * _SQRT1_2)) + h * _INV_SQRT_2PI * torch.exp(-0.5 * h * h)
    if activation == "gelu_tanh":
        t = torch.tanh(_K0 * (h + _K1 * h * h * h))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _K0 * (1.0 + 3.0 * _K1 * h * h)
    if activation == "silu":
        s = torch.sigmoid(h)
        return s * (1.0 + h * (1.0 - s))
    return torch.ones_like(h)


def _ceil8(n: int) -> int:
    return (n + 7) // 8 * 8


def _r_pad(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())


def _forward_torch(x2, L, R, bias, activation):
    """Two matmuls: (y [T, d_out], h fp32 [T, r]), h rounded to the input dtype first."""
    h = (x2 @ L).float()
    a = _act_torch(h, activation).to(x2.dtype)
    y = torch.addmm(bias, a, R) if bias is not None else a @ R
    return y, h


def _weight_grads(x2, dy2, dh, h, activation, need_L, need_R, need_b):
    """(dL, dR, db), empty where not needed; ``dh`` [T, >= r] in the input dtype (zero past r).
    ``[dR; db] = [a, 1, 0...]ᵀ @ dy``: one GEMM reads dy for both, its rows padded to a multiple of 8."""
    T, r = h.shape
    dtype = x2.dtype
    dL = (x2.t() @ dh)[:, :r].contiguous() if need_L else x2.new_empty((0,))
    dR, db = x2.new_empty((0,)), x2.new_empty((0,))  # (distinct: a custom op's outputs may not alias)
    if need_R:
        a = _act_torch(h, activation).to(dtype)
        w = _ceil8(r + int(need_b))
        if w > r:
            a = F.pad(a, (0, w - r))
            if need_b:
                a[:, r] = 1
        res = a.t() @ dy2
        dR = res[:r] if w > r else res
        if need_b:
            db = res[r].clone()
    elif need_b:
        db = dy2.sum(0)
    return dL, dR, db


def _backward_torch(dy2, x2, L, R, h, activation, need_x, need_L, need_R, need_b):
    da = (dy2 @ R.t()).float()
    dh = (da * _dact_torch(h, activation)).to(x2.dtype)
    dx = dh @ L.t() if need_x else x2.new_empty((0,))
    return (dx, *_weight_grads(x2, dy2, dh, h, activation, need_L, need_R, need_b))


# ---------------------------------------------------------------------------------------------
# The Triton launches
# ---------------------------------------------------------------------------------------------


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else _NullGuard()


class _NullGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _forward_triton(x2, L, R, bias, activation):
    T, d_in = x2.shape
    r, d_out = R.shape
    y = x2.new_empty((T, d_out))
    h = torch.empty((T, r), device=x2.device, dtype=torch.float32)
    if T == 0:
        return y, h
    if bias is not None:
        bias = bias.contiguous()

    def grid(meta):
        return (triton.cdiv(T, meta["BLOCK_T"]),)

    with _device_guard(x2):
        _fwd_kernel[grid](
            x2, L, R, bias if bias is not None else y, y, h, T, d_in, d_out, r, triton.next_power_of_2(T),
            *x2.stride(), *L.stride(), *R.stride(), *y.stride(), *h.stride(),
            ACT=_act_index(activation), HAS_BIAS=bias is not None, R_PAD=_r_pad(r),
            DOT_PRECISION=dot_precision(x2.dtype))
    return y, h


def _backward_triton(dy2, x2, L, R, h, activation, need_x, need_L, need_R, need_b):
    T, d_in = x2.shape
    r, d_out = R.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if need_x else x2.new_empty((0,))
    w = _ceil8(r)
    dh = x2.new_empty((T, w))
    if T > 0 and (need_x or need_L):
        out = dx if need_x else dh  # (a placeholder pointer when NEED_DX is off)
        sx = out.stride() if need_x else (0, 0)

        def grid(meta):
            return (triton.cdiv(T, meta["BLOCK_T"]),)

        with _device_guard(x2):
            _bwd_kernel[grid](
                dy2, R, L, h, dh, out, T, d_in, d_out, r, w, triton.next_power_of_2(T),
                *dy2.stride(), *R.stride(), *L.stride(), *h.stride(), *dh.stride(), *sx,
                ACT=_act_index(activation), NEED_DX=need_x, R_PAD=_r_pad(r),
                DOT_PRECISION=dot_precision(x2.dtype))
    return (dx, *_weight_grads(x2, dy2, dh, h, activation, need_L, need_R, need_b))


def _run(name: str, triton_fn, torch_fn, x2: torch.Tensor, r: int, impl: str, *args):
    """The Triton path when dispatch allows it (see the module doc), else the torch reference."""
    if use_triton(x2, impl, op=OP):
        if r > MAX_RANK:
            if impl == "triton":
                raise ValueError(f"{OP}: impl='triton' supports ranks r <= {MAX_RANK}, got r={r} (use impl='torch')")
        elif impl == "triton" or not _BROKEN:
            try:
                return triton_fn(*args)
            except Exception as exc:  # a Triton build that cannot compile the kernel: stay correct, say so once
                if impl == "triton":
                    raise
                _BROKEN.append(f"{type(exc).__name__}: {exc}")
                logger.warning("%s: the Triton %s kernel failed (%s); using the torch reference from now on "
                               "(correct, slower)", OP, name, _BROKEN[0].splitlines()[0][:300])
    return torch_fn(*args)


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op(OP, mutates_args=())
def _lowrank_op(x: torch.Tensor, L: torch.Tensor, R: torch.Tensor, bias: Optional[torch.Tensor],
                activation: str, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., d_out] in x's dtype, h = x @ L [..., r] in fp32, pre-activation: what the backward needs)."""
    T, d_in, r, d_out = _check(x, L, R, bias, activation)
    lead = x.shape[:-1]
    x2 = x.reshape(T, d_in)
    y, h = _run("forward", _forward_triton, _forward_torch, x2, r, impl, x2, L, R, bias, activation)
    return y.reshape(*lead, d_out), h.reshape(*lead, r)


@_lowrank_op.register_fake
def _(x, L, R, bias, activation, impl):
    _, _, r, d_out = _check(x, L, R, bias, activation)
    return x.new_empty((*x.shape[:-1], d_out)), x.new_empty((*x.shape[:-1], r), dtype=torch.float32)


@torch.library.custom_op("comera::lowrank_linear_backward", mutates_args=())
def _lowrank_backward_op(dy: torch.Tensor, x: torch.Tensor, L: torch.Tensor, R: torch.Tensor, h: torch.Tensor,
                         activation: str, impl: str, need_x: bool, need_L: bool, need_R: bool,
                         need_b: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dL, dR, dbias); an output that is not needed comes back empty."""
    d_in, r = L.shape
    d_out = R.shape[1]
    T = x.shape[:-1].numel()
    x2, dy2, h2 = x.reshape(T, d_in), dy.reshape(T, d_out), h.reshape(T, r)
    dx, dL, dR, db = _run("backward", _backward_triton, _backward_torch, x2, r, impl,
                          dy2, x2, L, R, h2, activation, need_x, need_L, need_R, need_b)
    return dx.reshape(x.shape) if need_x else dx, dL, dR, db


@_lowrank_backward_op.register_fake
def _(dy, x, L, R, h, activation, impl, need_x, need_L, need_R, need_b):
    def empty():
        return x.new_empty((0,))

    return (x.new_empty(x.shape) if need_x else empty(), L.new_empty(L.shape) if need_L else empty(),
            R.new_empty(R.shape) if need_R else empty(), R.new_empty((R.shape[1],)) if need_b else empty())


def _setup_context(ctx, inputs, output):
    x, L, R, bias, activation, impl = inputs
    y, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, L, R, h)
    ctx.activation, ctx.impl, ctx.has_bias = activation, impl, bias is not None


def _backward(ctx, dy, _dh):
    x, L, R, h = ctx.saved_tensors
    need_x, need_L, need_R, need_b = ctx.needs_input_grad[:4]
    need_b = need_b and ctx.has_bias
    if dy is None or not (need_x or need_L or need_R or need_b):
        return (None,) * 6
    dx, dL, dR, db = _lowrank_backward_op(dy, x, L, R, h, ctx.activation, ctx.impl, need_x, need_L, need_R, need_b)
    return (dx if need_x else None, dL if need_L else None, dR if need_R else None, db if need_b else None,
            None, None)


_lowrank_op.register_autograd(_backward, setup_context=_setup_context)


def lowrank_linear(x: torch.Tensor, L: torch.Tensor, R: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   activation: Optional[str] = "identity", *, impl: str = "auto") -> torch.Tensor:
    """``act(x @ L) @ R + bias`` for ``x [..., d_in]``, ``L [d_in, r]``, ``R [r, d_out]``, ``bias [d_out]``;
    ``activation`` in :data:`ACTIVATIONS` (None: identity); ``impl`` "auto" | "triton" | "torch" (see the
    module doc). L, R and bias are cast to x's dtype (a differentiable cast) when they differ."""
    activation = "identity" if activation is None else activation
    L, R = L.to(x.dtype), R.to(x.dtype)
    bias = bias.to(x.dtype) if bias is not None else None
    _check(x, L, R, bias, activation)
    y, _ = torch.ops.comera.lowrank_linear(x, L, R, bias, activation, impl)
    return y
