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
