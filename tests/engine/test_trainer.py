"""engine/trainer.py: the loop through real ``engine-run`` runs on the CPU (gloo for two
processes): non-finite steps, recipes that own their steps, gradient clipping and the
before-optimizer-step hook, early stopping, schedulers on a metric; the class's size."""

from __future__ import annotations

import ast
import contextlib
import json
import math

import pytest
import torch

import engine
from engine.testing import fit
from engine.errors import ConfigError
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
    # The logged losses leave the skipped step out: the first window's (steps 1-2) and
    # the epoch's are the losses of the steps taken, not NaN.
    rows = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()]
    logged = [float(value) for _, _, name, value in rows[1:]
              if name in ("train/loss", "train/epoch_loss")]
    assert len(logged) == 5 and all(map(math.isfinite, logged)), logged
    assert math.isfinite(summary["train_epoch_loss"]) and "train loss nan" not in proc.stdout


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


def test_dict_batch_recipe_trains_and_resumes_exactly(tmp_path):
    proc = run_cli(DICT_BATCH, *RESUME, f"out_dir={tmp_path / 'ddp'}", "--nproc", "2",
                   check=True)
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 3 and all("val acc " in line and "val top2 " in line
                                   for line in lines), proc.stdout
    assert 0 <= read_summary(tmp_path / "ddp")["val_accuracy"] <= 1
    # Exact resume of the recipe's own step: one process is enough to show it (the
    # 2-process kill and resume is the regression recipe's, below).
    out = tmp_path / "reference"
    run_cli(DICT_BATCH, *RESUME, f"out_dir={out}", "--nproc", "1", check=True)
    assert kill_and_resume(DICT_BATCH, tmp_path, 1)["weights_sha256"] == (
        read_summary(out)["weights_sha256"])


# ------------------------------------------- gradient clipping, before_optimizer_step

TINY = str(REPO / "tests" / "recipes" / "tiny_parallel_recipe.py")
CLIP = 0.05  # well below the tiny model's gradient norms, so every step clips
#: 64 samples, global batch 8 in micro-batches of 8 / world / 2: full groups of 2.
CLIP_RUN = ("epochs=2", "batch_size=8", "grad_accum_steps=2", "train_size=64")


def hand_written_clipped(rank: int = 0, world_size: int = 1, clip: float | None = CLIP,
                         port: int = 0) -> str:
    """tiny_parallel_recipe trained by a plain loop with accumulation (2 micro-batches)
    and clip_grad_norm_ before each step, DDP when world_size > 1. The weights digest."""
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from engine.checkpoint import model_digest
    from engine.recipe import load_recipe

    recipe = load_recipe(TINY).module
    cfg = recipe.Config(epochs=2, batch_size=8, train_size=64)
    train_set, _ = recipe.build_datasets(cfg, None)
    if world_size > 1:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    torch.manual_seed(0)
    model = recipe.build_model(cfg)
    optimizer = recipe.build_optimizer(cfg, model)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=8 // world_size // 2, sampler=sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i, (inputs, targets) in enumerate(loader):
            last = i % 2 == 1
            sync = contextlib.nullcontext() if last or world_size == 1 else model.no_sync()
            with sync:
                (F.cross_entropy(model(inputs), targets) / 2).backward()
            if last:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    digest = model_digest(getattr(model, "module", model).state_dict())
    if world_size > 1:
        dist.destroy_process_group()
    return digest


#: One rank of the hand-written DDP loop: ``-c HAND_WRITTEN RANK PORT`` prints its digest.
HAND_WRITTEN = ("import sys\nfrom tests.engine.test_trainer import hand_written_clipped\n"
                "print(hand_written_clipped(int(sys.argv[1]), 2, port=int(sys.argv[2])))\n")


def test_grad_clip_norm_equals_a_hand_written_loop_with_accumulation(tmp_path):
    out = tmp_path / "run"
    run_cli(TINY, *CLIP_RUN, f"grad_clip_norm={CLIP}", f"out_dir={out}", "--nproc", "1",
            check=True)
    expected = hand_written_clipped()
    assert expected != hand_written_clipped(clip=None), "the test must clip something"
    assert read_summary(out)["weights_sha256"] == expected


