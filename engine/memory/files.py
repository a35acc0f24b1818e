"""The memory tier's files and ids: this user's folder in the shared tmpfs, the run's id,
each rank's buffer names. Nothing in /dev/shm is trusted for its name (CWE-377, CWE-59):
the folder must be this user's real folder closed to others (else a private one,
:func:`own_folder`), a buffer this user's regular file, opened without following a link;
anything else is :class:`Unsafe` (the tier goes off with one warning). The run id, in
the run folder's ``.engine-memory-id``, is in every buffer's name and header."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import re
import secrets
import socket
import stat

from engine.atomic_io import atomic_write_text
from engine.shm import SHM

FOLDER_PREFIX = "engine-memory-"  # + the user id
#: In the run folder, where this user's folder was taken: {host: its private folder}.
FOLDER_FILE = ".engine-memory-folder"
_PRIVATE = re.compile(rf"{FOLDER_PREFIX}\d+-[0-9a-f]{{32}}")
#: The run's id, in the run folder: a buffer without it is not this run's.
RUN_ID_FILE = ".engine-memory-id"
# "-held-": the copies of the predecessor's snapshots under fsdp (engine/memory/ring.py).
BUFFER_NAME = re.compile(r"(?P<run_id>[0-9a-f]{32})-r(?P<rank>\d+)-(?:held-)?[ab]")


class Unsafe(Exception):
    """A folder or buffer in the shared tmpfs that is not this user's own (a link,
    another user's file, a folder open to others, a directory at a buffer's name)."""


class NoRoom(Exception):
    """The tmpfs could not hold a buffer (ENOSPC while reserving its pages)."""


def user_folder(shm: pathlib.Path = SHM) -> pathlib.Path:
    return pathlib.Path(shm) / f"{FOLDER_PREFIX}{os.geteuid()}"


def own_dir(folder: pathlib.Path, create: bool = True, new: bool = False) -> pathlib.Path:
    """``folder``, made 0700 when missing (``create``; ``new``: it must not exist yet);
    Unsafe unless it is a real folder (not a link) of this user's, closed to others."""
    try:
        try:
            if create or new:
                os.mkdir(folder, 0o700)  # never follows a link at the name: EEXIST
        except FileExistsError:
            if new:
                raise
        info = os.lstat(folder)
    except OSError as exc:
        raise Unsafe(f"cannot make {folder}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise Unsafe(f"{folder} is a symbolic link, not this user's folder")
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(f"{folder} is not a folder")
    if info.st_uid != os.geteuid():
        raise Unsafe(f"{folder} belongs to uid {info.st_uid}, not to this user "
                     f"(uid {os.geteuid()})")
    if info.st_mode & 0o077:
        raise Unsafe(f"{folder} is open to other users (mode "
                     f"{stat.S_IMODE(info.st_mode):o}, expected 700)")
    return pathlib.Path(folder)


def _records(fd: int) -> dict:
    try:
        records = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _recorded(records: dict, shm) -> pathlib.Path | None:
    """This host's private folder in ``records`` while it is this user's own."""
    name = records.get(socket.gethostname())
    if isinstance(name, str) and _PRIVATE.fullmatch(name):
        with contextlib.suppress(Unsafe):
            return own_dir(pathlib.Path(shm) / name, create=False)
    return None


def folder_of(run_dir, shm: pathlib.Path = SHM) -> pathlib.Path:
    """Where the run's buffers are on this host: the private folder recorded in the run
    folder (:func:`own_folder`) while it is this user's own, else :func:`user_folder`."""
    try:
        fd = os.open(pathlib.Path(run_dir) / FOLDER_FILE,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return user_folder(shm)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: read as it is
            fcntl.flock(fd, fcntl.LOCK_SH)  # never while own_folder writes it
        return _recorded(_records(fd), shm) or user_folder(shm)
    finally:
        os.close(fd)


def own_folder(run_dir, shm: pathlib.Path = SHM) -> pathlib.Path:
    """The run's buffer folder on this host (:func:`folder_of`'s, made when missing), or,
    where another user took the name first, a private one of random name, recorded in
    the run folder (under its lock) for the restarts and other local ranks; or Unsafe."""
    try:
        return own_dir(folder_of(run_dir, shm))
    except Unsafe as exc:
        taken = exc
    record = pathlib.Path(run_dir) / FOLDER_FILE
    try:
        fd = os.open(record, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            records = _records(fd)
            folder = _recorded(records, shm)  # another local rank's, made meanwhile
            if folder is None:
                folder = own_dir(pathlib.Path(shm) / f"{FOLDER_PREFIX}{os.geteuid()}-"
                                 f"{secrets.token_hex(16)}", new=True)
                text = json.dumps({**records, socket.gethostname(): folder.name}).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, text, 0)
        finally:
            os.close(fd)
    except (OSError, Unsafe) as exc:
        raise Unsafe(f"{taken}; and no private folder could be had instead ({record}: "
                     f"{getattr(exc, 'strerror', None) or exc})") from None
    return folder


def open_own(path: pathlib.Path, writable: bool) -> int:
    """A descriptor of the buffer at ``path``: never through a link, created exclusively
    when missing (``writable``), and only a regular file of this user's closed to others.
    FileNotFoundError when it is missing and not ``writable``; Unsafe otherwise."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDWR if writable else os.O_RDONLY)
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not writable:
                raise
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unsafe(f"{path} is not a buffer of this user's ({exc.strerror or exc})") \
            from None
    info = os.fstat(fd)
    problem = (None if stat.S_ISREG(info.st_mode) else "not a regular file") or (
        None if info.st_uid == os.geteuid() else f"it belongs to uid {info.st_uid}") or (
        None if not info.st_mode & 0o077 else
        f"it is open to other users (mode {stat.S_IMODE(info.st_mode):o})")
    if problem:
        os.close(fd)
        raise Unsafe(f"{path} is not a buffer of this user's: {problem}")
    return fd


def _recorded_id(run_dir) -> tuple[str | None, str | None]:
    """The id in ``run_dir``'s RUN_ID_FILE and its folder's inode (None: not recorded)."""
    try:
        run_id, _, folder = (pathlib.Path(run_dir) / RUN_ID_FILE).read_text().partition(" ")
    except (OSError, UnicodeDecodeError):
        return None, None
    return (run_id.strip() if re.fullmatch(r"[0-9a-f]{32}", run_id.strip()) else None,
            folder.strip() or None)


def copied(run_dir) -> bool:
    """Whether ``run_dir``'s id was written in another folder: ``run_dir`` is a copy
    (``cp -a``; a renamed folder keeps its inode, and its id)."""
    run_id, folder = _recorded_id(run_dir)
    return run_id is not None and folder not in (None, str(os.stat(run_dir).st_ino))


def run_id_of(run_dir) -> str | None:
    """The run id kept in ``run_dir`` (None: none, not one, or a copy's)."""
    return None if copied(run_dir) else _recorded_id(run_dir)[0]


def claim_run_id(run_dir, fresh: bool) -> tuple[str | None, str]:
    """Rank 0 at the start: (the id ``run_dir`` had, the run's id): the old one unless
    the run starts ``fresh`` or has none, else a new one written with the folder's inode."""
    old = run_id_of(run_dir)
    if old is not None and not fresh:
        return old, old
    new = secrets.token_hex(16)
    atomic_write_text(pathlib.Path(run_dir) / RUN_ID_FILE,
                      f"{new} {os.stat(run_dir).st_ino}\n")
    return old, new


def buffer_paths(run_dir, rank: int, shm: pathlib.Path = SHM, run_id: str | None = None,
                 folder: pathlib.Path | None = None) -> tuple[pathlib.Path, ...]:
    """Rank ``rank``'s two buffers of the run in ``run_dir`` (its id read from there
    unless given; a run without one has none: paths that do not exist)."""
    run_id = run_id or run_id_of(run_dir) or "0" * 32
    return tuple((folder or folder_of(run_dir, shm)) / f"{run_id}-r{rank}-{x}" for x in "ab")


def run_buffers(run_id: str, shm: pathlib.Path = SHM, run_dir=None) -> list[pathlib.Path]:
    """Every rank's buffers of the run ``run_id`` (in ``run_dir``) on this machine."""
    folder = user_folder(shm) if run_dir is None else folder_of(run_dir, shm)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(folder / n for n in names
                  if (m := BUFFER_NAME.fullmatch(n)) and m["run_id"] == run_id)


def writer_gone(path: pathlib.Path) -> bool:
    """Whether no process holds the buffer at ``path`` open for writing (its writer's
    flock, :class:`Buffer`): the kernel drops it however the writer ended."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # and the lock with it
    return True


def mount_namespace() -> str | None:
    """This process's mount namespace: containers sharing a tmpfs and a host name
    (--ipc=host --net=host) see other run folders at the same paths."""
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None
