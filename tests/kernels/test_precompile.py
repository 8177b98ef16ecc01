"""``options={"precompile": ...}``: the fused loss's Triton kernels compiled for the graph's shapes in another
process while Inductor compiles. On this CPU machine no job is ever started by a compile (not CUDA); the
job's description (from fake CUDA tensors), its limits, the child process's run of a job (on the CPU
here: the op forward and backward through its torch path), and the pass's hand-off are tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import comera_compile as cc
from comera_compile.kernels import precompile
from comera_compile.cce import LCEOptions
from comera_compile.options import OptionsError


@pytest.fixture
def gpu_like(monkeypatch):
    """As on a GPU machine with compiled Triton (no interpreter) and 80 GiB free."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("comera_compile.kernels.dispatch.HAS_TRITON", True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 141 << 30))


def _fakes(n=64, d=32, v=1000, w_transposed=False, dtype=torch.bfloat16):
    with FakeTensorMode():
        x = torch.empty(n, d, device="cuda", dtype=dtype)
        w = torch.empty(d, v, device="cuda", dtype=dtype).t() if w_transposed else torch.empty(v, d, device="cuda",
                                                                                             dtype=dtype)
        t = torch.empty(n, device="cuda", dtype=torch.long)
    return x, w, t


def test_a_job_describes_the_op_call_exactly(gpu_like):
    """Shapes, strides (a transposed weight's too), dtypes, which inputs take gradients, the op's
    arguments, and the fp32 dot-precision setting the kernels' cache key depends on."""
    x, w, t = _fakes(w_transposed=True)
    args = LCEOptions(strategy="fused", need_dx=True, need_dw=True, filter_eps=2.0 ** -12).op_args()
    job = precompile.lce_job(x, w, t, None, args, (True, True, False))
    assert job["op"] == "linear_cross_entropy" and job["device"] == 0
    assert job["tensors"][0] == {"shape": [64, 32], "stride": [32, 1], "dtype": "bfloat16", "requires_grad": True}
    assert job["tensors"][1] == {"shape": [1000, 32], "stride": [1, 1000], "dtype": "bfloat16", "requires_grad": True}
    assert job["tensors"][2] == {"shape": [64], "stride": [1], "dtype": "int64", "requires_grad": False}
    assert job["tensors"][3] is None
    assert job["args"] == list(args) and job["allow_tf32"] == torch.backends.cuda.matmul.allow_tf32
    json.dumps(job)  # what goes to the process


def test_no_job_where_no_kernel_would_compile(gpu_like, monkeypatch):
    args = LCEOptions(filter_eps=0.0).op_args()
    x, w, t = _fakes()
    cpu = torch.zeros(4, 32), torch.zeros(10, 32), torch.zeros(4, dtype=torch.long)
    assert precompile.lce_job(*cpu, None, args, (True, True, False)) is None  # not CUDA
    assert precompile.lce_job(x, w, t, None, LCEOptions(impl="torch", filter_eps=0.0).op_args(), (True, True, False)) is None
    big = _fakes(n=8192, d=4096, v=128256)
    assert precompile.lce_job(*big, None, args, (True, True, False)) is None  # over MAX_JOB_BYTES
    x64 = _fakes(dtype=torch.float64)
    assert precompile.lce_job(*x64, None, args, (True, True, False)) is None  # no Triton dtype
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 << 29, 141 << 30))
    assert precompile.lce_job(x, w, t, None, args, (True, True, False)) is not None  # a small job fits in 2.5 GiB
    mid = _fakes(n=8192, d=1024, v=32000)  # ~230 MB with gradients and working memory: 4x + 2 GiB > 2.5 GiB
    assert precompile.lce_job(*mid, None, args, (True, True, False)) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert precompile.lce_job(x, w, t, None, args, (True, True, False)) is None  # the interpreter compiles nothing


def _cpu_job(**options):
    x, w, t = torch.zeros(16, 8), torch.zeros(8, 50).t(), torch.zeros(16, dtype=torch.long)
    spec = {"op": "linear_cross_entropy", "device": 0, "allow_tf32": False,
            "args": list(LCEOptions(filter_eps=0.0, **options).op_args()),
            "tensors": [precompile.tensor_spec(x, True), precompile.tensor_spec(w, True),
                        precompile.tensor_spec(t, False), None]}
    return spec


