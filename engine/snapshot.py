"""Snapshots: capturing the training state, saving it, and resuming from one.

A snapshot is a dict of tensors and plain values (``torch.load(weights_only=True)``):
a header (engine version, resolved config, number of processes, where training
stands) and the state of every part the run registered (engine/stateful.py: model,
optimizer, scheduler, scaler, progress, loader position, metrics, the recipe's and
plugins' parts, RNG states). This module walks the parts and decides what may be
resumed (the config check); the checkpointer (:class:`engine.checkpoint.Checkpointer`)
only stores the dict and gives it back.
"""

from __future__ import annotations

import copy
import inspect
import math
import pathlib
import time
import warnings

import engine
from engine import config as config_mod
from engine import distributed, phases
from engine.checkpoint import read_manifest
from engine.errors import CheckpointError, ConfigError

# torch is imported inside the functions that use it: the launching process imports
# this module without it; the memory tier (engine/memory/) only when on (a costly import).

#: Config keys a resumed run may change: how long it goes and how it is launched, watched
#: and stored, not what a step computes. Any OTHER key that differs refuses the resume
#: (unless --resume-anyway): batch_size, grad_accum_steps, seed, drop_last, precision,
#: per_sample_seed, scheduler_interval, ddp's arithmetic, a recipe's own keys (never two
#: runs mixed silently). ``lr`` has its own rule (:func:`_apply_lr`); another world size
#: goes on at the global sample position; a config group names its own in ``RESUME_SAFE``.
MAY_CHANGE = frozenset({
    "epochs", "log_every", "num_workers", "timeout_s", "out_dir", "launcher", "init_method",
    "parallel", "checkpointer", "preemption", "requeue", "deterministic", "on_nonfinite",
    "activation_checkpointing",
    # How long the run goes and when it validates, not what a step computes (a longer
    # max_steps trains on from where the run ended). The smoke switch (limit_batches,
    # smoke) may not change: a smoke run's folder is its own.
    "max_steps", "val_every_steps", "validate",
})


def capture(ctx, config: dict | None = None, parts: dict | None = None) -> dict:
    """The snapshot dict: a header, then every registered part's state
    (engine/stateful.py). Collective: every rank walks the parts (some gather).
    ``config`` (as a dict), ``parts`` (their states): where the caller has them."""
    import torch

    state = ctx.state
    return {
        "engine_version": engine.__version__,
        "config": config if config is not None else config_mod.to_dict(ctx.cfg),
        # The recipe file (or a custom loop's script): with the config, what
        # engine.load_model rebuilds the model from.
        "recipe": ctx.recipe_path,
        "world_size": ctx.world.world_size,
        "threads": torch.get_num_threads(),  # a CPU's sums depend on them (restore)
        # Where training stands, for tools that read a snapshot without the engine
        # (tools/ckpt.py inspect); a resume reads the parts, never these.
        "epoch": state.epoch,
        "step": state.step,
        "batch_in_epoch": state.batch_in_epoch,
        "epochs_completed": state.epochs_completed,
        **(parts if parts is not None else ctx.snapshot_parts.state_dict()),
    }


def upgrade(snap: dict) -> dict:
    """A snapshot written before the state was kept in parts (flat keys: train_state,
    epoch_loss, samples_in_epoch, a list of RNG states), in the parts' form."""
    if "progress" in snap:
        return snap
    snap = dict(snap)
    progress = dict(snap.pop("train_state", None) or {})
    progress.update(epoch=int(snap["epoch"]), step=int(snap["step"]),
                    epochs_completed=int(snap.get("epochs_completed", snap["epoch"])),
                    epoch_loss=snap.pop("epoch_loss", None))
    progress.pop("batch_in_epoch", None)
    snap["progress"] = progress
    snap["loader"] = {"batch_in_epoch": int(snap.get("batch_in_epoch", 0)),
                      "samples_in_epoch": snap.pop("samples_in_epoch", None),
                      "world_size": snap.get("world_size")}
    if isinstance(snap.get("rng"), list):
        snap["rng"] = {"ranks": snap["rng"], "world_size": snap.get("world_size")}
    snap.pop("sampler_seed", None)
    return snap


def save(ctx) -> pathlib.Path | None:
    """Write a snapshot; rank 0 only unless the checkpointer shards over all ranks.
    Collective (capture). Returns the path on the ranks that saved."""
    with phases.carve(phases.SNAPSHOTS, within="training", label="snapshot"):
        state = capture(ctx)
        if not (ctx.checkpointer.all_ranks or ctx.is_rank0):
            return None
        return ctx.checkpointer.save(state, epoch=ctx.state.epoch, step=ctx.state.step,
                                     metrics=dict(ctx.metrics))


