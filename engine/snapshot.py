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
import functools
import inspect
import math
import pathlib
import time
import warnings

import engine
from engine import config as config_mod
from engine import distributed, memory_ring, memory_snapshot, phases, shm_codec, stateful
from engine.checkpoint import read_manifest
from engine.errors import CheckpointError, ConfigError

# torch is imported inside the functions that use it: the launching process imports
# this module (engine/launching.py: already_complete) without torch.

#: Config keys a resumed run may change: they decide how long the run goes and how it
#: is launched, watched and stored, not what an optimizer step computes. Any OTHER key
#: that differs refuses the resume (unless --resume-anyway): batch_size,
#: grad_accum_steps, seed, drop_last, per_sample_seed, precision, scheduler_interval,
#: ddp's arithmetic, a recipe's own keys (the engine cannot judge those: refusing never
#: mixes two runs silently). ``lr`` has its own rule (:func:`_apply_lr`). Another world
#: size continues at the global sample position (:class:`engine.stateful.LoaderPosition`).
#: A config group names its own in ``RESUME_SAFE`` (:func:`engine.config.resume_safe`).
MAY_CHANGE = frozenset({
    "epochs", "log_every", "num_workers", "timeout_s", "out_dir", "launcher", "init_method",
    "parallel", "checkpointer", "preemption", "requeue", "deterministic", "on_nonfinite",
    "activation_checkpointing",
    # How long the run goes and when it validates, not what a step computes (a longer
    # max_steps trains on from where the run ended). The smoke switch (limit_batches,
    # smoke) may not change: a smoke run's folder is its own.
    "max_steps", "val_every_steps",
})


def capture(ctx, config: dict | None = None, parts: dict | None = None) -> dict:
    """The snapshot dict: a header, then every registered part's state
    (engine/stateful.py). Collective: every rank walks the parts (some gather).
    ``config``: the config as a dict, when the caller keeps it (it does not change
    while training); ``parts``: the parts' states, when the caller walked them."""
    state = ctx.state
    return {
        "engine_version": engine.__version__,
        "config": config if config is not None else config_mod.to_dict(ctx.cfg),
        # The recipe file (or a custom loop's script): with the config, what
        # engine.load_model rebuilds the model from.
        "recipe": ctx.recipe_path,
        "world_size": ctx.world.world_size,
        # Where training stands, for tools that read a snapshot without the engine
        # (tools/ckpt.py inspect); a resume reads the parts, never these.
        "epoch": state.epoch,
        "step": state.step,
        "batch_in_epoch": state.batch_in_epoch,
        "epochs_completed": state.epochs_completed,
        **(parts if parts is not None else ctx.snapshot_parts.state_dict()),
    }


def capture_here(ctx, config) -> tuple[dict, bytes]:
    """A memory snapshot's dict, without a collective of its own, and this rank's
    exchange row (engine/memory_snapshot.py's make_row). Each rank keeps its own share
    where the disk snapshot gathers every rank's: ``progress`` its own loss sums (the
    Trainer's ``local_state_dict()``), and ``rng`` this rank's row (its RNG states and
    loss sums) rather than every rank's RNG states. Any other part that gathers still
    does. The
    row goes to the other ranks off the step's path (MemorySnapshots.start_exchange);
    memory_snapshot.complete makes a snapshot whole again at a resume."""
    parts, states = ctx.snapshot_parts, {}
    for name in parts.names():
        part = parts[name]
        if isinstance(part, stateful.RngStates):
            continue  # below, once the loss sums are known
        # The Trainer's progress: its loss sums, which memory_snapshot.complete sums
        # over the ranks at a resume (only it knows how to make them whole again). A
        # sharded part (fsdp): this rank's own shards (engine/stateful.py).
        here = getattr(part, "local_state_dict" if name == "progress"
                       else "memory_state_dict", None)
        states[name] = here() if here is not None else part.state_dict()
    loss = (states.get("progress") or {}).get("epoch_loss")
    row = memory_snapshot.make_row(None if loss is None else (loss["sum"], loss["batches"]))
    if "rng" in parts:
        states["rng"] = {"world_size": ctx.world.world_size, "rank": ctx.world.rank,
                         "row": row}
    return capture(ctx, config, states), row


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
    """When a snapshot to disk is due: every ``every_steps`` optimizer steps, every
    ``every_minutes`` of wall time (rank 0's clock; the ranks agree at a check point),
    every ``every_epochs`` epochs, and after the last epoch."""

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


