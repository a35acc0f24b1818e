"""Crash-consistent file writes, shared by the checkpointers and the run summary.

- :func:`atomic_write`: temp file in the same directory, fsync, rename, fsync of the
  directory. A crash at any moment leaves either the old file or the new one.
- :class:`HashingWriter`: counts and sha256-hashes the bytes on their way to the file,
  so a manifest needs no second read.
- :func:`file_sha256`: the sha256 of a file on disk, read in chunks.

Standard library only: importing this costs nothing at start-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pathlib
from typing import Any, Callable


def fsync_directory(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter(io.RawIOBase):
    """A file wrapper that hashes and counts what is written through it.

    sha256 costs about as much CPU as writing the bytes (``tools/bench_checkpoint.py
    --breakdown``), so a large write is hashed on a helper thread while this thread
    writes the same bytes to the file. Both release the GIL: with a core to spare, the
    hash hides behind the write instead of adding to it. Call :meth:`stop` when done.
    """

    #: Smaller writes are hashed inline: not worth a hand-off to the thread.
    PARALLEL_BYTES = 1 << 20

    def __init__(self, raw):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._helper = None  # a one-thread pool, started by the first large write

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self.PARALLEL_BYTES:
            if self._helper is None:
                from concurrent.futures import ThreadPoolExecutor  # 30 ms: not at import

                self._helper = ThreadPoolExecutor(1, thread_name_prefix="sha256")
            hashing = self._helper.submit(self.sha256.update, view)
            try:
                n = self.raw.write(view)
            finally:
                hashing.result()  # the caller may reuse its buffer once we return
        else:
            self.sha256.update(view)
            n = self.raw.write(view)
        self.size += view.nbytes
        return view.nbytes if n is None else n

    def flush(self) -> None:
        self.raw.flush()

    def stop(self) -> None:
        """End the helper thread (the writer stays usable, hashing inline)."""
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None


def atomic_write(path: pathlib.Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write ``path`` through ``write(fileobj)`` crash-consistently.

    Returns (size, sha256) of what was written. On any error (a full disk included) the
    temp file is removed and the previous ``path``, if any, is untouched.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as raw:
            writer = HashingWriter(raw)
            try:
                write(writer)
            finally:
                writer.stop()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return writer.size, writer.sha256.hexdigest()


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
