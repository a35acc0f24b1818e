"""Logger ``console``: a tqdm progress bar and one line per epoch, on rank 0 only.

The bar shows step, loss (``train/loss``: the mean of the last log window), throughput
(samples/s, or the recipe's own unit: tokens/s) and the share of time spent waiting for
data; it refreshes at the log interval, so it never forces a host-device synchronisation per
step. On a terminal it redraws in place; in a log file (SLURM output) only the epoch
lines appear. An epoch whose training waited for data more than :data:`DATA_BOUND` of
its time is called data-bound, with a hint on what to do about it.
"""

from __future__ import annotations

import math
import sys

import engine
from engine.context import throughput_of

#: A run is called data-bound when more than this fraction of its time waits for data.
DATA_BOUND = 0.3


def data_wait_text(wait: float) -> str:
    """``data-bound: 63% waiting`` above the threshold, ``data wait: 4% waiting`` below."""
    return f"{'data-bound' if wait > DATA_BOUND else 'data wait'}: {wait:.0%} waiting"


def data_bound_hint(engine) -> str:
    settings = getattr(engine, "loader_settings", None)
    workers = (f"num_workers={settings.num_workers} per process" if settings is not None
               else f"num_workers={engine.cfg.num_workers}")
    return (f"hint: the training waits for data ({workers}); measure better settings with "
            f"`engine-run tune-workers {engine.recipe.path}`, or give the job more CPUs "
            "(SLURM: --cpus-per-task)")


def done_time(summary: dict) -> str:
    """This segment's time (summary.json's ``wall_time_s``: from the command's start),
    how much of it passed before training began, and a resumed run's total:
    ``24.7s (start-up 12.0s)``, ``9.1s (start-up 5.2s; 31.0s over 2 segments)``."""
    from engine import phases

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
        self.last_step = 0
        self.postfix: dict[str, str] = {}

    @engine.hookimpl
    def engine_run_start(self, engine):
        if not engine.is_rank0:
            return
        import threading

        from tqdm import tqdm

        if not hasattr(tqdm, "_lock"):
            # tqdm's default lock includes a multiprocessing semaphore (for bars of
            # several processes; ours is one): a killed rank 0 leaked it, and the
            # resource tracker's warning about it became the job's last line.
            tqdm.set_lock(threading.RLock())
        cfg = engine.cfg
        loader_batches = math.ceil(len(engine.train_loader.sampler.dataset) /
                                   engine.world.world_size / engine.micro_batch)
        steps_per_epoch = math.ceil(loader_batches / cfg.grad_accum_steps)
        self.last_step = engine.state.step
        self.postfix = {}
        self.bar = tqdm(total=cfg.epochs * steps_per_epoch, initial=self.last_step,
                        desc=engine.recipe.name, unit="step", dynamic_ncols=True,
                        disable=None, file=sys.stderr, mininterval=0.5)

    @engine.hookimpl
    def engine_log(self, engine, metrics, step):
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

    @engine.hookimpl
    def engine_epoch_end(self, engine, epoch, metrics):
        if not engine.is_rank0:
            return
        wait = metrics.get("train/data_wait_fraction")
        if self.bar is not None:
            self.bar.update(engine.state.step - self.last_step)
            self.last_step = engine.state.step
            if wait is not None:
                self.postfix["data_wait"] = f"{wait:.0%}"
                self.bar.set_postfix(self.postfix, refresh=True)
        parts = [f"epoch {epoch + 1}/{engine.cfg.epochs}"]
        # The validation metrics are the recipe's (its eval_step's; by default val/loss
        # and, for class-index targets, val/accuracy), in the order it returns them.
        shown = [("train/epoch_loss", "train loss (epoch mean)", ".4f")]
        shown += [(key, "val acc", ".2%") if key == "val/accuracy" else
                  (key, key.replace("/", " "), ".4f")
                  for key in metrics if key.startswith("val/")]
        for key, label, fmt in shown:
            if metrics.get(key) is not None:
                parts.append(f"{label} {format(metrics[key], fmt)}")
        throughput = throughput_of(metrics)  # the epoch's
        if throughput is not None and throughput[1] is not None:
            parts.append(f"{throughput[0]}/s {throughput[1]:.0f}")
        if wait is not None:
            parts.append(data_wait_text(wait))
        message = "  ".join(parts)
        if wait is not None and wait > DATA_BOUND:
            message += "\n" + data_bound_hint(engine)
        self._write(message)

    @engine.hookimpl
    def engine_run_end(self, engine, summary):
        if not engine.is_rank0:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if summary["status"] == "completed":
            self._write(f"done: {summary['epochs_completed']} epochs in {done_time(summary)}, "
                        f"results in {engine.out_dir}")

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