#: ``checkpoint.memory_every_steps=auto``: the share of the training step's time the
#: memory snapshots may take; the interval is the smallest that keeps their cost within it.
MEMORY_BUDGET = 0.02
#: auto's intervals: powers of two, so that the snapshot steps of a new interval are
#: multiples of the old one's or the reverse, and a crash while the interval changes
#: still loses at most the larger of the two (Snapshots.agreed); at most 128 steps,
#: near the fixed 100 it replaced, however expensive a snapshot is.
MEMORY_INTERVALS = tuple(2**i for i in range(8))
#: The tier's interval while auto's probe pauses it for a window (never due).
PAUSED = 1 << 62


class MemoryCost:
    """What this rank's memory snapshots cost against its training steps, measured at
    each check point with the clocks the run keeps anyway: the snapshots' own
    (engine/phases.py carves them out of the training phase) and the check point's
    window (its wall time and steps). Totals since the first check point after the
    tier's first snapshot: that one also reserves the buffers and agrees with the other
    ranks that they could (a collective), which no later one does.

    A window's step time is its wall time less the snapshots written in it (to memory
    and to disk); a validation inside it (val_every_steps) counts as steps, which can
    only make the interval shorter. The copy a large or GPU state leaves to the
    background thread counts where the next optimizer step waits for it
    (phases.MEMORY_WAITS). What no clock of theirs sees (that copy taking the CPUs the
    step's threads need) is measured once, by comparing a window with a snapshot at
    every step with one without (:meth:`probed`; Snapshots pauses the tier for it)."""

    def __init__(self):
        self.snapshot_s = self.step_s = 0.0
        self.snapshots = self.steps = 0
        self.last = self.clocks()  # at the last check point, or the window's start
        self.counting = False  # the last check came after the tier's first snapshot
        #: The last window's seconds per step, its memory snapshots included (its disk
        #: snapshots not), or None after a window without steps.
        self.window_step_s: float | None = None
        #: Per snapshot, what it costs beyond its clocks (probed); None until measured.
        self.hidden_s: float | None = None

    @staticmethod
    def clocks() -> tuple[float, int, float]:
        """The memory snapshots' seconds (with the optimizer steps' waits for their
        background copies) and count, and the disk snapshots' seconds, so far in this
        process."""
        memory_s, _, memory_n = phases.carved(phases.MEMORY_SNAPSHOTS)
        memory_s += phases.carved(phases.MEMORY_WAITS)[0]
        return memory_s, memory_n, phases.carved(phases.SNAPSHOTS)[0]

    def window_started(self) -> None:
        """An epoch's first window starts: what came between the last check point and
        here (the epoch's end: its snapshots, validation) is in no window."""
        self.last = self.clocks()

    def measure(self, window_s: float, window_steps: int, saves: int) -> None:
        """At a check point: its window's wall seconds and optimizer steps, and how many
        memory snapshots this rank has written so far."""
        now = self.clocks()
        memory_s, memory_n, disk_s = (a - b for a, b in zip(now, self.last))
        self.window_step_s = (max(0.0, window_s - disk_s) / window_steps
                              if window_steps > 0 else None)
        if self.counting and window_steps > 0:
            self.snapshot_s += memory_s
            self.snapshots += memory_n
            self.step_s += max(0.0, window_s - memory_s - disk_s)
            self.steps += window_steps
        self.last, self.counting = now, saves > 0

    def probed(self, with_snapshots_s: float, without_s: float) -> None:
        """The probe's two windows' seconds per step: with a memory snapshot at every
        step, and without any. Their difference is what a snapshot costs, all of it; what
        its clocks do not show is added to every snapshot from now on. (A difference
        below the clocks' is the load's noise: the clocks' then.)"""
        clocked = self.snapshot_s / self.snapshots if self.snapshots else 0.0
        self.hidden_s = max(0.0, with_snapshots_s - without_s - clocked)

    def per_step(self) -> float | None:
        """One step's time without the snapshots: the windows' less the snapshots' clocks
        (measure) and less what the probe found they cost beyond them (at most half)."""
        if not (self.steps and self.step_s > 0):
            return None
        hidden = (self.hidden_s or 0.0) * self.snapshots
        return max(self.step_s - hidden, self.step_s / 2) / self.steps

    def per_snapshot(self) -> float | None:
        """One snapshot's cost: its clocks' mean and what the probe found beyond them."""
        if not self.snapshots:
            return None
        return self.snapshot_s / self.snapshots + (self.hidden_s or 0.0)

    def every_steps(self, current: int) -> int | None:
        """The shortest interval (of MEMORY_INTERVALS) whose snapshots cost at most
        MEMORY_BUDGET of the step time, or None before any was measured. Shorter than
        ``current`` (the interval now) only where it keeps them within 80% of the
        budget: a cost near a boundary would otherwise change it at every check point.
        None until the probe measured what the clocks do not see."""
        percent = self.percent(1)
        if self.hidden_s is None or percent is None:
            return None
        needed = percent / (100 * MEMORY_BUDGET)  # steps per snapshot within the budget
        every = shortest(needed)
        return every if every >= current else min(current, shortest(needed / 0.8))

    def percent(self, every_steps: int) -> float | None:
        """The snapshots' cost at one every ``every_steps`` steps, in % of the step time
        (None before both were measured)."""
        snapshot, step = self.per_snapshot(), self.per_step()
        if snapshot is None or step is None:
            return None
        return 100 * snapshot / (every_steps * step)

    def record(self, every_steps: int, auto: bool) -> dict:
        """summary.json's ``memory_snapshots``: the interval, whether auto chose it, what
        one snapshot and one step took (rank 0's) and the snapshots' share at it."""
        def rounded(value, digits=6):
            return None if value is None else round(value, digits)

        return {"every_steps": every_steps, "auto": auto,
                "snapshot_s": rounded(self.per_snapshot()), "step_s": rounded(self.per_step()),
                "cost_percent": rounded(self.percent(every_steps) if every_steps else None, 3)}


