"""A tiny regression recipe: one real-valued target per sample, mean squared error.

It owns its evaluation (``eval_step`` returns sums of squared and absolute errors and a
count), so the engine reports ``val/loss`` and ``val/mae``, never an accuracy.

    nan_sample=K   the training input of sample K is NaN, so the micro-batch holding it
                   has a NaN loss and NaN gradients (for the on_nonfinite tests)

Data are made from a fixed generator, so every worker and every run sees the same set.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from engine import TrainConfig
from engine.classification import train_step  # (inputs, targets) batches, loss_fn

FEATURES = 6


@attrs.define
class Config(TrainConfig):
    epochs: int = 3
    batch_size: int = 8
    lr: float = 0.05
    log_every: int = 2
    train_size: int = 64
    val_size: int = 24
    nan_sample: int = -1
    dropout: float = 0.2


def make_data(n: int, seed: int, nan_sample: int = -1):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(7))
    inputs = torch.randn(n, FEATURES, generator=g)
    targets = inputs @ teacher + 0.1 * torch.randn(n, 1, generator=g)
    if 0 <= nan_sample < n:
        inputs[nan_sample] = float("nan")
    return torch.utils.data.TensorDataset(inputs, targets)


def build_model(cfg):
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(cfg.dropout),
                         nn.Linear(16, 1))


def build_datasets(cfg, ctx):
    return (make_data(cfg.train_size, seed=1, nan_sample=cfg.nan_sample),
            make_data(cfg.val_size, seed=2))


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)


def loss_fn(outputs, targets):
    return F.mse_loss(outputs, targets)


def eval_step(batch, ctx):
    inputs, targets = batch
    error = ctx.module(inputs) - targets
    return {"loss": error.pow(2).sum(), "mae": error.abs().sum(), "count": targets.shape[0]}
