"""The run's length and validation by steps (engine/trainer.py): ``max_steps``,
``val_every_steps`` and the smoke switch (``limit_batches``, ``smoke``), on real
2-process runs. The recipe validates with an eval_step that draws from the global RNG
(tests/recipes/tiny_eval_draws.py): training must go on as without the validations, so
its weights are those of the session's uninterrupted reference run of tiny_resume."""

from __future__ import annotations

import csv

import pytest

from engine.config import apply_overrides
from engine.errors import ConfigError
from engine import TrainConfig as TinyConfig
from tests.conftest import REPO, engine_env, read_summary, run_cli
from tests.engine.conftest import RESUME_BASE

RECIPE = str(REPO / "tests" / "recipes" / "tiny_eval_draws.py")
# 3 epochs of 6 steps; snapshots every 4 steps.
ARGS = (RECIPE, *RESUME_BASE, "--nproc", "2")


def rows(out_dir, name: str) -> list[tuple[int, float]]:
    """(step, value) of each row of metric ``name`` in the run's metrics.csv."""
    with open(out_dir / "metrics.csv") as f:
        return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(f)
                if r["name"] == name]


@pytest.fixture(scope="module")
def by_steps(tmp_path_factory):
    """One run followed through its segments: validating every 4 steps and ending at
    max_steps=10 (batch 4 of epoch 2), killed (rank 1, SIGKILL) right after step 5, the
    step after the validation and snapshot at step 4; the same command again (it resumes
    at step 4 and ends at step 10); once more (already complete); then with max_steps
    lifted, to the end of its 3 epochs."""
    tmp = tmp_path_factory.mktemp("by_steps")
    out = tmp / "run"
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP="5",
                       ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp / "fault-done"))
    args = (*ARGS, "val_every_steps=4", f"out_dir={out}", "-p", "tests.fault_plugin")
    killed = run_cli(*args, "max_steps=10", env=fault)
    resumed = run_cli(*args, "max_steps=10", env=fault, check=True)
    ended = {"summary": read_summary(out), "val_loss": rows(out, "val/loss"),
             "snapshots": sorted(p.name for p in (out / "checkpoints").glob("*.pt"))}
    again = run_cli(*args, "max_steps=10", env=fault, check=True)
    extended = run_cli(*args, "max_steps=0", env=fault, check=True)
    return {"out": out, "killed": killed, "resumed": resumed, "ended": ended,
            "again": again, "extended": extended}


def test_a_kill_after_a_validation_by_steps_resumes_from_its_snapshot_without_redoing_it(
        by_steps):
    assert by_steps["killed"].returncode != 0, by_steps["killed"].stderr
    resumed = by_steps["resumed"]
    assert "resuming from" in resumed.stdout and "epoch 1, step 4, batch 4" in resumed.stdout
    # Validated at steps 4 and 8 (every 4), at epoch 1's end (step 6) and where max_steps
    # ended the run (step 10): each once, across the kill (step 4's by the killed run).
    assert [step for step, _ in by_steps["ended"]["val_loss"]] == [4, 6, 8, 10]
    assert "step 8 (epoch 2/3)  val loss" in resumed.stdout


def test_max_steps_ends_the_run_mid_epoch_with_a_validation_and_a_final_snapshot(by_steps):
    summary = by_steps["ended"]["summary"]
    assert (summary["status"], summary["global_step"], summary["epochs_completed"]) == (
        "completed", 10, 1)
    assert "snapshot-e0001-s00000010.pt" in by_steps["ended"]["snapshots"]
    assert "done: 10 steps (max_steps, in epoch 2) (resumed at step 4) in " in by_steps["resumed"].stdout
    assert "step 10 (epoch 2/3)  val loss" in by_steps["resumed"].stdout
    # The run again: answered from its folder, nothing trained.
    assert by_steps["again"].stdout.startswith(
        f"already complete: {by_steps['out']} holds a finished run of 10 steps (asked for "
        "max_steps=10), nothing to train; to train on, ask for more (max_steps=11 or more)")


