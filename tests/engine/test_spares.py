"""engine/spares.py on real processes: a worker forked from the warm spare starts with
the run's modules imported, the launcher's environment and the launcher as its parent
(watched: the fork ends with it); a spare that does not fork in time, or that cannot
fork safely (a thread pool), is one SpareError, never a hang, and its close ends it at
once; a zygote that dies or stops during a run is one warning, and the run goes on. (A
run whose workers it replaces after a SIGKILL: tests/plugins/test_spawn.py.)"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from engine.spares import SpareError, SparePool, _SparePopen

#: A recipe module that notes what torch.cuda.is_available() would ask at its import.
PROBE_RECIPE = ("import os\n\nSEEN = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n\n"
                "from tests.recipes.tiny_resume import *  # noqa\n")


def _report(index: int, path: str) -> None:
    """A forked worker's body: what it found at its start."""
    import multiprocessing
    import signal
    import threading

    with open(path, "w") as f:
        json.dump({"preloaded": sorted(m for m in ("torch._dynamo", "engine.trainer",
                                                   "engine.plugins.ddp", "spare_probe")
                                       if m in sys.modules),
                   # torch.cuda.is_available() at a recipe's top level, in the zygote,
                   # would poison every fork for CUDA unless NVML answers (a GPU shows
                   # the poison itself); the worker has the launcher's variables.
                   "nvml_check": [sys.modules["spare_probe"].SEEN,
                                  os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")],
                   "parent": multiprocessing.parent_process().pid,
                   "asked": os.environ.get("SPARE_TEST_VALUE"),
                   "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                   # Ctrl-C stops a worker as a spawned one (the zygote ignores it).
                   "sigint_raises": (signal.getsignal(signal.SIGINT)
                                     is signal.default_int_handler),
                   # A fork's parent is the zygote: a thread ends it with the launcher.
                   "watching": [t.name for t in threading.enumerate()
                                if t.name == "engine-launcher-watch"]},
                  f)


def _wait_for_python_to_handle_sigint(pid: int) -> None:
    """Until the process has its SIGINT handled or ignored (/proc's masks): its
    interpreter has started, and its imports (seconds of torch) are under way."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":\t", 1) for line in f if line.startswith("Sig"))
        if (int(masks["SigCgt"], 16) | int(masks["SigIgn"], 16)) & 1 << (2 - 1):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} never set up SIGINT")


@pytest.mark.slow
def test_a_fork_of_the_spare_has_the_run_imported_and_the_launchers_environment(
        tmp_path, monkeypatch, capfd):
    import signal

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    recipe = tmp_path / "spare_probe.py"
    recipe.write_text(PROBE_RECIPE)
    pool = SparePool(str(recipe))
    try:
        # The zygote ignores SIGTERM (a signal to the process group must not kill it);
        # the environment is the launcher's at the fork, not at the zygote's start.
        pool.warm(deaf_to=(signal.SIGTERM,))
        # A Ctrl-C reaches the whole process group, the zygote amid its imports too: it
        # neither dies nor prints a traceback (the launcher decides what Ctrl-C does).
        zygote = pool._server._forkserver_pid
        _wait_for_python_to_handle_sigint(zygote)  # so a Ctrl-C would raise there
        os.kill(zygote, signal.SIGINT)
        monkeypatch.setenv("SPARE_TEST_VALUE", "set after the spare started")
        path = tmp_path / "report.json"
        # A launcher that takes Ctrl-C (a terminal's engine-run: Python's handler, whatever
        # this test runner inherited; CI runs it with SIGINT ignored).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            context = pool.start(_report, (str(path),), 1, listen_to=(signal.SIGTERM,))
        finally:
            signal.signal(signal.SIGINT, previous)
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the forked worker never ended"
        assert json.loads(path.read_text()) == {
            "preloaded": ["engine.plugins.ddp", "engine.trainer", "spare_probe",
                          "torch._dynamo"],
            "nvml_check": ["1", None],
            "parent": os.getpid(), "asked": "set after the spare started",
            "sigterm_default": True, "sigint_raises": True,
            "watching": ["engine-launcher-watch"]}
        assert "KeyboardInterrupt" not in capfd.readouterr().err
        # A launcher in the background (Ctrl-C ignored): its forks ignore it too.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            context = pool.start(_report, (str(path),), 1, listen_to=(signal.SIGTERM,))
        finally:
            signal.signal(signal.SIGINT, previous)
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the forked worker never ended"
        assert json.loads(path.read_text())["sigint_raises"] is False
        assert pool._server._forkserver_pid == zygote  # the same one, not a new one
    finally:
        pool.close()


def _never_runs(index: int) -> None:
    raise AssertionError("forked after the spare timed out")


@pytest.mark.slow
def test_a_spare_that_does_not_fork_in_time_is_one_error_and_is_ended_at_once(
        monkeypatch):
    # The zygote is still importing torch a hundredth of a second after its start.
    monkeypatch.setattr(_SparePopen, "timeout_s", 0.01)
    pool = SparePool()
    started = time.monotonic()
    with pytest.raises(SpareError) as raised:
        pool.start(_never_runs, (), 1)
    assert str(raised.value) == ("the warm spare process did not start worker 0: the "
                                 "fork server did not start a process within 0.01s")
    zygote = pool._server._forkserver_pid
    pool.close()
    assert time.monotonic() - started < 30
    assert not os.path.exists(f"/proc/{zygote}"), "the zygote outlived close()"


@pytest.mark.slow
def test_a_recipe_that_starts_a_thread_pool_as_it_is_imported_is_not_forked(
        tmp_path, capfd):
    # A tensor operation at the recipe module's top level starts OpenMP's pool in the
    # zygote: native threads, no Python one, and a fork using two threads could hang in
    # it. The zygote refuses, as ENGINE_START_METHOD=fork does (engine.launch_env).
    recipe = tmp_path / "pool_at_import.py"
    recipe.write_text("import torch\n\ntorch.set_num_threads(2)\n"
                      "_x = torch.randn(512, 512)\n(_x @ _x).sum()\n\n"
                      "from tests.recipes.tiny_resume import *  # noqa\n")
    pool = SparePool(str(recipe))
    try:
        with pytest.raises(SpareError):
            pool.start(_never_runs, (), 1)
    finally:
        pool.close()
    assert ("warning: the warm spare cannot fork safely after its imports (the recipe's "
            "module?): this process runs") in capfd.readouterr().err



# ------------------------------------------- a run whose zygote dies or stops (issue 50)

def _run_with_spares(tmp_path, action: str):
    """``engine-run --max-restarts 3`` of tiny_resume whose workers are forks of the
    zygote, and whose rank 0 does ``action`` (tests/fault_plugin.py) once, after step 3
    (a disk snapshot at step 2); returns the process, once rank 0 acted, its zygote's
    PID and its workers' PIDs."""
    from engine.atomic_io import proc_stat
    from engine.launch_env import START_METHOD_ENV
    from engine.testing import start_engine
    from tests.conftest import REPO, engine_env

    once = tmp_path / "once"
    env = engine_env(ENGINE_FAULT_ACTION=action, ENGINE_FAULT_STEP="3",
                     ENGINE_FAULT_ONCE=str(once), **{START_METHOD_ENV: "spawn"})
    proc = start_engine([REPO / "tests" / "recipes" / "tiny_resume.py", "epochs=2",
                         "checkpoint.every_steps=2", "checkpoint.memory_every_steps=0",
                         f"out_dir={tmp_path / 'run'}", "--nproc", "2", "--launcher",
                         "spawn", "--max-restarts", "3", "-p", "tests.fault_plugin"],
                        env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    while not once.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(1)
        time.sleep(0.05)

    def children(pid) -> list[int]:
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit()
                      and (proc_stat(p) or "??")[1] == str(pid))

    zygote = next(p for p in children(proc.pid)
                  if b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read())
    return proc, zygote, children(zygote)


@pytest.mark.slow
def test_a_zygote_killed_mid_run_is_one_warning_and_its_forks_run_on(tmp_path):
    """SIGKILL of the zygote, while rank 0 is stopped after step 3: the launcher says so
    once and the run goes on to its end, each worker's end seen by the launcher itself
    (it ended with exit 1 at once, "exited with code 255; its error is printed above",
    when the statuses came through the zygote)."""
    import signal

    from engine.atomic_io import process_state
    from engine.testing import read_summary

    proc, zygote, workers = _run_with_spares(tmp_path, "stop")
    try:
        stopped = []
        while not stopped:  # rank 0 stops itself right after its marker
            stopped = [w for w in workers if process_state(w) == "T"]
            time.sleep(0.01)
        stopped = stopped[0]
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{zygote}"):  # until the launcher reaped it
            assert time.monotonic() < deadline, "the launcher never noticed"
            time.sleep(0.05)
        os.kill(stopped, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert stderr.splitlines() == [
        f"warning: the warm spare process (pid {zygote}) was killed by SIGKILL; the "
        "workers run on, and restarts start new ones with spawn"], stderr
    assert read_summary(tmp_path / "run")["status"] == "completed"


@pytest.mark.slow
def test_a_stopped_zygote_is_killed_and_the_restart_spawns(tmp_path):
    """SIGSTOP of the zygote, then SIGKILL of a worker: the launcher sees the worker's
    end itself (it waited for ever on the stopped zygote to report it), kills the zygote
    with one warning, and restarts both workers with spawn; the run completes."""
    import re
    import signal

    from engine.testing import read_summary

    proc, zygote, workers = _run_with_spares(tmp_path, "hang")
    try:
        os.kill(zygote, signal.SIGSTOP)
        os.kill(workers[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    lines = stderr.splitlines()
    assert lines[0] == (f"warning: the warm spare process (pid {zygote}) is stopped "
                        "(SIGSTOP or a debugger) and was killed; the workers run on, and "
                        "restarts start new ones with spawn"), stderr
    assert re.fullmatch(r"worker rank [01] was killed by SIGKILL; restarting all 2 "
                        r"workers \(restart 1 of 3\)", lines[1]), stderr
    assert len(lines) == 2, stderr
    assert read_summary(tmp_path / "run")["status"] == "completed"
