"""Helpers of the distributed tests: a free local TCP port for a process group's rendezvous,
``mp.spawn`` that runs its workers again once when one of them died of SIGABRT, and the results its
workers saved."""

import socket
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, args_after_port: tuple, nprocs: int) -> None:
    """``mp.spawn(worker, args=(port, *args_after_port))`` on a fresh port. On the CPU, a gloo worker
    of the FSDP2 tests has died of SIGABRT ("terminate called without an active exception", from a
    C++ thread inside torch) about once in five full CI runs, never in 56 runs of those tests alone;
    such a run is repeated once, with a warning. Every assertion is made on a run that completed: a
    failure of any other kind, or a second abort, fails the test."""
    try:
        mp.spawn(worker, args=(free_port(), *args_after_port), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as exc:
        if exc.signal_name != "SIGABRT":
            raise
        warnings.warn(f"a worker died of SIGABRT ({exc}); running the workers once more", RuntimeWarning)
        mp.spawn(worker, args=(free_port(), *args_after_port), nprocs=nprocs, join=True)


def spawn_results(worker, out: Path, nprocs: int) -> list:
    """:func:`spawn` of ``worker(rank, port, str(out))``, then what each rank saved as ``out/rank<r>.pt``."""
    spawn(worker, (str(out),), nprocs)
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
