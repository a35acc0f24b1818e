"""The run's length and validation by steps (engine/trainer.py): ``max_steps``,
``val_every_steps`` and the smoke switch (``limit_batches``, ``smoke``), on real
2-process runs. The recipe validates with an eval_step that draws from the global RNG
(tests/recipes/tiny_eval_draws.py): training must go on as without the validations, so
its weights are those of the session's uninterrupted reference run of tiny_resume."""

from __future__ import annotations

import csv

import pytest
import torch

from engine.overrides import apply_overrides
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
    (["validate=false", "val_every_steps=5"], "config key 'validate': false never "
     "validates, and val_every_steps=5 needs validation; leave validate=false out, or that key"),
    (["validate=false", "checkpoint.best_metric=val/loss"], "config key 'validate': false "
     "never validates, and checkpoint.best_metric=val/loss needs validation"),
])
def test_bad_run_length_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(
            ")", r"\)")):
        apply_overrides(TinyConfig(), overrides)


def test_run_length_keys_may_change_on_resume_the_smoke_switch_may_not():
    from engine.snapshot import may_change

    cfg = TinyConfig()
    assert may_change("max_steps", cfg) and may_change("val_every_steps", cfg)
    assert may_change("validate", cfg)
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


# ------------------------------------------------ a new run length and the scheduler

