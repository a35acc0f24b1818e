"""engine.atomic_io: a file is either the old one or the new one, whatever happens
during the write; the size and sha256 returned are those of the bytes on disk."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.atomic_io import (HashingWriter, atomic_write, atomic_write_text, file_sha256)
from tests.conftest import REPO


def test_size_and_sha256_are_those_of_the_file_small_and_large_writes(tmp_path):
    big = os.urandom(HashingWriter.PARALLEL_BYTES + 12345)  # hashed on the helper thread
    chunks = [b"head", big, b"", memoryview(big)[:100], b"tail"]
    path = tmp_path / "f.bin"
    size, sha256 = atomic_write(path, lambda f: [f.write(c) for c in chunks])
    data = path.read_bytes()
    assert data == b"".join(bytes(c) for c in chunks)
    assert (size, sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert file_sha256(path) == sha256


def test_an_error_during_the_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "latest"
    atomic_write_text(path, "old\n")

    def fails(f):
        f.write(b"half of the new one")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, fails)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_process_killed_in_the_middle_of_a_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "snapshot.bin"
    atomic_write_text(path, "old")
    started = tmp_path / "started"
    code = (
        "import pathlib, sys, time\n"
        "from engine.atomic_io import atomic_write\n"
        "def slow(f):\n"
        "    f.write(b'new' * 1000)\n"
        f"    pathlib.Path({str(started)!r}).touch()\n"
        "    time.sleep(60)\n"
        f"atomic_write(pathlib.Path({str(path)!r}), slow)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert path.read_text() == "old"
    # What is left is a hidden temp file, which is never taken for the real one.
    assert [p.name for p in tmp_path.glob(".snapshot.bin.tmp-*")] == [
        f".snapshot.bin.tmp-{proc.pid}"]