def shortest(needed: float) -> int:
    """The shortest of MEMORY_INTERVALS of at least ``needed`` steps (the longest where
    none is)."""
    return next((n for n in MEMORY_INTERVALS if n >= needed), MEMORY_INTERVALS[-1])


def proposal(every_steps: int | None) -> list[float]:
    """A rank's proposed interval for the check point's all-reduce (a sum): one 1 at
    its place in MEMORY_INTERVALS, all 0 for none. The sums say which intervals any
    rank proposed: the largest is the one every rank's budget allows."""
    return [float(n == every_steps) for n in MEMORY_INTERVALS]


def agreed_interval(sums) -> int | None:
    """The largest interval any rank proposed (:func:`proposal`'s sums), or None."""
    return max((n for n, total in zip(MEMORY_INTERVALS, sums) if total > 0), default=None)


class Snapshots:
    """The run's snapshots, one layer: the training loop tells it when an optimizer step
    ended (:meth:`step_ended`) and it decides: to disk (``every_steps``, or a check
    point's time flag), into shared memory (``memory_every_steps``, while the memory
    tier is on), or nothing. The loop asks only from step :attr:`next_due` on: where
    nothing is due, a step costs it two attribute reads and a compare, no call. The
    loop has it write the snapshots the loop itself decides (:meth:`save`: an epoch's
    end, a pre-emption, the run's end).

    It owns the memory tier (engine/memory_snapshot.py; ``memory``: the run's, as the
    Engine opened it, or None): each step's progress note (:attr:`note_reached`), and
    its switch-off where a rank's buffer cannot be had. A memory snapshot is a
    collective, so every rank turns the tier off at the same check point: the check
    point's all-reduce carries this layer's flags (:meth:`check_flags`) and
    :meth:`agreed` acts on their sums.

    ``finish_check``: the loop's, called before a snapshot at a step: the check point in
    flight is finished (its window logged: a run resumed from the snapshot would never
    log it) and its flags recorded, which may raise the time flag or turn the tier off
    here; it returns True when they stop the run at this step (a pre-emption: the loop
    writes the durable snapshot as the epoch stops)."""

    def __init__(self, ctx, memory, finish_check, check_point=None):
        self.ctx = ctx
        self.policy = SnapshotPolicy(ctx.cfg, ctx.is_rank0)
        self.finish_check = finish_check
        self.memory = memory
        # The tier's progress note, which the loop calls right after each optimizer
        # step (a restart says how many steps it lost); None while the tier is off.
        self.note_reached = None if memory is None else memory.note_reached
        # A finished check point said a snapshot is due by time (every_minutes): the
        # next snapshot goes to disk.
        self.time_due = False
        # The first step the loop asks at (step_ended): none is due by count before it,
        # and no check point said one is due by time. 0 until the first step (a resume
        # moves the count) and while a time flag waits for a snapshot to disk.
        self.next_due = 0
        # What the memory snapshots cost (measured at check points, auto or not), and
        # whether the ranks choose their interval from it (memory_every_steps=auto: from
        # 1, every restart too, on whatever machines it runs now; Engine opens the tier).
        self.memory_cost = MemoryCost()
        self.auto = memory is not None and ctx.cfg.checkpoint.memory_every_steps == "auto"
        # auto's probe, by check point (the same on every rank, so the tier pauses and
        # resumes at the same steps everywhere): the window of the first snapshot (it
        # reserves the buffers: not counted), one with a snapshot at every step, one
        # without any (the tier paused), then None: MemoryCost.probed compares the two.
        self.probe = "first" if self.auto else None
        self.probe_with_s = None  # the window with a snapshot at every step, per step
        self._record_memory()
        if check_point is not None:  # the loop's (engine/check_point.py): this layer's slot
            check_point.add("snapshots", self.check_flags, self.agree_on,
                            started=self.window_started)

    # --------------------------------------------------------------- per step

    def step_ended(self, step: int) -> None:
        """After optimizer step ``step``, its check point and validation done (but not
        where the run stops or ends at it: the loop writes that snapshot). A snapshot to
        disk when ``every_steps`` is due or a check point said one is due by time, else
        one into shared memory when ``memory_every_steps`` is due.

        The check in flight is finished first (``finish_check``), and its flags count
        as any check's: a pre-emption writes no snapshot here (the loop writes the
        durable one as the epoch stops), a snapshot due by time goes to disk instead of
        memory. Dropping them lost both whenever every check point had a snapshot at its
        step (memory_every_steps=1): pre-emption waited for the epoch's end, or never
        came in the last epoch."""
        self.next_due = 0 if self.time_due else self._next_due(step)
        to_disk = self.policy.due_at_step(step)
        to_memory = self.memory is not None and self.memory.due(step)
        if not (to_disk or to_memory or self.time_due):
            return
        if self.finish_check():
            return
        if to_disk or self.time_due:
            self.save()
        elif self.memory is not None:  # the finished check may have turned it off
            self._to_memory()

    def _next_due(self, step: int) -> float:
        """The first step after ``step`` at which a snapshot is due by count (a
        multiple of every_steps or of the memory tier's every_steps; it may have gone
        off since: then the call finds nothing due)."""
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
        """At an epoch's end: every_epochs, the last epoch, or a check point's time flag
        (the epoch's last check point, finished at its end, may have raised it)."""
        return self.policy.due_at_epoch_end(epochs_done) or self.time_due

    def window_started(self) -> None:
        """The loop's, as an epoch's first log window starts (MemoryCost.window_started)."""
        if self.memory is not None:
            self.memory_cost.window_started()

    def check_flags(self, window_s: float, window_steps: int) -> list[float]:
        """This rank's flags for a check point's all-reduce (summed over the ranks): a
        snapshot due by time (rank 0's clock decides: the others' policy has no period),
        this rank's memory buffer could not be had (a full tmpfs, a background copy that
        failed), and under memory_every_steps=auto the interval its measured costs allow
        (:func:`proposal`). ``window_s``, ``window_steps``: the check point's window, the
        step time the costs are measured against."""
        memory, every = self.memory, None
        if memory is not None:
            self.memory_cost.measure(window_s, window_steps, memory.saves)
            if self.probe is not None:
                self._probe()
            if self.auto:
                every = self.memory_cost.every_steps(memory.every_steps)
            self._record_memory()
        return [float(self.policy.due_by_time()),
                float(memory is not None and memory.failed is not None), *proposal(every)]

    def agree_on(self, sums) -> None:
        """A finished check point's sums of :meth:`check_flags`, as it laid them out."""
        self.agreed(sums[0] > 0, sums[1] > 0, sums[2:])

    def agreed(self, due_by_time: bool, memory_failed: bool, intervals=()) -> None:
        """A finished check point's sums of :meth:`check_flags`, the same on every rank:
        the next snapshot goes to disk, or every rank turns the memory tier off, or
        (auto) every rank takes the largest interval any rank proposed, at this step.

        A memory snapshot is a collective (the rows' all_gather), so the ranks must
        write them at the same steps: they do, since each applies the same sums at the
        same step. The intervals are powers of two and a snapshot is due at their
        multiples, so the steps of the new interval fall on the old one's (a shorter
        one) or the old one's on the new one's (a longer one): between the last
        snapshot and the next there are never more steps than the larger of the two."""
        if due_by_time:
            self.time_due = True
            self.next_due = 0  # the loop asks at every step until a snapshot to disk
        every = agreed_interval(intervals) if self.auto else None
        if every is not None and self.memory is not None and every != self.memory.every_steps:
            self.memory.every_steps = every
            self.next_due = 0  # the next step asks: it may be due at the new interval
            self._record_memory()
            if self.ctx.options.get("verbose"):
                self.ctx.print(f"in-memory snapshots: every {every} step(s) from step "
                               f"{self.ctx.state.step} (auto, the longest any rank's costs "
                               f"asked for; {self._cost_said(every)})")
        if memory_failed and self.memory is not None:
            # Every rank is here, at the same check point: one gather tells rank 0 which
            # rank's buffer failed and why, for the one warning (once in a run).
            failed = [(rank, why) for rank, why in enumerate(
                distributed.all_gather_object(self.memory.failed)) if why is not None]
            self._memory_off(*failed[0])

    # ------------------------------------------------------------ memory tier

    def _to_memory(self) -> None:
        """Copy a snapshot into this rank's shared-memory buffer. Every rank saves its
        own, with no collective to wait for (capture_here): the rows the ranks exchange
        go off the step's path. A rank whose buffer cannot be had (a full tmpfs, a name
        taken) still starts the exchange, a collective, and raises ``memory.failed``:
        the ranks agree to turn the tier off at the next check point (:meth:`agreed`).
        Before the first one they agree at once (_memory_problem)."""
        ctx, memory = self.ctx, self.memory
        with phases.carve(phases.MEMORY_SNAPSHOTS, within="training",
                          label="memory snapshot"):
            if memory.config is None:  # the same at every step: converted and pickled once
                memory.config = shm_codec.Pickled(config_mod.to_dict(ctx.cfg))
            state, row = capture_here(ctx, memory.config)
            if not memory.saves:
                problem = _memory_problem(ctx, memory, state)  # collective
                if problem is not None:
                    self._memory_off(*problem)
                    return
            memory.start_exchange(row)  # every rank: a collective, not waited for
            saved = False
            if memory.failed is None:
                # What only the optimizer's step changes is copied during the next
                # step's forward and backward, finished before that optimizer step
                # (memory.hold). Asked only when the copies are planned again
                # (memory.save), not each step.
                held = (None if ctx.optimizer is None
                        else functools.partial(memory_snapshot.held_by, ctx.optimizer))
                try:
                    if memory.save(state, step=ctx.state.step, epoch=ctx.state.epoch,
                                   held=held):
                        memory.hold(ctx.optimizer)  # its next step waits for the copy
                    saved = True
                except (memory_snapshot.NoRoom, memory_snapshot.Unsafe) as exc:
                    memory.failed = str(exc)
            memory.record_exchange(saved)

    def _memory_off(self, rank: int, why: str) -> None:
        """Every rank, together: no more memory snapshots, their buffers removed, one
        warning (rank 0's, naming the step, the rank and why); the run goes on with disk
        snapshots. ``ctx.memory`` stays the tier the run opened: removing it again at
        the run's end finds nothing."""
        ctx, memory = self.ctx, self.memory
        self.memory = self.note_reached = None
        self._record_memory()  # every_steps 0: a crash now goes back to the disk snapshot
        for problem in memory.remove():
            ctx.warn_here(problem)
        where = f"rank {rank}: " if ctx.world.world_size > 1 else ""
        ctx.warn(f"checkpoint.memory_every_steps: in-memory snapshots are off at step "
                 f"{ctx.state.step}: {where}{why}; the run goes on with disk snapshots")


    def _probe(self) -> None:
        """auto's next probe stage, at a check point (:attr:`probe`)."""
        cost, memory = self.memory_cost, self.memory
        if cost.window_step_s is None:  # a window without steps: the stage waits
            return
        if self.probe == "first":
            self.probe = "with"
        elif self.probe == "with":
            self.probe_with_s, self.probe = cost.window_step_s, "without"
            memory.every_steps = PAUSED  # the next window takes none: a crash there
            # goes back to the last one, at most a window and a step
        else:
            cost.probed(self.probe_with_s, cost.window_step_s)
            self.probe, memory.every_steps = None, 1
            self.next_due = 0  # the loop asks again from the next step

    def _record_memory(self) -> None:
        """summary.json's ``memory_snapshots`` (MemoryCost.record): the interval now and
        what the snapshots cost; None while the run has no memory tier."""
        if self.memory is None and not getattr(self.ctx, "memory_record", None):
            return
        every = self.memory.every_steps if self.memory is not None else 0
        self.ctx.memory_record = self.memory_cost.record(
            1 if every == PAUSED else every, self.auto)

    def _cost_said(self, every: int) -> str:
        """What a snapshot costs, for the verbose line of a new interval."""
        percent = self.memory_cost.percent(every)
        return (f"budget {100 * MEMORY_BUDGET:g}% of the step time" if percent is None else
                f"here they cost {percent:.2f}% of the step time at it, budget "
                f"{100 * MEMORY_BUDGET:g}%")


