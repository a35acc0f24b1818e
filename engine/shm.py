"""Shared memory in a tmpfs (``/dev/shm``): how much room it has (:func:`free_bytes`,
asked by the memory tier, engine/memory/, and the async checkpointer,
plugins/async_file.py, before they take any), and the sweep of what a killed writer of
the memory tier left there (:func:`sweep`: a tmpfs outlives the process). What may be
removed is decided here once: only this user's regular files, never what someone else
put at a name they could guess."""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Callable

#: The tmpfs every Linux machine has: memory that outlives a process, not the machine.
SHM = pathlib.Path("/dev/shm")


def free_bytes(folder) -> int | None:
    """The bytes this user may still take in the filesystem of ``folder`` (statvfs's
    ``f_bavail``); None where it cannot be asked (no such folder, not Linux-like): the
    caller's reservation (posix_fallocate) then says whether there is room."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def unlink_own(paths) -> list[str]:
    """Remove those of ``paths`` that are this user's regular files (anything else at
    such a name is left as it is: someone else's to remove, never ours); a warning, not
    an error, for each that could not go."""
    problems = []
    for path in paths:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"could not look at the shared-memory file {path}: "
                            f"{exc.strerror or exc}")
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            continue
        try:
            pathlib.Path(path).unlink(missing_ok=True)
        except OSError as exc:
            problems.append(f"could not remove the shared-memory file {path}: "
                            f"{exc.strerror or exc}")
    return problems


def sweep(folder, left_behind: Callable[[str, pathlib.Path], bool]
          ) -> tuple[list[pathlib.Path], list[str]]:
    """Remove the files in ``folder`` that ``left_behind(name, path)`` says a gone
    writer left, this user's regular files among them only (:func:`unlink_own`).
    Returns what was removed and a warning for each that could not be; a folder that
    cannot be listed (none yet) has nothing to sweep."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return [], []
    removed, problems = [], []
    for name in names:
        path = pathlib.Path(folder) / name
        if not left_behind(name, path):
            continue
        problems += unlink_own([path])
        if not os.path.lexists(path):  # not someone else's, left where it was
            removed.append(path)
    return removed, problems
