"""Pre-emption: a signal makes every rank stop at a check point (the one after the check
point that saw it), with a snapshot from which the run resumes to the same weights as an
uninterrupted one."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
ARGS = ("epochs=3", "checkpoint.every_steps=0", "checkpoint.keep_last=2")


def test_sigusr1_on_one_rank_snapshots_all_and_the_rerun_finishes_identically(tmp_path):
    reference = tmp_path / "reference"
    run_cli(RECIPE, *ARGS, f"out_dir={reference}", "--nproc", "2", check=True)

    out = tmp_path / "run"
    env = engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_STEP="7",
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    args = (RECIPE, *ARGS, f"out_dir={out}", "--nproc", "2", "--launcher", "spawn",
            "-p", "tests.fault_plugin")
    stopped = run_cli(*args, env=env)
    assert stopped.returncode == 75, stopped.stderr  # EXIT_PREEMPTED: run me again
    # Rank 1 got the signal after step 7 (epoch 1's first). The check point at step 8
    # carries its flag to every rank; they act on it at the next one (step 10), where
    # the sums have long arrived.
    assert ("pre-empted: snapshot written at epoch 2, step 10, batch 4 of the epoch; not "
            "requeued (start the "
            "run again to resume)") in stopped.stderr
    summary = read_summary(out)
    assert summary["status"] == "preempted" and summary["global_step"] == 10
    assert (out / "checkpoints" / "snapshot-e0001-s00000010.pt").is_file()

    resumed = run_cli(*args, env=env, check=True)
    assert "resuming from" in resumed.stdout and "epoch 2, step 10, batch 4" in resumed.stdout
    assert read_summary(out)["weights_sha256"] == read_summary(reference)["weights_sha256"]


def python_block_after(text: str, heading: str) -> str:
    """The first ```python block after ``heading`` in a doc."""
    return text.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_plugin_guides_scheduler_requeues_and_the_log_says_so(tmp_path):
    """engine_requeue, as docs/plugins.md shows it: the first plugin that answers (a
    third-party scheduler's; the slurm plugin answers None outside a SLURM job) runs its
    scheduler's requeue, and rank 0 logs its line."""
    guide = (REPO / "docs" / "plugins.md").read_text()
    (tmp_path / "scheduler_plugin.py").write_text(
        python_block_after(guide, "### `engine_requeue(engine)`"))
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    scheduler = bin_dir / "my-scheduler"  # a real program on PATH, as the example runs
    scheduler.write_text(f'#!/bin/sh\necho "$@" >> {asked}\n')
    scheduler.chmod(0o755)
    env = engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_STEP="3",
                     MY_SCHEDULER_JOB="42", PYTHONPATH=f"{REPO}:{tmp_path}")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    plugins = ("-p", "tests.fault_plugin", "-p", "scheduler_plugin")
    stopped = run_cli(RECIPE, *ARGS, f"out_dir={tmp_path / 'run'}", "--nproc", "2",
                      *plugins, env=env)
    assert stopped.returncode == 75, stopped.stderr
    assert "; job 42 requeued" in stopped.stderr, stopped.stderr
    assert asked.read_text() == "requeue 42\n"  # once: rank 0 only
    # requeue=false: nobody is asked.
    again = run_cli(RECIPE, *ARGS, f"out_dir={tmp_path / 'run2'}", "--nproc", "1",
                    "requeue=false", *plugins, env=env)
    assert again.returncode == 75 and "requeued" not in again.stderr, again.stderr
    assert asked.read_text() == "requeue 42\n"


# A real scheduler round trip (submit, signal, requeue, start again) takes 2-3 minutes
# on an idle 2-core machine; the suite's 300 s default is too close under load.
@pytest.mark.timeout(600)
@pytest.mark.slurm
def test_slurm_job_signalled_mid_run_is_requeued_and_finishes_identically(tmp_path):
    """On the local cluster: the script `engine-run sbatch` writes, SIGUSR1 mid-run
    (what --signal=USR1@90 sends), requeue, resume, same weights as uninterrupted."""
    import json
    import subprocess
    import time

    train = (RECIPE, "epochs=12", "checkpoint.every_steps=0")
    reference = tmp_path / "reference"
    run_cli(*train, f"out_dir={reference}", "--launcher", "spawn", "--nproc", "2",
            "--threads", "1", check=True)

    out = tmp_path / "run"
    script = run_cli("sbatch", *train, f"out_dir={out}", "--nodes", "1",
                     "--procs-per-node", "2", "--cpus-per-task", "2",
                     "--layout", "task-per-node", check=True).stdout
    assert "#SBATCH --signal=USR1@90" in script and "#SBATCH --requeue" in script
    job_file = tmp_path / "job.sh"
    job_file.write_text(script)
    out.mkdir()  # what the script's "Submit with" line says: SLURM does not create it
    submitted = subprocess.run(["sbatch", str(job_file)], capture_output=True, text=True,
                               env=engine_env(), cwd=REPO, timeout=60, check=True)
    job = submitted.stdout.split()[-1]
    try:
        deadline = time.monotonic() + 450
        while not (out / "checkpoints" / "latest").exists():  # handlers are up by then
            assert time.monotonic() < deadline, "the job never wrote a snapshot"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        summary = {}
        while summary.get("status") != "completed":
            assert time.monotonic() < deadline, f"job {job} did not finish: {summary}"
            time.sleep(1)
            if (out / "summary.json").exists():
                summary = json.loads((out / "summary.json").read_text())
    finally:
        subprocess.run(["scancel", job], timeout=30)
    log = (out / f"slurm-{job}.out").read_text()
    assert "pre-empted by SIGUSR1" in log and f"job {job} requeued" in log, log
    assert "resuming from" in log, log
    # scancel signals every process of the step: each worker got SIGUSR1 directly and
    # forwarded by its task: one request, no worker killed by it.
    # Then the requeue's SIGTERM to the step changes nothing: the task exits with 75.
    # (Only the first run's part: the scancel below may catch the second one exiting.)
    stopped = log.split("resuming from")[0]
    assert log.count("pre-empted by SIGUSR1") == 1 and "killed by" not in stopped, log
    assert "Traceback" not in stopped and "task 0: Exited with exit code 75" in stopped, log
    assert summary["weights_sha256"] == read_summary(reference)["weights_sha256"]


HANDLER_PROBE = """
import os, signal, sys
from engine import preemption
preemption.DUPLICATE_WINDOW_S = float(sys.argv[1])
flag = preemption.PreemptionFlag()
flag.install()
os.kill(os.getpid(), signal.SIGUSR1)
os.kill(os.getpid(), signal.SIGUSR1)  # the same request again (direct + forwarded)
print("alive", flag.signal_name)
"""


def test_a_signal_delivered_twice_at_once_is_one_request_and_a_later_one_kills():
    import signal
    import subprocess
    import sys

    def probe(window: str):
        return subprocess.run([sys.executable, "-c", HANDLER_PROBE, window],
                              capture_output=True, text=True, timeout=60)

    same = probe("5")
    assert (same.returncode, same.stdout.strip()) == (0, "alive SIGUSR1"), same.stderr
    later = probe("-1")  # every second signal counts as "later": die as asked
    assert later.returncode == -signal.SIGUSR1, later
    # Once the pre-emption snapshot is written, the SIGTERM of SLURM's requeue (sent to
    # every task of the step while it exits) changes nothing.
    saved = subprocess.run([sys.executable, "-c", HANDLER_PROBE.replace(
        'print("alive"', 'flag.uninstall(ignore_more=True)\n'
        'os.kill(os.getpid(), signal.SIGTERM)\nprint("alive"'), "5"],
        capture_output=True, text=True, timeout=60)
    assert (saved.returncode, saved.stdout.strip()) == (0, "alive SIGUSR1"), saved.stderr


def test_sigusr1_to_the_whole_process_group_gives_one_snapshot_and_a_clean_stop(tmp_path):
    """What `kill -- -PGID`, `scancel --signal=USR1` and the SLURM time limit do: each
    worker gets the signal directly and again forwarded by the launcher."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", RECIPE, "epochs=40", "checkpoint.every_steps=4",
         f"out_dir={out}", "--nproc", "2", "--launcher", "spawn"],
        env=engine_env(), cwd=REPO, start_new_session=True, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").exists():  # the handlers are up
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, stderr
    assert stderr.count("pre-empted by SIGUSR1: snapshot written") == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert read_summary(out)["status"] == "preempted"
