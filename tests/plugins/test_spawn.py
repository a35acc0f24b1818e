"""plugins/spawn.py: workers started here, on one machine or on every node by hand
(--nnodes/--node-rank), checked before anything starts."""

from __future__ import annotations

import json
import os
import socket

import pytest

from engine.errors import LaunchError
from engine.launch_env import START_METHOD_ENV
from engine.launcher import LaunchOptions, free_port
from engine.plugins.spawn import SpawnLauncher
from tests.conftest import ENGINE_RUN, REPO, engine_env, run_cli
from tests.plugins.launch_runs import (ONE_THREAD, finished, reference_digest, run_together,
                                       train_args)


def test_every_node_style_ranks():
    launcher = SpawnLauncher(LaunchOptions(nproc=2, nnodes=3, node_rank=1,
                                           master_addr="10.0.0.1", master_port=29400), {})
    worlds = launcher.worlds()
    assert [(w.rank, w.local_rank, w.node_rank, w.world_size, w.local_world_size)
            for w in worlds] == [(2, 0, 1, 6, 2), (3, 1, 1, 6, 2)]
    assert {(w.master_addr, w.master_port, w.num_nodes) for w in worlds} == {
        ("10.0.0.1", 29400, 3)}
    # The table knows node 0's address, this node, and nothing about node 2.
    assert [w.host for w in launcher.all_worlds()] == ["10.0.0.1"] * 2 + [
        socket.gethostname()] * 2 + ["?"] * 2


def test_the_machines_cpus_are_shared_by_the_processes_it_starts():
    """The CPU rule of spawn: this machine's usable CPUs divided by --nproc, the same
    answer in every world (it sets the torch threads and num_workers=auto)."""
    shares = {w.cpu_share() for w in SpawnLauncher(LaunchOptions(
        nproc=3, cpu_allocation=(12, "SLURM_CPUS_PER_TASK")), {}).worlds()}
    assert [(s.count, s.reason) for s in shares] == [
        (4, "12 CPUs (SLURM_CPUS_PER_TASK) shared by 3 local processes = 4 each")]
    affinity = len(os.sched_getaffinity(0))
    (alone,) = SpawnLauncher(LaunchOptions(nproc=1), {}).worlds()
    assert alone.cpu_share().reason == f"{affinity} CPUs (affinity) for this process"


CPU_REPORTER = """
import torch


def engine_run_start(engine):
    print(f"rank {engine.rank}: {torch.get_num_threads()} threads, "
          f"{engine.loader_settings.num_workers} loader workers", flush=True)
"""


def test_each_workers_threads_and_auto_workers_come_from_its_one_share(tmp_path):
    """A real run: the share spawn's world carries into each worker sets both its torch
    threads and what num_workers=auto chooses (6 CPUs for 2 processes: 3 threads, and 3
    CPUs less the training process's: 2 workers)."""
    (tmp_path / "cpu_reporter.py").write_text(CPU_REPORTER)
    env = engine_env(SLURM_CPUS_PER_TASK="6", PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    proc = run_cli(str(REPO / "tests" / "recipes" / "tiny_resume.py"), "epochs=1",
                   "size=32", "num_workers=auto", f"out_dir={tmp_path / 'run'}",
                   "--launcher", "spawn", "--nproc", "2", "-p", "cpu_reporter", env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0: 3 threads, 2 loader workers", "rank 1: 3 threads, 2 loader workers"]


def test_one_machine_picks_a_free_port_once():
    launcher = SpawnLauncher(LaunchOptions(nproc=2), {})
    first, second = launcher.worlds(), launcher.worlds()
    assert first == second and first[0].run_id and first[0].master_port > 0


def test_the_picked_port_is_bound_from_the_pick_until_rank_0s_store_takes_it():
    """A port picked free and bound a second later by rank 0 can be taken in between by
    another process's connection (a CI run failed so: "master port ... is already in
    use"): the launcher binds it as it picks it and hands rank 0 the socket."""
    launcher = SpawnLauncher(LaunchOptions(nproc=2), {})
    port = launcher.worlds()[0].master_port
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))


@pytest.mark.parametrize("options, message", [
    (dict(nproc=2, nnodes=2, node_rank=2, master_addr="h", master_port=1),
     "--node-rank 2 must lie in 0..1 for --nnodes 2"),
    (dict(nproc=2, nnodes=2, node_rank=1),
     "spawn on several nodes needs --master-addr HOST and --master-port PORT"),
    (dict(nproc=0), "--nproc 0 must be >= 1"),
    (dict(nproc=2, init_method="file://relative"), "init method 'file://relative' is not"),
    (dict(nproc=2, nnodes=2, master_addr="h", master_port=1, max_restarts=1),
     "--max-restarts 1 with spawn on 2 nodes: each node would restart its own workers, "
     "which cannot rejoin the other nodes' run; use torchrun --max-restarts N with a c10d "
     "rendezvous"),
])
def test_bad_options(options, message):
    with pytest.raises(LaunchError) as err:
        SpawnLauncher(LaunchOptions(**options), {}).worlds()
    assert str(err.value).startswith(message)