def _memory_problem(ctx, memory, state: dict) -> tuple[int, str] | None:
    """Before the first memory snapshot: whether every rank can keep two: room for them
    in the tmpfs of every machine, and both buffers reserved (a name taken by anything
    but this user's own file is refused, engine/memory_snapshot.py). Collective: the
    first rank that cannot, and why (all turn them off together: a rank alone would
    leave the others' next snapshot, a collective, waiting); None when all can."""
    needed, free = memory.room_for(state)
    each = needed / 2 / ctx.world.local_world_size / 2**20  # MB, one buffer
    problem = None
    if needed > free:
        problem = (f"they need 2 x {each:.1f} MB per rank in {memory.shm}, and it has "
                   f"{free / 2**20:.0f} MB free; make it larger (docker: --shm-size), "
                   "set checkpoint.memory_dir to a larger tmpfs, or set "
                   "checkpoint.memory_every_steps=0")
    else:
        try:
            memory.reserve(state)
        except (memory_snapshot.NoRoom, memory_snapshot.Unsafe) as exc:
            problem = str(exc)
    problems = [(rank, p) for rank, p in enumerate(distributed.all_gather_object(problem))
                if p]
    if problems:
        return problems[0]
    if ctx.options.get("verbose"):
        auto = " to start with (auto)" if ctx.cfg.checkpoint.memory_every_steps == "auto" else ""
        ctx.print(f"in-memory snapshots: every {memory.every_steps} step(s){auto}, 2 x "
                  f"{each:.1f} MB per rank in {memory.folder}")
    return None


