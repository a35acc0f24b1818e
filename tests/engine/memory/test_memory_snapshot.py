"""In-memory snapshots (engine/memory/): real buffers in a tmpfs folder, real
processes killed during their copy."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import struct
import subprocess
import sys
import time

import pytest
import torch

from engine import phases
from engine.memory import buffer, copy_plan, files, resume, ring, rows, tier
from engine.memory.pair import MemorySnapshots
from engine.shm import SHM
from engine.testing import assert_same_snapshot
from engine.testing import make_engine, make_plugin_manager, tiny_recipe  # noqa: F401 (fixtures)
from engine.world import World
from tests.conftest import small_disk


@pytest.fixture
def shm(tmp_path):
    """A folder on /dev/shm (a tmpfs, as the real buffers), removed afterwards."""
    import shutil
    import uuid

    folder = SHM / f"engine-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def world(rank: int = 0, size: int = 1) -> World:
    return World(rank=rank, local_rank=rank, world_size=size, local_world_size=size)


def a_snapshot(step: int) -> dict:
    """What capture() holds, in miniature: tensors of several dtypes and shapes (an
    empty one, a scalar), an optimizer's int keys and tuples, plain values."""
    torch.manual_seed(step)
    return {
        "engine_version": "test", "config": {"lr": 0.1, "checkpoint": {"keep_last": 3}},
        "step": step,
        "model": {"w": torch.randn(7, 5), "b": torch.randn(5).to(torch.bfloat16),
                  "count": torch.tensor(step), "empty": torch.empty(0, 3)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(7, 5)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "progress": {"epoch": 1, "step": step, "epoch_loss": None},
        "rng": {"ranks": [{"python": (3, tuple(range(5)), None),
                           "torch": torch.get_rng_state()}], "world_size": 1},
        "dtype": torch.float16, "size": torch.Size([2, 3]),
    }


RUN_ID = "0123456789abcdef" * 2


def load_newest(memory, warn):
    """This rank's newest memory snapshot that loads whole (resume.load_all), or None."""
    loaded = resume.load_all(memory, warn)
    for other in loaded[1:]:
        other.close()
    return loaded[0] if loaded else None


def memory_of(run_dir, shm, rank: int = 0, run_id: str = RUN_ID) -> MemorySnapshots:
    memory = MemorySnapshots(run_dir, world(rank), every_steps=1, run_id=run_id, shm=shm)
    assert memory.check() is None
    return memory


def test_a_saved_snapshot_comes_back_whole_and_detached_from_the_buffer(shm, tmp_path):
    memory = memory_of(tmp_path, shm)
    state = a_snapshot(3)
    memory.save(state, step=3, epoch=1)
    slot = buffer.newest(memory.paths, RUN_ID)
    assert (slot.step, slot.epoch, slot.info["run_dir"]) == (3, 1, str(tmp_path.resolve()))
    assert slot.path.parent == shm / f"engine-memory-{os.geteuid()}"
    loaded = buffer.load_slot(slot)
    assert_same_snapshot(loaded, state)
    assert loaded["dtype"] is torch.float16 and loaded["size"] == torch.Size([2, 3])
    memory.save(a_snapshot(4), step=4, epoch=1)
    memory.save(a_snapshot(5), step=5, epoch=1)  # overwrites the buffer step 3 was in
    assert_same_snapshot(loaded, state)


def test_an_fsdp_models_snapshot_holds_its_shards_and_loads_them_back_bit_for_bit(
        shm, tmp_path):
    """Under fully_shard (one rank, in a process group of its own) the model's and the
    optimizer's local_state_dict hold the DTensors' local tensors with their shape and
    placements (to_shards); through the tier's buffer they load into a fresh sharded
    model, and into its optimizer before its first step (no state yet), so that the
    next step is the same to the bit; a whole model refuses them in one line."""
    import torch.distributed as dist
    from torch import nn

    from engine.errors import CheckpointError
    from engine.shards import SHARD
    from engine.stateful import ModelState, OptimizerState
    from tests.engine.test_stateful import tiny_adamw_run

    def trained(steps: int):
        return tiny_adamw_run(sharded=True, steps=steps)

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        model, optimizer = trained(2)
        state = {**a_snapshot(2), "model": ModelState(model).local_state_dict(),
                 "optimizer": OptimizerState(model, optimizer).local_state_dict()}
        shard = state["model"]["0.weight"]
        assert (shard[0], shard[2], shard[4]) == (SHARD, (3, 4), "S0")
        assert state["optimizer"]["state"][0]["exp_avg"][0] == SHARD
        memory = memory_of(tmp_path, shm)
        memory.save(state, step=2, epoch=0)
        loaded = buffer.load_slot(buffer.newest(memory.paths, RUN_ID))
        fresh, fresh_optimizer = trained(0)
        ModelState(fresh).load_state_dict(loaded["model"])
        OptimizerState(fresh, fresh_optimizer).load_state_dict(loaded["optimizer"])
        batch = torch.randn(5, 4)
        for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
            m(batch).sum().backward()
            o.step()
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a.to_local(), b.to_local())
        with pytest.raises(CheckpointError, match="^the memory snapshot holds fsdp shards "
                           "and this run's model is not sharded: resume with --parallel "
                           "fsdp"):
            ModelState(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))).load_state_dict(
                loaded["model"])
    finally:
        dist.destroy_process_group()


