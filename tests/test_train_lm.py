"""The research driver, benchmarks/train_lm.py: a tiny run trains (finite, falling loss) and writes its JSON log."""

import hashlib
import importlib.util
import json
import math
import statistics
import sys
import zlib
from pathlib import Path

import pytest
import torch

DRIVER = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "8",
        "--steps", "30", "--lr", "1e-2", "--eval-every", "0", "--eval-batches", "2", "--max-corpus-mb", "2",
        "--device", "cpu", "--no-progress", "--seed", "0"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", DRIVER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_lm = _load("train_lm")
data = sys.modules["data"]  # benchmarks/data.py, imported by train_lm


def test_the_comera_backend_and_the_packages_api_are_there():
    """The example's tests below use them: a missing backend or API fails here, it is never skipped."""
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("comera") is not None
    assert train_lm.cc is not None and callable(train_lm.cc.tensorize_) and callable(train_lm.cc.param_groups)


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


def test_train_comera(tmp_path):
    out = tmp_path / "comera.json"
    # Inner aot_eager keeps the test fast on CPU; the comera passes run the same way as under inductor.
    options = json.dumps({"inner": "aot_eager"})
    log = train_lm.main(TINY + ["--backend", "comera", "--compile-options", options, "--out", str(out)])
    _check_training_log(log, out)


