"""torchtitan's trainer (``torchtitan.train.main``) with this folder's config functions importable.

    torchrun --nproc_per_node 1 launch.py --module comera_configs --config llama3_2048_comera [overrides]
    torchrun --nproc_per_node 1 launch.py --cpu --module comera_configs --config llama3_tiny_comera

``--cpu``: run torchtitan 0.3.0 on the CPU (gloo) for a smoke test. torchtitan picks its device once at
import (``torch._utils._get_available_device_type() or "cuda"``) and reads memory statistics from the
device module, which ``torch.cpu`` lacks; this flag makes that device "cpu" and gives ``torch.cpu``
the few statistics functions torchtitan calls (zeros); and FSDP2 reduces gradients with plain sums
(gloo has no ``PREMUL_SUM``, which FSDP2 uses once torchtitan sets the divide factor to 1). Nothing
changes for a GPU run.

``--offline-stubs``: where ``datasets`` or ``tensorboard`` is not installed (a GPU machine without a
registry, where their wheels and pyarrow/pandas would not fit), stand-ins named after them let torchtitan
import; this folder's configs use synthetic data and no tensorboard, so nothing calls them, and a call
raises ``RuntimeError`` naming the missing package. An installed package is always used as it is.

``--timing-lines``: after each of torchtitan's step logs, one more line, ``launch.py timing: step N
end_to_end_s X data_loading_s Y``: the mean seconds per step since the last log and the mean seconds
of it spent waiting for the data loader (torchtitan measures both and hands them only to tensorboard
or wandb); ``summarize.py`` reads them.

``--profile-steps A:B``: torch's profiler around training steps A to B-1 (counted from 1), then a table of
the ops by their own device time (CPU time on the CPU), the kernels launched per step, and the step's
host and device seconds, printed after ``launch.py profile:``. With ``--profile-python`` as well, the
profiler also records Python functions, and a second table, printed after ``launch.py host:``, lists the
ops and Python functions by their own host time: where a host-bound step spends it.

Always: torchtitan 0.3.0 calls ``torch.distributed.set_timeout``, which torch 2.13.0 lacks; where it is
missing it is defined from torch's ``_set_pg_timeout`` (:func:`_set_timeout_shim`).
"""

from __future__ import annotations

import os
import sys
import types
from typing import Callable

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


