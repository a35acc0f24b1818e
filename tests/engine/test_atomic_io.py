"""engine.atomic_io: a file is either the old one or the new one, whatever happens
during the write; the size and checksum returned are those of the bytes on disk."""

from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import xxhash

from engine.atomic_io import (atomic_write, atomic_write_text, check_file, checksum_entry,
                              file_checksum, stale_temps)
from tests.conftest import REPO


def test_size_and_checksum_are_those_of_the_file_small_and_large_writes(tmp_path):
    big = os.urandom((1 << 20) + 12345)
    chunks = [b"head", big, b"", memoryview(big)[:100], b"tail"]
    path = tmp_path / "f.bin"
    size, checksum = atomic_write(path, lambda f: [f.write(c) for c in chunks])
    data = path.read_bytes()
    assert data == b"".join(bytes(c) for c in chunks)
    assert (size, checksum) == (len(data), xxhash.xxh3_128(data).hexdigest())
    assert file_checksum(path) == checksum
    assert file_checksum(path, "sha256") == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty"
    assert atomic_write(empty, lambda f: None) == (0, xxhash.xxh3_128(b"").hexdigest())
    assert file_checksum(empty) == xxhash.xxh3_128(b"").hexdigest()


def test_check_file_catches_a_flipped_byte_and_a_missing_one_old_manifests_too(tmp_path):
    path = tmp_path / "f.bin"
    size, checksum = atomic_write(path, lambda f: f.write(os.urandom(100_000)))
    old_style = {"size": size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    for entry in (checksum_entry(size, checksum), old_style):
        assert check_file(path, entry) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    path.write_bytes(bytes(data))
    assert check_file(path, checksum_entry(size, checksum)) == (
        "xxh3_128 differs from the manifest (corrupt)")
    assert check_file(path, old_style) == "sha256 differs from the manifest (corrupt)"
    path.write_bytes(bytes(data[:-1]))
    assert check_file(path, old_style) == (
        f"size {size - 1} differs from the manifest's {size} (truncated?)")


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
    # What is left is a hidden temp file, which is never taken for the real one, and
    # which a clean-up can tell from a live writer's: its pid is gone.
    assert [p.name for p in tmp_path.glob(".snapshot.bin.tmp-*")] == [
        f".snapshot.bin.tmp-{proc.pid}"]
    live = tmp_path / f".other.tmp-{os.getppid()}"  # a running process's: kept
    live.touch()
    assert stale_temps(tmp_path) == [tmp_path / f".snapshot.bin.tmp-{proc.pid}"]
    # A killed writer whose parent is gone too is a zombie until init reaps it: dead.
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while pathlib.Path(f"/proc/{zombie.pid}/stat").read_bytes().rpartition(b")")[2].split()[
            0] != b"Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    try:
        (tmp_path / f".zombie.tmp-{zombie.pid}").touch()
        assert tmp_path / f".zombie.tmp-{zombie.pid}" in stale_temps(tmp_path)
    finally:
        zombie.wait(timeout=30)
