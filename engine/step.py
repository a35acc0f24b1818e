"""One training step, as the Trainer runs it and tune-workers' ``--full-step`` measures
it. The last step's gradients are freed just before the next group's first backward:
hooks after the step see them, and glibc reuses their memory for the new ones instead of
faulting in fresh pages (docs/performance.md). Nothing reads the device back but
``on_nonfinite=skip``."""

from __future__ import annotations

import contextlib
import math

import torch

from engine import data, distributed, phases
from engine.errors import ConfigError, RunError


class NonFiniteLoss(RunError):
    """The loss became non-finite: the run failed (exit code 1)."""


class NonFinitePolicy:
    """``on_nonfinite``: what a non-finite training loss does. ``stop`` costs nothing per
    step: a non-finite loss of a log window (reduced at the check point) or of the epoch
    stops the run. ``skip`` ANDs every micro-batch's finiteness into a device flag (a NaN
    in any poisons the accumulated gradients); one all-reduce at the optimizer step tells
    every rank alike whether to step: a host sync per step, the price of deciding."""

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


class TrainExtras:
    """What a ``train_step`` returns beside the loss (``{"loss": loss, "accuracy": ...}``),
    micro-batch means summed on the device: ``train/NAME``, the mean over a check point's
    window (its slot) and the ranks; ``train/epoch_NAME``, over this run's part of the epoch."""

    def __init__(self, names: list[str], device):
        self.names = names
        self.window = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.epoch = torch.zeros_like(self.window)
        self.window_batches = self.epoch_batches = 0
        self.kept = torch.zeros_like(self.window)  # on_nonfinite=skip: see settle
        self.kept_batches = 0

    def add(self, out: dict) -> None:
        self.window += torch.stack([torch.as_tensor(out[n]).detach().double().to(
            self.window.device) for n in self.names])
        self.window_batches += 1

    def settle(self, taken: bool) -> None:
        """``on_nonfinite=skip``, after each optimizer step: keep its micro-batches'
        metrics, or drop them with the step, as its losses (LogWindow.settle)."""
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

    # The check point's slot: the window's sums, then its micro-batches.
    def check_values(self, window_s: float, window_steps: int) -> torch.Tensor:
        sums, batches = self.take_window()
        return torch.cat([sums, sums.new_tensor([batches])])

    def check_agreed(self, sums) -> dict:
        return self.means(sums[:-1], sums[-1])


def autocast_for(precision: str, device):
    """What the steps run under: nothing at 32, else autocast to bf16 or fp16."""
    if precision == "32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


class StepRunner:
    """The step on ``parts`` (engine.worker_setup.RunParts): :meth:`micro_batch` for each
    of a group of grad_accum_steps, then :meth:`optimizer_step`. ``extras_known(extras)``
    hears at the first micro-batch what ``train_step`` returns beside the loss (a
    TrainExtras, or None). Not ``synced``: the model is not wrapped (tune-workers)."""

    def __init__(self, parts, cfg, train_step, ctx, *, world_size: int, warn,
                 extras_known=None, synced: bool = True):
        self.parts, self.ctx = parts, ctx
        self.device = device = parts.parallel.device
        self.autocast = autocast_for(cfg.precision, device)
        self.non_blocking = device.type == "cuda"
        self.moves_batches = device.type != "cpu"  # the loaders yield CPU tensors
        self.no_sync = parts.parallel.no_sync if synced else (
            lambda model: contextlib.nullcontext())
        self.clip_norm = cfg.grad_clip_norm
        self.nonfinite = NonFinitePolicy(cfg.on_nonfinite, device, world_size, warn)
        self.train_step = self.first_train_step
        self.checked_train_step = train_step
        self.extras: TrainExtras | None = None  # train_step returns a dict
        self.extras_known = extras_known
        self.before_step_hook = None  # engine_before_optimizer_step, where implemented

    def first_train_step(self, batch, ctx):
        """The run's first micro-batch: the step's loss checked once (a loss of another
        shape failed deep in autograd); a dict holds it and the extras (TrainExtras)."""
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
        if self.extras_known is not None:
            self.extras_known(self.extras)
        self.train_step = self.checked_train_step
        return out

    def micro_batch(self, batch, group_size: int, first_micro: bool, last_micro: bool,
                    padding: bool = False):
        """Forward (under autocast) and backward of one micro-batch; returns its loss,
        detached. DDP all-reduces the gradients in a group's last backward only. A
        stream's ``padding`` micro-batch weighs 0: it only keeps this rank in the
        all-reduces of ranks whose part of the stream is longer."""
        parts = self.parts
        if self.moves_batches:
            batch = data.to_device(batch, self.device, non_blocking=self.non_blocking)
        with contextlib.nullcontext() if last_micro else self.no_sync(parts.model):
            with self.autocast():
                loss = self.train_step(batch, self.ctx)
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

    def optimizer_step(self, step: int) -> bool:
        """Optimizer step number ``step``, unless the non-finite policy skips it; True
        when taken."""
        parts = self.parts
        taken = self.nonfinite.allow_step(step)
        if self.nonfinite.skip and self.extras is not None:
            self.extras.settle(taken)
        if taken:
            with phases.span("optimizer step"):
                if self.clip_norm is not None or self.before_step_hook is not None:
                    self.before_optimizer_step(step)
                if parts.scaler is not None:
                    parts.scaler.step(parts.optimizer)
                    parts.scaler.update()
                else:
                    parts.optimizer.step()
        return taken

    def before_optimizer_step(self, step: int) -> None:
        """On the true gradients, unscaled (fp16) and averaged over the ranks (DDP reduced
        them in the group's last backward): clip to ``grad_clip_norm``, the plugins' hook."""
        parts = self.parts
        if parts.scaler is not None:
            # scaler.step() then sees that they are unscaled and does not do it again.
            parts.scaler.unscale_(parts.optimizer)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(parts.model.parameters(), self.clip_norm)
        if self.before_step_hook is not None:
            self.before_step_hook(ctx=self.ctx, step=step, optimizer=parts.optimizer)
