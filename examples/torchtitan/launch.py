"""torchtitan's trainer (``torchtitan.train.main``) with this folder's config functions importable.

    torchrun --nproc_per_node 1 launch.py --module comera_configs --config llama3_2048_comera [overrides]
    torchrun --nproc_per_node 1 launch.py --cpu --module comera_configs --config llama3_tiny_comera

``--cpu``: run torchtitan 0.3.0 on the CPU (gloo) for a smoke test. torchtitan picks its device once at
import (``torch._utils._get_available_device_type() or "cuda"``) and reads memory statistics from the
device module, which ``torch.cpu`` lacks; this flag makes that device "cpu" and gives ``torch.cpu``
the few statistics functions torchtitan calls (zeros). Nothing changes for a GPU run.

Always: torchtitan 0.3.0 calls ``torch.distributed.set_timeout``, which torch 2.13.0 lacks; where it is
missing it is defined from torch's ``_set_pg_timeout`` (:func:`_set_timeout_shim`).
"""

from __future__ import annotations

import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_device() -> None:
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    props = types.SimpleNamespace(total_memory=1, name="cpu")
    for name, fn in {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: props,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {"active_bytes.all.peak": 0, "reserved_bytes.all.peak": 0,
                                          "num_alloc_retries": 0, "num_ooms": 0},
        "set_device": lambda *a, **k: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
    }.items():
        if not hasattr(cpu, name) or name in ("current_device", "get_device_properties", "memory_stats",
                                              "device_count"):
            setattr(cpu, name, fn)


def _set_timeout_shim() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` after the first step (``set_pg_timeouts``),
    which torch 2.13.0 does not have (AttributeError); torch's private ``_set_pg_timeout`` does the same."""
    import torch.distributed as dist

    if dist.is_available() and not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


def main(argv: list[str]) -> None:
    _set_timeout_shim()
    if "--cpu" in argv:
        argv.remove("--cpu")
        _cpu_device()
    sys.path.insert(0, HERE)
    sys.argv = [sys.argv[0], *argv]
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main(sys.argv[1:])
