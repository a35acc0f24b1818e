"""A recipe on a stream (an IterableDataset) that records what it trains on.

Each item is (sample id, features, label). ``train_step`` appends
``epoch step sample_id`` lines to ``<out_dir>/consumed-rank<R>.txt`` for every real
micro-batch (a padding one, ``ctx.train_loader.padding``, is the engine's and trains
nothing). ``data.stateful=true`` gives the stream state_dict/load_state_dict.
``data.uneven=true`` (2 processes) makes the stream split itself, unevenly: rank 1
takes the items ``i % 4 == 3``, rank 0 the rest, so rank 1 trains padding for many
steps of each epoch.

``data.val_size=N`` adds a validation stream of items 0..N-1 (split like the training
one: by the engine's rule, or unevenly by the stream itself with ``data.uneven``); its
metrics are the items validated (``val/items``) and the mean of their ids and squared
ids, which equal those of 0..N-1 only when every item is validated exactly once.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from torch.utils.data import IterableDataset

from engine import TrainConfig


@attrs.define
class DataConfig:
    size: int = 45  # not a multiple of 2 ranks x batch 2: the ranks' parts differ
    stateful: bool = False
    uneven: bool = False
    val_size: int = 0


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 4
    lr: float = 0.05
    log_every: int = 2
    num_workers: int = 0
    data: DataConfig = attrs.field(factory=DataConfig)


def item(i: int):
    """Item i: (i, features, label), made from its id alone."""
    label = i % 3
    return i, torch.randn(6, generator=torch.Generator().manual_seed(i)) + label, label


class Stream(IterableDataset):
    """Items 0..size-1, made from their id; read from the epoch's start each time."""

    def __init__(self, size: int, rank: int | None = None):
        self.size, self.rank = size, rank
        if rank is not None:  # data.uneven
            self.shards_itself = True

    def __iter__(self):
        for i in range(self.size):
            if self.rank is None or (i % 4 == 3) == (self.rank == 1):
                yield item(i)


class StatefulStream(Stream):
    """The same items; its position is its state (in each loader worker's copy)."""

    def __init__(self, size: int):
        super().__init__(size)
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        self.position = 0

    def __iter__(self):
        while self.position < self.size:
            i = self.position
            self.position += 1
            yield item(i)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def build_model(cfg):
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def build_datasets(cfg, ctx):
    rank = ctx.rank if cfg.data.uneven else None
    val = Stream(cfg.data.val_size, rank) if cfg.data.val_size else None
    if cfg.data.uneven:
        return Stream(cfg.data.size, rank), val
    return (StatefulStream if cfg.data.stateful else Stream)(cfg.data.size), val


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr)


_started = False  # this process wrote its "start" line


def train_step(batch, ctx):
    """Records ``epoch step id`` per sample; a process's first line is ``start``."""
    global _started
    ids, x, y = batch
    if not ctx.train_loader.padding:
        with open(ctx.out_dir / f"consumed-rank{ctx.world.rank}.txt", "a") as f:
            if not _started:
                f.write("start\n")
                _started = True
            f.writelines(f"{ctx.state.epoch} {ctx.state.step} {i}\n" for i in ids.tolist())
    return nn.functional.cross_entropy(ctx.model(x), y)


def eval_step(batch, ctx):
    ids, x, y = batch
    ids = ids.double()
    return {"id": ids.sum(), "id_sq": (ids ** 2).sum(), "count": len(ids)}


def eval_metrics(sums):
    return {"items": sums["count"], "id": sums["id"] / sums["count"],
            "id_sq": sums["id_sq"] / sums["count"]}
