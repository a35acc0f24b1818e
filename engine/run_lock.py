"""One run per folder: the run holds an exclusive lock on its ``out_dir`` for its whole
life, so that a second run started on the same folder (a second terminal, a job array
with a fixed out_dir, a requeue racing a manual rerun) is refused before any of its
workers trains, instead of resuming the first run's snapshot and writing over its files.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<out_dir>/.engine-lock``: the
kernel releases it however the holder dies, so a restarted run takes over at once, and
it works on clusters' shared filesystems (NFS, Lustre with ``flock``). The file's content
(host, PID, start time) only informs the refusal. The holder is the process that
launches the workers of the node with rank 0, or rank 0 itself when a launcher adopted
it; a folder named with a placeholder (``{version}``) is new for each run and needs none.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import pathlib
import socket
import stat
from typing import Iterator

from engine.errors import LaunchError
from engine.run_dir import is_pattern

LOCK_FILE = ".engine-lock"

#: The lock files this process holds: a POSIX lock belongs to the process, so a second
#: run in this same process (an engine.fit in a thread) would get it again, and closing
#: its descriptor would release the first run's.
_HELD: set[pathlib.Path] = set()


@contextlib.contextmanager
def holding(out_dir: str, asked_by: str = "engine-run") -> Iterator[None]:
    """Hold ``out_dir``'s lock while the block runs; a LaunchError (exit 2) naming the
    holder when another run holds it."""
    if is_pattern(out_dir):
        yield
        return
    folder = pathlib.Path(out_dir)
    created = not folder.exists()
    # The folder resolved, not the lock: a link planted at .engine-lock is refused, not
    # followed (it would have the run truncate whatever file it points to).
    path = folder.resolve() / LOCK_FILE
    if path in _HELD:  # checked before opening it: closing a second descriptor would
        raise _in_use(asked_by, out_dir, f"this process, pid {os.getpid()}")  # unlock it
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise _unusable(asked_by, path, exc) from None
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise _unusable(asked_by, path, None, _kind_of(kind))
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise _unusable(asked_by, path, exc) from None
            # Another process's lock: closing this descriptor leaves it held.
            raise _in_use(asked_by, out_dir, _holder(fd)) from None
    except BaseException:
        os.close(fd)
        raise
    _HELD.add(path)
    try:
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started "
                          f"{started}\n".encode(), 0)
        except OSError as exc:
            raise _unusable(asked_by, path, exc) from None
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


def _unusable(asked_by: str, path: pathlib.Path, exc: OSError | None,
              wrong: str = "") -> LaunchError:
    """The lock file cannot serve: what it is or what the system said, and the fix."""
    if exc is not None and exc.errno == errno.ELOOP:
        wrong = "is a symbolic link, which the run does not follow"
    elif exc is not None and exc.errno == errno.EISDIR:
        wrong = _kind_of(stat.S_IFDIR)
    elif exc is not None:
        wrong = f"cannot be opened, locked and written: {exc.strerror or exc}"
        if exc.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
            wrong += " (read-only, immutable or not yours: see lsattr, ls -l)"
        elif exc.errno == errno.ENOLCK:
            wrong += " (the filesystem takes no locks: NFS without its lock manager?)"
    return LaunchError(f"{asked_by}: the run lock {path} {wrong}; remove it (the run "
                       "creates its own) or give another out_dir")


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return f"is {name}, not a file"
    return "is not a regular file"


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its holder did not say who it is"