def test_a_resume_with_max_steps_lifted_trains_on_to_the_uninterrupted_runs_weights(
        by_steps, reference):
    """Validating every 4 steps with an eval_step that draws, a kill, a stop at
    max_steps and two resumes: the weights of one uninterrupted run that validated at
    epochs' ends only."""
    extended = by_steps["extended"]
    assert "epoch 2, step 10, batch 4" in extended.stdout
    summary = read_summary(by_steps["out"])
    assert (summary["status"], summary["global_step"], summary["epochs_completed"]) == (
        "completed", 18, 3)
    assert "done: 3 epochs (resumed at step 10) in" in extended.stdout
    # The per-step schedule's length changed with max_steps: said, as for epochs.
    assert "max_steps changed since" in extended.stderr and ": 10 -> 0;" in extended.stderr
    assert summary["weights_sha256"] == reference[2]
    assert [s for s, _ in rows(by_steps["out"], "val/loss")] == [4, 6, 8, 10, 12, 16, 18]
    assert {v for _, v in rows(by_steps["out"], "val/samples")} == {32}  # the whole set


def test_a_smoke_run_trains_a_few_steps_in_a_folder_of_its_own_started_afresh(tmp_path):
    out = tmp_path / "run"
    first = run_cli(*ARGS, f"out_dir={out}", "limit_batches=1", check=True)
    smoke = tmp_path / "run-smoke"
    assert "smoke run: 1 step(s) and 1 validation batch(es) per process" in first.stdout
    summary = read_summary(smoke)
    assert (summary["status"], summary["global_step"], summary["epochs_requested"]) == (
        "completed", 1, 1)
    assert rows(smoke, "val/samples") == [(1, 16.0)]  # 1 batch of 8 on each of 2 ranks
    assert not out.exists()  # nothing a real run in out_dir could resume from
    # smoke=true: 2 steps, again from step 0 in the same folder (never resumed).
    second = run_cli(*ARGS, f"out_dir={out}", "smoke=true", check=True)
    assert "resuming" not in second.stdout
    assert "done: 2 steps (max_steps, in epoch 1)" in second.stdout, second.stdout
    assert read_summary(smoke)["global_step"] == 2
    assert rows(smoke, "val/samples") == [(2, 32.0)]


@pytest.mark.parametrize("overrides, message", [
    (["max_steps=-1"], "config key 'max_steps': -1 must be >= 0 (0: the epochs decide)"),
    (["val_every_steps=-2"], "config key 'val_every_steps': -2 must be >= 0"),
    (["limit_batches=-1"], "config key 'limit_batches': -1 must be >= 0 (0: not a smoke"),
    (["val_every_steps=5", "early_stopping.metric=train/epoch_loss"],
     "config key 'early_stopping.metric': 'train/epoch_loss' is not known at a validation "
     "by steps (val_every_steps=5); name a val/ metric"),
])
def test_bad_run_length_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(
            ")", r"\)")):
        apply_overrides(TinyConfig(), overrides)


def test_run_length_keys_may_change_on_resume_the_smoke_switch_may_not():
    from engine.snapshot import may_change

    cfg = TinyConfig()
    assert may_change("max_steps", cfg) and may_change("val_every_steps", cfg)
    assert not may_change("limit_batches", cfg) and not may_change("smoke", cfg)


def test_early_stopping_by_steps_ends_the_run_mid_epoch_and_the_best_is_the_validated_one(
        tmp_path):
    """Validating every 2 steps, patience 1 and a min_delta no loss beats: the first
    validation (step 2) sets the best, the second (step 4, inside epoch 1) stops the run
    there, with the final snapshot; the best snapshot is step 2's."""
    out = tmp_path / "run"
    run = run_cli(*ARGS, f"out_dir={out}", "val_every_steps=2", "checkpoint.every_steps=2",
                  "early_stopping.metric=val/loss", "early_stopping.patience=1",
                  "early_stopping.min_delta=10", "checkpoint.best_metric=val/loss",
                  check=True)
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"], summary["stopped_early"]) == (
        "completed", 4, True)
    best = [v for s, v in rows(out, "val/loss") if s == 2][0]
    assert (f"early stopping: val/loss did not improve by more than 10 on {best:.4g} for 1 "
            f"validations; best {best:.4g} at step 2 (epoch 1)") in run.stdout, run.stdout
    assert summary["best_checkpoint"].endswith("snapshot-e0000-s00000002.pt")
    assert (out / "checkpoints" / "snapshot-e0000-s00000004.pt").is_file()
