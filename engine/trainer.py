"""The training loop. ``Trainer.fit`` in pseudocode, the method that holds each part on
the right (the hooks and when they fire: docs/plugins.md, "Hooks in the order they fire")::

    log world_size at the step the run starts from (rank 0)          fit
    for epoch in epochs not yet completed:                          run_epoch
        sampler.set_epoch(epoch, from the global sample position a resumed snapshot
                          reached: the rest of the order split over these ranks)
        for each micro-batch: forward and backward (engine/step.py) train_epoch
            after a group's last one: the optimizer step unless     optimizer_step
                on_nonfinite=skip skips it; scheduler if per step
                every log_every steps: start one all-reduce of the  CheckPoint.start
                    window's loss and its slots (engine/check_point.py), finish the last
                unless the epoch ends here, every val_every_steps steps validate_if_due
                    and where max_steps ends the run: validate, log its val/* at the
                    step, early stopping (may end the run)
                a snapshot to disk if the validation was a new best, else the snapshot
                    layer's if due: disk or shared memory           Snapshots.step_ended
                stop the epoch if a finished check said pre-empted, or the run ends here
        the last check point finished; the epoch's loss and the slowest
        rank's data wait, gathered from all ranks                   epoch_metrics
        the run ended inside the epoch (max_steps, early stopping):
            the final snapshot, stop                                end_in_epoch
        pre-empted (a check point said so): snapshot, stop          run_epoch
        the recipe's eval_step, reduced (engine/validation.py)      Validation.run
        log the epoch's metrics; scheduler if per epoch             step_scheduler
            (ReduceLROnPlateau: with scheduler_metric's reduced value)
        early stopping, pre-emption, snapshot if due (a check's time flag, a new
            best; always after the last epoch, or at max_steps)

Nothing inside a step reads the device back (but ``on_nonfinite=skip``, which decides
every step): metrics add up in device tensors, read at check points and epochs' ends.
"""

from __future__ import annotations

import math
import time

import torch

from engine import data, distributed, health, phases, preemption, snapshot, streaming
from engine.check_point import CheckPoint, LogWindow
from engine.errors import ConfigError
from engine.metrics import (SCHEDULER, EarlyStopping, EpochMetrics, NamedMetrics, Throughput,
                            expected_mode, improves, not_logged, resolved_mode)
from engine.step import StepRunner
from engine.validation import Validation

#: The epoch's mean training loss (``train/loss``: one log window's). One name, one meaning.
EPOCH_LOSS = "train/epoch_loss"


def scheduler_metric(scheduler, cfg) -> str | None:
    """The metric a scheduler that steps on one (steps_on_metric) steps on after each
    validation (``scheduler_metric``), else None. Refused in one line before training: a
    metric missing or named for none, a per-step interval, a mode against its direction."""
    metric = cfg.scheduler_metric
    kind = type(scheduler).__name__
    if not snapshot.steps_on_metric(scheduler):
        if metric:
            has = (f"'s build_scheduler returned a {kind}" if scheduler is not None
                   else " has no build_scheduler")
            raise ConfigError(f"config key {SCHEDULER!r}: {metric!r} is for a scheduler that "
                              f"steps on a metric (ReduceLROnPlateau), and the recipe{has}; "
                              "leave scheduler_metric empty")
        return None
    if not metric:
        raise ConfigError(f"the recipe's build_scheduler returned a {kind}, which steps on "
                          "a metric: name it with scheduler_metric=NAME (a metric of the "
                          "epoch, e.g. val/loss)")
    if cfg.scheduler_interval != "epoch":
        raise ConfigError(f"config key 'scheduler_interval': {cfg.scheduler_interval!r} "
                          f"does not fit a {kind}, which steps on {metric} after each "
                          "validation; use scheduler_interval=epoch")
    expected, mode = expected_mode(cfg, metric), getattr(scheduler, "mode", None)
    if expected is not None and mode in ("min", "max") and mode != expected[0]:
        better = "lower" if expected[0] == "min" else "higher"
        raise ConfigError(f"config key {SCHEDULER!r}: {better} is better for {metric!r} "
                          f"({expected[1]}), but the recipe's {kind} has mode={mode!r}; "
                          f"build it with mode={expected[0]!r}")
    return metric