class SnapshotPolicy:
    """When a snapshot to disk is due: every ``every_steps`` steps, ``every_minutes``
    (rank 0's clock, agreed at a check point), ``every_epochs`` epochs, the last epoch."""

    def __init__(self, cfg, is_rank0: bool):
        self.every_steps = cfg.checkpoint.every_steps
        self.every_epochs = cfg.checkpoint.every_epochs
        self.every_seconds = cfg.checkpoint.every_minutes * 60 if is_rank0 else 0
        self.epochs = cfg.epochs
        self.last_time = time.monotonic()

    def due_at_step(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_time(self) -> bool:
        return bool(self.every_seconds) and (
            time.monotonic() - self.last_time >= self.every_seconds)

    def due_at_epoch_end(self, epochs_done: int) -> bool:
        return bool(self.every_epochs and epochs_done % self.every_epochs == 0) or (
            epochs_done == self.epochs)

    def saved(self) -> None:
        self.last_time = time.monotonic()


class Snapshots:
    """The run's snapshots, one layer the loop calls three ways: after each optimizer
    step (:meth:`step_ended`) it decides: to disk (a new best, ``every_steps``, a check
    point's time flag), into shared memory, or nothing; it says whether one is due at an
    epoch's end (:meth:`due_at_epoch_end`); it writes the loop's own (:meth:`save`). It
    owns the memory tier (engine/memory/'s MemoryTier, ``memory``; None while off): opens
    it at the resume, feeds it, turns it off on every rank at one check point
    (:meth:`check_flags`, :meth:`agreed`), closes it at the run's end.

    ``finish_check``: the loop's, before a snapshot at a step: finishes the check point
    in flight; True when its flags stop the run at this step (a pre-emption)."""

    #: :meth:`check_flags`' values: time, failure, engine.memory.cost.MEMORY_INTERVALS'.
    FLAGS = 2 + 8

    def __init__(self, ctx, finish_check, memory=None, check_point=None):
        self.ctx = ctx
        self.policy = SnapshotPolicy(ctx.cfg, ctx.is_rank0)
        self.finish_check = finish_check
        self.time_due = False  # a check point said one is due by time: to disk next
        # The first step step_ended looks further than an integer compare at: 0 until the
        # first step (a resume moves the count) and while a time flag waits for one to disk.
        self.next_due = 0
        self.memory = memory
        if check_point is not None:  # the loop's (engine/check_point.py): this layer's slot
            check_point.add("snapshots", self.check_flags, self.agree_on,
                            started=self.window_started)

    # ---------------------------------------------------------- start and end

    def resume(self) -> None:
        """Open the memory tier (collective), then :func:`resume`."""
        if self.ctx.cfg.checkpoint.memory_every_steps:
            from engine.memory import MemoryTier  # only when on: a costly import

            self.memory = MemoryTier.open(self.ctx)
        resume(self.ctx, self.memory)

    def ended(self) -> None:
        """The run ended by itself, its last snapshot durable: the memory snapshots go."""
        if self.memory is not None:
            self.memory.remove()

    def close(self, wait: bool = True) -> None:
        """However the run ended: the tier's thread and mappings go, its files stay
        (``wait=False``, a failed run: the thread may wait on a gone peer)."""
        if self.memory is not None:
            self.memory.close(wait=wait)

    # --------------------------------------------------------------- per step

    def step_ended(self, step: int, new_best: bool = False) -> None:
        """After optimizer step ``step`` and its validation (not where the run stops at
        it): to disk when ``new_best`` or due by count or time, else into shared memory
        when due; before :attr:`next_due`, an integer compare. The check in flight is
        finished first (``finish_check``): a pre-emption writes none (the loop does)."""
        if step < self.next_due and not new_best:
            return
        self.next_due = 0 if self.time_due else self._next_due(step)
        to_disk = new_best or self.time_due or self.policy.due_at_step(step)
        to_memory = self.memory is not None and self.memory.due(step)
        if not (to_disk or to_memory) or self.finish_check():
            return
        if to_disk:
            self.save()
        elif self.memory is not None:  # the finished check may have turned it off
            problem = self.memory.save(capture)
            if problem is not None:  # before the first one, agreed at once
                self._memory_off(*problem)

    def _next_due(self, step: int) -> float:
        """The first step after ``step`` due by count (a multiple of every_steps or of the
        memory tier's, which may have gone off since: that call finds nothing due)."""
        counts = [n for n in (self.policy.every_steps,
                              self.memory.every_steps if self.memory is not None else 0) if n]
        return min((step // n + 1) * n for n in counts) if counts else math.inf

    # ------------------------------------------------------ what the loop asks

    def save(self) -> None:
        """A snapshot to disk, now (the loop finished its check in flight first)."""
        save(self.ctx)
        self.policy.saved()
        self.time_due = False

    def due_at_epoch_end(self, epochs_done: int) -> bool:
        """At an epoch's end: every_epochs, the last epoch, or a check point's time flag."""
        return self.policy.due_at_epoch_end(epochs_done) or self.time_due

    def window_started(self) -> None:
        """The loop's, as an epoch's first log window starts (the tier's cost window)."""
        if self.memory is not None:
            self.memory.window_started()

    def check_flags(self, window_s: float, window_steps: int) -> list[float]:
        """This rank's flags for a check point's all-reduce (a sum): a snapshot due by
        time (rank 0's clock), its memory buffer failed, under auto the interval its costs
        allow (a flag per interval), measured on the window (``window_s``, its steps)."""
        memory, proposal = self.memory, [0.0] * (self.FLAGS - 2)
        if memory is not None:
            from engine.memory import cost  # the tier is on: imported already

            every_before = memory.every_steps
            proposal = cost.proposal(memory.measure(window_s, window_steps))
            if memory.every_steps != every_before:  # auto paused it, or ended a pause
                self.next_due = 0
        return [float(self.policy.due_by_time()),
                float(memory is not None and memory.failed is not None), *proposal]

    def agree_on(self, sums) -> None:
        """A finished check point's sums of :meth:`check_flags`, as it laid them out."""
        self.agreed(sums[0] > 0, sums[1] > 0, sums[2:])

    def agreed(self, due_by_time: bool, memory_failed: bool, intervals=()) -> None:
        """A finished check point's sums of :meth:`check_flags`, the same on every rank:
        the next snapshot to disk, the memory tier off, or (auto) the largest interval
        any rank proposed from this step: every rank takes a memory snapshot at the
        same steps (powers of two: never more steps between two than either interval)."""
        if due_by_time:
            self.time_due = True
            self.next_due = 0  # the loop asks at every step until a snapshot to disk
        memory = self.memory
        if memory is not None and memory.auto:
            from engine.memory import cost  # the tier is on: imported already

            every_before = memory.every_steps
            memory.take_interval(cost.agreed_interval(intervals))
            if memory.every_steps != every_before:
                self.next_due = 0  # the next step asks: it may be due at the new interval
        if memory_failed and memory is not None:
            self._memory_off(*memory.failed_rank())  # every rank, at one check point

    def _memory_off(self, rank: int, why: str) -> None:
        """Every rank, together: the memory tier off, one warning (step, rank, why)."""
        ctx, memory = self.ctx, self.memory
        self.memory = None
        for problem in memory.switch_off():
            ctx.warn_here(problem)
        where = f"rank {rank}: " if ctx.world.world_size > 1 else ""
        ctx.warn(f"checkpoint.memory_every_steps: in-memory snapshots are off at step "
                 f"{ctx.state.step}: {where}{why}; the run goes on with disk snapshots")


def resume(ctx, memory=None) -> None:
    """Continue from the newest snapshot every rank can restore (a memory snapshot of
    ``memory``, the tier, newer than the latest good disk snapshot), from ``--resume
    PATH``, or start fresh. Rank 0 decides which file and broadcasts the decision."""
    phases.mark("data, model")
    opts = ctx.options
    if opts.get("no_resume"):
        _forget_memory(ctx, memory)
        return
    chosen = disk_step = None
    if ctx.is_rank0 or ctx.checkpointer.all_ranks:
        if opts.get("resume"):
            chosen = _checked_resume_path(ctx, str(opts["resume"]))
        else:
            latest = ctx.checkpointer.latest()
            chosen = str(latest) if latest is not None else None
            disk_step = _step_of(latest)
    chosen, disk_step = distributed.broadcast_object((chosen, disk_step))
    if isinstance(chosen, CheckpointError):
        raise chosen
    if memory is not None:
        if not opts.get("resume") and memory.resume(disk_step, restore):
            return
        _forget_memory(ctx, memory)
    if chosen is None:
        if ctx.is_rank0:
            _say_when_every_snapshot_is_unusable(ctx)
        return
    restore(ctx, load_snapshot(ctx, pathlib.Path(chosen)), source=chosen)
    where = ctx.state.position()
    restarts = (f" (restart {ctx.world.restart_count})" if ctx.world.restart_count else "")
    reached = memory.reached_before if memory is not None else 0
    lost = reached - ctx.state.step
    lost = f" ({lost} step{'' if lost == 1 else 's'} lost)" if lost > 0 else ""
    ctx.print(f"resuming from {chosen}: {where}{restarts}{lost}")
    ctx.record_resume(chosen, "disk", ctx.state.step, reached)


def _step_of(path) -> int | None:
    """The step of the disk snapshot ``latest()`` chose (its manifest's)."""
    return None if path is None else (read_manifest(pathlib.Path(path)) or {}).get("step")


def _forget_memory(ctx, memory) -> None:
    """A run that did not resume from its memory snapshots removes them (older than what
    it resumed from: a restart before its first memory snapshot must not take them)."""
    if memory is not None:
        for problem in memory.remove():
            ctx.warn_here(problem)


def _checked_resume_path(ctx, chosen: str) -> str | CheckpointError:
    """``--resume PATH`` as given, once the checkpointer's own check (its manifest's
    size and checksum) passes on rank 0; else the error every rank raises."""
    chosen = str(ctx.checkpointer.resolve(chosen))
    if not pathlib.Path(chosen).exists():
        return CheckpointError(f"--resume {chosen!r}: no such snapshot")
    problem = ctx.checkpointer.verify(pathlib.Path(chosen)) if ctx.is_rank0 else None
    if problem is None:
        return chosen
    return CheckpointError(f"--resume {chosen!r}: the snapshot fails its check ({problem}); "
                           "resume from another snapshot")


def _say_when_every_snapshot_is_unusable(ctx) -> None:
    """No good snapshot in the checkpoint folder: the run starts over and says so (not
    refused: a run killed in its first save leaves one without a manifest)."""
    found = ctx.checkpointer.snapshots()
    if found:
        ctx.warn(f"none of the {len(found)} snapshot(s) in {ctx.checkpointer.directory} is "
                 "usable (see above): training restarts from step 0")


def load_snapshot(ctx, path: pathlib.Path) -> dict:
    """The snapshot at ``path``, through the checkpointer; nothing is changed yet."""
    if ctx.checkpointer.distributed_state_dict:
        # A sharded format loads in place, as the sharded parts' state dicts say (model,
        # optimizer: created if none yet, a part whose ``sharded`` is true: fsdp's ema).
        parts = ctx.snapshot_parts
        return ctx.checkpointer.load(path, template={
            name: parts[name].state_dict() for name in parts.names()
            if name in ("model", "optimizer") or getattr(parts[name], "sharded", False)})
    # Onto the CPU: load_state_dict copies into the model's and optimizer's devices,
    # and the RNG states must stay CPU tensors (a GPU resume crashed restoring them).
    return ctx.checkpointer.load(path, map_location="cpu")


def restore(ctx, snap: dict, source: str) -> None:
    """Put ``snap`` (from :func:`load_snapshot`) into every registered part, after
    checking its config against this run's."""
    import torch

    snap = upgrade(snap)
    lr_change = check_config(ctx, snap.get("config"), source)
    length = _length_change(ctx, snap.get("config"), source)
    start = schedule_start(ctx.scheduler, ctx.optimizer) if length else None
    ctx.snapshot_parts.load_state_dict(snap, source=source, warn=ctx.warn)
    saved, now = snap.get("threads"), torch.get_num_threads()
    if ctx.options.get("threads_chosen") and saved and saved != now:
        # The default follows the machine's load, which moved since: the interrupted run's
        # threads, so that a CPU's sums (and the weights) are an uninterrupted run's.
        ctx.print(f"threads: {saved} per process, as the interrupted run had (the default "
                  f"is {now} now; --threads N sets it)")
        torch.set_num_threads(saved)
    if lr_change is not None:
        _apply_lr(ctx, *lr_change, source)
    if length:
        follow_new_length(ctx, start, length)


# ------------------------------------------------------------ a changed config


def may_change(key: str, cfg) -> bool:
    return key in MAY_CHANGE or config_mod.resume_safe(cfg, key)


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{key: (saved value, current value)}`` for the keys both configs have and that
    differ (one only one has, from an older engine or recipe, is no change)."""
    old, new = config_mod.flatten(saved), config_mod.flatten(current)
    return {k: (old[k], new[k]) for k in old.keys() & new.keys() if old[k] != new[k]}


def check_config(ctx, saved: dict | None, source: str) -> tuple | None:
    """Refuse a resume whose config changed a key that breaks exact resume (see
    :data:`MAY_CHANGE`), or load it anyway with ``--resume-anyway`` and say what
    changed. Returns ``(old lr, new lr)`` when the learning rate is to be applied."""
    if not isinstance(saved, dict):
        return None  # written before snapshots held their config
    changes = config_changes(saved, config_mod.to_dict(ctx.cfg))
    lr = changes.pop("lr", None)
    # With a scheduler the learning rate is the scheduler's (its state holds the base
    # lrs it scales): a new cfg.lr could only be mixed into it, so it counts as a change
    # that breaks the resume. Without one, the new lr is applied (_apply_lr).
    if lr is not None and ctx.scheduler is not None:
        changes["lr"], lr = lr, None
    refused = {k: v for k, v in sorted(changes.items()) if not may_change(k, ctx.cfg)}
    if refused:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in refused.items())
        if not ctx.options.get("resume_anyway"):
            raise ConfigError(
                f"cannot resume {source}: the config changed {listed}, which would mix two "
                "runs; put the values back, pass --resume-anyway to load the snapshot "
                "with the new values, or --no-resume --overwrite to start fresh")
        ctx.warn(f"--resume-anyway: resuming {source} although the config changed "
                 f"{listed}; the run is no longer an exact continuation"
                 + ("; the learning rate stays the scheduler's" if "lr" in refused else ""))
    return lr


def _length_change(ctx, saved: dict | None, source: str) -> str | None:
    """``epochs``/``max_steps`` changed since ``source``, said, where the scheduler
    follows the run's length; one that is no torch LRScheduler refuses the resume."""
    from torch.optim.lr_scheduler import LRScheduler

    scheduler = ctx.scheduler
    if not isinstance(saved, dict) or scheduler is None or steps_on_metric(scheduler):
        return None
    changed = ", ".join(f"{key} changed since {source}: {saved[key]} -> "
                        f"{getattr(ctx.cfg, key)}" for key in ("epochs", "max_steps")
                        if key in saved and saved[key] != getattr(ctx.cfg, key))
    if changed and not isinstance(scheduler, LRScheduler):
        raise ConfigError(f"cannot resume: {changed}, and the scheduler "
                          f"{type(scheduler).__name__} is not a torch LRScheduler, which "
                          "the engine could rebuild for the new length; put the values "
                          "back, or pass --no-resume --overwrite to start afresh")
    return changed or None


def steps_on_metric(scheduler) -> bool:
    """Whether ``scheduler.step`` needs a value: ReduceLROnPlateau's ``step(metrics)``."""
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError, AttributeError):  # None, or no signature
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in parameters)


def schedule_start(scheduler, optimizer) -> tuple:
    """The fresh scheduler's state and its optimizer's param groups (but their params)."""
    return copy.deepcopy((scheduler.state_dict(), [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]))


def follow_new_length(ctx, start: tuple, changed: str) -> None:
    """After loading a snapshot of another run length (its scheduler's T_max,
    total_steps, milestones...): the scheduler and the optimizer's hyperparameters go back
    to ``start`` (built for the new length) and it steps as often as the loaded one had
    (ChainedScheduler's first's count): where a run of the new length stands."""
    from torch.optim.lr_scheduler import ChainedScheduler

    scheduler, groups = ctx.scheduler, ctx.optimizer.param_groups
    steps = (scheduler._schedulers[0] if isinstance(scheduler, ChainedScheduler)
             else scheduler).last_epoch
    state, fresh, old_lr = *copy.deepcopy(start), groups[0]["lr"]
    for group, hyper in zip(groups, fresh):
        group.update(hyper)
    scheduler.load_state_dict(state)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore")
        for _ in range(steps):
            scheduler.step()
    unit, cfg = ("step" if ctx.cfg.scheduler_interval == "step" else "epoch"), ctx.cfg
    length = (f"{cfg.epochs} epochs" + (f", max_steps={cfg.max_steps}" if cfg.max_steps else "")
              + (f" ({ctx.total_steps} steps)" if ctx.total_steps else ""))
    ctx.warn(f"{changed}; the scheduler ({type(scheduler).__name__}, per {unit}) is rebuilt "
             f"for {length} and brought to {unit} {steps} of it: the learning rate is the "
             f"new schedule's from here on ({old_lr:.4g} -> {groups[0]['lr']:.4g} now; put "
             "the old length back to continue the old schedule)")


def _apply_lr(ctx, old: float, new: float, source: str) -> None:
    """Set a changed ``lr`` on the loaded optimizer (else it keeps the snapshot's); a
    param group at another lr (a per-group multiple of cfg.lr) is scaled by new/old."""
    for group in ctx.optimizer.param_groups:
        if group["lr"] == old or not old:
            group["lr"] = new
        else:
            group["lr"] = group["lr"] * new / old
    ctx.warn(f"lr changed since {source}: {old!r} -> {new!r}, applied to every optimizer "
             "param group")