def forked_ranks(world_size: int, target, *args, **kwargs) -> None:
    """``target(*args, rank, **kwargs)`` in ``world_size`` forked processes (no imports
    to repeat), each given 120 s; every one must exit 0 (a failure's traceback is above)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=target, args=(*args, rank), kwargs=kwargs)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    for process in ranks:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in ranks] == [0] * world_size, "a rank failed: see above"


def test_the_ring_keeps_the_newest_whole_copy_and_gives_it_back_checked(shm, tmp_path):
    """engine/memory/ring.py between 2 real gloo processes (forked: no imports to
    repeat), each the other's successor: each snapshot's copy goes into the held buffer
    with the older copy; one that arrives damaged is refused and leaves the newest whole
    copy; at a resume where both ranks' own snapshots are gone, they agree on the
    copies' step and each gets its own back from the other, checked: the same snapshot
    to the bit."""
    forked_ranks(2, _ring_rank, shm=shm, tmp_path=tmp_path)


def _ring_snapshot(step: int, rank: int) -> dict:
    """A memory snapshot of rank ``rank``'s fsdp shards, of 2 processes."""
    from engine.shards import SHARD

    state = a_snapshot(step)
    torch.manual_seed(100 * step + rank)
    return {**state, "world_size": 2, "model": {
        "shard": (SHARD, torch.randn(3 + rank, 4), (7, 4), 0, "S0"), **state["model"]}}


def _ring_rank(rank: int, shm, tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 2),
                            rank=rank, world_size=2)
    warnings = []
    memory = MemorySnapshots(tmp_path, world(rank, 2), every_steps=1, run_id=RUN_ID,
                             shm=shm, sharded=True)
    memory.ring = ring.Ring(memory, timeout_s=20)  # a failure is a timeout

    def save_and_copy(step: int, damage: bool = False) -> None:
        memory.save(_ring_snapshot(step, rank), step=step, epoch=0)
        newest = memory.buffers[memory.newest_index]
        if damage:  # changed after its checksum was taken: as a flaky link would
            newest.array[buffer.HEADER_BYTES + 200] ^= 0xFF
        memory.ring._exchange(newest, memory.sequence)

    def held_steps() -> list[int]:
        copies = ring.load_held(memory, warnings.append)
        for copy in copies:
            copy.close()
        return [c.step for c in copies]

    for step in (1, 2, 3):
        save_and_copy(step)
    assert held_steps() == [3, 2]
    # Rank 1's copy arrives damaged at rank 0: refused there; rank 1 goes on (rank 0
    # acknowledges it as none, so nobody waits for its timeout).
    if rank == 0:
        with pytest.raises(RuntimeError, match="^the copy of rank 1's memory snapshot of "
                                               "step 4 arrived damaged"):
            save_and_copy(4)
        assert held_steps() == [3]  # step 2's buffer went for step 4's, never committed
    else:
        save_and_copy(4, damage=True)
        assert held_steps() == [4, 3]
    copies = ring.load_held(memory, warnings.append)
    choice = resume.agree(memory, [], copies)  # its own snapshots "are gone"
    # Step 4: rank 0 holds no whole copy of rank 1's; step 3: each its successor's copy.
    assert (choice.step, choice.holders, choice.peers) == (3, [], {0: 1, 1: 0})
    assert_same_snapshot(ring.fetch(memory, choice, [], copies),
                         _ring_snapshot(3, rank))
    assert memory.sequence >= copies[0].slot.sequence
    assert warnings == []
    for copy in copies:
        copy.close()
    memory.remove()
    assert not any(p.exists() for p in memory.ring.paths)
    from engine import health

    health.release()
    dist.destroy_process_group()


def test_a_rank_lost_with_one_keeper_of_its_row_resumes_exactly_with_all_keepers_disk(
        shm, tmp_path):
    """4 real gloo processes (forked), each rank's row kept by the next two: each
    buffer's exchange region holds 3 rows (its own and its two predecessors'), whatever
    the number of processes, as the tier's accounting says. A restart in place agrees
    on step 2 with one all-reduce, nothing gathered (every rank holds the same steps).
    Then rank 1 and rank 2 (one of rank 1's keepers) lost in one failure (their buffers
    gone): 4 new processes gather who holds what and resume step 2 from memory, rank 1's
    row from rank 3, rank 2's from rank 0, each
    rank with its own RNG states and the loss sums over the ranks, as saved. Rank 3
    lost too (rank 1's last keeper): the ranks agree on none, and the line the run
    prints before it takes its disk snapshot says why."""
    import json
    def everyone(phase: str) -> list[dict]:
        forked_ranks(4, _keeper_rank, phase, shm=shm, tmp_path=tmp_path)
        return [json.loads((tmp_path / f"{phase}-{r}.json").read_text()) for r in range(4)]

    saved = everyone("save")
    row = rows.ROW_BYTES
    for rank, one in enumerate(saved):
        assert one["bytes"] == {"sent": 2 * row, "received": 2 * row,
                                "kept": buffer.EXCHANGE_HEAD + 3 * row}
        assert one["owners"] == [rank, (rank - 1) % 4, (rank - 2) % 4]
    in_place = everyone("restart")
    assert {(r["step"], r["source"], r["not_used"], r["gathered"]) for r in in_place} == {
        (2, 0, None, 0)}
    assert [(r["keepers"], r["rng"], r["loss"]["sum"]) for r in in_place] == [
        ({}, before["rng"], 14.0) for before in saved]
    for rank in (1, 2):  # a rank and one of its row's keepers, in one failure
        for path in files.buffer_paths(tmp_path, rank, shm, RUN_ID):
            path.unlink()
    resumed = everyone("resume")
    assert {(r["step"], r["source"], r["not_used"], r["gathered"]) for r in resumed} == {
        (2, 0, None, 1)}
    assert all(r["keepers"] == {"1": 3, "2": 0} for r in resumed)
    for one, before in zip(resumed, saved, strict=True):
        assert one["rng"] == before["rng"]  # its own RNG states, never another's
        assert one["loss"] == {"sum": 14.0, "batches": 4.0, "micro_batch": 1}
        assert one["model"]
    for path in files.buffer_paths(tmp_path, 3, shm, RUN_ID):  # its last keeper
        path.unlink()
    lost = everyone("lost")
    assert {(r["step"], r["not_used"]) for r in lost} == {(-1, (
        "the memory snapshot of step 2 is not used: rank(s) 1 had no copy, and no rank "
        "that holds it kept their RNG states and loss sums (never restored from another "
        "rank's)"))}


