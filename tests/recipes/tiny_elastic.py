"""A recipe that records what each rank trains on, for elastic-resume tests.

Every micro-batch appends one line to ``<out_dir>/batches-rank<R>-<pid>.txt``: the
step this process started from (0, or the resumed snapshot's), the step the batch
belongs to, the epoch, the batch's mean loss, and the indices of its samples. Over the
runs that made an epoch (the one stopped and the ones resumed), the lines tell which
samples were trained on and how often, and what the epoch's loss was. ``slow_rank``
loads its samples slowly (``slow_s`` each): the data wait the epoch metrics must
report is that rank's.

``<out_dir>/hold`` (a test writes it) holds training: while it exists and names a step
that this one reaches, every rank waits before that step (and says so in
``<out_dir>/holding-<pid>``), until the file names a later step or goes, or a
pre-emption signal arrives (then the step ends and the snapshot is written).
"""

from __future__ import annotations

import os
import time

import attrs
import torch
from torch import nn
from torch.utils.data import Dataset

from engine import TrainConfig
from engine.classification import eval_step  # (inputs, targets) batches


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 6  # splits over 1, 2 and 3 processes
    lr: float = 0.05
    log_every: int = 1
    size: int = 36
    slow_rank: int = -1
    slow_s: float = 0.0


class Indexed(Dataset):
    def __init__(self, size: int, delay: float = 0.0):
        self.size, self.delay = size, delay

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        if self.delay:
            import time

            time.sleep(self.delay)
        g = torch.Generator().manual_seed(index)
        label = index % 3
        return torch.randn(4, generator=g) + label, label, index


def build_model(cfg):
    return nn.Linear(4, 3)


def build_datasets(cfg, ctx):
    delay = cfg.slow_s if ctx.world.rank == cfg.slow_rank else 0.0
    return Indexed(cfg.size, delay), None


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr)


START: dict = {}  # the step this process started training from


def hold(ctx) -> None:
    path, deadline = ctx.out_dir / "hold", time.monotonic() + 300
    marker = ctx.out_dir / f"holding-{os.getpid()}"
    while not (ctx.preemption and ctx.preemption.signal_name):
        try:
            until = int(path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            break
        if ctx.state.step + 1 < until:
            break
        marker.write_text(str(ctx.state.step))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} held training for 300 s")
        time.sleep(0.05)
    marker.unlink(missing_ok=True)


def train_step(batch, ctx):
    inputs, targets, indices = batch
    start = START.setdefault("step", ctx.state.step)
    hold(ctx)
    loss = nn.functional.cross_entropy(ctx.model(inputs), targets)
    record = ctx.out_dir / f"batches-rank{ctx.world.rank}-{os.getpid()}.txt"
    with open(record, "a") as f:  # a sync per step: fine in a test recipe
        f.write(f"{start} {ctx.state.step + 1} {ctx.state.epoch} {loss.item()!r} "
                f"{','.join(map(str, indices.tolist()))}\n")
    return loss
