"""engine/launch_checks.py: what the launching process refuses or answers before any
worker starts (a sweep through a completed run's folder; a recipe's checks that need no
batch)."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.testing import fit
from tests import conftest

RECIPE = conftest.REPO / "tests" / "recipes" / "tiny_regression.py"


def test_a_sweep_through_one_folder_is_refused_not_answered_with_the_first_result(
        tmp_path, capsys):
    """engine.fit with another lr into the folder of a completed run: refused in the
    calling process from the folder's summary.json and config.json (no worker, no data),
    naming the change and the fix that keeps both runs; with ``{version}`` each lr gets
    its folder and trains."""

    out = tmp_path / "run"
    fit(RECIPE, nproc=1, out_dir=str(out), epochs=1, lr=0.1)
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ConfigError) as refused:
        fit(RECIPE, nproc=1, out_dir=str(out), epochs=1, lr=0.05)
    assert str(refused.value) == (
        f"engine.fit: {out} holds a completed run trained with lr 0.1 (asked: 0.05): "
        "nothing would be trained with this config; to keep both runs, give each its "
        f"folder (out_dir={out / '{version}'}), or use engine.fit(..., resume=False, "
        "overwrite=True) to replace it")
    # Refused before any worker: nothing in the folder was written (not even the lock).
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    results = [fit(RECIPE, nproc=1, out_dir=str(out / "{version}"),
                   epochs=1, lr=lr) for lr in (0.1, 0.05)]
    assert [r["status"] for r in results] == ["completed", "completed"]
    # Each summary says its folder, the {version} filled.
    assert [r["out_dir"] for r in results] == [str(out / "0"), str(out / "1")]
    assert results[0]["weights_sha256"] != results[1]["weights_sha256"]


CHECKED_RECIPE = """
import torch
from tests.recipes.tiny_regression import *  # noqa: F401,F403
from tests.recipes.tiny_regression import eval_step  # noqa: F401
{extra}
"""


@pytest.mark.parametrize("extra, overrides, message", [
    ("throughput_unit = 'tokens'", [],
     "the recipe declares throughput_unit='tokens' without count_throughput(batch) -> int"),
    ("", ["checkpoint.best_metric=train/epoch_los", "checkpoint.best_mode=min"],
     "config key 'checkpoint.best_metric': 'train/epoch_los' is not a metric this run logs "
     "(did you mean 'train/epoch_loss'?)"),
    ("", ["early_stopping.metric=train/epoch_tokens_per_sec"],
     "config key 'early_stopping.metric': 'train/epoch_tokens_per_sec' is not a metric this "
     "run logs (did you mean 'train/epoch_samples_per_sec'?)"),
    ("def build_scheduler(cfg, optimizer, ctx):\n"
     "    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode='max')",
     ["scheduler_metric=val/loss"],
     "config key 'scheduler_metric': lower is better for 'val/loss' (read from the name), "
     "but the recipe's ReduceLROnPlateau has mode='max'; build it with mode='min'"),
    ("", ["scheduler_metric=val/loss"], "config key 'scheduler_metric': 'val/loss' is for a "
     "scheduler that steps on a metric (ReduceLROnPlateau), and the recipe has no "
     "build_scheduler"),
])
def test_checks_that_need_no_batch_are_answered_in_the_launching_process(
        tmp_path, extra, overrides, message):
    """Refused by --dry-run, which starts no worker (they came after 13-21 s of worker
    start-up)."""
    recipe = tmp_path / "checked.py"
    recipe.write_text(CHECKED_RECIPE.format(extra=extra))
    proc = conftest.run_cli_here(str(recipe), *overrides, f"out_dir={tmp_path / 'run'}",
                                 "--dry-run")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"engine-run: error: {message}"), proc.stderr


def test_a_recipe_whose_scheduler_needs_its_real_model_is_left_to_the_worker(tmp_path):
    recipe = tmp_path / "checked.py"
    recipe.write_text(CHECKED_RECIPE.format(
        extra="def build_scheduler(cfg, optimizer, ctx):\n"
              "    assert len(optimizer.param_groups[0]['params']) == 4  # the real model's\n"
              "    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)"))
    conftest.run_cli_here(str(recipe), "scheduler_metric=val/loss",
                          f"out_dir={tmp_path / 'run'}", "--dry-run", check=True)
