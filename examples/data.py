"""The example's corpus and tokenizers: the running interpreter's own standard library, no download.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (third-party packages in
``site-packages`` excluded), read in sorted order. Files are split between train and validation by a
hash of their relative path, so the split is the same on every run and does not depend on file order.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

FILE_SEPARATOR = "\n\n"
BPE_TRAINING_CHARS = 8_000_000


@dataclass
class Corpus:
    """Raw text of the train and validation files, and where it came from."""

    root: Path
    train_text: str
    val_text: str
    num_train_files: int
    num_val_files: int


def stdlib_python_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library, sorted by relative path, without site-packages."""
    paths = sysconfig.get_paths()
    root = Path(root or paths["stdlib"]).resolve()
    excluded = {Path(paths[key]).resolve() for key in ("purelib", "platlib")}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in {"site-packages", "dist-packages", "__pycache__"} and (here / d).resolve() not in excluded
        )
        files.extend(here / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def load_stdlib_corpus(val_fraction: float = 0.05, max_bytes: int | None = None, root: Path | None = None) -> Corpus:
    """Read the standard library's sources and split them by file into train and validation text.

    ``max_bytes`` caps the total size read (files are taken in sorted order), for quick runs.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root = Path(root or sysconfig.get_paths()["stdlib"]).resolve()
    files = stdlib_python_files(root)
    if not files:
        raise RuntimeError(f"no *.py files found under the standard library directory {root}")
    train, val, total = [], [], 0
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        relative = path.relative_to(root).as_posix()
        bucket = val if zlib.crc32(relative.encode()) % 10_000 < val_fraction * 10_000 else train
        bucket.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes and train and val:
            break
    if not val:  # tiny caps: keep at least one file for validation
        val.append(train.pop())
    return Corpus(root, FILE_SEPARATOR.join(train), FILE_SEPARATOR.join(val), len(train), len(val))


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to train, no dependency."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        data = bytearray(text.encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE tokenizer trained on the train split with the ``tokenizers`` package."""

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, train_text: str, vocab_size: int) -> "BPETokenizer":
        tokenizers = _import_tokenizers()
        if vocab_size < 257:
            raise ValueError(f"--vocab-size must be at least 257 for BPE (256 byte tokens + merges), got {vocab_size}")
        byte_level = tokenizers.pre_tokenizers.ByteLevel
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
        tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=byte_level.alphabet(), show_progress=False
        )
        chunks = list(_chunks(train_text))
        stride = max(1, len(train_text) // BPE_TRAINING_CHARS)  # an even sample of the corpus is enough for merges
        tokenizer.train_from_iterator(chunks[::stride], trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> "BPETokenizer":
        return cls(_import_tokenizers().Tokenizer.from_str(text))

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    def encode(self, text: str) -> torch.Tensor:
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)  # fast: no offsets
        encodings = encode(list(_chunks(text)))
        ids = [i for encoding in encodings for i in encoding.ids]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def _import_tokenizers():
    try:
        import tokenizers
        import tokenizers.decoders
        import tokenizers.models
        import tokenizers.pre_tokenizers
        import tokenizers.trainers
    except ImportError as error:
        raise ImportError(
            "--tokenizer bpe needs the optional 'tokenizers' package: "
            "pip install tokenizers  (or pip install 'comera-compile[examples]'); "
            "the default --tokenizer bytes needs nothing"
        ) from error
    return tokenizers


def _chunks(text: str, size: int = 1 << 16):
    """Split text at line ends into pieces of about ``size`` characters (the BPE library parallelizes over them)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def build_tokenizer(kind: str, train_text: str, vocab_size: int | None = None):
    if kind == "bytes":
        if vocab_size not in (None, 256):
            raise ValueError(f"--vocab-size applies to --tokenizer bpe only (bytes always has 256), got {vocab_size}")
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.train(train_text, vocab_size or 4096)
    raise ValueError(f"unknown tokenizer {kind!r}; valid choices: 'bytes', 'bpe'")


@dataclass
class TokenData:
    train: torch.Tensor  # 1-D token ids (uint8 for bytes, int32 for BPE)
    val: torch.Tensor
    tokenizer: ByteTokenizer | BPETokenizer
    corpus: Corpus
    seconds: float  # time spent reading and tokenizing (or loading the cache)
    cache: Path | None = None  # where the tokenizer and tokens were cached
    from_cache: bool = False

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """Random windows of ``seq_len`` tokens as int64 ``[batch_size, seq_len]`` (on CPU)."""
        data = self._split(split, seq_len)
        starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
        return torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()

    def eval_batches(self, batch_size: int, seq_len: int, num_batches: int) -> list[torch.Tensor]:
        """The validation set: ``num_batches`` batches of windows evenly spaced over the validation
        split. Fixed by the corpus and the shapes alone (no seed), so every run is scored on the same tokens."""
        data = self._split("val", seq_len)
        starts = torch.linspace(0, data.numel() - seq_len - 1, batch_size * num_batches).long()
        windows = torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()
        return list(windows.split(batch_size))

    def _split(self, split: str, seq_len: int) -> torch.Tensor:
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len:
            raise ValueError(f"the {split} split has {data.numel()} tokens, fewer than --seq-len {seq_len}")
        return data


def load_token_data(
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    max_bytes: int | None = None,
    val_fraction: float = 0.05,
    cache_dir: Path | None = None,
) -> TokenData:
    """The standard-library corpus, tokenized: what the example trains on.

    With ``cache_dir``, a trained BPE tokenizer and the tokenized splits are stored there, keyed by
    the corpus text and the tokenizer settings, and later runs load them instead of training again.
    A file lock makes concurrent runs wait for the first one rather than all training at once.
    """
    start = time.perf_counter()
    corpus = load_stdlib_corpus(val_fraction=val_fraction, max_bytes=max_bytes)
    if cache_dir is None or tokenizer == "bytes":  # bytes: encoding is a copy, nothing worth caching
        tok = build_tokenizer(tokenizer, corpus.train_text, vocab_size)
        train, val = tok.encode(corpus.train_text), tok.encode(corpus.val_text)
        return TokenData(train, val, tok, corpus, time.perf_counter() - start)
    entry = Path(cache_dir) / _cache_key(corpus, tokenizer, vocab_size)
    tok, train, val, hit = _load_or_build_cached(entry, corpus, tokenizer, vocab_size)
    return TokenData(train, val, tok, corpus, time.perf_counter() - start, cache=entry, from_cache=hit)


def _cache_key(corpus: Corpus, tokenizer: str, vocab_size: int | None) -> str:
    h = hashlib.sha256()
    for part in (corpus.train_text, corpus.val_text):
        h.update(part.encode("utf-8", errors="replace"))
        h.update(b"\0")
    h.update(f"{tokenizer}|{vocab_size}|{BPE_TRAINING_CHARS}|{_tokenizers_version()}".encode())
    return f"{tokenizer}-{vocab_size or 'default'}-{h.hexdigest()[:16]}"


def _tokenizers_version() -> str:
    try:
        import tokenizers
    except ImportError:
        return "none"
    return tokenizers.__version__


def _load_or_build_cached(entry: Path, corpus: Corpus, tokenizer: str, vocab_size: int | None):
    """(tokenizer, train ids, val ids, whether the cache had them), building the entry under a lock."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(entry.with_suffix(".lock")):
        if (entry / "tokens.pt").exists():
            tok = BPETokenizer.from_json((entry / "tokenizer.json").read_text())
            tokens = torch.load(entry / "tokens.pt", weights_only=True)
            return tok, tokens["train"], tokens["val"], True
        tok = build_tokenizer(tokenizer, corpus.train_text, vocab_size)
        train, val = tok.encode(corpus.train_text), tok.encode(corpus.val_text)
        entry.mkdir(exist_ok=True)
        _atomic_write(entry / "tokenizer.json", lambda f: f.write(tok.to_json().encode()))
        _atomic_write(entry / "tokens.pt", lambda f: torch.save({"train": train, "val": val}, f))
        return tok, train, val, False


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock held while the block runs (POSIX ``flock``; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: concurrent first runs may each build the cache
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
