"""The ``async`` checkpointer: torch-file's files, written by a background process.

The first tests drive the checkpointer directly (a real writer process, real files);
the last ones run recipes/cifar_ddp.py with ``--checkpointer async`` on 2 processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from engine.checkpoint import manifest_path, model_digest
from engine.errors import CheckpointError
from engine.plugins.async_file import AsyncFileCheckpointer, check_shared_memory
from engine.plugins.torch_file import TorchFileCheckpointer
from tests.plugins.test_torch_file import small_disk
from tests.conftest import QUICK, REPO, read_summary, run_cli

MB = 1 << 20


def big_state(value: float, megabytes: int = 32) -> dict:
    """Snapshot-shaped, with tensors large enough that a write takes a while."""
    n = megabytes * MB // 4 // 2
    return {"model": {"a.weight": torch.full((n,), value), "a.bias": torch.full((3,), value)},
            "optimizer": {"state": {0: {"momentum_buffer": torch.full((n,), -value)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "epoch": 1, "step": 0, "rng": [{"torch": torch.get_rng_state()}]}


@pytest.fixture
def checkpointer(tmp_path):
    ck = AsyncFileCheckpointer(tmp_path / "checkpoints")
    yield ck
    ck._stop_writer()  # a test that failed half-way must not leave the process behind


def test_snapshot_holds_the_values_of_save_time_and_a_second_save_waits(checkpointer):
    ck = checkpointer
    state = big_state(1.0)
    first = ck.save(state, epoch=1, step=10, metrics={"val/loss": 0.5})
    # The training loop goes on and changes its tensors in place, as optimizer.step does.
    for t in (state["model"]["a.weight"], state["optimizer"]["state"][0]["momentum_buffer"]):
        t.mul_(2)
    second = ck.save(state, epoch=1, step=20)
    # save() returned, so the first write must be complete: it waited for it (and only
    # then reused the shared buffer that the first write was reading).
    assert ck.problem(first) is None
    ck.wait()
    assert ck.problem(second) is None
    assert (ck.directory / "latest").read_text().strip() == second.name
    a = torch.load(first, weights_only=True)
    b = torch.load(second, weights_only=True)
    assert torch.equal(a["model"]["a.weight"], torch.full_like(a["model"]["a.weight"], 1.0))
    assert torch.equal(b["model"]["a.weight"], torch.full_like(b["model"]["a.weight"], 2.0))
    assert torch.equal(b["optimizer"]["state"][0]["momentum_buffer"],
                       torch.full_like(b["model"]["a.weight"], -2.0))
    assert b["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert json.loads(manifest_path(first).read_text())["metrics"] == {"val/loss": 0.5}
    ck.close()


def test_file_is_the_one_torch_file_writes(checkpointer, tmp_path):
    """Same container types (an OrderedDict state_dict with its _metadata), dtypes,
    shapes and empty tensors: a run can switch checkpointers and resume."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = {"model": model.state_dict(), "empty": torch.empty(0, 5),
             "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
             "scalar": torch.tensor(7), "python": (3, (1, 2), 0.5), "none": None}
    path = checkpointer.save(state, epoch=0, step=1)
    checkpointer.close()
    loaded = torch.load(path, weights_only=True)
    assert loaded["model"]._metadata == state["model"]._metadata
    assert model_digest(loaded["model"]) == model_digest(state["model"])
    for key in ("empty", "half", "scalar"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key])
    assert loaded["python"] == (3, (1, 2), 0.5) and loaded["none"] is None
    assert checkpointer.latest() == path
    assert torch.equal(checkpointer.load(path)["half"], state["half"])


def test_close_returns_only_when_the_last_write_is_durable(checkpointer):
    path = checkpointer.save(big_state(3.0, megabytes=64), epoch=2, step=5)
    pid = checkpointer.writer_pid
    # What a job's processes receive on Ctrl-C and on SLURM pre-emption: the trainer
    # decides; the writer finishes its write.
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
        os.kill(pid, sig)
    checkpointer.close()
    assert checkpointer.problem(path) is None
    assert (checkpointer.directory / "latest").read_text().strip() == path.name
    with pytest.raises(ProcessLookupError):  # the writer has exited and been reaped
        os.kill(pid, 0)


