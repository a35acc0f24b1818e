"""Crash-consistent file writes and file checksums, shared by the checkpointers and the
run summary.

:func:`atomic_write` writes a temp file in the same directory, fsyncs, renames and
fsyncs the directory: a crash at any moment leaves the old file or the new one
(writers of several files may do the directory fsync once, at the end).
:class:`ChecksumWriter` checksums the bytes on their way to the file, so a manifest
needs no second read; :func:`check_file` checks a file against a manifest entry
(``xxh3_128``, or ``sha256`` in manifests written before xxh3).

Why xxh3-128 (the ``xxhash`` package) and not sha256: the checksum is there to catch
torn writes, truncation and bit rot, not an attacker (who could rewrite the manifest
too); sha256 cost as much CPU as the write, xxh3 is as fast as a hardware crc32c on any
CPU and fast enough to hash inline, and 128 bits leave no realistic chance of a corrupt
file matching (docs/performance.md, "Checksums"). xxhash is imported at the first
checksum, not at start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import io
import mmap
import os
import pathlib
import sys
from typing import Any, Callable

#: The manifest key (and algorithm) of new checksums.
CHECKSUM = "xxh3_128"
#: Older manifests' key, still verified.
LEGACY_CHECKSUMS = ("sha256",)


def new_checksum(algorithm: str = CHECKSUM):
    """A hasher with ``update(bytes-like)`` and ``hexdigest()``."""
    if algorithm == CHECKSUM:
        import xxhash  # lazily: see the module docstring

        return xxhash.xxh3_128()
    if algorithm in LEGACY_CHECKSUMS:
        return hashlib.new(algorithm)
    raise ValueError(f"unknown checksum {algorithm!r}; expected {CHECKSUM!r} or "
                     f"{' or '.join(map(repr, LEGACY_CHECKSUMS))}")


def fsync_directory(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=None)  # one dlopen per process, not one per file
def _writeback_starter() -> Callable[[int, int, int], None] | None:
    """Linux's sync_file_range(SYNC_FILE_RANGE_WRITE): start writing a range of a file
    to disk without waiting for it. None where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # 2: _WRITE


class ChecksumWriter(io.RawIOBase):
    """A file wrapper that checksums and counts what is written through it.

    With ``writeback``, it also asks the kernel to start writing each
    :data:`WRITEBACK_BYTES` to disk as soon as they are written: the disk then works
    while torch.save serializes the rest, and the final fsync waits for the tail only
    (fsync was most of a crash-consistent save's cost)."""

    WRITEBACK_BYTES = 16 << 20

    def __init__(self, raw, algorithm: str = CHECKSUM, writeback: bool = False):
        self.raw = raw
        self.checksum = new_checksum(algorithm)
        self.size = 0
        self._start_writeback = _writeback_starter() if writeback else None
        self._written_back = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.checksum.update(view)
        n = self.raw.write(view)
        if n is not None and n != view.nbytes:
            # A raw file may write less; torch's writer does not retry, so neither do
            # we silently: the checksum would cover bytes that are not on disk.
            raise OSError(f"short write: {n} of {view.nbytes} bytes")
        self.size += view.nbytes
        if (self._start_writeback is not None
                and self.size - self._written_back >= self.WRITEBACK_BYTES):
            self.raw.flush()
            self._start_writeback(self.raw.fileno(), self._written_back,
                                  self.size - self._written_back)
            self._written_back = self.size
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()


