"""Pre-emption: a signal makes every rank stop at a check point (the one after the check
point that saw it), with a snapshot from which the run resumes to the same weights as an
uninterrupted one."""

from __future__ import annotations

import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env, read_summary, run_cli, run_cli_here

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
# Without memory snapshots unless a test asks for them: one at a check point's step
# finishes that check at once (the ranks stop there), and the default interval (auto)
# depends on the measured cost, so where the ranks stop would depend on the machine.
ARGS = ("epochs=3", "checkpoint.every_steps=0", "checkpoint.keep_last=2",
        "checkpoint.memory_every_steps=0")


def test_sigusr1_on_one_rank_snapshots_all_and_the_rerun_finishes_identically(tmp_path,
                                                                               reference):
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
    assert read_summary(out)["weights_sha256"] == reference[2]


def test_ctrl_c_is_one_line_a_snapshot_and_exit_130_and_the_same_command_resumes(
        tmp_path, reference):
    """Ctrl-C as a terminal sends it: SIGINT to engine-run's whole process group (run_cli
    starts it in a session of its own), here from rank 0 right after step 7 (issue 35).
    The workers take it as a pre-emption request, not a KeyboardInterrupt in the
    recipe's forward: they stop together at a check point, with a snapshot."""
    out = tmp_path / "run"
    env = engine_env(ENGINE_FAULT_ACTION="interrupt", ENGINE_FAULT_STEP="7",
                     ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    args = (RECIPE, *ARGS, f"out_dir={out}", "--nproc", "2", "--launcher", "spawn",
            "-p", "tests.fault_plugin")
    stopped = run_cli(*args, env=env)
    assert stopped.returncode == 130, stopped.stderr  # EXIT_INTERRUPTED
    assert stopped.stderr.splitlines() == [
        "interrupted at epoch 2, step 10, batch 4 of the epoch: snapshot written; the same "
        "command resumes"], stopped.stderr
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"], summary["error"]) == (
        "interrupted", 10, None)
    assert (out / "checkpoints" / "snapshot-e0001-s00000010.pt").is_file()
    runs = run_cli_here("runs", str(tmp_path), check=True).stdout
    assert "interrupted" in runs.splitlines()[-1], runs

    resumed = run_cli(*args, env=env, check=True)
    assert "resuming from" in resumed.stdout and "epoch 2, step 10, batch 4" in resumed.stdout
    assert read_summary(out)["weights_sha256"] == reference[2]


def test_a_second_ctrl_c_ends_a_stuck_shutdown_at_once(tmp_path):
    """After the first Ctrl-C, rank 0 hangs deaf to SIGINT (a shutdown that would not end
    for 30 s): the second Ctrl-C kills the workers at once, with one line."""
    env = engine_env(ENGINE_FAULT_ACTION="interrupt-twice", ENGINE_FAULT_STEP="3")
    proc = run_cli(RECIPE, *ARGS, f"out_dir={tmp_path / 'run'}", "--nproc", "2",
                   "--launcher", "spawn", "-p", "tests.fault_plugin", env=env)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == [
        "engine-run: interrupted again: the workers were killed; the same command resumes "
        "from the newest snapshot"], proc.stderr


def python_block_after(text: str, heading: str) -> str:
    """The first ```python block after ``heading`` in a doc."""
    return text.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_plugin_guides_scheduler_requeues_and_the_log_says_so(tmp_path):
    """engine_requeue, as docs/plugins.md shows it: the first plugin that answers (a
    third-party scheduler's; the slurm plugin answers None outside a SLURM job) runs its
    scheduler's requeue, and rank 0 logs its line."""
    guide = (REPO / "docs" / "plugins.md").read_text()
    (tmp_path / "scheduler_plugin.py").write_text(
        python_block_after(guide, "### `engine_requeue(ctx)`"))
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
    import subprocess
    import time
    from concurrent.futures import ThreadPoolExecutor

    train = (RECIPE, "epochs=12", "checkpoint.every_steps=0",
             "checkpoint.memory_every_steps=0")
    out = tmp_path / "run"
    script = run_cli("sbatch", *train, f"out_dir={out}", "--nodes", "1",
                     "--procs-per-node", "2", "--cpus-per-task", "2",
                     "--layout", "task-per-node", check=True).stdout
    # The uninterrupted run goes on while the job waits for the scheduler (no other
    # run_cli until it is joined: the warm start runs one command at a time).
    reference, background = tmp_path / "reference", ThreadPoolExecutor(1)
    uninterrupted = background.submit(run_cli, *train, f"out_dir={reference}", "--launcher",
                                      "spawn", "--nproc", "2", "--threads", "1", check=True)
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
            # A failed run is not requeued: say so now, with the job's log, not at the deadline.
            assert summary.get("status") != "failed", (
                f"job {job} failed: {summary.get('error')}\n"
                + (out / f"slurm-{job}.out").read_text(errors="replace"))
    finally:
        subprocess.run(["scancel", job], timeout=30)
        uninterrupted.result(timeout=300)  # raises what the run raised
        background.shutdown()
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