def test_full_disk_is_reported_by_the_next_save_and_by_close(checkpointer):
    ck = checkpointer
    good = ck.save(big_state(1.0, megabytes=2), epoch=1, step=1)
    ck.wait()

    def fill_disk_for(epoch: int, step: int):
        # The writer writes .NAME.tmp-PID first; as a link to /dev/full every write
        # to it fails with ENOSPC, from the kernel, as on a full disk.
        name = f"snapshot-e{epoch:04d}-s{step:08d}.pt"
        (ck.directory / f".{name}.tmp-{ck.writer_pid}").symlink_to("/dev/full")
        return ck.directory / name

    failed = fill_disk_for(1, 2)
    ck.save(big_state(2.0, megabytes=2), epoch=1, step=2)
    with pytest.raises(CheckpointError) as err:
        ck.save(big_state(3.0, megabytes=2), epoch=1, step=3)
    assert str(err.value) == (
        f"writing {failed} failed: OSError: [Errno 28] No space left on device; free "
        f"space in {ck.directory} or point out_dir elsewhere; the previous snapshot is "
        f"untouched: {good}")
    assert not failed.exists() and not manifest_path(failed).exists()
    assert not list(ck.directory.glob(".*tmp*"))  # the temp file (here: link) is gone
    assert ck.latest() == good and ck.problem(good) is None

    # The writer survived the error; the next failure is reported by close().
    failed = fill_disk_for(1, 4)
    ck.save(big_state(4.0, megabytes=2), epoch=1, step=4)
    with pytest.raises(CheckpointError, match=r"^writing .*s00000004\.pt failed: OSError: "
                                              r"\[Errno 28\] No space left on device"):
        ck.close()
    assert ck.latest() == good


def test_a_really_full_disk_is_named_not_torchs_unexpected_pos(tmp_path):
    """On a real full disk torch.save fails with "unexpected pos ..." (a RuntimeError
    whose context is the OSError): the one line must say the disk is full."""
    with small_disk(tmp_path / "small", "3m") as mount:
        ck = AsyncFileCheckpointer(mount / "checkpoints")
        try:
            good = ck.save(big_state(1.0, megabytes=1), epoch=1, step=1)
            failed = ck.save(big_state(2.0, megabytes=4), epoch=1, step=2)
            with pytest.raises(CheckpointError) as err:
                ck.wait()
        finally:
            ck._stop_writer()
        assert str(err.value) == (
            f"writing {failed} failed: OSError: [Errno 28] No space left on device; free "
            f"space in {ck.directory} or point out_dir elsewhere; the previous snapshot "
            f"is untouched: {good}")