def _gloo_sum_reductions() -> None:
    """torchtitan turns FSDP2's gradient division off (``set_gradient_divide_factor(1.0)``), after which
    FSDP2 reduces with ``ReduceOp.PREMUL_SUM``, which gloo refuses at world size > 1; FSDP2's public
    ``set_force_sum_reduction_for_comms(True)`` makes the same reduction a plain sum."""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    divide_off = titan_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model):
        divide_off(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _missing(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is None


def _stub(name: str, package: str, **attrs) -> types.ModuleType:
    """A module ``name`` whose attributes ``attrs`` raise when called (classes too, when instantiated)."""
    module = types.ModuleType(name)
    module.__file__ = f"<offline stub for {package}>"
    module.__path__ = []  # a package, so that its submodules can be stubbed too

    def refuse(what):
        def call(*args, **kwargs):
            raise RuntimeError(f"{name}.{what}: {package} is not installed (launch.py --offline-stubs stands in for "
                               f"it); install {package} to use this")
        return call

    for attr, kind in attrs.items():
        setattr(module, attr, type(attr, (), {"__init__": refuse(attr)}) if kind == "class" else refuse(attr))
    sys.modules[name] = module
    return module


def _offline_stubs(missing: Callable[[str], bool] = _missing) -> list[str]:
    """Stand-ins for ``datasets`` and ``torch.utils.tensorboard`` where the packages are missing (by
    ``missing(package)``); returns the names stubbed."""
    stubbed = []
    if missing("datasets"):
        _stub("datasets", "datasets", Dataset="class", IterableDataset="class", load_dataset="function",
              interleave_datasets="function")
        _stub("datasets.distributed", "datasets", split_dataset_by_node="function")
        stubbed.append("datasets")
    if missing("tensorboard"):
        _stub("torch.utils.tensorboard", "tensorboard", SummaryWriter="class")
        stubbed.append("tensorboard")
    return stubbed


def _set_timeout_shim() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` after the first step (``set_pg_timeouts``),
    which torch 2.13.0 does not have (AttributeError); torch's private ``_set_pg_timeout`` does the same."""
    import torch.distributed as dist

    if dist.is_available() and not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


def _fsdp_mesh_dims_shim() -> None:
    """torchtitan 0.3.0 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12) at import, and uses
    it only under ``parallelism.spmd_backend="full_dtensor"``; on an older torch a stand-in that refuses to be
    built lets it import (the configs here use the default backend)."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:  # noqa: N801 - torch's name
            def __init__(self, *args, **kwargs):
                raise RuntimeError("DataParallelMeshDims needs torch >= 2.12 (spmd_backend='full_dtensor'); "
                                   f"this torch is {__import__('torch').__version__}")

        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _timing_lines() -> None:
    """Print torchtitan's per-log step time and data-loading time (see the module's docstring)."""
    from torchtitan.components.metrics import BaseLogger, MetricsProcessor

    class TimingLines(BaseLogger):
        def __init__(self, inner: BaseLogger):
            self.inner = inner

        def log(self, metrics, step):
            e2e, data = metrics.get("time_metrics/end_to_end(s)"), metrics.get("time_metrics/data_loading(s)")
            if e2e is not None and data is not None:
                print(f"launch.py timing: step {step} end_to_end_s {e2e:.6f} data_loading_s {data:.6f}", flush=True)
            self.inner.log(metrics, step)

        def close(self):
            self.inner.close()

    build = MetricsProcessor._build_metric_logger

    def _build_metric_logger(self, *args, **kwargs):
        return TimingLines(build(self, *args, **kwargs))

    MetricsProcessor._build_metric_logger = _build_metric_logger


def _device_events(events) -> list:
    """The device events of a profile's ``key_averages()`` (kernels, copies, sets), without the user
    annotations on the device timeline ("Optimizer.step#AdamW.step", "FSDP::pre_backward (...)"): each
    spans kernels that are counted already (torch's own table totals leave them out too)."""
    import torch

    return [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


def _device_totals(events) -> tuple[float, int]:
    """The device time (us) and the number of device events (:func:`_device_events`): with the annotations, a
    step's busy time would count their kernels twice."""
    device = _device_events(events)
    return sum(getattr(e, "self_device_time_total", 0) for e in device), sum(e.count for e in device)


def _kernels_by_count(events, steps: int, top: int = 40) -> list[str]:
    """The ``top`` device events by launches per step: launches, microseconds a launch, milliseconds a step
    and the whole name (where a step's extra kernels come from)."""
    rows = sorted(_device_events(events), key=lambda e: (-e.count, e.key))[:top]
    return [f"{e.count / steps:7.1f} x {e.self_device_time_total / max(e.count, 1):8.1f} us = "
            f"{e.self_device_time_total / 1e3 / steps:7.2f} ms  {e.key}" for e in rows]


def _with_python_functions(prof):
    """``prof.key_averages()`` with the Python function events of ``with_stack=True`` in it: torch 2.14
    leaves them out unless ``include_python_functions=True`` (an argument earlier releases lack, where they
    are always in)."""
    import inspect

    if "include_python_functions" in inspect.signature(prof.key_averages).parameters:
        return prof.key_averages(include_python_functions=True)
    return prof.key_averages()


def _profile_steps(first: int, end: int, python: bool = False) -> None:
    """Profile training steps ``first`` .. ``end - 1`` (see the module's docstring)."""
    import time

    import torch
    from torchtitan.trainer import Trainer

    if not 1 <= first < end:
        raise SystemExit(f"launch.py --profile-steps {first}:{end}: needs 1 <= A < B")
    step_fn = Trainer.train_step
    state = {"step": 0, "prof": None, "t0": 0.0}

    def train_step(self, *args, **kwargs):
        state["step"] += 1
        if state["step"] == first:
            cuda = torch.cuda.is_available()
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            if cuda:
                torch.cuda.synchronize()
            extra = {}
            if python:  # Python functions as events of their own (their self time is the host's work in them)
                extra = dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True))
            state["prof"] = torch.profiler.profile(activities=activities, **extra)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        out = step_fn(self, *args, **kwargs)
        if state["step"] == end - 1 and state["prof"] is not None:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - state["t0"]) / (end - first)
            prof, state["prof"] = state["prof"], None
            prof.__exit__(None, None, None)
            events = prof.key_averages()
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            device_us, kernels = _device_totals(events)
            print(f"launch.py profile: steps {first}-{end - 1}: {wall * 1e3:.1f} ms per step (host wall), "
                  f"device busy {device_us / 1e3 / (end - first):.1f} ms per step, "
                  f"{kernels / (end - first):.0f} kernels per step", flush=True)
            for line in events.table(sort_by=sort, row_limit=30).splitlines():
                print(f"launch.py profile: {line}", flush=True)
            if cuda:
                for line in _kernels_by_count(events, end - first):
                    print(f"launch.py kernels: {line}", flush=True)
            if python:
                for line in _with_python_functions(prof).table(sort_by="self_cpu_time_total", row_limit=60,
                                                               max_name_column_width=90
                                         ).splitlines():
                    print(f"launch.py host: {line}", flush=True)
        return out

    Trainer.train_step = train_step


def main(argv: list[str]) -> None:
    _set_timeout_shim()
    _fsdp_mesh_dims_shim()
    cpu = "--cpu" in argv
    if cpu:
        argv.remove("--cpu")
        _cpu_device()
    if "--offline-stubs" in argv:
        argv.remove("--offline-stubs")
        stubbed = _offline_stubs()
        if stubbed:
            print(f"launch.py: offline stand-ins for {', '.join(stubbed)} (not installed; never called here)",
                  flush=True)
    timing = "--timing-lines" in argv
    if timing:
        argv.remove("--timing-lines")
    profile = None
    if "--profile-steps" in argv:
        i = argv.index("--profile-steps")
        try:
            profile = tuple(int(v) for v in argv[i + 1].split(":"))
            assert len(profile) == 2
        except (IndexError, ValueError, AssertionError):
            raise SystemExit("launch.py --profile-steps takes A:B (profile steps A to B-1), e.g. 20:25") from None
        del argv[i:i + 2]
    python = "--profile-python" in argv
    if python:
        if not profile:
            raise SystemExit("launch.py --profile-python needs --profile-steps A:B")
        argv.remove("--profile-python")
    sys.path.insert(0, HERE)
    sys.argv = [sys.argv[0], *argv]
    if cpu:
        _gloo_sum_reductions()
    if timing:
        _timing_lines()
    if profile:
        _profile_steps(*profile, python=python)
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main(sys.argv[1:])
