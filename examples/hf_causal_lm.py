"""A Hugging Face causal language model on a Hugging Face ``datasets`` dataset.

    python examples/hf_causal_lm.py make-data data/hf          # example data, no download
    engine-run examples/hf_causal_lm.py data.disk=data/hf/disk                 # map-style
    engine-run examples/hf_causal_lm.py data.files='data/hf/train-*.jsonl' \\
        data.val_files=data/hf/val.jsonl                                       # streaming
    engine-run examples/hf_causal_lm.py data.disk=data/hf/disk model.kind=llama

Needs ``pip install 'ddp-engine[hf]'`` (transformers, datasets; ``torchdata`` for the
streaming path). Nothing is downloaded: the model is built from a small config
(``GPT2Config`` or ``LlamaConfig``, random weights) and the tokenisation is done here,
UTF-8 bytes plus an end-of-text token (a vocabulary of 257, no tokenizer file). The
example sets ``HF_HUB_OFFLINE=1`` and ``HF_DATASETS_OFFLINE=1`` unless they are set, so
a run never reaches for the hub.

The data is records with a ``text`` column, cut into windows of ``model.context + 1``
tokens (each record's bytes and an end-of-text token, concatenated over
``data.group_records`` records at a time; the tokens left over at the end of a group fill
no window), in one of two ways:

- ``data.disk=DIR``: a ``datasets.DatasetDict`` (``train`` and optionally
  ``validation``) or a ``Dataset`` written with ``save_to_disk`` and read back with
  ``datasets.load_from_disk``. Its windows are a map-style dataset (made in memory), so
  the engine shards, shuffles by (seed, epoch) and resumes it exactly at any number of
  processes, as any indexable dataset.
- ``data.files=PATTERNS``: local ``.jsonl``/``.json`` or ``.txt`` files (comma-separated,
  globs allowed) read with ``datasets.load_dataset(..., streaming=True)``: an
  ``IterableDataset`` that reads the files in order, nothing loaded ahead. It shards
  itself (``datasets.distributed.split_dataset_by_node`` over the processes, and
  ``datasets`` gives each DataLoader worker its files), so it says so
  (``shards_itself = True``), and it has ``state_dict``/``load_state_dict``, so the engine
  keeps every worker's position in its snapshots and a resume with the same processes and
  workers is exact (docs/data.md, "Hugging Face datasets"). ``data.val_files``: the
  validation windows (the first ``data.val_windows``, held in memory).

The steps are the recipe's: next-token cross-entropy on the model's logits, the
validation's summed loss and token count, ``val/perplexity`` from them.
"""

from __future__ import annotations

import glob
import math
import os
import pathlib
import sys
import sysconfig
from typing import Literal

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from engine import TrainConfig
from engine.errors import ConfigError

# Before datasets or transformers is imported (they read these once): nothing here needs
# the hub, so a run never waits for it or depends on it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

EOT = 256  # the end-of-text token after each record's UTF-8 bytes
VOCAB = 257
HINT = "pip install 'ddp-engine[hf]' (transformers and datasets)"


@attrs.define
class ModelConfig:
    kind: Literal["gpt2", "llama"] = "gpt2"
    layers: int = 2
    heads: int = 4
    width: int = 64
    context: int = 64  # tokens the model sees (a window is one more: the targets' shift)


@attrs.define
class DataConfig:
    disk: str = ""  # a save_to_disk folder: map-style
    files: str = ""  # local .jsonl/.json/.txt files, comma-separated globs: streaming
    val_files: str = ""  # with data.files: validation files (read into memory)
    val_windows: int = 200  # validation windows at most
    group_records: int = 100  # records concatenated before cutting windows


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 16
    lr: float = 3e-3
    grad_clip_norm: float | None = 1.0
    log_every: int = 10
    out_dir: str = "runs/hf_causal_lm"
    model: ModelConfig = attrs.Factory(ModelConfig)
    data: DataConfig = attrs.Factory(DataConfig)


