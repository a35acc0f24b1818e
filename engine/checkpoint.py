"""The checkpointer interface, the store that every file-based checkpointer is built on.

Words (used the same way in the code, the docs and the messages):

- a **snapshot** is the whole training state that an exact resume needs: model,
  optimizer, scheduler, grad scaler, epoch/step/position, RNG states, config. The core
  captures and restores it (:mod:`engine.snapshot`); on disk it is one file or folder
  (``snapshot-e0002-s00001564.pt``) under ``<out_dir>/checkpoints/``.
- a **checkpointer** (a plugin: torch-file, async, dcp) is storage only: it saves a
  snapshot dict, lists the saved ones, verifies and loads them back. It never sees the
  Engine, a model or an optimizer. :class:`Checkpointer` is the interface the core
  calls; :class:`SnapshotStore` implements it for snapshots kept as files or folders
  with manifests and pointer files, so that a format (a backend) only says how one
  snapshot is written and read.
- **checkpoint** on its own names that storage side: the ``checkpoint.*`` config group
  (when to save, how many to keep), the ``checkpoints/`` folder, :class:`CheckpointError`.
The state-dict helpers (``model_digest``...) are in engine/stateful.py, importable here.
"""

from __future__ import annotations

import errno
import hashlib
import json
import pathlib
import shutil
import time
from typing import Any, Callable, ClassVar

import engine
from engine import stateful
from engine.atomic_io import (atomic_write, atomic_write_text, check_file, checksum_entry,
                              fsync_directory, os_error_in, stale_temps)
from engine.errors import CheckpointError, first_line, untrusted_pickle, warn
from engine.metrics import improves, resolved_mode

#: The model's keys and digest moved beside the model state part, engine/stateful.py
#: (after 0.2.0); still importable from here.
_MOVED_TO_STATEFUL = frozenset({"COMPILED_SEGMENT", "add_module_prefix", "load_model_state",
                                "model_digest", "plain_keys", "uncompiled_key"})


def __getattr__(name: str):
    if name in _MOVED_TO_STATEFUL:
        return getattr(stateful, name)
    raise AttributeError(f"module 'engine.checkpoint' has no attribute {name!r}")


# ----------------------------------------------------------- the checkpointer


class Checkpointer:
    """Storage for snapshots under ``directory``: save, list, verify, load. No Engine.

    A snapshot reaches :meth:`save` as a dict of tensors and plain Python values
    (loadable with ``torch.load(weights_only=True)``), and :meth:`load` gives the same
    dict back. The core (:mod:`engine.snapshot`) decides what goes in and what to do
    with it. Constructed as ``Checkpointer(directory, cfg, world)``: ``cfg.checkpoint``
    says how many to keep and which is best, ``world`` which rank this is.

    This is the interface the core calls. A store of snapshot files or folders
    subclasses :class:`SnapshotStore`, which implements all of it but the format.
    """

    name: ClassVar[str] = ""
    #: True when every rank takes part in save and load (sharded formats); otherwise
    #: only rank 0 saves, and every rank loads.
    all_ranks: ClassVar[bool] = False
    #: True when "model" and "optimizer" are to be in get_state_dict's form (keyed by
    #: parameter name, sharded tensors left sharded; torch.distributed.checkpoint), and
    #: :meth:`load` gets a ``template`` of it: a sharded format reads each part in place.
    distributed_state_dict: ClassVar[bool] = False

    def __init__(self, directory: pathlib.Path, cfg=None, world=None):
        self.directory = pathlib.Path(directory)
        self.cfg = cfg
        self.world = world

    def save(self, state: dict, *, epoch: int, step: int, metrics: dict | None = None
             ) -> pathlib.Path:
        """Store ``state`` durably; returns its path (durable once :meth:`wait` returns)."""
        raise NotImplementedError

    def load(self, path: pathlib.Path, *, map_location=None, template: dict | None = None
             ) -> dict:
        """The snapshot dict stored at ``path``. ``template``: see
        :attr:`distributed_state_dict`; formats that store the dict as it is ignore it."""
        raise NotImplementedError

    def latest(self) -> pathlib.Path | None:
        """The newest snapshot that passes its integrity check, or None."""
        raise NotImplementedError

    def best(self) -> pathlib.Path | None:
        """The best snapshot by ``cfg.checkpoint.best_metric``, or None (no metric set,
        none saved yet, or a format that does not keep one)."""
        return None

    def snapshots(self) -> list[pathlib.Path]:
        """Every snapshot in :attr:`directory`, usable or not, oldest first (the core
        counts them when none is usable)."""
        return []

    def verify(self, path: pathlib.Path) -> str | None:
        """What is wrong with the snapshot at ``path`` (None: nothing, or a format that
        cannot tell); ``--resume PATH`` asks before loading."""
        return None

    def resolve(self, given: str) -> pathlib.Path:
        """The snapshot that ``--resume GIVEN`` means (a store with pointer files takes
        a pointer or a folder for the snapshot it names); here: ``given`` itself."""
        return pathlib.Path(given)

    def wait(self) -> None:
        """Block until every save started so far is durable."""

    def close(self) -> None:
        """:meth:`wait`, then let go of what the checkpointer holds. Called at the end
        of every run, failed ones included; calling it again does no harm."""
        self.wait()


