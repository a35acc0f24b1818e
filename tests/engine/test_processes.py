"""engine/processes.py: local worker processes get their environment and the
launcher's signals, send back their status, and a failed one is named."""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time

import pytest

from engine.errors import LaunchError
from engine.processes import spawn_workers
from engine.world import World

# --------------------------------------------------------------- local workers


def worlds(n: int) -> list[World]:
    return [World(rank=r, local_rank=r, world_size=n, local_world_size=n) for r in range(n)]


class Worker:
    """Worker: record the environment it was given, say ready, wait (bounded) for
    SIGUSR1 and record it; then rank 1 fails with exit code 1 (a failed run's)."""

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)

    def __call__(self, world):
        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        (self.folder / f"env{world.rank}").write_text(os.environ["ENGINE_TEST_VALUE"])
        (self.folder / f"ready{world.rank}").touch()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        if got:
            (self.folder / f"usr1-{world.rank}").touch()
        if world.rank == 1:
            raise SystemExit(1)


def test_local_workers_get_their_environment_and_signals_and_failures_are_named(tmp_path):
    # One run for three things, because starting worker processes is the slow part.
    def send_when_ready():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all((tmp_path / f"ready{r}").exists() for r in range(2)):
                os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal=USR1@90 would
                return
            time.sleep(0.05)

    sender = threading.Thread(target=send_when_ready, daemon=True)
    sender.start()
    with pytest.raises(LaunchError) as err:
        spawn_workers(Worker(tmp_path), worlds(2), {"ENGINE_TEST_VALUE": "share"})
    sender.join(timeout=5)
    assert [(tmp_path / f"env{r}").read_text() for r in range(2)] == ["share", "share"]
    # The parent passed the pre-emption signal on to both workers.
    assert (tmp_path / "usr1-0").exists() and (tmp_path / "usr1-1").exists()
    # It printed no error: the line points at none (it said "printed above").
    assert str(err.value) == ("worker with local rank 1 (rank 1) exited with code 1 and "
                              "reported no error")
    assert err.value.exit_code == 1
    # A failed run's code, but after the launcher passed a pre-emption signal on: the
    # run is being stopped, and spawn --max-restarts must not start it again.
    assert err.value.failure == "worker rank 1 exited with code 1"
    assert err.value.restartable is False


class Status:
    """Worker: return a short status, or an object too large to send back."""

    def __call__(self, world):
        return "preempted" if world.rank == 0 else "x" * 100_000


def test_local_workers_send_back_their_status():
    assert spawn_workers(Status(), worlds(2)) == ["preempted", None]


# ------------------------------------------------------------ stopped peers