def _import(name: str):
    try:
        module = __import__(name)
    except ImportError:
        raise ConfigError(f"examples/hf_causal_lm.py needs the {name} package: {HINT}"
                          ) from None
    if name == "datasets":
        module.disable_progress_bars()  # a bar per map and save: noise in a run's output
    return module


# ---------------------------------------------------------------------- model


def build_model(cfg: Config) -> nn.Module:
    """A transformers causal LM from a config: random weights, nothing downloaded (the
    same under the meta device that --dry-run sizes the model on)."""
    transformers = _import("transformers")
    m = cfg.model
    if m.kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=m.context, n_embd=m.width, n_layer=m.layers,
            n_head=m.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=EOT, eos_token_id=EOT)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=m.context, hidden_size=m.width,
            intermediate_size=4 * m.width, num_hidden_layers=m.layers,
            num_attention_heads=m.heads, num_key_value_heads=m.heads,
            bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(config)


def build_optimizer(cfg: Config, model: nn.Module):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)


# ----------------------------------------------------------------------- steps


def train_step(batch, ctx):
    ids = batch["input_ids"]
    logits = ctx.model(input_ids=ids[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].reshape(-1))


def eval_step(batch, ctx):
    ids = batch["input_ids"]
    logits = ctx.module(input_ids=ids[:, :-1]).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].reshape(-1),
                           reduction="sum")
    return {"loss": loss, "count": ids[:, 1:].numel()}


def eval_metrics(sums: dict) -> dict:
    loss = sums["loss"] / sums["count"]
    return {"loss": loss, "perplexity": math.exp(loss)}


throughput_unit = "tokens"


def count_throughput(batch) -> int:
    return batch["input_ids"][:, 1:].numel()


# ----------------------------------------------------------------------- data


def windows(length: int):
    """The ``datasets.map(batched=True)`` function: a group of records' text, as bytes
    with an end-of-text token after each, cut into windows of ``length`` tokens."""
    def cut(records: dict) -> dict:
        ids = []
        for text in records["text"]:
            ids.extend(text.encode())
            ids.append(EOT)
        return {"input_ids": [ids[i:i + length]
                              for i in range(0, len(ids) - length + 1, length)]}
    return cut


def build_datasets(cfg: Config, ctx):
    data = cfg.data
    if bool(data.disk) == bool(data.files):
        raise ConfigError("give one of data.disk=DIR (a datasets save_to_disk folder, "
                          "map-style) and data.files=PATTERNS (.jsonl/.txt files, streamed); "
                          "python examples/hf_causal_lm.py make-data DIR writes both")
    if data.group_records < 1:
        raise ConfigError(f"data.group_records must be >= 1, got {data.group_records}")
    if data.disk:
        return disk_datasets(cfg, ctx)
    return streamed_datasets(cfg, ctx)


def disk_datasets(cfg: Config, ctx):
    """``load_from_disk``: the windows of its ``train`` (and ``validation``) split, made
    in memory (``keep_in_memory``: no cache file written beside the user's data, where
    every process would race to write the same one)."""
    datasets = _import("datasets")
    folder = pathlib.Path(cfg.data.disk)
    if not folder.is_dir():
        raise ConfigError(f"data.disk={cfg.data.disk}: no such folder; give a folder "
                          "written by Dataset.save_to_disk")
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as exc:
        raise ConfigError(f"data.disk={cfg.data.disk}: not a datasets save_to_disk folder "
                          f"({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"data.disk={cfg.data.disk} has splits {sorted(loaded)}, "
                              "no 'train'")
        train, val = loaded["train"], loaded.get("validation")
    else:
        train, val = loaded, None

    def prepare(split, name):
        if "text" not in split.column_names:
            raise ConfigError(f"data.disk={cfg.data.disk}: the {name} split has columns "
                              f"{split.column_names}, no 'text'")
        cut = split.map(windows(cfg.model.context + 1), batched=True,
                        batch_size=cfg.data.group_records, remove_columns=split.column_names,
                        keep_in_memory=True, desc=None)
        return cut.with_format("torch")

    train = prepare(train, "train")
    if val is not None:
        val = prepare(val, "validation")
        val = val.select(range(min(len(val), cfg.data.val_windows)))
    ctx.print(f"hf_causal_lm: {len(train):,} training windows of {cfg.model.context + 1} "
              f"tokens from {folder}" + (f", {len(val):,} validation" if val else ""))
    return train, val


