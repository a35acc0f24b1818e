"""One run per folder: the run holds an exclusive lock on its ``out_dir`` for its whole
life, so that a second run started on the same folder (a second terminal, a job array
with a fixed out_dir, a requeue racing a manual rerun) is refused before any of its
workers trains, instead of resuming the first run's snapshot and writing over its files.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<out_dir>/.engine-lock``: the
kernel releases it when the holder dies, however it dies, so a run restarted after a
crash (a rerun, a torchrun restart, a SLURM requeue) takes over at once; and it works on
the shared filesystems clusters use (NFS through its lock manager, Lustre mounted with
``flock`` or ``localflock``). The file says who holds it (host, PID, start time) for the
refusal's message; its content is only informative, the lock is what counts.

Who holds it: the process that launches the workers of the node with rank 0 (spawn), or
rank 0 itself when a launcher adopted the process (torchrun, SLURM, legacy). A folder
whose name has a placeholder (``{version}``) is new for each run and needs none.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import socket
from typing import Iterator

from engine.errors import LaunchError

LOCK_FILE = ".engine-lock"

#: The lock files this process holds: a POSIX lock belongs to the process, so a second
#: run in this same process (an engine.fit in a thread) would get it again, and closing
#: its descriptor would release the first run's.
_HELD: set[pathlib.Path] = set()


@contextlib.contextmanager
def holding(out_dir: str, asked_by: str = "engine-run") -> Iterator[None]:
    """Hold ``out_dir``'s lock while the block runs; a LaunchError (exit 2) naming the
    holder when another run holds it."""
    import fcntl

    from engine.run_dir import is_pattern

    if is_pattern(out_dir):
        yield
        return
    folder = pathlib.Path(out_dir)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / LOCK_FILE).resolve()
    if path in _HELD:  # checked before opening it: closing a second descriptor would
        raise _in_use(asked_by, out_dir, f"this process, pid {os.getpid()}")  # unlock it
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)  # another process's lock: closing this descriptor leaves it held
        raise _in_use(asked_by, out_dir, holder) from None
    _HELD.add(path)
    try:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started "
                      f"{started}\n".encode(), 0)
        yield
    finally:
        # A run that made the folder and wrote nothing in it (refused, or failed before
        # its workers started) leaves no folder behind; removed while still locked.
        if created and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            with contextlib.suppress(OSError):
                path.unlink()
                folder.rmdir()
        # Closing the descriptor releases the lock. The file stays otherwise: removing it
        # could let a third run lock a new file while the second still holds the old one.
        _HELD.discard(path)
        os.close(fd)


def _in_use(asked_by: str, out_dir: str, holder: str) -> LaunchError:
    return LaunchError(f"{asked_by}: out_dir {out_dir} is in use by another run ({holder}); "
                       "wait for it to end, give another out_dir, or use "
                       "out_dir=.../version_{version} for a new folder each run")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its holder did not say who it is"
