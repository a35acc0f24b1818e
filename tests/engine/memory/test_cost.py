"""engine/memory/cost.py: what the memory snapshots cost, and the interval auto takes
from it (the probe and the ranks' agreement: tests/engine/test_snapshot.py)."""

from __future__ import annotations

import pytest


def costs(cost, snapshot_s: float, step_s: float, snapshots: int = 10, steps: int = 10):
    """What a tier's memory snapshots cost so far, as MemoryCost.measure totals them."""
    cost.snapshot_s, cost.snapshots = snapshot_s * snapshots, snapshots
    cost.step_s, cost.steps = step_s * steps, steps
    if cost.hidden_s is None:  # as if the probe found nothing the clocks did not see
        cost.hidden_s = 0.0


def test_auto_takes_the_shortest_interval_within_2_percent_of_the_step(tmp_path):
    """The interval auto proposes: the shortest power of two whose snapshots cost at most
    2% of the step (1 where a snapshot is nearly free, at most 128 however dear), shorter
    than the one in force only with a margin (a cost near a boundary must not flip it at
    every check point), none before anything was measured."""
    from engine.memory.cost import MEMORY_BUDGET, MemoryCost

    assert MEMORY_BUDGET == 0.02
    cost = MemoryCost()
    assert cost.every_steps(1) is None and cost.record(1, True)["cost_percent"] is None
    for snapshot_s, step_s, current, every in [
            (0.0001, 0.1, 1, 1),     # 0.1% of a step: every step
            (0.002, 0.1, 1, 1),      # exactly 2%
            (0.0021, 0.1, 1, 2),
            (0.023, 0.1, 1, 16),     # 23% (CIFAR at 2 processes here): 11.5 -> 16
            (1.0, 0.1, 1, 128),      # ten steps' worth: the cap
            (0.003, 0.1, 4, 2),      # 1.5: 2 is within 80% of the budget: shorter
            (0.0039, 0.1, 4, 4),     # 1.95: 2 would be within budget, but near it
            (0.0075, 0.1, 8, 8),     # 3.75: so would 4
            (0.0060, 0.1, 8, 4)]:    # 3.0
        costs(cost, snapshot_s, step_s)
        assert cost.every_steps(current) == every, (snapshot_s, step_s, current)
        assert cost.percent(every) <= 100 * MEMORY_BUDGET or every == 128
    costs(cost, 0.024, 0.1)
    assert cost.record(16, True) == {"every_steps": 16, "auto": True, "snapshot_s": 0.024,
                                     "step_s": 0.1, "cost_percent": 1.5,
                                     "measured_percent": None,
                                     "measured_error_percent": None}


def test_the_costs_are_the_carved_snapshot_times_from_the_window_after_the_first(tmp_path):
    """MemoryCost.measure: the memory snapshots' time is the phase clock's (carve), with
    the optimizer's waits for their background copies (a copy of several steps' length
    would otherwise look free), the step time the window's less the snapshots in it
    (memory and disk); the window with
    the tier's first snapshot (which also reserves the buffers) is not counted."""
    from engine import phases
    from engine.memory.cost import MemoryCost

    cost = MemoryCost()

    def snapshot(kind):
        with phases.carve(kind, within="training"):
            sum(range(20000))  # a cost, whatever it is: the clock's reading is compared

    snapshot(phases.MEMORY_SNAPSHOTS)  # the first
    cost.measure(window_s=5.0, window_steps=4, saves=1)
    assert (cost.snapshots, cost.steps) == (0, 0)  # its window is not counted
    before = (phases.carved(phases.MEMORY_SNAPSHOTS)[0], phases.carved(phases.SNAPSHOTS)[0],
              phases.carved(phases.MEMORY_WAITS)[0])
    snapshot(phases.MEMORY_SNAPSHOTS)
    snapshot(phases.MEMORY_SNAPSHOTS)
    snapshot(phases.MEMORY_WAITS)  # an optimizer step waited for a background copy
    snapshot(phases.SNAPSHOTS)
    cost.measure(window_s=5.0, window_steps=4, saves=3)
    memory_s = (phases.carved(phases.MEMORY_SNAPSHOTS)[0] - before[0]
                + phases.carved(phases.MEMORY_WAITS)[0] - before[2])
    disk_s = phases.carved(phases.SNAPSHOTS)[0] - before[1]
    assert (cost.snapshots, cost.steps) == (2, 4)
    assert cost.snapshot_s == pytest.approx(memory_s)
    assert cost.step_s == pytest.approx(5.0 - memory_s - disk_s)
    snapshot(phases.MEMORY_SNAPSHOTS)  # the epoch's end: in no window
    cost.window_started()
    cost.measure(window_s=1.0, window_steps=2, saves=4)
    assert (cost.snapshots, cost.steps) == (2, 6)
    assert cost.step_s == pytest.approx(6.0 - memory_s - disk_s)


