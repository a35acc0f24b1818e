"""Samplers and DataLoaders: the parts users forget (sampler, set_epoch, batch split).

- Training: :class:`ResumableDistributedSampler`, torch's DistributedSampler (same
  shuffle, same padding, so the data order equals a hand-written DDP loop) that can
  start part-way through an epoch without loading the samples it skips.
- Validation: :class:`ShardSampler`, rank r takes samples r, r+W, r+2W...; no padding,
  so every validation sample is counted exactly once in the reduced metrics.
"""

from __future__ import annotations

import math
import os

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True,
                 drop_last: bool = False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.start_index = 0  # samples of this rank's share to skip in the current epoch

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self):
        indices = super().__iter__()
        if self.start_index:
            indices = iter(list(indices)[self.start_index:])
        return indices

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ShardSampler(Sampler):
    """Rank ``rank`` of ``num_replicas`` takes every num_replicas-th sample, no padding."""

    def __init__(self, length: int, num_replicas: int, rank: int):
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self):
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


def usable_cpus() -> int:
    """CPUs this process may run on: SLURM's allocation, else the affinity mask."""
    slurm = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(local_world_size: int) -> int:
    """Share the node's CPUs among its processes so that they do not oversubscribe."""
    cpus = usable_cpus()
    if os.environ.get("SLURM_CPUS_PER_TASK"):
        return max(1, cpus)  # SLURM already gave each task its own CPUs
    return max(1, cpus // max(1, local_world_size))


def split_batch(global_batch: int, world_size: int, accum: int) -> int:
    """The micro-batch one process feeds per forward pass; exact, or a clear error."""
    from engine.errors import ConfigError

    per_process, remainder = divmod(global_batch, world_size)
    if remainder or per_process == 0:
        good = max(world_size, global_batch - remainder)
        raise ConfigError(
            f"batch_size {global_batch} (global) does not split evenly over {world_size} "
            f"processes; choose a multiple of {world_size}, e.g. batch_size={good}"
        )
    micro, remainder = divmod(per_process, accum)
    if remainder or micro == 0:
        raise ConfigError(
            f"batch_size {global_batch} is {per_process} per process, which does not split "
            f"into grad_accum_steps={accum} equal micro-batches; choose a batch_size that "
            f"is a multiple of {world_size * accum}"
        )
    return micro


def train_loader(dataset, *, micro_batch: int, world, seed: int, num_workers: int,
                 pin_memory: bool, drop_last: bool) -> DataLoader:
    sampler = ResumableDistributedSampler(dataset, num_replicas=world.world_size,
                                          rank=world.rank, seed=seed)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler,
                      num_workers=num_workers, pin_memory=pin_memory, drop_last=drop_last,
                      persistent_workers=num_workers > 0)


def val_loader(dataset, *, batch: int, world, num_workers: int, pin_memory: bool
               ) -> DataLoader:
    sampler = ShardSampler(len(dataset), world.world_size, world.rank)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0)


def batches_per_epoch(num_samples: int, micro_batch: int, drop_last: bool) -> int:
    return num_samples // micro_batch if drop_last else math.ceil(num_samples / micro_batch)
