"""The training loop.

``Trainer.fit`` in pseudocode (hooks in brackets)::

    [engine_run_start]                                   (fired by Engine.run)
    for epoch in epochs not yet completed:
        sampler.set_epoch(epoch, skip the batches a resumed snapshot already consumed)
        [engine_epoch_start]
        for each micro-batch:
            forward, loss, backward             (DDP syncs gradients on the last micro-step only)
            on the last micro-step of a group:
                optimizer step, zero_grad(set_to_none=True), scheduler if per step
                [engine_train_step_end]                 (not called when nobody implements it)
                every log_every steps: [engine_log] on rank 0, pending snapshot/stop decisions
        reduce the epoch's metrics over all ranks; validate
        [engine_log] [engine_epoch_end]; scheduler if per epoch; snapshot if due

Nothing inside a step reads a value back from the device: metrics accumulate in device
tensors and are read at the log interval and at the end of the epoch.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from engine import data, distributed, health, snapshot
from engine.errors import EngineError


class NonFiniteLoss(EngineError):
    pass


class Trainer:
    def __init__(self, engine):
        self.engine = engine
        self.cfg = engine.cfg
        hook = engine.pm.hook
        # A per-step hook with no implementation costs nothing: we never call it.
        self.step_end_hook = (hook.engine_train_step_end
                              if hook.engine_train_step_end.get_hookimpls() else None)
        self.log_hook = hook.engine_log if engine.is_rank0 else None
        device = engine.device
        if self.cfg.precision == "32":
            self.autocast = contextlib.nullcontext
        else:
            dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
            self.autocast = lambda: torch.autocast(device.type, dtype=dtype)
        self.last_snapshot_time = time.monotonic()
        self.stop_requested = False  # the ranks agreed to stop (see engine/preemption.py)
        self.skipped_steps = 0

    # ------------------------------------------------------------------- fit

    def fit(self) -> None:
        eng, cfg = self.engine, self.cfg
        while eng.state.epoch < cfg.epochs:
            epoch = eng.state.epoch
            data.start_epoch(eng.train_loader, epoch,
                             start_index=eng.state.batch_in_epoch * eng.micro_batch)
            eng.pm.hook.engine_epoch_start(engine=eng, epoch=epoch)
            train_metrics = self.train_epoch(epoch)
            if self.stop_requested:  # pre-empted half-way through the epoch
                self.save_snapshot()
                return
            # DDP syncs buffers at the start of each forward; after the last one every
            # rank's BatchNorm statistics moved on their own. Equalise before validating.
            eng.parallel.sync_buffers(eng.model)
            metrics = {**train_metrics, **self.validate()}
            metrics["lr"] = self.current_lr()
            health.epoch_barrier(cfg.timeout_s)
            eng.metrics.update(metrics)
            eng.state.epoch = epoch + 1
            eng.state.batch_in_epoch = 0
            eng.state.epochs_completed = epoch + 1
            if self.log_hook is not None:
                self.log_hook(engine=eng, metrics=metrics, step=eng.state.step)
            eng.pm.hook.engine_epoch_end(engine=eng, epoch=epoch, metrics=metrics)
            if eng.scheduler is not None and cfg.scheduler_interval == "epoch":
                eng.scheduler.step()
            every = cfg.checkpoint.every_epochs
            due = (every and (epoch + 1) % every == 0) or eng.state.epoch == cfg.epochs
            stop = eng.state.epoch < cfg.epochs and self.agree_to_stop()
            if due or stop:
                self.save_snapshot()
            if stop:
                return

    # ----------------------------------------------------------------- epoch

    def train_epoch(self, epoch: int) -> dict:
        eng, cfg = self.engine, self.cfg
        model, optimizer, scaler = eng.model, eng.optimizer, eng.scaler
        device, loss_fn, parallel = eng.device, eng.loss_fn, eng.parallel
        accum = cfg.grad_accum_steps
        non_blocking = device.type == "cuda"
        model.train()

        n_batches = len(eng.train_loader)  # what is left of this epoch
        first_batch = eng.state.batch_in_epoch
        # Losses add up on the device in one tensor per log window (one add per
        # micro-batch); each window is folded into the epoch's sum at its check point.
        loss_sum = torch.zeros((), device=device)
        window_loss = torch.zeros((), device=device)
        window_steps = window_batches = 0
        steps_in_epoch = batches_seen = 0
        data_wait = 0.0
        samples_per_step = eng.micro_batch * accum * eng.world.world_size
        # on_nonfinite=skip: whether every micro-batch of the step so far had a finite
        # loss, kept on the device; one check at the optimizer step. A NaN in any
        # micro-batch poisons the accumulated gradients, not only one in the last.
        skip_nonfinite = cfg.on_nonfinite == "skip"
        step_finite = torch.ones((), dtype=torch.bool, device=device)
        epoch_start = window_start = time.perf_counter()

        fetch_start = time.perf_counter()
        for i, (inputs, targets) in enumerate(eng.train_loader):
            data_wait += time.perf_counter() - fetch_start
            batch_index = first_batch + i
            # Micro-steps are grouped by absolute position, so a resumed epoch groups
            # them exactly as the uninterrupted one did.
            group_start = batch_index - batch_index % accum
            group_size = min(accum, first_batch + n_batches - group_start)
            last_micro = batch_index - group_start == group_size - 1
            inputs = inputs.to(device, non_blocking=non_blocking)
            targets = targets.to(device, non_blocking=non_blocking)

            with (contextlib.nullcontext() if last_micro else parallel.no_sync(model)):
                with self.autocast():
                    outputs = model(inputs)
                    loss = loss_fn(outputs, targets)
                scaled = loss / group_size if group_size > 1 else loss
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            window_loss += loss.detach()
            if skip_nonfinite:
                step_finite &= torch.isfinite(loss.detach())
            window_batches += 1
            eng.state.batch_in_epoch = batch_index + 1
            batches_seen += 1
            if last_micro:
                if skip_nonfinite and not self.all_finite(step_finite):
                    optimizer.zero_grad(set_to_none=True)
                    self.skipped_steps += 1
                    eng.warn(f"non-finite loss at step {eng.state.step + 1}: step skipped "
                             "(on_nonfinite=skip)")
                elif scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if skip_nonfinite:
                    step_finite.fill_(True)
                if eng.scheduler is not None and cfg.scheduler_interval == "step":
                    eng.scheduler.step()
                eng.state.step += 1
                steps_in_epoch += 1
                window_steps += 1
                if self.step_end_hook is not None:
                    self.step_end_hook(engine=eng, step=eng.state.step, loss=loss)
                if eng.state.step % cfg.log_every == 0:
                    now = time.perf_counter()
                    stop = self.check_point(window_loss, window_batches, window_steps,
                                            samples_per_step * window_steps / (now - window_start))
                    loss_sum += window_loss
                    window_loss.zero_()
                    window_steps = window_batches = 0
                    window_start = now
                    if stop:
                        break
                every_steps = cfg.checkpoint.every_steps
                if every_steps and eng.state.step % every_steps == 0:
                    self.save_snapshot()
            fetch_start = time.perf_counter()

        loss_sum += window_loss
        # One reduction per epoch: the loss of every rank, and how many batches it saw.
        totals = torch.stack([loss_sum.float(),
                              torch.tensor(float(batches_seen), device=device)])
        distributed.all_reduce_sum(totals)
        mean_loss = (totals[0] / totals[1].clamp(min=1)).item()
        elapsed = time.perf_counter() - epoch_start  # after .item(): the device is done
        if not math.isfinite(mean_loss) and cfg.on_nonfinite == "stop":
            raise NonFiniteLoss(f"the training loss is not finite ({mean_loss}) in epoch "
                                f"{epoch}, by step {eng.state.step}")
        return {
            "train/loss": mean_loss,
            "train/images_per_sec": samples_per_step * steps_in_epoch / max(elapsed, 1e-9),
            "train/data_wait_fraction": data_wait / max(elapsed, 1e-9),
        }

    def check_point(self, window_loss, window_batches: int, window_steps: int,
                    images_per_sec: float) -> bool:
        """Every ``log_every`` steps, on every rank: one small all-reduce gives the mean
        loss of the window over all ranks and the ranks' agreement on a pre-emption stop
        or a time-based snapshot. Returns True when the epoch must stop here."""
        eng, cfg = self.engine, self.cfg
        due_by_time = eng.is_rank0 and bool(cfg.checkpoint.every_minutes) and (
            time.monotonic() - self.last_snapshot_time >= cfg.checkpoint.every_minutes * 60)
        preempted = eng.preemption is not None and bool(eng.preemption)
        values = torch.stack([window_loss.float(), window_loss.new_tensor(float(preempted)),
                              window_loss.new_tensor(float(due_by_time))])
        loss_sum, preempted, due_by_time = distributed.all_reduce_sum(values).tolist()
        # The mean over micro-batches (with accumulation, a step has several).
        loss = loss_sum / max(window_batches, 1) / eng.world.world_size
        first = eng.state.step - window_steps + 1
        if not math.isfinite(loss) and cfg.on_nonfinite == "stop":
            raise NonFiniteLoss(
                f"the training loss became non-finite ({loss}) between steps {first} and "
                f"{eng.state.step} (epoch {eng.state.epoch}); lower lr, check the data, "
                "or set on_nonfinite=skip")
        if self.log_hook is not None:
            self.log_hook(engine=eng, step=eng.state.step, metrics={
                "train/loss": loss, "train/images_per_sec": images_per_sec,
                "lr": self.current_lr()})
        if preempted:
            self.stop_requested = True
            return True
        if due_by_time:
            self.save_snapshot()
        return False

    def agree_to_stop(self) -> bool:
        """At an epoch boundary: did a pre-emption signal reach any rank?"""
        eng = self.engine
        if eng.preemption is None:
            return False
        flag = torch.tensor([float(bool(eng.preemption))], device=eng.device)
        self.stop_requested = distributed.all_reduce_sum(flag).item() > 0
        return self.stop_requested

    def all_finite(self, finite) -> bool:
        """Whether every rank's step was finite: a host sync, so only with on_nonfinite=skip."""
        flag = finite.float().reshape(1)
        return distributed.all_reduce_sum(flag).item() == self.engine.world.world_size

    # ------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict:
        eng = self.engine
        if eng.val_loader is None:
            return {}
        # The unwrapped module: no DDP collectives in forward, so ranks whose shard is
        # one batch shorter do not hang the others.
        module = eng.module
        was_training = module.training
        module.eval()
        device = eng.device
        sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss, correct, count
        for inputs, targets in eng.val_loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with self.autocast():
                outputs = module(inputs)
                loss = eng.loss_fn(outputs, targets)  # a mean over the batch
            sums[0] += loss.double() * targets.shape[0]
            sums[1] += (outputs.argmax(dim=1) == targets).sum()
            sums[2] += targets.shape[0]
        distributed.all_reduce_sum(sums)
        module.train(was_training)
        loss_sum, correct, count = sums.tolist()
        if count == 0:
            return {}
        return {"val/loss": loss_sum / count, "val/accuracy": correct / count}

    # --------------------------------------------------------------- helpers

    def current_lr(self) -> float:
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def save_snapshot(self) -> None:
        snapshot.save(self.engine)
        self.last_snapshot_time = time.monotonic()

