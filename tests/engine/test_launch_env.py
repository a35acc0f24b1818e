"""engine/launch_env.py: the variables a launcher reads, the master port checked before
any worker starts, and how local workers are started (spawn, or fork when asked and
safe)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from engine.errors import LaunchError
from engine.launch_env import (LOWEST_FREE_PORT, START_METHOD_ENV, check_port_free,
                               ephemeral_low, free_port, require_variables, start_method)
from tests.conftest import REPO, engine_env


def test_require_variables_singular():
    with pytest.raises(LaunchError, match="needs the environment variables RANK, which is "
                                          "not set"):
        require_variables({"WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"], "x")


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


def test_a_free_port_is_drawn_where_no_connection_and_no_slurm_job_takes_it():
    """Ports below the ephemeral range (which the kernel hands to outgoing connections)
    and above the SLURM jobs' (15000-24999), different draws, each free."""
    low = ephemeral_low()
    ports = {free_port() for _ in range(8)}
    assert len(ports) > 1
    for port in ports:
        if low - LOWEST_FREE_PORT >= 1000:  # else no room below them: the kernel picks
            assert LOWEST_FREE_PORT == 25000 <= port < low
        check_port_free("127.0.0.1", port)



# ------------------------------------------------------------------ start method

FORK_PROBE = '''\
import sys
import threading

from engine.processes import spawn_workers
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
    # threads fork_unsafe counts are a new interpreter's (torch's idle one included).
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
