"""The loop's check points: every ``log_every`` steps, on every rank, one small
all-reduce (a sum) of the log window's loss (:class:`LogWindow`) and of the named slots
that contributors registered (pre-emption, the snapshot layer, train_step's extras), each
handed its sums back by name: the loop knows no contributor's layout. The sums are read
one check point later, long arrived (waiting would cost a DDP step's latency every
window), or earlier where a snapshot or the epoch's end must see the window logged.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from engine import distributed


class CheckPoint:
    """``nonfinite``: the step's policy, which checks each window's loss; ``log``: rank
    0's engine_log, or None."""

    def __init__(self, ctx, nonfinite, per_sec_metric: str, log: Callable | None):
        self.ctx, self.nonfinite, self.log = ctx, nonfinite, log
        self.per_sec_metric = per_sec_metric  # the throughput's name
        self.slots: dict[str, tuple] = {}  # name: (values, agreed, started)
        # The check point in flight: its all-reduce, the slots' (name, offset, length)
        # in it, and what to log once it arrives (epoch, first and last step, per_sec, lr).
        self.pending: tuple | None = None

    def add(self, name: str, values: Callable, agreed: Callable,
            started: Callable | None = None) -> None:
        """Register slot ``name``: ``values(window_s, window_steps)`` gives its values at
        each check point (floats, or a 1-d tensor on the device; as many each time),
        ``agreed(sums)`` gets their sums over the ranks and returns the metrics to log
        beside the loss (or None), ``started()`` hears that an epoch's first window
        starts. Every rank registers the same slots in the same order."""
        self.slots[name] = (values, agreed, started)

    def window_started(self) -> None:
        for _, _, started in self.slots.values():
            if started is not None:
                started()

    def start(self, window: LogWindow, counted: bool, lr: float) -> None:
        """Start this check point's all-reduce, then finish the previous one (``counted``:
        the throughput is in the recipe's units)."""
        ctx, now = self.ctx, time.perf_counter()
        # The loss, the values given as floats (the micro-batch count first: a stream's
        # ranks differ), then those given as tensors.
        host, tensors, layout = [float(window.batches)], [], []
        for name, (give, _, _) in self.slots.items():
            values = give(now - window.start, window.steps)
            if isinstance(values, torch.Tensor):
                tensors.append((name, values.float()))
            else:
                layout.append((name, 1 + len(host), len(values)))
                host += values
        at = 1 + len(host)
        for name, values in tensors:
            layout.append((name, at, len(values)))
            at += len(values)
        loss = window.loss.float().reshape(1)
        reduced = torch.cat([loss, loss.new_tensor(host), *(v for _, v in tensors)])
        started = (distributed.start_all_reduce_sum(reduced), layout, ctx.state.epoch,
                   ctx.state.step - window.steps + 1, ctx.state.step,
                   window.per_sec(now, counted), lr)
        window.restart(now)
        previous, self.pending = self.pending, started
        self.finish(previous)

    def finish_pending(self) -> None:
        """Finish the check point in flight, if any (before a collective that must see
        its window logged: the epoch's end, a snapshot)."""
        check, self.pending = self.pending, None
        self.finish(check)

    def finish(self, check: tuple | None) -> None:
        """The window's mean loss over all ranks, checked and logged with the slots'
        metrics, each slot handed its sums: at the same step on every rank, whoever
        finishes it (a check point, a snapshot, the epoch's end)."""
        if check is None:
            return
        reduction, layout, epoch, first_step, step, per_sec, lr = check
        sums = reduction.values()
        # The mean over all ranks' micro-batches (with accumulation, a step has several);
        # NaN when on_nonfinite=skip skipped every step of the window.
        loss = window_mean(sums[0], sums[1], self.ctx.world.world_size)
        self.nonfinite.check_window(loss, first=first_step, last=step,
                                    epoch=epoch + 1)  # counted from 1
        metrics = {"train/loss": loss}
        for name, at, length in layout:
            metrics.update(self.slots[name][1](sums[at:at + length]) or {})
        metrics.update({self.per_sec_metric: per_sec, "lr": lr})
        self.ctx.metrics.update(metrics)  # summary.json's train_loss: the last window's
        if self.log is not None:
            self.log(ctx=self.ctx, step=step, metrics=metrics)


