"""engine/stateful.py: a snapshot is the walk over the run's parts, and nothing outside
the Trainer reaches into it; the model's keys (DDP's and torch.compile's parts stripped,
loaded into any model) and its digest."""

from __future__ import annotations

import ast
import os

import pytest
import torch
from torch import nn

import engine

from engine.errors import CheckpointError, ConfigError
from engine.stateful import (SnapshotParts, add_module_prefix, load_model_state,
                             model_digest, plain_keys)
from tests import conftest
from tests.conftest import REPO, read_summary, run_cli

PARTS_RECIPE = str(REPO / "tests" / "recipes" / "tiny_parts.py")
# 64 samples, global batch 8: 8 steps an epoch; the kill after step 11 is mid-epoch 1,
# after the snapshot of step 10.
RUN = ("epochs=3", "checkpoint.every_steps=5", "checkpoint.keep_last=2", "ema.enabled=true",
       "ema.decay=0.8", "ema.every_steps=2")
KILL_STEP = 11


class Counter:
    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.count = state_dict["count"]


def test_the_walk_saves_and_restores_every_part_in_order():
    parts = SnapshotParts()
    parts.add("a", Counter(1))
    parts.add("b", Counter(2))
    assert parts.names() == ["a", "b"]
    snap = parts.state_dict()
    assert snap == {"a": {"count": 1}, "b": {"count": 2}}
    fresh = SnapshotParts()
    fresh.add("a", Counter())
    fresh.add("b", Counter())
    fresh.load_state_dict(snap, source="snap.pt", warn=pytest.fail)
    assert (fresh["a"].count, fresh["b"].count) == (1, 2)


def test_a_missing_or_an_unknown_part_is_a_warning_not_a_failure():
    parts = SnapshotParts()
    parts.current_owner = "plugin 'x'"
    parts.add("new", Counter(5))
    warnings = []
    parts.load_state_dict({"gone": {"count": 1}, "epoch": 3}, source="snap.pt",
                          warn=warnings.append)
    assert parts["new"].count == 5  # kept its initial state
    assert warnings == [
        "snap.pt holds no state for part 'new' (added by plugin 'x'): it starts from this "
        "run's initial state",
        "snap.pt holds state for part(s) gone that this run does not have (a plugin or "
        "recipe part no longer added?): left unused"]


@pytest.mark.parametrize("name, part, message", [
    ("step", Counter(), "the recipe adds a state part named 'step', which snapshots use for "
     "their header; choose another name"),
    ("my part", Counter(), "the recipe adds a state part named 'my part'; a part's name is "
     "a Python identifier, e.g. 'ema'"),
    ("thing", object(), "the recipe adds state part 'thing' as object, which has no "
     "state_dict() and load_state_dict(state_dict)"),
    ("taken", Counter(), "state part 'taken' is added twice: by plugin 'p' and by the "
     "recipe; each part needs its own name"),
])
def test_a_bad_part_is_one_line_naming_its_owner(name, part, message):
    parts = SnapshotParts()
    parts.current_owner = "plugin 'p'"
    parts.add("taken", Counter())
    parts.current_owner = "the recipe"
    with pytest.raises(ConfigError) as info:
        parts.add(name, part)
    assert str(info.value) == message


def test_a_part_that_does_not_load_names_the_snapshot_and_the_part():
    parts = SnapshotParts()
    parts.add("counter", Counter())
    with pytest.raises(CheckpointError) as info:
        parts.load_state_dict({"counter": {"other": 1}}, source="snap.pt", warn=print)
    assert str(info.value) == ("snap.pt: its 'counter' state does not load into this run's "
                               "(KeyError: 'count')")


def trainer_uses_outside_it() -> list[str]:
    """Every place in engine/ outside engine/trainer.py that touches a Trainer other
    than by making one and calling its ``fit()``: an attribute named ``trainer``, or any
    attribute of a name bound to ``Trainer(...)`` but ``fit``."""
    found = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        if path.name == "trainer.py":
            continue
        tree = ast.parse(path.read_text())
        trainers = {node.targets[0].id for node in ast.walk(tree)
                    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) == "Trainer"
                    and isinstance(node.targets[0], ast.Name)}
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr == "trainer":
                found.append(f"{where}: .trainer")
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in trainers and node.attr != "fit"):
                found.append(f"{where}: {node.value.id}.{node.attr}")
            elif isinstance(node, ast.Constant) and node.value == "trainer":
                found.append(f"{where}: 'trainer' (getattr?)")
    return found


