"""plugins/fsdp.py: the unit choice and its one-line errors (in this process, no
process group needed), then real runs on 2 gloo processes: fsdp against ddp, a
torch-file snapshot exported to safetensors and loaded into the plain model, and dcp
snapshots resumed at 1, 2 and 3 processes."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

from engine import TrainConfig
from engine.errors import ConfigError
from engine.plugins.fsdp import FSDPConfig, FullyShardedDataParallel
from engine.world import World


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
    parallel = FullyShardedDataParallel(world, Config(precision=precision,
                                                      fsdp=FSDPConfig(shard=shard)))
    parallel.recipe = recipe
    return parallel


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
