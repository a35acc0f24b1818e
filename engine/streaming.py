"""Iterable datasets (streams): their sharding, an epoch's common end, their resume.
The rules are docs/data.md's "Streams"."""

from __future__ import annotations

import collections
import copy
import logging
import re
import time
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from engine import data, distributed
from engine.errors import CheckpointError, ConfigError


def is_stream(dataset) -> bool:
    return isinstance(dataset, IterableDataset)


def has_state(dataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and \
        callable(getattr(dataset, "load_state_dict", None))


class ShardedStream(IterableDataset):
    """This rank's and this worker's items of ``dataset`` (the rule above). Calls the
    dataset's ``set_epoch(epoch)`` when it has one, before each epoch."""

    def __init__(self, dataset, rank: int, world_size: int):
        self.dataset = dataset
        self.rank, self.world_size = rank, world_size
        self.next_index = 0  # the stream's next item, counted from the epoch's start

    def __getattr__(self, name):  # collate_fn, ... of the dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __iter__(self):
        if getattr(self.dataset, "shards_itself", False):
            yield from self.dataset
            return
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        consumers = self.world_size * workers
        me = self.rank * workers + worker
        start = self.next_index
        for i, item in enumerate(self.dataset, start):
            self.next_index = i + 1
            if i % consumers == me:
                yield item


class ValidationStream(ShardedStream):
    """This rank's and worker's items of a validation stream, from the stream's start at
    every iteration (a dataset with ``state_dict`` is put back to the state it had when
    the loader was made); no lookahead, no padding (docs/data.md, "Validation")."""

    def __init__(self, dataset, rank: int, world_size: int):
        super().__init__(dataset, rank, world_size)
        self.start = copy.deepcopy(dataset.state_dict()) if has_state(dataset) else None

    def __iter__(self):
        self.next_index = 0  # not where the last validation stopped (a worker's copy too)
        if self.start is not None:
            self.dataset.load_state_dict(copy.deepcopy(self.start))
        return super().__iter__()


def val_loader(dataset, *, world, **kwargs):
    """engine.data.val_loader for any validation set (a stream's: ValidationStream)."""
    if is_stream(dataset):
        dataset = ValidationStream(dataset, world.rank, world.world_size)
    return data.val_loader(dataset, world=world, **kwargs)


class StatefulShardedStream(ShardedStream):
    """A ShardedStream over a dataset with ``state_dict``/``load_state_dict``: its state
    and the stream's position (which item comes next) travel together."""

    def state_dict(self) -> dict:
        return {"dataset": self.dataset.state_dict(), "next_index": self.next_index}

    def load_state_dict(self, state_dict: dict) -> None:
        self.dataset.load_state_dict(state_dict["dataset"])
        self.next_index = state_dict["next_index"]


def _stateful_dataloader():
    """torchdata's StatefulDataLoader (imported only when a recipe streams)."""
    try:
        # Here: torchdata is an optional extra (stream) that only a streaming run needs.
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise ConfigError("the recipe's training set is an IterableDataset, which needs "
                          "torchdata's StatefulDataLoader: pip install torchdata") from None
    # torchdata 0.11 calls torch's deprecated set_vital at each loader: noise in every run
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    # Its fast-forward notice is ours to give, once, in one line (StreamLoader.restore).
    logging.getLogger("torchdata.stateful_dataloader.stateful_dataloader").setLevel(
        logging.ERROR)
    return StatefulDataLoader


class StreamLoader(data.TrainingLoader):
    """The training loader of a stream: a StatefulDataLoader over this rank's part, and
    the lookahead that ends the epoch on every rank at the same micro-batch (``padding``,
    ``last``). ``samples`` counts the real samples handed out this epoch."""

    sized = False

    def __init__(self, dataset, *, micro_batch: int, world, num_workers: int,
                 pin_memory: bool, drop_last: bool, timeout: float = 0.0,
                 prefetch_factor: int | None = None, **_ignored):
        if (num_workers > 1 and not getattr(dataset, "shards_itself", False)
                and type(dataset).__module__.startswith("datasets.")):
            # datasets' IterableDataset gives each loader worker its own files; the rule
            # above would then keep every N-th item of a part: most items never trained.
            raise ConfigError(
                f"the training stream is a Hugging Face datasets {type(dataset).__name__}, "
                f"which splits itself over the {num_workers} loader workers: split it over "
                f"the processes too (datasets.distributed.split_dataset_by_node(dataset, "
                f"rank=ctx.rank, world_size=ctx.world_size)) and set "
                f"dataset.shards_itself = True, or use num_workers=1 "
                f"(examples/hf_causal_lm.py does the first)")
        self.world = world
        self.num_workers = num_workers
        self.batch_size = micro_batch
        self.stateful = has_state(dataset)
        self.dataset = (StatefulShardedStream if self.stateful else ShardedStream)(
            dataset, world.rank, world.world_size)
        # Workers are not persistent: each epoch forks them from the main process's
        # dataset, which set_epoch (and a resume's state) have just updated.
        self.loader = _stateful_dataloader()(
            self.dataset, batch_size=micro_batch, num_workers=num_workers,
            multiprocessing_context=data.worker_context(num_workers), pin_memory=pin_memory,
            drop_last=drop_last, timeout=timeout,
            prefetch_factor=prefetch_factor if num_workers else None,
            collate_fn=getattr(dataset, "collate_fn", None))
        self.restored = None  # a snapshot's state of this rank's loader, for start_epoch
        self.samples = 0
        self.peer_wait = 0.0  # seconds this epoch waited for the other ranks' flags
        self.position = None  # the loader's state after the last real batch handed out
        # This rank's last real batch once its part of the epoch has ended (it pads with
        # it): a snapshot keeps it, for a resume that starts in the padding.
        self.ended_with = None
        self.restored_padding = None  # that batch from a snapshot, for start_epoch
        self.resumed_padding = None  # and for this epoch's iteration
        self.group = None  # the process group of the end-of-data flags (CPU)

    # ----------------------------------------------------------- the epoch

    def start_epoch(self, epoch: int, start_index: int = 0, *,
                    start_sample: int | None = None) -> None:
        resumed = bool(start_index or start_sample)  # at the restored position
        self.dataset.next_index = 0
        if callable(getattr(self.dataset.dataset, "set_epoch", None)):
            self.dataset.dataset.set_epoch(epoch)
        state, self.restored = self.restored, None
        padding, self.restored_padding = self.restored_padding, None
        if resumed and state is not None:
            self.loader.load_state_dict(state)
        self.resumed_padding = padding if resumed else None

    def __iter__(self):
        """The rank's batches, then padding until every rank's stream has ended. At each
        micro-batch k, a one-element all-reduce (MAX) of "I have batch k+2" is started and
        the one for batch k+1, started a micro-batch earlier, is waited for: it has long
        arrived, and tells whether batch k is the epoch's last on every rank. Each batch
        is fetched with the loader's state after it, so a snapshot records the position
        of the batch trained on, not of the ones looked ahead at."""
        self.samples, self.padding, self.last, self.peer_wait = 0, False, False, 0.0
        self.ended_with = None
        source, ahead, ended = iter(self.loader), collections.deque(), False

        def fill():
            nonlocal ended
            while len(ahead) < 2 and not ended:
                try:
                    batch = next(source, None)
                except Exception as exc:
                    raised = as_raised(exc)
                    if raised is exc:
                        raise
                    raise raised from exc
                if batch is None:
                    ended = True
                else:
                    ahead.append((batch, self.loader.state_dict()))

        fill()
        flags = collections.deque([self._start_flag(len(ahead) > 0),
                                   self._start_flag(len(ahead) > 1)])
        if not self._any_left(flags.popleft()):  # no rank has a batch: an empty epoch
            return
        last = None
        while True:
            real = ahead.popleft() if ahead else None
            fill()
            flags.append(self._start_flag(len(ahead) > 1))
            more = self._any_left(flags.popleft())
            self.padding = real is None
            if real is not None:
                last, self.position = real
                self.samples += batch_samples(last)
            elif last is None and self.resumed_padding is not None:
                # resumed where this rank's part had ended: pad with the batch it padded
                # with (weight 0: any batch of the stream's structure would do)
                last, self.resumed_padding = self.resumed_padding, None
            elif last is None:
                raise ConfigError(
                    f"rank {self.world.rank} has no batch of the training stream in this "
                    f"epoch while other ranks have: a stream needs at least "
                    f"{self.world.world_size * max(1, self.num_workers)} items (one per "
                    f"process and loader worker)")
            self.last = not more
            if ended and not ahead:  # no real batch after this one on this rank
                self.ended_with = last
            if self.counts_in is not None:
                self.counts_in.batch_in_epoch += 1
            yield last
            if not more:
                return

    def _start_flag(self, have: bool):
        if not distributed.is_initialized():
            return have
        if self.group is None:
            self.group = (None if dist.get_backend() == "gloo"
                          else dist.new_group(backend="gloo"))
        # "some rank has it": a MAX over the ranks, on the CPU (no device sync)
        tensor = torch.tensor([float(have)])
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return tensor, work

    def _any_left(self, flag) -> bool:
        if isinstance(flag, bool):
            return flag
        tensor, work = flag
        started = time.perf_counter()
        work.wait()
        self.peer_wait += time.perf_counter() - started
        return bool(tensor.item() > 0)

    # ------------------------------------------------------------ snapshots

    def position_state(self, batch_in_epoch: int, world_size: int) -> dict:
        """Every rank's loader state, gathered, so that a rank-0 write holds them all."""
        mine = (self.position, self.ended_with) if batch_in_epoch else (None, None)
        ranks = distributed.all_gather_object(mine)
        return {"batch_in_epoch": batch_in_epoch, "samples_in_epoch": None,
                "world_size": world_size,
                "stream": {"ranks": [position for position, _ in ranks],
                           "padding": [batch for _, batch in ranks],
                           "num_workers": self.num_workers, "stateful": self.stateful}}

    def restore(self, state_dict: dict, world_size: int, warn) -> int:
        """Exact, or refused in one line (before training); this rank's state is kept
        for start_epoch."""
        batch_in_epoch = int(state_dict.get("batch_in_epoch") or 0)
        saved_world = state_dict.get("world_size", world_size)
        if not batch_in_epoch:
            return 0
        if "stream" not in state_dict:
            raise CheckpointError("the snapshot stopped mid-epoch in a map-style "
                                  "dataset; this run's training set is a stream")
        stream = state_dict["stream"]
        if saved_world != self.world.world_size:
            raise CheckpointError(
                f"the snapshot stopped mid-epoch in a stream (an IterableDataset) with "
                f"{saved_world} processes; this run has {self.world.world_size}: the items "
                f"each rank consumed are not a prefix of the stream, so the resume cannot be "
                f"exact; resume with {saved_world} processes (or give the data as a map-style "
                f"dataset, which resumes at any number)")
        workers = stream.get("num_workers")
        if not stream.get("stateful") and workers != self.num_workers:
            raise CheckpointError(
                f"the snapshot stopped mid-epoch in a stream without state_dict with "
                f"num_workers={workers}; this run has num_workers={self.num_workers}: "
                f"skipping the consumed samples replays each worker's part, which is exact "
                f"only with the same workers; resume with num_workers={workers}, or give the "
                f"dataset state_dict/load_state_dict")
        if stream.get("stateful") and workers != self.num_workers:
            raise CheckpointError(
                f"the snapshot stopped mid-epoch in a stream with num_workers={workers}; "
                f"this run has num_workers={self.num_workers}: the workers' stream states "
                f"do not carry over; resume with num_workers={workers}")
        self.restored = stream["ranks"][self.world.rank]
        self.restored_padding = stream.get("padding", [None] * saved_world)[self.world.rank]
        if not stream.get("stateful"):
            warn(f"the training stream has no state_dict/load_state_dict: the resume "
                 f"skips the {batch_in_epoch * self.batch_size} samples per process the "
                 f"epoch already consumed by reading them again (their loading time; "
                 f"exact only if the stream yields the same items in the same order again)")
        return batch_in_epoch


#: How torch re-raises a loader worker's exception: its type, this line, the traceback.
_CAUGHT = re.compile(r"Caught (\w+) in DataLoader worker process \d+\.\n")


class _Verbatim(str):  # a KeyError's message as raised (KeyError quotes its argument)
    __repr__ = str.__str__


def as_raised(exc: Exception) -> Exception:
    """A loader worker's exception as the recipe's stream raised it (the type and
    message that end the worker's traceback), where torch re-raised it with "Caught
    ValueError in DataLoader worker process 0." as the first line of its message, all
    that a one-line report would say. ``exc`` itself for any other exception."""
    caught = _CAUGHT.match(text := str(exc))
    lines = text.rstrip().splitlines() if caught else []
    at = next((i for i in range(len(lines) - 1, 0, -1)
               if re.match(rf"([\w.]+\.)?{caught[1]}(: |$)", lines[i])), None)
    if at is None:
        return exc
    message = "\n".join(lines[at:])
    if caught[1] == type(exc).__name__:  # else torch's RuntimeError: keep the type's name
        message = message.partition(": ")[2]
    try:
        return type(exc)(_Verbatim(message) if isinstance(exc, KeyError) else message)
    except Exception:  # a type that takes no message alone
        return exc


def batch_samples(batch) -> int:
    """The samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for part in batch:
            n = batch_samples(part)
            if n:
                return n
    return 0
