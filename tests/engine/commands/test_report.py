"""``engine-run report RUN_DIR``: a real PNG of the curves, from metrics.csv or from the
TensorBoard event files (runs made before the csv logger), a resumed run's points
replacing the interrupted run's, and one-line errors. The scalars are written with the
real writers (TensorBoard's SummaryWriter, the csv logger's format); one test reports on
a real finished run, and lists it with ``engine-run runs``."""

from __future__ import annotations

import sys

import pytest

from engine.commands.report import Curves, read_scalars
from engine.testing import tiny_recipe  # noqa: F401 (a fixture)
from tests.conftest import read_summary, run_cli, run_cli_here

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check_png(path) -> None:
    """A PNG a person can look at: the right magic, a real size, more than one colour."""
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 20_000, len(data)  # curves, text and axes; a blank PNG is ~2 KB
    image = matplotlib.image.imread(path)
    height, width, channels = image.shape
    assert height >= 400 and width >= 600 and channels in (3, 4)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def log_epoch(writer, epoch: int, steps_per_epoch: int = 4, log_every: int = 2,
              loss0: float = 2.0) -> None:
    """What the trainer logged for one epoch before train/epoch_loss (an old run): a
    train/loss every ``log_every`` steps, then the epoch's metrics (its mean as
    train/loss too, val/*) at the epoch's last step."""
    first = epoch * steps_per_epoch
    for step in range(first + log_every, first + steps_per_epoch + 1, log_every):
        writer.add_scalar("train/loss", loss0 / step, step)
        writer.add_scalar("lr", 0.1, step)
    end = first + steps_per_epoch
    for name, value in {"train/loss": loss0 / (end - 1), "val/loss": 1.5 / (epoch + 1),
                        "val/accuracy": 0.3 + 0.2 * epoch}.items():
        writer.add_scalar(name, value, end)