def _rng_digest(rng: dict) -> str:
    import hashlib

    return hashlib.sha256(repr((rng["python"], rng["torch"].tolist(),
                                rng["numpy"]["keys"].tolist())).encode()).hexdigest()


def _keeper_rank(phase: str, rank: int, shm, tmp_path) -> None:
    """One of 4 ranks: "save" two snapshots (a loss sum of step + rank each, the RNG
    states seeded by rank), else resume from what the buffers hold."""
    import faulthandler
    import json

    import torch.distributed as dist

    # Forked from a pytest worker whose earlier tests may have started OpenMP threads,
    # which the child does not have: a parallel op would wait for them forever.
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang: its stack, not a stray
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / phase), 4),
                            rank=rank, world_size=4)
    memory = MemorySnapshots(tmp_path, world(rank, 4), every_steps=1, run_id=RUN_ID,
                             shm=shm)
    assert memory.check() is None
    if phase == "save":
        for step in (1, 2):
            torch.manual_seed(10 * step + rank)
            row = rows.make_row((float(step + rank), 1.0))
            memory.exchanges.start(row)
            memory.save({**a_snapshot(step), "world_size": 4, "rng": {
                "world_size": 4, "rank": rank, "row": row}, "progress": {
                "epoch": 1, "step": step, "epoch_loss": {
                    "sum": 0.0, "batches": 0.0, "micro_batch": 1}}}, step=step, epoch=0)
            memory.record_exchange(saved=True)
        memory.finish()
        slot = memory.newest()
        out = {"bytes": memory.exchanges.bytes(), "owners": list(rows.owners(slot.rows)),
               "rng": _rng_digest(rows.read_row(row)["rng"])}
        slot.close()
    else:
        mine = resume.load_all(memory, pytest.fail)
        gathered, gather = [], resume.distributed.all_gather_object  # this process's
        resume.distributed.all_gather_object = lambda obj: gathered.append(1) or gather(obj)
        choice = resume.agree(memory, mine)
        out = {"step": choice.step, "source": choice.source, "keepers": choice.keepers,
               "not_used": choice.not_used(None), "gathered": len(gathered)}
        if choice.step >= 0:
            whole = resume.fetch(memory, choice, mine)
            out.update(rng=_rng_digest(whole["rng"]["ranks"][rank]),
                       loss=whole["progress"]["epoch_loss"], model=torch.equal(
                           whole["model"]["w"], a_snapshot(choice.step)["model"]["w"]))
        for one in mine:
            one.close()
    memory.close()
    (tmp_path / f"{phase}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_the_folder_and_buffers_are_this_users_alone(shm, tmp_path):
    memory = memory_of(tmp_path, shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    memory.save(a_snapshot(2), step=2, epoch=0)
    assert stat.S_IMODE(os.lstat(memory.folder).st_mode) == 0o700
    assert {stat.S_IMODE(os.lstat(p).st_mode) for p in memory.paths} == {0o600}


def test_the_newest_of_the_two_buffers_wins_and_a_damaged_one_is_never_used(shm, tmp_path):
    memory = memory_of(tmp_path, shm)
    for step in (1, 2):
        memory.save(a_snapshot(step), step=step, epoch=0)
    newest = buffer.newest(memory.paths, RUN_ID)
    assert newest.step == 2
    # One flipped bit in the newest payload: its checksum fails, the older one is taken.
    flip(newest.path, buffer.HEADER_BYTES + newest.length - 1)
    assert buffer.newest(memory.paths, RUN_ID).step == 1
    # A truncated one (a half-written file) neither.
    os.truncate(memory.paths[0] if newest.path == memory.paths[1] else memory.paths[1], 100)
    assert buffer.newest(memory.paths, RUN_ID) is None


def flip(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))


def test_the_header_is_under_the_checksum(shm, tmp_path):
    """A header whose step was changed (a forged "step 999999") fails the checksum as a
    changed payload does; so does one whose run id was changed."""
    memory = memory_of(tmp_path, shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    path = memory.paths[0]
    with open(path, "r+b") as f:
        f.seek(16)  # the step, right after magic and sequence
        f.write(struct.pack("<Q", 999999))
    assert buffer.check_slot(path)[0] is None
    memory.save(a_snapshot(2), step=2, epoch=0)  # into buffer b
    flip(memory.paths[1], 64)  # the run id's first byte
    assert buffer.check_slot(memory.paths[1])[0] is None


def test_another_runs_buffers_never_match(shm, tmp_path):
    """Buffers are found by the run's id (kept in its folder): another run's, or those
    of the run that a fresh start replaced, are not this run's even at the same path."""
    mine = memory_of(tmp_path, shm)
    mine.save(a_snapshot(1), step=1, epoch=0)
    other = "f" * 32
    assert buffer.newest(mine.paths, other) is None
    # The same names copied in under another run's id: still refused by the header.
    theirs = files.buffer_paths(tmp_path, 0, shm, other)
    shutil.copyfile(mine.paths[0], theirs[0])
    os.chmod(theirs[0], 0o600)
    assert buffer.newest(theirs, other) is None
    assert buffer.newest(theirs, RUN_ID).step == 1  # it is the other run's


def test_the_run_id_lives_in_the_run_folder_and_a_fresh_start_replaces_it(tmp_path):
    old, first = files.claim_run_id(tmp_path, fresh=False)
    assert old is None and files.run_id_of(tmp_path) == first
    assert files.claim_run_id(tmp_path, fresh=False) == (first, first)
    old, second = files.claim_run_id(tmp_path, fresh=True)  # --no-resume
    assert old == first and second != first
    assert files.run_id_of(tmp_path) == second


def test_a_copied_run_folder_gets_an_id_of_its_own_and_a_renamed_one_keeps_its_own(tmp_path):
    """cp -a of a run folder copies its id: the copy would share the original's buffers
    (one of the two resuming from the other's, or overwriting them). The id records its
    folder's inode: a copy's is not its own, and it claims a new one (``old`` None: the
    original's buffers are not the copy's to forget); a renamed folder keeps its id."""
    run = tmp_path / "run"
    run.mkdir()
    _, first = files.claim_run_id(run, fresh=False)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    assert files.copied(copy) and not files.copied(run) and files.run_id_of(copy) is None
    old, second = files.claim_run_id(copy, fresh=False)
    assert old is None and second != first
    assert (files.run_id_of(run), files.run_id_of(copy)) == (first, second)
    run.rename(tmp_path / "moved")
    assert files.run_id_of(tmp_path / "moved") == first


@pytest.mark.parametrize("planted", ["other user's file", "symlink", "directory"])
def test_a_name_taken_by_anything_but_our_own_file_is_refused_untouched(
        shm, tmp_path, planted):
    """Another user's file (mode 0666: it would receive the weights), a symbolic link
    (its target would be overwritten) or a directory at a buffer's name: Unsafe, and the
    planted object is left exactly as it was."""
    memory = memory_of(tmp_path, shm)
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 100)
    path = memory.paths[0]
    if planted == "symlink":
        path.symlink_to(target)
    elif planted == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"")
        os.chown(path, 12345, 12345)  # the suite runs as root (docs/development.md)
        os.chmod(path, 0o666)
    before = os.lstat(path)
    with pytest.raises(files.Unsafe, match=str(path)):
        memory.save(a_snapshot(1), step=1, epoch=0)
    after = os.lstat(path)
    assert (after.st_mode, after.st_uid, after.st_size, after.st_ino) == (
        before.st_mode, before.st_uid, before.st_size, before.st_ino)
    assert target.read_bytes() == b"x" * 100
    assert buffer.check_slot(path)[0] is None


