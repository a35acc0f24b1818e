"""engine/shm.py: what both users of shared memory share (the memory tier, the async
checkpointer), on a real tmpfs folder."""

from __future__ import annotations

import os
import uuid

import pytest

from engine import shm


@pytest.fixture
def folder():
    import shutil

    path = shm.SHM / f"engine-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_sweep_removes_only_this_users_files_among_those_left_behind(folder, tmp_path):
    """Of the names the caller says a gone writer left: this user's regular files go;
    another user's file, a symbolic link (to a file of root's) and a folder stay, and so
    does every name the caller keeps."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own")
    (folder / "left-1").write_bytes(b"x")
    (folder / "left-2").write_bytes(b"x")
    (folder / "left-theirs").write_bytes(b"theirs")
    os.chown(folder / "left-theirs", 12345, 12345)  # the suite runs as root
    (folder / "left-link").symlink_to(precious)
    (folder / "left-dir").mkdir()
    (folder / "kept").write_bytes(b"x")
    removed, problems = shm.sweep(folder, lambda name, path: name.startswith("left-"))
    assert (sorted(p.name for p in removed), problems) == (["left-1", "left-2"], [])
    assert sorted(p.name for p in folder.iterdir()) == [
        "kept", "left-dir", "left-link", "left-theirs"]
    assert precious.read_bytes() == b"root's own"
    assert shm.sweep(folder / "none", lambda *_: True) == ([], [])  # nothing to sweep


def test_free_bytes_is_the_tmpfs_room_or_none_where_it_cannot_be_asked(folder):
    free = shm.free_bytes(folder)
    info = os.statvfs(folder)
    assert free == info.f_bavail * info.f_frsize > 0
    assert shm.free_bytes(folder / "missing") is None