def temp_name(path: pathlib.Path) -> pathlib.Path:
    """Where :func:`atomic_write` stages ``path``: hidden, and named after this process,
    so a clean-up can tell the temp files of dead writers (see :func:`stale_temps`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def stale_temps(directory: pathlib.Path) -> list[pathlib.Path]:
    """Temp files in ``directory`` left by writers that are gone (killed half-way): the
    pid in the name is not a running process, or is this one (nothing of ours is being
    written while the caller cleans up)."""
    stale = []
    for temp in pathlib.Path(directory).glob(".*.tmp-*"):
        pid = temp.name.rpartition(".tmp-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or not pid_alive(int(pid)):
            stale.append(temp)
    return stale


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs (on this machine). A zombie does not: a
    killed writer whose parent died too waits as one until init reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return process_state(pid) != "Z"  # "" without /proc: os.kill said it exists


def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: [0] the state, [1] the
    parent's PID, [19] the start time in clock ticks since boot (the man page's fields
    3, 4 and 22); [] when the process is gone or there is no /proc. ``pid`` may be
    "self"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses.
            return f.read().rpartition(b")")[2].decode().split()
    except OSError:
        return []


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T stopped, Z zombie...); "" when the
    process is gone or there is no /proc."""
    fields = proc_stat(pid)
    return fields[0] if fields else ""


def atomic_write(path: pathlib.Path, write: Callable[[Any], None], *,
                 sync_directory: bool = True) -> tuple[int, str]:
    """Write ``path`` through ``write(fileobj)`` crash-consistently.

    Returns (size, xxh3-128 hex) of what was written. On any error (a full disk
    included) the temp file is removed and the previous ``path``, if any, is untouched.
    With ``sync_directory=False`` the rename is not yet durable: the caller fsyncs the
    directory (:func:`fsync_directory`) before anything relies on it; until then a
    crash may leave the old ``path`` (never a partial new one: the data was fsynced
    before the rename).
    """
    path = pathlib.Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as raw:
            writer = ChecksumWriter(raw, writeback=True)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        if sync_directory:
            fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return writer.size, writer.checksum.hexdigest()


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save reports one (a full disk) as a
    RuntimeError ("unexpected pos ...") whose context is the OSError."""
    while exc is not None:
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def atomic_write_text(path: pathlib.Path, text: str, *, sync_directory: bool = True) -> None:
    atomic_write(path, lambda f: f.write(text.encode()), sync_directory=sync_directory)


def file_checksum(path: pathlib.Path, algorithm: str = CHECKSUM) -> str:
    """The checksum of the file at ``path``, read through a memory map (the page cache
    is hashed in place: no copy into a buffer)."""
    digest = new_checksum(algorithm)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as memory:
                with memoryview(memory) as view:
                    step = 1 << 26  # sha256 holds the GIL per call: keep calls short
                    for start in range(0, len(view), step):
                        digest.update(view[start:start + step])
    return digest.hexdigest()


def checksum_entry(size: int, checksum: str) -> dict:
    """What a manifest records about one file."""
    return {"size": size, CHECKSUM: checksum}


def check_file(path: pathlib.Path, entry: dict, *, deep: bool = True) -> str | None:
    """None when the file at ``path`` has the size and checksum that the manifest
    ``entry`` records, else what is wrong (one phrase). ``deep=False``: the size only
    (no read of the data)."""
    try:
        size = path.stat().st_size
    except OSError:
        return "the file is missing"
    if size != entry.get("size"):
        return f"size {size} differs from the manifest's {entry.get('size')} (truncated?)"
    if not deep:
        return None
    for algorithm in (CHECKSUM, *LEGACY_CHECKSUMS):
        if algorithm in entry:
            if file_checksum(path, algorithm) != entry[algorithm]:
                return f"{algorithm} differs from the manifest (corrupt)"
            return None
    return f"the manifest records no checksum ({CHECKSUM} or sha256)"


def file_identity(path: pathlib.Path) -> tuple | None:
    """What changes when a file, or any file in a folder, is replaced or rewritten
    (device, inode, size, modification time of each), without reading it; None when
    ``path`` is gone. Lets a reader skip hashing again what it has just verified."""
    path = pathlib.Path(path)
    try:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        stats = [(str(p.relative_to(path)) if p != path else "", p.stat()) for p in files]
    except OSError:
        return None
    return tuple((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                 for name, st in stats)
