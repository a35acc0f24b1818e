"""Checkpointer ``torch-file`` (the default): one torch.save file per snapshot, by rank 0.

Layout under ``<out_dir>/checkpoints/``::

    snapshot-e0002-s00001564.pt        the snapshot (torch.save, weights_only-loadable)
    snapshot-e0002-s00001564.pt.json   its manifest: size, xxh3_128, epoch, step, metrics
    latest                             the file name of the newest good snapshot
    best                               the best one by cfg.checkpoint.best_metric, if set

Every file is written through :func:`engine.atomic_io.atomic_write`, which checksums
the bytes as they go (xxh3-128; manifests of older versions hold a sha256, still
checked) and fsyncs each file before its rename. The folder is fsynced once per save,
after the last rename and before the prune: a crash before it may lose any of the
renames, and ``latest()`` copes with each (a pointer naming a snapshot that is not
there, or one without its manifest, falls back to the newest snapshot that verifies;
nothing older is gone yet). ``latest()`` checks size and checksum against the manifest; a snapshot that
fails is reported and the previous good one is used. ``load()`` checks too, unless
this process has just verified the same unchanged file (``latest()`` then ``load()``
hashes it once). Storage only: the snapshot dict comes from and goes back to
engine.snapshot.

Clean-up, on the first save or ``latest()`` and at ``close()``: temp files of writes
that were killed half-way, and manifests whose snapshot is gone (a kill between the
two unlinks of a prune).
"""

from __future__ import annotations

import errno
import json
import pathlib
import sys
import time

import engine
from engine.atomic_io import (atomic_write, atomic_write_text, check_file, checksum_entry,
                              fsync_directory, stale_temps)
from engine.checkpoint import Checkpointer
from engine.errors import CheckpointError, untrusted_pickle

PREFIX = "snapshot-"
SUFFIX = ".pt"


def snapshot_name(epoch: int, step: int) -> str:
    return f"{PREFIX}e{epoch:04d}-s{step:08d}{SUFFIX}"


def manifest_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".json")


