"""The ``async`` checkpointer: torch-file's files, written by a background process.

The first tests drive the checkpointer directly (a real writer process, real files);
the last ones run recipes/cifar_ddp.py with ``--checkpointer async`` on 2 processes.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from engine.checkpoint import manifest_path, model_digest
from engine.errors import CheckpointError
from engine.plugins.async_file import AsyncFileCheckpointer, _shm_prefix, check_shared_memory
from engine.plugins.torch_file import TorchFileCheckpointer
from tests.plugins.test_torch_file import small_disk
from tests.conftest import QUICK, read_summary, run_cli

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


def test_no_named_semaphores_and_no_leftovers_of_killed_writers(checkpointer, tmp_path):
    """A kill leaves what the processes held: named semaphores (each multiprocessing
    Queue has three), the writer's temp file, the buffer's /dev/shm name if the kill
    came between its open and unlink. None of the first are made; the others are
    removed at the next start and at close, and only this folder's and this user's."""
    ck = checkpointer
    mine = sem_maps(os.getpid())
    dead, gone = (subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
                  for _ in range(2))
    ck.directory.mkdir(parents=True)
    temp = ck.directory / f".snapshot-e0001-s00000001.pt.tmp-{dead}"
    shm = pathlib.Path("/dev/shm") / f"{_shm_prefix(ck.directory)}{dead}"
    others = pathlib.Path("/dev/shm") / f"{_shm_prefix(tmp_path / 'other')}{dead}"
    # Another user's file at a name of this folder's (a guessed one): never ours to remove.
    planted = pathlib.Path("/dev/shm") / f"{_shm_prefix(ck.directory)}{gone}"
    planted.write_bytes(b"theirs")
    os.chown(planted, 12345, 12345)  # the suite runs as root (docs/development.md)

    def leave_leftovers():
        for path in (temp, shm, others):
            path.write_bytes(b"x" * 100)

    try:
        leave_leftovers()
        ck.save(big_state(1.0, megabytes=2), epoch=1, step=2)  # the start
        assert not temp.exists() and not shm.exists() and others.exists()
        assert planted.read_bytes() == b"theirs"
        assert sem_maps(ck.writer_pid) == set() and sem_maps(os.getpid()) == mine
        ck.wait()
        leave_leftovers()
        ck.close()
        assert not temp.exists() and not shm.exists() and others.exists()
        assert sorted(p.name for p in ck.directory.iterdir()) == [
            "latest", "snapshot-e0001-s00000002.pt", "snapshot-e0001-s00000002.pt.json"]
    finally:
        for path in (others, shm, planted):
            path.unlink(missing_ok=True)


def test_a_dead_writer_is_reported_not_waited_for(checkpointer):
    ck = checkpointer
    good = ck.save(big_state(1.0, megabytes=2), epoch=1, step=1)
    ck.wait()
    pid = ck.writer_pid
    os.kill(pid, signal.SIGSTOP)  # it cannot take the next job...
    lost = ck.save(big_state(2.0, megabytes=2), epoch=1, step=2)
    os.kill(pid, signal.SIGKILL)  # ...and dies with it
    with pytest.raises(CheckpointError) as err:
        ck.wait()
    assert str(err.value) == (f"the checkpoint writer process died (exit code -9) while "
                              f"writing {lost}; the previous snapshot is untouched: {good}")
    # The next save starts a new writer.
    again = ck.save(big_state(5.0, megabytes=2), epoch=1, step=3)
    ck.close()
    assert ck.writer_pid is None
    assert ck.problem(again) is None and ck.latest() == again


def test_too_little_shared_memory_is_an_error_before_any_copy(tmp_path):
    """The real /dev/shm, asked for more than it has: a clear error, not a SIGBUS."""
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(CheckpointError, match=(
            r"^the async checkpointer needs \d+ MB of shared memory for a snapshot, but "
            r"/dev/shm has \d+ MB free; make it larger \(docker: --shm-size\) or use "
            r"--checkpointer torch-file$")):
        check_shared_memory(free + (1 << 30))
    check_shared_memory(min(free, 1 << 20))  # enough: no error


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
