"""engine/memory/tier.py, the memory tier's face: imported only when the tier is on, and
its snapshot a walk over the parts' local state (engine.stateful.LocalStateful) that a
part implementing only the declared protocol resumes from under fsdp."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, engine_env, run_cli


def test_importing_the_trainer_does_not_import_the_memory_tier():
    code = "import sys, engine.trainer; print(sorted(m for m in sys.modules if " \
           "m.startswith('engine.memory')))"
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_part_with_only_the_declared_protocol_resumes_from_memory_under_fsdp(tmp_path):
    """fsdp on 2 gloo processes, a memory snapshot every step, rank 1 SIGKILLed in step
    4's end: the rerun resumes both ranks from the step-3 memory snapshot, the part's
    own value on each rank (not rank 0's), and its gathering state_dict() was called
    only for the disk snapshot at the run's end, never for a memory snapshot."""
    out = tmp_path / "run"
    args = (str(REPO / "tests" / "recipes" / "tiny_elastic.py"), "-p", "tests.fault_plugin",
            "-p", "tests.engine.memory.rank_part", "--parallel", "fsdp", "--nproc", "2",
            "checkpoint.memory_every_steps=1", "checkpoint.every_steps=0", f"out_dir={out}")
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP="4",
                       ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    killed = run_cli(*args, env=fault)
    assert killed.returncode != 0 and (tmp_path / "once").exists(), killed.stderr
    resumed = run_cli(*args, env=fault, check=True)
    assert "resumed from memory at step 3" in resumed.stdout, resumed.stdout
    ranks = [json.loads((out / f"rank_part-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"value": 6, "gathers": 1}, {"value": 12, "gathers": 1}]


def test_the_ranks_agree_there_is_no_problem_without_gathering_every_ranks(tmp_path):
    """The tier's agreements (open, the first snapshot's room, a failed save): an
    all-reduce of a flag, the same size at any number of ranks; every rank's problem is
    gathered only where some rank has one, and the first such rank is named."""
    from tests.engine.memory.test_memory_snapshot import forked_ranks

    forked_ranks(3, _problem_rank, str(tmp_path / "store"))


def _problem_rank(store: str, rank: int) -> None:
    import torch.distributed as dist

    from engine import distributed

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=3)
    gathered, gather = [], distributed.all_gather_object  # this process's
    distributed.all_gather_object = lambda obj: gathered.append(obj) or gather(obj)
    assert (distributed.first_problem(None), gathered) == (None, [])
    why = "no room" if rank > 0 else None
    assert (distributed.first_problem(why), gathered) == ((1, "no room"), [why])
    dist.destroy_process_group()


def test_a_memory_snapshot_reads_no_tensor_back_and_its_row_holds_the_loss_sum(
        tmp_path, monkeypatch):
    """docs/architecture.md promises no per-step host-device synchronisation: a memory
    snapshot at every step of an in-process run turns no tensor into a Python value (on
    a GPU each would wait for the device; the first snapshot's agreement on the room,
    once per run, reads one flag), and the loss sum its row holds (which a resume
    sums over the ranks) is the Trainer's, to the bit."""
    import torch

    from engine import testing
    from engine.memory import rows, tier
    from engine.trainer import Trainer

    reads, inside, sums, checked = [], [False], [], []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        def counted(self, *args, _read=getattr(torch.Tensor, name), _name=name):
            if inside[0]:
                reads.append(_name)
            return _read(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    local_state_dict, save = Trainer.local_state_dict, tier.MemoryTier.save

    def kept(self):
        state = local_state_dict(self)
        sums.append(state["epoch_loss"] and state["epoch_loss"]["sum"])
        return state

    def watched(self, whole):
        inside[0] = bool(checked)  # the first agrees on the room, once: one flag read back
        try:
            problem = save(self, whole)
        finally:
            inside[0] = False
        self.pair.finish()  # the thread copied the row back from the device
        row = rows.read_row(rows.row_in([self.pair.exchanges.rows[0].numpy()], 0))
        checked.append(row["loss"][0] == torch.as_tensor(sums[-1]).item())
        return problem

    monkeypatch.setattr(Trainer, "local_state_dict", kept)
    monkeypatch.setattr(tier.MemoryTier, "save", watched)
    testing.fit(REPO / "tests" / "recipes" / "tiny_regression.py", nproc=1, epochs=1,
                out_dir=str(tmp_path / "run"), **{"checkpoint.memory_every_steps": 1,
                                                  "checkpoint.every_steps": 0})
    assert reads == []
    assert len(checked) >= 3 and all(checked), checked
