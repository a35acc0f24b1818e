"""Where a run's time goes outside the training loop: named points on one clock.

Each process records the moment a phase ends (:func:`mark`, a dozen per run), printed
when asked for (``engine-run -v``); :func:`carve` times a part of a phase as a row of its
own. The launching process hands its points to its workers (``ENGINE_PHASES``:
``CLOCK_MONOTONIC`` is one clock for a machine's processes), so their tables run from
the command's start. While the ``profiler`` plugin records, :func:`span` labels its
trace (else a shared no-op: a function call per range, nothing more).
"""

from __future__ import annotations

import contextlib
import os
import time

ENV = "ENGINE_PHASES"
#: The phase that ends as the training loop starts (the Trainer's first mark): what
#: comes before is start-up.
TRAINING_STARTS = "resume, run-start hooks"
#: The phase that ends as the training loop returns (the Engine's mark after it).
TRAINING_ENDS = "training"

#: (the phase that ended, time.monotonic(), time.process_time(), pid) at its end; the
#: first entry is the start.
_marks: list[tuple[str, float, float, int]] = []
#: Time spent inside a phase on something named (carve): name -> [phase, wall, CPU,
#: times].
_carved: dict[str, list] = {}

#: The row of the snapshots written while training (taken out of the training phase).
SNAPSHOTS = "snapshots while training"
MEMORY_SNAPSHOTS = "memory snapshots while training"
#: An optimizer step's wait for a memory snapshot's copy left to the background thread
#: (a large or GPU state): the snapshot's cost too, paid a step later.
MEMORY_WAITS = "waits for memory snapshot copies"

#: The prefix of the engine's ranges in a trace: "engine: forward/backward".
RANGE_PREFIX = "engine: "
_UNLABELLED = contextlib.nullcontext()
#: torch.profiler.record_function while a profiler records, else None.
_label = None
#: True from the start to the end of a run in which a profiler will record: only then
#: is the data loader's iterator wrapped (:func:`labelled`).
_armed = False


def process_start() -> float:
    """When this process started, on the ``time.monotonic()`` clock (to the clock tick,
    10 ms on Linux); now where /proc cannot say."""
    # lazily: engine-run's start imports this module and needs no atomic_io (hashlib...)
    from engine.atomic_io import proc_stat

    try:
        start_ticks = int(proc_stat("self")[19])
        since_start = (time.clock_gettime(time.CLOCK_BOOTTIME)
                       - start_ticks / os.sysconf("SC_CLK_TCK"))
        return time.monotonic() - max(0.0, since_start)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def _inherited() -> list[tuple[str, float, float, int]]:
    """The launching process's points, in a worker it started."""
    try:
        return [(name, float(wall), float(cpu), int(pid)) for name, wall, cpu, pid in
                (item.split("|") for item in os.environ.get(ENV, "").split(";") if item)]
    except ValueError:
        return []


def mark(name: str) -> None:
    """The phase ``name`` ends now (it began at the previous mark)."""
    if not _marks:
        _marks.extend(_inherited() or [("", process_start(), 0.0, os.getpid())])
    _marks.append((name, time.monotonic(), time.process_time(), os.getpid()))


@contextlib.contextmanager
def carve(name: str, within: str, label: str | None = None):
    """Time the body as ``name``: a row of its own, taken out of the phase ``within``
    (the body may run several times: the times add up); a range ``label`` in a
    profiler's trace while one records."""
    wall, cpu = time.monotonic(), time.process_time()
    try:
        with span(label or name):
            yield
    finally:
        spent = _carved.setdefault(name, [within, 0.0, 0.0, 0])
        spent[1] += time.monotonic() - wall
        spent[2] += time.process_time() - cpu
        spent[3] += 1


def carved(name: str) -> tuple[float, float, int]:
    """The wall and CPU seconds carved as ``name`` so far in this process, and how many
    times (zeros when none)."""
    _, wall, cpu, times = _carved.get(name, (None, 0.0, 0.0, 0))
    return wall, cpu, times


def span(name: str):
    """A context manager: the range ``name`` in the trace while a profiler records,
    else a shared no-op."""
    return _UNLABELLED if _label is None else _label(RANGE_PREFIX + name)


def labelled(iterable, name: str):
    """``iterable``, each item's fetch a range ``name`` while a profiler records; the
    iterable itself in a run that no profiler records (:func:`arm`)."""
    return _labelled(iterable, name) if _armed else iterable


