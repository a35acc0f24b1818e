"""engine/threads.py: the torch threads per process, the idle CPUs shared by the
processes unless asked, and the warning when processes or threads outnumber the CPUs."""

from __future__ import annotations

import os

import pytest

import engine
from engine.testing import fit
from tests import conftest
from tests.conftest import run_cli

RECIPE = conftest.REPO / "tests" / "recipes" / "tiny_regression.py"


def test_more_processes_than_usable_cpus_is_a_warning_with_the_cpus(tmp_path):
    from engine.world import usable_cpus

    cpus, source = usable_cpus()
    batch = f"batch_size={cpus * (cpus + 1)}"  # splits over either number of processes
    proc = run_cli(str(RECIPE), batch, f"out_dir={tmp_path}", "--nproc", str(cpus + 1),
                   "--dry-run", check=True)
    assert (f"warning: {cpus + 1} processes on this node share {cpus} usable CPU(s) "
            f"({source}): each gets 1 torch thread and they take turns, so training will be "
            f"slow; --nproc {cpus} or fewer fits the CPUs") in proc.stderr, proc.stderr
    fits = run_cli(str(RECIPE), batch, f"out_dir={tmp_path}", "--nproc", str(cpus),
                   "--dry-run", check=True)
    assert "usable CPU(s)" not in fits.stderr


def a_machine(monkeypatch, cpus: int, load: float) -> None:
    """This process sees ``cpus`` CPUs (all of the machine's) and a 1-minute ``load``
    (not the suite's pinned one: tests/conftest.py)."""
    monkeypatch.delenv("ENGINE_LOAD_AVERAGE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize("cpus, load, processes, threads", [
    (2, 0.0, 1, 2), (2, 0.4, 1, 2), (2, 1.0, 1, 1), (2, 2.1, 1, 1),  # busy: one
    (2, 0.0, 2, 1), (2, 2.0, 2, 1), (8, 0.0, 2, 4), (8, 4.0, 2, 2), (8, 0.0, 16, 1)])
def test_default_threads_are_the_idle_cpus_shared_by_the_processes(cpus, load, processes,
                                                                   threads):
    from engine.threads import default_threads

    assert default_threads(cpus, load, processes) == threads


def test_the_plan_says_the_default_threads_and_a_run_uses_them(tmp_path, monkeypatch):
    """Two busy CPUs: one thread for one process (two ran 8-12x slower), said in the
    plan; the run trains with it. Idle: both."""
    import torch

    a_machine(monkeypatch, cpus=2, load=2.0)
    proc = conftest.run_cli_here(str(RECIPE), f"out_dir={tmp_path / 'plan'}", "--nproc", "1",
                                 "--dry-run", check=True,  # empty: the machine's load
                                 env=conftest.engine_env(ENGINE_LOAD_AVERAGE=""))
    assert ("threads       1 per process (default: 2 CPU(s) (affinity), load 2.0, "
            "1 process(es); --threads N sets it)") in proc.stdout, proc.stdout
    seen = []

    class Threads:
        @engine.hookimpl
        def engine_run_start(self, ctx):
            seen.append(torch.get_num_threads())

    fit(RECIPE, nproc=1, out_dir=str(tmp_path / "busy"), epochs=1, plugins=[Threads()])
    a_machine(monkeypatch, cpus=2, load=0.0)
    fit(RECIPE, nproc=1, out_dir=str(tmp_path / "idle"), epochs=1, plugins=[Threads()])
    assert seen == [1, 2]
    asked = conftest.run_cli_here(str(RECIPE), f"out_dir={tmp_path / 'plan'}", "--nproc", "1",
                                  "--threads", "2", "--dry-run", check=True)
    assert "threads       2 per process (--threads)" in asked.stdout, asked.stdout
    pinned = conftest.run_cli_here(str(RECIPE), f"out_dir={tmp_path / 'plan'}", "--nproc",
                                   "1", "--dry-run", check=True,  # stands for the load
                                   env=conftest.engine_env(ENGINE_LOAD_AVERAGE="2"))
    assert "threads       1 per process (default: 2 CPU(s) (affinity), load 2.0" in \
        pinned.stdout, pinned.stdout


def test_threads_asked_beyond_the_cpus_are_a_warning_naming_the_setting(tmp_path,
                                                                        monkeypatch):
    a_machine(monkeypatch, cpus=2, load=0.0)
    proc = conftest.run_cli_here(str(RECIPE), f"out_dir={tmp_path}", "--nproc", "2",
                                 "--threads", "2", "--dry-run", check=True)
    assert ("warning: --threads 2 x 2 process(es) = 4 torch threads on 2 usable CPU(s) "
            "(affinity): they take turns, so training will be slow; leave threads out (the "
            "default fits the CPUs and their load) or ask for 1") in proc.stderr, proc.stderr
    fits = conftest.run_cli_here(str(RECIPE), f"out_dir={tmp_path}", "--nproc", "2",
                                 "--threads", "1", "--dry-run", check=True)
    assert "torch threads" not in fits.stderr
