"""Agreeing at a resume: each rank loads its whole snapshots, the ranks agree (:func:`agree`)
on the newest one every rank can restore (its own, or a holder's with its row from a
keeper, rows.py; fsdp: its successor's copy, ring.py), and :func:`complete` makes it
whole again (this rank's RNG states, the epoch's loss sums over the ranks)."""

from __future__ import annotations

import functools

import attrs
import torch
import torch.distributed as dist

from engine import distributed
from engine.shards import holds_shards
from engine.memory.buffer import Slot, check_slot, load_slot, read_payload
from engine.memory.rows import ROW_BYTES, owners, read_row, row_in


@attrs.define
class Loaded:
    """One of this rank's usable memory snapshots: its checked buffer and its content."""

    slot: Slot
    state: dict

    @property
    def step(self) -> int:
        return self.slot.step

    def close(self) -> None:
        self.slot.close()


def load_all(memory, warn) -> list[Loaded]:
    """This rank's memory snapshots of this run that load whole, newest first (a peer may
    need the older one); one that does not is one ``warn``ing, never a traceback."""
    slots, problems = [], []
    for path in memory.paths:
        slot, problem = check_slot(path, run_id=memory.run_id)
        if problem is not None:
            problems.append(problem)
        elif slot is not None:
            slots.append(slot)
    if problems:  # one line per rank
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        warn(f"the memory snapshot {problems[0]}{more}; not used")
    slots.sort(key=lambda s: -s.sequence)
    if slots:  # the next save writes above the highest sequence, whatever loads
        memory.sequence = slots[0].sequence
    loaded = []
    for slot in slots:
        one, problem = load_checked(slot)
        if one is not None:
            loaded.append(one)
        else:
            warn(f"the memory snapshot {slot.path} does not load ({problem}); not used")
    if loaded:
        memory.newest_index = memory.paths.index(loaded[0].slot.path)
    return loaded


def load_checked(slot: Slot, also=None) -> tuple[Loaded | None, str | None]:
    """``slot`` (its checks passed) decoded into a snapshot, or None and why not (then
    closed): a skeleton with anything but plain values, a tensor outside the payload,
    no config, another step than its header's, or what ``also(state)`` says (a text)."""
    try:
        state = load_slot(slot)
        problem = _not_a_snapshot(state, slot.step) or (also(state) if also else None)
    except Exception as exc:  # whatever a damaged or forged payload raises
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return Loaded(slot, state), None
    slot.close()
    return None, problem


def _not_a_snapshot(state, step: int) -> str | None:
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a snapshot"
    if not isinstance(state.get("config"), dict):
        return "it holds no config to check against this run's"
    if state.get("step") != step:
        return f"its header says step {step}, its content step {state.get('step')!r}"
    return None


@attrs.define
class MemoryChoice:
    """The newest step every rank can restore (-1: none), the ranks that hold it, the
    rank that sends it to the others, and the step the interrupted run reached;
    ``keepers``: {a rank without it: the rank that sends its row}."""

    step: int
    holders: list[int]
    reached: int
    source: int = 0
    #: The newest step of a snapshot passed over (:func:`agree`), and why.
    unusable: tuple[int, str] | None = None
    #: Under fsdp: {a rank without its own snapshot of the step: its successor, which
    #: holds a copy and sends it} (engine/memory/ring.py).
    peers: dict = attrs.field(factory=dict)
    keepers: dict = attrs.field(factory=dict)

    def newer_than(self, disk_step: int | None) -> bool:
        return self.step >= 0 and (disk_step is None or self.step > disk_step)

    def not_used(self, disk_step: int | None) -> str | None:
        """The line that says why a memory snapshot newer than the chosen one and than
        ``disk_step`` (the disk snapshot's) was passed over (``unusable``), or None."""
        if self.unusable is None:
            return None
        step, why = self.unusable
        if step <= max(self.step, -1 if disk_step is None else disk_step):
            return None
        return f"the memory snapshot of step {step} is not used: {why}"

    def missing(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.holders]


