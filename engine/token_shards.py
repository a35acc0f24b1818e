"""Token shards: pre-tokenised data on disk, read as fixed-length windows. A folder holds
``index.json`` and ``shard-00000.npy``, ... of token ids (``uint16`` or ``uint32``),
memory-mapped; ``engine-run shards`` writes one. :class:`TokenShards` is a map-style
dataset of windows (docs/data.md). numpy is required: imported only when a recipe uses it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from engine.atomic_io import atomic_write, atomic_write_text
from engine.errors import ConfigError, first_line, warn

INDEX = "index.json"
FORMAT = "ddp-engine token shards"
VERSION = 1
DTYPES = ("uint16", "uint32")
WRITE_HINT = "write one with: engine-run shards TEXT... --out DIR"


def read_index(folder: str | pathlib.Path) -> dict:
    """The folder's index, checked: a one-line ConfigError names what is wrong."""
    path = (folder := pathlib.Path(folder)) / INDEX
    if not path.is_file():
        what = "does not exist" if not folder.exists() else f"has no {INDEX}"
        raise ConfigError(f"token shards {folder} {what}; {WRITE_HINT}")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"token shards: cannot read {path} ({exc}); {WRITE_HINT}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"token shards: {path} is not a token-shard index (no "
                          f"\"format\": {FORMAT!r}); {WRITE_HINT}")
    if problem := _index_problem(index):
        raise ConfigError(f"token shards: {path} {problem}; {WRITE_HINT}")
    return index


def _index_problem(index: dict) -> str | None:
    def bad(key: str, got, what: str) -> str:
        return f'has no "{key}" ({what})' if got is None else f'has "{key}" {got!r}, not {what}'

    if index.get("version") != VERSION or index.get("dtype") not in DTYPES:
        return (f"has version {index.get('version')!r} and dtype {index.get('dtype')!r}; "
                f"this engine reads version {VERSION} with a dtype of {', '.join(DTYPES)}")
    if type(index.get("vocab_size")) is not int or index["vocab_size"] < 1:
        return bad("vocab_size", index.get("vocab_size"), "a vocabulary size")
    if not isinstance(index.get("shards"), list):
        return bad("shards", index.get("shards"), "a list of shards")
    for k, shard in enumerate(index["shards"]):
        shard = shard if isinstance(shard, dict) else {}
        file, tokens = shard.get("file"), shard.get("tokens")
        if not isinstance(file, str) or not file or pathlib.PurePath(file).name != file:
            return f"in shard {k}: " + bad("file", file, "a file name in the folder")
        if type(tokens) is not int or tokens < 0:
            return f"in shard {file}: " + bad("tokens", tokens, "a count")
    return None


class TokenShards(Dataset):
    """A shard folder's windows: ``dataset[i]`` is ``(inputs, targets)``, int64 tensors of
    ``seq_len`` tokens, the targets shifted by one. A state part (``ctx.add_state("shards",
    dataset)``): snapshots keep the index's sha256; a resume on rewritten shards says so."""

    def __init__(self, folder: str | pathlib.Path, seq_len: int):
        if seq_len < 1:
            raise ConfigError(f"token shards: seq_len must be >= 1, got {seq_len}")
        self.folder, self.seq_len = pathlib.Path(folder), seq_len
        self.index = read_index(self.folder)
        self.index_sha256 = hashlib.sha256((self.folder / INDEX).read_bytes()).hexdigest()
        self.dtype, self.vocab_size = np.dtype(self.index["dtype"]), int(self.index["vocab_size"])
        self.files, counts = [], []
        for shard in self.index["shards"]:
            path = self.folder / shard["file"]
            try:  # a memory map: only the header is read here
                found = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                raise ConfigError(f"token shards: cannot read shard {path} ({exc}); "
                                  f"{WRITE_HINT}") from None
            if found.dtype != self.dtype or found.shape != (shard["tokens"],):
                raise ConfigError(f"token shards: {path} holds {found.shape} {found.dtype}, "
                                  f"the index says ({shard['tokens']},) {self.dtype}; was "
                                  "the folder written twice? write it again")
            # Once per shard, not per window: an IndexError in the middle of training.
            if len(found) and (top := int(found.max())) >= self.vocab_size:
                raise ConfigError(f"token shards: {path} holds token id {top}, not below "
                                  f"the vocabulary size {self.vocab_size} of its {INDEX}; "
                                  "write it again with the tokenizer it names")
            self.files.append(path)
            counts.append(shard["tokens"] // (seq_len + 1))
        #: starts[k]: the global index of shard k's first window; starts[-1]: the total.
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        if self.starts[-1] == 0:
            longest = max((s["tokens"] for s in self.index["shards"]), default=0)
            raise ConfigError(f"token shards {self.folder}: no window of seq_len + 1 = "
                              f"{seq_len + 1} tokens fits in any shard (the longest has "
                              f"{longest} tokens); use a shorter seq_len or more text per shard")
        self._maps: list | None = None

    @property
    def tokens(self) -> int:  # in the index's shards, those that no window reads too
        return sum(shard["tokens"] for shard in self.index["shards"])

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self):  # a worker opens its own maps
        return {**self.__dict__, "_maps": None}

    def window(self, index: int) -> np.ndarray:  # its seq_len + 1 tokens: a view of the map
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        if self._maps is None:
            self._maps = [np.load(path, mmap_mode="r") for path in self.files]
        shard = bisect.bisect_right(self.starts, index) - 1
        start = (index - self.starts[shard]) * (self.seq_len + 1)
        return self._maps[shard][start:start + self.seq_len + 1]

    def __getitem__(self, index: int):
        window = torch.from_numpy(self.window(int(index)).astype(np.int64))
        return window[:-1], window[1:]

    def state_dict(self) -> dict:
        return {"index_sha256": self.index_sha256}

    def load_state_dict(self, state: dict) -> None:
        """A warning, not a refusal: a rewrite (more text, a fixed file) may be meant."""
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if rank0 and state.get("index_sha256") not in (None, self.index_sha256):
            warn(f"token shards {self.folder}: {INDEX} changed since the snapshot (sha256 "
                 f"{state['index_sha256'][:12]}, now {self.index_sha256[:12]}): the resume "
                 "reads other tokens; write them back, or --no-resume to train on these")


