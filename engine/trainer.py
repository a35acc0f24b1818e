"""The training loop.

``Trainer.fit`` in pseudocode, with the method that holds each part on the right (the
hooks it fires, and when: docs/plugins.md, "Hooks in the order they fire")::

    log world_size at the step the run starts from (rank 0)          fit
    for epoch in epochs not yet completed:                          run_epoch
        sampler.set_epoch(epoch, from the global sample position a resumed snapshot
                          reached: the rest of the order split over these ranks)
        for each micro-batch:                                       train_epoch
            batch to the device; forward and loss (the recipe's     run_batch
            train_step); a group's first micro-step: the last step's gradients
            freed; backward (DDP all-reduces them in a group's last micro-step only)
            after a group's last micro-step:                        optimizer_step
                unless on_nonfinite=skip skips the step:
                    unscale (fp16), clip to grad_clip_norm          before_optimizer_step
                    optimizer step
                scheduler if per step
                every log_every steps: start one all-reduce of the  check_point
                    window's loss, the pre-emption and the snapshot layer's
                    flags; finish the previous check point's: logged,  finish_check
                    its flags recorded
                unless the epoch ends here, every val_every_steps steps validate_if_due
                    and where max_steps ends the run: validate, log
                    its val/* at the step, early stopping (may end the run)
                this step ended: a snapshot to disk if the validation was a new best,
                    else the snapshot layer's if due: to disk       Snapshots.step_ended
                    (every_steps, a check's time flag) or into shared memory
                stop the epoch if a finished check said pre-empted, or if the
                    run ends at this step
        the last check point's result (its flags recorded)          finish_check
        the epoch's loss (a resumed epoch's included) and the slowest
        rank's data wait, gathered from all ranks                   epoch_metrics
        the run ended inside the epoch (max_steps, early stopping):
            the final snapshot, stop                                end_in_epoch
        pre-empted (a check point said so, the last one included):
            snapshot, stop                                          run_epoch
        the recipe's eval_step, reduced (every validation: the     validate
            RNG states forked around it)
        log the epoch's metrics; scheduler if per epoch             step_scheduler
            (ReduceLROnPlateau: with scheduler_metric's reduced value)
        early stopping, pre-emption, snapshot if due (a check's time flag, a new
            best; always after the last epoch, or at max_steps)

The phases of a step are ranges in a profiler's trace while one records
(engine/phases.py: span). Nothing inside a step reads a value back from the device
(except ``on_nonfinite=skip``, which must decide every step): metrics accumulate in
device tensors, read at the log interval and at the end of the epoch. The policies are
small objects: :class:`NonFinitePolicy`, :class:`LogWindow` (the losses and timing
between two check points), :class:`EarlyStopping`; when a snapshot is due, and where
it goes, is the snapshot layer's (:class:`~engine.snapshot.Snapshots`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time

import attrs
import torch

from engine import data, distributed, health, phases, snapshot, stateful, streaming
from engine.errors import ConfigError, EngineError, PeerFailed, RunError
from engine.metrics import (EARLY, EPOCH_END, SCHEDULER, EpochMetrics, expected_mode,
                            improves, named, not_logged, resolved_mode)


#: The epoch's mean training loss; ``train/loss`` is the mean of one log window (the
#: ``log_every`` steps before a check point). One name, one meaning.
EPOCH_LOSS = "train/epoch_loss"


class NonFiniteLoss(RunError):
    """The loss became non-finite: the run failed (exit code 1)."""


class NonFinitePolicy:
    """``on_nonfinite``: what a non-finite training loss does.

    ``stop`` costs nothing per step: the loss of each log window (reduced over the ranks
    at the check point) and the epoch's mean loss are checked, and a non-finite one stops
    the run. ``skip`` ANDs every micro-batch's finiteness into a device flag (a NaN in any
    micro-batch poisons the accumulated gradients, not only one in the last); at the
    optimizer step one all-reduce tells every rank alike whether to step: a host sync
    per step, the price of deciding per step.
    """

    def __init__(self, mode: str, device, world_size: int, warn):
        self.skip = mode == "skip"
        self.world_size = world_size
        self.warn = warn
        self.skipped_steps = 0
        self.finite = torch.ones((), dtype=torch.bool, device=device) if self.skip else None

    def observe(self, loss) -> None:
        """Every micro-batch's (detached) loss."""
        if self.skip:
            self.finite &= torch.isfinite(loss)

    def allow_step(self, step: int) -> bool:
        """At the optimizer step that will be number ``step``: take it?"""
        if not self.skip:
            return True
        flag = self.finite.float().reshape(1)
        self.finite.fill_(True)
        if distributed.all_reduce_sum(flag).item() == self.world_size:
            return True
        self.skipped_steps += 1
        self.warn(f"non-finite loss at step {step}: step skipped (on_nonfinite=skip)")
        return False

    def check_window(self, loss: float, first: int, last: int, epoch: int) -> None:
        if not self.skip and not math.isfinite(loss):
            raise NonFiniteLoss(
                f"the training loss became non-finite ({loss}) between steps {first} and "
                f"{last} (epoch {epoch}); lower lr, check the data, or set on_nonfinite=skip")

    def check_epoch(self, loss: float, epoch: int, step: int) -> None:
        if not self.skip and not math.isfinite(loss):
            raise NonFiniteLoss(f"the training loss is not finite ({loss}) in epoch "
                                f"{epoch}, by step {step}")


