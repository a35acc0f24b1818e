"""engine/trainer.py: the training loop's policies, through real ``engine-run`` runs on
the CPU (gloo for two processes)."""

from __future__ import annotations

import math

import torch

from tests.conftest import REPO, read_summary, run_cli

REGRESSION = str(REPO / "tests" / "recipes" / "tiny_regression.py")


def first_sample_of_epoch(epoch: int, n: int, seed: int = 0) -> int:
    """The sample a one-process run sees first in ``epoch`` (DistributedSampler's order)."""
    g = torch.Generator().manual_seed(seed + epoch)
    return int(torch.randperm(n, generator=g)[0])


def test_skip_counts_a_nan_in_any_micro_batch_not_only_the_last(tmp_path):
    # The NaN sample opens the first micro-batch of the first optimizer step; the
    # second micro-batch of that step is finite. The step must still be skipped.
    nan = first_sample_of_epoch(0, n=64)
    out = tmp_path / "run"
    proc = run_cli(REGRESSION, f"out_dir={out}", "--nproc", "1", "epochs=1",
                   "grad_accum_steps=2", "on_nonfinite=skip", f"nan_sample={nan}",
                   check=True)
    assert "non-finite loss at step 1: step skipped (on_nonfinite=skip)" in proc.stderr
    summary = read_summary(out)
    assert summary["status"] == "completed"
    assert math.isfinite(summary["val_loss"]), "the optimizer stepped on NaN gradients"


# ------------------------------------------------------------ recipes that own the step

DICT_BATCH = str(REPO / "tests" / "recipes" / "tiny_dict_batch.py")
#: 64 samples, global batch 8: 8 steps per epoch, 24 in all; snapshots every 5 steps.
RESUME = ("epochs=3", "checkpoint.every_steps=5", "checkpoint.keep_last=2")
KILL_STEP = 11  # mid-epoch 1, between the snapshots of steps 10 and 15


def kill_and_resume(recipe: str, tmp_path, nproc: int, *overrides: str) -> dict:
    """The summary of a run killed (SIGKILL, last rank) after step KILL_STEP and resumed."""
    from tests.conftest import engine_env

    out = tmp_path / "resumed"
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(KILL_STEP),
                       ENGINE_FAULT_RANK=str(nproc - 1),
                       ENGINE_FAULT_ONCE=str(tmp_path / "fault-done"))
    args = (recipe, *RESUME, *overrides, f"out_dir={out}", "--nproc", str(nproc),
            "-p", "tests.fault_plugin")
    killed = run_cli(*args, env=fault)
    assert killed.returncode != 0, f"the fault was not injected\n{killed.stderr}"
    resumed = run_cli(*args, env=fault, check=True)
    assert "resuming from " in resumed.stdout, resumed.stdout
    return read_summary(out)


def epoch_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("epoch ")]


def test_regression_recipe_reports_its_own_metrics_and_resumes_exactly(tmp_path):
    out = tmp_path / "reference"
    proc = run_cli(REGRESSION, *RESUME, f"out_dir={out}", "--nproc", "2", check=True)
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 3 and all("val mae " in line for line in lines), proc.stdout
    assert "val acc" not in proc.stdout
    reference = read_summary(out)
    assert reference["status"] == "completed" and reference["val_accuracy"] is None
    assert math.isfinite(reference["val_loss"])
    assert kill_and_resume(REGRESSION, tmp_path, 2)["weights_sha256"] == (
        reference["weights_sha256"])


def test_dict_batch_recipe_trains_and_resumes_exactly(tmp_path):
    out = tmp_path / "reference"
    proc = run_cli(DICT_BATCH, *RESUME, f"out_dir={out}", "--nproc", "2", check=True)
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 3 and all("val acc " in line and "val top2 " in line
                                   for line in lines), proc.stdout
    reference = read_summary(out)
    assert 0 <= reference["val_accuracy"] <= 1
    assert kill_and_resume(DICT_BATCH, tmp_path, 2)["weights_sha256"] == (
        reference["weights_sha256"])

