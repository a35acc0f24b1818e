"""engine-run and ``python`` in test processes: a test run's environment and arguments,
each command forked from a warm server with torch imported (:mod:`.warm_start`) or
started plainly, and the processes a run left behind."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
from typing import Mapping, Sequence

from engine.atomic_io import proc_stat
from engine.launch_env import START_METHOD_ENV
from engine.threads import LOAD_ENV
from engine.testing import warm_start

#: Launcher and scheduler variables that would make a test run adopt them: removed.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


#: A test run's memory tier interval unless its arguments give one (auto reads clocks).
PINNED_MEMORY_INTERVAL = "checkpoint.memory_every_steps=0"


def pinned(args: Sequence[str]) -> list[str]:
    """``engine-run ARGS`` with :data:`PINNED_MEMORY_INTERVAL` after the recipe (a ``.py``
    file), unless ARGS set ``checkpoint.memory_every_steps`` (``=auto`` to test the
    choice itself); commands (``tune-workers RECIPE``, ``doctor``) are left as they are."""
    args = [str(a) for a in args]
    recipe = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    command = recipe != 0 and not args[0].startswith("-")  # engine-run COMMAND ...
    if recipe is None or command or any(a.startswith("checkpoint.memory_every_steps=")
                                        for a in args):
        return args
    return [*args[:recipe + 1], PINNED_MEMORY_INTERVAL, *args[recipe + 1:]]


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ for a test run: CPU only, no launcher variables, unbuffered output, and
    the default threads not from the machine's load (their number changes a run's bits)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"})
    env.setdefault(LOAD_ENV, "0")
    env.update(extra or {})
    return env


def run_engine(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None,
               timeout: float = 300, check: bool = False,
               program: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """``engine-run ARGS`` in a new process forked from the warm server
    (``ENGINE_TEST_FORK=0``: a plain one; ``program``, e.g. ``["engine-run"]``: that one);
    ``check``: a failed run is an AssertionError showing the command and its output."""
    env, args = dict(env) if env is not None else engine_env(), pinned(args)
    if program is None and _forkable(env):
        # The server has torch imported: its spawn launchers fork their workers from it
        # too, unless the test chose (engine.launch_env.start_method).
        env.setdefault(START_METHOD_ENV, "fork")
        proc = _warm_starter().run(args, env=env, cwd=cwd, timeout=timeout)
    else:
        command = [*(program or (sys.executable, "-m", "engine")), *map(str, args)]
        proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    return _checked(proc, check, "engine-run")


def run_python(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None,
               timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` (``SCRIPT``, ``-m MODULE``, ``-c CODE``) as :func:`run_engine` runs
    engine-run: a tool or an example script without a Python and torch start per call
    (not for what a fresh interpreter imports: the server has torch imported)."""
    env = dict(env) if env is not None else engine_env()
    if _forkable(env):
        proc = _warm_starter().run(args, env=env, cwd=cwd, timeout=timeout, python=True)
    else:
        proc = subprocess.run([sys.executable, *map(str, args)], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
    return _checked(proc, check, "python")


def start_engine(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None):
    """``engine-run ARGS`` started as :func:`run_engine` runs it, returned at once: a
    Popen-like handle: ``pid`` (own session), ``poll``, ``wait``, ``kill``, ``communicate``."""
    env, args = dict(env) if env is not None else engine_env(), pinned(args)
    if _forkable(env):
        env.setdefault(START_METHOD_ENV, "fork")  # as run_engine
        return _warm_starter().start(args, env=env, cwd=cwd)
    return _popen([sys.executable, "-m", "engine", *map(str, args)], env, cwd)


def start_python(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None):
    """``python ARGS`` started as :func:`run_python` runs it, returned at once, as
    :func:`start_engine` starts engine-run."""
    env = dict(env) if env is not None else engine_env()
    if _forkable(env):
        return _warm_starter().start(args, env=env, cwd=cwd, python=True)
    return _popen([sys.executable, *map(str, args)], env, cwd)


def _forkable(env: Mapping[str, str]) -> bool:
    """Not a command that may use a GPU here: the server's imports ask torch about CUDA,
    and torch refuses CUDA in a fork of a process that asked ("Cannot re-initialize CUDA
    in forked subprocess")."""
    return warm_start.enabled() and (env.get("CUDA_VISIBLE_DEVICES") == ""
                                     or not os.path.exists("/dev/nvidiactl"))


def _popen(command: list[str], env: Mapping[str, str], cwd) -> subprocess.Popen:
    """A plain subprocess as the server's children: its session, which ``kill()`` ends."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.kill = lambda: warm_start.kill_session(proc.pid)
    return proc


def _checked(proc: subprocess.CompletedProcess, check: bool,
             what: str) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed with code {proc.returncode}:\n"
                             f"{' '.join(map(str, proc.args))}\n{proc.stdout}\n{proc.stderr}")
    return proc


@functools.cache
def _warm_starter():
    """One warm-start server per test session (started on its first command)."""
    return warm_start.WarmStarter()


def _live_processes():
    """(PID, its /proc/PID/stat fields) of every live process (not zombies nor the ended)."""
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields and fields[0] != "Z":
            yield entry.name, fields


def group_processes(group: int) -> list[str]:
    """The PIDs of the live processes of process group ``group``."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == group]


def descendants(pid: int) -> list[str]:
    """The PIDs of the live processes started, at any depth, by process ``pid``."""
    children: dict[str, list[str]] = {}
    for child, fields in _live_processes():
        children.setdefault(fields[1], []).append(child)
    found, todo = [], [str(pid)]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def named_semaphores(pids: list[str]) -> set[str]:
    """The /dev/shm/sem.* files these processes have mapped that still have a name (not
    "(deleted)"): what a kill of them all would leave behind."""
    names = set()
    for pid in pids:
        try:
            maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.split()[-1] for line in maps.splitlines()
                     if "/dev/shm/sem." in line and not line.endswith("(deleted)"))
    return names