def _labelled(iterable, name: str):
    items = iter(iterable)
    while True:
        with span(name):
            item = next(items, _labelled)  # the generator itself marks the end
        if item is _labelled:
            return
        yield item


def arm(on: bool) -> None:
    """A profiler will record in this run (``on``), from its start to its end (False)."""
    global _armed
    _armed = on


def label_ranges(on: bool) -> None:
    """Label the engine's ranges from now on (``on``: a profiler records), or stop."""
    global _label
    if on:
        from torch.profiler import record_function  # lazily: torch, when profiling

        _label = record_function
    else:
        _label = None
def elapsed(until: str | None = None) -> float | None:
    """Seconds from the start (the command's, when the launching process handed its
    points down; else this process's) to now, or to the end of the phase ``until``
    (None when it has not ended)."""
    if not _marks:
        return None
    ends = [wall for name, wall, _, _ in _marks if name == until] if until else [
        time.monotonic()]
    return ends[0] - _marks[0][1] if ends else None


def training_time() -> float | None:
    """Seconds the training loop ran (its steps, validation and the snapshots written
    while training): from :data:`TRAINING_STARTS` to :data:`TRAINING_ENDS`, or to now
    when it has not ended (a run failing); None when it never started (a custom loop,
    a failure in set-up)."""
    start = elapsed(until=TRAINING_STARTS)
    if start is None:
        return None
    end = elapsed(until=TRAINING_ENDS)
    return (end if end is not None else elapsed()) - start


def launching() -> None:
    """In the launching process, just before the workers start: the command's set-up
    ends here (from the interpreter's start), and the workers inherit the points."""
    _marks[:] = [("", process_start(), 0.0, os.getpid())]
    _carved.clear()
    mark("command set-up")
    os.environ[ENV] = ";".join(f"{name}|{wall!r}|{cpu!r}|{pid}"
                               for name, wall, cpu, pid in _marks)


def restart() -> None:
    """A library call (engine.fit, engine.launch) starts its own clock: a second call in
    the same process counts from its own start, not from the interpreter's or the first
    call's; so do the workers it starts, a restarted one (max_restarts) too."""
    _marks[:] = [("", time.monotonic(), time.process_time(), os.getpid())]
    _carved.clear()
    os.environ[ENV] = f"|{_marks[0][1]!r}|{_marks[0][2]!r}|{os.getpid()}"


def rows() -> list[tuple[str, float, float]]:
    """(phase, wall seconds, CPU seconds), in order; a carved row follows the phase it
    was taken from."""
    out = []
    for (_, wall0, cpu0, pid0), (name, wall, cpu, pid) in zip(_marks, _marks[1:]):
        cpu_used = cpu - cpu0 if pid == pid0 else cpu  # a new process: all it used
        inside = [(row, w, c) for row, (within, w, c, _) in _carved.items()
                  if within == name]
        out.append((name, wall - wall0 - sum(w for _, w, _ in inside),
                    cpu_used - sum(c for _, _, c in inside)))
        out += inside
    return out


def table(title: str = "phases") -> str:
    """The phases so far, one line each: wall and CPU seconds, and when each ends,
    counted from the start (the command's, or this process's)."""
    if len(_marks) < 2:
        return f"{title}: none recorded"
    phases = rows()
    width = max(len(name) for name, _, _ in phases)
    lines = [f"{title}, seconds:",
             f"  {'phase':<{width}}  {'wall':>7} {'CPU':>7}  {'ends at':>10}"]
    at = 0.0
    for name, wall, cpu in phases:
        at += wall
        lines.append(f"  {name:<{width}}  {wall:7.3f} {cpu:7.3f}  at {at:7.3f}")
    return "\n".join(lines)


def report(verbose: bool, title: str = "phases (rank 0)") -> None:
    """Print the table when ``verbose``."""
    if verbose:
        print(table(title), flush=True)


def command_ended(verbose: bool) -> None:
    """In the launching process, once the workers have exited: how long the whole
    command took, when ``verbose`` (the workers' exit is the time after their table)."""
    if verbose and _marks:
        print(f"command: {time.monotonic() - _marks[0][1]:.3f}s from the interpreter's "
              "start to the workers' exit", flush=True)
