"""One real run (two CPU processes, two epochs of the tiny recipe) with the four
loggers of this repository on: the built-in ``csv``, ``tensorboard`` and ``console``, and
``mlflow`` (a local file store) and ``wandb`` (offline), which the entry points of
ddp-engine itself load, as they would a third-party plugin. Each logger's file or store
is read back with its own reader: the csv module, TensorBoard's, MLflow's client, the
records of W&B's ``.wandb`` file. Every one of them names the window's loss train/loss and
the epoch's mean train/epoch_loss, and numbers the epochs alike (docs/outputs.md: metric names)."""

from __future__ import annotations

import csv
import json

import pytest

from engine.testing import TINY_RECIPE
from tests.conftest import engine_env, read_summary, run_cli
from tests.plugins.test_wandb_logger import records


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loggers")
    recipe = tmp / "tiny.py"
    recipe.write_text(TINY_RECIPE)
    out, uri, probe = tmp / "run", (tmp / "mlruns").as_uri(), tmp / "epochs.jsonl"
    proc = run_cli(str(recipe), "epochs=2", "log_every=4", f"out_dir={out}", "--nproc", "2",
                   "mlflow.enabled=true", f"mlflow.tracking_uri={uri}",
                   "mlflow.experiment=e2e", "wandb.enabled=true", "wandb.mode=offline",
                   "wandb.project=e2e", "-p", "tests.plugins.epoch_probe",
                   # MLflow 3 refuses its file store unless asked; W&B: no network.
                   env=engine_env(MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true",
                                  ENGINE_EPOCH_PROBE=str(probe)),
                   check=True)
    hooks = [json.loads(line) for line in probe.read_text().splitlines()]
    return out, uri, read_summary(out), proc.stdout, hooks


#: (step, epoch) of the train/loss points: 8 steps per epoch, a point every 4 (log_every);
#: only rank 0 logs. Epochs counted from 1, as the console counts them.
LOSS_POINTS = [(4, 1), (8, 1), (12, 2), (16, 2)]
#: (step, epoch) of the epoch's mean, train/epoch_loss, logged after validation.
EPOCH_LOSS_POINTS = [(8, 1), (16, 2)]


def csv_rows(out) -> list[tuple[int, int, str, float]]:
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "epoch", "name", "value"]
    return [(int(s), int(e), name, float(v)) for s, e, name, v in rows[1:]]


def test_csv(run):
    out, _, summary, *_ = run
    rows = csv_rows(out)
    assert [(s, e) for s, e, name, _ in rows if name == "train/loss"] == LOSS_POINTS
    assert [(s, e) for s, e, name, _ in rows if name == "train/epoch_loss"] == \
        EPOCH_LOSS_POINTS
    val = [(s, e, v) for s, e, name, v in rows if name == "val/accuracy"]
    assert val[0][:2] == (8, 1) and val[1][:2] == (16, 2)
    assert val[-1][2] == summary["val_accuracy"]
    assert {name for _, _, name, _ in rows[1:]} >= {"lr", "train/samples_per_sec", "val/loss"}


def test_one_name_one_meaning_in_summary_console_and_tensorboard(run):
    """train/loss is a window's mean, train/epoch_loss the epoch's: summary.json's
    train_loss is the last window's, train_epoch_loss the last epoch's, the console's
    epoch line shows the epoch's mean and says so, TensorBoard has both tags."""
    from engine.plugins.tensorboard import read_metrics

    out, _, summary, stdout, _ = run
    rows = csv_rows(out)
    windows = [v for _, _, name, v in rows if name == "train/loss"]
    means = [v for _, _, name, v in rows if name == "train/epoch_loss"]
    assert summary["train_loss"] == windows[-1] == summary["metrics"]["train/loss"]
    assert summary["train_epoch_loss"] == means[-1] == summary["metrics"]["train/epoch_loss"]
    assert summary["train_loss"] != summary["train_epoch_loss"]  # two windows per epoch
    lines = [line for line in stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split("  ")[1] for line in lines] == [
        f"train loss (epoch mean) {mean:.4f}" for mean in means]
    scalars, _ = read_metrics(out)
    assert [step for step, _ in scalars["train/loss"]] == [s for s, _ in LOSS_POINTS]
    assert [step for step, _ in scalars["train/epoch_loss"]] == [
        s for s, _ in EPOCH_LOSS_POINTS]


