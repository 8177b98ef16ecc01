"""Compile the package's Triton kernels for a compiled graph's shapes in another process, while Inductor
compiles the graph.

Triton compiles a kernel at its first call for the argument types and shapes it sees (about 3 s for the
fused loss's forward and backward kernels on an H200), which a compiled model would pay at its first
step after Inductor is done. When the ``cce`` pass fuses a head on the GPU, :func:`schedule` starts a
Python process that calls the fused loss forward and backward once on random tensors of the graph's
shapes, strides and dtypes, on the same device and with the same Triton cache folder (where
``TRITON_CACHE_DIR`` is unset, the process gets the folder Inductor sets for this one at its first
kernel; this process's environment is not changed). Its compiled
kernels land in that cache; the model's first call then finds them there instead of compiling them.
Nothing else is shared: the process's values are thrown away, a failure in it is only logged when the
package's logger is at DEBUG, and a kernel it did not reach in time is compiled at the first call as
before. A job ends itself after ``JOB_TIMEOUT_S``; under an interpreter embedded in a host that is no
``python`` binary, none is started. ``options={"precompile": False}`` turns it off.

The process holds its own CUDA context and the job's tensors (at most ``MAX_JOB_BYTES``; a head whose
tensors and gradients take more is left to its first call) for a few seconds; it is started only where
the device has four times that free and 2 GiB more.

Which jobs were started, and which are still running, is held by a :class:`Scheduler`; :func:`schedule`
hands the job to the current one: the process's default, or the one of the innermost
:func:`use_scheduler` block (a scheduler the caller owns, e.g. a fresh one per test).

``python -m comera_compile.kernels.precompile`` is the process: it reads one job (JSON) from stdin.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import os
import signal
import subprocess
import sys
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch

from comera_compile._scope import scoped

MAX_JOB_BYTES = 1 << 30
JOB_TIMEOUT_S = 300


def tensor_spec(t: Optional[torch.Tensor], requires_grad: bool) -> Optional[dict]:
    """One tensor of a job (shape, strides, dtype, whether the job's backward needs its gradient); None for an
    absent one. A symbolic size raises ValueError: such a call has no concrete job."""
    if t is None:
        return None
    sizes = (*t.shape, *t.stride())
    if not all(isinstance(v, int) for v in sizes):  # symbolic: no concrete job
        raise ValueError("symbolic size")
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).rpartition(".")[2],
            "requires_grad": bool(requires_grad)}


def _extent(spec: dict) -> int:
    """Elements of the storage a tensor of ``spec``'s shape and strides spans."""
    return 1 + sum((n - 1) * s for n, s in zip(spec["shape"], spec["stride"]))


def _bytes(spec: Optional[dict]) -> int:
    if spec is None:
        return 0
    return _extent(spec) * getattr(torch, spec["dtype"]).itemsize * (2 if spec["requires_grad"] else 1)


def lce_job(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
            op_args: Sequence[Any], needs: Sequence[bool]) -> Optional[dict]:
    """The job for ``comera::linear_cross_entropy`` called with tensors like these (fakes will do) and
    ``op_args`` (``LCEOptions.op_args()``), with gradients for ``needs`` (x, weight, bias); None where
    there is nothing to precompile (not CUDA, symbolic sizes, or more than ``MAX_JOB_BYTES``)."""
    from comera_compile.kernels.dispatch import HAS_TRITON, TRITON_DTYPES, interpreting
    from comera_compile.cce import LCEOptions

    if x.device.type != "cuda" or not HAS_TRITON or interpreting() or x.dtype not in TRITON_DTYPES:
        return None
    if LCEOptions.from_op_args(tuple(op_args)).impl == "torch":  # no kernel to compile
        return None
    try:
        tensors = [tensor_spec(x, needs[0]), tensor_spec(weight, needs[1]), tensor_spec(target, False),
                   tensor_spec(bias, needs[2])]
    except ValueError:
        return None
    # the inputs, their gradients, and the loss's working memory (its budget, at most 1/16 of fp32 logits)
    working = x.shape[0] * weight.shape[0] * 4 // 16
    need = sum(_bytes(s) for s in tensors) + working
    if need > MAX_JOB_BYTES:
        return None
    if not _room_for(need, x.device):
        return None
    return {"op": "linear_cross_entropy", "device": x.device.index if x.device.index is not None else
            torch.cuda.current_device(), "tensors": tensors, "args": list(op_args),
            # the kernels' dot precision for fp32 follows this setting (a constexpr of their cache key)
            "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}


def _room_for(need: int, device: torch.device) -> bool:
    """Whether the device has room for a job of ``need`` bytes (plus its process's CUDA context) with
    room to spare for this process's first step: free memory at least 4x the job and 2 GiB."""
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA here (fake tensors of a CPU run)
        return False
    return free >= 4 * need + (2 << 30)


class Scheduler:
    """The jobs started and the processes still running: ``scheduled`` (each job's key; a job already
    started is not started again) and ``running`` (the ``subprocess.Popen`` of each job not yet seen
    to finish). :func:`schedule` uses the process's default scheduler; :func:`use_scheduler` swaps in
    another for a block. A process still running when this process exits is stopped, whichever
    scheduler started it."""

    def __init__(self) -> None:
        self.scheduled: set[str] = set()
        self.running: list[subprocess.Popen] = []
        _SCHEDULERS.add(self)

    def schedule(self, job: Optional[dict]) -> bool:
        """Start the process for ``job`` unless this scheduler started one for the same job already;
        returns whether it started one."""
        if job is None:
            return False
        if not os.path.basename(sys.executable or "").startswith("python"):
            return False  # an embedding host (uwsgi, an app binary): no interpreter to start
        key = json.dumps(job, sort_keys=True)
        if key in self.scheduled:
            return False
        self.scheduled.add(key)
        self.reap()
        env = dict(os.environ)
        if env.get("TRITON_CACHE_DIR") is None:
            # the job's process writes where this one's kernels will look: the folder Inductor sets for this
            # process when it loads its first kernel (this process's environment is left as it is)
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

            env["TRITON_CACHE_DIR"] = triton_cache_dir(job["device"])
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "comera_compile.kernels.precompile"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            proc.stdin.write(key.encode())
            proc.stdin.close()
        except OSError as err:  # no process: the kernels compile at their first call, as without this
            from comera_compile._logging import logger

            logger.debug("comera: kernel precompile not started: %s", err)
            return False
        self.running.append(proc)
        return True

    def reap(self) -> None:
        """Forget finished jobs (one that failed is logged at DEBUG: its kernels compile at their first
        call)."""
        codes = [(proc, proc.poll()) for proc in self.running]
        for _, code in codes:
            if code not in (None, 0):
                from comera_compile._logging import logger

                logger.debug("comera: a kernel precompile job exited with status %s", code)
        self.running[:] = [proc for proc, code in codes if code is None]

    def stop(self) -> None:
        """Stop every job still compiling (a kernel cache entry is written whole or not at all)."""
        for proc in self.running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


_SCHEDULERS: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()
_SCHEDULER: contextvars.ContextVar[Scheduler] = contextvars.ContextVar("comera_precompile_scheduler",
                                                                       default=Scheduler())


def current_scheduler() -> Scheduler:
    """The :class:`Scheduler` that :func:`schedule` uses now: the default, or the one of the innermost
    :func:`use_scheduler` block."""
    return _SCHEDULER.get()


@contextlib.contextmanager
def use_scheduler(scheduler: Optional[Scheduler] = None) -> Iterator[Scheduler]:
    """Within the block, :func:`schedule` uses ``scheduler`` (a new :class:`Scheduler` when None), which
    it yields; on exit the previous one is back. A context variable: it holds for this thread (and
    context) only. Its processes are left running on exit (call its ``stop()`` to end them)."""
    with scoped(_SCHEDULER, Scheduler() if scheduler is None else scheduler) as current:
        yield current


def schedule(job: Optional[dict]) -> bool:
    """Start the process for ``job`` unless the current scheduler (:func:`current_scheduler`) started one
    for the same job already; returns whether it started one."""
    return current_scheduler().schedule(job)


@atexit.register
def _stop() -> None:
    """A job still compiling when this process ends is stopped (a kernel cache entry is written whole
    or not at all)."""
    for scheduler in list(_SCHEDULERS):
        scheduler.stop()


def _make(spec: Optional[dict], device: torch.device, high: int, gen: torch.Generator) -> Optional[torch.Tensor]:
    if spec is None:
        return None
    dtype, extent = getattr(torch, spec["dtype"]), _extent(spec)
    if dtype.is_floating_point:
        flat = torch.randn(extent, device=device, dtype=dtype, generator=gen)
    else:
        flat = torch.randint(0, high, (extent,), device=device, dtype=dtype, generator=gen)
    t = flat.as_strided(spec["shape"], spec["stride"])
    return t.requires_grad_() if spec["requires_grad"] else t


def run_job(job: dict) -> None:
    """Call the job's op forward and backward once (what compiles its kernels)."""
    import comera_compile.kernels.linear_cross_entropy  # noqa: F401  (defines the op)

    if job["op"] != "linear_cross_entropy":
        raise ValueError(f"unknown precompile job {job['op']!r}")
    device = torch.device("cuda", job["device"]) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = bool(job.get("allow_tf32", False))
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = job["tensors"][1]["shape"][0]
    x, weight, target, bias = (_make(s, device, vocab, gen) for s in job["tensors"])
    with torch.enable_grad():
        out = torch.ops.comera.linear_cross_entropy(x, weight, target, bias, *job["args"])
        leaves = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
        if leaves:
            torch.autograd.grad(out[0], leaves)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    if hasattr(signal, "alarm"):  # a job that hangs ends itself (its GPU memory with it)
        signal.alarm(JOB_TIMEOUT_S)
    run_job(json.loads(sys.stdin.read()))
