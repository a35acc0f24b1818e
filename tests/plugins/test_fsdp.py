"""plugins/fsdp.py: the unit choice and its one-line errors (in this process, no
process group needed), then real runs on 2 gloo processes: fsdp against ddp and
compiled fsdp, a torch-file snapshot exported to safetensors and loaded into the plain
model, and dcp snapshots resumed at 1, 2 and 3 processes."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from engine import TrainConfig
from engine.errors import ConfigError
from engine.plugins.fsdp import FSDPConfig, FullyShardedDataParallel
from engine.world import World
from tests.conftest import REPO, engine_env, read_summary, run_cli


class Block(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.inner(x))


class Net(nn.Module):
    def __init__(self, tie=False):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 4)
        if tie:
            self.head.weight = self.blocks[1].inner.weight

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


@attrs.define
class Config(TrainConfig):
    fsdp: FSDPConfig = attrs.Factory(FSDPConfig)


class Recipe:
    def __init__(self, **attributes):
        self.attributes = attributes

    def optional(self, name):
        return self.attributes.get(name)


def mode(shard="", precision="32", recipe=None):
    world = World(rank=0, local_rank=0, world_size=2, local_world_size=2, num_nodes=1,
                  launcher="spawn", host="node-a", shared_devices=True)
    return FullyShardedDataParallel(world, Config(precision=precision,
                                                  fsdp=FSDPConfig(shard=shard)), recipe=recipe)


def unit_names(parallel, model):
    return [name for name, _ in parallel.units(model)]


def test_units_are_the_named_classes_the_recipes_or_the_parameter_holding_children():
    model = Net()
    assert unit_names(mode(shard="Block"), model) == ["blocks.0", "blocks.1"]
    assert unit_names(mode(shard="Block, Linear"), model)[:2] == ["embed", "blocks.0"]
    assert unit_names(mode(recipe=Recipe(shard_units=(Block,))), model) == [
        "blocks.0", "blocks.1"]
    # fsdp.shard wins over the recipe's choice.
    assert unit_names(mode(shard="Linear", recipe=Recipe(shard_units=(Block,))),
                      model)[0] == "embed"
    assert unit_names(mode(), model) == ["embed", "blocks", "head"]


def test_a_shard_class_that_matches_nothing_is_one_line_naming_the_classes_there_are():
    with pytest.raises(ConfigError) as info:
        mode(shard="Layer").units(Net())
    assert str(info.value) == (
        "fsdp.shard=Layer: Layer matches no submodule of Net; its submodule classes are: "
        "Block, Linear, ReLU, Sequential".replace(", ReLU", ""))


def test_weights_tied_across_units_are_refused_and_allowed_within_one():
    with pytest.raises(ConfigError, match=r"fsdp: blocks\.1\.inner\.weight and head\.weight "
                       r"are one tied parameter in two units \(unit 'blocks\.1' and the "
                       r"root\)"):
        mode(shard="Block").units(Net(tie=True))
    # Both ends inside the root's share: nothing is split.
    assert unit_names(mode(shard="Sequential"), Net(tie=False)) == ["blocks"]


def test_a_unit_with_two_dtypes_and_fp16_are_refused_in_one_line():
    model = Net()
    model.blocks[1].double()
    with pytest.raises(ConfigError, match="fsdp: unit 'blocks' holds parameters of dtypes "
                       "float32, float64"):
        mode(shard="Sequential").units(model)
    # Each dtype a unit of its own: fine.
    assert unit_names(mode(shard="Block"), model) == ["blocks.0", "blocks.1"]
    with pytest.raises(ConfigError, match="precision 'fp16' with parallel mode 'fsdp'.*"
                       "use precision=bf16"):
        mode(precision="fp16").check()


def test_a_chosen_memory_tier_is_accepted():
    """Each rank's memory snapshot holds its own shards (issue 37): no longer refused."""
    parallel = mode()
    parallel.cfg.checkpoint.memory_every_steps = 1
    parallel.check()


def test_the_plan_shows_the_units_and_the_bytes_per_rank():
    class Module:
        Config = Config

        @staticmethod
        def build_model(cfg):
            return Net()

    recipe = Recipe(shard_units=(Block,))
    recipe.module = Module
    rows = dict(mode(recipe=recipe).describe())
    assert rows["fsdp units"] == "2 + the root: blocks.0 (Block), blocks.1 (Block)"
    # 4 Linear(4, 4): 80 float32 parameters = 320 bytes, half on each of 2 ranks.
    assert rows["fsdp per rank"].startswith("parameters 160 B of 320 B")


# ------------------------------------------- real runs: 2 gloo processes and more