@attrs.define(slots=True)
class PendingCheck:
    """A check point whose all-reduce is in flight, and what to log once it arrives."""

    reduction: distributed.Reduction
    epoch: int
    first_step: int
    step: int
    per_sec: float  # the throughput, in the recipe's unit
    lr: float


class LogWindow:
    """The micro-batches and steps since the last check point. Losses add up on the
    device in one tensor (one add per micro-batch); at each check point the window is
    folded into the epoch's sum and starts again. Under ``on_nonfinite=skip`` a skipped
    step's micro-batches leave the sums (:meth:`settle`): the logged losses are those
    of the steps taken, not NaN."""

    def __init__(self, device, samples_per_step: int, first_batch: int = 0,
                 world_size: int = 1):
        self.samples_per_step = samples_per_step
        # A recipe's own throughput unit (Throughput): counted in this rank's batches,
        # in the window and in the epoch; the world's is that times world_size.
        self.world_size = world_size
        self.units = self.epoch_units = 0
        self.loss = torch.zeros((), device=device)
        self.epoch_loss = torch.zeros((), device=device)
        self.batches = self.steps = 0
        self.first_batch = first_batch  # where this epoch (re)started, per rank
        # on_nonfinite=skip: the window after the last step taken, and the epoch's
        # micro-batches in skipped steps (the same on every rank: the ranks agree).
        self.kept_loss = torch.zeros((), device=device)
        self.kept_batches = self.skipped_batches = 0
        # A stream's padding micro-batches this epoch (engine/streaming.py): trained with
        # weight 0, in no loss sum, so in no count either.
        self.padding_batches = 0
        # A resumed epoch's loss before the snapshot, in this run's micro-batches: the
        # epoch's metric covers the whole epoch. Rank 0 carries it (the sums are global).
        self.resumed_loss = 0.0
        self.resumed_batches = 0.0
        self.start = time.perf_counter()

    def add_resumed(self, saved: dict | None, micro_batch: int) -> None:
        """A snapshot's ``epoch_loss`` (Trainer.epoch_loss_so_far), converted to this
        run's micro-batch size when the number of processes changed: the mean weighs
        every sample alike."""
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


class Throughput:
    """What ``train/<unit>_per_sec`` (a log window's) and ``train/epoch_<unit>_per_sec``
    (an epoch's) count: samples by default (the global batch of a step), or the recipe's
    own unit, ``throughput_unit = "tokens"`` with ``count_throughput(batch) -> int`` (the
    units in one micro-batch, read from its shapes on the host: no device sync)."""

    def __init__(self, recipe):
        self.unit = recipe.optional("throughput_unit") or "samples"
        self.count = recipe.optional("count_throughput")
        if (self.count is None) != (self.unit == "samples"):
            raise ConfigError(
                f"the recipe declares throughput_unit={self.unit!r} "
                + ("without count_throughput(batch) -> int (the units in a micro-batch)"
                   if self.count is None else "as samples with a count_throughput: "
                   "name its unit, e.g. throughput_unit = 'tokens'"))
        self.metric = f"train/{self.unit}_per_sec"
        self.epoch_metric = f"train/epoch_{self.unit}_per_sec"


class TrainExtras:
    """What a ``train_step`` returns beside the loss (``{"loss": loss, "accuracy": ...}``):
    each a micro-batch mean, summed on the device like the loss (one add per
    micro-batch) and logged as ``train/NAME``, the mean over the window's micro-batches
    and the ranks at check points, over the epoch's (this run's part of a resumed epoch)
    at the epoch end."""

    def __init__(self, names: list[str], device):
        self.names = names
        self.window = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.epoch = torch.zeros_like(self.window)
        self.window_batches = self.epoch_batches = 0
        # on_nonfinite=skip: the window after the last step taken (LogWindow.settle).
        self.kept = torch.zeros_like(self.window)
        self.kept_batches = 0

    def add(self, out: dict) -> None:
        self.window += torch.stack([torch.as_tensor(out[n]).detach().double().to(
            self.window.device) for n in self.names])
        self.window_batches += 1

    def settle(self, taken: bool) -> None:
        """``on_nonfinite=skip``, after each optimizer step: keep its micro-batches'
        metrics, or drop them with the step, as its losses are (one NaN metric of a
        skipped step made the window's and the whole epoch's mean NaN)."""
        if taken:
            self.kept.copy_(self.window)
            self.kept_batches = self.window_batches
        else:
            self.window.copy_(self.kept)
            self.window_batches = self.kept_batches

    def take_window(self) -> tuple[torch.Tensor, int]:
        """The window's sums (a new tensor, for the check point's all-reduce) and its
        micro-batches; the window starts again."""
        sums, batches = self.window.clone(), self.window_batches
        self.epoch += self.window
        self.epoch_batches += batches
        self.window.zero_()
        self.kept.zero_()
        self.window_batches = self.kept_batches = 0
        return sums, batches

    def take_epoch(self) -> torch.Tensor:
        """The epoch's sums and micro-batches (the last entry); both start again."""
        self.take_window()
        total = torch.cat([self.epoch, self.epoch.new_tensor([self.epoch_batches])])
        self.epoch.zero_()
        self.epoch_batches = 0
        return total

    def means(self, sums, batches: float, prefix: str = "train/") -> dict:
        return {f"{prefix}{n}": (v / batches if batches else math.nan)
                for n, v in zip(self.names, sums)}