@pytest.mark.parametrize("planted", ["another user's folder", "symlink", "open folder",
                                     "file"])
def test_a_user_folder_that_is_not_ours_is_left_for_a_private_one(shm, tmp_path, planted):
    """Anything at this user's folder name but its own closed folder: left as it is; the
    buffers go into a private folder of random name (0700), recorded in the run folder,
    which a restart finds. Only where no private folder can be had is the tier off."""
    folder = files.user_folder(shm)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if planted == "symlink":
        folder.symlink_to(elsewhere)
    elif planted == "file":
        folder.write_text("")
    else:
        folder.mkdir(mode=0o700)
        if planted == "open folder":
            os.chmod(folder, 0o777)
        else:
            os.chown(folder, 12345, 12345)
    before = os.lstat(folder)
    memory = memory_of(tmp_path, shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    private = memory.paths[0].parent
    assert private.parent == shm and private.name.startswith(f"{folder.name}-")
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
    assert memory_of(tmp_path, shm).newest().step == 1  # a restart finds it
    assert files.buffer_paths(tmp_path, 0, shm, RUN_ID) == memory.paths
    after = os.lstat(folder)
    assert (after.st_mode, after.st_uid, after.st_ino) == (
        before.st_mode, before.st_uid, before.st_ino)
    assert list(elsewhere.iterdir()) == []
    memory.remove()
    assert not private.exists()
    unrecorded = tmp_path / "unrecorded"  # nowhere to record a private folder: off
    (unrecorded / files.FOLDER_FILE).mkdir(parents=True)
    memory = MemorySnapshots(unrecorded, world(), every_steps=1, run_id=RUN_ID, shm=shm)
    problem = memory.check()
    assert problem is not None and str(folder) in problem, problem


def test_a_folder_name_another_user_took_first_leaves_the_tier_on(shm, tmp_path):
    """Another local user (a real process of another uid) makes this user's folder
    name first in a shared tmpfs (mode 1777, as /dev/shm): two local ranks still save,
    into one private folder, and a restarted rank resumes from its snapshot."""
    os.chmod(shm, 0o1777)
    folder = files.user_folder(shm)
    subprocess.run(["mkdir", "-m", "700", str(folder)], user=12345, group=12345,
                   check=True)
    ranks = [MemorySnapshots(tmp_path, world(r, 2), every_steps=1, run_id=RUN_ID,
                             shm=shm) for r in (0, 1)]
    assert [m.check() for m in ranks] == [None, None]
    for step, memory in enumerate(ranks, 1):
        memory.save(a_snapshot(step), step=step, epoch=0)
        memory.close()
    assert ranks[0].folder == ranks[1].folder != folder
    restarted = MemorySnapshots(tmp_path, world(1, 2), every_steps=1, run_id=RUN_ID,
                                shm=shm)
    assert restarted.check() is None and restarted.newest().step == 2
    assert os.lstat(folder).st_uid == 12345 and list(folder.iterdir()) == []


def test_a_larger_state_grows_the_buffer_and_the_previous_snapshot_stays(shm, tmp_path):
    memory = memory_of(tmp_path, shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    big = {**a_snapshot(2), "extra": torch.randn(300_000)}
    memory.save(big, step=2, epoch=0)
    assert_same_snapshot(buffer.load_slot(
        buffer.newest(memory.paths, RUN_ID)), big)
    # A fresh reader (a restarted worker) finds the same.
    again = memory_of(tmp_path, shm)
    assert again.newest().step == 2


def test_a_full_tmpfs_after_the_first_snapshot_is_no_room_and_the_snapshot_stays(tmp_path):
    """Both buffers are reserved at the first save; a state that grows past them when
    the tmpfs has filled up meanwhile raises NoRoom (never a SIGBUS), and the newest
    snapshot stays whole."""
    with small_disk(tmp_path / "tiny", "2m") as tiny:
        memory = memory_of(tmp_path, tiny)
        memory.save(a_snapshot(1), step=1, epoch=0)
        memory.save(a_snapshot(2), step=2, epoch=0)  # no new pages: both were reserved
        (tiny / "filler").write_bytes(b"\0" * (2**21 - 2 * 4096 - os.path.getsize(
            memory.paths[0]) * 2))
        with pytest.raises(files.NoRoom, match="No space left"):
            memory.save({**a_snapshot(3), "extra": torch.randn(300_000)}, step=3, epoch=0)
        assert memory.newest().step == 2
        memory.close()


def test_only_leftovers_of_gone_writers_on_this_host_are_removed(shm, tmp_path):
    """At a start: buffers of a deleted run folder, or of this folder under an older id,
    go when no process writes them; a live writer's, another host's (a container
    sharing the tmpfs), and an existing folder's run (its rerun resumes from them)
    stay."""
    here, kept, gone, live, foreign = (tmp_path / n for n in
                                       ("here", "kept", "gone", "live", "foreign"))
    ids = {}
    for n, folder in enumerate((here, kept, gone, live, foreign)):
        folder.mkdir()
        ids[folder] = f"{n:032x}"
        memory = memory_of(folder, shm, run_id=ids[folder])
        if folder is foreign:
            memory.info["host"] = "another-container"
        memory.save(a_snapshot(1), step=1, epoch=0)
        memory.save(a_snapshot(2), step=2, epoch=0)
        # fsdp: the buffers that hold the predecessor's copies follow the same rules.
        held = buffer.Buffer(ring.held_paths(folder, 0, shm, ids[folder])[0])
        held.map(4096, memory.info, bytes.fromhex(ids[folder]))
        if folder is live:
            writer = memory  # its descriptors stay open: the writer lives
            held_writer = held
        else:
            memory.close()
            held.close()
    gone.rmdir()
    live.rmdir()
    foreign.rmdir()
    new_id = "e" * 32  # a fresh start over "here": its old id's buffers are stale
    removed, problems = tier.remove_leftovers(here, new_id, shm)
    assert problems == []
    def buffers(folder):
        return [*files.buffer_paths(folder, 0, shm, ids[folder]),
                ring.held_paths(folder, 0, shm, ids[folder])[0]]

    assert sorted(removed) == sorted(buffers(here) + buffers(gone))
    for folder in (kept, live, foreign):
        assert all(p.exists() for p in buffers(folder))
    writer.close()  # the writer is gone now: its buffers are leftovers
    held_writer.close()
    removed, _ = tier.remove_leftovers(here, new_id, shm)
    assert sorted(removed) == sorted(buffers(live))
    # --no-resume / --resume PATH: every rank's buffers of the run go, whatever folder
    for rank in (0, 1):
        memory = memory_of(kept, shm, rank, ids[kept])
        memory.save(a_snapshot(1), step=1, epoch=0)
        memory.close()
    tier.remove_leftovers(kept, ids[kept], shm, forget=ids[kept])
    assert files.run_buffers(ids[kept], shm) == []


IN_ANOTHER_NAMESPACE = """
import pathlib, sys, torch
from engine.memory.pair import MemorySnapshots
from engine.world import World
shm, run_dir, run_id = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
memory = MemorySnapshots(run_dir, World(rank=0, local_rank=0, world_size=1,
                                        local_world_size=1), 1, run_id=run_id, shm=shm)
assert memory.check() is None
memory.save({"config": {}, "step": 1, "model": {"w": torch.ones(3)}}, step=1, epoch=0)
memory.close()
"""


def test_a_start_leaves_the_buffers_of_another_mount_namespace(shm, tmp_path):
    """Two containers sharing the tmpfs and the host name (--ipc=host --net=host), each
    with its own run at the same path: a run started in one (a real process in a
    second mount namespace, unshare -m, over a tmpfs of its own at that path) leaves
    buffers whose writer is gone. This namespace's start at that path removes its own
    older id's leftovers and leaves the other namespace's, which its rerun resumes."""
    here = tmp_path / "run"
    here.mkdir()
    old, mine, theirs = "c" * 32, "a" * 32, "b" * 32
    stale = memory_of(here, shm, run_id=old)
    stale.save(a_snapshot(1), step=1, epoch=0)
    stale.close()
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount -t tmpfs none "$3" && exec "$0" -c "$@"', sys.executable,
                    IN_ANOTHER_NAMESPACE, str(shm), str(here), theirs],
                   check=True, timeout=120)
    other = files.run_buffers(theirs, shm)
    assert len(other) == 2 and buffer.read_info(other[0])["run_dir"] == str(here)
    assert buffer.read_info(other[0])["mnt"] != files.mount_namespace()
    assert list(here.iterdir()) == []  # its run folder was the other namespace's alone
    removed, problems = tier.remove_leftovers(here, mine, shm)
    assert (sorted(removed), problems) == (sorted(stale.paths), [])
    assert files.run_buffers(theirs, shm) == other
    assert buffer.newest(other, theirs).step == 1


