"""The example's corpus and tokenizers: the running interpreter's own Python sources, no download.

Two corpora (``--corpus``):

* ``stdlib``: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded);
  about 30 MB, the CPU default;
* ``python``: the standard library and every ``*.py`` file of the installed packages
  (``sysconfig``'s ``purelib`` and ``platlib``), the GPU default: as large as what is installed.

Files are listed in sorted order (root by root: stdlib, purelib, platlib; then by path relative to
the root) and deduplicated by content (the sha1 of their bytes): of files with the same bytes, the first
in that order is kept, whatever cap is set. Each file is named ``ROOT/RELATIVE`` (e.g.
``purelib/torch/nn/functional.py``); the name decides its split (``crc32(name) % 10000 < val_fraction *
10000``: validation) and its place in the corpus (files are read in the order of ``sha1(name)``, so a
``max_bytes`` cap takes a random-like sample of every package, not the first ones alphabetically; each
split takes files until it holds its share of the cap). Both depend on the name alone, so a file is in
the same split on every run and at every cap. The files a corpus holds are listed in its manifest
(:meth:`Corpus.write_manifest`).

Training reads the train split through :class:`EpochSampler`: non-overlapping windows in a seeded random
order, each once per epoch. Validation is a fixed set of evenly spaced windows (:meth:`TokenData.eval_batches`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

FILE_SEPARATOR = "\n\n"
BPE_TRAINING_CHARS = 8_000_000
CORPORA = ("stdlib", "python")
ROOT_ORDER = ("stdlib", "purelib", "platlib")
ORDER = "sha1(ROOT/RELATIVE)"  # the order files are read in (and a cap takes them)
SPLIT_RULE = "crc32(ROOT/RELATIVE) % 10000 < val_fraction * 10000: validation"


@dataclass(frozen=True)
class SourceFile:
    """One file of a corpus, as its manifest lists it."""

    root: str  # stdlib, purelib or platlib
    relative: str  # path under the root, with "/"
    sha1: str  # of its bytes
    bytes: int
    split: str  # "train" or "val"

    @property
    def name(self) -> str:
        return f"{self.root}/{self.relative}"


@dataclass
class Corpus:
    """The train and validation text of a corpus, and the files it was read from (in reading order).

    ``train_text`` and ``val_text`` are None once :func:`load_token_data` has tokenized them."""

    name: str
    roots: dict[str, Path]
    train_text: str | None
    val_text: str | None
    files: list[SourceFile] = field(default_factory=list)
    duplicates: int = 0  # files left out as byte-for-byte copies of a file earlier in sorted order
    max_bytes: int | None = None
    val_fraction: float = 0.05

    @property
    def root(self) -> Path:
        """The first root (the standard library)."""
        return next(iter(self.roots.values()))

    @property
    def num_train_files(self) -> int:
        return sum(f.split == "train" for f in self.files)

    @property
    def num_val_files(self) -> int:
        return sum(f.split == "val" for f in self.files)

    @property
    def num_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def digest(self) -> str:
        """sha256 of the manifest's entries in order: the same digest, the same text (whatever the roots' paths)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.root}\t{f.relative}\t{f.sha1}\t{f.bytes}\t{f.split}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def manifest(self) -> str:
        """The corpus as a tab-separated table: ``#`` lines (how it was made), then one row a file,
        in the order the files are read."""
        roots = "; ".join(f"{name}={path}" for name, path in self.roots.items())
        lines = [f"# corpus {self.name}: {len(self.files)} files ({self.num_train_files} train, "
                 f"{self.num_val_files} val), {self.num_bytes} bytes, {self.duplicates} duplicates left out",
                 f"# roots: {roots}",
                 f"# order: {ORDER}; split: {SPLIT_RULE} (val_fraction {self.val_fraction}); "
                 f"cap: {self.max_bytes if self.max_bytes is not None else 'none'} bytes",
                 f"# digest: {self.digest}",
                 "root\trelative\tsha1\tbytes\tsplit"]
        lines += [f"{f.root}\t{f.relative}\t{f.sha1}\t{f.bytes}\t{f.split}" for f in self.files]
        return "\n".join(lines) + "\n"

    def write_manifest(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda f: f.write(self.manifest().encode("utf-8", "surrogateescape")))
        return path


