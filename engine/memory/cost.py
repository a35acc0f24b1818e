"""What the memory snapshots cost (:class:`MemoryCost`), and the interval ``auto`` takes:
each rank proposes one at a check point (:meth:`MemoryCost.check`), all take the largest."""

from __future__ import annotations

import statistics

from engine import phases

#: ``checkpoint.memory_every_steps=auto``: the share of the training step's time the
#: memory snapshots may take; the interval is the smallest that keeps their cost within it.
MEMORY_BUDGET = 0.02
#: auto's intervals: powers of two, so that a crash while the interval changes still
#: loses at most the larger of the two (engine.snapshot's Snapshots.agreed); at most 128.
MEMORY_INTERVALS = tuple(2**i for i in range(8))
#: The tier's interval while auto pauses it for a window (never due).
PAUSED = 1 << 62
AUDIT_AFTER = 4  #: auto's audits: after this many windows at an interval, one paused


class MemoryCost:
    """What this rank's memory snapshots cost against its steps, by the clocks the run
    keeps anyway (engine/phases.py's carved times, each window's wall time and steps,
    the background thread's CPU time where the training's threads fill the CPUs), from
    the check point after the first snapshot (which reserves the buffers). What no
    clock sees (caches, page faults, the memory bus) auto measures by
    paired windows, on every rank alike: windows at the interval, then one paused. The
    first pair (the probe, at a snapshot every step) adds their difference beyond the
    clocks to every snapshot's cost; each later one (an audit) measures the snapshots'
    share of the step at their interval (:meth:`_audit`)."""

    def __init__(self, auto: bool = False, background=None):
        self.auto = auto
        #: The background thread's CPU seconds so far (a callable), where they are the
        #: step's (:func:`crowded`); None: on CPUs of their own, they cost the step nothing.
        self.background = background
        self.snapshot_s = self.step_s = 0.0
        self.snapshots = self.steps = 0
        self.last = self.clocks()  # at the last check point, or the window's start
        self.counting = False  # the last check came after the tier's first snapshot
        #: The last window's seconds per step, memory snapshots in, disk ones out.
        self.window_step_s: float | None = None  # None: a window without steps
        #: Per snapshot, what it costs beyond its clocks (probed); None until measured.
        self.hidden_s: float | None = None
        #: The last audit's share of the step, and its standard error.
        self.measured: float | None = None
        self.error: float | None = None
        self.over = 0  # the longest interval ruled out by the audits
        self.taken(1)

    def taken(self, every: int) -> None:
        """The ranks agreed on ``every`` (the tier's but while paused): its windows
        count from the next (this one is part at the old one)."""
        self.interval, self.skip, self.with_s = every, True, []

    def clocks(self) -> tuple[float, int, float]:
        """Memory snapshots' seconds (with the waits for their copies and, where it takes
        the step's CPUs, the background thread's work) and count, and disk snapshots'
        seconds, so far in this process."""
        memory_s, _, memory_n = phases.carved(phases.MEMORY_SNAPSHOTS)
        memory_s += phases.carved(phases.MEMORY_WAITS)[0]
        if self.background is not None:
            memory_s += self.background()
        return memory_s, memory_n, phases.carved(phases.SNAPSHOTS)[0]

    def window_started(self) -> None:
        """An epoch's first window starts: what came since the last check point (the
        epoch's end) is in no window."""
        self.last = self.clocks()

    def check(self, every: int, window_s: float, window_steps: int,
              saves: int) -> tuple[int, int | None]:
        """At a check point (:meth:`measure`'s arguments): the tier's interval from now
        (PAUSED: none) and, under auto, the one this rank's costs allow (None: none)."""
        self.measure(window_s, window_steps, saves)
        if self.auto and self.window_step_s is not None:  # else nothing moves
            every = self._paired(every, self.window_step_s)
        wanted = None if every == PAUSED or not self.auto else self.every_steps(every)
        return every, None if wanted is None else max(wanted, shortest(self.over + 1))

    def _paired(self, every: int, step_s: float) -> int:
        """A window ended: paused (an audit's verdict), or at the interval (paused next
        after one window at the probe, AUDIT_AFTER at an audit)."""
        if every == PAUSED:
            if self.with_s:  # else the ranks took another interval during the pause
                self._audit(self.with_s, step_s)
            self.with_s = []
            return self.interval
        if not self.skip:
            self.with_s.append(step_s)
        self.skip = False
        enough = len(self.with_s) >= (1 if self.hidden_s is None else AUDIT_AFTER)
        return PAUSED if enough else every

    def _audit(self, windows: list[float], without_s: float) -> None:
        """A step's seconds in each window at the interval, with its snapshots, and in the
        paused one. Their share clearly over the budget (by more than its standard error,
        from the windows' spread) rules that interval and all shorter ones out; clearly
        under a quarter of it just above those, the longest of them is let in again. Noise
        as large as the budget (2 processes on 2 cores: +-3% a window) decides nothing."""
        with_s = statistics.fmean(windows)
        if self.hidden_s is None:  # the probe: what no clock saw counts from now on
            clocked = self.snapshot_s / self.snapshots if self.snapshots else 0.0
            self.hidden_s = max(0.0, with_s - without_s - clocked)
        self.measured = with_s / without_s - 1
        # A mean of k windows less one window: sigma * sqrt(1/k + 1), sigma from their
        # spread (none in the probe's one window).
        self.error = (None if len(windows) < 2 else
                      statistics.stdev(windows) * (1 / len(windows) + 1) ** 0.5 / without_s)
        error = self.error or 0.0
        if self.measured - error > MEMORY_BUDGET:
            self.over = max(self.over, self.interval)
        elif (self.measured + error < MEMORY_BUDGET / 4
              and self.interval == 2 * self.over):
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

    def per_step(self) -> float | None:
        """One step's time without the snapshots (less what the probe found, <= half)."""
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
                                            else 100 * self.measured, 3),
                "measured_error_percent": rounded(None if self.error is None
                                                  else 100 * self.error, 3)}


def crowded(device, threads: int, cpus: int) -> bool:
    """Whether the background thread's work takes the step's CPUs: training on the CPU
    with this process's ``threads`` filling its share of them (``cpus``). Else (a GPU's
    step, a CPU to spare) it runs beside the step."""
    return device.type == "cpu" and threads >= cpus


def shortest(needed: float) -> int:
    """The shortest of MEMORY_INTERVALS of at least ``needed`` steps, or the longest."""
    return next((n for n in MEMORY_INTERVALS if n >= needed), MEMORY_INTERVALS[-1])


def proposal(every_steps: int | None) -> list[float]:
    """A rank's interval for the check point's all-reduce (a sum): 1 at its place."""
    return [float(n == every_steps) for n in MEMORY_INTERVALS]


def agreed_interval(sums) -> int | None:
    """The largest interval any rank proposed (:func:`proposal`'s sums), or None."""
    return max((n for n, total in zip(MEMORY_INTERVALS, sums) if total > 0), default=None)