def test_a_buffer_that_does_not_load_is_a_warning_and_the_older_one_is_used(shm, tmp_path):
    """A skeleton with anything but plain values (code a pickle could run), or a
    snapshot without its config, passes the checksum but is refused when loading: one
    warning each, and the next buffer (or none: the disk tier) instead of a traceback."""
    memory = memory_of(tmp_path, shm)
    memory.save(a_snapshot(1), step=1, epoch=0)
    memory.save({**a_snapshot(2), "path": pathlib.PurePosixPath("x")}, step=2, epoch=0)
    with pytest.raises(Exception, match="not allowed in a memory snapshot"):
        buffer.load_slot(memory.newest())
    warnings = []
    loaded = load_newest(memory, warnings.append)
    assert loaded.slot.step == 1 and loaded.state["step"] == 1
    loaded.close()
    assert len(warnings) == 1 and "not allowed in a memory snapshot" in warnings[0]
    forged = {k: v for k, v in a_snapshot(3).items() if k != "config"}
    # Into the refused buffer: the next save never overwrites the one that loaded.
    memory.save(forged, step=3, epoch=0)
    warnings.clear()
    loaded = load_newest(memory, warnings.append)
    assert loaded.slot.step == 1
    loaded.close()
    assert len(warnings) == 1 and "holds no config" in warnings[0], warnings


