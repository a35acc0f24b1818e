"""The plan --dry-run prints (engine/plan.py)."""

from __future__ import annotations

import re

from engine.plan import memory_plan
from engine.recipe import load_recipe
from tests.conftest import REPO


def test_the_memory_snapshots_line_gives_two_buffers_of_model_and_optimizer_state():
    """The CIFAR net (62,006 parameters, 248,024 bytes of state) under SGD with momentum
    (one buffer per parameter): 2 x 0.5 MB, built on the meta device."""
    recipe = load_recipe(REPO / "recipes" / "cifar_ddp.py")
    cfg = recipe.make_config()
    cfg.checkpoint.memory_every_steps = 0
    assert memory_plan(recipe, cfg) is None  # off
    cfg.checkpoint.memory_every_steps = 5
    line = memory_plan(recipe, cfg)
    assert re.fullmatch(r"every 5 step\(s\), 2 buffers per rank in /dev/shm/engine-memory-\d+: "
                        r"2 x 0\.5 MB "
                        r"\(model 0\.2 MB \+ optimizer state 0\.2 MB; \d+ MB free there\)",
                        line), line
    cfg.momentum = 0.0  # plain SGD keeps no state
    assert "optimizer state 0.0 MB" in memory_plan(recipe, cfg)
    cfg.parallel = "fsdp"  # each rank holds a shard: none are written (engine.py)
    assert memory_plan(recipe, cfg).startswith("off with parallel=fsdp")
