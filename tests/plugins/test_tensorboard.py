"""The TensorBoard logger: event files with the expected tags, steps and values, written
by rank 0 only, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import math
import socket
import time

import pytest

from engine.plugins.tensorboard import TensorBoardLogger
from engine.testing import TINY_RECIPE
from engine.testing import make_engine, make_plugin_manager, tiny_recipe  # noqa: F401
from tests.conftest import QUICK, read_summary, run_cli


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_each_metric_of_a_log_call_is_its_own_scalar_at_the_step(make_engine):
    eng, logger = make_engine(), TensorBoardLogger()
    logger.engine_run_start(ctx=eng)
    logger.engine_log(ctx=eng, metrics={"train/loss": 0.5, "lr": 0.1, "x": None}, step=4)
    logger.engine_log(ctx=eng, metrics={"train/loss": math.nan, "val/acc": 0.75}, step=8)
    logger.engine_log(ctx=eng, metrics={"x": None}, step=9)  # nothing to write
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    found = scalars(eng.out_dir / "tensorboard")
    assert set(found) == {"train/loss", "lr", "val/acc"}
    assert found["lr"] == [(4, pytest.approx(0.1))] and found["val/acc"] == [(8, 0.75)]
    assert found["train/loss"][0] == (4, 0.5) and found["train/loss"][1][0] == 8
    assert math.isnan(found["train/loss"][1][1])


def test_a_resumed_runs_event_file_sorts_after_one_begun_in_the_same_second(
        make_engine, monkeypatch):
    # TensorBoard reads event files in name order (seconds, host, pid as text); a resumed
    # run's file must come after the interrupted run's, or its purge_step applies to the
    # old points' past and the curves fold back. The clock stands still but for sleeps:
    # the resumed run begins in the old file's second however loaded the machine is (a
    # real second ticking over would pass the test without the wait).
    clock = [int(time.time()) + 0.25]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    eng, logger = make_engine(), TensorBoardLogger()
    folder = eng.out_dir / "tensorboard"
    folder.mkdir(parents=True)
    old = folder / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.99999999.0"
    old.write_bytes(b"")
    eng.state.step = 8  # resumed from step 8
    logger.engine_run_start(ctx=eng)
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    names = sorted(p.name for p in folder.glob("events.out.tfevents.*"))
    assert len(names) == 2 and names[0] == old.name


def test_rank0_writes_the_run_metrics_as_scalars(cifar_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(cifar_recipe, *QUICK, f"out_dir={out}", "--nproc", "2", check=True)
    # One writer: rank 0's.
    assert len(list(out.glob("**/events.out.tfevents.*"))) == 1
    found, summary = scalars(out / "tensorboard"), read_summary(out)
    assert {"train/loss", "train/samples_per_sec", "lr", "val/loss", "val/accuracy"} <= set(
        found)
    # 512 samples, global batch 64: 8 steps; a point every 4 (log_every), the epoch's mean
    # under its own name.
    assert [step for step, _ in found["train/loss"]] == [4, 8]
    assert [step for step, _ in found["train/epoch_loss"]] == [8]
    # One meaning per name: the windows' throughput, and the epoch's under its own name.
    assert [step for step, _ in found["train/samples_per_sec"]] == [4, 8]
    assert [step for step, _ in found["train/epoch_samples_per_sec"]] == [8]
    assert found["train/epoch_samples_per_sec"][0][1] == pytest.approx(
        summary["samples_per_sec"], rel=1e-6)
    assert found["epoch"] == [(8, 1.0)]  # epoch 1 ended at step 8
    assert [step for step, _ in found["val/accuracy"]] == [8]
    assert found["val/accuracy"][0][1] == pytest.approx(summary["val_accuracy"], abs=1e-6)
    assert found["train/loss"][-1][1] == pytest.approx(summary["train_loss"], rel=1e-6)
    assert found["train/epoch_loss"][-1][1] == pytest.approx(summary["train_epoch_loss"],
                                                             rel=1e-6)
    assert found["lr"][0][1] == pytest.approx(0.001)


def test_a_resumed_run_replaces_the_points_after_its_snapshot(tmp_path):
    recipe = tmp_path / "tiny.py"
    recipe.write_text(TINY_RECIPE)
    out = tmp_path / "run"
    run_cli(str(recipe), "epochs=2", "log_every=4", f"out_dir={out}", "--nproc", "1",
            check=True)
    first = scalars(out / "tensorboard")["train/loss"]
    assert [step for step, _ in first] == [4, 8, 12, 16]

    # Go back to the end of epoch 1 (step 8), as after a crash in epoch 2, with another
    # data order (seed, hence --resume-anyway) so that the new points differ from the old.
    snapshot = next((out / "checkpoints").glob("snapshot-e0001-s00000008.pt"))
    run_cli(str(recipe), "epochs=2", "log_every=4", "seed=1", f"out_dir={out}",
            "--resume", str(snapshot), "--resume-anyway", "--nproc", "1", check=True)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    second = scalars(out / "tensorboard")["train/loss"]
    assert [step for step, _ in second] == [4, 8, 12, 16]
    assert second[:2] == first[:2]
    assert all(new != old for new, old in zip(second[2:], first[2:]))