def agree(memory, mine: list[Loaded], copies=()) -> MemoryChoice:
    """Collective, the same answer on every rank: the newest step every rank holds, or
    a holder can send with each missing rank's row (:func:`choose`); fsdp shards only at
    their number of processes, a rank's own or its successor's copy (``copies``:
    ring.load_held's), where the model is alike. The newest passed over: ``unusable``."""
    world_size = memory.world.world_size
    held, unusable = [], []
    for m in mine:
        saved_world = m.state.get("world_size")
        shards = holds_shards(m.state.get("model"))
        if shards != memory.sharded:  # --parallel changed from or to fsdp: from disk
            unusable.append((m.step, "it holds " + ("fsdp shards" if shards else
                                                    "whole tensors") + ", this run's model "
                             "is " + ("sharded (fsdp)" if memory.sharded else "whole")))
        elif not shards:
            held.append((m.step, None if saved_world != world_size else owners(m.slot.rows)))
        elif saved_world != world_size:  # another split: the disk's dcp snapshots reshard
            unusable.append((m.step, f"it holds the shards of {saved_world} processes "
                                     f"(fsdp), this run has {world_size}"))
        else:  # fsdp: this rank's own shards (its successor has a copy: copies)
            held.append((m.step, ()))
    copied = [m.step for m in copies]
    reached = _reached_where_alike(memory, [s for s, _ in held], copied, unusable)
    every = ([(held, reached, [], copied)] * world_size if reached is not None else
             distributed.all_gather_object((held, memory.reached(), unusable, copied)))
    held = [h for h, _, _, _ in every]
    reached = max(r for _, r, _, _ in every)
    found = [u for _, _, theirs, _ in every for u in theirs]
    if memory.sharded:  # each rank's own shards, or its successor's copy of them
        own, ring = [[s for s, _ in h] for h in held], [c for *_, c in every]
        choice = choose_sharded(own, ring, reached)
        lacking = functools.partial(lacking_sharded, own, ring)
        why = ("under fsdp a rank's shards are only in its own memory and its "
               "successor's: no other peer can send them")
    else:
        choice = choose(held, reached)
        why = ("no rank that holds it kept their RNG states and loss sums (never restored "
               "from another rank's)")

        def lacking(step: int) -> list[int]:  # where its rows came (else: a kill before)
            came = any(kept for h in held for s, kept in h if s == step)
            return [m for m, k in row_keepers(held, step).items() if k is None and came]
    found += [(step, f"rank(s) {', '.join(map(str, ranks))} had no copy, and {why}")
              for step in {s for h in held for s, _ in h} if (ranks := lacking(step))]
    newest = max(found, default=None)  # the same on every rank
    if newest is not None and newest[0] > choice.step:
        choice.unusable = newest
    return choice


def _reached_where_alike(memory, own: list[int], copies: list[int], unusable: list):
    """Collective, one all-reduce (max) of a few numbers (a rank holds at most 2 snapshots
    and 2 copies): the step the run reached where every rank holds the same steps and none
    unusable (a restart in place: every rank's answer is this rank's), else None."""
    mine = [len(unusable), *(v for steps in (own, copies) for v in (
        len(steps), *sorted(steps), *[-2] * (len(memory.paths) - len(steps))))]
    values = torch.tensor([*mine, *(-v for v in mine), memory.reached()],
                          dtype=torch.int64, device=distributed.collective_device())
    if distributed.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    highest, lowest = values[:len(mine)], -values[len(mine):-1]
    return int(values[-1]) if highest[0] == 0 and bool((highest == lowest).all()) else None


def choose(held: list[list[tuple[int, tuple | None]]], reached: int) -> MemoryChoice:
    """:func:`agree`'s answer from ``held[rank]``: (step, the ranks whose rows it keeps
    with it; None: none needed, another number of processes) for each of its snapshots:
    the newest step every rank holds, or a holder sends with each one's row kept."""
    for step in sorted({s for h in held for s, _ in h}, reverse=True):
        keepers = row_keepers(held, step)
        if None not in keepers.values():
            holders = [r for r, h in enumerate(held) if any(s == step for s, _ in h)]
            return MemoryChoice(step, holders, reached, source=holders[0], keepers=keepers)
    return MemoryChoice(-1, [], reached)


def row_keepers(held: list[list[tuple[int, tuple | None]]], step: int) -> dict:
    """{each rank without ``step``: the first rank holding it that keeps its row (None:
    none does)}; {} where no row is needed (another number of processes)."""
    having = [(r, kept) for r, h in enumerate(held) for s, kept in h if s == step]
    if any(kept is None for _, kept in having):
        return {}
    keeper = {m: r for r, kept in reversed(having) for m in kept}  # the first holder's
    holders = {r for r, _ in having}
    return {m: keeper.get(m) for m in range(len(held)) if m not in holders}


