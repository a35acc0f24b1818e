"""Samplers and DataLoaders: the parts users forget (sampler, set_epoch, batch split).

- Training: :class:`MapLoader` (the loader protocol, :class:`TrainingLoader`) with a
  :class:`ResumableDistributedSampler`: torch's DistributedSampler order, resumable.
- Validation: :class:`ShardSampler`, rank r takes samples r, r+W, r+2W...; no padding,
  so every validation sample is counted exactly once in the reduced metrics.

A dataset may carry two optional attributes that the loaders honour:
``sample_weights`` (one weight per sample: the training order becomes a weighted draw
with replacement, e.g. class-balanced) and ``collate_fn`` (how samples become a batch).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from engine.errors import CheckpointError, ConfigError


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler order, resumable at a global position.

    The epoch's global order is one list of the dataset's indices (a permutation from
    (seed, epoch), or a weighted draw), the same whatever the number of processes; rank
    r of W takes every W-th entry from r. After k samples per rank, the W ranks
    together consumed the first k*W entries: that global position is what a snapshot
    records, so a resume with another number of processes splits the rest of the same
    order over its own ranks, and every sample is still seen once per epoch.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True,
                 drop_last: bool = False, weights=None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.start_sample = 0  # entries of the epoch's global order already consumed
        self.with_epoch = False  # yield (epoch, index) keys for SeededSamples
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.double)

    def set_epoch(self, epoch: int, start_index: int = 0, *,
                  start_sample: int | None = None) -> None:
        """Start ``epoch`` at global position ``start_sample`` (samples consumed by all
        ranks together), or after ``start_index`` samples of each rank's share."""
        super().set_epoch(epoch)
        self.start_sample = start_index * self.num_replicas if start_sample is None \
            else start_sample

    def global_order(self) -> list[int]:
        """The epoch's order over all ranks (before the padding), from (seed, epoch)."""
        n = len(self.dataset)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.weights is not None:
            return torch.multinomial(self.weights, n, replacement=True, generator=g).tolist()
        if self.shuffle:
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _remaining(self) -> int:
        """Global entries left from start_sample, padded to a multiple of the ranks."""
        left = max(0, len(self.dataset) - self.start_sample)
        if self.drop_last:
            return left - left % self.num_replicas
        return -(-left // self.num_replicas) * self.num_replicas

    def __iter__(self):
        order = self.global_order()
        # The rest of the order, then (like DistributedSampler) entries from the epoch's
        # start until every rank has as many: at the same number of processes this is
        # exactly the uninterrupted run's padded order from the same position. Nothing
        # skipped is loaded: only indices are sliced.
        rest = order[self.start_sample:]
        total = self._remaining()
        if total > len(rest):
            rest += (order * -(-(total - len(rest)) // len(order)))[:total - len(rest)]
        indices = iter(rest[self.rank:total:self.num_replicas])
        if self.with_epoch:
            epoch = self.epoch
            indices = ((epoch, i) for i in indices)
        return indices

    def __len__(self) -> int:
        return self._remaining() // self.num_replicas


def sample_seed(seed: int, epoch: int, index: int) -> int:
    key = f"{seed}:{epoch}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class SeededSamples(Dataset):
    """Random augmentation that depends on (seed, epoch, sample index) only.

    Before loading sample i of epoch e, torch, numpy and random are seeded from
    (seed, e, i): which worker loads a sample, or whether the epoch was resumed half-way
    through, no longer changes its augmentation. That is what makes a resumed run with
    workers and random transforms bit-identical to an uninterrupted one. In the main
    process (num_workers=0) the global RNG states are restored afterwards.
    """

    def __init__(self, dataset, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # sample_weights, collate_fn, classes... of the dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key):
        epoch, index = key
        seed = sample_seed(self.seed, epoch, index)
        in_worker = torch.utils.data.get_worker_info() is not None
        saved = None if in_worker else (random.getstate(), np.random.get_state(),
                                         torch.get_rng_state())
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            if saved is not None:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])


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


def split_batch(global_batch: int, world_size: int, accum: int) -> int:
    """The micro-batch one process feeds per forward pass; exact, or a clear error."""
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


def worker_context(num_workers: int) -> str | None:
    """How DataLoader workers start: forked on Linux (as under torchrun), not spawned
    like engine-run's own workers, each importing torch again; they never touch CUDA."""
    if num_workers > 0 and sys.platform == "linux":
        return "fork"
    return None


class TrainingLoader:
    """The loader protocol: what the engine asks of a run's training loader, whatever
    the data. :class:`MapLoader` (a map-style dataset) and engine.streaming's
    StreamLoader (a stream) implement it; engine-run and ``ctx.loader`` make them."""

    #: ``len(loader)`` is the epoch's micro-batches (what is left of it once resumed);
    #: a stream's is not known: its loader says at each batch whether it is ``padding``
    #: (train it with weight 0) and whether it is the epoch's ``last`` on every rank.
    sized = True
    padding = last = False
    #: A TrainState whose batch_in_epoch counts each batch handed out (a library loop's
    #: first training loader), or None (engine-run's loop counts them itself).
    counts_in = None

    def start_epoch(self, epoch: int, start_index: int = 0, *,
                    start_sample: int | None = None) -> None:
        """Before iterating ``epoch``: start it at the global position ``start_sample``
        (the samples all ranks consumed together), or after ``start_index`` samples of
        this rank's share; a stream resumes its restored position there."""
        raise NotImplementedError

    def position_state(self, batch_in_epoch: int, world_size: int) -> dict:
        """The snapshot's loader part after ``batch_in_epoch`` batches (a stream's is a
        collective)."""
        raise NotImplementedError

    def restore(self, state_dict: dict, world_size: int, warn) -> int:
        """The micro-batches per rank the epoch resumes after, from a snapshot's loader
        part (``warn``: a notice for the run's output); or a one-line refusal."""
        raise NotImplementedError


class MapLoader(TrainingLoader, DataLoader):
    """The training loader of a map-style dataset (:func:`train_loader`): its sampler,
    a ResumableDistributedSampler, starts an epoch at any global position."""

    def __iter__(self):
        batches = super().__iter__()
        return batches if self.counts_in is None else self._counted(batches)

    def _counted(self, batches):  # when handed out: the loop body trains on it, then saves
        for batch in batches:
            self.counts_in.batch_in_epoch += 1
            yield batch

    def start_epoch(self, epoch: int, start_index: int = 0, *,
                    start_sample: int | None = None) -> None:
        # The sampler's order and the workers' seeds, both from (seed, epoch).
        self.sampler.set_epoch(epoch, start_index=start_index, start_sample=start_sample)
        self.generator.manual_seed(self.sampler.seed * 1_000_003 + epoch)

    def position_state(self, batch_in_epoch: int, world_size: int) -> dict:
        return {"batch_in_epoch": batch_in_epoch,
                "samples_in_epoch": samples_consumed(batch_in_epoch, self.batch_size,
                                                     world_size, len(self.dataset)),
                "world_size": world_size}

    def restore(self, state_dict: dict, world_size: int, warn) -> int:
        batches = int(state_dict.get("batch_in_epoch") or 0)
        position = state_dict.get("samples_in_epoch")
        saved_world = state_dict.get("world_size", world_size)
        # At an epoch boundary, with as many processes, or from a snapshot that did not
        # record the position (right when the global batch is the same): the count.
        if not batches or position is None or saved_world == world_size:
            return batches
        # The last batches of an epoch are short, and a library loop's batch size is
        # its own: the batches that reach the position at this number of processes.
        return batches_at(int(position), self.batch_size, world_size, len(self.dataset))


def train_loader(dataset, *, micro_batch: int, world, seed: int, num_workers: int,
                 pin_memory: bool, drop_last: bool, persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None, timeout: float = 0.0,
                 per_sample_seed: bool = False) -> MapLoader:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ConfigError(
            f"{type(dataset).__name__} is an IterableDataset (a stream): its training "
            "loader is engine.streaming.StreamLoader (as engine-run and ctx.loader make it)")
    sampler = ResumableDistributedSampler(dataset, num_replicas=world.world_size,
                                          rank=world.rank, seed=seed,
                                          weights=getattr(dataset, "sample_weights", None))
    if per_sample_seed:
        dataset = SeededSamples(dataset, seed)
        sampler.with_epoch = True
    # The loader draws its workers' base seed from its own generator (reseeded every
    # epoch by start_epoch), never from the global RNG: a resumed epoch then leaves the
    # global RNG exactly where the uninterrupted run had it.
    return MapLoader(dataset, batch_size=micro_batch, sampler=sampler,
                     multiprocessing_context=worker_context(num_workers),
                     generator=torch.Generator().manual_seed(seed),
                     num_workers=num_workers, pin_memory=pin_memory, drop_last=drop_last,
                     persistent_workers=(num_workers > 0 if persistent_workers is None
                                         else persistent_workers),
                     prefetch_factor=prefetch_factor, timeout=timeout,
                     collate_fn=getattr(dataset, "collate_fn", None))


def start_epoch(loader, epoch: int, start_index: int = 0, *,
                start_sample: int | None = None) -> None:
    """Before iterating an epoch of a training loader (TrainingLoader.start_epoch)."""
    loader.start_epoch(epoch, start_index, start_sample=start_sample)


def val_loader(dataset, *, batch: int, world, num_workers: int, pin_memory: bool,
               persistent_workers: bool | None = None, prefetch_factor: int | None = None,
               timeout: float = 0.0) -> DataLoader:
    """This rank's shard of a validation set, every sample once over the ranks: of a
    map-style set, samples rank, rank+W, ...; an IterableDataset here is already this
    rank's part of a stream (engine.streaming.val_loader's ValidationStream)."""
    sampler = (None if isinstance(dataset, torch.utils.data.IterableDataset)
               else ShardSampler(len(dataset), world.world_size, world.rank))
    # Its own generator, like the training loader's: creating its iterator must not
    # draw from the global RNG (how often that happens depends on persistent workers
    # and on resumes, and dropout draws from the same RNG).
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=num_workers,
                      multiprocessing_context=worker_context(num_workers),
                      generator=torch.Generator().manual_seed(0),
                      pin_memory=pin_memory,
                      persistent_workers=(num_workers > 0 if persistent_workers is None
                                          else persistent_workers),
                      prefetch_factor=prefetch_factor, timeout=timeout,
                      collate_fn=getattr(dataset, "collate_fn", None))


def first_val_samples(loader) -> list:
    """One batch of samples of a validation loader, read from its dataset (the loader's
    iterator, workers and generator untouched): its shard's first, else the set's."""
    size = loader.batch_size
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):  # ValidationStream
        return (list(itertools.islice(iter(loader.dataset), size))
                or list(itertools.islice(iter(loader.dataset.dataset), size)))
    indices = (list(itertools.islice(iter(loader.sampler), size))
               or list(range(min(len(loader.dataset), size))))
    return [loader.dataset[i] for i in indices]


