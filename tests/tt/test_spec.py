"""TTSpec as the one description of a TT layer: the marker op's arguments written and read back, the
checks of cores, a spec and a cut as constants of an FX graph, and the spec-taking planner."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx

import comera_compile  # noqa: F401  (registers the ops)
from comera_compile.kernels import tt_runtime
from comera_compile.tensorize import TTConfig, tensorize_, tt_parametrization
from comera_compile.tt import TTSpec, join_flat, planner, random_cores, split_flat


def test_fields_are_the_marker_ops_arguments():
    schema = torch.ops.comera.tt_materialize.default._schema.arguments
    assert [a.name for a in schema] == ["core_flat", "gate_flat", *TTSpec._fields]
    spec = TTSpec("ttm", [3, 4], [2, 5], [1, 6, 1], 11, 9, True)
    args = spec.materialize_args("C", "G")
    assert args[:2] == ("C", "G") and TTSpec(*args[2:]) == spec
    assert args[2:] == ("ttm", [3, 4], [2, 5], [1, 6, 1], 11, 9, True)  # lists, as the op's int[] are traced


def test_read_back_from_the_parametrizations_graph():
    layer = torch.nn.Linear(24, 20)
    tensorize_(layer, TTConfig(rank=3, fmt="tt", min_size=0))
    param = tt_parametrization(layer)
    gm = fx.symbolic_trace(param)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target is torch.ops.comera.tt_materialize.default or node.target is torch.ops.comera.tt_materialize
    assert TTSpec.from_materialize_node(node) == param.spec
    assert [a.target for a in node.args[:2]] == ["core_flat", "gate_flat"]
    node.kwargs = {"transpose": True}
    with pytest.raises(ValueError, match="by position"):
        TTSpec.from_materialize_node(node)


def test_from_cores_checks_once():
    spec = TTSpec("tt", (3, 4), (5,), (1, 2, 3, 1), 11, 5)
    cores = random_cores(spec, 1.0)
    gates = [torch.ones(r) for r in spec.gate_sizes]
    assert TTSpec.from_cores(cores, "tt", (3, 4), (5,), 11, 5, gates=gates) == spec
    with pytest.raises(ValueError, match="'tt' with row_modes \\[3, 4\\] and col_modes \\[5\\] needs 3 cores, got 2"):
        TTSpec.from_cores(cores[:2], "tt", (3, 4), (5,), 11, 5)
    with pytest.raises(ValueError, match="fmt must be 'tt', 'ttm' or 'btt'"):
        TTSpec.from_cores(cores, "cp", (3, 4), (5,), 11, 5)
    with pytest.raises(ValueError, match="core 1 has shape"):
        TTSpec.from_cores([cores[0], cores[1][:, :3], cores[2]], "tt", (3, 4), (5,), 11, 5, gates=gates)
    with pytest.raises(ValueError, match="expected 2 gates"):
        TTSpec.from_cores(cores, "tt", (3, 4), (5,), 11, 5, gates=gates[:1])
    with pytest.raises(ValueError, match="comera::tt_linear: rows=13, cols=5 exceed the padded shape 12x5"):
        tt_runtime.layer_spec("comera::tt_linear", cores, gates, "tt", (3, 4), (5,), 13, 5)
    core_flat, gate_flat = join_flat(cores, gates)
    back, back_gates = split_flat(core_flat, gate_flat, spec)
    assert all(torch.equal(a, b) for a, b in zip(back + back_gates, cores + gates))


def test_format_facts_live_on_the_spec():
    tt = TTSpec("tt", (3, 4), (5, 2), (1, 2, 3, 4, 1), 12, 10)
    ttm = TTSpec("ttm", (3, 4), (5, 2), (1, 6, 1), 12, 10)
    assert tt.chain_modes == ((3, 1), (4, 1), (1, 5), (1, 2)) and ttm.chain_modes == ((3, 5), (4, 2))
    assert tt.sizes == (3, 4, 5, 2) and ttm.sizes == (15, 8)
    assert (tt.bottleneck, tt.interleaved, tt.natural_split) == (2, False, 2)
    assert (ttm.bottleneck, ttm.interleaved, ttm.natural_split) == (None, True, 1)
    for spec in (tt, ttm):
        assert spec.n_cores == len(spec.core_shapes) == len(spec.ranks) - 1
        assert [math.prod(m) for m in spec.chain_modes] == list(spec.sizes)


def test_spec_and_cut_stand_in_an_fx_graph():
    """What the tensor_network pass writes: group_outputs(flats, spec, cut, output, dtype) as constants
    of a graph that is generated as Python code and runs."""
    spec = TTSpec("tt", (3, 4), (5,), (1, 2, 3, 1), 11, 5, True)
    cores = random_cores(spec, 1.0, dtype=torch.float64)
    gates = [torch.rand(r, dtype=torch.float64) + 0.5 for r in spec.gate_sizes]
    cut = planner.cut_at(spec, 1)
    graph = fx.Graph()
    c, g = graph.placeholder("core_flat"), graph.placeholder("gate_flat")
    out = graph.call_function(tt_runtime.group_outputs, ([c], [g], spec, cut, "dense_t", torch.float64))
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert "TTSpec('tt', (3, 4), (5,), (1, 2, 3, 1), 11, 5, True)" in gm.code and "Cut(1, 0, (1, 2))" in gm.code
    (w,) = gm(*join_flat(cores, gates))
    expect = torch.ops.comera.tt_materialize(*spec.materialize_args(*join_flat(cores, gates)))
    torch.testing.assert_close(w, expect)


def test_the_planner_takes_a_spec():
    args = ("tt", (12, 8, 8), (8, 8, 12), (1, 12, 30, 30, 30, 12, 1))
    spec = TTSpec(*args, 768, 768, True)
    plan = planner.plan_linear(spec, 4096)
    assert plan is planner.plan_tt_linear(*args, 4096)  # the positional form builds the same spec
    assert planner.plan_linear(TTSpec(*args, 700, 760), 4096) is plan  # rows, cols, transpose: same plan
    assert plan.spec.ranks == plan.ranks == args[3] and plan.cut == planner.cut_at(spec, plan.split)
    assert plan.cut == (plan.split, plan.left, plan.right)
    emb = TTSpec("ttm", (16, 20, 10, 10), (4, 4, 8, 6), (1, 32, 32, 32, 1), 30522, 768)
    assert planner.plan_embedding(emb, 8192) is planner.plan_tt_embedding(*emb[:4], 8192)
    with pytest.raises(ValueError, match="split must be a bond"):
        planner.cut_at(spec, 6)