class MetricSums:
    """What ``eval_step`` returns, summed over the batches of a rank; then one
    all-reduce over the ranks, and every sum divided by the ``count`` sum, or, when the
    recipe defines ``eval_metrics(sums)``, whatever it derives from the reduced sums
    (a perplexity, an F1 from counts: metrics that are no sum divided by a count).

    Tensors add up on the device (no sync per batch); Python numbers on the host. The
    names come from the first batch; rank 0, which holds the most validation samples,
    tells the others, so a rank with no batch at all still joins the same reduction.
    """

    def __init__(self, device, derive=None):
        self.device = device
        self.derive = derive
        self.names: list[str] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.numbers: dict[str, float] = {}

    def add(self, sums: dict) -> None:
        if self.names is None:
            if not isinstance(sums, dict) or ("count" not in sums and self.derive is None):
                raise EngineError(
                    "eval_step must return a dict of metric sums with a 'count' (the number "
                    f"of samples they cover), e.g. {{'loss': ..., 'count': n}}; got {sums!r}")
            self.names = list(sums)
        for name in self.names:
            value = sums[name]
            if isinstance(value, torch.Tensor):
                value = value.detach().double()
                if name in self.tensors:
                    self.tensors[name] += value
                else:
                    self.tensors[name] = value.clone()
            else:
                self.numbers[name] = self.numbers.get(name, 0.0) + float(value)

    def reduce(self) -> dict:
        """``{"val/NAME": sum over ranks / count}``, identical on every rank."""
        names = distributed.broadcast_object(self.names)
        if not names:
            return {}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # A name may have come as a tensor from some batches and a number from others.
        values = torch.stack([self.tensors.get(n, zero) + self.numbers.get(n, 0.0)
                              for n in names])
        totals = dict(zip(names, distributed.all_reduce_sum(values).tolist()))
        if totals.get("count", 1) == 0:
            return {}  # no validation sample on any rank
        if self.derive is not None:
            return {f"val/{name}": float(value) for name, value in self.derive(totals).items()}
        count = totals.pop("count")
        return {f"val/{name}": total / count for name, total in totals.items()}


class EarlyStopping:
    """``early_stopping.*``: stop when ``metric`` has not improved by more than
    ``min_delta`` for ``patience`` validations (``mode`` as ``checkpoint.best_mode``).
    Its best is compared as the checkpointer compares (no min_delta); ``min_delta``
    counts the patience only. The metrics are reduced over the ranks, so every rank
    decides alike; the count lives in the TrainState, which snapshots save."""

    def __init__(self, cfg, state, by_steps: bool = False):
        self.metric = cfg.metric
        self.mode = (resolved_mode(cfg.metric, cfg.mode, "early_stopping.mode")
                     if cfg.metric else None)
        self.patience = cfg.patience
        self.min_delta = cfg.min_delta
        self.state = state
        # val_every_steps: the patience counts validations, inside epochs too, and the
        # best is named by its step.
        self.by_steps = by_steps

    def update(self, metrics: dict, epoch: int, step: int = 0) -> bool:
        """After a validation in ``epoch`` (from 0; at its end, or after optimizer step
        ``step`` with val_every_steps): True when the run must stop now."""
        if not self.metric:
            return False
        if self.metric not in metrics:
            raise not_logged(EARLY, self.metric, sorted(metrics))
        value, s = metrics[self.metric], self.state
        if s.reference_metric is None:  # a snapshot written before the field: its best
            s.reference_metric = s.best_metric  # was the reference
        if improves(value, s.best_metric, self.mode):
            s.best_metric, s.best_epoch, s.best_step = value, epoch + 1, step
        if improves(value, s.reference_metric, self.mode, self.min_delta):
            s.reference_metric, s.epochs_without_improvement = value, 0
        else:
            s.epochs_without_improvement += 1
        s.stopped_early = s.epochs_without_improvement >= self.patience
        return s.stopped_early

    def message(self) -> str:
        s = self.state
        at = (f"step {s.best_step} (epoch {s.best_epoch})" if self.by_steps
              else f"epoch {s.best_epoch}")
        best = "none" if s.best_metric is None else f"{s.best_metric:.4g} at {at}"
        compared = ("" if not self.min_delta or s.reference_metric is None else
                    f" by more than {self.min_delta:g} on {s.reference_metric:.4g}")
        counted = "validations" if self.by_steps else "epochs"
        return (f"early stopping: {self.metric} did not improve{compared} for "
                f"{s.epochs_without_improvement} {counted}; best {best}")