# ------------------------------------------------------- a store of snapshots
#
# On disk, under ``<out_dir>/checkpoints/``:
#
#     snapshot-e0002-s00001564.pt        one snapshot (a file, or a folder of files)
#     snapshot-e0002-s00001564.pt.json   its manifest: size and xxh3_128 of every byte of
#                                        it, epoch, step, config digest, metrics (after it)
#     latest                             the name of the newest committed snapshot
#     best                               the best by cfg.checkpoint.best_metric, if set

PREFIX = "snapshot-"


def follow_pointer(given) -> pathlib.Path:
    """The snapshot ``--resume`` (and tools/ckpt.py) names: itself, or the one a pointer
    file names, or a checkpoint or run folder's ``latest`` (a user copies the path seen)."""
    path = pathlib.Path(given)
    for pointer in (path, path / "latest", path / "checkpoints" / "latest"):
        if pointer.name in POINTERS and pointer.is_file():
            try:
                name = pointer.read_text().strip()
            except (OSError, UnicodeDecodeError):
                return path  # not a pointer after all: checked as a snapshot
            if name and "/" not in name:
                return pointer.parent / name
    return path

#: The pointer files of a checkpoint folder: each holds the name of a snapshot beside it.
POINTERS = ("latest", "best")


def manifest_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".json")


