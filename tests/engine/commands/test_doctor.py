"""``engine-run doctor``: versions, what each launcher rule makes of the environment,
the world it computes, checks with a clear verdict, and the hints. Each case sets the
variables a launcher would set and runs the real command (in this process)."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from engine.commands.doctor import HINTS
from engine.plugin_manager import DISABLE_AUTOLOAD_ENV, build_plugin_manager
from engine.testing import write_distribution
from tests.conftest import REPO, engine_env, run_cli_here

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400"}


def doctor(*args: str, **env: str):
    return run_cli_here("doctor", *args, env=engine_env(**env))


def detection_rows(stdout: str) -> list[list[str]]:
    block = stdout.split("launcher detection (first match wins):\n")[1].split("checks:")[0]
    return [line.split()[:3] for line in block.splitlines()]


def test_plain_machine():
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("engine ")
    assert "torch " in out and "CUDA available: no (CUDA_VISIBLE_DEVICES='')" in out
    assert detection_rows(out) == [["legacy", "10", "no"], ["torchrun", "20", "no"],
                                   ["slurm", "30", "no"], ["spawn", "1000", "yes"]]
    assert "ok      launcher spawn (detected)" in out
    assert "ranks 0, 1 of 2, local world size 2" in out
    assert "spawn picked it and holds it for rank 0's rendezvous store" in out
    for title, _ in HINTS:
        assert f"  {title}: " in out


def test_under_torchrun_variables():
    proc = doctor(**TORCHRUN)
    out = proc.stdout
    assert ["torchrun", "20", "yes"] in detection_rows(out)
    assert "launcher torchrun (detected)" in out
    assert "this node: node 1 of 2, ranks 3 of 4, local world size 2; master " \
           "127.0.0.1:29400 (env://)" in out
    assert "torchrun's agent holds it" in out
    assert "  TORCHELASTIC_RUN_ID=job7" in out.split("variables read by torchrun:")[1]
    # The table: node 0's ranks inferred, this node's exact.
    table = out.split("world (as computed here):\n")[1].splitlines()[1:5]
    assert [row.split()[:3] for row in table] == [["0", "0", "0"], ["1", "1", "0"],
                                                  ["2", "0", "1"], ["3", "1", "1"]]


def test_problems_are_named_and_fail_the_exit_status():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = doctor("--master-port", str(port), NCCL_SOCKET_IFNAME="nosuch0")
    assert proc.returncode == 1
    assert (f"PROBLEM master port {port} on 127.0.0.1 is already in use" in proc.stdout)
    assert "PROBLEM NCCL_SOCKET_IFNAME=nosuch0: no interface matches nosuch0 (interfaces " \
           "here: lo" in proc.stdout


def test_an_mlflow_store_that_cannot_open_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # mlflow-skinny's
    proc = doctor(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db")
    assert proc.returncode == 1
    assert (f"PROBLEM MLFLOW_TRACKING_URI: sqlite:///{tmp_path}/m.db is a database store, "
            "which needs SQLAlchemy; the [mlflow] extra (mlflow-skinny) lacks it: pip "
            "install mlflow") in proc.stdout


def test_launcher_asked_for_without_its_variables():
    proc = doctor("--launcher", "torchrun")
    assert proc.returncode == 1
    assert "PROBLEM launcher 'torchrun' needs the environment variables RANK, LOCAL_RANK, " \
           "WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which are not set" \
           in proc.stdout


def test_salloc_shell_is_explained():
    proc = doctor(SLURM_JOB_ID="9", SLURM_PROCID="0", SLURM_JOB_NAME="interactive",
                  SLURM_JOB_NODELIST="n1", SLURM_NTASKS="1")
    slurm_row = [line for line in proc.stdout.splitlines() if line.startswith("  slurm ")]
    assert slurm_row and "no   in a SLURM allocation but not in a job step" in slurm_row[0]
    assert "launcher spawn (detected)" in proc.stdout


@pytest.fixture
def broken_install(tmp_path, monkeypatch):
    """An installed distribution whose plugin fails to import, found by
    importlib.metadata like a pip-installed one (on sys.path: the commands run here)."""
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    write_distribution(tmp_path, "engine-bad", "1.0", {"bad": "bad_plugin_xyz"},
                       files={"bad_plugin_xyz.py": "import gone_module_xyz\n"})
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_broken_plugin_is_named_by_help_doctor_and_plugins_and_stops_a_run(
        broken_install):
    error = ('Error importing plugin "bad": ModuleNotFoundError: No module named '
             "'gone_module_xyz'")
    named = (f'plugin "bad" (distribution engine-bad 1.0) is broken and was left out: '
             f"{error}; to disable it: -p no:bad, or {DISABLE_AUTOLOAD_ENV}=1 (no "
             "installed plugin loads), or pip uninstall engine-bad")
    proc = doctor()
    assert proc.returncode == 1
    # The built-ins and this repository's own entry points (the optional loggers).
    loaded = len(build_plugin_manager(["no:bad"]).infos)
    assert f"plugins:\n  ok      {loaded} loaded (engine-run plugins lists " \
           f"them)\n  PROBLEM {named}\nlauncher detection" in proc.stdout
    assert "ok      launcher spawn (detected)" in proc.stdout  # the rest still runs

    proc = run_cli_here("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: engine-run")
    assert proc.stderr == f"engine-run: warning: {named}\n"

    proc = run_cli_here("plugins")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == f"broken: {named}"
    assert "spawn " in proc.stdout

    # A run refuses, with the one line it always had.
    recipe = str(REPO / "recipes" / "cifar_ddp.py")
    proc = run_cli_here(recipe, "--dry-run")
    assert (proc.returncode, proc.stderr) == (2, f"engine-run: error: {error}\n")

    assert "PROBLEM" not in doctor("-p", "no:bad").stdout
    assert run_cli_here("-p", "no:bad", "--help").stderr == ""


def test_the_threads_line_names_the_setting_when_the_load_leaves_fewer_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    busy = doctor("--nproc", "1", ENGINE_LOAD_AVERAGE="").stdout
    assert ("note    torch threads: 1 per process (default: 2 CPU(s) (affinity), load 1.9, "
            "1 process(es); --threads N sets it); the load keeps CPUs busy") in busy, busy
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 1.0, 1.0))
    assert "ok      torch threads: 2 per process (default: 2 CPU(s) (affinity), load 0.1" in \
        doctor("--nproc", "1", ENGINE_LOAD_AVERAGE="").stdout
