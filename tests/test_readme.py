"""The README's custom-pass example works as written."""

import pathlib
import re

import torch

import comera_compile as cc

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_custom_pass_example():
    text = README.read_text()
    section = text[text.index("## Writing a pass"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
        x = torch.linspace(-3, 9, 13)
        out = torch.compile(lambda t: torch.relu(t) + 1, backend="comera", options={"inner": "eager"})(x)
        torch.testing.assert_close(out, torch.nn.functional.relu6(x) + 1)
        report = cc.explain(lambda t: torch.relu(t) * 2, x, options={"inner": "eager"})
        assert [r.kind for r in report.rewrites] == ["scale-relu"]
    finally:
        if "scale-relu" in cc.list_passes():
            cc.unregister_pass("scale-relu")