# This module is also the probe plugin of the next test (``-p tests.engine.test_trainer``):
# every rank records, for each optimizer step, the step number the hook was given and
# the total norm of the gradients it saw, before the step and after it, and writes them
# to grad-probe-rank{R}.json and grad-after-rank{R}.json in the out_dir at the end.
# (``.item()`` every step: fine for a test, not for a logger.)
_grad_norms: list[tuple[int, float]] = []
_grad_norms_after: list[tuple[int, float | None]] = []


def _grad_norm(optimizer) -> float | None:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in grads])).item() if grads else None


@engine.hookimpl
def engine_before_optimizer_step(engine, step, optimizer):
    _grad_norms.append((step, _grad_norm(optimizer)))


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    _grad_norms_after.append((step, _grad_norm(ctx.optimizer)))


@engine.hookimpl
def engine_run_end(engine, summary):
    rank = engine.world.rank
    (engine.out_dir / f"grad-probe-rank{rank}.json").write_text(json.dumps(_grad_norms))
    (engine.out_dir / f"grad-after-rank{rank}.json").write_text(json.dumps(_grad_norms_after))


def test_grad_clip_norm_with_ddp_equals_a_hand_written_ddp_loop_and_the_hook_sees_it(
        tmp_path):
    from engine.launcher import free_port
    from engine.testing import start_python

    out = tmp_path / "run"
    run_cli(TINY, *CLIP_RUN, f"grad_clip_norm={CLIP}", f"out_dir={out}", "--nproc", "2",
            "--parallel", "ddp", "-p", "tests.engine.test_trainer", check=True)
    port = free_port()
    ranks = [start_python(["-c", HAND_WRITTEN, rank, port], cwd=REPO) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    digests = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert digests[0] == digests[1]
    assert read_summary(out)["weights_sha256"] == digests[0]
    # engine_before_optimizer_step saw every step's gradients, clipped.
    for rank in (0, 1):
        seen = json.loads((out / f"grad-probe-rank{rank}.json").read_text())
        assert [step for step, _ in seen] == list(range(1, 17))  # 8 steps x 2 epochs
        assert all(0 < norm <= CLIP * (1 + 1e-5) for _, norm in seen), seen
        # After the step (engine_train_step_end) the gradients are still there, the same
        # (they are freed before the next group's first backward, not after the step).
        assert json.loads((out / f"grad-after-rank{rank}.json").read_text()) == seen
    # DDP averaged the gradients before the hook: both ranks saw the same ones.
    assert (json.loads((out / "grad-probe-rank0.json").read_text())
            == json.loads((out / "grad-probe-rank1.json").read_text()))


def test_grad_clip_norm_must_be_positive(tmp_path):
    proc = run_cli(TINY, "grad_clip_norm=0", f"out_dir={tmp_path}", "--nproc", "1")
    assert proc.returncode != 0
    assert "config key 'grad_clip_norm': 0.0 must be > 0 (or none: no clipping)" in proc.stderr


# ------------------------------------------------------------------ early stopping

#: min_delta far above any change: epoch 1 sets the reference, later epochs never beat
#: it by that much, so with patience 2 the run stops after epoch 3 of 6.
EARLY = ("epochs=6", "early_stopping.metric=val/loss", "early_stopping.patience=2",
         "early_stopping.min_delta=1000")


def test_regression_recipe_stops_early_and_resumes_exactly(tmp_path):
    """The regression recipe (its own step and metrics) with early stopping, 2 processes:
    the run, the stop line, a rerun that knows it stopped, and a kill mid-run that
    resumes to the same weights with the early-stopping state intact."""
    out = tmp_path / "reference"
    proc = run_cli(REGRESSION, *RESUME, *EARLY, f"out_dir={out}", "--nproc", "2",
                   check=True)
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 3 and all("val mae " in line for line in lines), proc.stdout
    assert "val acc" not in proc.stdout
    reference = read_summary(out)
    assert (reference["status"], reference["epochs_completed"]) == ("completed", 3)
    assert "val_accuracy" not in reference and math.isfinite(reference["val_loss"])
    assert reference["val_mae"] == reference["metrics"]["val/mae"]
    val_losses = [float(line.split("val loss ")[1].split()[0]) for line in lines]
    (stop_line,) = [line for line in proc.stdout.splitlines()
                    if line.startswith("early stopping: ")]
    # What it compares: epoch 1's loss, by more than min_delta; the best is the lowest
    # (the best snapshot's), whichever epoch reached it.
    assert stop_line.startswith("early stopping: val/loss did not improve by more than 1000 "
                                "on "), stop_line
    assert float(stop_line.split(" on ")[1].split()[0]) == pytest.approx(val_losses[0],
                                                                         rel=1e-3)
    assert " for 2 epochs; best " in stop_line
    assert stop_line.endswith(f" at epoch {val_losses.index(min(val_losses)) + 1}")
    assert float(stop_line.split("best ")[1].split()[0]) == pytest.approx(min(val_losses),
                                                                          rel=1e-3)

    again = run_cli(REGRESSION, *RESUME, *EARLY, f"out_dir={out}", "--nproc", "2",
                    check=True)
    assert "this run already stopped early after epoch 3" in again.stdout
    assert read_summary(out)["epochs_completed"] == 3

    resumed = kill_and_resume(REGRESSION, tmp_path, 2, *EARLY)
    assert resumed["epochs_completed"] == 3
    assert resumed["weights_sha256"] == reference["weights_sha256"]


def test_a_snapshot_without_the_early_stopping_state_still_loads(tmp_path):
    out = tmp_path / "run"
    run_cli(REGRESSION, "epochs=1", f"out_dir={out}", "--nproc", "1", check=True)
    (path,) = (out / "checkpoints").glob("snapshot-*.pt")
    snap = torch.load(path, weights_only=True)
    # The flat layout of snapshots written before state parts, and before TrainState
    # grew the early-stopping fields (no train_state at all).
    old_layout = {key: snap[key] for key in (
        "engine_version", "config", "world_size", "epoch", "step", "batch_in_epoch",
        "epochs_completed", "model", "optimizer", "metrics")}
    old_layout.update(scheduler=None, scaler=None, sampler_seed=0,
                      samples_in_epoch=snap["loader"]["samples_in_epoch"],
                      epoch_loss=snap["progress"]["epoch_loss"], rng=snap["rng"]["ranks"])
    old = tmp_path / "old.pt"
    torch.save(old_layout, old)
    proc = run_cli(REGRESSION, "epochs=2", f"out_dir={tmp_path / 'again'}", "--nproc", "1",
                   "--resume", str(old), check=True)
    assert f"resuming from {old}: the end of epoch 1, step 8" in proc.stdout
    assert read_summary(tmp_path / "again")["epochs_completed"] == 2


@pytest.mark.parametrize("override, message", [
    ("early_stopping.metric=val/acc", "config key 'early_stopping.metric': 'val/acc' is not "
     "a metric this run logs at an epoch's end; it logs: val/loss, val/mae, train/epoch_loss, "
     "train/epoch_samples_per_sec, train/data_wait_fraction, lr"),
    ("early_stopping.metric=train/loss", "config key 'early_stopping.metric': 'train/loss' "
     "is the mean of one log window, not of an epoch; use train/epoch_loss"),
    ("early_stopping.mode=lowest", "config key 'early_stopping.mode': 'lowest' is not one "
     "of: auto, min, max"),
    ("early_stopping.patience=0", "config key 'early_stopping.patience': 0 must be >= 1"),
])
def test_bad_early_stopping_config_is_one_line_naming_the_key(tmp_path, override, message):
    proc = run_cli(REGRESSION, "epochs=2", override, f"out_dir={tmp_path}", "--nproc", "1")
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------- named metrics

def test_the_best_snapshot_by_val_loss_is_the_lowest_loss_epoch(reference, tmp_path):
    """checkpoint.best_metric=val/loss without best_mode keeps the lowest (the name says
    lower is better), early stopping on it names the same epoch, and the validation
    batch that checked the names before training changed nothing: 2 processes, the
    weights of the same run with no metric named (dropout, random augmentation)."""
    from engine.checkpoint import read_manifest
    from engine.plugins.csv_logger import read_rows
    from tests.engine.conftest import RESUME_BASE, RESUME_RECIPE

    out = tmp_path / "run"
    run_cli(RESUME_RECIPE, *RESUME_BASE, "checkpoint.best_metric=val/loss",
            "early_stopping.metric=val/loss", "early_stopping.patience=3",
            "early_stopping.min_delta=1000", f"out_dir={out}", "--nproc", "2", check=True)
    summary = read_summary(out)
    losses = {epoch: value for _, epoch, name, value in read_rows(out / "metrics.csv")
              if name == "val/loss"}
    assert sorted(losses) == [1, 2, 3] and len(set(losses.values())) == 3, losses
    lowest = min(losses, key=losses.get)
    best = read_manifest(out / summary["best_checkpoint"])
    assert (best["epoch"], best["metrics"]["val/loss"]) == (lowest, losses[lowest]), (
        best, losses)
    progress = torch.load(out / summary["final_checkpoint"], weights_only=True)["progress"]
    assert progress["best_epoch"] == lowest and progress["best_metric"] == losses[lowest]
    assert progress["epochs_without_improvement"] == 2  # min_delta: none beat epoch 1's
    assert summary["weights_sha256"] == reference[2]


@pytest.mark.parametrize("key, nproc", [("checkpoint.best_metric", 2),
                                        ("early_stopping.metric", 1)])
def test_a_metric_the_run_does_not_log_is_refused_before_the_first_step(tmp_path, key,
                                                                        nproc):
    """val/acc (the run logs val/accuracy): one line listing what it logs, on every
    rank alike, before any step (nothing logged, no snapshot)."""
    out = tmp_path / "run"
    proc = run_cli(TINY, "epochs=2", f"{key}=val/acc", f"out_dir={out}", "--nproc",
                   str(nproc))
    assert proc.returncode == 2, proc.stderr
    at = " at an epoch's end" if key == "early_stopping.metric" else ""
    logs = ("val/loss, val/accuracy, train/epoch_loss, train/epoch_samples_per_sec, "
            "train/data_wait_fraction, "
            + ("" if at else "train/samples_per_sec, ") + "lr")
    line = (f"error: config key '{key}': 'val/acc' is not a metric this run logs{at} (did "
            f"you mean 'val/accuracy'?); it logs: {logs}")
    # Every rank refuses alike; the launcher prints it once (issue 35 point 4).
    assert proc.stderr.count(line) == 1 and proc.stderr.strip().endswith(line), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.csv").exists() and not (out / "checkpoints").exists()
    assert not epoch_lines(proc.stdout)


def test_a_train_step_extra_named_is_checked_at_the_first_micro_batch(tmp_path):
    """Which names train_step returns beside the loss is known at its first call: a
    name that is one of them passes (best_metric), one that is not stops the run there,
    before the first optimizer step."""
    recipe = tmp_path / "extras.py"
    recipe.write_text("from torch.nn import functional as F\n"
                      "from tests.recipes.tiny_regression import *  # noqa\n"
                      "from tests.recipes.tiny_regression import Config  # noqa\n\n"
                      "def train_step(batch, ctx):\n    inputs, targets = batch\n"
                      "    outputs = ctx.model(inputs)\n"
                      "    return {'loss': F.mse_loss(outputs, targets),\n"
                      "            'mae': (outputs - targets).abs().mean()}\n")
    out = tmp_path / "run"
    proc = run_cli(str(recipe), "epochs=1", "checkpoint.best_metric=train/epoch_mae",
                   "early_stopping.metric=train/epoch_mse", f"out_dir={out}", "--nproc", "1")
    assert proc.returncode == 2, proc.stderr
    assert ("error: config key 'early_stopping.metric': 'train/epoch_mse' is not a metric "
            "this run logs at an epoch's end (did you mean 'train/epoch_mae'?); it logs: "
            "val/loss, val/mae, train/epoch_loss, train/epoch_mae, "
            "train/epoch_samples_per_sec, train/data_wait_fraction, lr") in proc.stderr, (
        proc.stderr)
    assert ",train/" not in (out / "metrics.csv").read_text()


# ------------------------------------------------- a scheduler that steps on a metric

#: A recipe whose build_scheduler returns torch's ReduceLROnPlateau; lr 1e-6 learns next
#: to nothing, so val/loss improves by less than 1% (its threshold) after epoch 1 and,
#: with patience 0, each later epoch halves the learning rate.
PLATEAU = """
import attrs
import torch

from tests.recipes.tiny_regression import *  # noqa
from tests.recipes.tiny_regression import Config as Regression


@attrs.define
class Config(Regression):
    lr: float = 1e-6
    plateau_mode: str = "min"


def build_scheduler(cfg, optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=cfg.plateau_mode, factor=0.5, patience=0, threshold=0.01)
"""


@pytest.fixture
def plateau_recipe(tmp_path) -> str:
    path = tmp_path / "plateau.py"
    path.write_text(PLATEAU)
    return str(path)


def test_reduce_lr_on_plateau_steps_on_the_named_metric_and_resumes_exactly(
        plateau_recipe, tmp_path):
    """2 processes: the plateau halves the lr after epochs 2 and 3 (it crashed after
    epoch 1: step() missing 'metrics'); resumed for a 4th epoch, the scheduler goes on
    from its saved state (its best is still epoch 1's loss: a new one would take epoch
    4's as its first best and keep the lr)."""
    from engine.plugins.csv_logger import read_rows

    out = tmp_path / "run"
    proc = run_cli(plateau_recipe, "epochs=3", "scheduler_metric=val/loss",
                   f"out_dir={out}", "--nproc", "2", check=True)
    rows = read_rows(out / "metrics.csv")
    lrs = {epoch: value for _, epoch, name, value in rows if name == "lr"}
    assert lrs == {1: 1e-6, 2: 1e-6, 3: 5e-7}  # the lr each epoch trained with
    # Each reduction is one line, once (rank 0), after its epoch's line.
    said = [line for line in proc.stdout.splitlines() if "ReduceLROnPlateau" in line]
    assert said == ["lr 1e-06 -> 5e-07: val/loss stopped improving (ReduceLROnPlateau)",
                    "lr 5e-07 -> 2.5e-07: val/loss stopped improving (ReduceLROnPlateau)"]
    first_loss = next(value for _, epoch, name, value in rows if name == "val/loss")
    summary = fit(plateau_recipe, nproc=1, out_dir=str(out), epochs=4,
                  scheduler_metric="val/loss")
    assert summary["resumed_from"] and summary["epochs_completed"] == 4
    saved = torch.load(out / summary["final_checkpoint"], weights_only=True)["scheduler"]
    assert saved["best"] == pytest.approx(first_loss, rel=1e-6)
    assert saved["_last_lr"] == [pytest.approx(1.25e-7)]


def test_a_plateau_scheduler_without_a_metric_is_refused_before_training(plateau_recipe,
                                                                         tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        fit(plateau_recipe, nproc=1, out_dir=str(out), epochs=2)
    assert str(info.value) == (
        "the recipe's build_scheduler returned a ReduceLROnPlateau, which steps on a "
        "metric: name it with scheduler_metric=NAME (a metric of the epoch, e.g. val/loss)")
    assert not (out / "metrics.csv").exists() and not (out / "checkpoints").exists()
    # The name is checked as the other named metrics are, before the scheduler.
    with pytest.raises(ConfigError, match=r"^config key 'scheduler_metric': 'val/los' is not "
                                          r"a metric this run logs at an epoch's end \(did "
                                          r"you mean 'val/loss'\?\); it logs: val/loss, "):
        fit(plateau_recipe, nproc=1, out_dir=str(out), epochs=2,
            scheduler_metric="val/los")


def plateau(mode="min"):
    model = torch.nn.Linear(1, 1)
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD(model.parameters(), lr=0.1), mode=mode)


@pytest.mark.parametrize("scheduler, overrides, message", [
    (plateau("max"), ["scheduler_metric=val/loss"], "config key 'scheduler_metric': lower "
     "is better for 'val/loss' (read from the name), but the recipe's ReduceLROnPlateau "
     "has mode='max'; build it with mode='min'"),
    (plateau("min"), ["scheduler_metric=val/f1"], "config key 'scheduler_metric': higher "
     "is better for 'val/f1' (read from the name), but the recipe's ReduceLROnPlateau has "
     "mode='min'; build it with mode='max'"),
    # A name that says neither: the best snapshot's explicit mode on the same metric.
    (plateau("min"), ["scheduler_metric=val/score", "checkpoint.best_metric=val/score",
                      "checkpoint.best_mode=max"], "config key 'scheduler_metric': higher is "
     "better for 'val/score' (as checkpoint.best_mode says), but the recipe's "
     "ReduceLROnPlateau has mode='min'; build it with mode='max'"),
    (plateau(), ["scheduler_metric=val/loss", "scheduler_interval=step"], "config key "
     "'scheduler_interval': 'step' does not fit a ReduceLROnPlateau, which steps on "
     "val/loss after each validation; use scheduler_interval=epoch"),
    (None, ["scheduler_metric=val/loss"], "config key 'scheduler_metric': 'val/loss' is for "
     "a scheduler that steps on a metric (ReduceLROnPlateau), and the recipe has no "
     "build_scheduler; leave scheduler_metric empty"),
    (torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), 1),
     ["scheduler_metric=val/loss"], "config key 'scheduler_metric': 'val/loss' is for a "
     "scheduler that steps on a metric (ReduceLROnPlateau), and the recipe's "
     "build_scheduler returned a StepLR; leave scheduler_metric empty"),
])
def test_a_scheduler_and_its_metric_that_disagree_are_one_line(scheduler, overrides,
                                                               message):
    from engine.config import TrainConfig
    from engine.overrides import apply_overrides
    from engine.trainer import scheduler_metric

    cfg = apply_overrides(TrainConfig(), overrides)
    with pytest.raises(ConfigError) as info:
        scheduler_metric(scheduler, cfg)
    assert str(info.value) == message


