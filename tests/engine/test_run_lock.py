"""engine/run_lock.py: one run per folder, with real concurrent engine-run processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine.errors import LaunchError
from engine.run_lock import LOCK_FILE, holding
from engine.testing import fit, start_engine
from tests import conftest
from tests.conftest import REPO, read_summary, run_cli

RECIPE = str(REPO / "tests" / "recipes" / "tiny_regression.py")


def start_hanging_run(out, tmp_path):
    """A real 2-process engine-run that hangs after step 3 (rank 0), holding the lock; in
    a session of its own."""
    env = conftest.engine_env(ENGINE_FAULT_ACTION="hang", ENGINE_FAULT_STEP="3",
                              ENGINE_START_METHOD="fork")
    proc = start_engine([RECIPE, "epochs=3", "checkpoint.every_steps=2", f"out_dir={out}",
                         "--nproc", "2", "-p", "tests.fault_plugin"], env=env, cwd=REPO)
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists():  # trained 2 steps: it holds it
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(1)
        time.sleep(0.2)
    return proc


def files_of(out) -> dict:
    return {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def test_a_second_run_on_the_folder_is_refused_and_a_killed_holders_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = start_hanging_run(out, tmp_path)
    try:
        before = files_of(out)
        second = run_cli(RECIPE, "epochs=3", f"out_dir={out}", "--nproc", "2")
        assert second.returncode == 2, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"engine-run: error: out_dir {out} is in use by "
                               "another run (host "), last
        assert f", pid {first.pid}, started " in last
        assert last.endswith("); wait for it to end, give another out_dir, or use "
                             "out_dir=.../version_{version} for a new folder each run")
        assert "[rank" not in second.stderr  # refused before any worker started
        assert files_of(out) == before  # the first run's files untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the holder dies however it dies
        first.wait(timeout=30)
    # The kernel released the dead holder's lock: the next run starts at once, resumes.
    again = run_cli(RECIPE, "epochs=3", f"out_dir={out}", "--nproc", "2", check=True)
    assert "resuming from " in again.stdout
    assert read_summary(out)["status"] == "completed"


HOLDER = """
import sys, time
from engine.run_lock import holding
with holding(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_the_library_doors_hold_the_lock_too(tmp_path):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, out], env=conftest.engine_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(LaunchError, match=rf"^engine.fit: out_dir .* is in use by another "
                                              rf"run \(host .*, pid {holder.pid}, started "):
            fit(RECIPE, nproc=1, out_dir=out, epochs=1)
    finally:
        holder.kill()
        holder.wait()
    assert fit(RECIPE, nproc=1, out_dir=out, epochs=1)["status"] == "completed"
    assert (tmp_path / "run" / LOCK_FILE).exists()  # left in place, unlocked


def test_a_second_run_in_the_same_process_is_refused_and_the_first_keeps_its_lock(tmp_path):
    out = str(tmp_path / "run")
    with holding(out):
        with pytest.raises(LaunchError, match=rf"in use by another run \(this process, pid "
                                              rf"{os.getpid()}\)"):
            with holding(out):
                pass
        probe = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(120)", ""),
                                out], env=conftest.engine_env(), capture_output=True, text=True)
        assert "is in use by another run" in probe.stderr  # still held by this process


def test_a_folder_with_a_placeholder_needs_no_lock(tmp_path):
    pattern = str(tmp_path / "runs" / "v{version}")
    with holding(pattern):
        with holding(pattern):  # each run gets a folder of its own
            pass
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind, wrong", [("symlink", "is a symbolic link"),
                                         ("directory", "is a directory"),
                                         ("immutable", "Operation not permitted")])
def test_a_lock_that_is_not_a_writable_file_is_one_line_and_its_target_untouched(
        tmp_path, kind, wrong):
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep me\n")
    lock = out / LOCK_FILE
    if kind == "symlink":
        lock.symlink_to(target)
    elif kind == "directory":
        lock.mkdir()
    else:  # root opens a chmod 000 file anyway: an immutable one it cannot
        lock.write_text("")
        chattr = subprocess.run(["chattr", "+i", str(lock)], capture_output=True, text=True)
        if chattr.returncode != 0:
            pytest.skip(f"chattr +i: {chattr.stderr.strip()}")
    try:
        proc = run_cli(RECIPE, "epochs=1", f"out_dir={out}", "--nproc", "1")
    finally:
        subprocess.run(["chattr", "-i", str(lock)], capture_output=True)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith(f"engine-run: error: the run lock {lock} "), line
    assert wrong in line and line.endswith("or give another out_dir"), line
    assert target.read_text() == "keep me\n"
    assert not (out / "summary.json").exists()  # refused before any worker started
