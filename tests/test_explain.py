import torch
import torch.nn as nn

import comera_compile as cc


def test_report_shape_and_text():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(2, 4)
    report = cc.explain(model, x, options={"inner": "eager"})
    torch.testing.assert_close(report.output, model(x))
    assert len(report.graphs) == 1 and isinstance(report.graphs[0], torch.fx.GraphModule)
    text = str(report)
    assert "=== graph 0 ===" in text and "--- before ---" in text and "--- after ---" in text
    assert "rewrites (0)" in text
    assert isinstance(report.rewrites, list) and isinstance(report.skipped, list)


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
