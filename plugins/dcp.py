"""Checkpointer ``dcp``: torch.distributed.checkpoint, saved and loaded by every rank.

Layout under ``<out_dir>/checkpoints/``::

    snapshot-e0002-s00001564.dcp/        one snapshot: a DCP checkpoint directory
        .metadata                        DCP's index: every tensor's shape, dtype, chunks
        __0_0.distcp  __1_0.distcp ...   tensor data, one file per rank that wrote some
        train_state.pt                   the rest of the snapshot, by rank 0 (see below)
    snapshot-e0002-s00001564.dcp.json    manifest: size and xxh3_128 of every file above
    latest, best                         the directory name, as with torch-file

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

A save is crash-consistent: every rank writes into a hidden staging directory, rank 0
moves it into place after a barrier, then writes the manifest and the ``latest``
pointer atomically. ``latest()`` checks the manifest and falls back to the previous
good snapshot, like torch-file.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import time
import warnings

import engine
from engine import distributed
from engine.atomic_io import (atomic_write, atomic_write_text, check_file, checksum_entry,
                              file_checksum, fsync_directory)
from engine.errors import CheckpointError, untrusted_pickle
from engine.plugins.torch_file import (PREFIX, TorchFileCheckpointer, manifest_path,
                                       read_manifest, warn)

SUFFIX = ".dcp"
STAGING = ".staging-"  # prefix of a directory being written (never resumed from)
TRAIN_STATE = "train_state.pt"
#: The parts of a snapshot dict that DCP stores; the rest goes to TRAIN_STATE.
DCP_PARTS = ("model", "optimizer")


def snapshot_name(epoch: int, step: int) -> str:
    return f"{PREFIX}e{epoch:04d}-s{step:08d}{SUFFIX}"


def verify(path: pathlib.Path, deep: bool = True) -> str | None:
    """None when the snapshot directory matches its manifest, else what is wrong.
    ``deep=False`` checks sizes only (no reading of the data)."""
    manifest = read_manifest(path)
    if manifest is None:
        return "its manifest is missing or unreadable"
    files = manifest.get("files") or {}
    if ".metadata" not in files:
        return "its manifest lists no DCP .metadata"
    for name, expected in sorted(files.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != expected.get("size"):
            return (f"{name} has {size} bytes, the manifest says {expected.get('size')} "
                    "(truncated?)")
        problem = check_file(path / name, expected) if deep else None
        if problem is not None:
            return f"{name}: {problem}"
    return None


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class DCPCheckpointer(TorchFileCheckpointer):
    """Reuses torch-file's pointers (``latest``, ``best``) and manifest reading; a
    snapshot is a directory here instead of a file."""

    name = "dcp"
    all_ranks = True
    distributed_state_dict = True  # save() gets, load() fills, get_state_dict's form

    # --------------------------------------------------------------- saving

    def save(self, state, *, epoch, step, metrics=None):
        """Collective: every rank calls it with its own ``state`` (model and optimizer
        state dicts under "model" and "optimizer"; the rest as rank 0 has it)."""
        import torch
        import torch.distributed.checkpoint as dcp

        rank, world_size = _rank_and_size(self.world)
        path = self.directory / snapshot_name(epoch, step)
        staging = self.directory / f"{STAGING}{path.name}"
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f"{STAGING}*"):  # saves that crashed
                shutil.rmtree(stale, ignore_errors=True)
        distributed.barrier()
        try:
            with _single_process_is_intended():
                dcp.save({k: state[k] for k in DCP_PARTS if state.get(k) is not None},
                         checkpoint_id=str(staging))
        except Exception as exc:
            raise CheckpointError(f"rank {rank}: saving {path} failed: "
                                  f"{type(exc).__name__}: {_first_line(exc)}") from None
        if rank == 0:
            rest = {k: v for k, v in state.items() if k not in DCP_PARTS}
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
            manifest = {"dir": path.name, "files": dict(sorted(files.items())),
                        "epoch": epoch, "step": step,
                        "world_size": world_size, "metrics": dict(metrics or {}),
                        "created": time.time(), "engine_version": engine.__version__}
            atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1))
            self.commit(path, metrics)
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

    # -------------------------------------------------------------- loading

    def load(self, path, *, map_location=None, template=None):
        """The snapshot at ``path``. With ``template`` (what engine.snapshot passes: the
        model's and optimizer's state dicts as ``get_state_dict`` gives them), every
        rank reads its part of "model" and "optimizer" in place into those tensors.
        Without one (tools), the whole snapshot comes into this process: "model" as
        saved, "optimizer" keyed by parameter names. The train state is added to both."""
        path = pathlib.Path(path)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path} is not a dcp snapshot (no .metadata in it)")
        if template is not None:
            parts = {k: template[k] for k in DCP_PARTS}
            try:
                import torch.distributed.checkpoint as dcp

                with _single_process_is_intended():
                    dcp.load(parts, checkpoint_id=str(path))
            except Exception as exc:
                raise CheckpointError(f"{path} cannot be loaded into this model and "
                                      f"optimizer: {type(exc).__name__}: "
                                      f"{_first_line(exc)}") from None
            return {**_train_state(path, required=True), **parts}
        try:
            state = load_everything(path)
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be loaded: {type(exc).__name__}: "
                                  f"{_first_line(exc)}") from None
        state.update(_train_state(path))
        if map_location is not None:
            state = _to(state, map_location)
        return state

    # ------------------------------------------------------------- choosing

    def snapshots(self):
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.glob(f"{PREFIX}*{SUFFIX}") if p.is_dir()),
                      key=lambda p: (p.name.split("-s")[-1], p.name))

    def verify(self, path) -> str | None:
        """What is wrong with the snapshot at ``path`` (None: nothing); --resume asks.
        One without a manifest (saved by hand) cannot be checked and passes."""
        path = pathlib.Path(path)
        return verify(path) if manifest_path(path).exists() else None

    def latest(self):
        candidates = self.snapshots()
        pointed = self._pointer("latest")
        if pointed is not None and pointed in candidates:
            # The pointer wins; anything newer than it was never committed.
            candidates = candidates[: candidates.index(pointed) + 1]
        # Every rank is asked (all_ranks) but rank 0's answer is the one that counts
        # (engine.snapshot.resume broadcasts it): the others skip reading the data.
        rank, _ = _rank_and_size(self.world)
        for path in reversed(candidates):
            problem = verify(path, deep=rank == 0)
            if problem is None:
                return path
            if rank == 0:
                warn(f"snapshot {path} is unusable: {problem}; trying the previous one")
        return None

    def _prune(self, keep: int) -> None:
        if keep <= 0:
            return
        protected = {self._pointer("latest"), self._pointer("best")}
        old = [p for p in self.snapshots() if p not in protected]
        for path in old[: max(0, len(old) - (keep - 1))]:
            manifest_path(path).unlink(missing_ok=True)  # first: it is what makes it valid
            shutil.rmtree(path, ignore_errors=True)


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
                              f"{type(exc).__name__}: {_first_line(exc)}") from None


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