def test_port_in_use_is_reported_before_any_worker_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli(*train_args(tmp_path / "run"), "--master-port", str(port))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"engine-run: error: master port {port} on 127.0.0.1 is already in use; choose "
        "another with --master-port PORT (or leave it out and a free port is picked)")
    assert "[rank" not in proc.stderr and not (tmp_path / "run").exists()


def stale_rendezvous_file(path) -> None:
    """What a crashed run leaves in a file:// rendezvous: its session, a verdict for
    tokens of its own, and process-group keys pointing at dead processes."""
    import torch.distributed as dist

    store = dist.FileStore(str(path), 2)  # one of two users: torch keeps the file
    store.set("engine/session", "deadbeefdeadbeef")
    store.set("engine/deadbeefdeadbeef/verdict",
              json.dumps({"ok": True, "tokens": ["dead0", "dead1"]}))
    store.set("engine/deadbeefdeadbeef/pg/rank_0", "127.0.0.1:1")
    del store


def test_two_nodes_by_hand_meet_through_a_stale_file_and_match_spawn(tmp_path,
                                                                    tmp_path_factory):
    """The seeds' style (the same command on every node) with a file:// rendezvous that
    an earlier run left behind: same weights as one machine."""
    rdzv = tmp_path / "rdzv"
    stale_rendezvous_file(rdzv)
    assert rdzv.exists()
    out = tmp_path / "run"
    port = free_port()
    nodes = [[ENGINE_RUN, *train_args(out), "--launcher", "spawn", "--nnodes", "2",
              "--node-rank", str(rank), "--nproc", "1", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--init-method", f"file://{rdzv}", *ONE_THREAD]
             for rank in range(2)]
    run_together(nodes)
    assert finished(out, "spawn")["weights_sha256"] == reference_digest(tmp_path_factory)


# ------------------------------------------------------------------ --max-restarts


def test_max_restarts_replaces_a_killed_worker_from_the_warm_spare_to_identical_weights(
        tmp_path, tmp_path_factory):
    """Rank 1 SIGKILLed once after step 6 (a disk snapshot at step 4, memory snapshots
    every step): the launcher says so in one line and replaces both workers with forks
    of its warm spare (engine/spares.py), which resume from the memory snapshot of step
    5 in the same folder (no new version of the pattern; --no-resume applies to the
    first start) to the weights of the uninterrupted run; the command succeeds.
    (--max-restarts 0, the default, ends such a run with the failure:
    tests/engine/test_snapshot.py.) The kill -> first new step time is printed, as
    tools/memory_kill_loop.py measures it (its plugin kills and times the run)."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    try:
        from memory_kill_loop import KILL_RANK, KILL_STEP, steps_seen
    finally:
        sys.path.remove(str(REPO / "tools"))
    runs = tmp_path / "runs"
    env = engine_env(**{KILL_STEP: "6", KILL_RANK: "1"})
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tools")
    env[START_METHOD_ENV] = "spawn"  # the default: the warm spare (fork: the launcher)
    proc = run_cli(*train_args(runs / "version_{version}"), "checkpoint.every_steps=4",
                   "checkpoint.memory_every_steps=1", "--launcher", "spawn",
                   "--nproc", "2", *ONE_THREAD, "--max-restarts", "1", "-p",
                   "memory_kill_loop", "--no-resume", env=env)  # the first start only
    assert proc.returncode == 0, proc.stderr
    out = runs / "version_0"
    assert [p.name for p in runs.iterdir()] == ["version_0"]
    assert (out / "killed").exists(), "rank 1 was never killed"
    assert ("worker rank 1 was killed by SIGKILL; restarting all 2 workers from the warm "
            "spare (restart 1 of 1)" in proc.stderr.splitlines()), proc.stderr
    assert "resumed from memory at step 5 (restart 1; 1 step lost)" in proc.stdout, (
        proc.stdout)
    summary = finished(out, "spawn")
    assert summary["resume"] == {"tier": "memory", "step": 5, "steps_lost": 1,
                                 "source_rank": None}
    assert summary["weights_sha256"] == reference_digest(tmp_path_factory)
    killed_at = float((out / "killed").read_text())
    first = next(when for when, _, restart in steps_seen(out) if restart)
    print(f"kill -> first new step: {first - killed_at:.2f}s")
    assert 0 < first - killed_at < 60  # a bound for a loaded CI machine: the print tells