def sem_maps(pid: int) -> set[str]:
    """The named POSIX semaphores (/dev/shm/sem.*) mapped by a process."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "/dev/shm/sem." in line}


def test_no_named_semaphores_and_no_leftovers_of_killed_writers(checkpointer):
    """A kill leaves what the processes held: named semaphores (each multiprocessing
    Queue has three) and the writer's temp file. None of the first are made; the
    others are removed at the next start and at close."""
    ck = checkpointer
    mine = sem_maps(os.getpid())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ck.directory.mkdir(parents=True)
    temp = ck.directory / f".snapshot-e0001-s00000001.pt.tmp-{dead}"
    temp.write_bytes(b"x" * 100)
    ck.save(big_state(1.0, megabytes=2), epoch=1, step=2)  # the start
    assert not temp.exists()
    assert sem_maps(ck.writer_pid) == set() and sem_maps(os.getpid()) == mine
    ck.wait()
    temp.write_bytes(b"x" * 100)
    ck.close()
    assert not temp.exists()
    assert sorted(p.name for p in ck.directory.iterdir()) == [
        "latest", "snapshot-e0001-s00000002.pt", "snapshot-e0001-s00000002.pt.json"]


def old_buffer_name(directory: pathlib.Path, pid: int) -> pathlib.Path:
    """Where the buffer was named before it was anonymous: a name anyone could guess."""
    digest = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:12]
    return pathlib.Path("/dev/shm") / f"engine-ckpt-{digest}-{pid}"


def test_the_buffer_has_no_name_another_user_could_take_or_lose(checkpointer):
    """Another local user's file at the name the buffer had: root (the suite) removed
    it before, now it is left as it is; the snapshot is written all the same, and no
    name of ours appears in /dev/shm."""
    ck = checkpointer
    planted = old_buffer_name(ck.directory, os.getpid())
    planted.write_bytes(b"theirs")
    os.chown(planted, 12345, 12345)  # the suite runs as root (docs/development.md)
    before = set(os.listdir("/dev/shm"))
    try:
        path = ck.save(big_state(1.0, megabytes=2), epoch=1, step=1)
        assert set(os.listdir("/dev/shm")) == before
        ck.close()
        assert ck.problem(path) is None and planted.read_bytes() == b"theirs"
    finally:
        planted.unlink()


AS_ANOTHER_USER = """
import os, pathlib, sys, torch
from engine.plugins.async_file import AsyncFileCheckpointer
from tests.plugins.test_async_file import old_buffer_name
folder = pathlib.Path(sys.argv[1])  # the user's own (pytest's folders are root's alone)
planted = old_buffer_name(folder, os.getpid())
print(planted, flush=True)
planted.write_bytes(b"theirs")
os.chown(planted, 12345, 12345)
os.chown(folder.parent, 12346, 12346)
os.setgid(12346); os.setuid(12346)  # a user other than the one who planted it
ck = AsyncFileCheckpointer(folder)
# The buffer is made and filled before the writer starts: a writer is a new Python,
# whose standard library (under /root) this user cannot read; stop there.
ck._start_writer = lambda: sys.exit(0 if planted.read_bytes() == b"theirs" else 3)
ck.save({"model": {"w": torch.ones(1000)}}, epoch=1, step=1)
"""


def test_a_users_save_is_not_blocked_by_another_users_file():
    """A non-root user's save ended in PermissionError when another user had created a
    file at its buffer's name in /dev/shm (sticky: only its owner may remove it)."""
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run([sys.executable, "-c", AS_ANOTHER_USER,
                               f"{folder}/checkpoints"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    pathlib.Path(proc.stdout.splitlines()[0]).unlink()
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------- through engine-run


def test_write_error_fails_the_run_with_one_line(cifar_recipe, tmp_path):
    out = tmp_path / "run"
    # A folder where the final snapshot must go: the rename onto it fails.
    blocker = out / "checkpoints" / "snapshot-e0001-s00000008.pt"
    blocker.mkdir(parents=True)
    proc = run_cli(cifar_recipe, *QUICK, f"out_dir={out}", "--nproc", "2",
                   "--checkpointer", "async")
    assert proc.returncode != 0
    line = next(line for line in proc.stderr.splitlines() if "error:" in line)
    assert line.startswith(f"[rank 0] error: writing {blocker} failed: IsADirectoryError: "
                           "[Errno 21] Is a directory"), proc.stderr
    assert line.endswith("; the previous snapshot is untouched: there is none")
    # The launcher's last line repeats it: the one line users read is the useful one.
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("engine-run: error: worker with local rank 0 (rank 0) exited "
                           f"with code 2: writing {blocker} failed: "), proc.stderr
    assert last.endswith("; the previous snapshot is untouched: there is none")
    assert "Traceback" not in proc.stderr
    assert read_summary(out)["status"] == "failed"


@pytest.mark.slow
@pytest.mark.timeout(900)  # three runs
def test_async_snapshot_resumes_like_an_uninterrupted_run(cifar_recipe, tmp_path):
    """One epoch with async, the second with torch-file from async's snapshot: the same
    weights as two epochs in one go (model, momentum, RNG and position all restored).
    The first run's final snapshot is durable the moment the process has exited."""
    args = (cifar_recipe, *QUICK, "--nproc", "2", "--threads", "1")
    half = tmp_path / "half"
    run_cli(*args, f"out_dir={half}", "--checkpointer", "async", check=True)
    summary = read_summary(half)
    checkpoints = half / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    assert final.name == f"snapshot-e0001-s{summary['global_step']:08d}.pt"
    assert TorchFileCheckpointer(checkpoints).problem(final) is None  # right after the process exited
    snap = torch.load(final, weights_only=True)
    assert (snap["epoch"], snap["step"], snap["world_size"]) == (1, summary["global_step"], 2)
    assert model_digest(snap["model"]) == summary["weights_sha256"]
    assert len(snap["rng"]) == 2
    assert not list(checkpoints.glob(".*"))  # no temp files left

    proc = run_cli(*args, "epochs=2", f"out_dir={half}", "--checkpointer", "torch-file",
                   check=True)
    assert (f"resuming from {half / 'checkpoints' / 'snapshot-e0001-s00000008.pt'}: "
            "the end of epoch 1, step 8") in proc.stdout
    whole = tmp_path / "whole"
    run_cli(*args, "epochs=2", f"out_dir={whole}", "--checkpointer", "async", check=True)
    assert read_summary(half)["global_step"] == read_summary(whole)["global_step"] == 16
    assert read_summary(half)["weights_sha256"] == read_summary(whole)["weights_sha256"]
