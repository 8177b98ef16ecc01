"""benchmarks/bench_e2e.py's width sweep: its models build at the widths' shape rules and its step floor
counts the FLOPs and bytes a hand count gives."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_llama_ffn_is_eight_thirds_rounded_up_to_256():
    assert [bench.llama_ffn(d) for d in (1024, 2048, 4096)] == [2816, 5632, 11008]  # Llama-2 7B's 11008


def test_width_models_and_the_step_floor():
    torch.manual_seed(0)
    model, make = bench.build("lm-d2048", smoke=True)  # d 128, 2 layers, vocabulary 1000
    (ids,) = make("cpu", torch.Generator().manual_seed(0))
    n, seq = ids.numel(), ids.shape[-1]
    cfg = model.model.config
    assert cfg.hidden_size == 128 and cfg.intermediate_size == bench.llama_ffn(128) and cfg.vocab_size == 1000
    d, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    per_layer = 4 * d * d + 3 * d * f  # q, k, v, o; gate, up, down
    want = 6 * n * (layers * per_layer + d * v) + layers * 6 * n * seq * d
    floor = bench.step_floor(model, n, seq)
    assert floor["floor_flops"] == want and floor["floor_tt_flops"] == 0
    assert floor["floor_bytes"] == 40 * sum(p.numel() for p in model.parameters())
    assert floor["floor_ms"] == pytest.approx(1e3 * max(want / 790e12, floor["floor_bytes"] / 4.3e12))
    bench.tensorize(model, "lm-d2048", "ttm")  # the blocks only
    import comera_compile as cc

    fqns = [lay.fqn for lay in cc.iter_tt_layers(model)]
    assert len(fqns) == layers * 7 and all(".layers." in f for f in fqns)
    tt = bench.step_floor(model, n, seq)
    assert 0 < tt["floor_tt_flops"] and tt["floor_flops"] - tt["floor_tt_flops"] == want - 6 * n * layers * per_layer