def read_manifest(path: Path) -> list[SourceFile]:
    """The files a manifest lists (what :meth:`Corpus.manifest` wrote)."""
    files = []
    for line in Path(path).read_text(encoding="utf-8", errors="surrogateescape").splitlines():
        if line.startswith("#") or line == "root\trelative\tsha1\tbytes\tsplit" or not line:
            continue
        root, relative, sha1, size, split = line.split("\t")
        files.append(SourceFile(root, relative, sha1, int(size), split))
    return files


def corpus_roots(corpus: str = "stdlib") -> dict[str, Path]:
    """``{root name: directory}`` of a corpus: the standard library, and for ``python`` the
    installed packages too (``platlib`` left out where it is ``purelib``)."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; valid choices: {', '.join(CORPORA)}")
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"]).resolve()}
    if corpus == "python":
        for name in ("purelib", "platlib"):
            path = Path(paths[name]).resolve()
            if path.is_dir() and path not in roots.values():
                roots[name] = path
    return roots


def python_files(roots: dict[str, Path]) -> list[tuple[str, str, Path, int]]:
    """``(root name, relative path, path, size)`` of every ``*.py`` file under ``roots``, in sorted
    order (roots in the order given, then relative paths). A root's walk follows no links to
    directories and skips ``__pycache__``, the other roots (site-packages inside the standard library's
    directory) and, for ``stdlib``, any ``site-packages`` or ``dist-packages``."""
    resolved = {name: str(Path(path).resolve()) for name, path in roots.items()}
    out = []
    for name, root in resolved.items():
        others = {p for n, p in resolved.items() if n != name}
        skip = {"__pycache__"} | ({"site-packages", "dist-packages"} if name == "stdlib" else set())
        found, stack = [], [""]
        while stack:
            relative_dir = stack.pop()
            directory = os.path.join(root, relative_dir) if relative_dir else root
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                relative = f"{relative_dir}/{entry.name}" if relative_dir else entry.name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if entry.name not in skip and entry.path not in others:
                            stack.append(relative)
                    elif entry.name.endswith(".py") and entry.is_file():  # a link to a file counts
                        found.append((name, relative, Path(entry.path), entry.stat().st_size))
                except OSError:  # a broken link, a file gone meanwhile
                    continue
        out += sorted(found, key=lambda f: f[1])
    return out


def stdlib_python_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library, sorted by relative path, without site-packages."""
    roots = {"stdlib": Path(root or sysconfig.get_paths()["stdlib"])}
    return [path for _, _, path, _ in python_files(roots)]


def _split_of(name: str, val_fraction: float) -> str:
    return "val" if zlib.crc32(name.encode("utf-8", "surrogateescape")) % 10_000 < val_fraction * 10_000 else "train"


