"""A recipe on token shards (engine.token_shards.TokenShards) that records which windows
each rank trains on, for the exactly-once tests of tests/engine/test_token_shards.py.

Each item is (window index, inputs, targets). Every micro-batch appends a line to
``<out_dir>/windows-rank<R>-<pid>.txt``: the step this process started from (0, or the
resumed snapshot's), the step the batch belongs to, the epoch, and the window indices.
"""

from __future__ import annotations

import os

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset

from engine import TrainConfig
from engine.token_shards import TokenShards


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 6  # splits over 1, 2 and 3 processes
    lr: float = 0.05
    log_every: int = 1
    shards: str = ""
    seq_len: int = 7


class Numbered(Dataset):
    def __init__(self, windows: TokenShards):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        return (index, *self.windows[index])


def build_model(cfg):
    return nn.Sequential(nn.Embedding(256, 4), nn.Linear(4, 256))


def build_datasets(cfg, ctx):
    return Numbered(TokenShards(cfg.shards, cfg.seq_len)), None


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr)


START: dict = {}  # the step this process started training from


def train_step(batch, ctx):
    indices, inputs, targets = batch
    start = START.setdefault("step", ctx.state.step)
    record = ctx.out_dir / f"windows-rank{ctx.world.rank}-{os.getpid()}.txt"
    with open(record, "a") as f:
        f.write(f"{start} {ctx.state.step + 1} {ctx.state.epoch} "
                f"{','.join(map(str, indices.tolist()))}\n")
    logits = ctx.model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
