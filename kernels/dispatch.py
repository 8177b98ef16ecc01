"""One rule, shared by every op, for when a Triton kernel runs and at which precision.

* ``use_triton(t, impl, op=...)``: ``impl="torch"`` never; ``impl="triton"`` always (CUDA tensors,
  or the Triton interpreter with ``TRITON_INTERPRET=1``; anything else raises, naming the op);
  ``impl="auto"`` for CUDA tensors of a Triton dtype (fp16, bf16, fp32), and under the
  interpreter only when ``COMERA_FORCE_TRITON=1`` asks for it (the interpreter is slow: CPU runs
  take the torch reference unless a test wants the kernels).
* ``dot_precision(dtype)``: the ``tl.dot`` precision that matches what torch does for the same
  product: fp32 inputs use TF32 exactly when ``torch.backends.cuda.matmul.allow_tf32`` is set
  (``torch.set_float32_matmul_precision("high")``), otherwise IEEE fp32; fp16/bf16 inputs are
  multiplied in their own type with fp32 accumulation (the argument does not apply to them).
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional on CPU-only installs.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "IMPLS", "TRITON_DTYPES", "dot_precision", "interpreting", "use_triton"]

IMPLS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype`` (see the module doc)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