def config_digest(config) -> str:
    """A resolved config's digest, in the manifest: what a rerun checks config.json by."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(path: pathlib.Path) -> dict | None:
    """The manifest of the snapshot at ``path``, or None (missing or unreadable)."""
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None


def check_recorded(path: pathlib.Path, manifest: dict, deep: bool = True) -> str | None:
    """None when the snapshot at ``path`` has the bytes its manifest records, else what
    is wrong (one phrase). A manifest records one file (``size`` and checksum at its
    top) or a folder's files (``files``: name -> size and checksum). ``deep=False``
    compares sizes only (nothing is read)."""
    files = manifest.get("files")
    if files is None:
        return check_file(path, manifest, deep=deep)
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


def disk_full_hint(exc: OSError, directory: pathlib.Path) -> str:
    """What to do about a failed write, when there is something to do."""
    if exc.errno == errno.ENOSPC:
        return f"; free space in {directory} or point out_dir elsewhere"
    return ""


#: path -> identity (device, inode, size, mtime) of a snapshot file when its check last
#: passed, so that load() right after latest() does not hash the same bytes again.
_verified: dict[str, tuple] = {}


def _identity(path: pathlib.Path) -> tuple | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class SnapshotStore(Checkpointer):
    """A checkpointer that keeps each snapshot as a file or a folder in
    :attr:`directory`, with a manifest beside it and the ``latest`` and ``best``
    pointers. A backend says how one snapshot is written and read:

    - :attr:`suffix`: the end of its names (``snapshot-e0002-s00001564`` + suffix);
    - :meth:`write` ``(path, state)``: write the snapshot at ``path``, crash-consistently
      (:meth:`write_file` does it for one file), and return what the manifest records
      about its bytes;
    - :meth:`read` ``(path, *, map_location, template)``: the snapshot dict back;
    - optionally :meth:`check` ``(path, manifest)``: what the format requires beyond the
      sizes and checksums the manifest records.

    The store does the rest, the same for every format: the manifest (after the
    snapshot), ``latest`` and ``best`` (after the manifest), one fsync of the folder per
    save, pruning to ``cfg.checkpoint.keep_last`` (never ``latest`` or ``best``),
    :meth:`latest` falling back past snapshots that fail their check, :meth:`verify`,
    :meth:`resolve` for ``--resume``, and the removal of what killed writes leave.

    A crash at any moment leaves the previous snapshot usable: the new one counts once
    its manifest is there and matches it, and ``latest`` names it only after that.
    """

    #: The end of a snapshot's name: ``".pt"``, ``".dcp"``...
    suffix: ClassVar[str] = ""
    #: True when a snapshot is a folder of files (the manifest lists each) rather than
    #: one file.
    folder: ClassVar[bool] = False
    #: False when :meth:`load` is not to check the snapshot against its manifest first
    #: (a sharded format, whose every rank would read every file: rank 0 checked it in
    #: :meth:`latest`, or ``--resume`` did through :meth:`verify`).
    check_on_load: ClassVar[bool] = True

    _cleaned = False

    # ----------------------------------------------------- what a backend says

    def write(self, path: pathlib.Path, state: dict) -> dict:
        """Write ``state`` as the snapshot at ``path``, crash-consistently (nothing at
        ``path`` until it is whole), without the fsync of the folder (the store does
        one per save). Returns what the manifest records about its bytes:
        :meth:`write_file`'s answer for one file, ``{"files": {name: {"size": ...,
        "xxh3_128": ...}}}`` for a folder (plus anything else worth keeping there). With
        :attr:`all_ranks`, every rank calls it; rank 0's answer is the one recorded."""
        raise NotImplementedError

    def read(self, path: pathlib.Path, *, map_location=None, template: dict | None = None
             ) -> dict:
        """The snapshot dict at ``path`` (see :meth:`Checkpointer.load`). An exception
        other than a CheckpointError becomes one naming the snapshot."""
        raise NotImplementedError

    def check(self, path: pathlib.Path, manifest: dict) -> str | None:
        """What the format requires of a snapshot beyond the sizes and checksums its
        manifest records (checked after this); None: nothing."""
        return None

    def write_file(self, path: pathlib.Path, write: Callable[[Any], None]) -> dict:
        """For :meth:`write`: ``write(fileobj)`` fills the file at ``path``, through a
        temp file that is fsynced and renamed (:func:`engine.atomic_io.atomic_write`),
        checksummed on the way; returns its manifest record."""
        size, checksum = atomic_write(path, write, sync_directory=False)
        return {"file": path.name, **checksum_entry(size, checksum)}

    # ---------------------------------------------------------------- names

    def snapshot_name(self, epoch: int, step: int) -> str:
        return f"{PREFIX}e{epoch:04d}-s{step:08d}{self.suffix}"

    @property
    def rank(self) -> int:
        return self.world.rank if self.world is not None else 0

    @property
    def commits(self) -> bool:
        """Whether this process writes the manifest and pointers: the one that saves,
        or rank 0 of a store that all ranks save."""
        return not self.all_ranks or self.rank == 0

    def snapshots(self) -> list[pathlib.Path]:
        """Every snapshot here, usable or not, oldest first (by step, then epoch)."""
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.glob(f"{PREFIX}*{self.suffix}")
                       if p.is_dir() == self.folder),
                      key=lambda p: (p.name.split("-s")[-1], p.name))

    def pointer(self, name: str) -> pathlib.Path | None:
        """The snapshot the pointer file ``name`` (``latest``, ``best``) names, or None;
        it may no longer exist."""
        try:
            target = (self.directory / name).read_text().strip()
        except OSError:
            return None
        return self.directory / target if target else None

    # --------------------------------------------------------------- saving

    def save(self, state, *, epoch, step, metrics=None):
        path = self.directory / self.snapshot_name(epoch, step)
        if self.commits:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean_up_once()
        try:
            self.write_and_commit(state, path, epoch=epoch, step=step, metrics=metrics)
        except (OSError, RuntimeError) as exc:
            os_error = os_error_in(exc)
            if os_error is None:
                raise
            raise self.write_error(path, os_error) from exc
        return path

    def write_and_commit(self, state: dict, path: pathlib.Path, *, epoch: int, step: int,
                         metrics: dict | None) -> None:
        """:meth:`write` the snapshot, then its manifest, then :meth:`commit` it.

        When the manifest or the commit fails (the disk filled up after the snapshot
        itself), the new snapshot goes again: ``latest`` still names the previous one,
        which is what a resume takes and what the error says is intact, and the new
        files would only take space (and warnings at every start)."""
        record = self.write(path, state)
        if not self.commits:
            return  # a sharded store's other ranks: their share is written
        try:
            manifest = {**record, "epoch": epoch, "step": step, "metrics": dict(metrics or {}),
                        "config": config_digest(state.get("config")),
                        "created": time.time(), "engine_version": engine.__version__}
            atomic_write_text(manifest_path(path), json.dumps(manifest, indent=1),
                              sync_directory=False)  # commit() syncs the folder once
            self.commit(path, metrics)
        except BaseException:
            if self.pointer("latest") != path:
                self.remove(path)
            raise

    def write_error(self, path: pathlib.Path, exc: OSError) -> CheckpointError:
        previous = self.pointer("latest")
        kept = (f"the previous snapshot {previous} is intact" if previous is not None
                else "no earlier snapshot exists")
        reason = (exc.strerror or str(exc)) + disk_full_hint(exc, self.directory)
        return CheckpointError(f"cannot write snapshot {path}: {reason}; {kept}")

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
        self.prune(keep=cfg.keep_last if cfg is not None else 0)

    def _is_better(self, value: float, cfg) -> bool:
        """Whether ``value`` beats the best snapshot's (strictly: a later snapshot that
        carries the same metrics, one written mid-epoch, does not take its place). The
        mode and the comparison are early stopping's (engine/metrics.py), so the two
        agree on the best epoch."""
        mode = resolved_mode(cfg.best_metric, cfg.best_mode, "checkpoint.best_mode")
        best = self.pointer("best")
        old = None if best is None else (
            (read_manifest(best) or {}).get("metrics", {}).get(cfg.best_metric))
        return improves(value, old, mode)

    def prune(self, keep: int) -> None:
        """Remove all but the ``keep`` newest snapshots (0: keep all), sparing the ones
        ``latest`` and ``best`` name."""
        if keep <= 0:
            return
        protected = {self.pointer("latest"), self.pointer("best")}
        old = [p for p in self.snapshots() if p not in protected]
        for path in old[: max(0, len(old) - (keep - 1))]:
            self.remove(path)

    def remove(self, path: pathlib.Path) -> None:
        """The snapshot at ``path`` and its manifest; the manifest first: it is what
        makes a snapshot count, so a kill half-way leaves one that is never resumed
        from (and goes with the next prune), not a half-removed folder that looks whole."""
        manifest_path(path).unlink(missing_ok=True)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------- clean-up

    def clean_up_once(self) -> None:
        """:meth:`clean_up`, the first time this checkpointer touches its folder."""
        if not self._cleaned:
            self._cleaned = True
            self.clean_up()

    def clean_up(self) -> None:
        """Remove what killed writes left here: temp files whose writer is gone (the pid
        in their name), and manifests whose snapshot is gone. Only this folder's own
        names: nothing else in it is touched. Rank 0 only: it is the one that commits
        here, and another node would take its live writer's pid for a dead one. A
        backend that stages elsewhere in the folder adds its own leftovers."""
        if self.rank != 0 or not self.directory.is_dir():
            return
        for temp in stale_temps(self.directory):
            temp.unlink(missing_ok=True)
        for manifest in self.directory.glob(f"{PREFIX}*{self.suffix}.json"):
            if not manifest.with_name(manifest.name[:-len(".json")]).exists():
                manifest.unlink(missing_ok=True)

    def close(self) -> None:
        super().close()
        self.clean_up()

    # ------------------------------------------------------------- choosing

    def problem(self, path: pathlib.Path, *, deep: bool = True) -> str | None:
        """None when the snapshot at ``path`` matches its manifest (and :meth:`check`
        passes), else what is wrong; a missing manifest is wrong. ``deep=False``
        compares sizes only."""
        path = pathlib.Path(path)
        manifest = read_manifest(path)
        if manifest is None:
            return "its manifest is missing or unreadable"
        identity = _identity(path)
        problem = self.check(path, manifest) or check_recorded(path, manifest, deep)
        if (problem is None and deep and not path.is_dir() and identity is not None
                and identity == _identity(path)):
            _verified.clear()  # one entry is all load() needs: no growth over a long run
            _verified[str(path)] = identity
        return problem

    def verify(self, path) -> str | None:
        """What is wrong with the snapshot at ``path`` (None: nothing); --resume asks.
        One without a manifest (saved by hand) cannot be checked and passes."""
        path = pathlib.Path(path)
        return self.problem(path) if manifest_path(path).exists() else None

    def latest(self):
        self.clean_up_once()
        candidates = self.snapshots()
        pointed = self.pointer("latest")
        if pointed is not None and pointed in candidates:
            # The pointer wins; anything newer than it was never committed.
            candidates = candidates[: candidates.index(pointed) + 1]
        # With all_ranks every rank asks, but rank 0's answer is the one that counts
        # (engine.snapshot.resume broadcasts it): the others skip reading the data.
        for path in reversed(candidates):
            problem = self.problem(path, deep=self.rank == 0)
            if problem is None:
                return path
            if self.rank == 0:
                # Every time: a snapshot found unusable twice is said twice.
                warn(f"snapshot {path} is unusable: {problem}; trying the previous one",
                     said=None)
        return None

    def best(self):
        pointed = self.pointer("best")
        return pointed if pointed is not None and pointed.exists() else None

    def resolve(self, given: str) -> pathlib.Path:
        """What ``--resume`` names (:func:`follow_pointer`)."""
        return follow_pointer(given)

    # -------------------------------------------------------------- loading

    def load(self, path, *, map_location=None, template=None):
        path = pathlib.Path(path)
        if not path.exists():
            raise CheckpointError(f"snapshot {str(path)!r} not found")
        # Checked unless problem() just passed this very file (latest() before load():
        # hashing it again would cost a second read for nothing). A snapshot without a
        # manifest (an export, a hand-made torch.save) is loaded as it is.
        if (self.check_on_load and manifest_path(path).exists()
                and _verified.get(str(path)) != _identity(path)):
            problem = self.problem(path)
            if problem is not None:
                raise CheckpointError(f"snapshot {str(path)!r} is unusable: {problem}")
        try:
            return self.read(path, map_location=map_location, template=template)
        except CheckpointError:
            raise
        except Exception as exc:
            untrusted = untrusted_pickle(f"snapshot {str(path)!r}", exc)
            if untrusted:
                raise CheckpointError(untrusted) from None
            raise CheckpointError(f"snapshot {str(path)!r} cannot be loaded: "
                                  f"{type(exc).__name__}: {first_line(exc)}") from None