KILLER = """
import os, pathlib, random, signal, sys, time
import torch
from engine.memory import buffer
from engine.memory.files import buffer_paths
from engine.memory.pair import MemorySnapshots
from engine.world import World
torch.set_num_threads(1)  # no thread pool for the forked savers to inherit half-made
shm, runs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rng = random.Random(0)
for attempt in range(int(sys.argv[3])):
    run = runs / str(attempt)
    ready, go = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the saver: 8 MB snapshots back to back, each value its step number
        memory = MemorySnapshots(run, World(rank=0, local_rank=0, world_size=1,
                                            local_world_size=1), every_steps=1,
                                 run_id=f"{attempt:032x}", shm=shm)
        step = 0
        while os.getppid() == parent:  # not beyond a test that died
            step += 1
            memory.save({"w": torch.full((2_000_000,), float(step)), "step": step},
                        step=step, epoch=0)
            if step == 2:
                os.write(go, b"x")
    os.read(ready, 1)
    time.sleep(rng.uniform(0.0, 0.2))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    slot = buffer.newest(buffer_paths(run, 0, shm, f"{attempt:032x}"))
    loaded = buffer.load_slot(slot)
    whole = loaded["step"] == slot.step and torch.equal(
        loaded["w"], torch.full((2_000_000,), float(slot.step)))
    print(slot.step, whole, flush=True)
"""


