"""How many torch threads each worker process gets, chosen once in the launching process,
and the warning when processes or threads outnumber the CPUs this node may use."""

from __future__ import annotations

import os

from engine.errors import warn
from engine.world import usable_cpus

#: The 1-minute load average the default threads count, where set (choose_threads).
LOAD_ENV = "ENGINE_LOAD_AVERAGE"


def default_threads(cpus: int, load: float, processes: int) -> int:
    """The idle CPUs shared by the processes, rounded; at least one, at most their share."""
    processes = max(1, processes)
    idle = max(0.0, cpus - load) / processes
    return max(1, min(cpus // processes, int(idle + 0.5)))


def choose_threads(share, processes: int) -> tuple[int, str]:
    """:func:`default_threads` here, and the plan's words for it. The load counts every
    CPU of the machine: left out where ours are fewer (a SLURM allocation's); LOAD_ENV,
    where set, stands for it (a test suite's runs pin it: the same threads every run)."""
    cpus, source = share.shared or usable_cpus()
    try:
        load = float(os.environ.get(LOAD_ENV) or (
            os.getloadavg()[0] if cpus >= (os.cpu_count() or cpus) else 0.0))
    except (OSError, ValueError):  # no load average here, or LOAD_ENV no number
        load = 0.0
    return default_threads(cpus, load, processes), (
        f"default: {cpus} CPU(s) ({source}), load {load:.1f}, {processes} process(es); "
        "--threads N sets it")


def warn_if_oversubscribed(local_processes: int, share, threads: int, door) -> None:
    """Processes or threads beyond the CPUs this node may use take turns on them: a warning
    (the run is right, only slow); ``door`` (engine.launching's) names the threads asked."""
    cpus, source = share.shared or usable_cpus()
    if local_processes > cpus:
        warn(f"{local_processes} processes on this node share {cpus} usable CPU(s) "
             f"({source}): each gets 1 torch thread and they take turns, so training "
             f"will be slow; --nproc {cpus} or fewer fits the CPUs")
    elif threads * local_processes > cpus:
        asked = (f"{door.name}(threads={threads})" if door.library
                 else f"--threads {threads}")
        warn(f"{asked} x {local_processes} process(es) = {threads * local_processes} torch "
             f"threads on {cpus} usable CPU(s) ({source}): they take turns, so training "
             f"will be slow; leave threads out (the default fits the CPUs and their load) "
             f"or ask for {max(1, cpus // local_processes)}")