def resume(ctx) -> None:
    """Continue from the newest snapshot every rank can restore (a memory snapshot newer
    than the latest good disk snapshot, see :func:`_resume_from_memory`), from
    ``--resume PATH``, or start fresh.

    Rank 0 decides which file (if any) and broadcasts the decision, so the ranks never
    disagree about whether there is something to resume.
    """
    phases.mark("data, model")
    opts = ctx.options
    memory = getattr(ctx, "memory", None)
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
        if not opts.get("resume") and _resume_from_memory(ctx, memory, disk_step):
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
    """The step of the disk snapshot ``latest()`` chose (its manifest's: latest() takes
    none without one)."""
    return None if path is None else (read_manifest(pathlib.Path(path)) or {}).get("step")


def _resume_from_memory(ctx, memory, disk_step: int | None) -> bool:
    """Resume from the newest memory snapshot when one is newer than the disk snapshot:
    this rank's own buffer, or a healthy peer's sent over the process group where this
    rank's is gone. Collective. False: none newer (the disk snapshot, if any, wins).
    Only this run's buffers count (the run id, engine/memory_snapshot.py); one that
    fails to load is a warning and the next tier."""
    mine = memory_snapshot.load_all(memory, ctx.warn_here)
    # fsdp: this rank's copies of its predecessor's snapshots (engine/memory_ring.py).
    copies = memory_ring.load_held(memory, ctx.warn_here)
    try:
        choice = memory_snapshot.agree(memory, mine, copies)
        memory.reached_before = choice.reached
        if not choice.newer_than(disk_step):
            notice = choice.not_used(disk_step)  # fsdp: a rank's shards lost, or resized
            if notice:
                ctx.print(notice)
            return False
        source = f"memory (step {choice.step})"
        # fsdp, a rank without its own: its successor's copy (engine/memory_ring.py).
        snap = (memory_ring.fetch(memory, choice, mine, copies) if choice.peers
                else memory_snapshot.fetch(memory, choice, mine))
        restore(ctx, snap, source=source)
    finally:
        for loaded in mine + copies:
            loaded.close()
    missing = choice.missing(ctx.world.world_size)
    # fsdp: each missing rank's successor sent its copy (one rank, the usual case).
    senders = sorted(set(choice.peers.values())) or [choice.source]
    why = (f"rank(s) {', '.join(map(str, missing))} had no copy: sent by rank "
           f"{', '.join(map(str, senders))}" if missing else
           f"restart {ctx.world.restart_count}" if ctx.world.restart_count else "rerun")
    lost = max(0, choice.reached - choice.step)
    ctx.print(f"resumed from memory at step {choice.step} ({why}; {lost} step"
              f"{'' if lost == 1 else 's'} lost): {ctx.state.position()}")
    ctx.record_resume(source, "peer" if missing else "memory", choice.step, choice.reached,
                      source_rank=choice.source if missing else None)
    return True