def read_manifest(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None


#: path -> identity (inode, size, mtime) of the file when verify() last passed it, so
#: that load() right after latest() does not hash the same bytes again.
_verified: dict[str, tuple] = {}


def _identity(path: pathlib.Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def verify(path: pathlib.Path) -> str | None:
    """None when ``path`` matches its manifest, else what is wrong."""
    path = pathlib.Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        return "its manifest is missing or unreadable"
    identity = _identity(path)
    problem = check_file(path, manifest)
    if problem is None and identity is not None and identity == _identity(path):
        _verified.clear()  # one entry is all load() needs: no growth over a long run
        _verified[str(path)] = identity
    return problem


def save_without_crc32(state: dict, fileobj) -> None:
    """torch.save, minus the CRC32 of every record in its zip container: the manifest's
    checksum already covers the whole file, torch.load never checks the CRC, and on a
    busy CPU computing both made a save ~1.5x slower than it needs to be."""
    import torch
    import torch.serialization as serialization

    if not hasattr(serialization, "set_crc32_options"):  # torch < 2.4
        torch.save(state, fileobj)
        return
    previous = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        torch.save(state, fileobj)
    finally:
        serialization.set_crc32_options(previous)


def _os_error_in(exc: BaseException) -> OSError | None:
    """torch.save reports a failed write (a full disk) as a RuntimeError whose context
    is the OSError; find it."""
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class TorchFileCheckpointer(Checkpointer):
    name = "torch-file"
    _cleaned = False

    def save(self, state, *, epoch, step, metrics=None):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.clean_up_once()
        path = self.directory / snapshot_name(epoch, step)
        try:
            self.write_and_commit(state, path, epoch=epoch, step=step, metrics=metrics)
        except (OSError, RuntimeError) as exc:
            os_error = _os_error_in(exc)
            if os_error is None:
                raise
            raise self.write_error(path, os_error) from exc
        return path

    def write_and_commit(self, state: dict, path: pathlib.Path, *, epoch: int, step: int,
                         metrics: dict | None) -> None:
        """Write ``state`` to ``path``, then its manifest, then :meth:`commit` it.

        When the manifest or the commit fails (the disk filled up after the snapshot
        itself), the new snapshot goes again: ``latest`` still names the previous one,
        which is what a resume takes and what the error says is intact, and the new
        files would only take space (and warnings at every start)."""
        size, checksum = atomic_write(path, lambda f: save_without_crc32(state, f),
                                      sync_directory=False)  # commit() does it once
        try:
            manifest = {"file": path.name, **checksum_entry(size, checksum), "epoch": epoch,
                        "step": step, "metrics": metrics or {}, "created": time.time(),
                        "engine_version": engine.__version__}
            atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1),
                              sync_directory=False)
            self.commit(path, metrics)
        except BaseException:
            if self._pointer("latest") != path:
                for victim in (manifest_path(path), path):  # the manifest first
                    victim.unlink(missing_ok=True)
            raise

    def write_error(self, path: pathlib.Path, exc: OSError) -> CheckpointError:
        previous = self._pointer("latest")
        kept = (f"the previous snapshot {previous} is intact" if previous is not None
                else "no earlier snapshot exists")
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            reason += f"; free space in {self.directory} or point out_dir elsewhere"
        return CheckpointError(f"cannot write snapshot {path}: {reason}; {kept}")

    def clean_up_once(self) -> None:
        """:meth:`clean_up`, the first time this checkpointer touches its folder."""
        if not self._cleaned:
            self._cleaned = True
            self.clean_up()

    def clean_up(self) -> None:
        """Remove what killed writes left here: temp files whose writer is gone (the pid
        in their name), and manifests whose snapshot is gone. Only this folder's own
        names: nothing else in it is touched. Rank 0 only: it is the one that writes
        here, and another node would take its live writer's pid for a dead one."""
        if (self.world is not None and self.world.rank != 0) or not self.directory.is_dir():
            return
        for temp in stale_temps(self.directory):
            temp.unlink(missing_ok=True)
        for manifest in self.directory.glob(f"{PREFIX}*{SUFFIX}.json"):
            if not manifest.with_name(manifest.name[:-len(".json")]).exists():
                manifest.unlink(missing_ok=True)

    def close(self) -> None:
        super().close()
        self.clean_up()

    def commit(self, path: pathlib.Path, metrics: dict | None) -> None:
        """Point ``latest`` (and maybe ``best``) at ``path``, make every rename of this
        save durable with one fsync of the folder, then prune old snapshots (only
        then: a crash must not find the old ones gone and the new one not there)."""
        atomic_write_text(self.directory / "latest", path.name + "\n", sync_directory=False)
        cfg = self.cfg.checkpoint if self.cfg is not None else None
        if cfg is not None and cfg.best_metric and metrics and cfg.best_metric in metrics:
            if self._is_better(metrics[cfg.best_metric], cfg):
                atomic_write_text(self.directory / "best", path.name + "\n",
                                  sync_directory=False)
        fsync_directory(self.directory)
        self._prune(keep=cfg.keep_last if cfg is not None else 0)

    def _is_better(self, value: float, cfg) -> bool:
        best = self._pointer("best")
        if best is None:
            return True
        old = (read_manifest(best) or {}).get("metrics", {}).get(cfg.best_metric)
        if old is None:
            return True
        return value > old if cfg.best_mode == "max" else value < old

    def _pointer(self, name: str) -> pathlib.Path | None:
        try:
            target = (self.directory / name).read_text().strip()
        except OSError:
            return None
        return self.directory / target if target else None

    def snapshots(self) -> list[pathlib.Path]:
        """All snapshot files, oldest first (by step, then epoch)."""
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob(f"{PREFIX}*{SUFFIX}"),
                      key=lambda p: (p.name.split("-s")[-1], p.name))

    def _prune(self, keep: int) -> None:
        if keep <= 0:
            return
        protected = {self._pointer("latest"), self._pointer("best")}
        old = [p for p in self.snapshots() if p not in protected]
        for path in old[: max(0, len(old) - (keep - 1))]:
            for victim in (path, manifest_path(path)):
                victim.unlink(missing_ok=True)

    def verify(self, path) -> str | None:
        """What is wrong with the snapshot at ``path`` (None: nothing); --resume asks.
        One without a manifest (saved by hand) cannot be checked and passes."""
        path = pathlib.Path(path)
        return verify(path) if manifest_path(path).exists() else None

    def best(self):
        pointed = self._pointer("best")
        return pointed if pointed is not None and pointed.exists() else None

    def latest(self):
        self.clean_up_once()
        candidates = self.snapshots()
        pointed = self._pointer("latest")
        if pointed is not None and pointed in candidates:
            # The pointer wins; anything newer than it was never committed.
            candidates = candidates[: candidates.index(pointed) + 1]
        for path in reversed(candidates):
            problem = verify(path)
            if problem is None:
                return path
            warn(f"snapshot {path} is unusable: {problem}; trying the previous one")
        return None

    def load(self, path, *, map_location=None, template=None):
        import torch

        path = pathlib.Path(path)
        if not path.is_file():
            raise CheckpointError(f"snapshot {str(path)!r} not found")
        # Checked unless verify() just passed this very file (latest() before load():
        # hashing it again would cost a second read for nothing). A file without a
        # manifest (an export, a hand-made torch.save) is loaded as it is.
        if manifest_path(path).exists() and _verified.get(str(path)) != _identity(path):
            problem = verify(path)
            if problem is not None:
                raise CheckpointError(f"snapshot {str(path)!r} is unusable: {problem}")
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:
            untrusted = untrusted_pickle(f"snapshot {str(path)!r}", exc)
            if untrusted:
                raise CheckpointError(untrusted) from None
            raise CheckpointError(
                f"snapshot {str(path)!r} cannot be loaded: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(TorchFileCheckpointer)