def test_the_check_points_flags_hold_one_per_interval():
    """engine/snapshot.py's Snapshots.FLAGS counts the intervals without importing the
    tier (it is imported only when on): the count must be cost.py's."""
    from engine.memory.cost import MEMORY_INTERVALS, proposal
    from engine.snapshot import Snapshots

    assert Snapshots.FLAGS == 2 + len(MEMORY_INTERVALS) == 2 + len(proposal(None))


def test_an_interval_agreed_during_an_audits_pause_is_taken_at_its_end_unaudited():
    """The ranks' agreement of a check point arrives at the next one, after its own
    flags: it may fall in a window auto paused. The new interval starts at the pause's
    end, and the pause audits nothing: its windows with snapshots were at the old one."""
    from engine.memory.cost import AUDIT_AFTER, PAUSED, MemoryCost

    cost = MemoryCost(auto=True)
    costs(cost, snapshot_s=0.001, step_s=0.1)  # probed: 1% a snapshot, every step
    every = 1
    for _ in range(1 + AUDIT_AFTER):  # the window of the interval's start is not counted
        assert every == 1
        every, proposed = cost.check(every, window_s=2.0, window_steps=10, saves=5)
    assert (every, proposed) == (PAUSED, None)
    cost.taken(4)  # agreed on in the paused window
    every, proposed = cost.check(every, window_s=1.0, window_steps=10, saves=5)
    assert every == 4 and proposed is not None
    assert cost.measured is None  # 2.0 s against 1.0 would have ruled 1 out


def test_the_background_threads_cpu_counts_where_the_training_fills_the_cpus():
    """A snapshot's copy and checksum in the background thread take CPU from the step
    where the training's threads fill the CPUs (2 processes on 2 cores): its CPU time, not
    its wall time (a wait for a peer costs nothing), counts with the snapshots' clocks.
    Beside a GPU's step, or with a CPU to spare, it costs the step nothing."""
    import threading
    import time

    import torch

    from engine import phases
    from engine.memory.background import Background
    from engine.memory.cost import MemoryCost, crowded

    background, go, burnt = Background(memory=None), threading.Event(), []

    def burn():
        started = time.thread_time()
        sum(range(300_000))
        burnt.append(time.thread_time() - started)

    cost = MemoryCost(background=lambda: background.cpu_s)
    cost.measure(window_s=1.0, window_steps=10, saves=1)  # the first snapshot's window
    background.submit(lambda: go.wait(60))  # a wait: no CPU
    background.submit(burn)
    go.set()
    background.wait()
    with phases.carve(phases.MEMORY_SNAPSHOTS, within="training"):
        pass
    cost.measure(window_s=1.0, window_steps=10, saves=2)
    background.stop()
    assert burnt[0] > 0 and burnt[0] <= background.cpu_s < burnt[0] + 0.05
    assert cost.snapshots == 1
    assert cost.snapshot_s >= burnt[0]
    assert cost.step_s == pytest.approx(1.0 - cost.snapshot_s)
    assert MemoryCost().background is None  # not crowded: the clocks alone
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert crowded(cpu, threads=1, cpus=1) and crowded(cpu, threads=4, cpus=4)
    assert not crowded(cpu, threads=1, cpus=2)  # 1 process, 1 thread, 2 cores: one spare
    assert not crowded(gpu, threads=8, cpus=8)


@pytest.mark.parametrize("windows, ruled_out", [
    ((0.1029, 0.1031, 0.1030, 0.1030), True),    # 3% over the paused window, +-0.1%
    ((0.1000, 0.1060, 0.1000, 0.1060), False)])  # 3% too, but +-3%: noise, not a cost
def test_an_audit_rules_an_interval_out_only_when_its_windows_resolve_the_budget(
        windows, ruled_out):
    """An audit's share (its windows with snapshots against the paused one) rules its
    interval out when it is over the budget by more than its standard error, which the
    windows' own spread gives: on 2 processes filling 2 cores a window's step time moves
    by +-3%, as large as the budget, and a single pair of windows would push the interval
    about at random."""
    from engine.memory.cost import AUDIT_AFTER, PAUSED, MemoryCost

    assert len(windows) == AUDIT_AFTER
    cost = MemoryCost(auto=True)
    costs(cost, snapshot_s=0.0001, step_s=0.1)  # probed: 0.1% a snapshot, every step
    every, _ = cost.check(1, window_s=1.0, window_steps=10, saves=5)  # the interval's start
    for step_s in windows:
        assert every == 1
        every, _ = cost.check(every, window_s=10 * step_s, window_steps=10, saves=5)
    assert every == PAUSED
    every, proposed = cost.check(every, window_s=1.0, window_steps=10, saves=5)
    assert every == 1 and cost.measured == pytest.approx(0.03)
    assert (cost.error < 0.01) is ruled_out
    assert (cost.over, proposed) == ((1, 2) if ruled_out else (0, 1))
    assert cost.record(1, True)["measured_error_percent"] == pytest.approx(100 * cost.error,
                                                                           abs=1e-3)