class Trainer:
    def __init__(self, ctx, parts):
        self.ctx = ctx
        self.run_parts = parts  # what the loop drives: model, optimizer, loaders (RunParts)
        self.cfg = cfg = ctx.cfg
        self.log_hook = ctx.pm.hook.engine_log if ctx.is_rank0 else None
        self.device = parts.parallel.device
        # The step (the recipe's train_step: its own, or engine/classification.py's).
        self.runner = StepRunner(parts, cfg, ctx.recipe.train_step, ctx,
                                 world_size=ctx.world.world_size, warn=ctx.warn,
                                 extras_known=self.extras_known)
        self.bind_step_hooks()
        self.throughput = Throughput(ctx.recipe)
        # The check points' slots: pre-emption's, the snapshot layer's, train_step's extras.
        self.check = CheckPoint(ctx, self.runner.nonfinite, self.throughput.metric,
                                self.log_hook)
        self.stop = preemption.StopRequest(ctx.preemption)  # the ranks agreed to stop
        if ctx.preemption is not None:
            self.check.add("preemption", self.stop.check_values, self.stop.check_agreed)
        # When a snapshot is due and where it goes (disk, shared memory).
        self.snapshots = parts.snapshots = snapshot.Snapshots(
            ctx, self.finish_before_snapshot, check_point=self.check)
        self.validation = Validation(ctx, parts, self.runner.autocast)
        self.early_stopping = EarlyStopping(cfg.early_stopping, ctx.state,
                                            by_steps=bool(cfg.val_every_steps))
        # The run's length and validation by steps (0: by epochs), and why the run ends
        # inside an epoch once it does ("max_steps", "early stopping"), else None.
        self.max_steps = cfg.max_steps
        self.val_every_steps = cfg.val_every_steps
        self.ending: str | None = None
        self.epoch_end_batch = 0  # the epoch's micro-batches in all (train_epoch)
        # The metrics the config names, checked before the first step (and config.json).
        self.named = NamedMetrics(cfg, self.throughput, self.validation.names)
        # ReduceLROnPlateau's metric (None: the scheduler steps without one), checked now.
        self.scheduler_metric = scheduler_metric(parts.scheduler, cfg)
        self.window = None  # the epoch's LogWindow while it trains (snapshots read it)
        # The epoch's loss before the snapshot a resume loaded (see load_state_dict).
        self.resumed_epoch_loss = None

    def bind_step_hooks(self) -> None:
        """A per-step hook with no implementation is never called. Bound again after
        engine_run_start, where a plugin may register one (the profiler)."""
        hook = self.ctx.pm.hook
        self.step_end_hook = (hook.engine_train_step_end
                              if hook.engine_train_step_end.get_hookimpls() else None)
        self.runner.before_step_hook = (
            hook.engine_before_optimizer_step
            if hook.engine_before_optimizer_step.get_hookimpls() else None)

    def extras_known(self, extras) -> None:
        """At the run's first micro-batch: train_step's extras (a TrainExtras, or None)
        join the check points and the names this run logs."""
        if extras is not None:
            self.check.add("extras", extras.check_values, extras.check_agreed)
        self.named.extras_known(extras.names if extras is not None else [])

    # ------------------------------------------------------- the progress part

    def state_dict(self) -> dict:
        """The snapshot part ``progress``: the TrainState and the epoch's loss sums so far
        (a resumed epoch's whole). Collective (the sums are gathered)."""
        return {**self.ctx.state.state_dict(), "epoch_loss": self.epoch_loss_so_far()}

    def local_state_dict(self) -> dict:
        """The same with this rank's own loss sums (a tensor, not read back), without a
        collective: a memory snapshot's (engine.stateful.LocalStateful)."""
        return {**self.ctx.state.state_dict(),
                "epoch_loss": self.epoch_loss_so_far(reduce=False)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.ctx.state.load_state_dict(state_dict)
        # Added to the first epoch after the resume (LogWindow.add_resumed).
        self.resumed_epoch_loss = state_dict.get("epoch_loss")

    # ------------------------------------------------------------------- fit

    def fit(self) -> str:
        """Train the epochs not yet completed; returns how the run ended: "completed"
        (every epoch, or early stopping) or "preempted" (a snapshot was written)."""
        phases.mark(phases.TRAINING_STARTS)
        self.bind_step_hooks()
        ctx = self.ctx
        if self.log_hook is not None:  # how many processes train from this step on:
            # engine-run report marks where a resumed run took over, and with how many
            self.log_hook(ctx=ctx, step=ctx.state.step,
                          metrics={"world_size": float(ctx.world.world_size)})
        if self.ctx.state.stopped_early:  # resumed from the end of an early-stopped run
            self.stop_early(again=True)
            return "completed"
        if self.reached_max_steps():  # resumed where max_steps ended the run
            ctx.print(f"already complete: {ctx.out_dir} holds a finished run of "
                      f"{ctx.state.step} steps (max_steps={self.max_steps}), nothing to "
                      f"train; to train on, ask for more (max_steps={ctx.state.step + 1} "
                      "or more, or 0 for the epochs')")
            return "completed"
        while self.ctx.state.epoch < self.cfg.epochs:
            if not self.run_epoch(self.ctx.state.epoch):
                break
        # max_steps reached as a pre-emption came: the run is complete all the same.
        return "preempted" if self.stop.requested and self.ending is None else "completed"

    def reached_max_steps(self) -> bool:
        return bool(self.max_steps) and self.ctx.state.step >= self.max_steps

    def run_epoch(self, epoch: int) -> bool:
        """Train one epoch, validate, log, snapshot if due. False when the run stops."""
        ctx, cfg = self.ctx, self.cfg
        data.start_epoch(self.run_parts.train_loader, epoch,
                         start_sample=ctx.state.batch_in_epoch * self.run_parts.micro_batch
                         * ctx.world.world_size)
        ctx.pm.hook.engine_epoch_start(ctx=ctx, epoch=epoch)
        train_metrics = self.train_epoch(epoch)
        if self.ending is not None:  # max_steps or early stopping, inside the epoch
            return self.end_in_epoch()
        # Pre-empted in the epoch or at its end (its last check point's flag): stop before
        # validating, even in the last epoch; the run resumed here finishes the epoch.
        if self.stop.requested:
            self.save_snapshot()
            return False
        self.window = None  # the epoch is complete: a snapshot has no partial loss
        # DDP syncs buffers at the start of each forward; after the last one every
        # rank's BatchNorm statistics moved on their own. Equalise before validating.
        self.run_parts.parallel.sync_buffers(self.run_parts.model)
        metrics = {**train_metrics, **self.validation.run(epoch)}
        metrics["lr"] = self.current_lr()
        health.epoch_barrier(cfg.timeout_s)
        ctx.metrics.update(metrics)
        self.named.validated(metrics)
        stop_early = self.early_stopping.update(metrics, epoch, ctx.state.step)
        new_best = self.best_improved(metrics)
        if self.log_hook is not None:  # while ctx.state.epoch is still this epoch's
            self.log_hook(ctx=ctx, metrics=metrics, step=ctx.state.step)
        ctx.state.epoch = epoch + 1
        ctx.state.batch_in_epoch = 0
        ctx.state.epochs_completed = epoch + 1
        ctx.pm.hook.engine_epoch_end(ctx=ctx, epoch=epoch, metrics=EpochMetrics(metrics))
        if self.run_parts.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.step_scheduler(metrics)
        if stop_early:  # the same decision on every rank: the metrics are reduced
            self.save_snapshot(at_end=True)
            self.stop_early()
            return False
        # The run's last epoch, or max_steps reached at this epoch's last step.
        last = ctx.state.epoch == cfg.epochs or self.reached_max_steps()
        stop = not last and self.agree_to_stop()
        if last:
            self.save_snapshot(at_end=True)
        elif stop or new_best or self.snapshots.due_at_epoch_end(ctx.state.epoch):
            self.save_snapshot()
        return not (stop or last)

    def end_in_epoch(self) -> bool:
        """The run ends inside the epoch (``self.ending``: max_steps, or early stopping at
        a validation by steps, done by validate_if_due): the final snapshot is here, mid-
        epoch (a larger max_steps trains on from it); no epoch end. Returns False."""
        self.save_snapshot(at_end=True)
        if self.ending == "early stopping":
            self.stop_early()
        return False

    def step_scheduler(self, metrics: dict) -> None:
        """The epoch's scheduler step; ReduceLROnPlateau's with its metric, reduced over
        the ranks already (the same value on every rank: no other collective)."""
        if self.scheduler_metric is None:
            self.run_parts.scheduler.step()
            return
        if self.scheduler_metric not in metrics:
            raise not_logged(SCHEDULER, self.scheduler_metric, sorted(metrics))
        before = self.current_lr()
        self.run_parts.scheduler.step(metrics[self.scheduler_metric])
        if self.current_lr() != before:  # the plateau's reduction, said once
            self.ctx.print(f"lr {before:.4g} -> {self.current_lr():.4g}: "
                           f"{self.scheduler_metric} stopped improving (ReduceLROnPlateau)")

    def stop_early(self, again: bool = False) -> None:
        ctx = self.ctx
        where = (f"at step {ctx.state.step}" if self.val_every_steps
                 else f"after epoch {ctx.state.epochs_completed}")
        ctx.print(self.early_stopping.message() + (
            f" (this run already stopped early {where}; "
            "start a new one with --no-resume or another out_dir)" if again else ""))

    # ----------------------------------------------------------------- epoch

    def train_epoch(self, epoch: int) -> dict:
        ctx = self.ctx
        parts = self.run_parts
        accum = self.cfg.grad_accum_steps
        parts.model.train()
        first_batch = ctx.state.batch_in_epoch
        # A stream (engine/streaming.py) does not know its length: its loader says at
        # each micro-batch whether it is padding and whether it is the epoch's last.
        loader = parts.train_loader
        stream = None if loader.sized else loader
        end_batch = None if stream is not None else first_batch + len(parts.train_loader)
        self.epoch_end_batch = end_batch  # None: the stream's loader knows (.last)
        window = self.window = LogWindow(self.device, parts.micro_batch * accum
                                         * ctx.world.world_size, first_batch,
                                         world_size=ctx.world.world_size)
        self.check.window_started()  # what the memory snapshots cost: from here
        count_units = self.throughput.count
        if stream is not None and count_units is None:  # a stream's batches may be short:
            count_units = streaming.batch_samples  # count its samples, not its steps
        if ctx.is_rank0:
            window.add_resumed(self.resumed_epoch_loss, parts.micro_batch)
        self.resumed_epoch_loss = None  # the first epoch after a resume only
        steps_at_start = ctx.state.step
        data_wait = 0.0
        epoch_start = fetch_start = time.perf_counter()
        for i, batch in enumerate(phases.labelled(parts.train_loader, "data wait")):
            data_wait += time.perf_counter() - fetch_start
            batch_index = first_batch + i
            # Micro-steps are grouped by absolute position, so a resumed epoch groups
            # them exactly as the uninterrupted one did.
            group_start = batch_index - batch_index % accum
            if stream is None:
                group_size = min(accum, end_batch - group_start)
                last_micro = batch_index - group_start == group_size - 1
            else:  # a stream's last group may be short: its step divides by accum still
                group_size = accum
                last_micro = batch_index - group_start == accum - 1 or stream.last
            padding = stream is not None and stream.padding  # trains nothing, counts nothing
            if count_units is not None and not padding:
                window.units += count_units(batch)
            with phases.span("forward/backward"):
                loss = self.runner.micro_batch(batch, group_size, batch_index == group_start,
                                               last_micro, padding=padding)
            if padding:
                window.padding_batches += 1
            else:
                window.add_batch(loss)
            ctx.state.batch_in_epoch = batch_index + 1
            if last_micro and self.optimizer_step(loss, window):
                break
            fetch_start = time.perf_counter()
        self.check.finish_pending()  # logged before the epoch's own metrics; run_epoch
        # acts on its slots' sums (a pre-emption; the snapshot layer's time flag)
        return self.epoch_metrics(epoch, window,
                                  batches=window.epoch_batches(ctx.state.batch_in_epoch),
                                  steps=ctx.state.step - steps_at_start,
                                  epoch_start=epoch_start,
                                  # a stream's wait for the other ranks' end-of-data
                                  # flags is waiting for peers, not for data
                                  data_wait=data_wait - (stream.peer_wait if stream else 0.0))

    def optimizer_step(self, loss, window: LogWindow) -> bool:
        """After a group's last micro-batch: step, hooks, check point, snapshot if due.
        True when the epoch stops here (a pre-emption agreed: run_epoch writes that one)."""
        ctx, parts, state = self.ctx, self.run_parts, self.ctx.state
        taken = self.runner.optimizer_step(state.step + 1)
        if self.runner.nonfinite.skip:
            window.settle(taken)
        if parts.scheduler is not None and self.cfg.scheduler_interval == "step":
            parts.scheduler.step()
        state.step += 1
        window.steps += 1
        if self.step_end_hook is not None:
            self.step_end_hook(ctx=ctx, step=state.step, loss=loss)
        if state.step % self.cfg.log_every == 0:
            with phases.span("check point"):
                self.check.start(window, self.throughput.count is not None,
                                 self.current_lr())  # finishes the previous check
        # Before any snapshot at this step: a run resumed from it starts after the step
        # and its validation, and neither redoes nor skips it.
        new_best = self.validate_if_due(state.step)
        if self.ending is not None:
            return True  # the run ends here: run_epoch writes the final snapshot
        # To disk at a new best, else as due; a pre-emption stops here (run_epoch saves).
        self.snapshots.step_ended(state.step, new_best)
        return self.stop.requested

    def finish_before_snapshot(self) -> bool:
        """The snapshot layer's, before a snapshot at a step: the check in flight finished
        (a run resumed from it would never log its window); True when a pre-emption stops
        the run here (run_epoch writes that snapshot)."""
        self.check.finish_pending()
        return self.stop.requested

    def epoch_metrics(self, epoch: int, window: LogWindow, *, batches: int, steps: int,
                      epoch_start: float, data_wait: float) -> dict:
        """One collective per epoch: every rank's loss sum, batch count and data wait,
        gathered; the loss is the mean over all ranks' batches, the data wait the
        slowest rank's (one rank starved of data holds every other at the next step)."""
        ctx = self.ctx
        mine = torch.cat([window.total_loss().reshape(1), torch.tensor(
            [batches + window.resumed_batches, data_wait, window.epoch_units + window.units],
            dtype=torch.float64, device=self.device)])
        extras = self.runner.extras
        if extras is not None:  # their sums, then their micro-batches
            mine = torch.cat([mine, extras.take_epoch()])
        ranks = distributed.all_gather_tensor(mine).tolist()  # one read-back
        loss_sum, batch_count = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
        wait = max(r[2] for r in ranks)
        units = sum(r[3] for r in ranks)  # counted units: a stream's ranks differ
        if not units and self.throughput.count is None:  # samples, a global batch a step
            units = window.samples_per_step * steps
        elapsed = time.perf_counter() - epoch_start  # after .tolist(): the device is done
        mean_loss = loss_sum / batch_count if batch_count else math.nan  # all skipped
        self.runner.nonfinite.check_epoch(mean_loss, epoch + 1, ctx.state.step)  # from 1
        # The epoch's means have names of their own (train/epoch_NAME), as train/epoch_loss:
        # train/NAME is always one log window's mean.
        extras = {} if extras is None else extras.means(
            [sum(r[4 + i] for r in ranks) for i in range(len(extras.names))],
            sum(r[-1] for r in ranks), prefix="train/epoch_")
        return {
            EPOCH_LOSS: mean_loss,
            **extras,
            self.throughput.epoch_metric: units / max(elapsed, 1e-9),
            "train/data_wait_fraction": wait / max(elapsed, 1e-9),
        }

    def epoch_loss_so_far(self, reduce: bool = True) -> dict | None:
        """For a snapshot (collective: every rank takes part): the epoch's loss sum and
        micro-batch count over all ranks so far, with the micro-batch size they are in;
        None between epochs. ``reduce=False``: this rank's alone, its sum a tensor."""
        window, ctx = self.window, self.ctx
        if window is None:
            return None
        batches = window.epoch_batches(ctx.state.batch_in_epoch) + window.resumed_batches
        if reduce:
            totals = torch.stack([window.total_loss(), torch.tensor(
                batches, dtype=torch.float64, device=self.device)])
            loss_sum, batch_count = distributed.all_reduce_sum(totals).tolist()
        else:  # a memory snapshot's: no collective, nothing read from the device
            loss_sum, batch_count = window.total_loss(), float(batches)
        return {"sum": loss_sum, "batches": batch_count,
                "micro_batch": self.run_parts.micro_batch}

    def agree_to_stop(self) -> bool:
        """At an epoch boundary: did a pre-emption signal reach any rank?"""
        ctx = self.ctx
        if ctx.preemption is None:
            return False
        flag = torch.tensor([float(bool(ctx.preemption))], device=self.device)
        self.stop.requested = distributed.all_reduce_sum(flag).item() > 0
        return self.stop.requested

    # ------------------------------------------------------------ validation

    def validate_if_due(self, step: int) -> bool:
        """After optimizer step ``step``, unless the epoch ends with it (run_epoch's): a
        validation when ``val_every_steps`` divides the step or max_steps ends the run here
        (``self.ending``), logged at the step. Training goes on as without it (RNG states,
        the model's mode, the loader); early stopping may end the run here. True when the
        validation is the new best (best_improved)."""
        ctx = self.ctx
        parts = self.run_parts
        if (parts.train_loader.last if self.epoch_end_batch is None
                else ctx.state.batch_in_epoch >= self.epoch_end_batch):
            return False
        if self.reached_max_steps():
            self.ending = "max_steps"
        elif not (self.val_every_steps and step % self.val_every_steps == 0):
            return False
        if parts.val_loader is None:
            return False
        with phases.span("validation"):
            self.check.finish_pending()  # the window before the validation is logged first
            parts.parallel.sync_buffers(parts.model)  # rank 0's statistics, as at epochs' ends
            metrics = self.validation.run(ctx.state.epoch)
            ctx.metrics.update(metrics)
            self.named.validated(metrics)
            if self.log_hook is not None:
                self.log_hook(ctx=ctx, metrics=metrics, step=step)
        if self.early_stopping.update(metrics, ctx.state.epoch, step):
            self.ending = "early stopping"
        return self.best_improved(metrics)

    def best_improved(self, metrics: dict) -> bool:
        """Whether a validation beat checkpoint.best_metric's best so far: then a snapshot
        is written at its step whatever the interval (checkpoints/best: its weights)."""
        best, state = self.cfg.checkpoint, self.ctx.state
        value = metrics.get(best.best_metric)
        if value is None or not improves(value, state.best_saved, resolved_mode(
                best.best_metric, best.best_mode, "checkpoint.best_mode")):
            return False
        state.best_saved = value
        return True

    # --------------------------------------------------------------- helpers

    def current_lr(self) -> float:
        return float(self.run_parts.optimizer.param_groups[0]["lr"])

    def save_snapshot(self, at_end: bool = False) -> None:
        # The window in flight is logged first: a run resumed from here would never log it.
        self.check.finish_pending()
        if self.cfg.checkpoint.at_end or not at_end:  # false: a throw-away run's end
            self.snapshots.save()
