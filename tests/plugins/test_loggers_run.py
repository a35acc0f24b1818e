"""One real run (two CPU processes, two epochs of the tiny recipe) with the three
loggers of this repository on: the built-in ``csv``, and ``mlflow`` (a local file store)
and ``wandb`` (offline), which the entry points of ddp-engine itself load, as they would
a third-party plugin. Each logger's file or store is read back with its own reader:
the csv module, MLflow's client, the records of W&B's ``.wandb`` file."""

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
    out, uri = tmp / "run", (tmp / "mlruns").as_uri()
    run_cli(str(recipe), "epochs=2", "log_every=4", f"out_dir={out}", "--nproc", "2",
            "mlflow.enabled=true", f"mlflow.tracking_uri={uri}", "mlflow.experiment=e2e",
            "wandb.enabled=true", "wandb.mode=offline", "wandb.project=e2e",
            # MLflow 3 refuses its file store unless asked; W&B: no network, no noise.
            env=engine_env(MLFLOW_ALLOW_FILE_STORE="true", WANDB_SILENT="true"),
            check=True)
    return out, uri, read_summary(out)


#: (step, epoch) of the train/loss points: 8 steps per epoch, a point every 4 (log_every)
#: and the epoch's mean after validation. One of each: only rank 0 logs.
LOSS_POINTS = [(4, 0), (8, 0), (8, 0), (12, 1), (16, 1), (16, 1)]


def test_csv(run):
    out, _, summary = run
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "epoch", "name", "value"]
    assert [(int(s), int(e)) for s, e, name, _ in rows[1:] if name == "train/loss"] == \
        LOSS_POINTS
    val = [(int(s), int(e), float(v)) for s, e, name, v in rows[1:] if name == "val/accuracy"]
    assert val[0][:2] == (8, 0) and val[1][:2] == (16, 1)
    assert val[-1][2] == summary["val_accuracy"]
    assert {name for _, _, name, _ in rows[1:]} >= {"lr", "train/samples_per_sec", "val/loss"}


def test_mlflow(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store
    out, uri, summary = run
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
    accuracy = client.get_metric_history(found.info.run_id, "val/accuracy")
    assert max(accuracy, key=lambda m: m.step).value == summary["val_accuracy"]
    assert found.data.metrics["summary/global_step"] == summary["global_step"] == 16
    path = client.download_artifacts(found.info.run_id, "summary.json", str(out.parent))
    assert json.loads(open(path).read())["status"] == "completed"


def test_wandb(run):
    out, _, summary = run
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
    assert sorted(history) == [4, 8, 12, 16]
    assert history[16]["val/accuracy"] == summary["val_accuracy"]
    final = {}
    for r in found:
        if r.WhichOneof("record_type") == "summary":
            final.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                          for i in r.summary.update})
    assert final["status"] == "completed" and final["global_step"] == 16
    (end,) = [r.exit for r in found if r.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 0
