"""What the memory snapshots cost (:class:`MemoryCost`), and the interval
``checkpoint.memory_every_steps=auto`` takes: each rank proposes one at a check point
(:meth:`MemoryCost.check`, :func:`proposal`), all take the largest (:func:`agreed_interval`)."""

from __future__ import annotations

from engine import phases

#: ``checkpoint.memory_every_steps=auto``: the share of the training step's time the
#: memory snapshots may take; the interval is the smallest that keeps their cost within it.
MEMORY_BUDGET = 0.02
#: auto's intervals: powers of two, so that a crash while the interval changes still
#: loses at most the larger of the two (engine.snapshot's Snapshots.agreed); at most 128.
MEMORY_INTERVALS = tuple(2**i for i in range(8))
#: The tier's interval while auto pauses it for a window (never due).
PAUSED = 1 << 62
#: auto's audits: after this many windows at one interval, one window paused.
AUDIT_AFTER = 4


class MemoryCost:
    """What this rank's memory snapshots cost against its steps, by the clocks the run
    keeps anyway (engine/phases.py's carved times, each window's wall time and steps),
    from the check point after the first snapshot (which reserves the buffers). A
    window's step time is its wall time less its snapshots (memory and disk).

    What no clock sees (a background copy taking the step's CPUs, caches, page faults)
    auto measures by paired windows, the same on every rank: windows at the interval in
    force, then one paused (no snapshot). The first pair (the probe: one window at a
    snapshot every step, after the first snapshot's) adds its difference, beyond the
    clocks, to every snapshot's cost; each later pair (an audit, after AUDIT_AFTER
    windows) measures the snapshots' share of the step at their interval, and where it
    is over the budget no interval up to that one is proposed again."""

    def __init__(self, auto: bool = False):
        self.auto = auto
        self.snapshot_s = self.step_s = 0.0
        self.snapshots = self.steps = 0
        self.last = self.clocks()  # at the last check point, or the window's start
        self.counting = False  # the last check came after the tier's first snapshot
        #: The last window's seconds per step, its memory snapshots included (its disk
        #: snapshots not), or None after a window without steps.
        self.window_step_s: float | None = None
        #: Per snapshot, what it costs beyond its clocks (probed); None until measured.
        self.hidden_s: float | None = None
        #: The last audit's share of the step time the snapshots took (None: none yet).
        self.measured: float | None = None
        self.over = 0  # the longest interval an audit found over the budget
        self.taken(1)

    def taken(self, every: int) -> None:
        """The ranks agreed on interval ``every`` (the tier's but while paused): its
        paired windows start afresh, after the window in progress (part at the old one)."""
        self.interval = every
        self.windows = -1  # windows at the interval, -1: skip the next
        self.paired = [0.0, 0, 0.0, 0]  # seconds and steps: with snapshots, paused

    @staticmethod
    def clocks() -> tuple[float, int, float]:
        """Memory snapshots' seconds (with the waits for their copies) and count, and
        disk snapshots' seconds, so far in this process."""
        memory_s, _, memory_n = phases.carved(phases.MEMORY_SNAPSHOTS)
        memory_s += phases.carved(phases.MEMORY_WAITS)[0]
        return memory_s, memory_n, phases.carved(phases.SNAPSHOTS)[0]

    def window_started(self) -> None:
        """An epoch's first window starts: what came since the last check point (the
        epoch's end) is in no window."""
        self.last = self.clocks()

    def check(self, every: int, window_s: float, window_steps: int,
              saves: int) -> tuple[int, int | None]:
        """At a check point (:meth:`measure`'s arguments): the tier's interval from now
        (PAUSED: none in the next window) and, under auto, the interval this rank's costs
        allow (None: none yet, or paused)."""
        self.measure(window_s, window_steps, saves)
        if not self.auto:
            return every, None
        if self.window_step_s is not None:  # a window without steps: nothing moves
            every = self._paired(every, self.window_step_s * window_steps, window_steps)
        wanted = None if every == PAUSED else self.every_steps(every)
        return every, None if wanted is None else max(wanted, shortest(self.over + 1))

    def _paired(self, every: int, seconds: float, steps: int) -> int:
        """A window ended: counted with or without snapshots, the next paused after
        enough, an audit's verdict at a pause's end."""
        paired = self.paired
        if every == PAUSED:
            if paired[1]:  # else the ranks took another interval during the pause
                paired[2] += seconds
                paired[3] += steps
                self._audit(paired[0] / paired[1], paired[2] / paired[3])
            self.paired = [0.0, 0, 0.0, 0]  # each audit's pair its own: load drifts
            return self.interval
        if self.windows >= 0:
            paired[0] += seconds
            paired[1] += steps
        self.windows += 1
        # The probe pauses after one window (of every step), audits after more.
        if self.windows >= (AUDIT_AFTER if self.hidden_s is not None else 1):
            self.windows = 0
            return PAUSED
        return every

    def _audit(self, with_s: float, without_s: float) -> None:
        """A step's seconds at the interval, with its snapshots and paused: a share over
        the budget rules the interval and all shorter ones out; under a quarter of it,
        just above the ones ruled out, lets the longest of those in again."""
        if self.hidden_s is None:
            self.probed(with_s, without_s)
        self.measured = with_s / without_s - 1
        if self.measured > MEMORY_BUDGET:
            self.over = max(self.over, self.interval)
        elif self.measured < MEMORY_BUDGET / 4 and self.interval == 2 * self.over:
            self.over //= 2

    def measure(self, window_s: float, window_steps: int, saves: int) -> None:
        """At a check point: its window's seconds and steps, this rank's saves so far."""
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
        """The probe's seconds per step, with a snapshot at every step and without:
        their difference beyond the clocks counts from now on."""
        clocked = self.snapshot_s / self.snapshots if self.snapshots else 0.0
        self.hidden_s = max(0.0, with_snapshots_s - without_s - clocked)

    def per_step(self) -> float | None:
        """One step's time without the snapshots (less what the probe found: at most
        half)."""
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
        """The shortest interval whose snapshots cost at most MEMORY_BUDGET of the step
        (None until probed); shorter than ``current`` only within 80% of it (no flapping)."""
        percent = self.percent(1)
        if self.hidden_s is None or percent is None:
            return None
        needed = percent / (100 * MEMORY_BUDGET)  # steps per snapshot within the budget
        every = shortest(needed)
        return every if every >= current else min(current, shortest(needed / 0.8))

    def percent(self, every_steps: int) -> float | None:
        """The snapshots' cost at one every ``every_steps`` steps, in % of the step."""
        snapshot, step = self.per_snapshot(), self.per_step()
        if snapshot is None or step is None:
            return None
        return 100 * snapshot / (every_steps * step)

    def record(self, every_steps: int, auto: bool) -> dict:
        """summary.json's ``memory_snapshots``: the interval, auto, the costs."""
        def rounded(value, digits=6):
            return None if value is None else round(value, digits)

        return {"every_steps": every_steps, "auto": auto,
                "snapshot_s": rounded(self.per_snapshot()), "step_s": rounded(self.per_step()),
                "cost_percent": rounded(self.percent(every_steps) if every_steps else None, 3),
                "measured_percent": rounded(None if self.measured is None
                                            else 100 * self.measured, 3)}


def shortest(needed: float) -> int:
    """The shortest of MEMORY_INTERVALS of at least ``needed`` steps, or the longest."""
    return next((n for n in MEMORY_INTERVALS if n >= needed), MEMORY_INTERVALS[-1])


def proposal(every_steps: int | None) -> list[float]:
    """A rank's proposed interval for the check point's all-reduce (a sum): a 1 at its
    place in MEMORY_INTERVALS (all 0: none)."""
    return [float(n == every_steps) for n in MEMORY_INTERVALS]


def agreed_interval(sums) -> int | None:
    """The largest interval any rank proposed (:func:`proposal`'s sums), or None."""
    return max((n for n, total in zip(MEMORY_INTERVALS, sums) if total > 0), default=None)
