"""The README's code runs as written and its claims hold: the custom-pass examples, the Hugging Face
Trainer example, the options list, what the default tensor-train format does."""

import pathlib
import re

import pytest
import torch

import comera_compile as cc

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _code_after(heading: str) -> str:
    """The first ```python block after ``heading``."""
    text = README.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)


def _run(code: str) -> dict:
    namespace: dict = {}
    # Not "README.md": Dynamo would read the traced functions' source lines from the markdown file.
    exec(compile(code, "<README.md>", "exec"), namespace)
    return namespace


def test_readme_custom_pass_example():
    try:
        _run(_code_after("## Writing a pass"))
        x = torch.linspace(-3, 9, 13)
        out = torch.compile(lambda t: torch.relu(t) + 1, backend="comera", options={"inner": "eager"})(x)
        torch.testing.assert_close(out, torch.nn.functional.relu6(x) + 1)
        report = cc.explain(lambda t: torch.relu(t) * 2, x, options={"inner": "eager"})
        assert [r.kind for r in report.rewrites] == ["scale-relu"]
    finally:
        if "scale-relu" in cc.list_passes():
            cc.unregister_pass("scale-relu")


def test_readme_matching_example_registers_a_pass_that_runs():
    """The `plain_adds` example is a pass: it registers, runs under strict=True (a pass returning
    anything but an int raises there) and lists the add it could not take, as its comment says."""
    try:
        namespace = _run(_code_after("`cc.matching` is the vocabulary"))
        (reason,) = [s.reason for s in namespace["report"].skipped if s.kind == "plain-adds"]
        assert reason.endswith(": alpha=2")
        x = torch.randn(3)
        report = cc.explain(namespace["f"], x, x, options={"inner": "eager", "strict": True,
                                                            "passes": {"plain-adds": True}})
        assert [s.reason for s in report.skipped if s.kind == "plain-adds"] == [reason]
        assert ("plain-adds", 0) in report.graph_reports[0].passes_run
    finally:
        if "plain-adds" in cc.list_passes():
            cc.unregister_pass("plain-adds")


def test_readme_trainer_example_trains_with_the_loss_fused(tmp_path, monkeypatch):
    """The Trainer example as written, on the CPU: 8 logged steps, the LM head's loss fused and the
    MLP projections lowered, as its last comment says. Only the inner compiler is swapped for
    aot_eager (what cc.hf.compile passes on is otherwise unchanged), to keep the compile short."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    compile_in_place = cc.hf.compile

    def quick(model, *, options=None, **kwargs):
        return compile_in_place(model, options={**(options or {}), "inner": "aot_eager"}, **kwargs)

    monkeypatch.setattr(cc.hf, "compile", quick)
    monkeypatch.chdir(tmp_path)
    namespace = _run(_code_after("### Training with `Trainer`"))
    losses = [h["loss"] for h in namespace["trainer"].state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    rewrites = [(r.kind, r.module) for r in namespace["report"].rewrites]
    assert ("cce", "lm_head") in rewrites, str(namespace["report"])
    assert sum(kind == "tt_linear" for kind, _ in rewrites) == 2 * 3, str(namespace["report"])


def test_readme_lists_every_option():
    """The options example in the README and CompileOptions' docstring name every key."""
    block = _code_after("Options go through `options=`")
    listed = re.findall(r'^\s+"(\w+)":', block, re.M)
    assert listed == cc.CompileOptions.keys()
    documented = re.findall(r"^        (\w+):", cc.CompileOptions.__doc__, re.M)
    assert documented == cc.CompileOptions.keys()


def test_readme_says_the_ttm_format_forms_the_dense_weight():
    """The TT-matrix format (the default below 2048 features) merges the dense weight from its cores (explain's plan says so);
    the README's summary says that instead of claiming the dense weight is never formed."""
    intro = README.read_text().split("## Set up")[0]
    assert "never formed" not in intro
    assert re.search(r"TT-matrix \(`ttm`\)[^;]*form[^;]*dense weight", intro.replace("\n", " "))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    cc.tensorize_(model, cc.TTConfig(rank=4, min_size=0))
    (layer,) = cc.iter_tt_layers(model)
    assert layer.spec.fmt == "ttm"
    (rewrite,) = cc.explain(model, torch.randn(8, 64), options={"inner": "eager"}).rewrites
    assert "forms the dense weight" in rewrite.detail


def test_readme_trainer_section_says_what_fails_and_why():
    section = README.read_text().split("### Training with `Trainer`")[1].split("\n## ")[0]
    for needed in ("'COMERA' is not a valid DynamoBackend", "The batch received was empty", "accelerate",
                   "cc.hf.compile", "SFTTrainer", "Seq2SeqTrainer"):
        assert needed in section, needed


def test_readme_api_table_lists_every_public_name():
    import comera_compile as cc

    section = README.read_text().split("## API")[1].split("\n## ")[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert set(cc.__all__) - listed == set(), "cc.__all__ names missing from README's API table"
    assert listed - set(cc.__all__) == set(), "README's API table names what cc.__all__ does not export"


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 400


def _heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lowercased, punctuation but '-' and '_' dropped, spaces
    as '-', '-1', '-2' ... for repeats); headings inside code blocks are not headings."""
    seen, anchors, in_code = {}, set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


DOCS = ["README.md", "BENCHMARKS.md", "DESIGN.md", "docs/benchmarks_archive.md", "examples/torchtitan/README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_local_links_reach_a_file_and_heading(doc):
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _heading_anchors(linked.read_text()):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_benchmarks_stays_short():
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 600