# ------------------------------------------------------------------ writing shards


def bytes_tokenizer() -> tuple[Callable[[str], list[int] | np.ndarray], int, str]:
    """UTF-8 bytes: a vocabulary of 256 that fits every text, without a file."""
    return (lambda text: np.frombuffer(text.encode(), dtype=np.uint8)), 256, "bytes"


def hf_tokenizer(path: str) -> tuple[Callable[[str], list[int]], int, str]:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` package, imported here)."""
    try:
        from tokenizers import Tokenizer  # optional (an extra): only for --tokenizer
    except ImportError:
        raise ConfigError(f"--tokenizer {path}: a tokenizer file needs the tokenizers "
                          "package (pip install tokenizers); or use --tokenizer bytes") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - its errors are plain Exceptions
        raise ConfigError(f"--tokenizer {path}: not a Hugging Face tokenizer.json "
                          f"({first_line(exc, type(exc).__name__)})") from None
    return (lambda text: tokenizer.encode(text).ids), tokenizer.get_vocab_size(), str(path)


def text_blocks(paths: Iterable[str | pathlib.Path], block_chars: int) -> Iterator[str]:
    """The files' text in blocks of about ``block_chars`` characters cut after a line's end."""
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            carry = ""
            while block := read_text(f, path, block_chars):
                cut = (block := carry + block).rfind("\n") + 1
                carry = block[cut:]
                if cut:
                    yield block[:cut]
            if carry:
                yield carry


def read_text(f, path, chars: int) -> str:
    try:
        return f.read(chars)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"shards: {path} is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start} of a block); give UTF-8 text files") from None


def write_shards(texts: list[str | pathlib.Path], out: str | pathlib.Path, *,
                 tokenizer: str = "bytes", shard_tokens: int = 100_000_000,
                 block_chars: int = 1 << 24) -> dict:
    """Tokenise ``texts`` (UTF-8 files, concatenated) into shards of ``shard_tokens`` tokens
    in ``out``, written beside it first (a failure leaves ``out``), its index last."""
    if shard_tokens < 2:
        raise ConfigError(f"--shard-tokens must be >= 2, got {shard_tokens}")
    for text in texts:
        if not pathlib.Path(text).is_file():
            raise ConfigError(f"shards: {text}: no such file; give UTF-8 text files")
    encode, vocab_size, name = (bytes_tokenizer() if tokenizer == "bytes"
                                else hf_tokenizer(tokenizer))
    dtype = np.dtype("uint16" if vocab_size <= 1 << 16 else "uint32")
    (out := pathlib.Path(out)).parent.mkdir(parents=True, exist_ok=True)
    shards, pending, held = [], [], 0

    def flush(count: int) -> None:
        nonlocal pending, held
        tokens = np.concatenate(pending) if pending else np.zeros(0, dtype)
        shard, rest = tokens[:count], tokens[count:]
        file = f"shard-{len(shards):05d}.npy"
        _, xxh3 = atomic_write(work / file, lambda f: np.save(f, shard), sync_directory=False)
        shards.append({"file": file, "tokens": int(len(shard)), "xxh3_128": xxh3})
        pending, held = [rest], len(rest)

    with tempfile.TemporaryDirectory(prefix=f".{out.name}.writing-", dir=out.parent) as tmp:
        work = pathlib.Path(tmp)
        for block in text_blocks(texts, block_chars):
            pending.append(ids := np.asarray(encode(block), dtype=dtype))
            held += len(ids)
            while held >= shard_tokens:
                flush(shard_tokens)
        if held or not shards:
            flush(held)
        out.mkdir(exist_ok=True)
        (out / INDEX).unlink(missing_ok=True)  # unfinished until the new index is written
        for old in out.glob("shard-*.npy"):  # an earlier write's, maybe more of them
            old.unlink()
        for shard in shards:
            os.replace(work / shard["file"], out / shard["file"])
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "vocab_size": vocab_size,
             "tokenizer": name, "sources": [str(t) for t in texts], "shards": shards}
    atomic_write_text(out / INDEX, json.dumps(index, indent=1) + "\n")
    return index
