"""Restarts that resume from memory (issue 26), on real torchrun processes: a worker
killed mid-epoch comes back from its own in-memory snapshot, and a "node" whose
shared memory is gone gets the snapshot from its healthy peer; both end with the
weights of a run that was never interrupted."""

from __future__ import annotations

import random

import pytest

from engine.memory_snapshot import buffer_paths
from tests.conftest import ENGINE_RUN, engine_env, read_summary, run_cli
from tests.engine.test_snapshot import (BASE, ELASTIC, EPOCHS, RECIPE, STEPS_PER_EPOCH,
                                        TORCHRUN, Agents, wait_for)

#: tiny_resume with a memory snapshot every step and disk snapshots only at epoch ends,
#: so that a kill mid-epoch has a disk snapshot older than the memory one.
MEMORY = (*BASE, "checkpoint.every_steps=0", "checkpoint.memory_every_steps=1")
#: tiny_elastic, 2 epochs of 10 steps (global batch 6), a memory snapshot every step.
PEER = (ELASTIC, "epochs=2", "size=60", "checkpoint.memory_every_steps=1")


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory):
    """weights_sha256 of a 2-process PEER run never interrupted."""
    out = tmp_path_factory.mktemp("elastic-reference")
    run_cli(*PEER, f"out_dir={out}", "--nproc", "2", check=True)
    return read_summary(out)["weights_sha256"]


def no_buffers_left(out, world_size: int = 2) -> bool:
    return not any(p.exists() for r in range(world_size) for p in buffer_paths(out, r))


def test_a_worker_killed_mid_epoch_under_torchrun_resumes_from_memory_losing_one_step(
        reference, tmp_path):
    """Rank 1 SIGKILLed in the step-end hook of a mid-epoch step (after the epoch-end
    disk snapshot before it, before that step's memory copy): torchrun restarts both
    workers, which resume from the previous step's memory snapshot, not from disk."""
    from tests.plugins.launch_runs import run

    # Neither an epoch's first step (the memory snapshot before it is as old as the disk
    # one: the disk wins) nor its last; a disk snapshot is older than the memory one.
    step = random.choice([s for s in range(STEPS_PER_EPOCH + 2, STEPS_PER_EPOCH * EPOCHS)
                          if s % STEPS_PER_EPOCH not in (0, 1)])
    out = tmp_path / "run"
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(step),
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    proc = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                ENGINE_RUN, RECIPE, *MEMORY, f"out_dir={out}", "-p", "tests.fault_plugin"],
               env=env, timeout=300)
    assert (tmp_path / "once").exists(), "the worker was never killed"
    assert (f"resumed from memory at step {step - 1} (restart 1; 1 step lost)"
            in proc.stdout), proc.stdout
    assert "resuming from " not in proc.stdout  # not from the disk snapshot
    summary = read_summary(out)
    assert summary["resume"] == {"tier": "memory", "step": step - 1, "steps_lost": 1,
                                 "source_rank": None}
    assert (summary["launcher"], summary["global_step"]) == ("torchrun", 18)
    assert summary["weights_sha256"] == reference[2]  # BASE's: snapshots change nothing
    assert no_buffers_left(out), "a completed run leaves its shared-memory buffers"


def rank_of(pid: int) -> int | None:
    """The RANK torchrun gave the process ``pid`` (None: not a worker, or gone)."""
    import pathlib

    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"RANK=")]
    return int(ranks[0]) if ranks else None


def test_a_node_replaced_with_its_shared_memory_gone_recovers_from_its_peer(
        elastic_reference, tmp_path):
    """Two torchrun agents on loopback (--nnodes 2, c10d): both hold before step 8
    (``<out_dir>/hold``, tiny_elastic), their step-7 memory snapshots written; agent b
    and its worker are SIGKILLed and its rank's buffers deleted (its machine replaced);
    a new agent c takes its place. The restarted rank that has no copy gets the
    snapshot from its peer over the process group: nothing lost, the weights of a run
    never interrupted."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("8")
    agents = Agents(tmp_path, "2", *PEER, f"out_dir={out}")
    with agents:
        agents.start("a", is_host=True)
        agents.start("b")
        wait_for(lambda: len(list(out.glob("holding-*"))) == 2,
                 "2 processes to hold before step 8")
        (lost_rank,) = {rank_of(pid) for pid in agents.workers("b")} - {None}
        agents.kill("b")  # the "node" goes: its agent, its worker, its memory
        for path in buffer_paths(out, lost_rank):
            assert path.exists(), f"rank {lost_rank} had no memory snapshot: {path}"
            path.unlink()
        (out / "hold").unlink()  # a's worker steps on and finds b gone
        agents.start("c")
        agents.wait("a", "c", timeout=240)
    log = agents.said()
    summary = read_summary(out)
    record = summary["resume"]
    # Whichever rank the new rendezvous gave the new node, one rank lacks its copy: the
    # killed worker's rank's buffers are gone, the survivor's are on the shared /dev/shm.
    assert record["tier"] == "peer" and record["step"] == 7, (record, log)
    source = record["source_rank"]
    assert (f"resumed from memory at step 7 (rank(s) {1 - source} had no copy: sent by "
            f"rank {source}; 0 steps lost)") in log, log
    assert record["steps_lost"] == 0
    assert (summary["status"], summary["world_size"], summary["global_step"]) == (
        "completed", 2, 20)
    assert summary["weights_sha256"] == elastic_reference
    assert no_buffers_left(out)
