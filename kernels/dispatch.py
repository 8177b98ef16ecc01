"""One rule, shared by every op, for when a Triton kernel runs and at which precision.

* ``use_triton(t, impl, op=...)``: ``impl="torch"`` never; ``impl="triton"`` always (CUDA tensors,
  or the Triton interpreter with ``TRITON_INTERPRET=1``; anything else raises, naming the op);
  ``impl="auto"`` for CUDA tensors of a Triton dtype (fp16, bf16, fp32), and under the
  interpreter only when ``COMERA_FORCE_TRITON=1`` asks for it (the interpreter is slow: CPU runs
  take the torch reference unless a test wants the kernels).
* ``dot_precision(dtype)``: the one precision rule of the kernels: every ``tl.dot`` takes
  ``input_precision=dot_precision(dtype)`` for the op's inputs of ``dtype`` (a dot without the
  argument would run fp32 operands in TF32 whatever torch is set to). It matches what torch does
  for the same product: fp32 inputs use TF32 exactly when ``torch.backends.cuda.matmul.allow_tf32``
  is set (``torch.set_float32_matmul_precision("high")``), otherwise IEEE fp32. fp16/bf16 inputs
  are multiplied in their own type with fp32 accumulation (the argument does not apply); a dot of
  fp32 operands formed from them (the one-hot term of the sparse dW) runs in TF32, which holds
  fp16 and bf16 values exactly.
"""

from __future__ import annotations

import os

import torch

from comera_compile.devices import IMPLS  # the valid impl= values, one list for every op

try:  # Triton is optional on CPU-only installs.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "IMPLS", "TRITON_DTYPES", "dot_precision", "env_number", "interpreting", "use_triton"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def env_number(name: str, default: float, meaning: str, cast=float) -> float:
    """The number >= 0 in the environment variable ``name`` (``cast`` of its text), else ``default`` where it
    is unset or blank; any other value raises ``ValueError`` naming the variable, with ``meaning``."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = cast(text)
    except ValueError:
        value = -1
    if not value >= 0:
        raise ValueError(f"{name}={text!r}: expected a number >= 0 ({meaning})")
    return value


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor, impl: str = "auto", *, op: str = "comera op") -> bool:
    """Whether ``op`` runs its Triton kernels on ``t`` (see the module doc)."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r}; valid values: {list(IMPLS)}")
    if impl == "torch":
        return False
    if impl == "triton":
        if not HAS_TRITON or not (t.is_cuda or interpreting()):
            raise RuntimeError(f"{op}: impl='triton' needs CUDA tensors or TRITON_INTERPRET=1")
        if t.dtype not in TRITON_DTYPES:
            raise TypeError(f"{op}: impl='triton' supports fp32/fp16/bf16, not {t.dtype} (use impl='torch')")
        return True
    if not HAS_TRITON or t.dtype not in TRITON_DTYPES:
        return False
    return t.is_cuda or (interpreting() and os.environ.get("COMERA_FORCE_TRITON") == "1")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for an op's inputs of ``dtype``: "ieee" for fp32 unless torch
    allows TF32 for fp32 matmuls, else "tf32" (see the module doc)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
