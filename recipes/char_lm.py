"""A character-level language model: a small decoder-only transformer (GPT-style
causal self-attention blocks, learned positions, the output layer tied to the token
embedding), trained to predict the next character.

    engine-run recipes/char_lm.py                       # Python's own library, ~3 min on 2 CPUs
    engine-run recipes/char_lm.py data.path=book.txt epochs=4 model.layers=6
    engine-run recipes/char_lm.py precision=bf16
    engine-run shards book.txt --out shards && engine-run recipes/char_lm.py data.shards=shards

Text every machine has, without a download: by default the source files of Python's
standard library (the top-level ``*.py`` files of ``sysconfig``'s ``stdlib`` folder, in
sorted order, up to ``data.max_chars``), every ``data.val_every``-th file held out for
validation, so that no file is in both sets. ``data.path`` trains on any UTF-8 text
file instead (its last tenth validates). Characters are UTF-8 bytes: a vocabulary of
256 that fits every text, with no vocabulary file to carry around. ``data.shards``
trains on token shards (``engine-run shards``, engine/token_shards.py, any tokenizer:
the vocabulary is the index's): its windows of ``model.context + 1`` tokens, every
``data.val_every``-th one held out for validation, each training window once per epoch.

The recipe owns its steps: ``train_step`` (next-character cross-entropy) and
``eval_step`` (summed loss and token count), and ``eval_metrics`` turns the reduced
sums into ``val/loss`` (nats per character), ``val/perplexity`` and
``val/bits_per_char``. AdamW without weight decay on biases, norms and embeddings;
linear warmup then cosine decay, per optimizer step over the run's length
(``build_scheduler`` gets it from ``ctx``). ``shard_units`` names the block class for
the fsdp parallel mode and activation checkpointing. At the start rank 0 prints the
unigram cross-entropy of the validation text (what a model that knows only character
frequencies would reach) as the baseline, and at the end a generated sample (seeded:
two runs print the same).
"""

from __future__ import annotations

import math
import pathlib
import sysconfig
from typing import Literal

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, Subset

from engine import TrainConfig
from engine.errors import ConfigError

VOCAB = 256  # UTF-8 bytes


@attrs.define
class ModelConfig:
    layers: int = 2
    heads: int = 4
    width: int = 64  # the residual stream's width (the embedding size)
    context: int = 64  # characters the model sees at once (its learned positions)
    dropout: float = 0.0


@attrs.define
class DataConfig:
    path: str = ""  # a UTF-8 text file; empty: Python's standard library sources
    max_chars: int = 3_000_000  # the library's files, in sorted order, up to this much
    val_every: int = 10  # every N-th library file validates (the last tenth of data.path)
    train_windows: int = 14_400  # training windows per epoch, at fixed random offsets
    val_windows: int = 400  # validation windows at most, spread evenly over the text
    # A token-shard folder (engine-run shards): its windows instead of the text above
    # (path, max_chars and train_windows then unused: an epoch is every training window).
    shards: str = ""


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 32
    lr: float = 6e-3
    weight_decay: float = 0.1
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    scheduler_interval: Literal["epoch", "step"] = "step"
    grad_clip_norm: float | None = 1.0
    log_every: int = 10
    sample_chars: int = 200  # generated at the end by rank 0; 0: none
    out_dir: str = "runs/char_lm"
    model: ModelConfig = attrs.Factory(ModelConfig)
    data: DataConfig = attrs.Factory(DataConfig)