def data_files(patterns: str, key: str) -> tuple[str, list[str]]:
    """The files of ``patterns`` in sorted order, and the datasets builder that reads
    them (``json`` for .jsonl/.json, ``text`` for .txt): one kind only."""
    files = []
    for pattern in filter(None, (p.strip() for p in patterns.split(","))):
        found = sorted(glob.glob(pattern))
        if not found:
            raise ConfigError(f"{key}: {pattern!r} matches no file")
        files += found
    kinds = {"json" if f.endswith((".jsonl", ".json")) else
             "text" if f.endswith(".txt") else f for f in files}
    if len(kinds) != 1 or kinds - {"json", "text"}:
        raise ConfigError(f"{key}: {', '.join(files)}: give .jsonl/.json files (a 'text' "
                          "field per record) or .txt files (a record per line), one kind")
    return kinds.pop(), files


def streamed_datasets(cfg: Config, ctx):
    """``load_dataset(..., streaming=True)``: an IterableDataset of windows, split over
    the processes by ``split_dataset_by_node`` (and over each process's loader workers by
    datasets itself): it shards itself, and says so."""
    datasets = _import("datasets")
    from datasets.distributed import split_dataset_by_node

    def stream(key, patterns):
        kind, files = data_files(patterns, key)
        raw = datasets.load_dataset(kind, data_files=files, split="train", streaming=True)
        return raw.map(windows(cfg.model.context + 1), batched=True,
                       batch_size=cfg.data.group_records,
                       remove_columns=["text"]).with_format("torch"), len(files)

    train, n_files = stream("data.files", cfg.data.files)
    train = split_dataset_by_node(train, rank=ctx.rank, world_size=ctx.world_size)
    train.shards_itself = True  # datasets gives each process and worker its part
    val = None
    if cfg.data.val_files:
        held, _ = stream("data.val_files", cfg.data.val_files)
        val = [window for _, window in zip(range(cfg.data.val_windows), held)]
    ctx.print(f"hf_causal_lm: streaming {n_files} file(s) of {cfg.data.files} in windows "
              f"of {cfg.model.context + 1} tokens" +
              (f", {len(val):,} validation windows" if val is not None else ""))
    return train, val


# ------------------------------------------------------------ example data


def make_data(out: str | pathlib.Path, max_chars: int = 2_000_000,
              files: int = 4) -> None:
    """Example data without a download: the paragraphs (blocks between blank lines) of
    Python's standard library sources, every 10th held out for validation, written
    as ``out/disk`` (a DatasetDict, save_to_disk) and as ``out/train-0000K.jsonl`` (the
    training records in ``files`` files, so that loader workers have files to share)
    and ``out/val.jsonl``."""
    import json

    datasets = _import("datasets")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits, total = {"train": [], "validation": []}, 0
    sources = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for path in sources:
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        for paragraph in filter(str.strip, text.split("\n\n")):
            held = len(splits["train"]) + len(splits["validation"])
            splits["validation" if held % 10 == 0 else "train"].append(paragraph)
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": texts})
                          for name, texts in splits.items()}).save_to_disk(str(out / "disk"))
    train = splits["train"]
    for k in range(files):
        part = train[k * len(train) // files:(k + 1) * len(train) // files]
        (out / f"train-{k:05d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in part))
    (out / "val.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in splits["validation"]))
    print(f"wrote {out}: {len(train):,} training and {len(splits['validation']):,} "
          f"validation records ({total:,} characters) as {out / 'disk'} and "
          f"{files} train-*.jsonl files + val.jsonl")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "make-data":
        sys.exit("usage: python examples/hf_causal_lm.py make-data DIR")
    make_data(sys.argv[2])
