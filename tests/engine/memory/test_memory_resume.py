"""Restarts that resume from memory (issue 26), on real torchrun processes: a worker
killed mid-epoch comes back from its own in-memory snapshot (killed again at an epoch's
start, from the newer disk snapshot: torchrun's restarts from disk), and a "node" whose
shared memory is gone gets the snapshot from its healthy peer; both end with the
weights of a run that was never interrupted."""

from __future__ import annotations

import os
import random

import pytest

from engine.memory.files import buffer_paths
from tests.conftest import ENGINE_RUN, engine_env, read_summary, run_cli, small_disk
from tests.engine.test_snapshot import (BASE, ELASTIC, RECIPE, STEPS_PER_EPOCH,
                                        TORCHRUN, Agents, wait_for)

#: tiny_resume with a memory snapshot every step and disk snapshots only at epoch ends,
#: so that a kill mid-epoch has a disk snapshot older than the memory one.
MEMORY = (*BASE, "checkpoint.every_steps=0", "checkpoint.memory_every_steps=1")
#: tiny_elastic, 2 epochs of 10 steps (global batch 6), a memory snapshot every step.
PEER = (ELASTIC, "epochs=2", "size=60", "checkpoint.memory_every_steps=1")


@pytest.fixture(scope="module")
def elastic_reference(tmp_path_factory):
    """weights_sha256 of a 2-process PEER run never interrupted, as a future: the run
    goes on in the background (a warm-start fork, beside any other command) while the
    test's agents start and wait on each other."""
    from concurrent.futures import ThreadPoolExecutor

    out = tmp_path_factory.mktemp("elastic-reference")

    def uninterrupted() -> str:
        run_cli(*PEER, f"out_dir={out}", "--nproc", "2", check=True)
        return read_summary(out)["weights_sha256"]

    with ThreadPoolExecutor(1) as background:
        yield background.submit(uninterrupted)


def no_buffers_left(out, world_size: int = 2) -> bool:
    return not any(p.exists() for r in range(world_size) for p in buffer_paths(out, r))


def test_a_worker_killed_under_torchrun_resumes_from_memory_or_from_disk_whichever_is_newer(
        reference, tmp_path):
    """Rank 1 SIGKILLed twice in one torchrun run (--max-restarts 2), in the step-end
    hook, before that step's memory copy. Mid-epoch, after the epoch-end disk snapshot
    before it: torchrun restarts both workers, which resume from the previous step's
    memory snapshot, not from disk. At an epoch's first step, whose memory snapshot
    before it is as old as the epoch-end disk one: from disk (and a run that resumed
    twice ends with the uninterrupted weights)."""
    import re

    from tests.plugins.launch_runs import run

    # Neither an epoch's first step nor its last; in the second epoch, so that the disk
    # snapshot before it is older than the memory one.
    step = random.choice([s for s in range(STEPS_PER_EPOCH + 2, STEPS_PER_EPOCH * 2)])
    epoch_start = STEPS_PER_EPOCH * 2 + 1
    out = tmp_path / "run"
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=f"{step},{epoch_start}",
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    proc = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                ENGINE_RUN, RECIPE, *MEMORY, f"out_dir={out}", "-p", "tests.fault_plugin"],
               env=env, timeout=300)
    for killed in (step, epoch_start):
        assert (tmp_path / f"once.step{killed}").exists(), f"never killed at step {killed}"
    assert (f"resumed from memory at step {step - 1} (restart 1; 1 step lost)"
            in proc.stdout), proc.stdout
    assert re.search(rf"^resuming from .*: the end of epoch 2, step {epoch_start - 1} "
                     r"\(restart 2\) \(1 step lost\)$", proc.stdout, re.M), proc.stdout
    assert proc.stdout.count("resuming from ") == 1  # the memory resume was not from disk
    summary = read_summary(out)
    assert summary["resume"]["tier"] == "disk"
    assert summary["resume"]["step"] == epoch_start - 1
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
    assert summary["weights_sha256"] == elastic_reference.result(timeout=240)
    assert no_buffers_left(out)


