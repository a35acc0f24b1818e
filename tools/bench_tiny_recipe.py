"""The near-zero-compute workload of tools/bench_overhead.py (``--workload tiny``): a
Linear 8 -> 8 classifier on random data. A step costs microseconds of arithmetic, so
what the engine adds per step around it (the framework's own cost) dominates the
difference from the hand-written loop."""

from __future__ import annotations

import attrs
import torch
from torch import nn

from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches

FEATURES = CLASSES = 8


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 2
    lr: float = 0.01
    momentum: float = 0.9
    train_size: int = 4000
    out_dir: str = "runs/bench_tiny"


def make_data(n: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, FEATURES, generator=g),
                                          torch.randint(0, CLASSES, (n,), generator=g))


def build_model(cfg):
    return nn.Linear(FEATURES, CLASSES)


def build_datasets(cfg, ctx):
    return make_data(cfg.train_size), make_data(16, seed=99)


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
