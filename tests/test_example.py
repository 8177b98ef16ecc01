"""The main example, examples/train_lm.py: a tiny run trains (finite, falling loss) and writes its JSON log."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--steps", "30", "--lr", "1e-2", "--eval-every", "0", "--eval-batches", "2", "--max-corpus-mb", "2",
        "--device", "cpu", "--no-progress", "--seed", "0"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_lm = _load("train_lm")
data = sys.modules["data"]  # examples/data.py, imported by train_lm


def _comera_registered() -> bool:
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("comera")
    except Exception:
        return False
    return True


def _check_training_log(log: dict, out: Path) -> None:
    losses = [s["loss"] for s in log["steps"]]
    assert len(losses) == 30
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first steps {first:.3f}, last steps {last:.3f}"
    assert math.isfinite(log["evals"][-1]["val_loss"])
    assert log["peak_memory_bytes"] > 0 and log["tokens_per_s"] > 0
    written = json.loads(out.read_text())
    assert [s["loss"] for s in written["steps"]] == losses
    assert {"step", "loss", "lr", "tokens_per_s"} <= written["steps"][0].keys()


def test_train_eager(tmp_path):
    out = tmp_path / "eager.json"
    log = train_lm.main(TINY + ["--backend", "eager", "--sample-tokens", "8", "--out", str(out)])
    _check_training_log(log, out)
    assert isinstance(log["sample"], str) and log["sample"].startswith("def ")


@pytest.mark.skipif(not _comera_registered(), reason="the 'comera' torch.compile backend is not registered yet")
def test_train_comera(tmp_path):
    out = tmp_path / "comera.json"
    # Inner aot_eager keeps the test fast on CPU; the comera passes run the same way as under inductor.
    options = json.dumps({"inner": "aot_eager"})
    log = train_lm.main(TINY + ["--backend", "comera", "--compile-options", options, "--out", str(out)])
    _check_training_log(log, out)


def test_comera_matches_eager_first_steps():
    """The same seed gives the same losses with and without the backend (up to float reassociation)."""
    if not _comera_registered():
        pytest.skip("the 'comera' torch.compile backend is not registered yet")
    short = TINY + ["--steps", "3"]
    eager = train_lm.main(short + ["--backend", "eager"])
    torch._dynamo.reset()
    compiled = train_lm.main(short + ["--backend", "comera", "--compile-options", '{"inner": "aot_eager"}'])
    for a, b in zip(eager["steps"], compiled["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-4)


@pytest.mark.skipif(not hasattr(train_lm.cc, "tensorize_"), reason="comera_compile.tensorize_ (issue 4) not available")
def test_train_tensorized_comera(tmp_path):
    out = tmp_path / "tt.json"
    args = TINY + ["--d-model", "64", "--tensorize", "4", "--backend", "comera",
                   "--compile-options", '{"inner": "aot_eager"}', "--out", str(out)]
    log = train_lm.main(args)
    _check_training_log(log, out)
    assert log["parameters"] < log["dense_parameters"]


@pytest.mark.skipif(not hasattr(train_lm.cc, "param_groups"), reason="comera_compile.param_groups not available")
def test_weight_decay_reaches_the_tt_cores_and_not_the_gates():
    """Decay on matrices and on the TT cores (one flat Parameter per layer, found by identity, not by
    its shape), none on biases, norms and rank gates; every parameter once, at --lr."""
    torch.manual_seed(0)
    model = train_lm.GPT(256, 32, 64, 1, 2)
    args = train_lm.parse_args(TINY + ["--d-model", "64", "--tensorize", "4", "--weight-decay", "0.05"])
    train_lm.compress(model, args)
    cores = {id(lay.param.core_flat) for lay in train_lm.cc.iter_tt_layers(model)}
    gates = {id(lay.param.gate_flat) for lay in train_lm.cc.iter_tt_layers(model)}
    assert cores and gates
    decay = {id(p): g["weight_decay"] for g in train_lm.optimizer_groups(model, args) for p in g["params"]}
    assert all(g["lr"] == args.lr for g in train_lm.optimizer_groups(model, args))
    assert sorted(decay) == sorted(id(p) for p in model.parameters())
    for name, p in model.named_parameters():
        want = 0.05 if id(p) in cores or (p.dim() >= 2 and id(p) not in gates) else 0.0
        assert decay[id(p)] == want, name


def test_corpus_is_deterministic_and_split_by_file():
    a = data.load_stdlib_corpus(max_bytes=1_000_000)
    b = data.load_stdlib_corpus(max_bytes=1_000_000)
    assert a.train_text == b.train_text and a.val_text == b.val_text
    assert a.num_train_files > 0 and a.num_val_files > 0
    assert all("site-packages" not in f.parts for f in data.stdlib_python_files())


def test_bpe_tokenizer_round_trips():
    pytest.importorskip("tokenizers")
    corpus = data.load_stdlib_corpus(max_bytes=500_000)
    tok = data.build_tokenizer("bpe", corpus.train_text, vocab_size=300)
    assert tok.vocab_size == 300
    text = "def f(x):\n    return x + 1\n"
    ids = tok.encode(text)
    assert int(ids.max()) < 300 and tok.decode(ids.tolist()) == text


def test_bpe_without_tokenizers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(ImportError, match="pip install tokenizers"):
        data.build_tokenizer("bpe", "x = 1\n", vocab_size=300)


def test_bad_flags_are_rejected():
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--rank-adapt", "10"])  # needs --tensorize
    with pytest.raises(ValueError, match="divisible"):
        train_lm.GPT(256, 16, d_model=30, n_layers=1, n_heads=4)