ELASTIC = str(REPO / "tests" / "recipes" / "tiny_elastic.py")
#: tiny_elastic: 36 samples, global batch 6 -> 6 steps; -p so the fault plugin loads.
BASE = (ELASTIC, "-p", "tests.fault_plugin")


def losses_per_rank(out) -> list[list[float]]:
    """Every rank's micro-batch losses in order, as tiny_elastic recorded them."""
    records = sorted(out.glob("batches-rank*.txt"))
    return [[float(line.split()[3]) for line in r.read_text().splitlines()]
            for r in records]


def samples_seen(out) -> list[int]:
    return sorted(int(i) for r in out.glob("batches-rank*.txt")
                  for line in r.read_text().splitlines() for i in line.split()[4].split(","))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """fsdp on 2 processes with the torch-file checkpointer, one epoch, never stopped:
    the reference of every test below."""
    out = tmp_path_factory.mktemp("fsdp") / "uninterrupted"
    run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", f"out_dir={out}", check=True)
    return out


def test_fsdp_on_two_processes_trains_as_ddp_does(uninterrupted, tmp_path):
    ddp = tmp_path / "ddp"
    run_cli(*BASE, "--parallel", "ddp", "--nproc", "2", f"out_dir={ddp}", check=True)
    fsdp_losses, ddp_losses = losses_per_rank(uninterrupted), losses_per_rank(ddp)
    assert [len(r) for r in fsdp_losses] == [6, 6]
    torch.testing.assert_close(fsdp_losses, ddp_losses)
    # ...and bit for bit here: the same samples per rank and the same update (on other
    # models the weights may differ in the last bit: reduce-scatter is not all-reduce).
    assert fsdp_losses == ddp_losses
    assert samples_seen(uninterrupted) == list(range(36))


def test_fsdp_with_compile_trains_as_eager_fsdp_does(uninterrupted, tmp_path):
    """compile.enabled=true under fsdp: the model compiled in place, then sharded. The
    backend is aot_eager: dynamo and AOTAutograd trace the forward and the backward
    around FSDP's hooks (where compile and fsdp meet) without inductor's code
    generation, which would cost each of the 2 processes tens of seconds here."""
    out = tmp_path / "compiled"
    proc = run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", "compile.enabled=true",
                   "compile.backend=aot_eager", f"out_dir={out}", check=True)
    assert "spent compiling on rank 0" in proc.stdout
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["compile_s"] > 0
    compiled_losses = losses_per_rank(out)
    assert [len(r) for r in compiled_losses] == [6, 6]
    # Traced ops sum in the same order here; the tolerance allows a decomposition's
    # rounding.
    torch.testing.assert_close(compiled_losses, losses_per_rank(uninterrupted),
                               rtol=1e-5, atol=1e-6)
    assert samples_seen(out) == list(range(36))


def test_a_torch_file_snapshot_of_fsdp_exports_to_safetensors_and_loads_into_the_plain_model(
        uninterrupted, tmp_path):
    from safetensors.torch import load_file

    from engine.checkpoint import model_digest

    out = tmp_path / "model.safetensors"
    assert ckpt_tool().main(["export", str(uninterrupted / "checkpoints"), str(out)]) == 0
    model = nn.Linear(4, 3)  # tiny_elastic's model, unsharded
    model.load_state_dict(load_file(out))  # strict: the very keys and shapes
    assert model_digest(model.state_dict()) == read_summary(uninterrupted)["weights_sha256"]


def test_the_runs_model_from_a_torch_file_snapshot_of_fsdp_is_the_full_trained_model(
        uninterrupted):
    """engine.load_model: tiny_elastic's plain nn.Linear with the full (unsharded)
    weights the run ended with, under plain keys."""
    import engine
    from engine.checkpoint import model_digest

    model = engine.load_model(uninterrupted)
    assert type(model) is nn.Linear and sorted(model.state_dict()) == ["bias", "weight"]
    assert model_digest(model.state_dict()) == read_summary(uninterrupted)["weights_sha256"]


