"""Logger ``console``: a progress bar or progress lines, and one line per epoch, on rank 0
only.

The bar shows step, loss (``train/loss``: the mean of the last log window), throughput
(samples/s, or the recipe's own unit: tokens/s) and the share of time spent waiting for
data; it refreshes at the log interval, so it never forces a host-device synchronisation per
step. On a terminal it redraws in place. Where stderr is not a terminal (a log file under
nohup or SLURM, a notebook) the bar is off and a plain line takes its place every
``console.progress_every_s`` seconds::

    step 120/400  epochs 0.30/1  loss 0.4321  samples/s 1520  eta 2m05s

It is written at the log interval too (when one is due), from the values logged there:
nothing per step, nothing read back from the device. An epoch whose training waited for
data more than :data:`DATA_BOUND` of its time is called data-bound, with a hint on what to
do about it.
"""

from __future__ import annotations

import sys
import threading
import time

import attrs

import engine
from engine import phases
from engine.metrics import throughput_of

#: A run is called data-bound when more than this fraction of its time waits for data.
DATA_BOUND = 0.3


def data_wait_text(wait: float) -> str:
    """``data-bound: 63% waiting`` above the threshold, ``data wait: 4% waiting`` below."""
    return f"{'data-bound' if wait > DATA_BOUND else 'data wait'}: {wait:.0%} waiting"


def data_bound_hint(ctx) -> str:
    settings = getattr(ctx, "loader_settings", None)
    workers = (f"num_workers={settings.num_workers} per process" if settings is not None
               else f"num_workers={ctx.cfg.num_workers}")
    return (f"hint: the training waits for data ({workers}); measure better settings with "
            f"`engine-run tune-workers {ctx.recipe.path}`, or give the job more CPUs "
            "(SLURM: --cpus-per-task)")


def val_parts(metrics) -> list[str]:
    """A validation's metrics as an epoch line and a step validation's line show them:
    the recipe's (its eval_step's; by default val/loss and, for class-index targets,
    val/accuracy), in the order it returns them; val/accuracy as ``val acc 98.06%``."""
    return [f"val acc {value:.2%}" if key == "val/accuracy" else
            f"{key.replace('/', ' ')} {value:.4f}" for key, value in metrics.items()
            if key.startswith("val/") and value is not None]


def _non_negative(instance, attribute, value) -> None:
    if value < 0:
        raise ValueError("give the seconds between two progress lines, or 0 for none")


@attrs.define
class ConsoleConfig:
    RESUME_SAFE = True  # what is printed, not what a step computes

    # Where stderr is not a terminal (nohup, SLURM, a notebook): a progress line every this
    # many seconds instead of the bar (0: none). Checked at the log interval (log_every).
    progress_every_s: float = attrs.field(default=30.0, validator=_non_negative)


@engine.hookimpl
def engine_register_config_groups():
    return {"console": ConsoleConfig}