def test_only_the_stopped_process_named_by_its_identity_is_killed():
    """A rank kills a stopped local peer only while it is the process the roll call
    recorded (a PID may be reused) and only while it is stopped."""
    import subprocess
    import sys

    from engine.processes import kill_if_stopped, process_identity, same_machine

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        identity = process_identity(peer.pid)
        assert same_machine(identity) and identity != process_identity(os.getpid())
        assert not kill_if_stopped(peer.pid, identity)  # running: left alone
        os.kill(peer.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while "State:\tT" not in pathlib.Path(f"/proc/{peer.pid}/status").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        boot, ticks = identity.split("/")
        assert not kill_if_stopped(peer.pid, f"{boot}/{int(ticks) + 1}")  # another one
        assert not kill_if_stopped(peer.pid, "")
        assert peer.poll() is None
        assert kill_if_stopped(peer.pid, identity)
        assert peer.wait(30) == -signal.SIGKILL
    finally:
        peer.kill()
        peer.wait()


# ------------------------------------------------------------ no leftovers


def test_a_run_killed_as_a_whole_leaves_no_named_semaphores(tmp_path):
    """SIGKILL of a whole 2-process run (its process group: the launcher, the workers,
    their DataLoader workers, multiprocessing's resource tracker) left the named
    semaphores of the launcher's result queue in /dev/shm (sem.mp-*) for good, as
    nobody lived to unlink them: two per killed run."""
    import subprocess

    from engine.testing import group_processes, named_semaphores
    from tests.conftest import ENGINE_RUN, REPO, engine_env

    out = tmp_path / "run"
    run = subprocess.Popen(
        [ENGINE_RUN, str(REPO / "tests" / "recipes" / "tiny_resume.py"), f"out_dir={out}",
         "epochs=1000", "num_workers=1", "--nproc", "2"],
        cwd=REPO, env=engine_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        # Training: the launcher, the resource tracker, 2 workers and their loader workers.
        while len(processes := group_processes(run.pid)) < 5:
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, f"the run never trained: {processes}"
            time.sleep(0.2)
        named = named_semaphores(processes)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    deadline = time.monotonic() + 60
    while group_processes(run.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    left = [name for name in named if os.path.exists(name)]
    for name in left:  # this run's, and every process that used them is dead
        os.unlink(name)
    assert left == []


# ------------------------------------------------- a failure every rank met alike

RAISING_RECIPE = '''
from tests.recipes.tiny_resume import (Config, build_datasets, build_model,  # noqa: F401
                                       build_optimizer, eval_step)


def train_step(batch, ctx):
    raise ValueError("logits and targets differ in shape: (16, 4) vs (16,)")
'''


def test_a_recipe_exception_on_every_rank_is_one_traceback_naming_the_others(tmp_path):
    """Issue 35: one rank's traceback, and the launcher's line names the rank that failed
    the same way (not a traceback per rank). The same EngineError on every rank is one
    line: tests/engine/test_cli.py's broken parallel mode."""
    from tests.conftest import run_cli

    recipe = tmp_path / "raising.py"
    recipe.write_text(RAISING_RECIPE)
    proc = run_cli(str(recipe), f"out_dir={tmp_path / 'run'}", "--nproc", "2")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert proc.stderr.count("Traceback (most recent call last):") == 1, proc.stderr
    rank = lines[0].split("]")[0] + "]"  # whichever failed first: "[rank 0]"
    assert lines[-2] == (f"{rank} ValueError: logits and targets differ in shape: (16, 4) "
                         "vs (16,)"), proc.stderr
    other = 1 - int(rank[-2])
    assert lines[-1].endswith("exited with code 1: ValueError: logits and targets differ "
                              f"in shape: (16, 4) vs (16,); rank {other} failed the same "
                              "way"), proc.stderr


def test_sigint_to_the_launching_process_alone_stops_the_run_as_ctrl_c_does(tmp_path):
    """`kill -INT PID` of engine-run (what `timeout -s INT`, a supervisor or an IDE's
    stop button send): the launcher passes it on, and the run stops as a terminal's
    Ctrl-C stops it: one line, a snapshot, summary.json "interrupted", exit 130 (it was
    ignored for 30 s, then the workers were killed without either)."""
    import re

    from engine.testing import read_summary, start_engine
    from tests.conftest import REPO, engine_env

    out = tmp_path / "run"
    proc = start_engine([REPO / "tests" / "recipes" / "tiny_resume.py", "epochs=40",
                         "checkpoint.every_steps=4", "checkpoint.memory_every_steps=0",
                         f"out_dir={out}", "--nproc", "2", "--launcher", "spawn"],
                        env=engine_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").exists():  # step 4: handlers are up
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(1)
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    line = re.fullmatch(r"interrupted at .*step (\d+)(, batch \d+ of the epoch)?: "
                        r"snapshot written; the same command resumes", stderr.strip())
    assert line, stderr
    step = int(line.group(1))
    assert (read_summary(out)["status"], read_summary(out)["global_step"]) == (
        "interrupted", step)
    assert (out / "checkpoints" / "latest").read_text().strip().endswith(f"s{step:08d}.pt")
