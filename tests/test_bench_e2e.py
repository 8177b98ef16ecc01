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


def test_btt_variants_tensorize_at_their_rank_and_floor_from_the_btt_planner():
    """``btt`` is rank 1 (Monarch), ``btt-rN`` rank N; the floor counts each btt layer's chosen plan."""
    import comera_compile as cc
    from comera_compile.tt.planner import plan_btt_linear

    torch.manual_seed(0)
    model, make = bench.build("lm-d1024", smoke=True)
    (ids,) = make("cpu", torch.Generator().manual_seed(0))
    bench.tensorize(model, "lm-d1024", "btt", 4)
    layers = list(cc.iter_tt_layers(model))
    assert layers and {lay.spec.fmt for lay in layers} == {"btt"} and {lay.spec.ranks for lay in layers} == {(1, 4, 1)}
    floor = bench.step_floor(model, ids.numel(), ids.shape[-1])
    assert floor["floor_tt_flops"] == sum(plan_btt_linear(lay.spec, ids.numel()).flops for lay in layers)


def test_plot_width_draws_the_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    spec = importlib.util.spec_from_file_location("plot_width", ROOT / "benchmarks" / "plot_width.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = [{"model": f"lm-d{d}", "variant": v, "step_ms": t * d / 1024, "floor_ms": 1.0, "device": "test",
             "torch": "x"} for d in (1024, 2048) for v, t in (("dense-inductor-cg", 10.0), ("btt", 7.0))]
    src = tmp_path / "w.json"
    src.write_text(json.dumps(rows))
    out = tmp_path / "p.png"
    plot.main([str(src), "--out", str(out)])
    assert out.stat().st_size > 1000
    src.write_text(json.dumps([{"model": "encoder", "variant": "tt"}]))
    with pytest.raises(SystemExit, match="no width-sweep rows"):
        plot.main([str(src), "--out", str(out)])


def test_plot_quality_summary_draws_every_row_and_refuses_an_empty_one(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    spec = importlib.util.spec_from_file_location("plot_quality_summary", ROOT / "benchmarks" / "plot_quality_summary.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    out = tmp_path / "q.png"
    plot.main([str(ROOT / "benchmarks" / "results" / "quality_2026-12-02.json"), "--out", str(out)])
    assert out.stat().st_size > 1000
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"row": "x", "family": "dense", "parameters": 1, "val_loss": []}]}))
    with pytest.raises(SystemExit, match="every row needs at least one val_loss"):
        plot.main([str(bad), "--out", str(out)])


def test_bench_swap_smoke_checks_the_permute_at_each_layers_blocks(capsys):
    """benchmarks/bench_swap.py --smoke: each layer's forward and backward swap shape from its btt
    blocks, the permute checked against torch's (no timing on the CPU)."""
    swap_spec = importlib.util.spec_from_file_location("bench_swap", ROOT / "benchmarks" / "bench_swap.py")
    swap = importlib.util.module_from_spec(swap_spec)
    swap_spec.loader.exec_module(swap)
    assert swap.blocks(4096, 11008, 1) == (64, 128, 1)  # d_in = 64 x 64, d_out = 128 x 86
    rows = swap.main(["--smoke"])
    shapes = {(r["d_in"], r["d_out"], r["swap"]): r["shape"] for r in rows}
    assert shapes[(64, 96, "fwd")][1:] == [16, shapes[(64, 96, "bwd")][0], 1]
    assert {r["variant"] for r in rows} == {"permute", "copy"}


def test_bench_swap_best_tile_is_the_fastest_token_tiled_variant_that_beats_the_kernel():
    swap_spec = importlib.util.spec_from_file_location("bench_swap", ROOT / "benchmarks" / "bench_swap.py")
    swap = importlib.util.module_from_spec(swap_spec)
    swap_spec.loader.exec_module(swap)

    def rows(**us):  # two swaps each
        return [{"variant": k.replace("_", "/"), "us": v / 2} for k, v in us.items() for _ in range(2)]

    assert swap.best_tile(rows(triton=100, t8KiB=90, t32KiB=80, t32KiB_w4=10, copy=50)) == 32768  # /w4: not the env's
    assert swap.best_tile(rows(triton=100, t8KiB=120, t16KiB=101)) == 0  # none beats the kernel as it runs now
    assert swap.best_tile(rows(triton=100)) == 0 and swap.best_tile([]) == 0
    partial = rows(triton=100, t16KiB=90) + [{"variant": "t64KiB", "us": 1.0}]  # ran one swap of two
    assert swap.best_tile(partial) == 16384


def test_bench_btt_smoke_checks_each_layer_against_float64():
    """benchmarks/bench_btt.py --smoke: a block's four btt layer groups (Q/K/V and gate/up as one op
    each) through comera::btt_blocks, outputs and every gradient against the float64 definition (no
    timing on the CPU)."""
    btt_spec = importlib.util.spec_from_file_location("bench_btt", ROOT / "benchmarks" / "bench_btt.py")
    btt = importlib.util.module_from_spec(btt_spec)
    btt_spec.loader.exec_module(btt)
    rows = btt.main(["--smoke"])
    assert [(r["layer"], r["d_outs"]) for r in rows] == [("qkv", [64] * 3), ("o", [64]), ("gate_up", [96] * 2),
                                                         ("down", [64])]
    assert all(max(r["err_y"], r["err_dx"], r["err_cores"]) < 1e-5 for r in rows)


def test_the_viainductor_tag_is_refused_where_there_are_no_passes_to_run(capsys):
    """``-viainductor`` (the passes inside plain torch.compile through cc.use_with_inductor) applies to the
    variants that run the passes; on dense-eager / dense-inductor it names the valid tags and exits."""
    for variant in ("dense-inductor-viainductor", "dense-eager-viainductor", "btt-viainductor-bogus"):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", "--model", "lm-d1024", "--variants", variant])
        assert "-viainductor (not for dense-eager / dense-inductor)" in capsys.readouterr().err
