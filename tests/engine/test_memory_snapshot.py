"""In-memory snapshots (engine/memory_snapshot.py): real buffers in a tmpfs folder, real
processes killed during their copy."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from engine import memory_snapshot
from engine.memory_snapshot import MemorySnapshots, buffer_paths
from engine.testing import assert_same_snapshot
from engine.world import World


@pytest.fixture
def shm(tmp_path):
    """A folder on /dev/shm (a tmpfs, as the real buffers), removed afterwards."""
    import shutil
    import uuid

    folder = memory_snapshot.SHM / f"engine-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def world(rank: int = 0, size: int = 1) -> World:
    return World(rank=rank, local_rank=rank, world_size=size, local_world_size=size)


def a_snapshot(step: int) -> dict:
    """What capture() holds, in miniature: tensors of several dtypes and shapes (an
    empty one, a scalar), an optimizer's int keys and tuples, plain values."""
    torch.manual_seed(step)
    return {
        "engine_version": "test", "config": {"lr": 0.1, "checkpoint": {"keep_last": 3}},
        "step": step,
        "model": {"w": torch.randn(7, 5), "b": torch.randn(5).to(torch.bfloat16),
                  "count": torch.tensor(step), "empty": torch.empty(0, 3)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(7, 5)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "progress": {"epoch": 1, "step": step, "epoch_loss": None},
        "rng": {"ranks": [{"python": (3, tuple(range(5)), None),
                           "torch": torch.get_rng_state()}], "world_size": 1},
        "dtype": torch.float16, "size": torch.Size([2, 3]),
    }


def test_a_saved_snapshot_comes_back_whole_and_detached_from_the_buffer(shm, tmp_path):
    memory = MemorySnapshots(tmp_path, world(), every_steps=1, shm=shm)
    state = a_snapshot(3)
    memory.save(state, step=3, epoch=1)
    slot = memory_snapshot.newest(memory.paths)
    assert (slot.step, slot.epoch, slot.info["run_dir"]) == (3, 1, str(tmp_path.resolve()))
    loaded = memory_snapshot.load_slot(slot)
    assert_same_snapshot(loaded, state)
    assert loaded["dtype"] is torch.float16 and loaded["size"] == torch.Size([2, 3])
    memory.save(a_snapshot(4), step=4, epoch=1)
    memory.save(a_snapshot(5), step=5, epoch=1)  # overwrites the buffer step 3 was in
    assert_same_snapshot(loaded, state)


def test_the_newest_of_the_two_buffers_wins_and_a_damaged_one_is_never_used(shm, tmp_path):
    memory = MemorySnapshots(tmp_path, world(), every_steps=1, shm=shm)
    for step in (1, 2):
        memory.save(a_snapshot(step), step=step, epoch=0)
    newest = memory_snapshot.newest(memory.paths)
    assert newest.step == 2
    # One flipped bit in the newest payload: its checksum fails, the older one is taken.
    with open(newest.path, "r+b") as f:
        f.seek(memory_snapshot.HEADER_BYTES + newest.length - 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    assert memory_snapshot.newest(memory.paths).step == 1
    # A truncated one (a half-written file) neither.
    os.truncate(memory.paths[0] if newest.path == memory.paths[1] else memory.paths[1], 100)
    assert memory_snapshot.newest(memory.paths) is None


def test_a_larger_state_grows_the_buffer_and_the_previous_snapshot_stays(shm, tmp_path):
    memory = MemorySnapshots(tmp_path, world(), every_steps=1, shm=shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    big = {**a_snapshot(2), "extra": torch.randn(300_000)}
    memory.save(big, step=2, epoch=0)
    assert_same_snapshot(memory_snapshot.load_slot(memory_snapshot.newest(memory.paths)), big)
    # A fresh reader (a restarted worker) finds the same.
    again = MemorySnapshots(tmp_path, world(), every_steps=1, shm=shm)
    assert again.newest().step == 2


def test_remove_and_the_leftovers_of_deleted_run_folders(shm, tmp_path):
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    kept.mkdir(), gone.mkdir()
    for folder in (kept, gone):
        memory = MemorySnapshots(folder, world(), every_steps=1, shm=shm)
        for step in (1, 2):  # both buffers
            memory.save(a_snapshot(step), step=step, epoch=0)
    gone.rmdir()
    removed = memory_snapshot.remove_leftovers(shm)
    assert sorted(removed) == sorted(buffer_paths(gone, 0, shm))
    assert all(p.exists() for p in buffer_paths(kept, 0, shm))
    memory = MemorySnapshots(kept, world(), every_steps=1, shm=shm)
    memory.remove()
    assert not any(p.exists() for p in buffer_paths(kept, 0, shm))


def test_a_skeleton_with_anything_but_plain_values_is_refused(shm, tmp_path):
    memory = MemorySnapshots(tmp_path, world(), every_steps=1, shm=shm)
    memory.save({"path": pathlib.PurePosixPath("x")}, step=1, epoch=0)  # not a plain value
    with pytest.raises(Exception, match="not allowed in a memory snapshot"):
        memory_snapshot.load_slot(memory.newest())


KILLER = """
import os, pathlib, random, signal, sys, time
import torch
from engine import memory_snapshot
from engine.memory_snapshot import MemorySnapshots, buffer_paths
from engine.world import World
torch.set_num_threads(1)  # no thread pool for the forked savers to inherit half-made
shm, runs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rng = random.Random(0)
for attempt in range(int(sys.argv[3])):
    run = runs / str(attempt)
    ready, go = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the saver: 8 MB snapshots back to back, each value its step number
        memory = MemorySnapshots(run, World(rank=0, local_rank=0, world_size=1,
                                            local_world_size=1), every_steps=1, shm=shm)
        step = 0
        while os.getppid() == parent:  # not beyond a test that died
            step += 1
            memory.save({"w": torch.full((2_000_000,), float(step)), "step": step},
                        step=step, epoch=0)
            if step == 2:
                os.write(go, b"x")
    os.read(ready, 1)
    time.sleep(rng.uniform(0.0, 0.2))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    slot = memory_snapshot.newest(buffer_paths(run, 0, shm))
    loaded = memory_snapshot.load_slot(slot)
    whole = loaded["step"] == slot.step and torch.equal(
        loaded["w"], torch.full((2_000_000,), float(slot.step)))
    print(slot.step, whole, flush=True)
"""


def test_a_process_killed_during_its_copies_leaves_one_whole_snapshot(shm, tmp_path):
    """SIGKILL at random moments of processes that save 8 MB snapshots back to back
    (most of their time is in the copy): the newest valid buffer is always one whole
    snapshot, all its values its own step's."""
    proc = subprocess.run([sys.executable, "-c", KILLER, str(shm), str(tmp_path), "8"],
                          capture_output=True, text=True, timeout=120)
    results = [line.split() for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(results) == 8, proc.stderr
    assert all(whole == "True" and int(step) >= 2 for step, whole in results), results