# ---------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.width % cfg.heads:
            raise ConfigError(f"model.width ({cfg.width}) must be a multiple of model.heads "
                              f"({cfg.heads})")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.dropout = cfg.dropout

    def forward(self, x):
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """One transformer block (pre-norm): attention, then an MLP, each added to the
    residual stream. The unit of sharding and of activation checkpointing."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attention = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
                                 nn.Linear(4 * cfg.width, cfg.width), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


#: The blocks the fsdp parallel mode shards one by one and activation checkpointing
#: recomputes (the embeddings and the tied output layer stay in the root unit).
shard_units = (Block,)


class CharTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab: int = VOCAB):
        super().__init__()
        self.context = cfg.context
        self.tokens = nn.Embedding(vocab, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocab, bias=False)
        self.apply(self._init)
        self.head.weight = self.tokens.weight  # tied: one matrix reads and writes characters

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, chars):
        positions = torch.arange(chars.shape[1], device=chars.device)
        x = self.dropout(self.tokens(chars) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(cfg: Config) -> nn.Module:
    return CharTransformer(cfg.model, vocab_size(cfg.data))


def vocab_size(data: DataConfig) -> int:
    if not data.shards:
        return VOCAB
    from engine.token_shards import read_index

    return int(read_index(data.shards)["vocab_size"])


def build_optimizer(cfg: Config, model: nn.Module):
    """AdamW; no weight decay on biases, norms and embeddings (the usual groups)."""
    no_decay_modules = (nn.LayerNorm, nn.Embedding)
    no_decay = {id(p) for m in model.modules() if isinstance(m, no_decay_modules)
                for p in m.parameters(recurse=False)}
    decay, rest = [], []
    for param in model.parameters():  # a tied weight once
        (rest if param.ndim < 2 or id(param) in no_decay else decay).append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def build_scheduler(cfg: Config, optimizer, ctx):
    """Linear warmup over ``warmup_steps``, then cosine down to ``lr * min_lr_ratio`` at
    the run's last optimizer step (``ctx.total_steps``: the engine knows the run's
    length)."""
    total, warmup = ctx.total_steps, min(cfg.warmup_steps, ctx.total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------- steps


def train_step(batch, ctx):
    """Next-character cross-entropy, the mean over the micro-batch's characters, and
    beside it the share of characters the model ranks first (``train/accuracy``)."""
    inputs, targets = batch
    logits = ctx.model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
    hits = (logits.detach().argmax(dim=-1) == targets).float().mean()
    return {"loss": loss, "accuracy": hits}


def eval_step(batch, ctx):
    inputs, targets = batch
    logits = ctx.module(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1),
                           reduction="sum")
    return {"loss": loss, "count": targets.numel()}


def eval_metrics(sums: dict) -> dict:
    """From the sums reduced over every batch and rank: the loss per character (nats),
    and what follows from it, which no sum divided by a count gives."""
    loss = sums["loss"] / sums["count"]
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_char": loss / math.log(2)}


#: Throughput in characters (``train/tokens_per_sec``), not windows.
throughput_unit = "tokens"


def count_throughput(batch) -> int:
    return batch[1].numel()


def on_train_end(cfg: Config, ctx) -> None:
    """Rank 0 prints a sample of the trained model's text, seeded: two runs of the same
    config print the same."""
    if cfg.sample_chars > 0 and vocab_size(cfg.data) == VOCAB:  # bytes: text to print
        prompt = "def "
        # Every rank generates the same text: under --parallel fsdp each forward is a
        # collective (every unit is gathered from all ranks), so rank 0 cannot run alone.
        text = generate(ctx.module, prompt, cfg.sample_chars, seed=cfg.seed)
        if ctx.is_rank0:
            ctx.print(f"sample ({cfg.sample_chars} characters after {prompt!r}):\n{text}")


@torch.no_grad()
def generate(model: CharTransformer, prompt: str, length: int, seed: int,
             temperature: float = 0.8) -> str:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    chars = torch.tensor([list(prompt.encode())], device=device)
    for _ in range(length):
        logits = model(chars[:, -model.context:])[0, -1].float() / temperature
        following = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        chars = torch.cat([chars, following[None]], dim=1)
    model.train(was_training)
    return bytes(chars[0].tolist()).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------- data


class RandomWindows(Dataset):
    """``count`` windows of ``context + 1`` characters at fixed random offsets (drawn
    once from ``seed``): an epoch's length does not depend on the text's."""

    def __init__(self, text: torch.Tensor, context: int, count: int, seed: int):
        self.text, self.context = text, context
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(text) - context - 1, (count,), generator=generator)

    def __len__(self):
        return len(self.offsets)

    def __getitem__(self, index):
        start = int(self.offsets[index])
        window = self.text[start:start + self.context + 1].long()
        return window[:-1], window[1:]


class SpreadWindows(RandomWindows):
    """At most ``most`` non-overlapping windows spread evenly over the whole text (every
    file has its share), each character scored once."""

    def __init__(self, text: torch.Tensor, context: int, most: int):
        self.text, self.context = text, context
        count = min(most, (len(text) - 1) // context)
        stride = (len(text) - 1) // count
        self.offsets = torch.arange(count) * stride


def library_files(max_chars: int) -> list[pathlib.Path]:
    """The standard library's top-level source files in sorted order, up to
    ``max_chars`` bytes in all: the same selection on every run of a Python version."""
    folder = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(folder.glob("*.py")):
        if total >= max_chars:
            break
        chosen.append(path)
        total += path.stat().st_size
    if not chosen:
        raise ConfigError(f"no Python sources under {folder} (sysconfig's stdlib); give a "
                          "text file with data.path=FILE")
    return chosen


def split_text(data: DataConfig) -> tuple[bytes, bytes]:
    """(training text, validation text), split by file (or, for data.path, at 90%)."""
    if data.path:
        path = pathlib.Path(data.path)
        if not path.is_file():
            raise ConfigError(f"data.path {data.path!r}: no such file; give a UTF-8 text "
                              "file, or leave data.path empty for Python's library sources")
        text = path.read_bytes()
        cut = len(text) * 9 // 10
        return text[:cut], text[cut:]
    if data.val_every < 2:
        raise ConfigError(f"data.val_every must be >= 2 (every N-th file validates), "
                          f"got {data.val_every}")
    files = library_files(data.max_chars)
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % data.val_every)
    val = b"".join(f.read_bytes() for i, f in enumerate(files) if not i % data.val_every)
    return train, val


def as_tensor(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor) -> float:
    """Nats per character of the validation text under the training text's character
    frequencies (add-one smoothed): what knowing only the frequencies reaches."""
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[val.long()].mean())


def shard_datasets(cfg: Config, ctx):
    """The shards' windows: every ``data.val_every``-th validates (at most
    ``data.val_windows`` of them, spread evenly), the rest train."""
    from engine.token_shards import TokenShards

    windows = TokenShards(cfg.data.shards, cfg.model.context)
    ctx.add_state("shards", windows)  # a resume on rewritten shards says so
    if cfg.data.val_every < 2 or len(windows) < cfg.data.val_every:
        raise ConfigError(f"data.shards {cfg.data.shards}: {len(windows)} windows of "
                          f"model.context={cfg.model.context} + 1 tokens, data.val_every="
                          f"{cfg.data.val_every}: need data.val_every >= 2 and at least that "
                          "many windows (more text, or a smaller model.context)")
    every = cfg.data.val_every
    held_out = torch.arange(0, len(windows), every)
    held_out = held_out[torch.linspace(0, len(held_out) - 1, min(cfg.data.val_windows,
                                                                 len(held_out))).long()]
    train = NotEveryNth(windows, every)
    ctx.print(f"char_lm: {len(windows):,} windows of {cfg.model.context + 1} tokens in "
              f"{cfg.data.shards} ({windows.tokens:,} tokens, vocabulary "
              f"{windows.vocab_size:,}): {len(train):,} train, {len(held_out):,} validate")
    return train, Subset(windows, held_out.tolist())


class NotEveryNth(Dataset):
    """The windows whose index is not a multiple of ``every``, by arithmetic (a list of
    a large corpus's window indices would take gigabytes in every process)."""

    def __init__(self, windows, every: int):
        self.windows, self.every = windows, every

    def __len__(self):
        return len(self.windows) - -(-len(self.windows) // self.every)

    def __getitem__(self, index):
        return self.windows[index + index // (self.every - 1) + 1]


def build_datasets(cfg: Config, ctx):
    if cfg.data.shards:
        return shard_datasets(cfg, ctx)
    train_text, val_text = (as_tensor(t) for t in split_text(cfg.data))
    context = cfg.model.context
    for name, text in (("training", train_text), ("validation", val_text)):
        if len(text) < context + 2:
            raise ConfigError(f"the {name} text has {len(text)} characters, fewer than one "
                              f"window of model.context={context} + 1; give more text or "
                              "a smaller model.context")
    baseline = unigram_cross_entropy(train_text, val_text)
    ctx.print(f"char_lm: {len(train_text):,} training and {len(val_text):,} validation "
              f"characters; unigram baseline val/loss {baseline:.4f} "
              f"(target <= {2 * baseline / 3:.4f})")
    train = RandomWindows(train_text, context, cfg.data.train_windows, seed=cfg.seed)
    return train, SpreadWindows(val_text, context, cfg.data.val_windows)
