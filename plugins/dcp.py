"""Checkpointer ``dcp``: torch.distributed.checkpoint, saved and loaded by every rank.

Layout under ``<out_dir>/checkpoints/``::

    snapshot-e0002-s00001564.dcp/        one snapshot: a DCP checkpoint directory
        .metadata                        DCP's index: every tensor's shape, dtype, chunks
        __0_0.distcp  __1_0.distcp ...   tensor data, one file per rank that wrote some
        train_state.pt                   the rest of the snapshot, by rank 0 (see below)
    snapshot-e0002-s00001564.dcp.json    manifest: size and xxh3_128 of every file above
    latest, best                         the directory name (engine.checkpoint.SnapshotStore)

Model and optimizer go through DCP, as ``get_state_dict`` presents them (the core
captures them in that form for this checkpointer: ``distributed_state_dict``): keys are the
parameters' names (not the optimizer's integer ids), so the optimizer state (momentum)
loads into a model at any world size. Replicated tensors (DDP) are written once, the
work spread over the ranks; at load every rank reads what it needs, so a snapshot
saved by 2 processes resumes on 1 and the other way round.

Everything else of the snapshot (epoch, step, position in the epoch, the RNG states
of every rank, scheduler, grad scaler, config, metrics, engine version: see
engine.snapshot.capture) is small and goes into ``train_state.pt``
(``torch.load(weights_only=True)``), written by rank 0.

Checkpointer ``dcp-async`` (:class:`AsyncDCPCheckpointer`): the same snapshots, written
by ``dcp.async_save`` in the background; the loop waits only while DCP copies the
shards, and the rest of the save is done at the next save or at the run's end.

A save is crash-consistent: every rank writes into a hidden staging directory, rank 0
moves it into place after a barrier; the store then writes the manifest and the
``latest`` pointer atomically. ``latest()`` checks the manifest and falls back to the
previous good snapshot (rank 0 reads the files; the others compare sizes), as every
store does. A crashed save's staging directory goes at the next start.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import pathlib
import shutil
import warnings

import engine
from engine import distributed
from engine.atomic_io import atomic_write, checksum_entry, file_checksum, fsync_directory
from engine.checkpoint import SnapshotStore
from engine.errors import CheckpointError, one_line, untrusted_pickle
from engine.shards import holds_dtensor

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).

STAGING = ".staging-"  # prefix of a directory being written (never resumed from)
TRAIN_STATE = "train_state.pt"
#: The parts of a snapshot dict that DCP stores; the rest goes to TRAIN_STATE.
DCP_PARTS = ("model", "optimizer")


def load_everything(path: pathlib.Path) -> dict:
    """The whole snapshot into this process, as it was saved (no model needed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    # Exactly what torch's own dcp_to_torch_save does: the planner builds the dict from
    # the checkpoint's metadata (the public dcp.load only fills keys given to it), and
    # no_dist, because only this process reads.
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns on every save and load without a process group; one process is a
    normal run here (and tools read snapshots in one process on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_and_size(world) -> tuple[int, int]:
    if distributed.is_initialized():
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()
    if world is not None:
        return world.rank, world.world_size
    return 0, 1


class DCPCheckpointer(SnapshotStore):
    """A snapshot is a directory of DCP files here; manifest, pointers, pruning and the
    choice of the latest good one are the store's."""

    name = "dcp"
    suffix = ".dcp"
    folder = True
    all_ranks = True
    distributed_state_dict = True  # save() gets, load() fills, get_state_dict's form
    check_on_load = False  # every rank loads: rank 0 checked the snapshot already

    @property
    def rank(self) -> int:
        return _rank_and_size(self.world)[0]

    # --------------------------------------------------------------- saving

    def write(self, path, state):
        """Collective: every rank calls it with its own ``state`` (model and optimizer
        state dicts under "model" and "optimizer"; the rest as rank 0 has it). Every
        rank writes into a hidden staging directory; rank 0 moves it into place once
        every file is there and hashed."""
        import torch

        rank, world_size = _rank_and_size(self.world)
        staging = self.directory / f"{STAGING}{path.name}"
        distributed.barrier()  # rank 0 has made the folder and cleared old staging
        try:
            with _single_process_is_intended():
                self.write_shards(state, staging)
        except Exception as exc:
            raise CheckpointError(f"rank {rank}: saving {path} failed: "
                                  f"{one_line(exc)}") from None
        if rank == 0:
            rest = {k: v for k, v in state.items() if k not in _dcp_parts(state)}
            atomic_write(staging / TRAIN_STATE, lambda f: torch.save(rest, f))
        distributed.barrier()

        # Every rank hashes a share of the files (written by anyone), rank 0 collects.
        names = sorted(p.name for p in staging.iterdir() if p.is_file())
        mine = {name: checksum_entry((staging / name).stat().st_size,
                                     file_checksum(staging / name))
                for name in names[rank::world_size]}
        files = {}
        for share in distributed.all_gather_object(mine):
            files.update(share)
        if rank == 0:
            fsync_directory(staging)
            self._move_into_place(staging, path)
        return {"dir": path.name, "files": dict(sorted(files.items())),
                "world_size": world_size}

    def write_shards(self, state: dict, staging: pathlib.Path) -> None:
        """This rank's shards of the model and optimizer into ``staging``."""
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_parts(state), checkpoint_id=str(staging))

    def save(self, state, *, epoch, step, metrics=None):
        path = super().save(state, epoch=epoch, step=step, metrics=metrics)
        distributed.barrier()  # no rank goes on before ``latest`` names this snapshot
        return path

    def _move_into_place(self, staging: pathlib.Path, path: pathlib.Path) -> None:
        """Rename the finished directory to its name. One saved again under the same
        name (same epoch and step) is swapped out first and then removed."""
        old = None
        if path.exists():
            old = path.with_name(f"{STAGING}old-{path.name}")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        staging.rename(path)
        fsync_directory(self.directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def clean_up(self) -> None:
        """The store's clean-up, plus the staging directories of saves that crashed."""
        super().clean_up()
        if self.rank == 0 and self.directory.is_dir():
            for stale in self.directory.glob(f"{STAGING}*"):
                shutil.rmtree(stale, ignore_errors=True)

    # -------------------------------------------------------------- loading

    def check(self, path, manifest):
        if ".metadata" not in (manifest.get("files") or {}):
            return "its manifest lists no DCP .metadata"
        return None

    def read(self, path, *, map_location=None, template=None):
        """The snapshot at ``path``. With ``template`` (what engine.snapshot passes: the
        model's and optimizer's state dicts as ``get_state_dict`` gives them), every
        rank reads its part of "model" and "optimizer" in place into those tensors.
        Without one (tools), the whole snapshot comes into this process: "model" as
        saved, "optimizer" keyed by parameter names. The train state is added to both."""
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is not a dcp snapshot (no .metadata in it)")
        if template is not None:
            parts = dict(template)  # model, optimizer and any other sharded part
            try:
                import torch.distributed.checkpoint as dcp

                with _single_process_is_intended():
                    dcp.load(parts, checkpoint_id=str(path))
            except Exception as exc:
                raise CheckpointError(f"{path} cannot be loaded into this model and "
                                      f"optimizer: {one_line(exc)}") from None
            return {**_train_state(path, required=True), **parts}
        try:
            state = load_everything(path)
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be loaded: {one_line(exc)}") from None
        state.update(_train_state(path))
        if map_location is not None:
            state = _to(state, map_location)
        return state


def _dcp_parts(state: dict) -> dict:
    """Model, optimizer, and any other part holding shards (ema under fsdp)."""
    return {k: v for k, v in state.items()
            if v is not None and (k in DCP_PARTS or holds_dtensor(v))}


class AsyncDCPCheckpointer(DCPCheckpointer):
    """Checkpointer ``dcp-async``: ``dcp``'s snapshots (the same layout: either resumes
    the other's), written in the background by ``dcp.async_save``. ``save()`` blocks the
    loop only while DCP stages (copies) this rank's shards; a thread then writes them.
    The rest of the save (the train state, the manifest, ``latest``) is collective, so
    it runs at the same point on every rank: the next ``save()``, or ``wait()`` /
    ``close()`` (the engine closes the checkpointer at the end of every run). So at most
    one snapshot is in flight, and until it is committed ``latest`` names the previous.

    The write's collectives go over a gloo group of its own (torch's advice for async
    checkpointing, and what DCP needs on the CPU): they never interleave with
    training's on the default group."""

    name = "dcp-async"
    #: Seconds a commit waits for the background write before it fails the save.
    WRITE_TIMEOUT_S = 1800.0

    _pending: tuple | None = None
    _group = None

    def save(self, state, *, epoch, step, metrics=None):
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = self.directory / self.snapshot_name(epoch, step)
        if self.commits:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean_up_once()
        distributed.barrier()  # rank 0 has made the folder and cleared old staging
        if not distributed.is_initialized():
            # DCP's writer thread warns on every save without a process group, outside
            # any catch_warnings of ours; one process is a normal run here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    module="torch.distributed.checkpoint")
        rank = self.rank
        try:
            with _single_process_is_intended():
                written = dcp.async_save(
                    _dcp_parts(state), checkpoint_id=str(self.directory / f"{STAGING}{path.name}"),
                    process_group=self.write_group())
        except Exception as exc:
            raise CheckpointError(f"rank {rank}: saving {path} failed: "
                                  f"{one_line(exc)}") from None
        # The rest is small and changes as training goes on (RNG states, metrics).
        rest = copy.deepcopy({k: v for k, v in state.items() if k not in _dcp_parts(state)})
        self._pending = (written, rest, epoch, step, dict(metrics or {}))
        return path

    def write_group(self):
        """A gloo group for the background writes, made once (collectively: every
        rank saves at the same points). None without a process group."""
        if self._group is None and distributed.is_initialized():
            import torch.distributed as dist

            # The run's bound on every wait (a rank that died is an error, not a hang).
            seconds = getattr(self.cfg, "timeout_s", None)
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
                seconds=seconds) if seconds else None)
        return self._group

    def write_shards(self, state, staging):
        # What save() started: wait for the background write to end.
        self._writing.result(timeout=self.WRITE_TIMEOUT_S)

    def wait(self):
        """Commit the snapshot in flight (collective: every rank calls it)."""
        if self._pending is None:
            return
        self._writing, rest, epoch, step, metrics = self._pending
        self._pending = None
        DCPCheckpointer.save(self, rest, epoch=epoch, step=step, metrics=metrics)


def _train_state(path: pathlib.Path, required: bool = False) -> dict:
    """Everything of the snapshot but the model and optimizer (rank 0 wrote it)."""
    import torch

    if not required and not (path / TRAIN_STATE).is_file():
        return {}
    try:
        return torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:
        untrusted = untrusted_pickle(path / TRAIN_STATE, exc)
        if untrusted:
            raise CheckpointError(untrusted) from None
        raise CheckpointError(f"{path / TRAIN_STATE} cannot be loaded: "
                              f"{one_line(exc)}") from None


def _to(state, device):
    import torch

    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to(v, device) for v in state)
    return state


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(DCPCheckpointer)
    registry.add(AsyncDCPCheckpointer)