def test_the_process_runs_a_job_forward_and_backward(monkeypatch, tmp_path):
    """The child process end to end (here on the CPU, where the op takes its torch path): it reads the job
    from stdin, calls the op and its backward, exits 0; a second identical job is not started again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    job = _cpu_job(need_dx=True, need_dw=True, strategy="chunked")
    with precompile.use_scheduler() as scheduler:
        assert precompile.schedule(job)
        proc = scheduler.running[-1]
        assert proc.wait(timeout=300) == 0
        assert not precompile.schedule(job)
        assert not precompile.schedule(None)


def test_scheduling_changes_no_environment_variable_of_this_process(monkeypatch):
    """The job's process gets the Triton cache folder Inductor uses for this one; this process's own
    environment stays as it was (no process-wide writes)."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    started = []

    class _Proc:
        stdin = type("S", (), {"write": lambda self, b: None, "close": lambda self: None})()

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(k["env"]) or _Proc())
    before = dict(os.environ)
    with precompile.use_scheduler():  # its own scheduler: the stand-in process is not left in the default's
        assert precompile.schedule(_cpu_job())
    assert dict(os.environ) == before
    assert started[0]["TRITON_CACHE_DIR"] == triton_cache_dir(0)


def test_no_process_where_the_interpreter_is_embedded(monkeypatch):
    """Under a host binary that is no Python (uwsgi, an app), nothing is started."""
    monkeypatch.setattr(sys, "executable", "/usr/bin/uwsgi")
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with precompile.use_scheduler():
        assert not precompile.schedule(_cpu_job())
    assert started == []


def test_run_job_calls_the_backward():
    """run_job reaches the op's backward (whose kernels are half of what it compiles): the backward
    records its path, and only when the job's inputs take gradients."""
    from comera_compile.cce import record_cce_stats

    with record_cce_stats() as stats:
        precompile.run_job(_cpu_job(strategy="static"))
    assert [s.phase for s in stats] == ["forward", "backward"]
    job = _cpu_job(strategy="static")
    for spec in job["tensors"][:2]:
        spec["requires_grad"] = False
    with record_cce_stats() as stats:
        precompile.run_job(job)
    assert [s.phase for s in stats] == ["forward"]


def test_a_bad_job_fails_in_the_process_not_here():
    bad = json.dumps({"op": "nothing", "device": 0, "tensors": [], "args": []})
    proc = subprocess.run([sys.executable, "-m", "comera_compile.kernels.precompile"], input=bad, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode != 0 and "unknown precompile job 'nothing'" in proc.stderr


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 300, bias=False)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.tanh(self.body(x))), y)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cce_pass_hands_its_fused_heads_to_precompile(monkeypatch, enabled):
    """Each fused head's call (its fakes and arguments) goes to lce_job and the job to schedule, unless
    precompile=False; the compiled values are eager's either way."""
    seen, scheduled = [], []

    def job(x, w, t, b, args, needs):
        seen.append((tuple(x.shape), tuple(w.shape), tuple(t.shape), b, tuple(args), tuple(needs)))
        return {"op": "test"}

    monkeypatch.setattr(precompile, "lce_job", job)
    monkeypatch.setattr(precompile, "schedule", lambda j: scheduled.append(j) or True)
    torch.manual_seed(0)
    model = _Head()
    x, y = torch.randn(12, 16), torch.randint(0, 300, (12,))
    options = {"cce_min_vocab": 0, "inner": "aot_eager", "precompile": enabled}
    compiled = torch.compile(model, backend="comera", options=options)
    torch.testing.assert_close(compiled(x, y), model(x, y))
    if enabled:
        assert len(seen) == 1 and scheduled == [{"op": "test"}]
        (xs, ws, ts, b, args, needs) = seen[0]
        assert xs == (12, 16) and ws == (300, 16) and ts == (12,) and b is None
        assert needs == (True, True, False)
        assert LCEOptions.from_op_args(args).need_dw
    else:
        assert seen == [] and scheduled == []


def test_a_bad_precompile_value_is_named():
    with pytest.raises(OptionsError, match="option 'precompile' must be a bool"):
        cc.CompileOptions(precompile="yes")