# ------------------------------------------------------------ what the tier trusts


@pytest.fixture
def memory_dir():
    """A folder on /dev/shm standing for a tmpfs shared with others
    (checkpoint.memory_dir), so that what a test plants is its own."""
    import shutil
    import uuid

    from engine.shm import SHM

    folder = SHM / f"engine-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def test_planted_names_leave_the_plants_untouched_and_the_run_on_disk_snapshots(
        reference, memory_dir, tmp_path):
    """Another user's file (mode 0666: it would receive the weights), a symbolic link to
    a file of root's (it would be overwritten) and a directory at this run's buffer
    names (the run's id planted with its folder, as someone who could read it would):
    one warning, the memory tier off on both ranks, the run trains from disk snapshots
    to the weights of a run that never had memory snapshots, and every planted object
    is as it was."""
    import os

    from engine.memory.files import RUN_ID_FILE, user_folder

    out = tmp_path / "run"
    out.mkdir()
    run_id = "5" * 32
    (out / RUN_ID_FILE).write_text(run_id)
    folder = user_folder(memory_dir)
    folder.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own file\n")
    leak = folder / f"{run_id}-r0-a"
    leak.write_bytes(b"")
    os.chown(leak, 12345, 12345)  # the suite runs as root (docs/development.md)
    os.chmod(leak, 0o666)
    (folder / f"{run_id}-r0-b").symlink_to(precious)
    (folder / f"{run_id}-r1-a").mkdir()
    planted = {p: os.lstat(p) for p in folder.iterdir()}
    proc = run_cli(RECIPE, *MEMORY, f"checkpoint.memory_dir={memory_dir}", f"out_dir={out}",
                   "--nproc", "2", check=True)
    said = warnings_in(proc.stderr)
    assert len(said) == 1 and "in-memory snapshots are off" in said[0], proc.stderr
    assert "is not a buffer of this user's" in said[0] and "Traceback" not in proc.stderr
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"]) == ("completed", 18)
    assert summary["weights_sha256"] == reference[2]
    assert precious.read_bytes() == b"root's own file\n"
    for path, before in planted.items():
        after = os.lstat(path)
        assert (after.st_mode, after.st_uid, after.st_size, after.st_ino) == (
            before.st_mode, before.st_uid, before.st_size, before.st_ino), path
    assert sorted(folder.iterdir()) == sorted(planted)  # and nothing else made there