def choose_sharded(own: list[list[int]], copies: list[list[int]],
                   reached: int) -> MemoryChoice:
    """:func:`agree`'s answer under fsdp (``own[r]``, ``copies[r]``: the steps of rank
    r's own snapshots and of its copies of its predecessor's): the newest step every
    rank restores from its own or its successor's copy; ``peers``: {rank: successor}."""
    world_size = len(own)
    for step in sorted({s for steps in own + copies for s in steps}, reverse=True):
        if lacking_sharded(own, copies, step):
            continue
        holders = [r for r in range(world_size) if step in own[r]]
        peers = {r: (r + 1) % world_size for r in range(world_size) if r not in holders}
        return MemoryChoice(step, holders, reached,
                            source=next(iter(peers.values()), 0), peers=peers)
    return MemoryChoice(-1, [], reached)


def lacking_sharded(own: list[list[int]], copies: list[list[int]], step: int) -> list[int]:
    """The ranks that can restore ``step`` neither from their own snapshot nor from
    their successor's copy (:func:`choose_sharded`)."""
    world_size = len(own)
    return [r for r in range(world_size)
            if step not in own[r] and step not in copies[(r + 1) % world_size]]


def fetch(memory, choice: MemoryChoice, mine: list[Loaded]) -> dict:
    """Collective: the chosen snapshot on every rank (:func:`complete`): its own, or
    broadcast by ``choice.source``, its row sent by its keeper (fsdp: ring.py's fetch)."""
    rank, world_size = memory.world.rank, memory.world.world_size
    own = next((m for m in mine if m.step == choice.step), None)
    if own is not None:
        memory.newest_index = memory.paths.index(own.slot.path)
    if choice.missing(world_size):
        length = distributed.broadcast_object(
            own.slot.length if rank == choice.source else None, src=choice.source)
        device = distributed.collective_device()
        payload = (own.slot.payload().to(device, copy=True) if rank == choice.source
                   else torch.empty(length, dtype=torch.uint8, device=device))
        distributed.broadcast_tensor(payload, src=choice.source)
        row = _rows_from_keepers(choice, rank, own, device)
    if own is not None:
        return complete(own.state, rank, world_size, None)
    return complete(read_payload(payload.cpu()), rank, world_size, row)


def _rows_from_keepers(choice: MemoryChoice, rank: int, own: Loaded | None, device):
    """Each missing rank's row from its keeper, point to point: this rank's, or None."""
    ops, received = [], None
    for missing, keeper in choice.keepers.items():
        if keeper == rank:
            line = next(line for line in own.slot.rows if row_in([line], missing))
            ops.append(dist.P2POp(dist.isend, torch.from_numpy(line.copy()).to(device),
                                  missing))
        elif missing == rank:
            received = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, received, keeper))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return None if received is None else row_in([received.cpu().numpy()], rank)


def complete(state: dict, rank: int, world_size: int, row: bytes | None) -> dict:
    """A memory snapshot as a resume restores it: its ``rng`` as the disk snapshot's,
    this rank's from its own row (or ``row``, its keeper's), the epoch's loss sums over
    every rank (a collective, mid-epoch)."""
    part = state.get("rng") or {}
    if "row" not in part:  # a whole state (a test's, or an older form): as it is
        return state
    saved_world = part["world_size"]
    mine = read_row(part["row"] if row is None else row)
    ranks = [None] * saved_world
    if mine is not None and rank < saved_world:
        ranks[rank] = mine["rng"]
    state = {**state, "rng": {"ranks": ranks, "world_size": saved_world}}
    progress = state.get("progress")
    loss = (progress or {}).get("epoch_loss")
    if loss is not None and saved_world != world_size:
        # Other ranks kept the sums: the epoch's mean covers the batches after the resume.
        state["progress"] = {**progress, "epoch_loss": None}
    elif loss is not None:  # every rank is mid-epoch alike (the same step)
        # The same values the disk snapshot's capture sums: the same sums, to the bit.
        totals = torch.tensor(mine["loss"], dtype=torch.float64,
                              device=distributed.collective_device())
        total, batches = distributed.all_reduce_sum(totals).tolist()
        state["progress"] = {**progress, "epoch_loss": {
            "sum": total, "batches": batches, "micro_batch": loss["micro_batch"]}}
    return state
