"""Logger ``mlflow``: the run's parameters, metrics and summary in an MLflow tracking
store, written by rank 0. Optional: ``pip install -e ".[mlflow]"`` (mlflow-skinny).

Registered through the ``engine.plugins`` entry-point group, as a third-party plugin
would be, and off until enabled through its config group ``mlflow``::

    engine-run RECIPE mlflow.enabled=true mlflow.tracking_uri=file:///data/mlruns \\
        mlflow.experiment=cifar

- ``enabled`` (false): log this run to MLflow. Until then ``mlflow`` is never imported.
- ``tracking_uri`` (none): where the runs go (``file:///path``, ``sqlite:///path.db``,
  ``http://server:5000``); none: MLflow's own default (``MLFLOW_TRACKING_URI``, else
  ``./mlruns``).
- ``experiment`` (none): the experiment, created when missing; none: the recipe's name.
- ``run_name`` (none): none: the out_dir's folder name.

What it records: the resolved config as parameters (flattened: ``lr``,
``ddp.bucket_cap_mb``...), every ``engine_log`` metric at its global step, tags
``engine.out_dir`` and ``engine.resumed_from``, and at the end the summary (its numbers
as ``summary/...`` metrics, the whole of it as the artifact ``summary.json``) and the
run's status: FINISHED (completed), KILLED (pre-empted) or FAILED. Metrics are sent in
batches at the end of each epoch, or after :data:`FLUSH_EVERY_S` seconds at the
next log interval, so a remote server costs no round trip per log interval. A resumed
run (``engine-run`` resuming a snapshot) is a new MLflow run tagged with the snapshot
it resumed from: MLflow refuses to change a logged parameter, and a resume may change
some (``epochs``, ``lr``: engine/snapshot.py says which).
"""

from __future__ import annotations

import os
import time

import attrs

import engine
from engine.errors import first_line
from engine.errors import PluginError
from engine.plugins.tracking import (enabled, experiment_name, flat_config,
                                     mlflow_store_problem, require_package, run_name,
                                     summary_scalars)

# mlflow is imported inside the functions that use it: an optional package (the mlflow
# extra), imported only once the logger is enabled, and the plugin manager loads this
# plugin in every run (test_the_optional_loggers_are_not_imported_unless_enabled).

#: Send buffered metrics at a log interval once this many seconds passed since the last.
FLUSH_EVERY_S = 30.0
#: MLflow's limit on the entries of one log_batch call.
BATCH = 1000
#: MLflow's run status for each summary status.
STATUSES = {"completed": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED",
            "failed": "FAILED"}


@attrs.define
class MLflowConfig:
    """Where and whether to log the run to MLflow (see the module docstring)."""

    RESUME_SAFE = True  # where a run is tracked is not what it computes

    enabled: bool = False
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None

    def check(self) -> None:
        """In the launching process and --dry-run, before any worker starts: the package
        is there and the store can be opened (engine.config.check calls it)."""
        if not self.enabled:
            return
        require_package("mlflow", extra="mlflow", group="mlflow")
        problem = mlflow_store_problem(self.tracking_uri, os.environ)
        if problem:
            raise PluginError(problem)


@engine.hookimpl
def engine_register_config_groups():
    return {"mlflow": MLflowConfig}


class MLflowLogger:
    def __init__(self):
        self.client = None
        self.run_id: str | None = None
        self.pending: list = []  # mlflow.entities.Metric, not yet sent
        self.sent_at = 0.0

    @engine.hookimpl
    def engine_run_start(self, ctx):
        if ctx.is_rank0 and self.client is None:
            self._start(ctx)

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        if self.client is None and not self._start(ctx):
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.pending += [Metric(name, float(value), now_ms, step)
                         for name, value in metrics.items() if value is not None]
        if time.monotonic() - self.sent_at > FLUSH_EVERY_S:
            self._send()

    @engine.hookimpl
    def engine_epoch_end(self, ctx, epoch, metrics):
        if self.client is not None:
            self._send()

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if self.client is None:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.pending += [Metric(f"summary/{key}", value, now_ms, ctx.state.step)
                         for key, value in summary_scalars(summary).items()]
        client, run_id = self.client, self.run_id
        status = STATUSES.get(summary["status"], "FAILED")
        # One step at a time: the status is set even when the metrics could not be sent
        # (a run left RUNNING forever misleads more than one with metrics missing). A
        # store failing now is a warning, not an exception: the run's outcome is decided,
        # and the other plugins' engine_run_end (files to close) must still run.
        for what, send in (("metrics", self._send),
                           ("summary.json", lambda: client.log_dict(run_id, summary,
                                                                    "summary.json")),
                           ("status", lambda: client.set_terminated(run_id, status))):
            try:
                send()
            except Exception as exc:
                ctx.warn(f"mlflow: could not record the run's {what} in MLflow run "
                         f"{run_id}: {type(exc).__name__}: {first_line(exc)}")
        self.__init__()  # the next run in this process (tests, engine.launch) starts clean

    def _start(self, ctx) -> bool:
        """Create the MLflow run on rank 0 when enabled; True if there is one."""
        found = enabled(ctx, "mlflow", extra="mlflow")
        if found is None:
            return False
        options = found[0]
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=options.tracking_uri)
        name = options.experiment or experiment_name(ctx)
        experiment = client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(name))
        tags = {"engine.out_dir": str(ctx.out_dir),
                "engine.resumed_from": str(ctx.resumed_from or "")}
        run = client.create_run(experiment_id, run_name=run_name(ctx, options.run_name),
                                tags=tags)
        self.client, self.run_id = client, run.info.run_id
        params = [Param(key, str(value)) for key, value in flat_config(ctx.cfg).items()]
        for first in range(0, len(params), 100):  # MLflow takes 100 params per batch
            client.log_batch(self.run_id, params=params[first:first + 100])
        self.sent_at = time.monotonic()
        return True

    def _send(self) -> None:
        for first in range(0, len(self.pending), BATCH):
            self.client.log_batch(self.run_id, metrics=self.pending[first:first + BATCH])
        self.pending = []
        self.sent_at = time.monotonic()


# One logger per process; its hooks are the module's hooks.
_logger = MLflowLogger()
engine_run_start = _logger.engine_run_start
engine_log = _logger.engine_log
engine_epoch_end = _logger.engine_epoch_end
engine_run_end = _logger.engine_run_end
