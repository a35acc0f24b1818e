"""engine/testing/contract.py: the checkpointer contract, run as an author runs it,
catches a careless store; the state part contract holds for every built-in part."""

from __future__ import annotations

import textwrap

from tests.engine.testing.test_testing import run_pytest


CARELESS_STORE = textwrap.dedent('''
    import torch

    from engine.checkpoint import SnapshotStore
    from engine.testing import CheckpointerContract


    class CarelessStore(SnapshotStore):
        """Writes in place, trusts every file and takes the newest one: what the
        contract is there to catch."""

        name = "careless"
        suffix = ".pt"

        def write(self, path, state):
            torch.save(state, path)
            return {"file": path.name}

        def read(self, path, *, map_location=None, template=None):
            return torch.load(path, map_location=map_location, weights_only=True)

        def problem(self, path, *, deep=True):
            return None

        def latest(self):
            return (self.snapshots() or [None])[-1]


    class TestCarelessStore(CheckpointerContract):
        checkpointer_class = CarelessStore
''')


def test_the_checkpointer_contract_catches_a_careless_store(tmp_path):
    """The contract run as an author runs it (a project of their own, no conftest):
    every check that a careless store fails, fails, and only those."""
    (tmp_path / "test_store.py").write_text(CARELESS_STORE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = run_pytest(tmp_path, "-rf")
    failed = sorted(line.split("::")[-1].split(" ")[0] for line in proc.stdout.splitlines()
                    if line.startswith("FAILED"))
    assert failed == [
        "test_a_write_killed_half_way_leaves_the_previous_snapshot_usable",
        "test_verify_reports_a_damaged_snapshot_and_latest_skips_it[flip]",
        "test_verify_reports_a_damaged_snapshot_and_latest_skips_it[truncate]"], proc.stdout
    assert "3 failed, 7 passed" in proc.stdout, proc.stdout


def test_the_state_part_contract_holds_for_every_built_in_part_and_catches_a_careless_one():
    """engine.testing.assert_state_part: each built-in part's memory-snapshot state
    (local_state_dict, or state_dict where it declares none) needs no process group and
    loads back to itself; a part whose local state gathers (a collective), or that does
    not load it back, fails the check."""
    import pytest
    import torch
    from torch import nn

    from engine.plugins.ema import ExponentialMovingAverage
    from engine.rng import RngStates
    from engine.stateful import Metrics, ModelState, OptimizerState, TrainState
    from engine.testing import assert_state_part
    from engine.world import World
    from tests.engine.memory.rank_part import RankPart

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1)
    for part in (ModelState(model), OptimizerState(model, optimizer), TrainState(step=3),
                 Metrics({"val/loss": 0.5}), RngStates(world, print), RankPart(rank=0),
                 ExponentialMovingAverage(model, optimizer, decay=0.9, every_steps=1)):
        assert_state_part(part)

    class Gathers(RankPart):
        local_state_dict = RankPart.state_dict  # a collective where none may be

    with pytest.raises((RuntimeError, ValueError), match="process group"):
        assert_state_part(Gathers(rank=0))

    class Forgets(RankPart):
        def load_state_dict(self, state):
            self.value = 0

    forgetful = Forgets(rank=0)
    forgetful.value = 5
    with pytest.raises(AssertionError, match="its state after a load"):
        assert_state_part(forgetful)