def _schedulers(total: int):
    """One factory per torch scheduler family, each built for a run of ``total`` steps
    (the recipe's build_scheduler reading ctx.total_steps)."""
    from torch.optim import lr_scheduler as L

    return {
        "cosine": lambda o: L.CosineAnnealingLR(o, T_max=total),
        "step": lambda o: L.StepLR(o, step_size=total // 4, gamma=0.5),
        "multistep": lambda o: L.MultiStepLR(o, milestones=[total // 2, total * 3 // 4]),
        "one-cycle": lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=total),
        "linear": lambda o: L.LinearLR(o, start_factor=1.0, end_factor=0.0,
                                       total_iters=total),
        "lambda": lambda o: L.LambdaLR(o, lambda s: 1 - s / total),
        "plateau": lambda o: L.ReduceLROnPlateau(o, patience=1),
        "sequential": lambda o: L.SequentialLR(o, [
            L.LinearLR(o, start_factor=0.1, total_iters=4),
            L.CosineAnnealingLR(o, T_max=total - 4)], milestones=[4]),
        "chained": lambda o: L.ChainedScheduler([
            L.LinearLR(o, start_factor=0.1, total_iters=4),
            L.CosineAnnealingLR(o, T_max=total)]),
    }


def _lrs(family: str, total: int, steps: range, resumed=None):
    """The learning rate after each of ``steps`` of a schedule built for ``total`` steps
    (from the start, or ``resumed(scheduler, optimizer)`` first); a plateau scheduler
    steps on a loss that stops improving at step 12."""
    import warnings

    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    scheduler = _schedulers(total)[family](optimizer)
    if resumed is not None:
        resumed(scheduler, optimizer)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            if family == "plateau":
                scheduler.step(max(12 - step, 0) + 1.0)
            else:
                scheduler.step()
            out.append((optimizer.param_groups[0]["lr"],
                        optimizer.param_groups[0]["momentum"]))
    return out, scheduler, optimizer


@pytest.mark.parametrize("family", list(_schedulers(10)))
def test_a_longer_run_follows_the_new_schedule_whatever_the_scheduler(family):
    """Trained 24 steps of a 24-step schedule, resumed as a 40-step run: from the resume
    on, every step's learning rate (and one-cycle's momentum) is that of a 40-step run
    from the start, as restore does it (the snapshot loaded into the schedule built for
    the new length, then follow_new_length)."""
    import types

    from engine import snapshot
    from engine.config import TrainConfig

    _, old, old_optimizer = _lrs(family, 24, range(1, 25))
    saved = (old.state_dict(), old_optimizer.state_dict())
    warned = []

    def resume(scheduler, optimizer):
        cfg = TrainConfig(epochs=5, scheduler_interval="step")
        ctx = types.SimpleNamespace(scheduler=scheduler, optimizer=optimizer, cfg=cfg,
                                    total_steps=40, warn=warned.append)
        changed = snapshot._length_change(ctx, {"epochs": 3, "max_steps": 0}, "the snapshot")
        start = snapshot.schedule_start(scheduler, optimizer) if changed else None
        scheduler.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        if changed:
            snapshot.follow_new_length(ctx, start, changed)

    after, _, _ = _lrs(family, 40, range(25, 41), resumed=resume)
    fresh, _, _ = _lrs(family, 40, range(1, 41))
    assert after == fresh[24:]
    if family == "plateau":  # it follows its metric, not the run's length: nothing said
        assert warned == []
    else:
        assert warned[0].startswith(
            "epochs changed since the snapshot: 3 -> 5; the scheduler (") and (
            "per step) is rebuilt for 5 epochs (40 steps) and brought to step 24 of it: "
            "the learning rate is the new schedule's from here on") in warned[0]


def test_a_new_length_with_a_scheduler_the_engine_cannot_rebuild_refuses_the_resume():
    import types

    from engine import snapshot
    from engine.config import TrainConfig

    class Halving:  # a scheduler of the recipe's own: state_dict, load_state_dict, step
        def step(self):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    ctx = types.SimpleNamespace(scheduler=Halving(), cfg=TrainConfig(epochs=5))
    with pytest.raises(ConfigError, match="^cannot resume: epochs changed since s.pt: 3 -> "
                       "5, and the scheduler Halving is not a torch LRScheduler"):
        snapshot._length_change(ctx, {"epochs": 3}, "s.pt")


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_resume_with_more_epochs_trains_on_the_cosine_schedule_of_the_new_length(
        tmp_path, interval):
    """tiny_cosine's cosine over its run (24 steps of 3 epochs, or the 3 epochs),
    resumed with epochs=5: each step's logged learning rate after the resume is that of
    a cosine over 40 steps (5 epochs) from the start; it used to reach 0 and climb back,
    or stay at 0 per epoch."""
    import math

    out = tmp_path / "run"
    args = (str(REPO / "tests" / "recipes" / "tiny_cosine.py"), "--nproc", "1",
            f"out_dir={out}", f"scheduler_interval={interval}", "log_every=1",
            "checkpoint.memory_every_steps=0")
    run_cli(*args, "epochs=3", check=True)
    resumed = run_cli(*args, "epochs=5", check=True)
    # lr after step s: a cosine from 0.05 over 40 steps, or over 5 epochs (8 steps each)
    # stepped at each epoch's end, after its last step's lr is logged.
    done = (lambda s: s / 40) if interval == "step" else (lambda s: (s - 1) // 8 / 5)
    logged = dict(rows(out, "lr"))  # each step's (an epoch's end logs its last again)
    assert list(logged) == list(range(1, 41))
    for step, lr in list(logged.items())[24:]:
        assert lr == pytest.approx(0.025 * (1 + math.cos(math.pi * done(step))), abs=1e-9)
    assert f"is rebuilt for 5 epochs (40 steps) and brought to {interval} {24 if interval == 'step' else 3} of it: " \
        f"the learning rate is the new schedule's from here on" in resumed.stderr


def test_the_best_snapshot_is_the_best_validation_whatever_the_snapshot_interval(tmp_path):
    """tiny_regression at lr 0.1, validating every 2 steps with snapshots at epochs'
    ends only (8 steps each): val/loss is lowest at step 4, then early stopping ends the
    run 4 validations later (step 12). checkpoints/best, summary.json and early
    stopping's message name step 4, and its weights give that validation's loss; the
    best used to be the best of the snapshots the interval wrote (step 8's)."""
    import engine
    from tests.recipes.tiny_regression import make_data

    out = tmp_path / "run"
    run = run_cli(str(REPO / "tests" / "recipes" / "tiny_regression.py"), "--nproc", "1",
                  f"out_dir={out}", "lr=0.1", "val_every_steps=2", "checkpoint.every_steps=0",
                  "checkpoint.memory_every_steps=0", "checkpoint.best_metric=val/loss",
                  "early_stopping.metric=val/loss", "early_stopping.patience=4", check=True)
    losses = rows(out, "val/loss")
    step, best = min(losses, key=lambda row: row[1])
    assert step == 4 and read_summary(out)["global_step"] == 12, losses
    name = "snapshot-e0000-s00000004.pt"
    assert (out / "checkpoints" / "best").read_text().strip() == name
    assert read_summary(out)["best_checkpoint"].endswith(name)
    assert f"best {best:.4g} at step 4 (epoch 1)" in run.stdout, run.stdout
    inputs, targets = make_data(24, seed=2).tensors
    with torch.no_grad():
        loss = (engine.load_model(out, which="best")(inputs) - targets).pow(2).mean()
    assert float(loss) == pytest.approx(best, rel=1e-5)


def test_validate_false_trains_without_validating_and_at_end_false_writes_no_snapshot(
        tmp_path):
    """A throw-away run (issue 52.4): a recipe with a validation set and validate=false
    logs no val/ metric; checkpoint.at_end=false (every_epochs=0) leaves no snapshot. The
    defaults validate and write the final snapshot."""
    recipe = str(REPO / "tests" / "recipes" / "tiny_regression.py")
    off = tmp_path / "off"
    run_cli(recipe, "epochs=1", "validate=false", "checkpoint.at_end=false",
            "checkpoint.every_epochs=0", f"out_dir={off}", "--nproc", "1", check=True)
    summary = read_summary(off)
    assert summary["status"] == "completed" and summary["final_checkpoint"] is None
    assert summary["val_loss"] is None and rows(off, "val/loss") == []
    assert not list(off.glob("checkpoints/*.pt"))
    on = tmp_path / "on"
    run_cli(recipe, "epochs=1", "checkpoint.every_epochs=0", f"out_dir={on}", "--nproc", "1",
            check=True)
    assert read_summary(on)["final_checkpoint"] and rows(on, "val/loss")