def test_no_engine_module_reads_or_writes_attributes_of_the_trainer():
    assert trainer_uses_outside_it() == []


def final_parts(out) -> dict:
    snap = torch.load(out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip(),
                      weights_only=True)
    return {"curriculum": snap["curriculum"], "ema": snap["ema"]}


def assert_same_tensors(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def test_a_recipe_part_and_the_ema_resume_bit_identically_after_a_kill_mid_epoch(tmp_path):
    reference = tmp_path / "reference"
    run_cli(PARTS_RECIPE, *RUN, f"out_dir={reference}", "--nproc", "2", check=True)

    out = tmp_path / "resumed"
    resumed = conftest.killed_then_resumed(PARTS_RECIPE, *RUN, f"out_dir={out}", "--nproc",
                                           "2", tmp_path=tmp_path, step=KILL_STEP)
    assert "epoch 2, step 10, batch 2 of the epoch" in resumed.stdout, resumed.stdout

    assert read_summary(out)["weights_sha256"] == read_summary(reference)["weights_sha256"]
    expected, got = final_parts(reference), final_parts(out)
    assert expected["curriculum"] == {"seen": 3 * 64 // 2}  # every sample once an epoch
    assert expected["ema"]["steps"] == 24
    assert_same_tensors(got, expected)


# This module is also a plugin (-p tests.engine.test_stateful): it adds a part named by
# ENGINE_TEST_PART.
@engine.hookimpl
def engine_register_state(engine, parts):
    name = os.environ.get("ENGINE_TEST_PART")
    if name:
        parts.add(name, Counter(7))


def test_a_plugin_part_is_saved_and_a_name_taken_twice_names_both_owners(tmp_path):
    args = (PARTS_RECIPE, "epochs=1", "--nproc", "1", "-p", "tests.engine.test_stateful")
    run_cli(*args, f"out_dir={tmp_path / 'ok'}", check=True,
            env=conftest.engine_env(ENGINE_TEST_PART="marker"))
    snap = torch.load(next((tmp_path / "ok" / "checkpoints").glob("snapshot-*.pt")),
                      weights_only=True)
    assert snap["marker"] == {"count": 7}
    assert list(snap)[-2:] == ["marker", "rng"]  # after the recipe's, before the RNG states

    taken = run_cli(*args, f"out_dir={tmp_path / 'taken'}",
                    env=conftest.engine_env(ENGINE_TEST_PART="curriculum"))
    assert taken.returncode == 2
    assert ("state part 'curriculum' is added twice: by the recipe (state_parts) and by "
            "plugin 'tests.engine.test_stateful'; each part needs its own name") in taken.stderr


def loop_with_a_part(ctx, epochs):
    model = torch.nn.Linear(2, 1)
    ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    counter = Counter()
    ctx.add_state("counter", counter)
    for _ in ctx.epochs(epochs):
        counter.count += 1
    return counter.count


def test_a_custom_loop_part_resumes_with_its_run(tmp_path):
    config = engine.TrainConfig(out_dir=str(tmp_path / "loop"))
    assert engine.launch(loop_with_a_part, 2, nproc=1, config=config) == 2
    # Resumed after epoch 2: the counter goes on from its saved count.
    assert engine.launch(loop_with_a_part, 3, nproc=1, config=config) == 3


def python_block_after(text: str, heading: str) -> str:
    """The first ```python block after ``heading`` in a doc."""
    after = text.split(heading, 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_plugin_guides_state_part_example_runs_and_resumes(tmp_path):
    guide = (REPO / "docs" / "plugins.md").read_text()
    (tmp_path / "steps_seen.py").write_text(
        python_block_after(guide, "### `engine_register_state(ctx, parts)`"))
    env = conftest.engine_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    args = (str(REPO / "tests" / "recipes" / "tiny_regression.py"), f"out_dir={tmp_path / 'r'}",
            "--nproc", "1", "-p", "steps_seen")
    run_cli(*args, "epochs=1", env=env, check=True)
    run_cli(*args, "epochs=2", env=env, check=True)  # resumed: counts on from 8
    latest = tmp_path / "r" / "checkpoints" / "latest"
    snap = torch.load(latest.parent / latest.read_text().strip(), weights_only=True)
    assert snap["steps_seen"] == {"count": 16}


def test_the_checkpoint_guides_recipe_part_example_is_saved(tmp_path):
    guide = (REPO / "docs" / "checkpoints.md").read_text()
    recipe = tmp_path / "curriculum_recipe.py"
    recipe.write_text("from tests.recipes.tiny_regression import *  # noqa\n"
                      "from tests.recipes.tiny_regression import Config  # noqa\n\n"
                      + python_block_after(guide, "## What a snapshot holds"))
    run_cli(str(recipe), "epochs=1", f"out_dir={tmp_path / 'r'}", "--nproc", "1", check=True)
    snap = torch.load(next((tmp_path / "r" / "checkpoints").glob("snapshot-*.pt")),
                      weights_only=True)
    assert snap["curriculum"] == {"level": 0}


def test_rng_states_travel_as_bytes_and_come_back_the_same():
    """What gather_rng_states sends for a rank: pickled with its tensors as bytes, within
    RNG_BYTES, and back to the same states."""
    import pickle

    from engine.rng import RNG_BYTES, _rng_as_bytes, _rng_from_bytes, rng_state
    from engine.testing import assert_same_snapshot

    state = rng_state()
    data = pickle.dumps(_rng_as_bytes(state), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(data) <= RNG_BYTES
    assert_same_snapshot(_rng_from_bytes(pickle.loads(data)), state)


# ------------------------------------------------------ the model's keys and digest


def test_model_digest_ignores_device_layout_and_key_order_but_not_values():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"w": weight, "b": torch.ones(3), "n": 5}
    transposed_twice = {"n": 5, "b": torch.ones(3), "w": weight.t().contiguous().t()}
    assert not transposed_twice["w"].is_contiguous()
    assert model_digest(state) == model_digest(transposed_twice)
    changed = dict(state, w=weight.clone())
    changed["w"][2, 3] += 1e-6
    assert model_digest(changed) != model_digest(state)
    assert model_digest(dict(state, w=weight.double())) != model_digest(state)


def test_module_prefix_is_added_and_stripped_only_as_a_whole():
    state = {"a.weight": 1, "b.bias": 2}
    assert add_module_prefix(state) == {"module.a.weight": 1, "module.b.bias": 2}
    assert plain_keys(add_module_prefix(state)) == state
    mixed = {"module.a.weight": 1, "b.bias": 2}
    assert plain_keys(mixed) == mixed
    assert add_module_prefix(mixed) == {"module.a.weight": 1, "module.b.bias": 2}


def test_loads_into_plain_and_ddp_wrapped_models_with_or_without_prefix(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    plain = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = DDP(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
        with_prefix = {f"module.{k}": v for k, v in source.state_dict().items()}
        for target, state in ((plain, source.state_dict()), (plain, with_prefix),
                              (wrapped, source.state_dict()), (wrapped, with_prefix)):
            load_model_state(target, state)
            got = getattr(target, "module", target).state_dict()
            assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_compiled_keys_are_plain_at_any_depth_and_with_ddp_prefix():
    compiled = {"_orig_mod.0.weight": 1, "_orig_mod.2.bias": 2}
    assert plain_keys(compiled) == {"0.weight": 1, "2.bias": 2}
    blocks = {"layers.0._orig_mod.fc.weight": 1, "layers.1._orig_mod.fc.weight": 2,
              "head.weight": 3}
    assert plain_keys(blocks) == {"layers.0.fc.weight": 1, "layers.1.fc.weight": 2,
                                  "head.weight": 3}
    assert plain_keys(add_module_prefix(compiled)) == {"0.weight": 1, "2.bias": 2}
    assert plain_keys({"my_orig_mod.weight": 1}) == {"my_orig_mod.weight": 1}


def test_loads_across_compiled_and_plain_models():
    """A model compiled whole (torch.compile's OptimizedModule) or by blocks takes plain
    keys, and its own keys load into a plain model. torch.compile is lazy: nothing is
    compiled here, only the wrappers and their state_dict keys are real."""
    def net():
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))

    torch.manual_seed(0)
    source = net()
    whole = torch.compile(net())
    by_block = net()
    by_block[0] = torch.compile(by_block[0])
    assert "_orig_mod.0.weight" in whole.state_dict()
    assert "0._orig_mod.weight" in by_block.state_dict()
    for target, state in ((whole, source.state_dict()), (by_block, source.state_dict()),
                          (net(), whole.state_dict()), (net(), by_block.state_dict())):
        load_model_state(target, state)
        got = plain_keys(target.state_dict())
        assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    with pytest.raises(CheckpointError, match="missing keys: 2.bias"):
        load_model_state(whole, {k: v for k, v in source.state_dict().items()
                                 if k != "2.bias"})


def test_key_mismatch_names_missing_and_unexpected_keys():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    state = dict(model.state_dict())
    state["2.weight"] = state.pop("1.weight")
    with pytest.raises(CheckpointError) as info:
        load_model_state(model, state, source="ckpt.pt")
    assert str(info.value) == ("ckpt.pt does not match the model; missing keys: 1.weight; "
                               "unexpected keys: 2.weight")
    state = dict(model.state_dict())
    state["1.weight"] = torch.zeros(5, 5)
    with pytest.raises(CheckpointError, match=r"ckpt.pt does not match the model: size "
                                              r"mismatch for 1.weight"):
        load_model_state(model, state, source="ckpt.pt")


def test_the_model_key_helpers_still_import_from_engine_checkpoint():
    from engine import checkpoint, stateful

    for name in ("COMPILED_SEGMENT", "add_module_prefix", "load_model_state",
                 "model_digest", "plain_keys", "uncompiled_key"):
        assert getattr(checkpoint, name) is getattr(stateful, name), name


def tiny_adamw_run(sharded: bool, steps: int = 0):
    """A two-layer model (each layer and the whole fully_shard-ed with ``sharded``, in
    the caller's process group) and its AdamW after ``steps`` steps, seeded."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    if sharded:
        fully_shard(model[0])
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_an_optimizers_state_crosses_between_whole_and_sharded_models(tmp_path):
    """``parallel`` may change at a resume (snapshot.MAY_CHANGE): a whole model's
    optimizer state (torch's own form, keyed by parameter index: a ddp or single run's
    torch-file snapshot) loads into an fsdp model's optimizer, and an fsdp run's
    gathered one (keyed by name) into a whole model's; the next step is the same either
    way. (Before, the first failed in torch's loader with a KeyError.)"""
    import io

    import torch.distributed as dist

    from engine.stateful import OptimizerState

    def full(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    def next_step(model, optimizer, batch):
        model(batch).sum().backward()
        optimizer.step()
        return [full(p).detach().clone() for p in model.parameters()]

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        for saved_sharded in (False, True):
            model, optimizer = tiny_adamw_run(saved_sharded, steps=2)
            # What a single-file checkpointer stores and reads back (the whole form,
            # gathered under fsdp): a copy, not the live state's tensors.
            buffer = io.BytesIO()
            torch.save(OptimizerState(model, optimizer).state_dict(), buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=True)
            into, into_optimizer = tiny_adamw_run(not saved_sharded)
            with torch.no_grad():
                for target, source in zip(into.parameters(), model.parameters()):
                    value = full(source)
                    if hasattr(target, "to_local"):
                        target.to_local().copy_(value)
                    else:
                        target.copy_(value)
            OptimizerState(into, into_optimizer).load_state_dict(saved)
            batch = torch.randn(5, 4)
            expected = next_step(model, optimizer, batch)
            for a, b in zip(next_step(into, into_optimizer, batch), expected):
                assert torch.equal(a, b), saved_sharded
    finally:
        dist.destroy_process_group()
