"""Where the suite's time goes (issue 39): ``ENGINE_TEST_PROFILE=FOLDER pytest ...``
writes one JSON line per test to ``FOLDER/<xdist worker>.jsonl``; ``tools/suite_profile.py
FOLDER`` prints the tables.

Per test (set-up, call and tear-down together): its wall time and the CPU seconds spent
for it, exactly where the kernel counts them and by kind of process where a sampler saw
them:

- exact: the pytest worker's own CPU (``RUSAGE_SELF``), the processes it started and
  reaped (``RUSAGE_CHILDREN``, each with the workers it reaped) and the commands forked
  from the warm-start server (the server reaps those; it reports each one's CPU).
  Processes outside the worker's tree (srun tasks, started by slurmd) are in none of
  these.
- by kind: a thread reads ``/proc`` every :data:`PERIOD_S` seconds and follows every
  process of this worker's tree, and every process whose environment carries this
  worker's tag (:data:`TAG_ENV`: srun passes the environment on to its tasks), naming its
  kind from its command line and its parent's kind (:func:`kind`). A process is sampled,
  not reaped: the CPU of its last period, and processes that lived less than one, are
  missed (the table shows the difference to the exact total).

Opt-in only: the sampler costs a little CPU of its own, and nothing reads the files but
the tool.
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import threading
import time

import pytest

#: ``ENGINE_TEST_PROFILE=FOLDER`` turns the measurement on.
PROFILE_ENV = "ENGINE_TEST_PROFILE"
#: Set in the pytest worker's environment, so that processes started through a
#: scheduler (srun tasks) can be told to be this worker's.
TAG_ENV = "ENGINE_TEST_PROFILE_TAG"
PERIOD_S = 0.1
TICK_S = 1 / os.sysconf("SC_CLK_TCK")

IN_PROCESS = "pytest worker (tests in-process)"


def kind(command: str, parent_kind: str, parent_command: str, in_slurm_job: bool,
              of_worker: bool) -> str:
    """The kind of a process, from its command line (arguments joined by spaces) and its
    parent's; ``of_worker``: the pytest worker is its parent."""
    # The program: the interpreter and what it runs (a script such as torchrun, found by
    # its #! line, comes second).
    words = command.split(" ")
    program = " ".join(words[:3] if words[1:2] in (["-m"], ["-u"]) else words[:2])
    if "warm_start import serve" in command:  # engine.testing.warm_start's server
        return "warm-start server" if of_worker else "forked run (warm start) and its workers"
    if "multiprocessing.forkserver" in command:
        if command == parent_command:
            return "async checkpointer writer (forked)"
        return "fork server of the async checkpointer"
    if "save_until_killed" in command:
        return "killed writer (checkpointer contract)"
    if "torch.distributed.run" in program or program.endswith("/torchrun"):
        return "torchrun agent"
    if parent_kind == "torchrun agent":
        return "torchrun worker"
    if "torch.distributed.launch" in program:
        return "legacy launch"
    if parent_kind == "legacy launch":
        return "legacy launch worker"
    if in_slurm_job or parent_kind.startswith("SLURM"):
        return "SLURM job (srun tasks, batch scripts)"
    if "multiprocessing.spawn" in command:
        return "spawned process (fresh interpreter)"
    if program.endswith(("-m engine", "/engine-run")):
        return "engine-run (fresh interpreter)"
    if "python" in words[0]:
        return "other Python (tools, scripts, pip)"
    return "other (srun/sbatch clients, shells)"


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


class _Process:
    __slots__ = ("ppid", "command", "kind", "cpu_s", "counted_for")

    def __init__(self, ppid: int) -> None:
        self.ppid, self.command, self.kind, self.cpu_s = ppid, None, "", 0.0
        self.counted_for = None  # the test its first CPU was counted for


