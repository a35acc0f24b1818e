"""A small recipe with everything that makes exact resume hard: random augmentation
(random crop and flip), dropout, an LR scheduler stepped per step, momentum.

Images are made from their index, so every worker and every run sees the same data.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset

from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches


@attrs.define
class Config(TrainConfig):
    epochs: int = 3
    batch_size: int = 16
    lr: float = 0.05
    log_every: int = 2
    per_sample_seed: bool = True
    scheduler_interval: str = "step"
    size: int = 96
    augment: bool = True


class IndexedImages(Dataset):
    def __init__(self, size: int, augment: bool, offset: int = 0):
        self.size, self.augment, self.offset = size, augment, offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        label = int(torch.randint(0, 4, (1,), generator=g))
        image = torch.randn(3, 12, 12, generator=g) + label
        if self.augment:  # global RNG: what per_sample_seed makes reproducible
            dx, dy = torch.randint(0, 5, (2,)).tolist()
            image = nn.functional.pad(image, (2, 2, 2, 2))[:, dy:dy + 12, dx:dx + 12]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, label


def build_model(cfg):
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3),
                         nn.Linear(8 * 10 * 10, 4))


def build_datasets(cfg, ctx):
    return (IndexedImages(cfg.size, cfg.augment),
            IndexedImages(cfg.size // 3, False, offset=10_000))


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)


def build_scheduler(cfg, optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