def window_mean(loss_sum: float, batches: float, world_size: int) -> float:
    """A log window's mean loss: ``loss_sum`` over ``batches``, both summed over the
    ranks; NaN for no micro-batch. Where every rank trained as many (map-style data),
    divided per rank, then by the ranks, as the logs always were: one division by the
    product rounds differently (a last-digit change in metrics.csv with 3 processes)."""
    if not batches:
        return math.nan
    if batches % world_size == 0:
        return loss_sum / (batches // world_size) / world_size
    return loss_sum / batches  # a stream's ranks differ: there is no per-rank count


def scheduler_metric(scheduler, cfg) -> str | None:
    """The metric a scheduler that steps on one (steps_on_metric) steps on after each
    validation (``scheduler_metric``), else None. Refused in one line before training:
    such a scheduler without a metric named, stepped per step, or whose mode disagrees
    with the metric's direction; a metric named for a scheduler that takes none."""
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


def autocast_for(precision: str, device):
    """What the steps run under: nothing at 32, else autocast to bf16 or fp16."""
    if precision == "32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


class Trainer:
    def __init__(self, ctx, parts):
        self.ctx = ctx
        self.run_parts = parts  # what the loop drives: model, optimizer, loaders (RunParts)
        self.cfg = ctx.cfg
        hook = ctx.pm.hook
        self.bind_step_hooks()
        self.log_hook = hook.engine_log if ctx.is_rank0 else None
        self.clip_norm = self.cfg.grad_clip_norm
        self.device = device = parts.parallel.device
        self.autocast = autocast_for(self.cfg.precision, device)
        self.non_blocking = device.type == "cuda"
        # The loaders yield CPU tensors: on the CPU there is nothing to move, every batch.
        self.moves_batches = device.type != "cpu"
        # The recipe's steps (its own, or a helper it names: engine/classification.py).
        recipe = ctx.recipe
        self.train_step = self.first_train_step
        self.checked_train_step = recipe.train_step
        self.eval_step = recipe.optional("eval_step")
        self.eval_metrics = recipe.optional("eval_metrics")
        self.throughput = Throughput(recipe)
        self.extras: TrainExtras | None = None  # train_step returns a dict (first_train_step)
        self.nonfinite = NonFinitePolicy(self.cfg.on_nonfinite, device,
                                         ctx.world.world_size, ctx.warn)
        # When a snapshot is due and where it goes (disk, shared memory); it finishes
        # the check in flight before one (finish_before_snapshot).
        self.snapshots = parts.snapshots = snapshot.Snapshots(
            ctx, finish_check=self.finish_before_snapshot)
        self.early_stopping = EarlyStopping(self.cfg.early_stopping, ctx.state,
                                            by_steps=bool(self.cfg.val_every_steps))
        # The run's length by steps (0: the epochs decide), validation by steps (0: at
        # epochs' ends only), and why the run ends inside an epoch once it does
        # ("max_steps", "early stopping": end_in_epoch), else None.
        self.max_steps = self.cfg.max_steps
        self.val_every_steps = self.cfg.val_every_steps
        self.ending: str | None = None
        self.epoch_end_batch = 0  # the epoch's micro-batches in all (train_epoch)
        # The metrics the config names (check_named_metrics): the val/* names (None: not
        # known before the first validation), and those to check once more is known.
        self.val_names: list[str] | None = []
        self.unchecked: list[tuple[str, str]] = []
        self.check_named_metrics()  # before the first step (and config.json)
        # ReduceLROnPlateau's metric (None: the scheduler steps without one), checked now.
        self.scheduler_metric = scheduler_metric(parts.scheduler, self.cfg)
        self.stop_requested = False  # the ranks agreed to stop (see engine/preemption.py)
        self.window = None  # the epoch's LogWindow while it trains (snapshots read it)
        self.pending = None  # the check point whose all-reduce is in flight
        # The epoch's loss before the snapshot a resume loaded (see load_state_dict).
        self.resumed_epoch_loss = None

    def bind_step_hooks(self) -> None:
        """A per-step hook with no implementation is never called. Bound again after
        engine_run_start, where a plugin may register one for this run (the profiler)."""
        hook = self.ctx.pm.hook
        self.step_end_hook = (hook.engine_train_step_end
                              if hook.engine_train_step_end.get_hookimpls() else None)
        self.before_step_hook = (hook.engine_before_optimizer_step if
                                 hook.engine_before_optimizer_step.get_hookimpls() else None)

    # ------------------------------------------------------- the progress part

    def state_dict(self) -> dict:
        """The snapshot part ``progress``: the TrainState and the epoch's loss sums so far
        (a resumed epoch reports the whole epoch's). Collective (the sums are gathered)."""
        return {**self.ctx.state.state_dict(), "epoch_loss": self.epoch_loss_so_far()}

    def local_state_dict(self) -> dict:
        """The same with this rank's own loss sums, without a collective: a memory
        snapshot's, which sums them over the ranks at a resume (engine.stateful.LocalStateful)."""
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
        return "preempted" if self.stop_requested and self.ending is None else "completed"

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
        # Pre-empted half-way through the epoch, or at its end (its last check point,
        # finished there, carried the flag): stop before validating, even in the last
        # epoch, where no check point would come again. The snapshot is at the position
        # reached; the run resumed from it finishes the epoch.
        if self.stop_requested:
            self.save_snapshot()
            return False
        self.window = None  # the epoch is complete: a snapshot has no partial loss
        # DDP syncs buffers at the start of each forward; after the last one every
        # rank's BatchNorm statistics moved on their own. Equalise before validating.
        self.run_parts.parallel.sync_buffers(self.run_parts.model)
        metrics = {**train_metrics, **self.validate(epoch)}
        metrics["lr"] = self.current_lr()
        health.epoch_barrier(cfg.timeout_s)
        ctx.metrics.update(metrics)
        self.learn_val_names(metrics)
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
        """The run ends inside the epoch (``self.ending``): max_steps reached, or early
        stopping at a validation by steps. That step's validation is done
        (validate_if_due); the final snapshot is at this position, mid-epoch, so that a
        resume with a larger max_steps trains on from it. No epoch end (the epoch is not
        complete): returns False, the run stops."""
        self.save_snapshot(at_end=True)
        if self.ending == "early stopping":
            self.stop_early()
        return False

    def learn_val_names(self, metrics: dict) -> None:
        """After a validation: the val/ names one validation batch could not tell
        (check_named_metrics) are known now; a named one it did not log is refused."""
        if self.unchecked:
            self.val_names = [name for name in metrics if name.startswith("val/")]
            self.unchecked = self.refuse_unlogged(self.unchecked, extras_known=True)

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
        self.snapshots.window_started()  # what the memory snapshots cost: from here
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
                loss = self.run_batch(batch, group_size, batch_index == group_start,
                                      last_micro, padding=padding)
            if padding:
                window.padding_batches += 1
            else:
                window.add_batch(loss)
            ctx.state.batch_in_epoch = batch_index + 1
            if last_micro and self.optimizer_step(loss, window):
                break
            fetch_start = time.perf_counter()
        self.finish_pending()  # logged before the epoch's own metrics; run_epoch acts
        # on its flags (stop_requested; the snapshot layer's time flag)
        return self.epoch_metrics(epoch, window,
                                  batches=window.epoch_batches(ctx.state.batch_in_epoch),
                                  steps=ctx.state.step - steps_at_start,
                                  epoch_start=epoch_start,
                                  # a stream's wait for the other ranks' end-of-data
                                  # flags is waiting for peers, not for data
                                  data_wait=data_wait - (stream.peer_wait if stream else 0.0))

    def first_train_step(self, batch, ctx):
        """The run's first micro-batch: the step's loss checked once (a loss of another
        shape failed deep in autograd), then the step itself for every later batch. A
        dict holds the loss and the recipe's extra metrics (TrainExtras)."""
        out = self.checked_train_step(batch, ctx)
        if isinstance(out, dict) and "loss" not in out:
            raise ConfigError(f"train_step returned a dict without 'loss' (keys: "
                              f"{', '.join(map(str, out))}); return {{'loss': loss, ...}}")
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                    else f"a {type(loss).__name__}")
            raise ConfigError(f"train_step must return the micro-batch's loss as a scalar "
                              f"tensor (shape ()), not {what}; reduce it, e.g. with .mean()")
        if isinstance(out, dict):
            self.extras = TrainExtras([n for n in out if n != "loss"], self.device)
        if self.unchecked:  # train/ names that may have been train_step's extras
            self.unchecked = self.refuse_unlogged(self.unchecked, extras_known=True)
        self.train_step = self.checked_train_step
        return out

    def run_batch(self, batch, group_size: int, first_micro: bool, last_micro: bool,
                  padding: bool = False):
        """Forward and backward of one micro-batch; returns its loss, detached. DDP
        all-reduces the gradients only in the backward of a group's last micro-batch.
        The last step's gradients are freed just before a group's first backward, not
        after the step: hooks after it see them, and glibc reuses their memory for the
        new ones instead of faulting in fresh pages (docs/performance.md).
        A stream's ``padding`` micro-batch (engine/streaming.py) weighs 0: it only keeps
        this rank in the gradient all-reduces of ranks whose part of the stream is longer."""
        ctx = self.ctx
        parts = self.run_parts
        if self.moves_batches:
            batch = data.to_device(batch, self.device, non_blocking=self.non_blocking)
        with (contextlib.nullcontext() if last_micro
              else parts.parallel.no_sync(parts.model)):
            with self.autocast():
                loss = self.train_step(batch, ctx)
            if self.extras is not None:
                if not padding:  # it repeats a batch: its metrics count once
                    self.extras.add(loss)
                loss = loss["loss"]
            scaled = loss / group_size if group_size > 1 else loss
            if padding:
                scaled = scaled * 0.0
            if first_micro:
                parts.optimizer.zero_grad(set_to_none=True)
            if parts.scaler is not None:
                parts.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        loss = loss.detach()
        self.nonfinite.observe(loss)
        return loss

    def optimizer_step(self, loss, window: LogWindow) -> bool:
        """After a group's last micro-batch: step, hooks, check point, snapshot if due.
        Returns True when the epoch must stop here (the ranks agreed on a pre-emption:
        run_epoch writes the snapshot)."""
        ctx = self.ctx
        parts = self.run_parts
        optimizer, scaler, state = parts.optimizer, parts.scaler, ctx.state
        taken = self.nonfinite.allow_step(state.step + 1)
        if self.nonfinite.skip:
            window.settle(taken)
            if self.extras is not None:
                self.extras.settle(taken)
        if taken:
            with phases.span("optimizer step"):
                if self.clip_norm is not None or self.before_step_hook is not None:
                    self.before_optimizer_step(state.step + 1)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
        if parts.scheduler is not None and self.cfg.scheduler_interval == "step":
            parts.scheduler.step()
        state.step += 1
        window.steps += 1
        if self.snapshots.note_reached is not None:  # the memory tier's: how far the run
            self.snapshots.note_reached(state.step)  # got (a restart says what it lost)
        if self.step_end_hook is not None:
            self.step_end_hook(ctx=ctx, step=state.step, loss=loss)
        if state.step % self.cfg.log_every == 0:
            with phases.span("check point"):
                self.check_point(window)  # finishes the previous check: its flags
        # Before any snapshot at this step: a run resumed from it starts after the step
        # and its validation, and neither redoes nor skips it.
        new_best = self.validate_if_due(state.step)
        if self.ending is not None:
            return True  # the run ends here: run_epoch writes the final snapshot
        # This step ended: a snapshot to disk if its validation is the new best, else
        # one if due (disk, memory), asked from the step the layer says one may be due
        # at. Either may finish this step's check: its flags (a pre-emption: run_epoch
        # writes the snapshot).
        if new_best and not self.finish_before_snapshot():
            self.snapshots.save()
        elif not self.stop_requested and state.step >= self.snapshots.next_due:
            self.snapshots.step_ended(state.step)
        return self.stop_requested

    def finish_before_snapshot(self) -> bool:
        """The snapshot layer's, before a snapshot at a step: the check in flight is
        finished (its window logged: a run resumed from the snapshot starts after it and
        would never log it), its flags recorded. True when they stop the run here (a
        pre-emption: run_epoch writes the durable snapshot as the epoch stops)."""
        self.finish_pending()
        return self.stop_requested

    def before_optimizer_step(self, step: int) -> None:
        """Between the last backward of a group and the optimizer step, on the true
        gradients: unscaled (fp16), and already averaged over the ranks (DDP reduced
        them in that backward). Clip to ``grad_clip_norm``, then the plugins' hook."""
        ctx = self.ctx
        parts = self.run_parts
        if parts.scaler is not None:
            # scaler.step() then sees that they are unscaled and does not do it again.
            parts.scaler.unscale_(parts.optimizer)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(parts.model.parameters(), self.clip_norm)
        if self.before_step_hook is not None:
            self.before_step_hook(ctx=ctx, step=step, optimizer=parts.optimizer)

    def check_point(self, window: LogWindow) -> None:
        """Every ``log_every`` steps, on every rank: start one small all-reduce of the
        window's loss, the ranks' pre-emption and time-based snapshot flags and the
        memory interval each proposes (Snapshots.check_flags), then
        finish the previous check point's. Waiting for the sums here would cost a DDP
        step's worth of latency every window; a window later they have long arrived. A
        pre-emption therefore stops the run one window after the ranks saw it, or at
        once where a snapshot at this step waits for the sums anyway (Snapshots.step_ended).
        The flags are recorded (finish_check); optimizer_step acts on them."""
        ctx = self.ctx
        now = time.perf_counter()
        preempted = ctx.preemption is not None and bool(ctx.preemption)
        # The snapshot layer's flags (Snapshots.check_flags: a snapshot due by time, a
        # memory buffer lost, the memory interval this rank's costs allow).
        flags = self.snapshots.check_flags(now - window.start, window.steps)
        extra_batches = 0
        if self.extras is not None:
            extra_sums, extra_batches = self.extras.take_window()
        # The micro-batch counts are summed too: a stream's ranks differ (one that ran
        # out of data trains padding, which counts nothing, for whole windows).
        values = torch.cat([window.loss.float().reshape(1), window.loss.new_tensor(
            [float(preempted), float(window.batches), float(extra_batches), *flags],
            dtype=torch.float32)])
        if self.extras is not None:
            values = torch.cat([values, extra_sums.float()])
        started = PendingCheck(distributed.start_all_reduce_sum(values), ctx.state.epoch,
                               first_step=ctx.state.step - window.steps + 1,
                               step=ctx.state.step,
                               per_sec=window.per_sec(now, self.throughput.count is not None),
                               lr=self.current_lr())
        window.restart(now)
        previous, self.pending = self.pending, started
        self.finish_check(previous)

    def finish_pending(self) -> None:
        """Finish the check point in flight, if any (before a collective that must see
        its window logged: the epoch's end, a snapshot)."""
        check, self.pending = self.pending, None
        self.finish_check(check)

    def finish_check(self, check: PendingCheck | None) -> None:
        """The mean loss of the check's window over all ranks, checked and logged. Its
        flags are recorded, whoever finished it (a check point, a snapshot, the epoch's
        end): ``stop_requested`` when any rank was pre-empted; the snapshot layer's (a
        snapshot due by time on rank 0's clock, a rank's memory buffer that failed:
        Snapshots.agreed). Every rank finishes the same checks at the same steps, so
        every rank records the same."""
        if check is None:
            return
        ctx = self.ctx
        loss_sum, preempted, batches, extra_batches, *rest = check.reduction.values()
        flags, extra_sums = rest[:snapshot.Snapshots.FLAGS], rest[snapshot.Snapshots.FLAGS:]
        # The mean over all ranks' micro-batches (with accumulation, a step has several);
        # NaN when on_nonfinite=skip skipped every step of the window.
        loss = window_mean(loss_sum, batches, ctx.world.world_size)
        self.nonfinite.check_window(loss, first=check.first_step, last=check.step,
                                    epoch=check.epoch + 1)  # counted from 1
        extras = ({} if self.extras is None else self.extras.means(extra_sums, extra_batches))
        metrics = {"train/loss": loss, **extras, self.throughput.metric: check.per_sec,
                   "lr": check.lr}
        ctx.metrics.update(metrics)  # summary.json's train_loss: the last window's
        if self.log_hook is not None:
            self.log_hook(ctx=ctx, step=check.step, metrics=metrics)
        if preempted > 0:
            self.stop_requested = True
        self.snapshots.agree_on(flags)

    def epoch_metrics(self, epoch: int, window: LogWindow, *, batches: int, steps: int,
                      epoch_start: float, data_wait: float) -> dict:
        """One collective per epoch: every rank's loss sum, batch count and data wait,
        gathered; the loss is the mean over all ranks' batches, the data wait the
        slowest rank's (one rank starved of data holds every other at the next step)."""
        ctx = self.ctx
        mine = torch.stack([window.total_loss(),
                            torch.tensor(batches + window.resumed_batches, dtype=torch.float64,
                                         device=self.device),
                            torch.tensor(data_wait, dtype=torch.float64, device=self.device),
                            torch.tensor(window.epoch_units + window.units,
                                         dtype=torch.float64, device=self.device)])
        if self.extras is not None:  # their sums, then their micro-batches
            mine = torch.cat([mine, self.extras.take_epoch()])
        ranks = distributed.all_gather_tensor(mine).tolist()  # one read-back
        loss_sum, batch_count = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
        wait = max(r[2] for r in ranks)
        units = sum(r[3] for r in ranks)  # counted units: a stream's ranks differ
        elapsed = time.perf_counter() - epoch_start  # after .tolist(): the device is done
        mean_loss = loss_sum / batch_count if batch_count else math.nan  # all skipped
        self.nonfinite.check_epoch(mean_loss, epoch + 1, ctx.state.step)  # from 1
        # The epoch's means have names of their own (train/epoch_NAME), as train/epoch_loss:
        # train/NAME is always one log window's mean.
        extras = {} if self.extras is None else self.extras.means(
            [sum(r[4 + i] for r in ranks) for i in range(len(self.extras.names))],
            sum(r[-1] for r in ranks), prefix="train/epoch_")
        return {
            EPOCH_LOSS: mean_loss,
            **extras,
            self.throughput.epoch_metric: (units or self.epoch_done(window, steps))
            / max(elapsed, 1e-9),
            "train/data_wait_fraction": wait / max(elapsed, 1e-9),
        }

    def epoch_done(self, window: LogWindow, steps: int) -> float:
        """Samples (or the recipe's units) all ranks trained on in this run's part of
        the epoch."""
        if self.throughput.count is None:
            return window.samples_per_step * steps
        return (window.epoch_units + window.units) * window.world_size

    def epoch_loss_so_far(self, reduce: bool = True) -> dict | None:
        """For a snapshot (collective: every rank takes part): the epoch's loss sum and
        micro-batch count over all ranks so far, with the micro-batch size they are in;
        None between epochs. ``reduce=False``: this rank's alone, no collective."""
        window, ctx = self.window, self.ctx
        if window is None:
            return None
        batches = window.epoch_batches(ctx.state.batch_in_epoch) + window.resumed_batches
        if reduce:
            totals = torch.stack([window.total_loss(), torch.tensor(
                batches, dtype=torch.float64, device=self.device)])
            loss_sum, batch_count = distributed.all_reduce_sum(totals).tolist()
        else:  # a memory snapshot's, each step at memory_every_steps=1: no more ops
            loss_sum, batch_count = window.total_loss().item(), float(batches)
        return {"sum": loss_sum, "batches": batch_count,
                "micro_batch": self.run_parts.micro_batch}

    def agree_to_stop(self) -> bool:
        """At an epoch boundary: did a pre-emption signal reach any rank?"""
        ctx = self.ctx
        if ctx.preemption is None:
            return False
        flag = torch.tensor([float(bool(ctx.preemption))], device=self.device)
        self.stop_requested = distributed.all_reduce_sum(flag).item() > 0
        return self.stop_requested

    # ------------------------------------------------------------ validation

    def validate_if_due(self, step: int) -> bool:
        """After optimizer step ``step``, unless the epoch ends with it (run_epoch
        validates there): a validation when ``val_every_steps`` divides the step, or when
        max_steps ends the run here (``self.ending``; the validation that an epoch's end
        would run). Early stopping may then end the run at this step. True when the
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
            metrics = self.validate_in_epoch(step)
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

    def validate_in_epoch(self, step: int) -> dict:
        """A validation inside an epoch, after optimizer step ``step``: its metrics are
        logged at that step and join the run's (the next snapshot's, for the best one).
        Training goes on exactly as without it (validate leaves the RNG states and the
        model's mode as they were; the training loader is not touched)."""
        ctx = self.ctx
        parts = self.run_parts
        self.finish_pending()  # the window before the validation is logged first
        # As at an epoch's end: rank 0's statistics.
        parts.parallel.sync_buffers(parts.model)
        metrics = self.validate(ctx.state.epoch)
        ctx.metrics.update(metrics)
        self.learn_val_names(metrics)
        if self.log_hook is not None:
            self.log_hook(ctx=ctx, metrics=metrics, step=step)
        return metrics

    @torch.no_grad()
    def validate(self, epoch: int) -> dict:
        """The recipe's ``eval_step`` over this rank's shard of the validation set (a
        smoke run's first ``limit_batches``); the sums reduced over the ranks in one
        all-reduce. The RNG states are forked around it: a recipe's eval_step may draw
        (test-time augmentation), and training must go on as without the validation,
        wherever it falls (val_every_steps) and however often."""
        if self.run_parts.val_loader is None:
            return {}
        saved = stateful.rng_state()
        try:
            return self.validate_shard(epoch)
        finally:
            stateful.set_rng_state(saved)

    def validate_shard(self, epoch: int) -> dict:
        ctx = self.ctx
        parts = self.run_parts
        ctx.pm.hook.engine_validation_start(ctx=ctx, epoch=epoch)
        # The unwrapped module: no DDP collectives in forward, so ranks whose shard is
        # one batch shorter do not hang the others.
        module = parts.module
        was_training = module.training
        module.eval()
        sums = MetricSums(self.device, self.eval_metrics)
        batches = (itertools.islice(parts.val_loader, self.cfg.limit_batches)
                   if self.cfg.limit_batches else parts.val_loader)  # a smoke run's few
        with parts.parallel.validation(parts.model):
            for batch in batches:
                batch = data.to_device(batch, self.device, non_blocking=self.non_blocking)
                with self.autocast():
                    sums.add(self.eval_step(batch, ctx))
        module.train(was_training)
        metrics = sums.reduce()
        ctx.pm.hook.engine_validation_end(ctx=ctx, epoch=epoch, metrics=metrics)
        return metrics

    # --------------------------------------------------------- named metrics

    def check_named_metrics(self) -> None:
        """Before the first step (and the resume): every metric the config names is one
        this run logs, or the run stops with one line listing those it does. The val/*
        names come from one validation batch (:meth:`validation_names`); a train/ name
        that may be one of train_step's extras waits for the first micro-batch."""
        wanted = named(self.cfg)
        if wanted:
            self.val_names = self.validation_names()
            self.unchecked = self.refuse_unlogged(wanted, extras_known=False)

    def logged_names(self, key: str) -> list[str]:
        """The metrics this run logs that config key ``key`` may name, as far as known:
        early stopping and a scheduler's metric see an epoch's end; the best snapshot
        every metric logged before it (but train/loss, which config.check refuses)."""
        extras = self.extras.names if self.extras is not None else []
        names = [*(self.val_names or []), EPOCH_LOSS, *(f"train/epoch_{n}" for n in extras),
                 self.throughput.epoch_metric, "train/data_wait_fraction"]
        if key not in EPOCH_END:  # a log window's
            names += [*(f"train/{n}" for n in extras), self.throughput.metric]
        return [*names, "lr"]

    def refuse_unlogged(self, wanted: list[tuple[str, str]], extras_known: bool
                        ) -> list[tuple[str, str]]:
        """Raise for the first of ``wanted`` (key, metric) that this run does not log;
        return those that it may still log: a train/ name before train_step's extras
        are known, a val/ name when one batch could not tell the val/* names. The same
        decision on every rank: the names are the same there."""
        later = []
        for key, metric in wanted:
            logged = self.logged_names(key)
            if metric in logged:
                continue
            if ((not extras_known and metric.startswith("train/"))
                    or (self.val_names is None and metric.startswith("val/"))):
                later.append((key, metric))
                continue
            raise not_logged(key, metric, logged)
        return later

    @torch.no_grad()
    def validation_names(self) -> list[str] | None:
        """The val/* names validation will log: rank 0's from one batch through
        eval_step and eval_metrics, on every rank. [] without a validation set or with
        an empty one; None when eval_metrics fails on one batch's sums (checked after
        the first validation then). Training is left as it was (RNG states, the model's
        mode; the batch read from the dataset, not the loader). Collective: every rank
        runs one batch (fsdp's first forward needs them all), and one all_gather tells
        rank 0's names and who failed (that rank raises its error, the others stop)."""
        parts = self.run_parts
        loader = parts.val_loader
        if loader is None:
            return []
        module = parts.module
        was_training = module.training
        saved = stateful.rng_state()
        names, failure = None, None
        module.eval()
        try:
            with parts.parallel.validation(parts.model):
                try:
                    names = self.first_batch_names(loader)
                except Exception as exc:
                    failure = exc
        finally:
            module.train(was_training)
            stateful.set_rng_state(saved)
        answers = distributed.all_gather_object((failure is not None, names))
        if failure is not None:
            raise failure
        failed = [rank for rank, (raised, _) in enumerate(answers) if raised]
        if failed:
            raise PeerFailed(f"rank(s) {', '.join(map(str, failed))} failed to validate one "
                             "batch before training (their error is the one to read)")
        return answers[0][1]

    def first_batch_names(self, loader) -> list[str] | None:
        """:meth:`validation_names` on one rank: eval_step on its shard's first batch
        (a rank whose shard is empty takes the set's first samples: every rank runs
        one forward)."""
        samples = data.first_val_samples(loader)
        if not samples:
            return []  # no validation sample: no val/* metric (MetricSums.reduce)
        batch = loader.collate_fn(samples)
        batch = data.to_device(batch, self.device, non_blocking=self.non_blocking)
        with self.autocast():
            sums = self.eval_step(batch, self.ctx)
        MetricSums(self.device, self.eval_metrics).add(sums)  # what it returns is checked
        if self.eval_metrics is None:
            return [f"val/{name}" for name in sums if name != "count"]
        try:
            derived = self.eval_metrics({name: float(value) for name, value in sums.items()})
            return [f"val/{name}" for name in derived]
        except Exception:
            return None

    # --------------------------------------------------------------- helpers

    def current_lr(self) -> float:
        return float(self.run_parts.optimizer.param_groups[0]["lr"])

    def save_snapshot(self, at_end: bool = False) -> None:
        # The window in flight is logged first: a run resumed from here would never log it.
        self.finish_pending()
        if self.cfg.checkpoint.at_end or not at_end:  # false: a throw-away run's end
            self.snapshots.save()
