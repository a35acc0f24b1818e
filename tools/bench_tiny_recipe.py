"""The near-zero-compute workload of tools/bench_overhead.py (``--workload tiny``): a
Linear 8 -> 8 classifier on random data. A step costs microseconds of arithmetic, so
what the engine adds per step around it (the framework's own cost) dominates the
difference from the hand-written loop.

With ``hidden_width=W`` (> 0) the model is an MLP 8 -> W -> W -> W -> 8 instead: at
W = 3584 its weights take ~103 MB of float32, the large state of
tools/bench_memory_snapshot.py's ``--workloads mlp100``."""

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
    hidden_width: int = 0  # 0: the Linear 8 -> 8; W: an MLP with three hidden layers of W
    out_dir: str = "runs/bench_tiny"


def make_data(n: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, FEATURES, generator=g),
                                          torch.randint(0, CLASSES, (n,), generator=g))


def build_model(cfg):
    w = cfg.hidden_width
    if not w:
        return nn.Linear(FEATURES, CLASSES)
    return nn.Sequential(nn.Linear(FEATURES, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                         nn.Linear(w, w), nn.ReLU(), nn.Linear(w, CLASSES))


def build_datasets(cfg, ctx):
    return make_data(cfg.train_size), make_data(16, seed=99)


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
