"""benchmarks/bench_cce.py on the CPU (its --smoke mode): every method's loss and gradients agree with the
float64 reference, including a compiled module (backend="comera": what the pass decides for a user's
``F.cross_entropy(F.linear(x, w))``), and the verdict compares auto with its own exact path."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_cce", ROOT / "benchmarks" / "bench_cce.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_smoke_rows_match_the_reference_and_the_verdict_reads_auto_against_its_exact_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--smoke", "--impl", "auto", "--shapes", "small", "--cases", "peaked",
                       "--methods", "eager,torch.compile,auto,auto-exact,backend", "--auto-warmup", "1"]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench_cce.json").read_text())}
    assert set(rows) == {"eager", "torch.compile", "ours auto", "ours auto, exact backward",
                         'ours via backend="comera"'}
    for r in rows.values():
        assert "error" not in r, r
        assert r["err_loss"] < 1e-5 and r["err_dx"] < 1e-4 and r["err_dw"] < 1e-4, r
    out = capsys.readouterr().out
    assert "its exact path" in out and 'a compiled module (backend="comera")' in out


def test_the_verdict_calls_a_different_slower_path_slower_and_the_same_path_noise():
    row = lambda ms, *paths: {"ms": ms, "paths": list(paths)}  # noqa: E731
    assert bench.auto_against_exact(row(13.98, "forward:triton", "forward:sparse"), row(12.16, "forward:chunked")) \
        == "SLOWER"
    assert bench.auto_against_exact(row(10.25, "forward:triton", "forward:sparse"), row(11.99, "forward:chunked")) \
        == "not slower"
    same = bench.auto_against_exact(row(12.27, "forward:chunked"), row(12.22, "forward:chunked"))
    assert same.startswith("the same path") and "0.4 %" in same
    assert bench.auto_against_exact(row(12.30, "forward:sparse"), row(12.22, "forward:chunked")) == "not slower"
    assert bench.auto_against_exact(row(12.60, "forward:sparse"), row(12.22, "forward:chunked")) == "SLOWER"
