import torch
import torch.nn as nn

import comera_compile as cc


def test_report_shape_and_text():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    report = cc.explain(model, x, options={"inner": "eager"})
    torch.testing.assert_close(report.output, model(x))
    assert len(report.graphs) == 1 and isinstance(report.graphs[0], torch.fx.GraphModule)
    text = str(report)  # the summary: no graph code
    assert "=== graph 0 ===" in text and "rewrites (0)" in text and "left alone (0)" in text
    assert "--- before ---" not in text and "def forward" not in text and "report.show(graphs=True)" in text
    full = report.format(graphs=True)  # and the graphs before and after, on request
    assert full.startswith(text.split("\n(report.show")[0]) and "rewrites (0)" in full
    assert "--- before ---" in full and "--- after ---" in full and full.count("def forward") == 2
    assert str(report.graph_reports[0]) == report.graph_reports[0].format() and repr(report) == text
    assert isinstance(report.rewrites, list) and isinstance(report.skipped, list)


def test_report_show_prints_the_summary_or_the_graphs(capsys):
    report = cc.explain(nn.Linear(4, 3), torch.randn(2, 4), options={"inner": "eager"})
    report.show()
    assert capsys.readouterr().out.strip() == str(report)
    report.show(graphs=True)
    assert capsys.readouterr().out.strip() == report.format(graphs=True).strip()
    assert "--- after ---" in report.format(graphs=True)


def test_collecting_gathers_what_the_backend_compiles_in_a_block():
    from comera_compile.report import collecting

    model = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), backend="comera", options={"inner": "eager"})
    with collecting() as report:
        model(torch.randn(2, 4))
    assert len(report.graph_reports) == 1 and "def forward" in report.format(graphs=True)
    with collecting() as again:  # a cached graph is not compiled again
        model(torch.randn(2, 4))
    assert again.graph_reports == []


def test_explain_reuses_options_of_compiled_model():
    model = nn.Linear(3, 3)
    compiled = torch.compile(model, backend="comera", options={"inner": "eager", "passes": {}})
    report = cc.explain(compiled, torch.randn(2, 3))
    assert len(report.graphs) == 1


def test_explain_kwargs_and_records():
    def f(x, *, scale):
        return torch.relu(x) * scale

    seen = {}

    @cc.register_pass("recorder")
    def recorder(gm, ctx):
        ctx.skip("recorder", "nothing to do here", module="m")
        seen["training"] = ctx.training
        return 0

    try:
        with torch.no_grad():
            report = cc.explain(f, torch.randn(3), scale=2.0, options={"inner": "eager"})
    finally:
        cc.unregister_pass("recorder")
    assert seen["training"] is False
    (skip,) = [s for s in report.skipped if s.kind == "recorder"]
    assert skip.reason == "nothing to do here" and skip.module == "m"
    assert "[recorder] m: nothing to do here" in str(report)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4)])
        self.lm_head = nn.Linear(4, 6)

    def forward(self, batch):  # one argument, so nn.Sequential can wrap it
        x, y = batch
        logits = self.lm_head(torch.relu(self.layers[0](x)))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, 6), y.view(-1))


_GLOBAL_MODEL = _Inner()


def _call_global_model(batch):
    return _GLOBAL_MODEL(batch)


def _names_seen(model, *args):
    """The module names a pass gets for every linear, and the nearest name of the loss."""
    from comera_compile.fx_utils import module_name, nearest_module_name

    @cc.register_pass("names")
    def names(gm, ctx):
        for node in gm.graph.nodes:
            if node.target is torch._C._nn.linear:
                ctx.skip("names", "linear", module_name(node))
            if node.target is torch.nn.functional.cross_entropy:
                ctx.skip("names", "loss", nearest_module_name(node))
        return 0

    try:
        report = cc.explain(model, *args, options={"inner": "eager"})
    finally:
        cc.unregister_pass("names")
    return [(s.reason, s.module) for s in report.skipped if s.kind == "names"]


def test_module_names_are_the_users_own_through_wrappers():
    """Sequential/compile wrappers and the global a function reaches the model through are not
    part of the names; the loss computed at the top level is named after its projection."""
    x, y = torch.randn(3, 4), torch.randint(0, 6, (3,))
    want = [("linear", "layers.0"), ("linear", "lm_head"), ("loss", "lm_head")]
    inner = _Inner()
    for model in (inner, nn.Sequential(inner), torch.compile(inner, backend="eager"),
                  nn.Sequential(torch.compile(inner, backend="eager")), _call_global_model):
        torch._dynamo.reset()
        assert _names_seen(model, (x, y)) == want, model
    # A Sequential of several modules keeps its indices: they are the user's names.
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 6))
    torch._dynamo.reset()
    from comera_compile.fx_utils import module_name

    @cc.register_pass("names")
    def names(gm, ctx):
        return [ctx.skip("names", "linear", module_name(n)) for n in gm.graph.nodes
                if n.target is torch._C._nn.linear] and 0

    try:
        report = cc.explain(seq, x, options={"inner": "eager"})
    finally:
        cc.unregister_pass("names")
    assert [s.module for s in report.skipped if s.kind == "names"] == ["0", "2"]


class _BrokenHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 6)

    def forward(self, x, y):
        logits = self.lm_head(x)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits.view(-1, 6), y)


def test_explain_reports_a_graph_break_between_projection_and_loss():
    x, y = torch.randn(3, 4), torch.randint(0, 6, (3,))
    report = cc.explain(_BrokenHead(), x, y, options={"inner": "eager"})
    assert len(report.graph_reports) == 2 and report.graph_breaks
    (record,) = [s for s in report.skipped if s.kind == "graph break"]
    assert record.graph == 1 and "graph break(s) in this run: " in record.reason
    assert "cannot be fused" in record.reason and "graph_break" in " ".join(report.graph_breaks)
    assert "graph breaks (1):" in str(report) and "[graph break] -: the loss's logits enter graph 1" in str(report)
    # A loss function that takes the logits as an argument: no graph break, and the report says so.
    torch._dynamo.reset()
    report = cc.explain(lambda logits, t: torch.nn.functional.cross_entropy(logits, t), torch.randn(3, 6), y,
                        options={"inner": "eager"})
    (record,) = [s for s in report.skipped if s.kind == "graph break"]
    assert report.graph_breaks == [] and "no graph break was recorded" in record.reason


def test_keyword_only_loss_left_alone_is_reported_not_crashed():
    import torch.nn.functional as F

    def f(h, W, y):
        return F.cross_entropy(input=torch.add(h @ W.T, 1.0, alpha=2), target=y)

    h, W, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    report = cc.explain(f, h, W, y, options={"inner": "eager", "cce_min_vocab": 0})
    assert any("alpha" in s.reason for s in report.skipped), str(report)
    torch.testing.assert_close(report.output, f(h, W, y))


def test_collecting_records_the_graph_breaks_of_its_block():
    """cc.report.collecting() around a compiled call lists Dynamo's graph breaks there (as explain does),
    and none for a block without any."""
    import comera_compile.report as report_mod

    def breaks(x):
        y = torch.relu(x)
        torch._dynamo.graph_break()
        return y * 2

    compiled = torch.compile(breaks, backend="comera")
    torch._dynamo.reset()
    with report_mod.collecting() as report:
        out = compiled(torch.randn(4))
    assert out.shape == (4,)
    assert len(report.graph_reports) == 2 and report.graph_breaks, str(report)
    assert "graph break" in str(report)
    with report_mod.collecting() as quiet:
        torch.compile(lambda x: x + 1, backend="comera")(torch.randn(4))
    assert quiet.graph_breaks == []