def test_a_dcp_snapshot_of_2_processes_resumes_at_2_bit_identically_and_at_1_and_3(
        uninterrupted, tmp_path):
    """Pre-empted after step 2 of 6 with 2 processes (rank 1 signalled at step 1),
    each rank writing its own shards; resumed from that snapshot with 2, 1 and 3."""
    import shutil

    stopped = stop_after_step_2(tmp_path / "stopped", "dcp")
    snapshot = next((stopped / "checkpoints").glob("*.dcp"))
    assert sorted(p.name for p in snapshot.glob("*.distcp")) == ["__0_0.distcp",
                                                                 "__1_0.distcp"]
    reference = read_summary(uninterrupted)["weights_sha256"]
    for nproc in (2, 1, 3):
        out = tmp_path / f"resumed{nproc}"
        shutil.copytree(stopped, out)
        resumed = run_cli(*BASE, "--parallel", "fsdp", "--nproc", str(nproc),
                          "checkpointer=dcp", f"out_dir={out}", check=True)
        assert f"resuming from {out}" in resumed.stdout
        assert samples_seen(out) == list(range(36)), nproc  # each sample once
        summary = read_summary(out)
        assert summary["global_step"] == 6
        # The run's time is both segments' (issue 35 point 7): engine-run runs' WALL.
        before = read_summary(stopped)
        assert summary["segments"] == 2
        assert summary["total_wall_time_s"] == pytest.approx(
            before["wall_time_s"] + summary["wall_time_s"], abs=0.002)
        assert summary["total_training_time_s"] == pytest.approx(
            before["training_time_s"] + summary["training_time_s"], abs=0.002)
        if nproc == 2:
            assert summary["weights_sha256"] == reference
        else:  # the same samples per step, summed over other shards: float-close
            assert summary["train_loss"] == pytest.approx(
                read_summary(uninterrupted)["train_loss"], rel=1e-5)


def test_a_torch_file_snapshot_of_fsdp_resumes_bit_identically(uninterrupted, tmp_path):
    """The full state gathered on rank 0 goes back into each rank's shards."""
    stopped = stop_after_step_2(tmp_path / "stopped", "torch-file")
    run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", f"out_dir={stopped}", check=True)
    assert (read_summary(stopped)["weights_sha256"]
            == read_summary(uninterrupted)["weights_sha256"])


def test_dcp_async_snapshots_taken_while_training_goes_on_resume_bit_identically(
        uninterrupted, tmp_path):
    """checkpointer=dcp-async, a snapshot every 2 steps: the one of step 2 is written
    in the background while steps 3 and 4 train (committed by the next save). The run
    ends with the weights of the reference; resumed from step 2's snapshot, so does
    another (so the write saw step 2's state, not a later one)."""
    out = tmp_path / "async"
    run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", "checkpointer=dcp-async",
            "checkpoint.every_steps=2", "checkpoint.keep_last=0", f"out_dir={out}",
            check=True)
    reference = read_summary(uninterrupted)["weights_sha256"]
    assert read_summary(out)["weights_sha256"] == reference
    snapshots = sorted((out / "checkpoints").glob("*.dcp"))
    # Steps 2, 4 and 6, and the epoch's end (step 6 again, as epoch 1).
    assert sorted({s.name[-13:] for s in snapshots}) == [
        "s00000002.dcp", "s00000004.dcp", "s00000006.dcp"]
    assert not list((out / "checkpoints").glob(".staging-*"))  # every write committed
    resumed = tmp_path / "resumed"
    proc = run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", "checkpointer=dcp-async",
                   "--resume", str(snapshots[0]), f"out_dir={resumed}", check=True)
    assert "resuming from" in proc.stdout
    assert read_summary(resumed)["weights_sha256"] == reference
    # The model from the dcp snapshot: read whole from both ranks' shards, plain keys.
    import engine
    from engine.checkpoint import model_digest

    model = engine.load_model(out)
    assert type(model) is nn.Linear and sorted(model.state_dict()) == ["bias", "weight"]
    assert model_digest(model.state_dict()) == reference


def stop_after_step_2(out, checkpointer: str):
    """fsdp on 2 processes, pre-empted after step 2 of 6 (rank 1 signalled at step 1)."""
    fault = engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_STEP="1",
                       ENGINE_FAULT_RANK="1")
    run_cli(*BASE, "--parallel", "fsdp", "--nproc", "2", f"checkpointer={checkpointer}",
            f"out_dir={out}", env=fault)
    assert read_summary(out)["status"] == "preempted"
    return out


def ckpt_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckpt_tool", REPO / "tools" / "ckpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_shows_the_plan_and_a_bad_unit_class_is_one_line(tmp_path):
    cifar = str(REPO / "recipes" / "cifar_ddp.py")
    common = (cifar, "--parallel", "fsdp", "--dry-run", f"out_dir={tmp_path}")
    proc = run_cli(*common, "fsdp.shard=Linear", check=True)
    assert "fsdp units     3 + the root: fc1 (Linear), fc2 (Linear), fc3 (Linear)" in proc.stdout
    assert "fsdp per rank  parameters 121.1 KiB of 242.2 KiB" in proc.stdout
    proc = run_cli(*common, "fsdp.shard=Lineer")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "engine-run: error: fsdp.shard=Lineer: Lineer matches no submodule of Net; its "
        "submodule classes are: Conv2d, Linear, MaxPool2d")
