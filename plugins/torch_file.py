"""Checkpointer ``torch-file`` (the default): one torch.save file per snapshot, by rank 0.

Layout under ``<out_dir>/checkpoints/``::

    snapshot-e0002-s00001564.pt        the snapshot (torch.save, weights_only-loadable)
    snapshot-e0002-s00001564.pt.json   its manifest: size, sha256, epoch, step, metrics
    latest                             the file name of the newest good snapshot
    best                               the best one by cfg.checkpoint.best_metric, if set

Every file is written through :func:`engine.atomic_io.atomic_write`. ``latest()``
checks size and sha256 against the manifest; a snapshot that fails is reported and
the previous good one is used. Storage only: the snapshot dict comes from and goes
back to engine.snapshot.
"""

from __future__ import annotations

import errno
import json
import pathlib
import sys
import time

import engine
from engine.atomic_io import atomic_write, atomic_write_text, file_sha256
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


def verify(path: pathlib.Path) -> str | None:
    """None when ``path`` matches its manifest, else what is wrong."""
    manifest = read_manifest(path)
    if manifest is None:
        return "its manifest is missing or unreadable"
    try:
        size = path.stat().st_size
    except OSError:
        return "the file is missing"
    if size != manifest.get("size"):
        return f"size {size} differs from the manifest's {manifest.get('size')} (truncated?)"
    if file_sha256(path) != manifest.get("sha256"):
        return "sha256 differs from the manifest (corrupt)"
    return None


def save_without_crc32(state: dict, fileobj) -> None:
    """torch.save, minus the CRC32 of every record in its zip container: the manifest's
    sha256 already covers the whole file, torch.load never checks the CRC, and on a
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
    _temps_checked = False

    def write_snapshot(self, state: dict, path: pathlib.Path, *, epoch: int, step: int,
                       metrics: dict | None) -> None:
        """Write ``state`` to ``path`` with its manifest (no pointer updates)."""
        size, sha256 = atomic_write(path, lambda f: save_without_crc32(state, f))
        manifest = {"file": path.name, "size": size, "sha256": sha256, "epoch": epoch,
                    "step": step, "metrics": metrics or {}, "created": time.time(),
                    "engine_version": engine.__version__}
        atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1))

    def save(self, state, *, epoch, step, metrics=None):
        self.directory.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temps()
        path = self.directory / snapshot_name(epoch, step)
        try:
            self.write_snapshot(state, path, epoch=epoch, step=step, metrics=metrics)
            self.commit(path, metrics)
        except (OSError, RuntimeError) as exc:
            os_error = _os_error_in(exc)
            if os_error is None:
                raise
            raise self.write_error(path, os_error) from exc
        return path

    def write_error(self, path: pathlib.Path, exc: OSError) -> CheckpointError:
        previous = self._pointer("latest")
        kept = (f"the previous snapshot {previous} is intact" if previous is not None
                else "no earlier snapshot exists")
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            reason += f"; free space in {self.directory} or point out_dir elsewhere"
        return CheckpointError(f"cannot write snapshot {path}: {reason}; {kept}")

    def remove_stale_temps(self) -> None:
        """Temp files of writes that were killed half-way (only one process writes here,
        so none of them can still be in progress)."""
        if self._temps_checked:
            return
        self._temps_checked = True
        for temp in self.directory.glob(".*.tmp-*"):
            temp.unlink(missing_ok=True)

    def commit(self, path: pathlib.Path, metrics: dict | None) -> None:
        """Point ``latest`` (and maybe ``best``) at ``path``, then prune old snapshots."""
        atomic_write_text(self.directory / "latest", path.name + "\n")
        cfg = self.cfg.checkpoint if self.cfg is not None else None
        if cfg is not None and cfg.best_metric and metrics and cfg.best_metric in metrics:
            if self._is_better(metrics[cfg.best_metric], cfg):
                atomic_write_text(self.directory / "best", path.name + "\n")
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

    def latest(self):
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
