"""The recipe of the feature-combination matrix (tests/test_combinations.py): the
smallest model that every feature has something to act on. Two ``Block``s (the class
that activation checkpointing, regional compile and fsdp's units name), dropout (the
RNG that a resume must restore), momentum (optimizer state), 28 samples made from their
index: 7 optimizer steps of a global batch of 4 in one epoch."""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset

from engine import TrainConfig, classification


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 4
    lr: float = 0.05
    log_every: int = 1
    size: int = 28


class Indexed(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=g) + index % 2, index % 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(4, 4), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.dropout(torch.tanh(self.linear(x)))


shard_units = (Block,)
# (inputs, targets) batches, cross-entropy, accuracy.
train_step, eval_step = classification.train_step, classification.eval_step


def build_model(cfg):
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def build_datasets(cfg, ctx):
    return Indexed(cfg.size), Indexed(4)


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