def test_report_from_tensorboard_events_of_a_resumed_run(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    writer = SummaryWriter(log_dir=str(run / "tensorboard"))
    for epoch in range(2):
        log_epoch(writer, epoch)
    writer.add_scalar("train/loss", 99.0, 10)  # epoch 3 under way, then killed
    writer.close()
    # Resumed from the snapshot at step 8 (the end of epoch 2): the plugin's purge_step.
    writer = SummaryWriter(log_dir=str(run / "tensorboard"), purge_step=9)
    log_epoch(writer, 2)
    writer.close()

    series, source = read_scalars(run)
    assert source == str(run / "tensorboard")
    curves = Curves.from_series(series)
    steps, losses = curves.by_step["train/loss"]
    assert steps == [2, 4, 6, 8, 10, 12]
    assert 99.0 not in losses  # the killed run's point after the snapshot is gone
    assert losses[1] == pytest.approx(2.0 / 4)  # the window's loss, not the epoch mean
    assert curves.by_epoch["val/loss"] == ([1, 2, 3], pytest.approx([1.5, 0.75, 0.5]))
    assert curves.by_epoch["train/epoch_loss"] == (
        [1, 2, 3], pytest.approx([2.0 / 3, 2.0 / 7, 2.0 / 11]))
    assert sorted(curves.by_epoch) == ["train/epoch_loss", "val/accuracy", "val/loss"]

    proc = run_cli_here("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"wrote {run / 'report.png'} (train/loss, lr by step; "
                           "train/epoch_loss, val/accuracy, val/loss by epoch; from "
                           f"{run / 'tensorboard'})\n")
    check_png(run / "report.png")


def test_metrics_csv_is_preferred_and_a_restart_replaces_points(tmp_path):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    # The csv logger's format: one row per metric, the epoch (from 0) the row belongs to.
    rows = ["step,epoch,name,value",
            "2,0,train/loss,1.0", "2,0,lr,0.1", "4,0,train/loss,0.8",
            "4,0,train/loss,0.9", "4,0,val/loss,0.7", "4,0,val/f1,0.5",
            "6,1,train/loss,5.0", "8,1,train/loss,4.0",  # killed, then resumed from step 4
            "6,1,train/loss,0.6", "8,1,train/loss,0.5",  # by a writer that only appends
            "8,1,train/loss,0.55", "8,1,val/loss,0.4", "8,1,val/f1,0.6",
            "8,1,val/acc"]  # the last line cut short by a kill
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    series, source = read_scalars(run)
    assert source == str(run / "metrics.csv")
    curves = Curves.from_series(series)
    assert curves.by_step["train/loss"] == ([2, 4, 6, 8], [1.0, 0.8, 0.6, 0.5])
    assert curves.by_epoch == {"val/f1": ([1, 2], [0.5, 0.6]), "val/loss": ([1, 2], [0.7, 0.4]),
                               "train/epoch_loss": ([1, 2], [0.9, 0.55])}
    out = tmp_path / "plots" / "curves.png"
    out.parent.mkdir()
    proc = run_cli_here("report", str(run), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out} (") and f"from {run / 'metrics.csv'}" in (
        proc.stdout)
    check_png(out)
    assert not (run / "report.png").exists()


def test_bad_input_is_one_line_with_exit_2(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    (empty / "tensorboard").mkdir(parents=True)
    no_columns = tmp_path / "no_columns"
    no_columns.mkdir()
    (no_columns / "metrics.csv").write_text("step,metric,value\n1,train/loss,0.5\n")
    only_lr = tmp_path / "only_header"
    only_lr.mkdir()
    (only_lr / "metrics.csv").write_text("step,epoch,name,value\n1,0,world_size,1\n")
    cases = {
        (str(tmp_path / "nope"),): f"report: {tmp_path / 'nope'} does not exist; give a "
                                   "run's out_dir",
        (str(empty),): f"report: no metrics in {empty}: neither metrics.csv nor "
                       f"TensorBoard event files in {empty / 'tensorboard'}",
        (str(no_columns),): f"{no_columns / 'metrics.csv'} is not a metrics file: it lacks "
                            "the column(s) epoch, name",
        (str(only_lr),): f"{only_lr / 'metrics.csv'} holds no metric to plot; logged: "
                         "world_size",
        (str(only_lr), "-o", str(tmp_path / "no" / "r.png")):
            f"cannot write {tmp_path / 'no' / 'r.png'}: the folder {tmp_path / 'no'} "
            "does not exist",
    }
    for args, message in cases.items():
        proc = run_cli_here("report", *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert proc.stderr.startswith("engine-run: error: ") and message in proc.stderr, (
            args, proc.stderr)
        assert proc.stderr.count("\n") == 1, proc.stderr
    # Without matplotlib (the optional extra): how to install it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    proc = run_cli_here("report", str(only_lr))
    assert proc.returncode == 2
    assert proc.stderr == ("engine-run: error: report needs matplotlib, which is not "
                           'installed; install it with pip install -e ".[report]"\n')


def panel_titles(curves) -> list[str]:
    return [title for title, _, _ in curves.panels()]


def test_a_real_run_and_its_resume_with_more_processes_are_listed_and_reported(
        tiny_recipe, tmp_path):  # noqa: F811
    """The main job's shape: the epoch's end (step 8, 16) is no check point (log_every=3),
    so the epoch mean once ended the window curve with a jump. Then resumed with 2
    processes for a third epoch: the report marks where, and from how many."""
    run = tmp_path / "runs" / "tiny" / "version_0"
    run_cli(str(tiny_recipe), "epochs=2", "log_every=3", f"out_dir={run}", "--nproc", "1",
            check=True)
    summary = read_summary(run)

    listed = run_cli_here("runs", str(tmp_path / "runs"))
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["RUN", "STATUS", "EPOCHS", "VAL/ACCURACY", "VAL/LOSS",
                              "THROUGHPUT", "WALL", "DIGEST"]
    assert row.split() == [str(run), "completed", "2/2",
                           f"{summary['val_accuracy']:.4f}", f"{summary['val_loss']:.4f}",
                           f"{summary['samples_per_sec']:.0f}", "samples/s",
                           f"{summary['wall_time_s']:.1f}s", summary["weights_sha256"][:12]]

    reported = run_cli_here("report", str(run))
    assert reported.returncode == 0, reported.stderr
    assert "train/loss, lr, train/epoch_samples_per_sec, train/samples_per_sec by step; " \
        "train/data_wait_fraction, " \
        "train/epoch_loss, val/accuracy, val/loss by epoch; from" in reported.stdout
    check_png(run / "report.png")
    curves = check_panels(run)
    assert curves.by_step["train/loss"][0] == [3, 6, 9, 12, 15]
    assert curves.resumes == []

    run_cli(str(tiny_recipe), "epochs=3", "log_every=3", f"out_dir={run}", "--nproc", "2",
            check=True)
    reported = run_cli_here("report", str(run))
    assert reported.returncode == 0, reported.stderr
    assert "; resumed at step 16: 1 -> 2 processes; from" in reported.stdout
    check_png(run / "report.png")
    curves = check_panels(run)
    assert curves.by_step["train/loss"][0] == [3, 6, 9, 12, 15, 18, 21, 24]
    assert curves.resumes == [(16, 1, 2)]
    assert curves.by_epoch["train/epoch_loss"][0] == [1, 2, 3]


def check_panels(run):
    """The panels of a trainer's run, and no point of the window-loss curve (or the
    throughput's) that is an epoch's value; the epochs' throughput in the throughput
    panel, at the steps the epochs ended."""
    series, _ = read_scalars(run)
    curves = Curves.from_series(series)
    assert panel_titles(curves) == [
        "training loss (train/loss: mean of each log window)", "loss by epoch",
        "learning rate", "throughput", "train/data_wait_fraction", "val/accuracy"]
    window = set(zip(*curves.by_step["train/loss"]))
    assert window == set(series["train/loss"])
    assert not window & set(series["train/epoch_loss"])
    epochs_ends = {step for step, _ in series["train/epoch_loss"]}
    throughput = set(zip(*curves.by_step["train/samples_per_sec"]))
    assert throughput and all(step % 3 == 0 for step, _ in throughput), (throughput,
                                                                          epochs_ends)
    assert set(zip(*curves.by_step["train/epoch_samples_per_sec"])) == set(
        series["train/epoch_samples_per_sec"])
    assert {step for step, _ in series["train/epoch_samples_per_sec"]} == epochs_ends
    return curves


def test_a_custom_loop_logging_its_own_names_gets_its_plots(tmp_path_factory):
    """A loop on engine.launch that logs train/mse and val/mse, no train/loss (the one
    SIGKILLed in its fourth epoch): its curves, not a refusal."""
    from tests.plugins.killed_runs import killed_custom_loop

    run = killed_custom_loop(tmp_path_factory)
    curves = Curves.from_series(read_scalars(run)[0])
    assert curves.by_step["train/mse"][0] == list(range(1, 13))
    assert curves.by_epoch["val/mse"][0] == [1, 2, 3]
    assert panel_titles(curves) == ["train/mse", "val/mse"]
    out = tmp_path_factory.mktemp("report") / "loop.png"
    reported = run_cli_here("report", str(run), "-o", str(out))
    assert reported.returncode == 0, reported.stderr
    assert "(train/mse by step; val/mse by epoch; from" in reported.stdout
    check_png(out)


def test_an_old_run_whose_epoch_end_was_no_check_point_has_no_jump(tmp_path):
    """Before train/epoch_loss, the epoch's mean was logged as train/loss too: at an
    epoch end that is no check point it was the step's only train/loss, and the window
    curve ended on it (the main job's 0.26 at step 300, then 1.22 at step 314)."""
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.csv").write_text("\n".join([
        "step,epoch,name,value", "3,0,train/loss,0.9", "6,0,train/loss,0.3",
        "8,0,train/loss,1.2", "8,0,val/loss,0.5", "11,1,train/loss,0.2",
        "14,1,train/loss,0.1", "16,1,train/loss,0.4", "16,1,val/loss,0.3"]) + "\n")
    curves = Curves.from_series(read_scalars(run)[0])
    assert curves.by_step["train/loss"] == ([3, 6, 11, 14], [0.9, 0.3, 0.2, 0.1])
    assert curves.by_epoch["train/epoch_loss"] == ([1, 2], [1.2, 0.4])


def test_validations_inside_epochs_are_drawn_by_step_not_as_epochs(tmp_path):
    """val_every_steps=2 in epochs of 8 steps: val/* at steps 2, 4, ... 16 is a curve by
    step; the epochs are those of train/epoch_loss (it once drew 8 epochs for 2)."""
    run = tmp_path / "run"
    run_cli("tests/recipes/tiny_regression.py", "epochs=2", "val_every_steps=2",
            f"out_dir={run}", "--nproc", "1", check=True)
    curves = Curves.from_series(read_scalars(run)[0])
    assert curves.by_epoch["train/epoch_loss"][0] == [1, 2]
    assert curves.by_step["val/loss"][0] == list(range(2, 17, 2))
    assert "val/loss" not in curves.by_epoch
