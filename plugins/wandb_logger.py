"""Logger ``wandb``: the run's config, metrics and summary in Weights & Biases, written by
rank 0. Optional: ``pip install -e ".[wandb]"``.

Registered through the ``engine.plugins`` entry-point group, as a third-party plugin
would be, and off until enabled through its config group ``wandb``::

    engine-run RECIPE wandb.enabled=true wandb.project=cifar
    engine-run RECIPE wandb.enabled=true wandb.mode=offline   # sync later: wandb sync

- ``enabled`` (false): log this run to W&B. Until then ``wandb`` is never imported.
- ``project`` (none): none: the recipe's name.
- ``entity`` (none): the team or user; none: your default entity.
- ``name`` (none): the run's display name; none: the out_dir's folder name.
- ``mode`` (none): ``online``, ``offline`` or ``disabled``; none: W&B's own default
  (``WANDB_MODE``, else online).
- ``dir`` (none): where W&B keeps its files (the ``wandb/`` folder); none: out_dir.

What it records: the resolved config (nested, as W&B shows it), every ``engine_log``
metric at its global step (``wandb.log`` hands them to W&B's own background process:
no network round trip in the training loop), the summary's numbers in the run summary,
and the end: ``finish(exit_code=...)`` with engine-run's exit code (0 completed, 1
failed, 75 pre-empted, after ``mark_preempting``). The run's id is kept in
``<out_dir>/wandb_run_id``, so a resumed run continues the same W&B run
(``resume="allow"``) instead of starting a second one. W&B keeps a run's steps
increasing: the points the interrupted run logged after its snapshot stay, and the
resumed run's points for those steps are dropped (with W&B's warning) until it passes
them; an exact resume logs the same values there anyway. W&B's capture of the console is
off (``console="off"``): the engine's output stays as it is.
"""

from __future__ import annotations

from typing import Literal

import attrs

import engine
from engine.errors import first_line
from engine.plugins.tracking import (EXIT_CODES, enabled, experiment_name, require_package,
                                     run_name, summary_scalars)

#: The file under out_dir that holds the W&B run's id, for a resumed run to continue it.
RUN_ID_FILE = "wandb_run_id"


@attrs.define
class WandbConfig:
    """Where and whether to log the run to W&B (see the module docstring)."""

    RESUME_SAFE = True  # where a run is tracked is not what it computes

    enabled: bool = False
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None

    def check(self) -> None:
        """Before any worker starts (engine.config.check calls it): wandb is installed."""
        if self.enabled:
            require_package("wandb", extra="wandb", group="wandb")


@engine.hookimpl
def engine_register_config_groups():
    return {"wandb": WandbConfig}


class WandbLogger:
    def __init__(self):
        self.run = None

    @engine.hookimpl
    def engine_run_start(self, ctx):
        if ctx.is_rank0 and self.run is None:
            self._start(ctx)

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        if self.run is None and not self._start(ctx):
            return
        self.run.log({name: value for name, value in metrics.items() if value is not None},
                     step=step)

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if self.run is None:
            return
        run, status = self.run, summary["status"]
        self.__init__()  # the next run in this process (tests, engine.launch) starts clean
        try:
            run.summary.update({**summary_scalars(summary), "status": status})
            if status == "preempted":
                run.mark_preempting()
            run.finish(exit_code=EXIT_CODES.get(status, 1))
        except Exception as exc:
            # The run's outcome is decided; the other plugins' engine_run_end (files to
            # close) must still run.
            ctx.warn(f"wandb: could not record the end of W&B run {run.id}: "
                     f"{type(exc).__name__}: {first_line(exc)}")

    def _start(self, ctx) -> bool:
        """Start (or, after a resume, continue) the W&B run on rank 0 when enabled."""
        found = enabled(ctx, "wandb", extra="wandb")
        if found is None:
            return False
        options, wandb = found
        id_file = ctx.out_dir / RUN_ID_FILE
        run_id = None
        if ctx.resumed_from is not None and id_file.exists():
            run_id = id_file.read_text().strip() or None
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
        # Not at the top: engine-run plugins loads this plugin without engine.config.
        from engine.config import to_dict

        self.run = wandb.init(
            project=options.project or experiment_name(ctx), entity=options.entity,
            name=run_name(ctx, options.name), mode=options.mode,
            dir=options.dir or str(ctx.out_dir), config=to_dict(ctx.cfg),
            id=run_id, resume="allow" if run_id else None,
            # Another run of this process (a test, engine.launch twice) gets its own.
            reinit="create_new", settings=wandb.Settings(console="off"))
        id_file.write_text(self.run.id + "\n")
        return True


# One logger per process; its hooks are the module's hooks.
_logger = WandbLogger()
engine_run_start = _logger.engine_run_start
engine_log = _logger.engine_log
engine_run_end = _logger.engine_run_end