def window_mean(loss_sum: float, batches: float, world_size: int) -> float:
    """A log window's mean loss: ``loss_sum`` over ``batches``, both summed over the
    ranks; NaN for no micro-batch. Where every rank trained as many (map-style data),
    per rank, then over the ranks, as the logs always were (one division rounds else)."""
    if not batches:
        return math.nan
    if batches % world_size == 0:
        return loss_sum / (batches // world_size) / world_size
    return loss_sum / batches  # a stream's ranks differ: there is no per-rank count


class LogWindow:
    """The micro-batches and steps since the last check point. Losses add up on the
    device (one add per micro-batch), folded into the epoch's sum at each check point.
    A step ``on_nonfinite=skip`` skipped leaves the sums (:meth:`settle`): the losses
    logged are those of the steps taken, not NaN."""

    def __init__(self, device, samples_per_step: int, first_batch: int = 0,
                 world_size: int = 1):
        self.samples_per_step = samples_per_step
        # A recipe's own throughput unit, counted in this rank's batches (the world's:
        # times world_size), in the window and in the epoch.
        self.world_size = world_size
        self.units = self.epoch_units = 0
        self.loss = torch.zeros((), device=device)
        self.epoch_loss = torch.zeros((), device=device)
        self.batches = self.steps = 0
        self.first_batch = first_batch  # where this epoch (re)started, per rank
        # on_nonfinite=skip: the window after the last step taken; the epoch's micro-
        # batches in skipped steps (the same on every rank).
        self.kept_loss = torch.zeros((), device=device)
        self.kept_batches = self.skipped_batches = 0
        self.padding_batches = 0  # a stream's this epoch: weight 0, in no sum nor count
        # A resumed epoch's loss before the snapshot, in this run's micro-batches: the
        # epoch's metric covers the whole epoch. Rank 0 carries it (the sums are global).
        self.resumed_loss = 0.0
        self.resumed_batches = 0.0
        self.start = time.perf_counter()

    def add_resumed(self, saved: dict | None, micro_batch: int) -> None:
        """A snapshot's ``epoch_loss`` (Trainer.epoch_loss_so_far), in this run's micro-
        batches (the number of processes may have changed): every sample weighs alike."""
        if not saved:
            return
        scale = saved["micro_batch"] / micro_batch
        self.resumed_loss = saved["sum"] * scale
        self.resumed_batches = saved["batches"] * scale

    def add_batch(self, loss) -> None:
        self.loss += loss
        self.batches += 1

    def epoch_batches(self, batch_in_epoch: int) -> int:
        """This rank's micro-batches in the epoch's loss sum so far, from where this run
        started it: neither those of skipped steps nor a stream's padding."""
        return (batch_in_epoch - self.first_batch - self.skipped_batches
                - self.padding_batches)

    def settle(self, taken: bool) -> None:
        """``on_nonfinite=skip``, after each optimizer step: keep its micro-batches'
        losses, or drop them when the step was skipped."""
        if taken:
            self.kept_loss.copy_(self.loss)
            self.kept_batches = self.batches
        else:
            self.skipped_batches += self.batches - self.kept_batches
            self.loss.copy_(self.kept_loss)
            self.batches = self.kept_batches

    def per_sec(self, now: float, counted: bool) -> float:
        """The window's throughput: samples (``samples_per_step`` a step), or the
        recipe's ``counted`` units."""
        done = self.units * self.world_size if counted else self.samples_per_step * self.steps
        return done / (now - self.start)

    def restart(self, now: float) -> None:
        self.epoch_units += self.units
        self.units = 0
        self.epoch_loss += self.loss
        self.loss.zero_()
        self.kept_loss.zero_()
        self.steps = self.batches = self.kept_batches = 0
        self.start = now

    def total_loss(self):
        """The epoch's loss sum on this rank so far, this window's included; the
        resumed part (rank 0's) too."""
        return (self.epoch_loss + self.loss).double() + self.resumed_loss