def test_a_scheduler_steps_on_the_metric_its_name_or_its_own_mode_agrees_with():
    from engine.config import TrainConfig
    from engine.overrides import apply_overrides
    from engine.snapshot import steps_on_metric
    from engine.trainer import scheduler_metric

    def cfg(*overrides):
        return apply_overrides(TrainConfig(), list(overrides))

    assert scheduler_metric(plateau("min"), cfg("scheduler_metric=val/loss")) == "val/loss"
    # The name says neither and nothing else names it: the scheduler's own mode decides.
    assert scheduler_metric(plateau("max"), cfg("scheduler_metric=val/score")) == "val/score"
    assert scheduler_metric(None, cfg()) is None
    step_lr = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), 1)
    assert not steps_on_metric(step_lr)

    class OnMetric:  # a scheduler of one's own whose step needs the value
        def step(self, value, epoch=None):
            pass

    assert steps_on_metric(OnMetric())


def test_the_trainer_class_only_trains():
    """The Trainer is the loop, read top to bottom: the step (engine/step.py), the check
    points (engine/check_point.py), validation (engine/validation.py) and the checks of
    the metrics a config names (engine/metrics.py) live in their modules. Its size and
    what it asks of the snapshot layer, printed for the record (pytest -s)."""
    tree = ast.parse((REPO / "engine" / "trainer.py").read_text())
    (trainer,) = [node for node in tree.body
                  if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    size = trainer.end_lineno - trainer.lineno + 1
    asked = sorted({node.attr for node in ast.walk(trainer) if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "snapshots"})
    print(f"\nthe Trainer class: {size} lines; the snapshot layer: {', '.join(asked)}")
    assert size <= 450, size
    # Each step's end (an integer compare where none is due), the epoch's end, the loop's
    # own; the memory tier notes each step reached itself (an optimizer step hook).
    assert asked == ["due_at_epoch_end", "save", "step_ended"]


@pytest.mark.parametrize("step, shape", [
    ("return F.mse_loss(ctx.model(inputs), targets, reduction='none')", "a tensor of shape (8, 1)"),
    ("return 0.5", "a float"),
])
def test_a_train_step_that_returns_no_scalar_loss_is_one_line(tmp_path, step, shape):
    recipe = tmp_path / "bad_step.py"
    recipe.write_text("from torch.nn import functional as F\n"
                      "from tests.recipes.tiny_regression import *  # noqa\n"
                      "from tests.recipes.tiny_regression import Config  # noqa\n\n"
                      f"def train_step(batch, ctx):\n    inputs, targets = batch\n    {step}\n")
    proc = run_cli(str(recipe), "epochs=1", f"out_dir={tmp_path / 'run'}", "--nproc", "1")
    assert proc.returncode == 2
    assert ("error: train_step must return the micro-batch's loss as a scalar tensor (shape "
            f"()), not {shape}; reduce it, e.g. with .mean()") in proc.stderr, proc.stderr
