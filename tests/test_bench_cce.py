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