def test_a_process_killed_during_its_copies_leaves_one_whole_snapshot(shm, tmp_path):
    """SIGKILL at random moments of processes that save 8 MB snapshots back to back
    (most of their time is in the copy): the newest valid buffer is always one whole
    snapshot, all its values its own step's."""
    proc = subprocess.run([sys.executable, "-c", KILLER, str(shm), str(tmp_path), "8"],
                          capture_output=True, text=True, timeout=120)
    results = [line.split() for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(results) == 8, proc.stderr
    assert all(whole == "True" and int(step) >= 2 for step, whole in results), results


# ------------------------------------------------------------ the step's path (issue 37)


def test_the_ranks_choose_the_newest_step_each_rank_can_restore():
    """A rank without a copy of a step needs a holder, and a holder that keeps its row
    (its RNG states and loss sums) of that step; else an older step, or none (held:
    (step, the ranks whose rows came whole with it) per snapshot)."""
    choose = resume.choose
    # Every rank holds step 7: its rows are not needed.
    assert choose([[(7, ()), (6, (0, 1))], [(7, ()), (6, (1, 0))]], 7) == \
        resume.MemoryChoice(7, [0, 1], 7, source=0)
    # Rank 1's buffers are gone: rank 0 sends step 7 when it has rank 1's row of step 7...
    assert choose([[(7, (0, 1)), (6, (0, 1))], []], 8) == \
        resume.MemoryChoice(7, [0], 8, source=0, keepers={1: 0})
    # ...else step 6, whose rows it has (a kill before step 7's exchange came).
    choice = choose([[(7, (0,)), (6, (0, 1))], []], 8)
    assert (choice.step, choice.source, choice.missing(2)) == (6, 0, [1])
    # Rank 1 killed during step 7's copy: step 6, which both hold.
    assert choose([[(7, (0,)), (6, (0, 1))], [(6, (1, 0))]], 7).holders == [0, 1]
    assert choose([[(7, (0,))], []], 7).step == -1  # nothing rank 1 could restore
    assert choose([[], []], 0).step == -1
    # 4 ranks, each row kept by the next two: ranks 1 and 2 lost, rank 1's row comes
    # from rank 3 (its other keeper), rank 2's from rank 0, the state from rank 0.
    kept = [(7, (r, (r - 1) % 4, (r - 2) % 4)) for r in range(4)]
    choice = choose([[kept[0]], [], [], [kept[3]]], 7)
    assert (choice.step, choice.source, choice.keepers) == (7, 0, {1: 3, 2: 0})
    # Rank 3 lost too: nobody keeps rank 1's row of step 7, and a rank is never
    # restored with another rank's: none (the disk snapshot).
    assert choose([[kept[0]], [], [], []], 7).step == -1
    assert resume.row_keepers([[kept[0]], [], [], []], 7) == {1: None, 2: 0, 3: 0}
    # Saved by another number of processes: no rows needed (RNG states not restored).
    assert choose([[(7, None)], [], []], 7) == resume.MemoryChoice(7, [0], 7, source=0)


def test_each_rank_s_row_is_kept_by_a_bounded_number_of_peers_a_node_apart():
    """rows.offsets: rank r's row goes to r + o for each offset, at most rows.KEEPERS
    of them, a node's ranks apart where there are several nodes; the bytes a rank
    sends and keeps per snapshot stop growing with the number of processes."""
    from engine.memory.background import Exchanges

    def offsets(size: int, local: int) -> list[int]:
        return rows.offsets(World(rank=0, local_rank=0, world_size=size,
                                  local_world_size=local))

    assert rows.KEEPERS == 2
    assert offsets(1, 1) == [] and offsets(2, 2) == [1] and offsets(4, 4) == [1, 2]
    assert offsets(4, 2) == [2] and offsets(16, 4) == [4, 8]  # other nodes only
    assert offsets(16384, 8) == [8, 16]
    exchanged = {size: Exchanges(World(rank=size - 1, local_rank=size - 1,
                                       world_size=size, local_world_size=size),
                                 None).bytes() for size in (2, 3, 4, 1024, 16384)}
    assert exchanged[2] == {"sent": rows.ROW_BYTES, "received": rows.ROW_BYTES,
                            "kept": buffer.EXCHANGE_HEAD + 2 * rows.ROW_BYTES}
    assert exchanged[3] == exchanged[4] == exchanged[1024] == exchanged[16384] == {
        "sent": 2 * rows.ROW_BYTES, "received": 2 * rows.ROW_BYTES,
        "kept": buffer.EXCHANGE_HEAD + 3 * rows.ROW_BYTES}
    fsdp = Exchanges(world(0, 4), None, sharded=True).bytes()  # its ring holds its row
    assert fsdp == {"sent": 0, "received": 0, "kept": buffer.EXCHANGE_HEAD + rows.ROW_BYTES}


def test_under_fsdp_a_rank_without_its_snapshot_takes_its_successors_copy_or_disk():
    """fsdp (engine/memory/ring.py): rank r's shards are in its own buffers and in the
    copy rank (r + 1) % W holds; a step counts where every rank has one of the two, and
    the choice names who sends what. Neither (a copy not yet arrived, or both nodes'
    memory lost): an older step, or none, and rank 0's line names the ranks (disk)."""
    choose, lacking = resume.choose_sharded, resume.lacking_sharded
    # Every rank holds its own step 7: no transfer.
    choice = choose([[7, 6], [7, 6], [7, 6]], [[7, 6], [7, 6], [7, 6]], 7)
    assert (choice.step, choice.holders, choice.peers) == (7, [0, 1, 2], {})
    # Rank 1's memory is gone (its own and its copy of rank 0's): rank 2 sends its copy.
    choice = choose([[7, 6], [], [7, 6]], [[7, 6], [], [7, 6]], 8)
    assert (choice.step, choice.peers, choice.source, choice.missing(3)) == \
        (7, {1: 2}, 2, [1])
    # Rank 0 lost too, whose copy rank 1 held: step 6 where rank 0's own is older...
    assert choose([[6], [], [7, 6]], [[7, 6], [], [7, 6]], 8).step == 6
    # ...none where its only copy was in rank 1's memory: the disk snapshot.
    choice = choose([[], [], [7, 6]], [[7, 6], [], [7, 6]], 8)
    assert choice.step == -1 and not choice.peers
    assert lacking([[], [], [7, 6]], [[7, 6], [], [7, 6]], 7) == [0]  # 1: rank 2 has it
    # Rank 1's step-7 copy had not reached rank 0 when rank 1's memory went: step 6.
    choice = choose([[7, 6], []], [[6, 5], [7, 6]], 7)
    assert (choice.step, choice.peers) == (6, {1: 0})
    # Two processes, both lost: nothing (a single process never has copies).
    assert choose([[], []], [[], []], 7).step == -1
    assert choose([[3, 2]], [[]], 3).step == 3


def test_a_row_gives_back_this_ranks_rng_states_and_loss_sums():
    """The row a peer keeps (raw bytes, numpy's state read only when it may have moved)
    restores what engine.rng.rng_state would have: after normal deviates cached
    and drawn (a draw that leaves numpy's generator where it was), a reseed, a
    set_state."""
    import numpy as np

    from engine import rng

    def same_as_now(loss=None) -> bool:
        row = rows.read_row(rows.make_row(loss))
        now, kept = rng.rng_state(), row["rng"]
        return (row["loss"] == loss and now["python"] == kept["python"]
                and torch.equal(now["torch"], kept["torch"])
                and torch.equal(now["numpy"]["keys"], kept["numpy"]["keys"])
                and all(now["numpy"][k] == kept["numpy"][k]
                        for k in ("pos", "has_gauss", "gauss")))

    saved = rng.rng_state()
    try:
        checks = [same_as_now((1.5, 4.0))]
        for move in (np.random.randn, np.random.randn, lambda: np.random.seed(3),
                     np.random.rand, np.random.randn):
            move()
            checks.append(same_as_now())
        state = np.random.get_state()
        np.random.randn()
        np.random.set_state(state)
        checks.append(same_as_now())
        assert all(checks), checks
    finally:
        rng.set_rng_state(saved)


def test_a_background_copy_ends_before_the_optimizer_step_and_holds_its_row(
        shm, tmp_path, monkeypatch):
    """What only the optimizer's step changes is copied by the background thread; the
    optimizer's next step waits for it, so the snapshot holds the weights before that
    step. Once done, the buffer holds the snapshot and, in its exchange region, this
    rank's row, from which a rank restores its RNG states."""
    import threading

    # A small model's copy is done at once; this one's goes to the thread as a large one's.
    monkeypatch.setattr(copy_plan, "BACKGROUND_BYTES", 0)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory = memory_of(tmp_path, shm)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1,
             "config": {}, "rng": {"world_size": 1, "rank": 0,
                                   "row": rows.make_row(None)}}
    row = state["rng"]["row"]
    go = threading.Event()
    memory.exchanges.start(row)
    memory.background.submit(lambda: go.wait(60))  # the thread busy: the copy waits
    assert memory.save(state, step=1, epoch=0, held=copy_plan.held_by(optimizer))
    memory.record_exchange(saved=True)
    memory.hold(optimizer)
    assert memory.newest() is None  # not valid until the copy is done
    waited_before, _, waits_before = phases.carved(phases.MEMORY_WAITS)
    # When the step's wait starts and ends (an event, not a guess at the scheduler).
    waiting, span, wait = threading.Event(), [], memory.background.wait

    def timed_wait(*args):
        span.append(time.monotonic())
        waiting.set()
        try:
            return wait(*args)
        finally:
            span.append(time.monotonic())

    memory.background.wait = timed_wait  # this object's only
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    assert waiting.wait(60), "the optimizer's step never waited for the copy"
    stepper.join(timeout=0.2)  # it waits for the copy, which waits for go
    assert stepper.is_alive(), "the optimizer stepped while the copy was in flight"
    go.set()
    stepper.join(timeout=60)
    assert not stepper.is_alive()
    del memory.background.wait  # the rest waits untimed
    # The whole wait is the snapshot's cost (memory_every_steps=auto counts it).
    waited, _, waits = phases.carved(phases.MEMORY_WAITS)
    assert waits == waits_before + 1 and waited - waited_before >= span[1] - span[0] > 0
    memory.note_reached(2)  # after the step: the hook goes
    assert memory.hook is None and not optimizer._optimizer_step_pre_hooks
    memory.finish()
    loaded = load_newest(memory, pytest.fail)
    assert all(torch.equal(loaded.state["model"][k], before[k]) for k in before)
    assert not torch.equal(model.weight, before["weight"])  # the step did happen
    assert rows.row_in(loaded.slot.rows, 0) == row
    whole = resume.complete(loaded.state, 0, 1, None)
    assert torch.equal(whole["rng"]["ranks"][0]["torch"],
                       rows.read_row(row)["rng"]["torch"])
    loaded.close()
    thread = memory.background.thread
    memory.close()
    thread.join(timeout=60)  # close ends it: no thread left behind per closed pair
    assert not thread.is_alive() and memory.background.thread is None