def test_buffers_of_another_run_a_deleted_folder_or_a_fresh_start_are_never_resumed(
        reference, memory_dir, tmp_path):
    """Buffers carry the id their run keeps in its folder. (1) A 2-process run killed
    mid-epoch leaves its buffers. (2) They are copied under another run's names (a
    forged buffer: a valid checksum, another run's id): that run refuses each in one
    line and trains from its own start. (3) The first folder deleted and the same
    command run again: a new run, not a resume of the deleted one; the old buffers are
    removed (their writer is gone). (4) It is killed too, then a 1-process ``--no-resume
    --overwrite``: every rank's buffers of the discarded run go at its start."""
    import os
    import shutil

    from engine.memory.files import RUN_ID_FILE, run_buffers, run_id_of, user_folder

    out, other = tmp_path / "run", tmp_path / "other"
    args = (RECIPE, *MEMORY, f"checkpoint.memory_dir={memory_dir}", "--nproc", "2",
            "-p", "tests.fault_plugin")
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP="9",
                       ENGINE_FAULT_RANK="1")
    killed = run_cli(*args, f"out_dir={out}", env=fault)
    assert killed.returncode != 0
    first_id = run_id_of(out)
    left = run_buffers(first_id, memory_dir)
    assert {p.name.split("-")[1] for p in left} == {"r0", "r1"}, left

    other.mkdir()
    other_id = "a" * 32
    (other / RUN_ID_FILE).write_text(other_id)
    for path in left:  # the same bytes at the other run's names
        copy = path.with_name(path.name.replace(first_id, other_id))
        shutil.copyfile(path, copy)
        os.chmod(copy, 0o600)
    theirs = run_cli(*args, f"out_dir={other}", check=True)
    refused = [w for w in warnings_in(theirs.stderr) if "carries run id" in w]
    assert refused and all(first_id in w for w in refused), theirs.stderr
    assert "resumed from memory" not in theirs.stdout
    assert read_summary(other)["weights_sha256"] == reference[2]

    shutil.rmtree(out)  # the experiment deleted; the same command again
    again = run_cli(*args, f"out_dir={out}", env=fault | {"ENGINE_FAULT_STEP": "11"})
    assert again.returncode != 0  # killed too, at a later step
    assert "resumed from" not in again.stdout  # from step 0, not the deleted run
    assert "resuming from" not in again.stdout
    assert run_buffers(first_id, memory_dir) == []  # removed at its start
    second_id = run_id_of(out)
    assert second_id != first_id and len(run_buffers(second_id, memory_dir)) == 4

    fresh = run_cli(RECIPE, *MEMORY, f"checkpoint.memory_dir={memory_dir}",
                    f"out_dir={out}", "--nproc", "1", "--no-resume", "--overwrite",
                    check=True)
    assert "resumed from" not in fresh.stdout and "resuming from" not in fresh.stdout
    assert read_summary(out)["weights_sha256"] == reference[1]
    assert list(user_folder(memory_dir).iterdir()) == []  # rank 1's too; then its own


def test_a_tmpfs_that_fills_up_after_the_first_snapshot_turns_the_tier_off_not_the_run(
        reference, tmp_path):
    """The no-room path on real processes. A 2-process run whose memory snapshots hold
    a 1 MB ballast, in a 5 MB tmpfs of its own (room for the 4 buffers at the start): at
    step 3 rank 1's state alone doubles, and the tmpfs has no room to grow its buffer
    (ENOSPC while reserving the pages, from the kernel). Rank 0 saved that step. The
    ranks agree at the next check point (step 4, log_every=2) to turn the tier off: one
    warning, rank 0's, naming the rank and the cause; every rank's buffers removed; the
    run trains on with disk snapshots (epoch ends and every_steps=4 after the tier went)
    and completes, within the timeout, with the weights of a run that never had memory
    snapshots."""
    with small_disk(tmp_path / "tmpfs", "5m") as tiny:
        out = tmp_path / "run"
        proc = run_cli(RECIPE, *BASE, "checkpoint.memory_every_steps=1",
                       f"checkpoint.memory_dir={tiny}", f"out_dir={out}",
                       "--nproc", "2", "-p", "tests.ballast_plugin", timeout=120,
                       env=engine_env(ENGINE_BALLAST_MB="1", ENGINE_BALLAST_GROW_AT="3",
                                      ENGINE_BALLAST_GROW_RANK="1"),
                       check=True)
        said = warnings_in(proc.stderr)
        assert len(said) == 1, proc.stderr
        buffer = tiny / f"engine-memory-{os.geteuid()}"
        assert said[0].startswith(
            "warning: checkpoint.memory_every_steps: in-memory snapshots are off at step "
            f"4: rank 1: {buffer}/"), said[0]
        assert said[0].endswith(": No space left on device; the run goes on with disk "
                                "snapshots"), said[0]
        assert "Traceback" not in proc.stderr
        summary = read_summary(out)
        assert (summary["status"], summary["global_step"]) == ("completed", 18)
        assert summary["weights_sha256"] == reference[2]
        assert list(buffer.iterdir()) == []
        # Disk snapshots went on after the tier went: keep_last=2 keeps the last two.
        kept = sorted(p.name for p in (out / "checkpoints").glob("snapshot-*.pt"))
        assert kept == ["snapshot-e0002-s00000016.pt", "snapshot-e0003-s00000018.pt"], kept