def _order_key(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()


def load_corpus(corpus: str = "stdlib", val_fraction: float = 0.05, max_bytes: int | None = None,
                roots: dict[str, Path] | None = None) -> Corpus:
    """Read a corpus (:data:`CORPORA`, or the ``*.py`` files under ``roots``) and split it by file.

    ``max_bytes`` caps the bytes read: files are taken in the order of the sha1 of their names, each
    into its split until that split holds its share of the cap (``val_fraction`` of it for validation;
    its last file makes it a little more), then only into the other, until both do. A file whose
    bytes equal those of a file earlier in sorted order is left out (counted in ``duplicates``), also
    when that one is past the cap.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    roots = {name: Path(path).resolve() for name, path in (roots or corpus_roots(corpus)).items()}
    listed = python_files(roots)
    if not listed:
        raise RuntimeError(f"no *.py files found under {', '.join(map(str, roots.values()))}")
    by_size: dict[int, list[int]] = {}  # size -> indices in sorted order: only files of one size can be equal
    for i, (_, _, _, size) in enumerate(listed):
        by_size.setdefault(size, []).append(i)
    hashes: dict[int, str] = {}

    def sha1_of(i: int, data: bytes | None = None) -> str:
        if i not in hashes:
            hashes[i] = hashlib.sha1(listed[i][2].read_bytes() if data is None else data).hexdigest()
        return hashes[i]

    order = sorted(range(len(listed)), key=lambda i: _order_key(f"{listed[i][0]}/{listed[i][1]}"))
    texts = {"train": [], "val": []}
    files, duplicates, size = [], 0, {"train": 0, "val": 0}
    share = None if max_bytes is None else {"train": (1 - val_fraction) * max_bytes, "val": val_fraction * max_bytes}
    for i in order:
        root, relative, path, _ = listed[i]
        try:
            data = path.read_bytes()
        except OSError:
            continue
        digest = sha1_of(i, data)
        if any(j < i and len(data) == listed[j][3] and sha1_of(j) == digest for j in by_size.get(len(data), ())):
            duplicates += 1
            continue
        split = _split_of(f"{root}/{relative}", val_fraction)
        if share is not None and size[split] >= share[split]:
            continue  # this split holds its share of the cap: only the other one takes files now
        files.append(SourceFile(root, relative, digest, len(data), split))
        texts[split].append(data.decode("utf-8", errors="replace"))
        size[split] += len(data)
        if share is not None and all(size[k] >= share[k] and texts[k] for k in size):
            break
    if not texts["val"]:  # a corpus of a few files: keep one for validation
        last = max(k for k, f in enumerate(files) if f.split == "train")
        files[last] = SourceFile(*[getattr(files[last], a) for a in ("root", "relative", "sha1", "bytes")], "val")
        texts["val"].append(texts["train"].pop())
    if not texts["train"]:
        raise RuntimeError(f"the corpus under {', '.join(map(str, roots.values()))} has no training file")
    return Corpus(corpus, roots, FILE_SEPARATOR.join(texts["train"]), FILE_SEPARATOR.join(texts["val"]), files,
                  duplicates, max_bytes, val_fraction)


def load_stdlib_corpus(val_fraction: float = 0.05, max_bytes: int | None = None, root: Path | None = None) -> Corpus:
    """The ``stdlib`` corpus (:func:`load_corpus`)."""
    roots = {"stdlib": Path(root)} if root is not None else None
    return load_corpus("stdlib", val_fraction, max_bytes, roots)


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


class EpochSampler:
    """Training batches that visit every window of the train split once per epoch.

    The split is cut into ``len(tokens) // seq_len`` non-overlapping windows of ``seq_len`` tokens
    (the model shifts its labels itself: no extra target token); the tokens after the last whole
    window are never used. Each epoch visits the windows in its own random permutation (seeded by
    ``seed`` and the epoch) and ends after ``windows // batch_size`` batches (the ``windows %
    batch_size`` windows left over that epoch are skipped), so a batch never holds a window twice
    and within an epoch no window comes back. Past the first epoch, :meth:`next_batch` raises
    unless ``allow_repeat``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0,
                 allow_repeat: bool = False) -> None:
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}")
        self.num_windows = tokens.numel() // seq_len
        if self.num_windows < batch_size:
            raise ValueError(f"the train split has {tokens.numel():,} tokens: {self.num_windows} windows of "
                             f"--seq-len {seq_len}, fewer than one batch of --batch-size {batch_size}")
        self.windows = tokens[: self.num_windows * seq_len].view(self.num_windows, seq_len)
        self.seq_len, self.batch_size, self.seed, self.allow_repeat = seq_len, batch_size, seed, allow_repeat
        self.batches_per_epoch = self.num_windows // batch_size
        self.batches = 0  # batches drawn so far, all epochs
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0: the first)."""
        return self.batches // self.batches_per_epoch

    @property
    def windows_seen(self) -> int:
        return self.batches * self.batch_size

    @property
    def tokens_seen(self) -> int:
        return self.windows_seen * self.seq_len

    @property
    def epochs_seen(self) -> float:
        """Windows drawn / windows in the split (repeats counted)."""
        return self.windows_seen / self.num_windows

    def epochs_for(self, batches: int) -> float:
        return batches * self.batch_size / self.num_windows

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the windows in ``epoch``: the same for the same seed, epoch and split."""
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            self._perm = (epoch, torch.randperm(self.num_windows, generator=generator))
        return self._perm[1]

    def seek(self, batches: int) -> None:
        """Go on after ``batches`` batches (a resumed run at step ``batches``)."""
        self.batches = batches

    def next_indices(self) -> torch.Tensor:
        """The window indices of the next batch (the windows are ``tokens[i * seq_len : (i + 1) * seq_len]``)."""
        epoch, k = divmod(self.batches, self.batches_per_epoch)
        if epoch >= 1 and not self.allow_repeat:
            raise EpochExhausted(
                f"one epoch of the train split ({self.num_windows:,} windows of {self.seq_len} tokens, "
                f"{self.batches_per_epoch:,} batches of {self.batch_size}) is used up after {self.batches:,} "
                "batches: lower --steps, use a larger corpus (--max-corpus-mb, --corpus python) or pass "
                "--allow-repeat to train on a second epoch")
        indices = self.permutation(epoch)[k * self.batch_size : (k + 1) * self.batch_size]
        self.batches += 1
        return indices

    def next_batch(self) -> torch.Tensor:
        """The next batch, int64 ``[batch_size, seq_len]`` on CPU."""
        return self.windows[self.next_indices()].long()


