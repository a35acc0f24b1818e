"""The memory tier's one face, :class:`MemoryTier`: the snapshot layer (engine/snapshot.py's
Snapshots) opens it at the resume, feeds it after each optimizer step and at each check
point, and closes it at the run's end."""

from __future__ import annotations

import os
import pathlib
import socket

import torch

from engine import config as config_mod
from engine import distributed, phases, shm_codec
from engine.memory import resume as agreeing
from engine.memory import ring as ring_mod
from engine.memory.buffer import read_info
from engine.memory.copy_plan import held_by
from engine.memory.cost import MEMORY_BUDGET, PAUSED, MemoryCost, crowded
from engine.memory.files import (BUFFER_NAME, NoRoom, Unsafe, claim_run_id, copied,
                                 folder_of, mount_namespace, writer_gone)
from engine.memory.pair import MemorySnapshots
from engine.memory.rows import make_row
from engine.shm import SHM, sweep
from engine.shards import is_sharded


class MemoryTier:
    """This rank's in-memory snapshots: its buffers (``pair``), what they cost and
    auto's interval (``cost``). Every call is made on every rank at the same step."""

    def __init__(self, ctx, pair: MemorySnapshots):
        self.ctx = ctx
        self.pair = pair
        # The step reached, at each optimizer step taken (a restart says what it lost).
        self.reached = ctx.optimizer and ctx.optimizer.register_step_post_hook(
            lambda *_: pair.note_reached(ctx.state.step + 1))
        # Per snapshot, bytes: rows "sent", "received", and the exchange region "kept".
        self.exchange_bytes = pair.exchanges.bytes()
        # auto: from every step (each restart too), then what the ranks' costs allow.
        self.auto = ctx.cfg.checkpoint.memory_every_steps == "auto"
        self.cost = MemoryCost(self.auto, (lambda: pair.background.cpu_s) if crowded(
            ctx.device, torch.get_num_threads(), pair.world.cpu_share().count) else None)
        self.record()

    @classmethod
    def open(cls, ctx) -> MemoryTier | None:
        """Collective: the run's tier (its id, earlier runs' leftovers removed, the folder
        checked; fsdp: the ring), or None, one warning, where any rank cannot have it."""
        every, opts = ctx.cfg.checkpoint.memory_every_steps, ctx.options
        ids = None
        if ctx.is_rank0:
            try:
                if copied(ctx.out_dir):  # its id and buffers are the original's
                    ctx.print(f"{ctx.out_dir} is a copy of another run folder: its memory "
                              "snapshots get an id of their own (the original's are not "
                              "resumed here)")
                ids = claim_run_id(ctx.out_dir, bool(opts.get("no_resume")))
            except OSError as exc:
                ids = f"cannot write its id into {ctx.out_dir}: {exc.strerror or exc}"
        ids = distributed.broadcast_object(ids)
        pair = problem = None
        if isinstance(ids, str):
            problem = ids
        else:
            old, run_id = ids
            pair = MemorySnapshots(ctx.out_dir, ctx.world, 1 if every == "auto" else every,
                                   run_id=run_id, shm=ctx.cfg.checkpoint.memory_dir,
                                   sharded=is_sharded(ctx.module))
            problem = pair.check()
            if problem is None and ctx.world.is_local_rank0:
                # --no-resume and --resume PATH: none of the run's snapshots is wanted.
                forget = old if opts.get("no_resume") or opts.get("resume") else None
                for warning in remove_leftovers(ctx.out_dir, run_id, pair.shm,
                                                forget=forget)[1]:
                    ctx.warn_here(warning)
        if (problem := distributed.first_problem(problem)) is not None:  # a barrier too
            ctx.warn(f"checkpoint.memory_every_steps: in-memory snapshots are off: "
                     f"{problem[1]}; the run goes on with disk snapshots")
            return None
        if pair.sharded and ctx.world.world_size > 1:  # fsdp: each rank's at its successor
            pair.ring = ring_mod.Ring(pair, ctx.cfg.timeout_s)  # collective
        return cls(ctx, pair)

    @property
    def every_steps(self) -> int:
        return self.pair.every_steps

    @every_steps.setter
    def every_steps(self, every: int) -> None:
        self.pair.every_steps = every

    @property
    def failed(self) -> str | None:
        """Why this rank's last save failed (the ranks agree to turn the tier off)."""
        return self.pair.failed

    def due(self, step: int) -> bool:
        return self.pair.due(step)

    # ------------------------------------------------------------ a snapshot

    def save(self, whole) -> tuple[int, str] | None:
        """Copy a snapshot (:func:`capture`'s, ``whole`` its header) into this rank's
        buffer, no collective waited for. A rank whose buffer cannot be had still starts
        the exchange (its keepers wait) and sets ``failed``; before the first snapshot
        the ranks agree at once: returns the first rank that cannot, and why."""
        ctx, pair = self.ctx, self.pair
        with phases.carve(phases.MEMORY_SNAPSHOTS, within="training",
                          label="memory snapshot"):
            if pair.config is None:  # the same at every step: converted and pickled once
                pair.config = shm_codec.Pickled(config_mod.to_dict(ctx.cfg))
            line = pair.exchanges.line(ctx.device)
            state, row, loss_sum = capture(ctx, pair.config, whole, line)
            if not pair.saves:
                problem = self._first_problem(state)  # collective
                if problem is not None:
                    return problem
            pair.exchanges.start(row, loss_sum)  # every rank: to its keepers, not waited for
            saved = False
            if pair.failed is None:
                # The optimizer's tensors and the row: copied during the next step (hold).
                held = (None if ctx.optimizer is None
                        else lambda: held_by(ctx.optimizer) | {line.data_ptr()})
                try:
                    if pair.save(state, step=ctx.state.step, epoch=ctx.state.epoch,
                                 held=held):
                        pair.hold(ctx.optimizer)  # its next step waits for the copy
                    saved = True
                except (NoRoom, Unsafe) as exc:
                    pair.failed = str(exc)
            pair.record_exchange(saved)
        return None

    def _first_problem(self, state: dict) -> tuple[int, str] | None:
        """Before the first snapshot, collective: whether every rank has room for two
        buffers and reserved them (all turn the tier off together, none left waiting)."""
        ctx, pair = self.ctx, self.pair
        needed, free = pair.room_for(state)
        each = needed / 2 / ctx.world.local_world_size / 2**20  # MB, one buffer
        problem = None
        if needed > free:
            problem = (f"they need 2 x {each:.1f} MB per rank in {pair.shm}, and it has "
                       f"{free / 2**20:.0f} MB free; make it larger (docker: --shm-size), "
                       "set checkpoint.memory_dir to a larger tmpfs, or set "
                       "checkpoint.memory_every_steps=0")
        else:
            try:
                pair.reserve(state)
            except (NoRoom, Unsafe) as exc:
                problem = str(exc)
        if (problem := distributed.first_problem(problem)) is not None:
            return problem
        if ctx.options.get("verbose"):
            auto = " to start with (auto)" if self.auto else ""
            ctx.print(f"in-memory snapshots: every {pair.every_steps} step(s){auto}, 2 x "
                      f"{each:.1f} MB per rank in {pair.folder}")
        return None

    def failed_rank(self) -> tuple[int, str]:
        """The first rank whose buffer failed, and why (collective)."""
        return distributed.first_problem(self.pair.failed)

    def switch_off(self) -> list[str]:
        """No more snapshots: summary.json's interval 0, the buffers removed (warnings)."""
        self.record(every=0)
        self.close()
        return self.pair.remove()

    # ------------------------------------------------------------ check points

    def window_started(self) -> None:
        self.cost.window_started()

    def measure(self, window_s: float, window_steps: int) -> int | None:
        """At a check point: MemoryCost.check (auto may pause the tier for a window: a
        crash in it loses a window and a step at most); the interval it proposes."""
        self.every_steps, every = self.cost.check(self.every_steps, window_s, window_steps,
                                                  self.pair.saves)
        self.record()
        return every

    def take_interval(self, every: int | None) -> None:
        """auto: the interval the ranks agreed on, from now or from a pause's end."""
        if every is None or every == self.cost.interval:
            return
        self.cost.taken(every)
        if self.every_steps != PAUSED:
            self.every_steps = every
        self.record()
        if self.ctx.options.get("verbose"):
            percent = self.cost.percent(every)
            said = (f"budget {100 * MEMORY_BUDGET:g}% of the step time" if percent is None
                    else f"here they cost {percent:.2f}% of the step time at it, budget "
                    f"{100 * MEMORY_BUDGET:g}%")
            self.ctx.print(f"in-memory snapshots: every {every} step(s) from step "
                           f"{self.ctx.state.step} (auto, the longest any rank's costs "
                           f"asked for; {said})")

    def record(self, every: int | None = None) -> None:
        """summary.json's ``memory_snapshots`` (MemoryCost.record)."""
        every = self.every_steps if every is None else every
        self.ctx.record_memory(self.cost.record(
            self.cost.interval if every == PAUSED else every, self.auto))

    # ------------------------------------------------------------ resume, end

    @property
    def reached_before(self) -> int:  # how far the interrupted run had got
        return self.pair.reached_before

    def resume(self, disk_step: int | None, restore) -> bool:
        """Collective: resume (``restore(ctx, snap, source)``) from the newest memory
        snapshot every rank can have when it is newer than the disk snapshot of
        ``disk_step``; False where none is (one that fails to load: a warning)."""
        ctx, pair = self.ctx, self.pair
        mine = agreeing.load_all(pair, ctx.warn_here)
        copies = ring_mod.load_held(pair, ctx.warn_here)  # fsdp: its predecessor's
        try:
            choice = agreeing.agree(pair, mine, copies)
            pair.reached_before = choice.reached
            if not choice.newer_than(disk_step):
                notice = choice.not_used(disk_step)  # fsdp: a rank's shards lost, resized
                if notice:
                    ctx.print(notice)
                return False
            source = f"memory (step {choice.step})"
            snap = (ring_mod.fetch(pair, choice, mine, copies) if choice.peers
                    else agreeing.fetch(pair, choice, mine))
            restore(ctx, snap, source=source)
        finally:
            for loaded in mine + copies:
                loaded.close()
        missing = choice.missing(ctx.world.world_size)
        # fsdp: each missing rank's successor sent its copy; else the source, keepers rows
        senders = sorted(set(choice.peers.values()) or {choice.source, *choice.keepers.values()})
        why = (f"rank(s) {', '.join(map(str, missing))} had no copy: sent by rank "
               f"{', '.join(map(str, senders))}" if missing else
               f"restart {ctx.world.restart_count}" if ctx.world.restart_count else "rerun")
        lost = max(0, choice.reached - choice.step)
        ctx.print(f"resumed from memory at step {choice.step} ({why}; {lost} step"
                  f"{'' if lost == 1 else 's'} lost): {ctx.state.position()}")
        ctx.record_resume(source, "peer" if missing else "memory", choice.step,
                          choice.reached, source_rank=choice.source if missing else None)
        return True

    def close(self, wait: bool = True) -> None:
        """The thread, the mappings and the optimizer's hook go, the files stay."""
        if self.reached is not None:
            self.reached.remove()
        self.pair.close(wait=wait)

    def remove(self) -> list[str]:
        """The buffers removed; a warning for each that could not be."""
        return self.pair.remove()