LATE_HANDLER_PROBE = """
import os, signal, sys, threading, time
from engine import preemption
preemption.DUPLICATE_WINDOW_S = 1.0
flag = preemption.PreemptionFlag()
flag.install()
os.kill(os.getpid(), signal.SIGUSR1)  # the first request, handled at once
# The same request again a few milliseconds later (the launcher's forward), while the
# main thread is busy for longer than the window (a collective waiting for a slow peer):
# the kernel delivers it to the other thread, and Python runs its handler only when the
# main thread comes back.
# The main thread blocks it before the sender starts (which inherits the mask and lifts
# it for itself): the sender is the one thread the kernel can deliver it to.
def send():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGUSR1)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
sender = threading.Thread(target=send)
sender.start()
time.sleep(float(sys.argv[1]))
sender.join()
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
print("alive", flag.signal_name)
"""


def test_a_duplicate_handled_late_is_still_the_same_request():
    """Its handler runs 2 s after the first one's, but it arrived 0.05 s after it: the
    arrival counts (a CI run's worker killed itself mid-snapshot on such a duplicate).
    A real second request (sent 1.5 s later, past the 1 s window) still kills."""
    import signal
    import subprocess
    import sys

    late = subprocess.run([sys.executable, "-c", LATE_HANDLER_PROBE, "2"],
                          capture_output=True, text=True, timeout=60)
    assert (late.returncode, late.stdout.strip()) == (0, "alive SIGUSR1"), late.stderr
    later = subprocess.run([sys.executable, "-c", LATE_HANDLER_PROBE.replace(
        "time.sleep(0.05)", "time.sleep(1.5)"), "2"],
        capture_output=True, text=True, timeout=60)
    assert later.returncode == -signal.SIGUSR1, later


def test_sigusr1_to_the_whole_process_group_gives_one_snapshot_and_a_clean_stop(tmp_path):
    """What `kill -- -PGID`, `scancel --signal=USR1` and the SLURM time limit do: each
    worker gets the signal directly and again forwarded by the launcher."""
    import os
    import signal
    import time

    from engine.testing import start_engine

    out = tmp_path / "run"
    # In a session of its own, as a job step's processes are.
    proc = start_engine([RECIPE, "epochs=40", "checkpoint.every_steps=4", f"out_dir={out}",
                         "--nproc", "2", "--launcher", "spawn"], env=engine_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").exists():  # the handlers are up
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(1)
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


# ------------------------------------ pre-emption and time-based snapshots between
# snapshots (issue 34): every snapshot, in memory or on disk, first finishes the check
# point in flight; what that check carried (a pre-emption, a snapshot due by time) is
# acted on, not dropped.

#: tiny_resume, 3 epochs of 6 steps at 2 processes, rank 1 signalled (signalled_after).
SIGNALLED = (RECIPE, *ARGS, "--nproc", "2", "-p", "tests.fault_plugin")


def signalled_after(step: int, signal_name: str) -> dict[str, str]:
    """The environment of a run whose rank 1 sends itself ``signal_name`` right after
    optimizer step ``step``."""
    return engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_SIGNAL=signal_name,
                      ENGINE_FAULT_STEP=str(step), ENGINE_FAULT_RANK="1")


def assert_preempted_at(out, proc, *, epoch: int, step: int, batch: int) -> None:
    """Exit 75, summary "preempted" at ``step``, and the durable snapshot there, named by
    ``latest`` (``epoch`` counted from 1, as the log says)."""
    assert proc.returncode == 75, proc.stderr  # EXIT_PREEMPTED
    assert (f"pre-empted: snapshot written at epoch {epoch}, step {step}, batch {batch} of "
            "the epoch") in proc.stderr, proc.stderr
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"]) == ("preempted", step)
    name = f"snapshot-e{epoch - 1:04d}-s{step:08d}.pt"
    assert (out / "checkpoints" / name).is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == name


# Rank 1 signals itself after `signalled`; the next check point (`stopped`, a multiple of
# log_every) carries its flag to every rank, and that step's snapshot waits for the
# sums: the ranks stop there, within two check points of the signal. Before the fix
# the snapshot dropped the flag at every check point: SIGUSR1 in epoch 2 stopped at its
# end (step 12), SIGTERM in the last epoch ended "completed" (exit 0). The same with a
# disk snapshot at every check point (every_steps=log_every), which save_snapshot's
# comment ("the flag stays raised for the next check point") had missed.
@pytest.mark.parametrize("snapshots, signal_name, signalled, log_every, stopped", [
    ("checkpoint.memory_every_steps=1", "SIGUSR1", 7, 2, 8),  # epoch 2 of 3 (steps 7-12)
    ("checkpoint.memory_every_steps=1", "SIGTERM", 13, 3, 15),  # the last (13-18)
    ("checkpoint.every_steps=2", "SIGUSR1", 7, 2, 8),
])
def test_a_signal_with_a_snapshot_at_every_check_point_stops_within_two_check_points(
        tmp_path, snapshots, signal_name, signalled, log_every, stopped):
    out = tmp_path / "run"
    proc = run_cli(*SIGNALLED, snapshots, f"log_every={log_every}", f"out_dir={out}",
                   env=signalled_after(signalled, signal_name))
    assert stopped - signalled <= 2 * log_every
    assert_preempted_at(out, proc, epoch=(stopped - 1) // 6 + 1, step=stopped,
                        batch=(stopped - 1) % 6 + 1)


