"""The plan --dry-run prints (engine/plan.py)."""

from __future__ import annotations

import re

from engine.plan import memory_plan
from engine.recipe import load_recipe
from tests.conftest import REPO, run_cli, run_cli_here

#: A recipe whose build_model notes the device it builds on, one line per call.
NOTING_RECIPE = '''
import attrs
import torch
from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 4
    notes: str = ""


def build_model(cfg):
    with open(cfg.notes, "a") as f:
        f.write(torch.empty(0).device.type + "\\n")
    return torch.nn.Linear(4, 2)


def build_datasets(cfg, ctx):
    return torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)), None


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=0.01)
'''


def test_the_memory_snapshots_line_gives_two_buffers_of_model_and_optimizer_state():
    """The CIFAR net (62,006 parameters, 248,024 bytes of state) under SGD with momentum
    (one buffer per parameter): 2 x 0.5 MB, built on the meta device; under fsdp four
    of a rank's shard."""
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
    cfg.momentum = 0.9
    cfg.parallel = "fsdp"  # each rank holds its shard: half of it with 2 processes,
    # and its predecessor's in two more buffers (the ring: engine/memory_ring.py)
    assert re.fullmatch(r"every 5 step\(s\), 4 buffers per rank \(2 its own, 2 its "
                        r"predecessor's\) in .*: 4 x 0\.2 MB "
                        r"\(model 0\.1 MB \+ optimizer state 0\.1 MB, this rank's shard "
                        r"of 2; \d+ MB free there\)", memory_plan(recipe, cfg, 2)), \
        memory_plan(recipe, cfg, 2)


def test_only_a_shown_plan_builds_the_model_in_the_launching_process(tmp_path):
    """Sizing the in-memory snapshots builds the recipe's model (on the meta device):
    --dry-run and -v do, once; a plain run builds it only in its workers, so that a
    build_model that downloads (from_pretrained) does not download in the launcher too."""
    recipe, notes = tmp_path / "noting.py", tmp_path / "notes"
    recipe.write_text(NOTING_RECIPE)
    proc = run_cli_here(str(recipe), f"notes={notes}", "--dry-run", check=True)
    # The default interval, auto: said with its budget (what a crash loses is known once
    # the run measured the snapshots' cost).
    assert re.search(r"in memory +every N steps, N auto: the fewest \(1 to 128\) whose "
                     r"snapshots cost at most 2% of the step time, measured while training; "
                     r"2 buffers per rank in .*: 2 x 0\.0 MB", proc.stdout), proc.stdout
    assert notes.read_text().split() == ["meta"]
    notes.unlink()
    run_cli(str(recipe), f"notes={notes}", f"out_dir={tmp_path / 'run'}", "--nproc", "1",
            check=True)
    assert notes.read_text().split() == ["cpu"]  # the worker's; none on the meta device