def samples_consumed(batches: int, micro_batch: int, world_size: int, dataset_size: int
                     ) -> int:
    """The global position after ``batches`` micro-batches per rank: the samples all
    ranks consumed together, capped at the epoch's end (the last batches may be short or
    padded)."""
    return min(batches * micro_batch * world_size, dataset_size)


def batches_at(position: int, micro_batch: int, world_size: int, dataset_size: int) -> int:
    """The inverse of :func:`samples_consumed` for another number of processes: the
    micro-batches per rank that bring the epoch to global ``position``. A position
    between two global batches cannot be reached: an error that says so."""
    per_batch = micro_batch * world_size
    if position >= dataset_size:  # the epoch was consumed: start past its end
        return -(-dataset_size // per_batch)
    if position % per_batch:
        raise CheckpointError(
            f"the snapshot stopped {position} samples into the epoch, which is not a whole "
            f"number of global batches of {per_batch} ({world_size} processes x "
            f"{micro_batch}); resume with the batch size it was written with")
    return position // per_batch


def batches_per_epoch(num_samples: int, micro_batch: int, drop_last: bool) -> int:
    return num_samples // micro_batch if drop_last else math.ceil(num_samples / micro_batch)


def to_device(batch, device, non_blocking: bool = False):
    """A batch on ``device``: tensors, nested in tuples (named ones keep their type),
    lists and dicts, or any object with a tensor's ``to(device, non_blocking=...)`` (a
    recipe's own batch type); anything else unchanged. ``non_blocking``: from pinned
    memory, overlapped with compute (CUDA)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, list):
        return [to_device(v, device, non_blocking) for v in batch]
    if isinstance(batch, tuple):
        moved = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if callable(getattr(batch, "to", None)):
        return batch.to(device, non_blocking=non_blocking)
    return batch
