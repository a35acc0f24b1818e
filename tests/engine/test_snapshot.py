"""Exact resume: a run killed with SIGKILL and started again ends with the same weights
as a run that was never interrupted (bit-identical weights_sha256)."""

from __future__ import annotations

import random

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
STEPS_PER_EPOCH = 6  # 96 samples, global batch 16
EPOCHS = 3
BASE = ("epochs=3", "checkpoint.every_steps=4", "checkpoint.keep_last=2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """weights_sha256 of uninterrupted runs, by number of processes."""
    digests = {}
    for nproc in (1, 2):
        out = tmp_path_factory.mktemp(f"reference{nproc}")
        run_cli(RECIPE, *BASE, f"out_dir={out}", "--nproc", str(nproc), check=True)
        digests[nproc] = read_summary(out)["weights_sha256"]
    return digests


def mid_epoch_step() -> int:
    rng = random.Random()
    candidates = [s for s in range(5, STEPS_PER_EPOCH * EPOCHS)
                  if s % STEPS_PER_EPOCH and s % 4]  # neither an epoch end nor a snapshot
    return rng.choice(candidates)


@pytest.mark.parametrize("nproc, workers, where", [
    (1, 0, "epoch"),
    (2, 0, "epoch"),
    (1, 0, "mid"),
    (2, 0, "mid"),
    (1, 2, "mid"),
    (2, 2, "mid"),
])
def test_killed_run_resumes_to_identical_weights(reference, tmp_path, nproc, workers, where):
    out = tmp_path / "run"
    fault = {"ENGINE_FAULT_ACTION": "kill", "ENGINE_FAULT_RANK": str(nproc - 1),
             "ENGINE_FAULT_ONCE": str(tmp_path / "fault-done")}
    if where == "epoch":
        fault["ENGINE_FAULT_EPOCH"] = "1"  # right after epoch 0's snapshot
    else:
        fault["ENGINE_FAULT_STEP"] = str(mid_epoch_step())
    args = (RECIPE, *BASE, f"num_workers={workers}", f"out_dir={out}", "--nproc", str(nproc),
            "-p", "tests.fault_plugin")
    killed = run_cli(*args, env=engine_env(**fault))
    assert killed.returncode != 0, f"the fault was not injected: {fault}\n{killed.stderr}"
    # Rank 0 records the failure when it notices the lost rank before it is stopped.
    assert not (out / "summary.json").exists() or read_summary(out)["status"] == "failed"

    resumed = run_cli(*args, env=engine_env(**fault), check=True)
    assert "resuming from " in resumed.stdout, resumed.stdout
    summary = read_summary(out)
    assert summary["epochs_completed"] == EPOCHS
    assert summary["global_step"] == STEPS_PER_EPOCH * EPOCHS
    assert summary["weights_sha256"] == reference[nproc], (
        f"resume after a kill ({fault}) changed the final weights")


def test_resume_message_says_from_where(tmp_path):
    out = tmp_path / "run"
    args = (RECIPE, *BASE, "epochs=1", f"out_dir={out}", "--nproc", "1")
    first = run_cli(*args, check=True)
    assert "resuming" not in first.stdout  # nothing to resume: it simply starts
    again = run_cli(*args[:-3], "epochs=2", f"out_dir={out}", "--nproc", "1", check=True)
    latest = (out / "checkpoints" / "snapshot-e0001-s00000006.pt")
    assert f"resuming from {latest}: epoch 1, step 6" in again.stdout
    assert read_summary(out)["global_step"] == 12


def test_no_resume_starts_fresh_and_resume_path_picks_a_snapshot(tmp_path, reference):
    out = tmp_path / "run"
    keep_all = (*BASE, "checkpoint.keep_last=0")
    run_cli(RECIPE, *keep_all, f"out_dir={out}", "--nproc", "1", check=True)
    fresh = run_cli(RECIPE, *keep_all, f"out_dir={out}", "--nproc", "1", "--no-resume",
                    check=True)
    assert "resuming" not in fresh.stdout
    assert read_summary(out)["weights_sha256"] == reference[1]

    early = out / "checkpoints" / "snapshot-e0002-s00000012.pt"
    assert early.exists()
    other = tmp_path / "other"
    chosen = run_cli(RECIPE, *BASE, f"out_dir={other}", "--nproc", "1", "--resume",
                     str(early), check=True)
    assert f"resuming from {early}: epoch 2, step 12" in chosen.stdout
    assert read_summary(other)["weights_sha256"] == reference[1]


def test_resume_from_a_missing_path_is_an_error(tmp_path):
    proc = run_cli(RECIPE, f"out_dir={tmp_path}", "--nproc", "1", "--resume",
                   str(tmp_path / "nope.pt"))
    assert proc.returncode != 0
    assert f"--resume '{tmp_path / 'nope.pt'}': no such checkpoint" in proc.stderr


def test_torchrun_max_restarts_resumes_a_killed_worker_to_identical_weights(
        reference, tmp_path):
    import shutil

    torchrun = shutil.which("torchrun", path=str(REPO / ".venv" / "bin")) or shutil.which(
        "torchrun")
    assert torchrun, "torchrun ships with torch"
    out = tmp_path / "run"
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(mid_epoch_step()),
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    from tests.plugins.launch_runs import run

    from tests.conftest import ENGINE_RUN

    proc = run([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                ENGINE_RUN, RECIPE, *BASE, f"out_dir={out}", "-p", "tests.fault_plugin"],
               env=env, timeout=400)
    assert (tmp_path / "once").exists(), "the worker was never killed"
    assert "(restart 1)" in proc.stdout, proc.stdout
    summary = read_summary(out)
    assert (summary["launcher"], summary["global_step"]) == ("torchrun", 18)
    assert summary["weights_sha256"] == reference[2]
