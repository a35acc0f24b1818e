"""engine/phases.py: the phases' accounting, its hand-over to the workers, and the table
rank 0 prints with -v (real processes)."""

from __future__ import annotations

import os
import re

import pytest

from engine import phases
from tests.conftest import QUICK, run_cli


class Clock:
    """Stands in for the time module: the wall clock and the CPU clock move by hand."""

    CLOCK_BOOTTIME = 7

    def __init__(self):
        self.wall = self.cpu = 0.0

    def monotonic(self):
        return self.wall

    def process_time(self):
        return self.cpu

    def clock_gettime(self, clock):
        return self.wall

    def tick(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(phases, "time", clock)
    monkeypatch.setattr(phases, "_marks", [])
    monkeypatch.setattr(phases, "_carved", {})
    monkeypatch.setattr(phases, "process_start", lambda: 0.0)
    monkeypatch.delenv(phases.ENV, raising=False)
    return clock


def test_each_phase_runs_from_the_previous_mark_and_a_carved_part_is_its_own_row(clock):
    clock.tick(2.0, 1.5)
    phases.mark("set-up")
    for _ in range(2):  # two snapshots while training, 0.25 s each
        clock.tick(1.0, 0.5)
        with phases.carve("snapshots", within="training"):
            clock.tick(0.25, 0.125)
    clock.tick(1.0, 0.5)
    phases.mark("training")
    clock.tick(0.5, 0.0)  # waiting, no CPU
    phases.mark("teardown")
    assert phases.rows() == [("set-up", 2.0, 1.5), ("training", 3.0, 1.5),
                             ("snapshots", 0.5, 0.25), ("teardown", 0.5, 0.0)]
    lines = phases.table("phases").splitlines()
    assert lines[0] == "phases, seconds:"
    assert re.fullmatch(r"  training\s+3\.000\s+1\.500  at\s+5\.000", lines[3])
    assert re.fullmatch(r"  teardown\s+0\.500\s+0\.000  at\s+6\.000", lines[5])


def test_a_worker_continues_the_launching_processes_table(clock, monkeypatch):
    clock.tick(3.0, 2.0)
    phases.launching()  # in the launching process
    handed_over = os.environ.pop(phases.ENV)
    monkeypatch.setenv(phases.ENV, handed_over)
    # A spawned worker: a new process with its own CPU clock, the same wall clock.
    monkeypatch.setattr(phases, "_marks", [])
    monkeypatch.setattr(phases.os, "getpid", lambda: -1)
    clock.tick(1.5, -2.0 + 1.25)  # its CPU clock reads 1.25 s: all it used so far
    phases.mark("worker start")
    clock.tick(0.5, 0.5)
    phases.mark("imports")
    assert phases.rows() == [("command set-up", 3.0, 2.0), ("worker start", 1.5, 1.25),
                             ("imports", 0.5, 0.5)]


def test_a_library_calls_workers_count_from_the_call_a_restarted_one_too(clock, monkeypatch):
    """engine.fit(nproc=2, max_restarts=1): a worker spawned (or restarted) by the call
    counts from the call's start, as engine-run's from the command's; its done line once
    said 3.9s for a 20s call, the time since the restart."""
    clock.tick(3.0, 2.0)  # the caller's script ran a while
    phases.restart()  # the call starts
    handed_over = os.environ.pop(phases.ENV)
    monkeypatch.setenv(phases.ENV, handed_over)
    monkeypatch.setattr(phases, "_marks", [])  # a worker restarted 15 s later
    monkeypatch.setattr(phases.os, "getpid", lambda: -1)
    clock.tick(15.0, 0.5)
    phases.mark("worker start")
    clock.tick(1.0, 1.0)
    assert phases.elapsed() == 16.0


def test_a_verbose_run_prints_rank_0s_phases_once_and_the_commands_end(cifar_recipe,
                                                                       tmp_path):
    proc = run_cli(cifar_recipe, *QUICK, f"out_dir={tmp_path / 'run'}", "--nproc", "2",
                   "checkpoint.memory_every_steps=1", "-v", check=True)
    assert proc.stdout.count("phases (rank 0), seconds:") == 1
    table = proc.stdout.split("phases (rank 0), seconds:\n")[1].splitlines()
    rows = [re.fullmatch(r"  (\S.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)  at\s+(\d+\.\d+)", line)
            for line in table[1:15]]
    # The memory snapshots' row first: at memory_every_steps=1 they start at step 1.
    assert [row.group(1) for row in rows] == [
        "command set-up", "worker start", "imports, plugins, recipe",
        "seed, threads, device", "process group", "data, model",
        "resume, run-start hooks", "training", "memory snapshots while training",
        "snapshots while training", "final snapshot durable", "closing digest", "summary",
        "process group destroyed"]
    ends = [float(row.group(4)) for row in rows]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(
        sum(float(row.group(2)) for row in rows), abs=0.01)
    command = re.search(r"^command: (\d+\.\d+)s from the interpreter's start to the "
                        r"workers' exit$", proc.stdout, re.M)
    assert command and float(command.group(1)) >= ends[-1]


def test_a_run_without_v_prints_no_phases(cifar_recipe, tmp_path):
    proc = run_cli(cifar_recipe, *QUICK, f"out_dir={tmp_path / 'run'}", "--nproc", "1",
                   check=True)
    assert "phases" not in proc.stdout and "command:" not in proc.stdout


def test_while_no_profiler_records_the_ranges_are_one_shared_no_op_and_the_loader_itself():
    loader = [1, 2, 3]
    assert phases.span("forward/backward") is phases.span("check point")
    assert phases.labelled(loader, "data wait") is loader  # nothing added per batch


def test_while_a_profiler_records_the_ranges_and_each_fetch_are_named_in_its_trace(
        monkeypatch):
    from torch.profiler import profile

    monkeypatch.setattr(phases, "_label", None)
    monkeypatch.setattr(phases, "_armed", False)
    monkeypatch.setattr(phases, "_carved", {})
    phases.arm(True)
    batches = phases.labelled([10, 20], "data wait")
    with profile() as prof:
        phases.label_ranges(True)
        fetched = list(batches)
        with phases.span("optimizer step"):
            pass
        with phases.carve("snapshots", within="training", label="snapshot"):
            pass
        phases.label_ranges(False)
        with phases.span("not recorded"):
            pass
    phases.arm(False)
    assert fetched == [10, 20]
    calls = {event.key: event.count for event in prof.key_averages()
             if event.key.startswith(phases.RANGE_PREFIX)}
    # Two batches and the fetch that found the end.
    assert calls == {"engine: data wait": 3, "engine: optimizer step": 1,
                     "engine: snapshot": 1}