def test_a_pre_emption_seen_at_the_last_epochs_end_stops_and_resumes_identically(
        tmp_path, reference):
    """No memory snapshots, log_every=4: the check point at step 16 carries a SIGUSR1
    sent after step 15; the last epoch ends at step 18, before the check point that
    would act on it, so the epoch's last check (finished at its end) does. The run
    stops there, before validating, as pre-empted with its snapshot (it ended
    "completed" before the fix), and the rerun resumes from it to the weights of an
    uninterrupted run."""
    out = tmp_path / "run"
    args = (*SIGNALLED, "checkpoint.memory_every_steps=0", "log_every=4", f"out_dir={out}")
    env = signalled_after(15, "SIGUSR1") | {"ENGINE_FAULT_ONCE": str(tmp_path / "once")}
    assert_preempted_at(out, run_cli(*args, env=env), epoch=3, step=18, batch=6)
    resumed = run_cli(*args, env=env, check=True)
    assert "resuming from" in resumed.stdout and "epoch 3, step 18, batch 6" in resumed.stdout
    summary = read_summary(out)
    assert (summary["status"], summary["epochs_completed"]) == ("completed", 3)
    assert summary["weights_sha256"] == reference[2]  # snapshots change no weight


ELASTIC = str(REPO / "tests" / "recipes" / "tiny_elastic.py")


def test_time_based_snapshots_are_written_with_a_memory_snapshot_every_step(tmp_path):
    """checkpoint.every_minutes=0.01 (0.6 s), a memory snapshot and a check point every
    step. Rank 0 loads its 3 samples of a step in at least 0.15 s (slow_s), so at the
    latest 4 steps after a snapshot the next is due by time, and the memory snapshot of
    that check point's step waits for its sums: disk snapshots are never more than 4
    steps apart (5 allowed: load only makes steps longer, hence snapshots closer).
    Before the fix the memory snapshots dropped every flag: only the epochs' ends."""
    out = tmp_path / "run"
    run_cli(ELASTIC, "epochs=2", "size=60", "slow_rank=0", "slow_s=0.05",
            "checkpoint.every_minutes=0.01", "checkpoint.memory_every_steps=1",
            "checkpoint.keep_last=0", f"out_dir={out}", "--nproc", "2", check=True)
    assert read_summary(out)["global_step"] == 20  # 2 epochs of 10 steps
    steps = sorted({int(p.stem.rsplit("-s", 1)[1])
                    for p in (out / "checkpoints").glob("snapshot-e*-s*.pt")})
    gaps = [b - a for a, b in zip([0, *steps], steps)]
    assert steps[-1] == 20 and max(gaps) <= 5, steps


SWEEP = """
import json, sys
import engine

out = sys.argv[1]
done = []
try:
    for lr in (0.1, 0.2):  # a sweep: Ctrl-C must stop it, not start the next run
        done.append(engine.fit({recipe!r}, nproc=2, launcher="spawn",
                               plugins=["tests.fault_plugin"], out_dir=f"{{out}}/{{lr}}",
                               lr=lr, {args})["status"])
except KeyboardInterrupt as exc:
    print(json.dumps({{"raised": type(exc).__name__, "done": done,
                      "status": exc.summary["status"], "step": exc.summary["global_step"]}}))
"""


def test_ctrl_c_stops_a_sweep_of_fit_calls_with_the_snapshot_written(tmp_path):
    """engine.fit in a loop: the Ctrl-C that stops one run raises KeyboardInterrupt in the
    caller once that run's snapshot is written (it returned the summary, and the loop
    went on with the next lr), with the summary attached."""
    args = ", ".join(f"{key!r}: {value!r}" for key, value in
                     (item.split("=", 1) for item in ARGS))
    code = SWEEP.format(recipe=RECIPE, args=f"**{{{args}}}")
    env = engine_env(ENGINE_FAULT_ACTION="interrupt", ENGINE_FAULT_STEP="7",
                     ENGINE_START_METHOD="fork")
    proc = run_python(["-c", code, str(tmp_path)], env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "raised": "Interrupted", "done": [], "status": "interrupted", "step": 10}, proc.stdout
    assert (tmp_path / "0.1" / "checkpoints" / "snapshot-e0001-s00000010.pt").is_file()
    assert not (tmp_path / "0.2").exists()