class EpochExhausted(RuntimeError):
    """The sampler was asked for a batch past its first epoch without ``allow_repeat``."""


@dataclass
class TokenData:
    train: torch.Tensor  # 1-D token ids (uint8 for bytes, int32 for BPE)
    val: torch.Tensor
    tokenizer: ByteTokenizer | BPETokenizer
    corpus: Corpus  # its files and counts; the text is dropped once tokenized
    seconds: float  # time spent reading and tokenizing (or loading the cache)
    cache: Path | None = None  # where the tokenizer and tokens were cached
    from_cache: bool = False
    manifest: Path | None = None  # the corpus' manifest (written in the cache directory)

    def sampler(self, batch_size: int, seq_len: int, seed: int = 0, allow_repeat: bool = False) -> EpochSampler:
        """The training batches: every window of the train split once per epoch (:class:`EpochSampler`)."""
        return EpochSampler(self._split("train", seq_len), seq_len, batch_size, seed, allow_repeat)

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
    corpus: str = "stdlib",
) -> TokenData:
    """A corpus (:data:`CORPORA`), tokenized: what the example trains on.

    With ``cache_dir``, the corpus' manifest is written there (``corpus-NAME-DIGEST.tsv``), and a
    trained BPE tokenizer and the tokenized splits are stored there, keyed by the corpus (its
    manifest's digest) and the tokenizer settings; later runs load them instead of training again.
    A file lock makes concurrent runs wait for the first one rather than all training at once.
    """
    start = time.perf_counter()
    source = load_corpus(corpus, val_fraction=val_fraction, max_bytes=max_bytes)
    manifest = None
    if cache_dir is not None:
        manifest = Path(cache_dir) / f"corpus-{source.name}-{source.digest[:16]}.tsv"
        if not manifest.exists():
            source.write_manifest(manifest)
    if cache_dir is None or tokenizer == "bytes":  # bytes: encoding is a copy, nothing worth caching
        tok = build_tokenizer(tokenizer, source.train_text, vocab_size)
        train, val = tok.encode(source.train_text), tok.encode(source.val_text)
        source.train_text = source.val_text = None
        return TokenData(train, val, tok, source, time.perf_counter() - start, manifest=manifest)
    entry = Path(cache_dir) / _cache_key(source, tokenizer, vocab_size)
    tok, train, val, hit = _load_or_build_cached(entry, source, tokenizer, vocab_size)
    source.train_text = source.val_text = None
    return TokenData(train, val, tok, source, time.perf_counter() - start, cache=entry, from_cache=hit,
                     manifest=manifest)


def _cache_key(corpus: Corpus, tokenizer: str, vocab_size: int | None) -> str:
    h = hashlib.sha256(corpus.digest.encode())  # the manifest's digest fixes the text
    h.update(f"|{FILE_SEPARATOR!r}|{tokenizer}|{vocab_size}|{BPE_TRAINING_CHARS}|{_tokenizers_version()}".encode())
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
