"""A normal (non-editable) install ships passes/ and kernels/ as comera_compile.passes/.kernels and nothing
else at the top level, with the torch_dynamo_backends entry point."""

import glob
import math
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_layout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = glob.glob(str(tmp_path / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"comera_compile", "comera_compile-0.1.0.dist-info"}
    for module in ("passes/cce.py", "passes/tensor_network.py", "kernels/linear_cross_entropy.py",
                   "kernels/tt_linear.py", "kernels/tt_embedding.py", "kernels/tt_materialize.py",
                   "rank_adaptation/__init__.py", "rank_adaptation/ranker.py", "cce/__init__.py", "cce/planner.py",
                   "cce/tuning.py", "cce/observed.py", "kernels/linear_cross_entropy_plan.py"):
        assert f"comera_compile/{module}" in names
    assert "comera_compile/py.typed" in names  # PEP 561: type checkers read the package's annotations
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[torch_dynamo_backends]" in text and "comera = comera_compile.backend:comera_backend" in text


def test_hf_extra_installs_what_trainer_needs():
    """transformers' Trainer raises ImportError without accelerate: the hf extra installs both."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", req)[0] for req in extras["hf"]}
    assert {"transformers", "accelerate"} <= names


def test_no_test_asserts_a_wall_clock_time():
    """Timings belong in benchmarks/: on a loaded CI machine a time bound fails at random. A test may
    record how long something took (tests/test_distributed.py reports its phases) but not read a clock
    in an assertion or a test body's comparison."""
    import re
    from pathlib import Path

    clock = re.compile(r"perf_counter|time\.time\(|time\.monotonic|elapsed_time|do_bench|timeit")
    # test_distributed.py: two perf_counter calls that only record phase seconds; test_quality_study.py:
    # two start times set in the past to put a study beyond its deadline (nothing asserts a duration)
    allowed = {"test_distributed.py": 2, "test_quality_study.py": 2}
    offenders = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        if path.name == Path(__file__).name:
            continue
        hits = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if clock.search(line)]
        if len(hits) > allowed.get(path.name, 0):
            offenders.append(f"{path.name}: lines {hits}")
    assert not offenders, offenders


_SHADOW_PROBE = "import kernels, passes; print(kernels.MARK, passes.MARK)"


def _fake_distributions(site):
    """Regular top-level packages ``kernels`` and ``passes``, as an installed distribution has them."""
    for name in ("kernels", "passes"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"MARK = 'installed-{name}'\n")
    (site / "shadow_probe.py").write_text(_SHADOW_PROBE + "\n")


def test_the_checkout_never_shadows_installed_top_level_modules(tmp_path):
    """``python -c``, ``python -m`` and ``PYTHONPATH=.`` from the repository root put the root first on
    sys.path; an installed ``kernels`` or ``passes`` (transformers depends on Hugging Face's ``kernels``)
    must still win over the checkout's folders of those names."""
    site = tmp_path / "site"
    _fake_distributions(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs = {
        "python -c": ([sys.executable, "-c", _SHADOW_PROBE], {"PYTHONPATH": str(site)}),
        "python -m": ([sys.executable, "-m", "shadow_probe"], {"PYTHONPATH": str(site)}),
        "PYTHONPATH=.": ([sys.executable, "-c", _SHADOW_PROBE], {"PYTHONPATH": f".{os.pathsep}{site}"}),
    }
    for how, (cmd, extra) in runs.items():
        out = subprocess.run(cmd, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{how}: {out.stderr}"
        assert out.stdout.split() == ["installed-kernels", "installed-passes"], how


def test_the_package_imports_its_passes_and_kernels_beside_installed_namesakes(tmp_path):
    """With namesakes installed, ``comera_compile.kernels`` / ``.passes`` are still this package's."""
    site = tmp_path / "site"
    _fake_distributions(site)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    probe = ("import kernels, comera_compile as cc, comera_compile.kernels.tt_linear as t, "
             "comera_compile.passes.builtin as b; print(kernels.MARK, t.__name__, cc.list_passes())")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["installed-kernels", "comera_compile.kernels.tt_linear"]
    assert "tensor_network" in out.stdout and "cce" in out.stdout


def _installed_hf_kernels() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
        importlib.metadata.distribution("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed_hf_kernels(), reason="Hugging Face's kernels (transformers >= 5.25) not installed")
def test_transformers_hub_kernels_load_from_the_repository_root():
    """From the root, ``import kernels`` is Hugging Face's package, and a transformers model builds and
    runs with its hub-kernels integration loaded (the fresh-install failure: ``cannot import name
    'CUDAProperties' from 'kernels'``)."""
    probe = (
        "import kernels, torch\n"
        "from kernels import CUDAProperties\n"
        "from transformers.integrations import hub_kernels\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=2)\n"
        "out = LlamaForCausalLM(cfg)(torch.randint(0, 64, (1, 5)), labels=torch.randint(0, 64, (1, 5)))\n"
        "print(kernels.__file__); print(float(out.loss))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    where = pathlib.Path(out.stdout.splitlines()[0]).resolve()
    assert not where.is_relative_to(ROOT / "kernels"), where  # CI's venv may sit inside the checkout
    assert math.isfinite(float(out.stdout.splitlines()[1]))
    import importlib.util

    spec = importlib.util.find_spec("kernels")  # this very process: `python -m pytest` from the root
    assert spec.origin is not None and not pathlib.Path(spec.origin).resolve().is_relative_to(ROOT / "kernels")
