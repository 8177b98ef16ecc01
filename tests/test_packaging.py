"""A normal (non-editable) install ships passes/ and kernels/ as comera_compile.passes/.kernels and nothing
else at the top level, with the torch_dynamo_backends entry point."""

import glob
import pathlib
import re
import subprocess
import sys
import zipfile

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
                   "rank_adaptation/__init__.py", "rank_adaptation/ranker.py"):
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
