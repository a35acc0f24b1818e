"""engine/launcher.py: which launcher a process belongs to (the documented detection
order), the checks made before any worker starts, and local worker processes."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from engine.errors import LaunchError
from engine.launcher import (START_METHOD_ENV, Launcher, LaunchOptions, check_port_free,
                             choose_launcher, detection_order, require_variables,
                             spawn_workers, start_method)
from engine.plugin_manager import build_plugin_manager
from engine.world import World
from tests.conftest import REPO, engine_env

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
OLD_LEGACY = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}
SRUN = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NAME": "train"}
SALLOC_SHELL = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "n1"}


@pytest.fixture(scope="module")
def registry():
    return build_plugin_manager(autoload=False).launchers


def chosen(registry, environ, **options) -> str:
    return choose_launcher(registry, "auto", LaunchOptions(**options), environ).name


def test_detection_order_is_documented_order(registry):
    names = [cls.name for cls in detection_order(registry)]
    assert names == ["legacy", "torchrun", "slurm", "spawn"]
    import engine.launcher

    doc = engine.launcher.__doc__
    for number, name in enumerate(names, start=1):
        assert f"\n{number}. ``{name}``" in doc


@pytest.mark.parametrize("environ, options, expected", [
    ({}, {}, "spawn"),
    (TORCHRUN, {}, "torchrun"),
    ({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}, {}, "torchrun"),
    (TORCHRUN, {"local_rank": 1}, "legacy"),  # torch >= 2: legacy launch sets the same
    (OLD_LEGACY, {}, "legacy"),  # --use_env before torchelastic: LOCAL_RANK only
    ({**OLD_LEGACY, "LOCAL_RANK": ""}, {"local_rank": 0}, "legacy"),
    (SRUN, {}, "slurm"),
    ({**SRUN, **TORCHRUN}, {}, "torchrun"),  # srun torchrun ...: torchrun's workers
    (SALLOC_SHELL, {}, "spawn"),  # a salloc shell: no job step
    ({**SRUN, "SLURM_JOB_NAME": "bash", "SLURM_STEP_NUM_TASKS": "1"}, {}, "spawn"),
    ({**SRUN, "SLURM_JOB_NAME": "bash"}, {}, "slurm"),  # srun -n2 bash -c engine-run
    ({**SRUN, "SLURM_STEP_ID": "4294967290"}, {}, "spawn"),  # the interactive step
    ({**SRUN, "SLURM_STEP_ID": ""}, {}, "spawn"),  # the batch script itself
])
def test_detection(registry, environ, options, expected):
    assert chosen(registry, environ, **options) == expected


def test_a_launcher_asked_for_by_name_is_used_without_detection(registry):
    launcher = choose_launcher(registry, "slurm", LaunchOptions(),
                               {**SALLOC_SHELL, "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    (world,) = launcher.worlds()
    assert (world.launcher, world.rank, world.world_size, world.master_addr) == (
        "slurm", 0, 1, "n1")


@pytest.mark.parametrize("name, missing", [
    ("torchrun", "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ("legacy", "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ("slurm", "SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID"),
])
def test_named_launcher_lists_the_missing_variables(registry, name, missing):
    with pytest.raises(LaunchError) as err:
        choose_launcher(registry, name, LaunchOptions(), {}).worlds()
    assert str(err.value).startswith(
        f"launcher {name!r} needs the environment variables {missing}, which are not set")


def test_unknown_launcher_name_lists_the_registered(registry):
    from engine.errors import PluginError

    with pytest.raises(PluginError, match="launcher 'torchrunn' is not available.*did you "
                                          "mean 'torchrun'"):
        choose_launcher(registry, "torchrunn", LaunchOptions(), {})


def test_require_variables_singular():
    with pytest.raises(LaunchError, match="needs the environment variables RANK, which is "
                                          "not set"):
        require_variables({"WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"], "x")


class OldStyle(Launcher):
    """A third-party launcher written against detect(environ)."""

    name = "old-style"
    priority = 5

    @classmethod
    def detect(cls, environ):
        return environ.get("OLD_STYLE") == "1"

    def worlds(self):
        return [World(rank=0, local_rank=0, world_size=1, local_world_size=1)]


def test_third_party_detect_with_one_argument_still_works():
    pm = build_plugin_manager(autoload=False)
    pm.launchers.add("old-style", OldStyle)
    assert chosen(pm.launchers, {"OLD_STYLE": "1"}) == "old-style"
    assert chosen(pm.launchers, {}) == "spawn"


def test_port_in_use_is_found_before_starting():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError) as err:
            check_port_free("127.0.0.1", port)
    assert str(err.value) == (f"master port {port} on 127.0.0.1 is already in use; choose "
                              "another with --master-port PORT")
    check_port_free("127.0.0.1", port)  # free again once the listener is gone


# --------------------------------------------------------------- local workers


def worlds(n: int) -> list[World]:
    return [World(rank=r, local_rank=r, world_size=n, local_world_size=n) for r in range(n)]


class Worker:
    """Worker: record the environment it was given, say ready, wait (bounded) for
    SIGUSR1 and record it; then rank 1 fails with exit code 3."""

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)

    def __call__(self, world):
        got = []
        signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
        (self.folder / f"env{world.rank}").write_text(os.environ["ENGINE_TEST_VALUE"])
        (self.folder / f"ready{world.rank}").touch()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        if got:
            (self.folder / f"usr1-{world.rank}").touch()
        if world.rank == 1:
            raise SystemExit(3)


def test_local_workers_get_their_environment_and_signals_and_failures_are_named(tmp_path):
    # One run for three things, because starting worker processes is the slow part.
    def send_when_ready():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all((tmp_path / f"ready{r}").exists() for r in range(2)):
                os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal=USR1@90 would
                return
            time.sleep(0.05)

    sender = threading.Thread(target=send_when_ready, daemon=True)
    sender.start()
    with pytest.raises(LaunchError) as err:
        spawn_workers(Worker(tmp_path), worlds(2), {"ENGINE_TEST_VALUE": "share"})
    sender.join(timeout=5)
    assert [(tmp_path / f"env{r}").read_text() for r in range(2)] == ["share", "share"]
    # The parent passed the pre-emption signal on to both workers.
    assert (tmp_path / "usr1-0").exists() and (tmp_path / "usr1-1").exists()
    assert str(err.value) == ("worker with local rank 1 (rank 1) exited with code 3; its "
                              "error is printed above")
    assert err.value.exit_code == 1  # a code that is not one of engine-run's: a failure


class Status:
    """Worker: return a short status, or an object too large to send back."""

    def __call__(self, world):
        return "preempted" if world.rank == 0 else "x" * 100_000


def test_local_workers_send_back_their_status():
    assert spawn_workers(Status(), worlds(2)) == ["preempted", None]


# ------------------------------------------------------------------ start method

FORK_PROBE = '''\
import sys
import threading

from engine.launcher import spawn_workers
from engine.world import World

import forkprobe

if __name__ == "__main__":
    sys.forkprobe_parent = True  # set at run time: only a forked child can see it
    if sys.argv[1:] == ["thread"]:
        threading.Thread(target=threading.Event().wait, args=(60,), daemon=True).start()
    if sys.argv[1:] == ["ops"]:  # OpenMP's pool starts: a forked worker could hang in it
        import torch

        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).sum()
    # One worker tells how workers start; a real interpreter, not a warm fork: the native
    # threads _fork_unsafe counts are a new interpreter's (torch's idle one included).
    print(spawn_workers(forkprobe.worker, [World(rank=0, local_rank=0, world_size=1,
                                                 local_world_size=1)]))
'''


def test_start_method_is_spawn_unless_the_variable_says_fork():
    assert start_method({}) == "spawn"
    assert start_method({START_METHOD_ENV: " "}) == "spawn"
    with pytest.raises(LaunchError) as err:
        start_method({START_METHOD_ENV: "forkserver"})
    assert str(err.value) == ("ENGINE_START_METHOD='forkserver' is not a start method; "
                              "expected spawn or fork (the default: spawn)")


@pytest.mark.parametrize("variable, parent, expected", [
    (None, "", "spawned"),
    ("fork", "", "forked"),
    ("fork", "thread", "spawned"),  # a second thread: forking could hang the child
    ("fork", "ops", "spawned"),  # a thread pool of tensor operations: likewise
])
def test_workers_are_forked_only_when_asked_and_safe(tmp_path, variable, parent, expected):
    (tmp_path / "forkprobe.py").write_text(
        "import sys\n\n\ndef worker(world):\n"
        "    return 'forked' if getattr(sys, 'forkprobe_parent', False) else 'spawned'\n")
    (tmp_path / "probe.py").write_text(FORK_PROBE)
    env = engine_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    env.pop(START_METHOD_ENV, None)
    if variable:
        env[START_METHOD_ENV] = variable
    proc = subprocess.run([sys.executable, str(tmp_path / "probe.py"), parent], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str([expected])
    warned = "ENGINE_START_METHOD=fork: this process runs" in proc.stderr
    assert warned == bool(parent), proc.stderr