def test_a_state_whose_tensors_change_is_planned_again_and_saved_whole(shm, tmp_path):
    """The copies planned at one save serve the next ones while the state holds the
    same tensors (their new values saved); a tensor replaced (a buffer reassigned), a
    view of other strides, one more or one fewer, and a skeleton that outgrew its room
    are planned again: every snapshot loads as it was saved."""
    memory = memory_of(tmp_path, shm)

    def saved_whole(state: dict, step: int) -> bool:
        memory.save({**state, "step": step}, step=step, epoch=0)
        slot = buffer.newest(memory.paths, RUN_ID)
        assert_same_snapshot(buffer.load_slot(slot), {**state, "step": step})
        slot.close()
        return True

    w, b = torch.randn(7, 5), torch.zeros(3)
    assert saved_whole({"w": w, "b": b}, 1)
    first = memory.plan
    w.add_(1.0)  # in place, as an optimizer step: the same plan, the new values
    assert saved_whole({"w": w, "b": b}, 2) and memory.plan is first
    b = b + 1  # reassigned, as a module may do with a buffer
    assert saved_whole({"w": w, "b": b}, 3) and memory.plan is not first
    assert saved_whole({"w": w.t(), "b": b}, 4)  # the same memory, other strides
    assert saved_whole({"w": w, "b": b, "more": torch.ones(2, dtype=torch.float64)}, 5)
    assert saved_whole({"w": w}, 6)
    assert saved_whole({"w": w, "log": "x" * 100_000}, 7)  # the data region moves on


def test_a_forked_child_has_no_background_thread_to_wait_for(shm, tmp_path):
    """A child forked while the background thread is busy (a DataLoader worker forked
    during a snapshot's copy) inherits neither the thread nor its queue, lock and
    events: its own wait returns at once, where it would wait for a thread it lacks."""
    import threading

    memory = memory_of(tmp_path, shm)
    go = threading.Event()
    memory.background.submit(lambda: go.wait(60))
    memory.background.copied.clear()  # as while a snapshot's copy is in flight
    memory.background.TIMEOUT_S = 5.0  # a child that waits fails, not hangs
    pid = os.fork()
    if pid == 0:  # the child: everything here ends in os._exit
        try:
            background = memory.background
            background.wait()
            background.wait(background.copied)
            fine = background.thread is None and background.pending == 0
        except BaseException:
            fine = False
        os._exit(0 if fine else 1)
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        go.set()
        memory.background.copied.set()
    assert os.waitstatus_to_exitcode(status) == 0
    memory.close()


def test_a_run_that_fails_closes_its_memory_snapshots_and_keeps_their_files(
        make_engine, shm):
    """A run that ends by an exception (in-process: a notebook's, a test's) leaves no
    background thread and no mapping behind; the buffers' files stay for its rerun."""
    import engine as engine_pkg

    class FailAtStep3:
        @engine_pkg.hookimpl
        def engine_train_step_end(self, engine, step, loss):
            if step == 3:
                raise RuntimeError("failed at step 3")

    threads = torch.get_num_threads()  # the run sets its own
    eng = make_engine("checkpoint.memory_every_steps=1", f"checkpoint.memory_dir={shm}",
                      plugins=[FailAtStep3(), "no:console"])
    try:
        with pytest.raises(Exception, match="failed at step 3"):
            eng.run()
    finally:
        torch.set_num_threads(threads)
    memory = eng.snapshots.memory.pair  # the tier the snapshot layer opened
    assert memory is not None and memory.saves == 2  # steps 1 and 2
    assert memory.background.thread is None and memory.plan is None
    assert all(b.fd is None and b.mapping is None for b in memory.buffers)
    assert buffer.newest(memory.paths, memory.run_id).step == 2
