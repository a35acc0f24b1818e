"""A tiny multi-input recipe whose samples are dicts: ``{"image": ..., "meta": ...,
"label": ...}``. The default collate makes a dict of batched tensors; the recipe owns
its steps (``train_step``, ``eval_step``), since the default expects ``(inputs,
targets)``. It reports its own metrics: ``val/loss``, ``val/accuracy`` and
``val/top2`` (a label among the two highest scores).

Dropout and momentum, so that an exact resume has RNG and optimizer state to get right.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from engine import TrainConfig

CLASSES = 4


@attrs.define
class Config(TrainConfig):
    epochs: int = 3
    batch_size: int = 8
    lr: float = 0.05
    log_every: int = 2
    train_size: int = 64
    val_size: int = 20


class TwoInputs(Dataset):
    """An image-like tensor and a metadata vector per sample, made from the index."""

    def __init__(self, size: int, offset: int = 0):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        label = int(torch.randint(0, CLASSES, (1,), generator=g))
        image = torch.randn(2, 4, 4, generator=g) + label
        meta = torch.randn(3, generator=g) - label
        return {"image": image, "meta": meta, "label": label}


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Flatten(), nn.Linear(32, 12), nn.ReLU())
        self.meta = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, CLASSES))

    def forward(self, image, meta):
        return self.head(torch.cat([self.image(image), self.meta(meta)], dim=1))


def build_model(cfg):
    return TwoTower()


def build_datasets(cfg, ctx):
    return TwoInputs(cfg.train_size), TwoInputs(cfg.val_size, offset=10_000)


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)


def train_step(batch, ctx):
    return F.cross_entropy(ctx.model(batch["image"], batch["meta"]), batch["label"])


def eval_step(batch, ctx):
    outputs = ctx.module(batch["image"], batch["meta"])
    labels = batch["label"]
    top2 = outputs.topk(2, dim=1).indices
    return {"loss": F.cross_entropy(outputs, labels, reduction="sum"),
            "accuracy": (top2[:, 0] == labels).sum(),
            "top2": (top2 == labels[:, None]).any(dim=1).sum(),
            "count": labels.shape[0]}