def test_one_epoch_numbering(run):
    """Epoch N (from 1) is `epoch N/2` on the console, N in metrics.csv's epoch column and
    TensorBoard's `epoch` scalar, epochs_completed N in summary.json after the last, and
    engine.state.epoch == epochs_completed == N in the hooks at its end, whose `epoch`
    argument is the index N - 1 (as range() and sampler.set_epoch count)."""
    from engine.plugins.tensorboard import read_metrics

    out, _, summary, stdout, hooks = run
    console = [line.split()[1] for line in stdout.splitlines() if line.startswith("epoch ")]
    assert console == ["1/2", "2/2"]
    csv_epochs = [e for _, e, name, _ in csv_rows(out) if name == "train/epoch_loss"]
    assert csv_epochs == [1, 2]
    scalars, _ = read_metrics(out)
    assert scalars["epoch"] == [(8, 1.0), (16, 2.0)]
    assert summary["epochs_completed"] == 2
    assert hooks == [{"epoch": n - 1, "state.epoch": n, "epochs_completed": n} for n in (1, 2)]


def test_mlflow(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store
    out, uri, summary, *_ = run
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("e2e")
    (found,) = client.search_runs([experiment.experiment_id])  # rank 0's only
    assert found.info.status == "FINISHED"
    assert found.info.run_name == "run"
    assert found.data.tags["engine.out_dir"] == str(out)
    params = found.data.params
    assert (params["epochs"], params["log_every"], params["mlflow.experiment"]) == \
        ("2", "4", "e2e")
    assert "ddp.bucket_cap_mb" in params  # a plugin's config group, flattened
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [step for step, _ in LOSS_POINTS]
    history = client.get_metric_history(found.info.run_id, "train/epoch_loss")
    assert sorted(m.step for m in history) == [step for step, _ in EPOCH_LOSS_POINTS]
    accuracy = client.get_metric_history(found.info.run_id, "val/accuracy")
    assert max(accuracy, key=lambda m: m.step).value == summary["val_accuracy"]
    assert found.data.metrics["summary/global_step"] == summary["global_step"] == 16
    path = client.download_artifacts(found.info.run_id, "summary.json", str(out.parent))
    assert json.loads(open(path).read())["status"] == "completed"


def test_wandb(run):
    out, _, summary, *_ = run
    (folder,) = (out / "wandb").glob("offline-run-*")  # rank 0's only
    (log,) = folder.glob("run-*.wandb")
    found = records(log)
    (start,) = [r.run for r in found if r.WhichOneof("record_type") == "run"]
    assert start.run_id == (out / "wandb_run_id").read_text().strip()
    assert (start.project, start.display_name) == ("e2e", "run")
    config = {item.key: json.loads(item.value_json) for item in start.config.update}
    assert config["epochs"] == 2 and config["wandb"]["mode"] == "offline"
    history = {}
    for r in found:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}
            history[r.history.step.num] = items
    # W&B keeps one row per step: the epoch's metrics join the step's log.
    assert sorted(history) == [0, 4, 8, 12, 16]  # 0: world_size, as the run starts
    assert history[16]["val/accuracy"] == summary["val_accuracy"]
    assert history[16]["train/epoch_loss"] == summary["train_epoch_loss"]
    assert history[16]["train/loss"] == summary["train_loss"]
    final = {}
    for r in found:
        if r.WhichOneof("record_type") == "summary":
            final.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                          for i in r.summary.update})
    assert final["status"] == "completed" and final["global_step"] == 16
    (end,) = [r.exit for r in found if r.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 0