def capture(ctx, config, whole, line) -> tuple[dict, bytes, object]:
    """A memory snapshot's dict without a collective, ``whole(ctx, config, parts)`` of
    every part's local state; this rank's row (rows.py), which ``rng`` holds as ``line``
    (Exchanges.line's), and the loss sum (a tensor) Exchanges.start writes into it."""
    states = ctx.snapshot_parts.local_state_dict()
    loss = (states.get("progress") or {}).get("epoch_loss")
    if loss is not None:  # its sum is the row's (a resume sums the ranks' rows)
        states["progress"] = {**states["progress"], "epoch_loss": {**loss, "sum": 0.0}}
    if "rng" in states:
        states["rng"] = {**states["rng"], "row": line}
    return (whole(ctx, config, states), make_row(loss and (0.0, loss["batches"])),
            loss and loss["sum"])


def remove_leftovers(run_dir, run_id: str, shm: pathlib.Path = SHM,
                     forget: str | None = None) -> tuple[list[pathlib.Path], list[str]]:
    """At a run's start (local rank 0): remove the buffers left behind, and only those:
    of this host and mount namespace, their writer gone, of this run folder under another
    id or of a folder gone, all of the id ``forget``. What went, and warnings."""
    host, here = socket.gethostname(), os.path.realpath(os.fspath(run_dir))
    mnt = mount_namespace()

    def left_behind(name: str, path: pathlib.Path) -> bool:
        match = BUFFER_NAME.fullmatch(name)
        if not match or (match["run_id"] == run_id and run_id != forget):
            return False
        if match["run_id"] != forget:
            info = read_info(path)
            theirs = info.get("run_dir")
            if (info.get("host"), info.get("mnt")) != (host, mnt) or \
                    not isinstance(theirs, str):
                return False
            if theirs != here and os.path.isdir(theirs):
                return False
        return writer_gone(path)

    return sweep(folder_of(run_dir, shm), left_behind)