def _forget_memory(ctx, memory) -> None:
    """A run that did not resume from its memory snapshots removes them: they are older
    than what it resumed from (or belong to the run it starts afresh over), and a
    restart before its first memory snapshot must not take them."""
    if memory is not None:
        for problem in memory.remove():
            ctx.warn_here(problem)


def _checked_resume_path(ctx, chosen: str) -> str | CheckpointError:
    """``--resume PATH`` as given, once the checkpointer's own check (its manifest's
    size and checksum) passes: a bit-flipped snapshot loaded without a word before, and
    training went on from damaged weights. Rank 0 decides; the others get its answer.
    No way around it: the checkpointer's load refuses a damaged file too."""
    chosen = str(ctx.checkpointer.resolve(chosen))
    if not pathlib.Path(chosen).exists():
        return CheckpointError(f"--resume {chosen!r}: no such snapshot")
    problem = ctx.checkpointer.verify(pathlib.Path(chosen)) if ctx.is_rank0 else None
    if problem is None:
        return chosen
    return CheckpointError(f"--resume {chosen!r}: the snapshot fails its check ({problem}); "
                           "resume from another snapshot")


def _say_when_every_snapshot_is_unusable(ctx) -> None:
    """No good snapshot among those in the checkpoint folder (each was reported as
    unusable): the run starts over, and says so in one line rather than leaving it to
    be inferred from the warnings. Not refused: a run killed during its first save
    leaves a snapshot without its manifest, and must start again by itself."""
    found = ctx.checkpointer.snapshots()
    if found:
        ctx.warn(f"none of the {len(found)} snapshot(s) in {ctx.checkpointer.directory} is "
                 "usable (see above): training restarts from step 0")


