"""A recipe small enough for many multi-process runs: an MLP on a learnable synthetic
set, with switches for the model features the parallel modes must handle.

    model.batchnorm=true      a BatchNorm1d layer (buffers: running statistics)
    model.unused_layer=true   a layer whose parameters never receive a gradient
    model.rank_tally=true     a buffer that every forward raises by (rank + 1): what
                              is left of it at the end shows whether DDP broadcast
                              rank 0's buffers before each forward
    model.host_branch=true    a Python branch on a tensor's value (a graph break for
                              torch.compile)
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches

FEATURES = 8
CLASSES = 3


@attrs.define
class ModelConfig:
    hidden: int = 16
    batchnorm: bool = False
    unused_layer: bool = False
    rank_tally: bool = False
    # A Python branch on a tensor's value: torch.compile must break the graph there
    # (an error under compile.fullgraph=true).
    host_branch: bool = False


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 8
    lr: float = 0.05
    momentum: float = 0.9
    train_size: int = 64
    val_size: int = 16
    log_every: int = 2
    out_dir: str = "runs/tiny_parallel"
    model: ModelConfig = attrs.Factory(ModelConfig)


class RankTally(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("tally", torch.zeros(()))

    def forward(self, x):
        if self.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.tally += rank + 1
        return x


class TinyNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, cfg.hidden)
        self.norm = nn.BatchNorm1d(cfg.hidden) if cfg.batchnorm else nn.Identity()
        self.fc2 = nn.Linear(cfg.hidden, CLASSES)
        self.unused = nn.Linear(cfg.hidden, CLASSES) if cfg.unused_layer else None
        self.tally = RankTally() if cfg.rank_tally else nn.Identity()
        self.host_branch = cfg.host_branch

    def forward(self, x):
        x = self.tally(x)
        if self.host_branch and bool(x.sum() > 0):
            x = x * 1.0
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def build_model(cfg: Config) -> nn.Module:
    return TinyNet(cfg.model)


def build_optimizer(cfg: Config, model: nn.Module):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def make_data(n: int, seed: int):
    """Labels from a fixed random linear teacher, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))
    inputs = torch.randn(n, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def build_datasets(cfg: Config, ctx):
    return make_data(cfg.train_size, seed=1), make_data(cfg.val_size, seed=2)
