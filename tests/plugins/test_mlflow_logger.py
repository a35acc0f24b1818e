"""The MLflow logger, through its hooks on an engine as ``make_engine`` makes it (no
process), against a local file store in tmp_path, read back with MLflow's own client.
tests/plugins/test_loggers_run.py checks a real two-process run;
tests/engine/test_imports.py that a disabled one imports nothing."""

from __future__ import annotations

import shutil
import sys

import pytest

from engine.config import with_groups
from engine.overrides import apply_overrides
from engine.errors import PluginError
from engine.plugins.mlflow_logger import MLflowConfig, MLflowLogger
from engine.testing import make_engine, make_plugin_manager, tiny_recipe  # noqa: F401 (fixtures)


def enabled(eng, *overrides: str):
    """The engine's config with the mlflow group, as engine-run builds it, overridden."""
    return apply_overrides(with_groups(eng.cfg, {"mlflow": MLflowConfig}),
                           ["mlflow.enabled=true", *overrides])


def only_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def test_params_metrics_by_epoch_summary_and_failed_status(make_engine, tmp_path,
                                                            monkeypatch):
    # MLflow 3 refuses its file store unless asked; sqlite needs the full mlflow package.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    eng = make_engine("lr=0.25")
    eng.cfg = enabled(eng, f"mlflow.tracking_uri={uri}", "mlflow.experiment=unit")
    logger = MLflowLogger()
    logger.engine_run_start(ctx=eng)
    logger.engine_log(ctx=eng, metrics={"train/loss": 0.5, "lr": 0.25}, step=4)
    client, run = only_run(uri, "unit")
    assert run.info.status == "RUNNING" and run.info.run_name == "run"  # out_dir's name
    assert run.data.params["lr"] == "0.25" and run.data.params["mlflow.enabled"] == "True"
    assert client.get_metric_history(run.info.run_id, "train/loss") == []  # sent per epoch
    logger.engine_log(ctx=eng, metrics={"train/loss": 0.25, "val/accuracy": 0.5}, step=8)
    logger.engine_epoch_end(ctx=eng, epoch=0, metrics={})
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(4, 0.5), (8, 0.25)]
    logger.engine_run_end(ctx=eng, summary=eng.summary("failed", ValueError("boom")))
    _, run = only_run(uri, "unit")
    assert run.info.status == "FAILED"
    assert run.data.metrics["summary/global_step"] == 0
    summary = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert '"error": "ValueError: boom"' in open(summary).read()


def test_enabled_without_the_package_is_one_line_naming_the_extra(make_engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: import fails
    eng = make_engine()
    with pytest.raises(PluginError) as info:  # the launching process's check
        enabled(eng)
    assert str(info.value) == ("mlflow.enabled=true needs the mlflow package, which is not "
                               'installed; install it with pip install -e ".[mlflow]" (or '
                               "pip install mlflow), or drop mlflow.enabled=true")
    # A worker given such a config anyway (a library caller's): the same, from the import.
    eng.cfg = apply_overrides(with_groups(eng.cfg, {"mlflow": MLflowConfig}),
                              ["mlflow.enabled=true"], checked=False)
    with pytest.raises(PluginError) as info:
        MLflowLogger().engine_run_start(ctx=eng)
    assert str(info.value).startswith("mlflow.enabled=true needs the mlflow package (")
    assert 'install it with pip install -e ".[mlflow]"' in str(info.value)
    assert "\n" not in str(info.value)


def test_a_store_failing_at_the_end_is_a_warning_not_an_exception(make_engine, tmp_path,
                                                                  monkeypatch, capsys):
    # The other plugins' engine_run_end (files to close) must still run.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    eng = make_engine()
    eng.cfg = enabled(eng, f"mlflow.tracking_uri={store.as_uri()}")
    logger = MLflowLogger()
    logger.engine_run_start(ctx=eng)
    shutil.rmtree(store)  # the store is gone: every call fails
    logger.engine_run_end(ctx=eng, summary=eng.summary("completed"))
    err = capsys.readouterr().err
    assert "mlflow: could not record the run's status in MLflow run" in err
    assert logger.client is None


def test_a_store_mlflow_cannot_open_is_one_line_before_any_worker_starts(tmp_path,
                                                                         monkeypatch):
    """sqlite:// with the [mlflow] extra (mlflow-skinny: no SQLAlchemy), and a file store
    without MLFLOW_ALLOW_FILE_STORE, failed only after 2 workers started, with MLflow's
    exception and a gloo error from rank 1. Now: one line, exit 2, from the launching
    process, in --dry-run too; the tracking URI from the environment alike."""
    from engine.testing import TINY_RECIPE
    from tests.conftest import engine_env, run_cli_here

    recipe = tmp_path / "tracked.py"
    recipe.write_text(TINY_RECIPE)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny's environment
    db, files = f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "mlruns").as_uri()
    out = f"out_dir={tmp_path / 'run'}"
    cases = [
        ([f"mlflow.tracking_uri={db}", "--nproc", "2"], {},
         f"config key 'mlflow.tracking_uri': {db} is a database store, which needs "
         "SQLAlchemy; the [mlflow] extra (mlflow-skinny) lacks it: pip install mlflow"),
        ([f"mlflow.tracking_uri={db}", "--dry-run"], {}, "needs SQLAlchemy"),
        (["--nproc", "2"], {"MLFLOW_TRACKING_URI": db},
         f"MLFLOW_TRACKING_URI: {db} is a database store, which needs SQLAlchemy"),
        ([f"mlflow.tracking_uri={files}", "--nproc", "2"], {},
         f"config key 'mlflow.tracking_uri': {files} is MLflow's file store, which this "
         "MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true is set: export "
         "MLFLOW_ALLOW_FILE_STORE=true"),
    ]
    for args, env, message in cases:
        proc = run_cli_here(str(recipe), "mlflow.enabled=true", out, *args,
                            env=engine_env(**env))
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("engine-run: error: ") and message in proc.stderr, (
            args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "[rank" not in proc.stderr
        assert not (tmp_path / "run").exists()  # no worker ever started
    proc = run_cli_here(str(recipe), "mlflow.enabled=true", out, f"mlflow.tracking_uri={files}",
                        "--dry-run", env=engine_env(MLFLOW_ALLOW_FILE_STORE="true"))
    assert proc.returncode == 0, proc.stderr