class Sampler:
    """This worker's processes, by kind, with the CPU seconds each spent per test."""

    def __init__(self, tag: str) -> None:
        self.me, self.tag = os.getpid(), f"{TAG_ENV}={tag}".encode()
        self.ours: dict[int, _Process] = {}
        self.others: set[int] = set()
        self.lock = threading.Lock()
        self.test: dict | None = None  # the running test's record
        self.stopped = threading.Event()
        threading.Thread(target=self._loop, name="suite-profile", daemon=True).start()

    def _loop(self) -> None:
        while not self.stopped.wait(PERIOD_S):
            with self.lock:
                self.scan()

    def scan(self) -> None:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        alive = set(pids)
        for pid in pids:
            if pid in self.others or pid == self.me:
                continue
            stat = _read(f"/proc/{pid}/stat")
            if not stat:
                continue
            fields = stat.rsplit(b")", 1)[-1].split()
            ppid, cpu_s = int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S
            process = self.ours.get(pid)
            if process is None:
                parent = self.ours.get(ppid)
                environ = b"" if parent or ppid == self.me else _read(f"/proc/{pid}/environ")
                if parent is None and ppid != self.me and self.tag + b"\0" not in environ:
                    self.others.add(pid)
                    continue
                process = self.ours[pid] = _Process(ppid)
            command = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(
                errors="replace").strip()
            if command != process.command:  # new, or exec'd since
                parent = self.ours.get(process.ppid)
                environ = _read(f"/proc/{pid}/environ")
                process.command = command
                process.kind = kind(command, parent.kind if parent else "",
                                    parent.command if parent else "",
                                    b"\0SLURM_JOB_ID=" in b"\0" + environ,
                                    process.ppid == self.me)
            if self.test is not None and cpu_s > process.cpu_s:
                kinds = self.test["kinds"].setdefault(process.kind, {"processes": 0,
                                                                     "cpu_s": 0.0})
                kinds["cpu_s"] += cpu_s - process.cpu_s
                if process.counted_for is not self.test:
                    process.counted_for = self.test
                    kinds["processes"] += 1
            process.cpu_s = cpu_s
        for pid in [p for p in self.ours if p not in alive]:
            del self.ours[pid]
        self.others &= alive


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _warm_start_cpu() -> float:
    from engine.testing import processes

    return processes._warm_starter().cpu_s


class Profiler:
    def __init__(self, folder: str) -> None:
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = pathlib.Path(folder) / f"{self.worker}.jsonl"
        self.sampler: Sampler | None = None
        self.record: dict = {}

    def pytest_runtest_logreport(self, report):
        # A test that failed or erred ran short: its figures say nothing of its cost.
        if report.nodeid == self.record.get("test") and not report.passed:
            failed = "failed" if report.when == "call" else "error"
            self.record["outcome"] = failed if report.failed else "skipped"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        if self.sampler is None:
            tag = f"{os.getpid()}"
            os.environ[TAG_ENV] = tag
            # A pytest that a test starts (tests/test_conftest.py) profiles nothing.
            os.environ.pop(PROFILE_ENV, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.sampler = Sampler(tag)
        record = self.record = {"test": item.nodeid, "worker": self.worker,
                                "outcome": "passed", "kinds": {}}
        with self.sampler.lock:
            self.sampler.scan()
            self.sampler.test = record
        start, wall = time.time(), time.monotonic()
        own, children, forked = _cpu(resource.RUSAGE_SELF), \
            _cpu(resource.RUSAGE_CHILDREN), _warm_start_cpu()
        yield
        with self.sampler.lock:
            self.sampler.scan()
            self.sampler.test = None
        own = _cpu(resource.RUSAGE_SELF) - own
        record.update(
            start=start, wall_s=time.monotonic() - wall, own_cpu_s=own,
            reaped_cpu_s=_cpu(resource.RUSAGE_CHILDREN) - children,
            forked_cpu_s=_warm_start_cpu() - forked)
        record["kinds"][IN_PROCESS] = {"processes": 0, "cpu_s": own}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def register(config) -> None:
    folder = os.environ.get(PROFILE_ENV)
    if folder:
        config.pluginmanager.register(Profiler(folder), "suite-profile")