def duration_text(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: an ETA's precision."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines:
    """The bar's stand-in where it cannot draw: a line every ``every_s`` seconds, at the
    first log interval after that much time passed. The ETA is the remaining steps of the
    run (``total_steps``: max_steps' where it ends the run sooner; None: a stream's, not
    known) at the pace since the previous line (validation and snapshots included)."""

    def __init__(self, every_s: float, step: int, steps_per_epoch: int | None, epochs: int,
                 total_steps: int | None):
        self.every_s = every_s
        self.steps_per_epoch, self.epochs, self.total = steps_per_epoch, epochs, total_steps
        self.since, self.since_step = time.monotonic(), step

    def line_due(self, step: int, loss: float, throughput: tuple[str, float]) -> str | None:
        now = time.monotonic()
        if now - self.since < self.every_s:
            return None
        unit, per_sec = throughput
        pace = (step - self.since_step) / (now - self.since)
        self.since, self.since_step = now, step
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        if self.steps_per_epoch is not None:
            parts.append(f"epochs {step / self.steps_per_epoch:.2f}/{self.epochs}")
        parts += [f"loss {loss:.4f}", f"{unit}/s {per_sec:.0f}"]
        if self.total:
            left = (self.total - step) / pace if pace > 0 else None
            parts.append(f"eta {'?' if left is None else duration_text(left)}")
        return "  ".join(parts)


def done_time(summary: dict) -> str:
    """This segment's time (summary.json's ``wall_time_s``: from the command's start),
    how much of it passed before training began, and a resumed run's total:
    ``24.7s (start-up 12.0s)``, ``9.1s (start-up 5.2s; 31.0s over 2 segments)``."""
    total, start_up = summary.get("wall_time_s"), phases.elapsed(until=phases.TRAINING_STARTS)
    if total is None:
        return "?"
    notes = [f"start-up {start_up:.1f}s"] if start_up is not None else []
    if (summary.get("segments") or 1) > 1 and summary.get("total_wall_time_s") is not None:
        notes.append(f"{summary['total_wall_time_s']:.1f}s over {summary['segments']} segments")
    return f"{total:.1f}s" + (f" ({'; '.join(notes)})" if notes else "")


class ConsoleLogger:
    def __init__(self):
        self.bar = None
        self.lines: ProgressLines | None = None  # where the bar is off
        self.last_step = 0
        self.postfix: dict[str, str] = {}

    @engine.hookimpl
    def engine_run_start(self, ctx):
        if not ctx.is_rank0:
            return

        # tqdm takes tens of ms to import: for rank 0's bar, not for loading the plugin.
        from tqdm import tqdm

        if not hasattr(tqdm, "_lock"):
            # tqdm's default lock includes a multiprocessing semaphore (for bars of
            # several processes; ours is one): a killed rank 0 leaked it, and the
            # resource tracker's warning about it became the job's last line.
            tqdm.set_lock(threading.RLock())
        cfg = ctx.cfg
        self.last_step = ctx.state.step
        self.postfix = {}
        self.bar = tqdm(total=ctx.total_steps, initial=self.last_step,
                        desc=ctx.recipe.name, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr, mininterval=0.5)
        every_s = (getattr(cfg, "console", None) or ConsoleConfig()).progress_every_s
        # tqdm turned itself off where stderr is no terminal (disable=None): lines instead.
        self.lines = (ProgressLines(every_s, self.last_step, ctx.steps_per_epoch,
                                    cfg.epochs, ctx.total_steps)
                      if self.bar.disable and every_s else None)

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        validation_only = ("train/loss" not in metrics and "train/epoch_loss" not in metrics
                           and any(k.startswith("val/") for k in metrics))
        if self.bar is not None and validation_only:
            # A validation inside an epoch (val_every_steps, or the step max_steps ends
            # the run at): one line, as an epoch's.
            self._write("  ".join([f"step {step} (epoch {ctx.state.epoch + 1}/"
                                   f"{ctx.cfg.epochs})"] + val_parts(metrics)))
            return
        throughput = throughput_of(metrics)
        if self.bar is None or "train/loss" not in metrics or throughput is None:
            return
        self.bar.update(step - self.last_step)
        self.last_step = step
        unit, per_sec = throughput
        self.postfix.update({"loss": f"{metrics['train/loss']:.4f}",
                             f"{unit}/s": f"{per_sec:.0f}"})
        if metrics.get("train/data_wait_fraction") is not None:
            self.postfix["data_wait"] = f"{metrics['train/data_wait_fraction']:.0%}"
        self.bar.set_postfix(self.postfix, refresh=False)
        if self.lines is not None:
            line = self.lines.line_due(step, metrics["train/loss"], throughput)
            if line is not None:
                print(line, file=sys.stderr, flush=True)

    @engine.hookimpl
    def engine_epoch_end(self, ctx, epoch, metrics):
        if not ctx.is_rank0:
            return
        wait = metrics.get("train/data_wait_fraction")
        if self.bar is not None:
            self.bar.update(ctx.state.step - self.last_step)
            self.last_step = ctx.state.step
            if wait is not None:
                self.postfix["data_wait"] = f"{wait:.0%}"
                self.bar.set_postfix(self.postfix, refresh=True)
        parts = [f"epoch {epoch + 1}/{ctx.cfg.epochs}"]
        if metrics.get("train/epoch_loss") is not None:
            parts.append(f"train loss (epoch mean) {metrics['train/epoch_loss']:.4f}")
        parts += val_parts(metrics)
        throughput = throughput_of(metrics)  # the epoch's
        if throughput is not None and throughput[1] is not None:
            parts.append(f"{throughput[0]}/s {throughput[1]:.0f}")
        if wait is not None:
            parts.append(data_wait_text(wait))
        message = "  ".join(parts)
        if wait is not None and wait > DATA_BOUND:
            message += "\n" + data_bound_hint(ctx)
        self._write(message)

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if not ctx.is_rank0:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.lines = None
        if summary["status"] == "completed":
            steps, max_steps = summary["global_step"], getattr(ctx.cfg, "max_steps", 0)
            if 0 < max_steps <= steps and summary["epochs_completed"] < ctx.cfg.epochs:
                trained = f"{steps} steps (max_steps, in epoch {ctx.state.epoch + 1})"
            else:
                done = summary["epochs_completed"]
                trained = f"{done} epoch{'' if done == 1 else 's'}"
            # A resumed run's count is the run's, not this command's: say where it began.
            resumed = summary.get("resume") or {}
            since = f" (resumed at step {resumed['step']})" if resumed.get("step") else ""
            self._write(f"done: {trained}{since} in {done_time(summary)}, results in "
                        f"{ctx.out_dir}")

    def _write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)


# One logger per process; its hooks are the module's hooks.
_logger = ConsoleLogger()
engine_run_start = _logger.engine_run_start
engine_log = _logger.engine_log
engine_epoch_end = _logger.engine_epoch_end
engine_run_end = _logger.engine_run_end