def test_comera_matches_eager_first_steps():
    """The same seed gives the same losses with and without the backend (up to float reassociation)."""
    short = TINY + ["--steps", "3"]
    eager = train_lm.main(short + ["--backend", "eager"])
    torch._dynamo.reset()
    compiled = train_lm.main(short + ["--backend", "comera", "--compile-options", '{"inner": "aot_eager"}'])
    for a, b in zip(eager["steps"], compiled["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-4)


def test_train_tensorized_comera(tmp_path):
    out = tmp_path / "tt.json"
    args = TINY + ["--d-model", "64", "--tensorize", "4", "--backend", "comera",
                   "--compile-options", '{"inner": "aot_eager"}', "--out", str(out)]
    log = train_lm.main(args)
    _check_training_log(log, out)
    assert log["parameters"] < log["dense_parameters"]


def test_optimizer_groups_find_the_flat_tt_parameters_by_identity():
    """Each layer's cores are one 1-D Parameter: the optimizer must find them by identity, not by shape
    (the shape rule would put them with the undecayed vectors). --core-weight-decay reaches them, the
    gates get none and the cores' lr (--gate-lr-scale 1), matrices --weight-decay; every parameter once."""
    torch.manual_seed(0)
    model = train_lm.GPT(256, 32, 64, 1, 2)
    args = train_lm.parse_args(TINY + ["--d-model", "64", "--tensorize", "4", "--weight-decay", "0.05",
                                       "--core-weight-decay", "0.02"])
    train_lm.compress(model, args)
    cores = {id(lay.param.core_flat) for lay in train_lm.cc.iter_tt_layers(model)}
    gates = {id(lay.param.gate_flat) for lay in train_lm.cc.iter_tt_layers(model)}
    assert cores and gates
    opt = train_lm.make_optimizer(model, args, torch.device("cpu"))
    seen = {id(p): (g["weight_decay"], g["lr"]) for g in opt.param_groups for p in g["params"]}
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    for name, p in model.named_parameters():
        want = (0.02, args.lr) if id(p) in cores else (0.0, args.lr) if id(p) in gates else (
            0.05 if p.dim() >= 2 else 0.0, args.lr)
        assert seen[id(p)] == pytest.approx(want), name


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


# ---------------------------------------------------------------------------------- the GPU preset


def _gpt_parameters(vocab, seq, d, layers, tied=True):
    """The dense GPT's parameter count, written out: embeddings, per block q/k/v/proj (no bias), MLP
    with biases, two LayerNorms; final LayerNorm; the head when untied."""
    block = 4 * d * d + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    return vocab * d + seq * d + layers * block + 2 * d + (0 if tied else vocab * d)


def test_gpu_preset_model_builds():
    args = train_lm.parse_args(["--preset", "gpu"])
    assert (args.d_model, args.n_layers, args.n_heads, args.qkv, args.tokenizer, args.vocab_size) == (
        768, 6, 12, "separate", "bpe", 16384)
    assert (args.precision, args.device, args.seq_len, args.batch_size) == ("bf16", "cuda", 512, 32)
    assert train_lm.parse_args(["--preset", "gpu", "--tokenizer", "bytes"]).vocab_size is None  # BPE's size only
    assert train_lm.parse_args(["--tokenizer", "bytes", "--vocab-size", "300"]).vocab_size == 300  # data.py rejects it
    model = train_lm.build_model(args, 16384, device="meta")
    assert sum(p.numel() for p in model.parameters()) == _gpt_parameters(16384, 512, 768, 6)
    assert isinstance(model.blocks[0].attn.q, torch.nn.Linear) and not hasattr(model.blocks[0].attn, "qkv")

    deep = train_lm.parse_args(["--preset", "gpu", "--n-layers", "12", "--tensorize", "32", "--fmt", "ttm"])
    model = train_lm.build_model(deep, 16384, device="meta")
    train_lm.compress(model, deep)
    layers = {lay.fqn: lay for lay in train_lm.cc.iter_tt_layers(model)}
    assert len(layers) == 12 * 6 and all(lay.spec.fmt == "ttm" for lay in layers.values())
    assert {train_lm.layer_kind(f) for f in layers} == {"attn", "mlp"}  # embeddings stay dense by default
    assert train_lm.block_parameters(model) < _gpt_parameters(0, 0, 768, 12) / 10  # ttm r32: ~14x


def test_per_kind_compression_options():
    args = train_lm.parse_args(["--preset", "gpu", "--tensorize", "attn=16,mlp=8,emb=4", "--fmt", "attn=tt,emb=ttm",
                                "--compress", "attn,mlp,pos", "--tt-init-std", "pos=0.02", "--head", "untied"])
    model = train_lm.build_model(args, 1000, device="meta")
    configs = train_lm.tt_configs(model, args)
    assert set(configs) == {f"blocks.{i}.{m}" for i in range(6) for m in
                            ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")} | {"pos_emb"}
    assert (configs["blocks.0.attn.q"].rank, configs["blocks.0.attn.q"].fmt) == (16, "tt")
    assert (configs["blocks.5.mlp.fc"].rank, configs["blocks.5.mlp.fc"].fmt) == (8, "auto")
    assert (configs["pos_emb"].rank, configs["pos_emb"].fmt, configs["pos_emb"].init_std) == (4, "ttm", 0.02)
    assert configs["blocks.0.attn.q"].init_std is None
    tied = train_lm.parse_args(["--tensorize", "tok=8,head=4", "--compress", "tok", "--tied", "share"])
    configs = train_lm.tt_configs(train_lm.build_model(tied, 256), tied)
    assert set(configs) == {"tok_emb", "lm_head"} and configs["lm_head"] == configs["tok_emb"]  # one weight
    assert configs["tok_emb"].rank == 8
    default = train_lm.parse_args(["--tensorize", "default", "--compress", "mlp"])
    assert train_lm.tt_configs(train_lm.build_model(default, 256), default)["blocks.0.mlp.fc"].rank == \
        train_lm.cc.TTConfig().rank
    for bad in (["--tensorize", "attn=16"], ["--tensorize", "8", "--fmt", "mlp=tensor"],
                ["--tensorize", "8", "--compress", "attn,ffn"], ["--tensorize", "lm=8"], ["--fmt", "ttm"],
                ["--backend", "eager", "--cuda-graphs"]):
        with pytest.raises(SystemExit):
            train_lm.parse_args(bad)


def test_separate_qkv_computes_what_fused_qkv_computes():
    """The same weights as one qkv matrix or as q, k, v: the same logits (an untied head too)."""
    torch.manual_seed(0)
    fused = train_lm.GPT(100, 16, d_model=32, n_layers=2, n_heads=4, qkv="fused", tie_head=False)
    separate = train_lm.GPT(100, 16, d_model=32, n_layers=2, n_heads=4, qkv="separate", tie_head=False)
    state = fused.state_dict()
    for i in range(2):
        q, k, v = state.pop(f"blocks.{i}.attn.qkv.weight").split(32)
        state.update({f"blocks.{i}.attn.q.weight": q, f"blocks.{i}.attn.k.weight": k, f"blocks.{i}.attn.v.weight": v})
    separate.load_state_dict(state)
    ids = torch.randint(0, 100, (3, 16))
    torch.testing.assert_close(separate(ids), fused(ids))
    assert separate.lm_head.weight is not separate.tok_emb.weight


def test_gate_init_keeps_the_weights():
    args = train_lm.parse_args(["--d-model", "64", "--n-layers", "1", "--tensorize", "4", "--fmt", "ttm",
                                "--compress", "mlp"])
    torch.manual_seed(0)
    model = train_lm.build_model(args, 256)
    train_lm.compress(model, args)
    before = model.blocks[0].mlp.fc.weight.detach().clone()
    train_lm.set_gate_init(model, 0.1)
    torch.testing.assert_close(model.blocks[0].mlp.fc.weight, before, rtol=1e-5, atol=1e-7)
    assert all(bool((g == 0.1).all()) for lay in train_lm.cc.iter_tt_layers(model) for g in lay.gates)


def test_help_matches_the_readme():
    text = train_lm.parse_args.__globals__["__doc__"]
    assert "PYTHONPATH" not in text and "python benchmarks/train_lm.py --preset gpu" in text
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        train_lm.parse_args(["--help"])
    assert "PYTHONPATH" not in out.getvalue() and "issue" not in out.getvalue().lower()


def test_bpe_cache_is_reused_and_validation_is_fixed(tmp_path):
    pytest.importorskip("tokenizers")
    first = data.load_token_data("bpe", 300, max_bytes=300_000, cache_dir=tmp_path)
    second = data.load_token_data("bpe", 300, max_bytes=300_000, cache_dir=tmp_path)
    assert not first.from_cache and second.from_cache and second.cache == first.cache
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    text = "for i in range(3):\n    print(i)\n"
    assert second.tokenizer.decode(second.tokenizer.encode(text).tolist()) == text
    assert torch.equal(second.tokenizer.encode(text), first.tokenizer.encode(text))
    a, b = first.eval_batches(4, 16, 3), second.eval_batches(4, 16, 3)
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    starts = torch.cat(a)[:, :4]
    assert torch.equal(starts[0], first.val[:4].long())  # evenly spaced from the first token on
    assert data.load_token_data("bpe", 301, max_bytes=300_000, cache_dir=tmp_path).from_cache is False


def test_checkpoint_then_tt_svd_fine_tune(tmp_path):
    """--save a trained dense model, then --init-from it with TT-SVD of its MLP: the fine-tune starts
    near where the dense run ended, far below a fresh start."""
    ckpt = tmp_path / "dense.pt"
    short = TINY + ["--d-model", "64", "--steps", "40", "--backend", "eager"]
    dense = train_lm.main(short + ["--save", str(ckpt)])
    tuned = train_lm.main(short + ["--steps", "2", "--init-from", str(ckpt), "--tt-init", "svd", "--tensorize", "16",
                                   "--compress", "mlp", "--fmt", "ttm"])
    fresh = train_lm.main(short + ["--steps", "2"])
    assert tuned["parameters"] < tuned["dense_parameters"]
    assert tuned["steps"][0]["loss"] < fresh["steps"][0]["loss"] - 1.0
    assert tuned["steps"][0]["loss"] == pytest.approx(dense["steps"][-1]["loss"], abs=0.3)
    with pytest.raises(RuntimeError, match="not a checkpoint of this model"):
        train_lm.main(short + ["--steps", "1", "--d-model", "32", "--init-from", str(ckpt)])


def test_pruned_checkpoint_reloads_at_its_ranks(tmp_path):
    """A rank-adapted run's --save loads into the model the same flags tensorize: the pruned ranks
    and the weights come back (what quality_study's timing pass of trained models relies on)."""
    ckpt = tmp_path / "adapted.pt"
    flags = TINY + ["--d-model", "64", "--backend", "eager", "--tensorize", "8", "--fmt", "ttm", "--compress", "mlp"]
    adapted = train_lm.main(flags + ["--steps", "12", "--rank-adapt", "2", "--save", str(ckpt), "--rank-adapt-options",
                                     '{"prune_every": 4, "threshold": 0.995}'])
    assert adapted["prune_events"] >= 1
    again = train_lm.main(flags + ["--steps", "1", "--lr", "0", "--init-from", str(ckpt)])
    assert again["parameters"] == adapted["final_parameters"]
    assert again["steps"][0]["loss"] < adapted["steps"][0]["loss"] - 0.5


# ---------------------------------------------------------------------------------- corpus and sampler


def _name_pair(prefix: str = "m") -> tuple[str, str]:
    """Two file names whose sorted order and reading order (sha1 of the name) disagree."""
    for i in range(100):
        first, second = f"{prefix}{i}a.py", f"{prefix}{i}b.py"
        if data._order_key(f"purelib/{second}") < data._order_key(f"purelib/{first}"):
            return first, second
    raise AssertionError("no such pair")


def test_python_corpus_dedups_by_content_and_skips_what_it_should(tmp_path):
    """Roots as the python corpus has them: the standard library (with a site-packages inside it and a
    __pycache__, both skipped) and purelib. Copies of a file are left out, the first in sorted order
    kept, also when the reading order meets the other copy first, and also when a cap stops before it."""
    stdlib, pure = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    (stdlib / "pkg").mkdir(parents=True)
    (stdlib / "__pycache__").mkdir()
    pure.mkdir()
    (stdlib / "os2.py").write_text("import sys\n" * 50)
    (stdlib / "pkg" / "mod.py").write_text("x = 1\n" * 80)
    (stdlib / "__pycache__" / "cached.py").write_text("no = 1\n")
    (stdlib / "notes.txt").write_text("not python\n")
    (pure / "copy_of_os2.py").write_text("import sys\n" * 50)  # a copy of a stdlib file: stdlib's kept
    first, second = _name_pair()
    (pure / first).write_text("y = 2\n" * 60)
    (pure / second).write_text("y = 2\n" * 60)  # read before `first`, but sorted after it: left out
    for i in range(30):
        (pure / f"f{i}.py").write_text(f"value_{i} = {i}\n" * (10 + i))
    roots = {"stdlib": stdlib, "purelib": pure}
    corpus = data.load_corpus("python", roots=roots)
    names = [f.name for f in corpus.files]
    assert "stdlib/os2.py" in names and "purelib/copy_of_os2.py" not in names
    assert f"purelib/{first}" in names and f"purelib/{second}" not in names
    assert corpus.duplicates == 2
    assert not any("cached" in n or "site-packages" in n or n.endswith(".txt") for n in names)
    assert len(names) == 2 + 1 + 30
    assert names == sorted(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())  # the reading order
    for f in corpus.files:  # the manifest's rows, checked against the files themselves
        raw = ((stdlib if f.root == "stdlib" else pure) / f.relative).read_bytes()
        assert (f.sha1, f.bytes) == (hashlib.sha1(raw).hexdigest(), len(raw))
        assert f.split == ("val" if zlib.crc32(f.name.encode()) % 10_000 < 500 else "train")
    assert data.read_manifest(corpus.write_manifest(tmp_path / "m.tsv")) == corpus.files
    assert f"# digest: {corpus.digest}" in (tmp_path / "m.tsv").read_text()
    # At every cap, also those that stop before `first` is read, `second` stays out (a copy of a file
    # earlier in sorted order), and each split holds the first files of the whole corpus' split.
    stopped_before_first = 0
    for cap in range(100, corpus.num_bytes + 1000, 100):
        capped = data.load_corpus("python", roots=roots, max_bytes=cap)
        got = [f.name for f in capped.files]
        assert f"purelib/{second}" not in got and capped.num_val_files >= 1
        stopped_before_first += f"purelib/{first}" not in got
        for split in ("train", "val"):
            mine = [f for f in capped.files if f.split == split]
            assert mine == [f for f in corpus.files if f.split == split][:len(mine)]
    assert stopped_before_first > 0


def test_python_corpus_tiny_cap_reads_a_hash_ordered_sample():
    corpus = data.load_corpus("python", max_bytes=200_000)
    assert list(corpus.roots)[:2] == ["stdlib", "purelib"]
    names = [f.name for f in corpus.files]
    assert names == sorted(names, key=lambda n: hashlib.sha1(n.encode()).hexdigest())
    assert len({f.sha1 for f in corpus.files}) == len(corpus.files)  # no two files with the same bytes
    train = sum(f.bytes for f in corpus.files if f.split == "train")
    val = corpus.num_bytes - train
    largest = max(f.bytes for f in corpus.files)
    assert 0.95 * 200_000 <= train <= 0.95 * 200_000 + largest and 0.05 * 200_000 <= val <= 0.05 * 200_000 + largest
    larger = data.load_corpus("python", max_bytes=2_000_000)
    assert larger.num_bytes >= 2_000_000
    # a cap takes the first files of a larger corpus' reading order, split by split
    for split in ("train", "val"):
        got = [f for f in corpus.files if f.split == split]
        assert got == [f for f in larger.files if f.split == split][:len(got)]


def test_epoch_sampler_visits_each_window_once_per_epoch():
    tokens = torch.arange(1003, dtype=torch.int32)
    sampler = data.EpochSampler(tokens, seq_len=10, batch_size=7, seed=3)
    assert (sampler.num_windows, sampler.batches_per_epoch) == (100, 14)
    seen = []
    for _ in range(14):
        batch = sampler.next_batch()
        assert batch.dtype == torch.int64 and batch.shape == (7, 10)
        starts = batch[:, 0].tolist()
        assert all(s % 10 == 0 for s in starts)  # windows on the grid: none overlaps another
        assert torch.equal(batch, torch.stack([torch.arange(s, s + 10) for s in starts]))
        seen += [s // 10 for s in starts]
    assert len(set(seen)) == len(seen) == 98 and set(seen) <= set(range(100))  # 2 windows left over
    assert (sampler.tokens_seen, sampler.epochs_seen) == (980, 0.98)
    with pytest.raises(data.EpochExhausted, match="--allow-repeat"):
        sampler.next_batch()
    again = data.EpochSampler(tokens, 10, 7, seed=3)
    assert [again.next_indices().tolist() for _ in range(14)] == [seen[i:i + 7] for i in range(0, 98, 7)]
    other = data.EpochSampler(tokens, 10, 7, seed=4)
    assert other.next_indices().tolist() != seen[:7]
    repeat = data.EpochSampler(tokens, 10, 7, seed=3, allow_repeat=True)
    repeat.seek(14)
    second = repeat.next_indices().tolist()
    assert repeat.epoch == 1 and second != seen[:7] and len(set(second)) == 7
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.EpochSampler(tokens[:50], 10, 7)


SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--device", "cpu", "--no-progress", "--backend",
         "eager", "--corpus", "stdlib", "--max-corpus-mb", "0.02", "--eval-batches", "1", "--no-cache"]


def _expected_tokens(manifest: Path, roots: dict) -> dict:
    """Byte tokens of each split, counted from the manifest's files on disk: their UTF-8 text (invalid
    bytes replaced) joined by a blank line."""
    counts = {"train": [], "val": []}
    for f in data.read_manifest(manifest):
        text = (Path(roots[f.root]) / f.relative).read_bytes().decode("utf-8", errors="replace")
        counts[f.split].append(len(text.encode("utf-8")))
    return {k: sum(v) + 2 * (len(v) - 1) for k, v in counts.items()}


def test_train_lm_reads_each_window_once_and_reports_the_counts(tmp_path, capsys, monkeypatch):
    drawn = []
    next_indices = data.EpochSampler.next_indices

    def spy(self):
        drawn.append(next_indices(self).tolist())
        return torch.tensor(drawn[-1])

    monkeypatch.setattr(data.EpochSampler, "next_indices", spy)
    out = tmp_path / "run.json"
    log = train_lm.main(SMALL + ["--steps", "6", "--batch-size", "8", "--seq-len", "32", "--eval-every", "3",
                                 "--out", str(out)])
    printed = capsys.readouterr().out
    windows = [i for batch in drawn for i in batch]
    assert len(drawn) == 6 and len(set(windows)) == len(windows) == 48
    manifest = tmp_path / "run.corpus.tsv"  # --no-cache: the manifest goes next to the log
    assert f"corpus manifest: {manifest}" in printed and log["data"]["manifest"] == str(manifest)
    want = _expected_tokens(manifest, log["data"]["roots"])
    assert (log["train_tokens"], log["val_tokens"]) == (want["train"], want["val"])
    assert f"{want['train']:,} train / {want['val']:,} validation" in printed
    per_epoch = want["train"] // 32
    assert log["data"]["train_windows"] == per_epoch and log["data"]["batches_per_epoch"] == per_epoch // 8
    assert log["tokens_seen"] == 6 * 8 * 32 and log["epochs"] == pytest.approx(48 / per_epoch)
    assert f"tokens seen: {6 * 8 * 32:,} of {want['train']:,} train tokens ({48 / per_epoch:.3f} epochs)" in printed
    assert [(e["step"], e["tokens"]) for e in log["evals"]] == [(3, 3 * 256), (6, 6 * 256)]
    assert json.loads(out.read_text())["data"]["digest"] == log["data"]["digest"]


def test_train_lm_stops_past_one_epoch_unless_allowed(capsys):
    flags = SMALL + ["--batch-size", "64", "--seq-len", "64", "--eval-every", "0"]
    probe = train_lm.main(flags + ["--steps", "1"])
    per_epoch = probe["data"]["batches_per_epoch"]
    with pytest.raises(SystemExit, match="--allow-repeat"):
        train_lm.main(flags + ["--steps", str(per_epoch + 1)])
    capsys.readouterr()
    log = train_lm.main(flags + ["--steps", str(per_epoch + 1), "--allow-repeat"])
    assert f"epoch 2 of the train split starts" in capsys.readouterr().out
    assert log["epochs"] > 1 and log["tokens_seen"] == (per_epoch + 1) * 64 * 64


# ---------------------------------------------------------------------------------- the low-rank baseline


def test_lowrank_linear_computes_the_product_of_its_factors():
    torch.manual_seed(0)
    layer = train_lm.LowRankLinear(48, 80, rank=5)
    layer.reset_parameters(0.02)
    torch.nn.init.normal_(layer.up.bias)
    assert sum(p.numel() for p in layer.parameters()) == 5 * (48 + 80) + 80
    x = torch.randn(3, 7, 48, dtype=torch.float64)
    a, b = layer.down.weight.double(), layer.up.weight.double()  # [5, 48], [80, 5]
    dense = torch.einsum("ok,ki->oi", b, a)  # the rank-5 dense map, [80, 48]
    want = torch.einsum("bti,oi->bto", x, dense) + layer.up.bias.double()
    torch.testing.assert_close(layer.double()(x), want)
    assert torch.linalg.matrix_rank(dense) == 5
    big = train_lm.LowRankLinear(1024, 1024, rank=16)
    big.reset_parameters(0.02)
    product = big.up.weight @ big.down.weight
    assert product.std().item() == pytest.approx(0.02, rel=0.05)  # the dense layer's init std
    assert big.down.weight.std().item() == pytest.approx((0.02**2 / 16) ** 0.25, rel=0.05)


def test_lowrank_flag_factors_every_block_linear():
    args = train_lm.parse_args(["--preset", "gpu", "--lowrank", "37"])
    model = train_lm.build_model(args, 16384, device="meta")
    train_lm.compress(model, args)
    d, r = 768, 37
    per_block = 4 * r * (d + d) + r * (d + 4 * d) + 4 * d + r * (4 * d + d) + d + 2 * 2 * d  # + biases, LayerNorms
    assert train_lm.block_parameters(model) == 6 * per_block
    lows = [m for m in model.blocks.modules() if isinstance(m, train_lm.LowRankLinear)]
    linears = [n for n, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(lows) == 6 * 6 and len(linears) == 2 * 6 * 6 and all(n.endswith((".down", ".up")) for n in linears)
    assert {m.down.out_features for m in lows} == {37}
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.tok_emb.weight
    per_kind = train_lm.parse_args(["--lowrank", "attn=3,mlp=5", "--d-model", "32", "--n-heads", "2"])
    model = train_lm.build_model(per_kind, 256)
    train_lm.compress(model, per_kind)
    assert model.blocks[0].attn.qkv.down.out_features == 3 and model.blocks[0].mlp.fc.down.out_features == 5
    for bad in (["--lowrank", "8", "--tensorize", "8"], ["--lowrank", "8", "--compress", "attn,tok"],
                ["--lowrank", "8", "--compress", "head"], ["--lowrank", "attn=8"], ["--lowrank", "default"]):
        with pytest.raises(SystemExit):
            train_lm.parse_args(bad)


def test_lowrank_act_puts_the_nonlinearity_between_the_factors():
    torch.manual_seed(0)
    x = torch.randn(4, 24, dtype=torch.float64)
    for act, fn in (("silu", lambda z: z * torch.sigmoid(z)), ("gelu", lambda z: 0.5 * z * (1 + torch.erf(z / 2**0.5)))):
        layer = train_lm.LowRankLinear(24, 40, rank=6, act=act).double()
        torch.nn.init.normal_(layer.up.bias)
        want = fn(x @ layer.down.weight.T) @ layer.up.weight.T + layer.up.bias
        torch.testing.assert_close(layer(x), want)
    with pytest.raises(ValueError, match="act must be one of"):
        train_lm.LowRankLinear(8, 8, 2, act="relu6")
    args = train_lm.parse_args(["--lowrank", "3", "--lowrank-act", "silu", "--d-model", "32", "--n-heads", "2"])
    model = train_lm.build_model(args, 256)
    train_lm.compress(model, args)
    assert {m.act for m in model.blocks.modules() if isinstance(m, train_lm.LowRankLinear)} == {"silu"}
    with pytest.raises(SystemExit):  # an activation of no low-rank layer
        train_lm.parse_args(["--lowrank-act", "silu"])


def _btt_reference(layer) -> torch.Tensor:
    """The BTT layer's dense weight, entry by entry from its definition, in float64."""
    b1, b2, c, a, r = layer.b1, layer.b2, layer.c, layer.a, layer.rank
    R, L = layer.R.detach().double(), layer.L.detach().double()
    W = torch.zeros(c * a, b1 * b2, dtype=torch.float64)
    for ci in range(c):
        for ai in range(a):
            for i in range(b1):
                for j in range(b2):
                    W[ci * a + ai, i * b2 + j] = sum(L[ci, i * r + k, ai] * R[i, j, ci * r + k] for k in range(r))
    return W


def test_btt_linear_applies_its_block_tensor_train_weight():
    torch.manual_seed(0)
    for d_in, d_out, rank in ((12, 20, 1), (12, 20, 3), (18, 8, 2)):
        layer = train_lm.BTTLinear(d_in, d_out, rank)
        torch.nn.init.normal_(layer.bias)
        assert layer.b1 * layer.b2 == d_in and layer.c * layer.a == d_out
        assert sum(p.numel() for p in layer.parameters()) == rank * (d_in * layer.c + d_out * layer.b1) + d_out
        W = _btt_reference(layer)
        torch.testing.assert_close(layer.dense_weight().double(), W)
        x = torch.randn(2, 5, d_in, dtype=torch.float64)
        torch.testing.assert_close(layer.double()(x), x @ W.T + layer.bias.double())
    assert train_lm.near_sqrt_factor(768) == 32 and train_lm.near_sqrt_factor(3072) == 64
    assert train_lm.near_sqrt_factor(12) == 4 and train_lm.near_sqrt_factor(13) == 13  # a tie: the larger
    monarch = train_lm.BTTLinear(64, 64, 1).double()  # rank 1 (Monarch) is full-rank in general
    assert torch.linalg.matrix_rank(monarch.dense_weight()) == 64
    big = train_lm.BTTLinear(1024, 1024, rank=2)  # the output has the variance of a dense layer at std 0.02
    x = torch.randn(512, 1024)
    assert big(x).std().item() == pytest.approx((x @ (0.02 * torch.randn(1024, 1024))).std().item(), rel=0.1)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        train_lm.BTTLinear(8, 8, 0)


def test_btt_flag_replaces_every_block_linear():
    args = train_lm.parse_args(["--preset", "gpu", "--btt", "1"])
    model = train_lm.build_model(args, 16384, device="meta")
    train_lm.compress(model, args)
    btts = [m for m in model.blocks.modules() if isinstance(m, train_lm.BTTLinear)]
    assert len(btts) == 6 * 6 and not any(isinstance(m, torch.nn.Linear) for m in model.blocks.modules())
    d = 768  # q, k, v, proj: 2 * 768 * 32; fc 768 -> 3072: 768 * 64 + 3072 * 32, and its transpose
    per_block = 4 * 2 * d * 32 + 2 * (d * 64 + 4 * d * 32) + 4 * d + d + 2 * 2 * d  # + MLP biases, LayerNorms
    assert train_lm.block_parameters(model) == 6 * per_block
    for bad in (["--btt", "1", "--lowrank", "8"], ["--btt", "1", "--tensorize", "8"], ["--btt", "1", "--compress", "tok"],
                ["--btt", "attn=1"], ["--btt", "default"]):
        with pytest.raises(SystemExit):
            train_lm.parse_args(bad)


def test_barrier_times_the_steps_after_it(tmp_path):
    log = train_lm.main(SMALL + ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--eval-every", "0",
                                 "--barrier", str(tmp_path / "b"), "--barrier-step", "2"])
    assert log["alone"] is True and log["alone_from_step"] == 2
    assert log["step_time_s"] == statistics.median(s["seconds"] for s in log["steps"][2:])  # the steps after it
    turn = train_lm.GPUTurn(tmp_path / "c", parties=2, timeout_s=0.3)  # the other party never comes
    assert turn.take() is False
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "ready-other").touch()  # it did
    assert train_lm.GPUTurn(tmp_path / "d", parties=2, timeout_s=5).take() is True
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--barrier", str(tmp_path), "--barrier-step", "0"])


@pytest.mark.parametrize("flag, rank, shrink", [("--lowrank", "4", 5), ("--btt", "1", 3)])
def test_factored_run_trains_and_its_checkpoint_reloads(tmp_path, flag, rank, shrink):
    ckpt = tmp_path / "low.pt"
    flags = SMALL + ["--d-model", "64", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--lr", "1e-2",
                     flag, rank]
    log = train_lm.main(flags + ["--steps", "12", "--save", str(ckpt)])
    assert log["block_parameters"] < log["block_dense_parameters"] / shrink
    assert log["steps"][-1]["loss"] < log["steps"][0]["loss"]
    again = train_lm.main(flags + ["--steps", "1", "--lr", "0", "--init-from", str(ckpt)])
    assert again["steps"][0]["loss"] < log["steps"][0]["loss"] - 0.3  # the trained factors came back
    dense = tmp_path / "dense.pt"
    train_lm.main(SMALL + ["--steps", "1", "--batch-size", "8", "--seq-len", "32", "--d-model", "64", "--save",
                           str(dense)])
    with pytest.raises(RuntimeError, match="dense checkpoint"):
        train_lm.main(flags + ["--steps", "1", "--init-from", str(dense)])


def test_gpu_preset_learning_rate_follows_the_quality_benchmark():
    """--preset gpu starts each compression at the lr that won its row of the benchmark (BENCHMARKS.md
    section 4); an explicit --lr and the cpu preset's are left as given."""
    def lr(*flags):
        return train_lm.parse_args(["--preset", "gpu", *flags]).lr

    assert lr() == 6e-4
    assert lr("--tensorize", "32") == lr("--tensorize", "32", "--fmt", "ttm") == 4.8e-3
    assert lr("--tensorize", "32", "--fmt", "tt") == 1.2e-3
    assert lr("--tensorize", "32", "--fmt", "attn=tt,mlp=ttm") == 1.2e-3  # the smaller of the two
    assert lr("--tensorize", "64", "--rank-adapt", "3.5") == 2.4e-3
    assert lr("--btt", "1") == lr("--tensorize", "1", "--fmt", "btt") == 9.6e-3 and lr("--lowrank", "37") == 2.4e-3
    assert lr("--lowrank", "37", "--lowrank-act", "silu") == 1.2e-3
    assert lr("--tensorize", "32", "--lr", "1e-3") == 1e-3
    assert train_lm.parse_args(["--tensorize", "8"]).lr == 3e-3  # the cpu preset


def test_the_packages_btt_and_the_examples_agree():
    """--tensorize R --fmt btt (cc.TTConfig(fmt="btt")) gives the blocks of --btt R (the example's layer)
    the same block parameters and, from the same cores, the same weights."""
    import comera_compile as cc

    flags = ["--d-model", "192", "--n-heads", "2", "--n-layers", "1"]
    pkg = train_lm.parse_args(flags + ["--tensorize", "2", "--fmt", "btt"])
    ex = train_lm.parse_args(flags + ["--btt", "2"])
    a, b = train_lm.build_model(pkg, 256), train_lm.build_model(ex, 256)
    train_lm.compress(a, pkg)
    train_lm.compress(b, ex)
    gates = sum(g.numel() for lay in cc.iter_tt_layers(a) for g in lay.param.gates)  # the package's rank gates
    assert train_lm.block_parameters(a) == train_lm.block_parameters(b) + gates
    layer = next(lay for lay in cc.iter_tt_layers(a) if lay.fqn == "blocks.0.mlp.fc")
    mine = b.blocks[0].mlp.fc  # the example's R [b1, b2, c * r], L [c, b1 * r, a]
    R, L = layer.param.cores
    with torch.no_grad():
        mine.R.copy_((R * layer.param.gates[0]).reshape(mine.R.shape))
        mine.L.copy_(L.permute(1, 2, 0, 3).reshape(mine.L.shape))
        want = a.blocks[0].mlp.fc.weight
    torch.testing.assert_close(mine.dense_weight(), want)


def test_tt_cores_sets_each_kinds_core_count():
    """--tt-cores N (or per kind) reaches TTConfig.n_cores; it needs --tensorize."""
    def mlp_cores(*flags):
        torch.manual_seed(0)
        model = train_lm.GPT(256, 32, 64, 1, 2)
        train_lm.compress(model, train_lm.parse_args(TINY + ["--d-model", "64", "--tensorize", "4", "--fmt", "ttm",
                                                             *flags]))
        return {lay.spec.n_cores for lay in train_lm.cc.iter_tt_layers(model) if train_lm.layer_kind(lay.fqn) == "mlp"}

    default = mlp_cores()
    assert len(default) == 1
    assert mlp_cores("--tt-cores", "3") == {3} and mlp_cores("--tt-cores", "mlp=4") == {4}
    assert mlp_cores("--tt-cores", "attn=3") == default  # another kind's count leaves mlp alone
    with pytest.raises(SystemExit):
        train_lm.parse_args(TINY + ["--tt-cores", "2"])


def test_core_lr_rule_fan_in_scales_each_cores_sgd_step_exactly():
    """CoreStepScale: with plain SGD each core's update is lr * s_k * grad, s_k = F / (r_{k-1} m_k) with F
    the geometric mean over the layer's cores (checked against the hand-made scales); other parameters
    and the gates are untouched by it; it needs --tensorize."""
    torch.manual_seed(0)
    model = train_lm.GPT(256, 32, 64, 1, 2)
    args = train_lm.parse_args(TINY + ["--d-model", "64", "--tensorize", "4", "--fmt", "ttm", "--core-lr-rule", "fan-in"])
    train_lm.compress(model, args)
    layers = list(train_lm.cc.iter_tt_layers(model))
    assert layers
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_lm.CoreStepScale(model, opt)
    idx = torch.randint(0, 256, (2, 16))
    model(idx, labels=idx).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    for lay in layers:
        spec, flat = lay.param.spec, lay.param.core_flat
        fans = [spec.ranks[k] * m for k, (m, _) in enumerate(spec.chain_modes)]
        mean = math.exp(sum(map(math.log, fans)) / len(fans))
        want = torch.cat([torch.full((math.prod(s),), mean / f) for s, f in zip(spec.core_shapes, fans)])
        name = names[id(flat)]
        torch.testing.assert_close(before[name] - flat.detach(), 0.1 * want * grads[name], rtol=1e-5, atol=1e-7)
        gname = names[id(lay.param.gate_flat)]
        if gname in grads:
            torch.testing.assert_close(before[gname] - lay.param.gate_flat.detach(), 0.1 * grads[gname])
    with pytest.raises(SystemExit):
        train_lm.parse_args(TINY + ["--core-lr-rule", "fan-in"])
