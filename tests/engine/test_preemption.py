"""Pre-emption: a signal makes every rank stop at the next check point, with a snapshot
from which the run resumes to the same weights as an uninterrupted one."""

from __future__ import annotations

from engine import preemption
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
    stopped = run_cli(*args, env=env, check=True)
    # Rank 1 got the signal after step 7; both stopped at the next check point (step 8).
    assert ("pre-empted: snapshot written at epoch 1, step 8; not a SLURM job: not "
            "requeued") in stopped.stderr
    summary = read_summary(out)
    assert summary["status"] == "preempted" and summary["global_step"] == 8
    assert (out / "checkpoints" / "snapshot-e0001-s00000008.pt").is_file()

    resumed = run_cli(*args, env=env, check=True)
    assert "resuming from" in resumed.stdout and "epoch 1, step 8, batch 2" in resumed.stdout
    assert read_summary(out)["weights_sha256"] == read_summary(reference)["weights_sha256"]


def test_requeue_reports_a_missing_scontrol(tmp_path):
    message = preemption.requeue({"SLURM_JOB_ID": "4242", "PATH": str(tmp_path)})
    assert message == ("scontrol not found on PATH: job 4242 was not requeued; resubmit it "
                       "to resume from the snapshot")


def test_array_jobs_are_requeued_by_their_array_id():
    env = {"SLURM_JOB_ID": "100", "SLURM_ARRAY_JOB_ID": "90", "SLURM_ARRAY_TASK_ID": "3"}
    assert preemption.slurm_job_id(env) == "90_3"
    assert preemption.slurm_job_id({"SLURM_JOB_ID": "100"}) == "100"
    assert preemption.requeue({}) == ("not a SLURM job: not requeued (start the run again "
                                      "to resume)")