def load_snapshot(ctx, path: pathlib.Path) -> dict:
    """The snapshot at ``path``, through the checkpointer; nothing is changed yet."""
    if ctx.checkpointer.distributed_state_dict:
        # A sharded format loads in place: the sharded parts' own state dicts (model,
        # optimizer, and any part whose ``sharded`` is true: ema under fsdp) say what to
        # read and where (get_state_dict creates the optimizer state if it has none yet).
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
    snap = upgrade(snap)
    lr_change = check_config(ctx, snap.get("config"), source)
    length = _length_change(ctx, snap.get("config"), source)
    start = schedule_start(ctx.scheduler, ctx.optimizer) if length else None
    ctx.snapshot_parts.load_state_dict(snap, source=source, warn=ctx.warn)
    if lr_change is not None:
        _apply_lr(ctx, *lr_change, source)
    if length:
        follow_new_length(ctx, start, length)


# ------------------------------------------------------------ a changed config


def may_change(key: str, cfg) -> bool:
    return key in MAY_CHANGE or config_mod.resume_safe(cfg, key)


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{key: (saved value, current value)}`` for the keys both configs have and that
    differ. A key only one of them has (a snapshot from an older engine or recipe) is no
    change: there is nothing to compare it with."""
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
    """``epochs``/``max_steps`` changed since ``source``, said, when the scheduler follows
    the run's length (one stepping on a metric does not); a scheduler that is no torch
    LRScheduler (which follow_new_length can rebuild) refuses the resume."""
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
    """After loading a snapshot of another run length, whose scheduler state holds the
    old one (T_max, total_steps, milestones...): the scheduler and the optimizer's
    hyperparameters go back to ``start`` (the scheduler built for the new length) and it
    steps as often as the loaded one had (its count; ChainedScheduler's first's): where a
    run of the new length stands, whatever the schedule (a chained formula, a closure)."""
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
    """Set a changed ``lr`` on the loaded optimizer, which would otherwise keep the
    snapshot's while config.json says the new one. A param group at another lr (a
    recipe's per-group multiple of cfg.lr) is scaled by new/old, keeping the ratio."""
    for group in ctx.optimizer.param_groups:
        if group["lr"] == old or not old:
            group["lr"] = new
        else:
            group["lr"] = group["lr"] * new / old
    ctx.warn(f"lr changed since {source}: {old!r} -> {new!r}, applied to every optimizer "
             "param group")
