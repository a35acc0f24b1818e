"""engine/parallel.py: the device-group mapping, its errors, and rank-0 warnings."""

from __future__ import annotations

import subprocess
import sys

import pytest

import engine
from engine.errors import ConfigError
from engine.parallel import Parallel, gpu_group, idle_gpus_message, require_single_process
from engine.testing import make_plugin_manager  # noqa: F401 (a fixture)
from engine.world import World


def world(local_rank=0, local_world_size=1, launcher="spawn", rank=None, nodes=1,
          host="node-a"):
    return World(rank=local_rank if rank is None else rank, local_rank=local_rank,
                 world_size=local_world_size * nodes, local_world_size=local_world_size,
                 num_nodes=nodes, launcher=launcher, host=host,
                 shared_devices=launcher == "spawn")


def test_each_local_rank_gets_its_own_consecutive_gpus():
    groups = [gpu_group("ddp-multigpu", world(r, 2), per_process=4, visible=8)
              for r in range(2)]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [gpu_group("ddp", world(r, 4), 1, visible=4) for r in range(4)] == [
        [0], [1], [2], [3]]


def test_too_few_gpus_for_the_local_processes_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ConfigError) as err:
        gpu_group("ddp-multigpu", world(0, 2), per_process=2, visible=3)
    assert str(err.value) == (
        "parallel mode 'ddp-multigpu' needs 2 GPU(s) per process x 2 processes on this "
        "node = 4 GPUs, but 3 are visible (CUDA_VISIBLE_DEVICES=0,1,2); start at most 1 "
        "processes per node (--nproc) or make more GPUs visible")


def test_a_launcher_that_binds_gpus_per_task_is_trusted(monkeypatch):
    # srun --gpus-per-task=2: every task sees only its own two GPUs.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert gpu_group("ddp-multigpu", world(3, 4, launcher="slurm"), 2, visible=2) == [0, 1]
    # Our own spawn passes one CUDA_VISIBLE_DEVICES to all children: never bound.
    with pytest.raises(ConfigError, match="needs 2 GPU"):
        gpu_group("ddp-multigpu", world(3, 4, launcher="spawn"), 2, visible=2)
    from engine.launcher import LaunchOptions
    from engine.plugins.spawn import SpawnLauncher

    spawned = SpawnLauncher(LaunchOptions(nproc=4), environ={}).worlds()
    assert all(w.shared_devices for w in spawned)
    with pytest.raises(ConfigError, match="needs 2 GPU"):
        gpu_group("ddp-multigpu", spawned[3], 2, visible=2)


def test_binding_needs_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match=r"needs 1 GPU\(s\) per process x 2 processes"):
        gpu_group("ddp", world(1, 2, launcher="torchrun"), 1, visible=1)


def test_idle_gpu_message_names_the_idle_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert idle_gpus_message("single", 1, 1, "x") is None
    assert idle_gpus_message("ddp", 2, 4, "start one process per GPU") == (
        "4 GPUs are visible but parallel mode 'ddp' uses only 2: cuda:2, cuda:3 stay "
        "idle; start one process per GPU")


def test_warn_prints_once_and_only_on_rank0(capsys):
    for rank in (0, 1):
        mode = Parallel(world(rank, 2), cfg=None)
        mode.warn("something")
        mode.warn("something")
    assert capsys.readouterr().err == "warning: something\n"


def test_node_warnings_come_from_every_node_named_by_host(capsys):
    for node, host in ((0, "node-a"), (1, "node-b")):
        for local in (0, 1):
            mode = Parallel(world(local, 2, rank=node * 2 + local, nodes=2, host=host),
                            cfg=None)
            mode.warn("GPUs idle", every_node=True)
    assert capsys.readouterr().err == ("warning: node-a: GPUs idle\n"
                                       "warning: node-b: GPUs idle\n")


def test_single_process_modes_refuse_a_bigger_world():
    class OneProcess(Parallel):
        name = "single"

    with pytest.raises(ConfigError) as err:
        require_single_process(OneProcess(world(0, 2), cfg=None))
    assert str(err.value) == ("parallel mode 'single' runs in one process, but the world "
                              "has 2; use --parallel ddp, or --nproc 1")


def test_base_mode_leaves_the_model_alone():
    mode = Parallel(world(), cfg=None)
    model = object()
    assert mode.wrap(model) is model and mode.unwrap(model) is model
    with mode.no_sync(model):
        pass
    mode.sync_buffers(model)
    assert mode.explain(RuntimeError("boom")) is None


def test_parallel_modules_do_not_import_torch():
    code = ("import sys, engine.parallel, engine.plugins.single, engine.plugins.dp, "
            "engine.plugins.ddp, engine.plugins.ddp_multigpu, engine.plugins.fsdp; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_all_five_modes_are_registered_built_ins():
    from engine.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    names = set(pm.parallel_modes.names())
    assert {"single", "dp", "ddp", "ddp-multigpu", "fsdp"} <= names
    assert all(pm.parallel_modes.owner(n) == n for n in ("single", "dp", "ddp",
                                                         "ddp-multigpu", "fsdp"))


# ------------------------------------------------------------------- auto


def auto(pm, world_size):
    from engine.parallel import choose_parallel

    w = World(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size)
    return choose_parallel(pm.parallel_modes, "auto", w).name


def test_auto_asks_the_modes_own_detect_in_priority_order(make_plugin_manager, monkeypatch):
    pm = make_plugin_manager()
    monkeypatch.setattr("engine.plugins.dp.visible_gpus", lambda: 0)
    assert [auto(pm, n) for n in (1, 2, 4)] == ["single", "ddp", "ddp"]
    # One process that sees several GPUs: dp (its detect asks how many are visible).
    monkeypatch.setattr("engine.plugins.dp.visible_gpus", lambda: 2)
    assert [auto(pm, n) for n in (1, 2)] == ["dp", "ddp"]
    # Without the dp plugin the same process falls back to single.
    assert auto(make_plugin_manager("no:dp"), 1) == "single"


class Pipeline(Parallel):
    name = "pipeline"
    priority = 5

    @classmethod
    def detect(cls, world):
        return world.world_size == 4


class PipelinePlugin:
    @engine.hookimpl
    def engine_register_parallel(self, registry):
        registry.add(Pipeline)
        ddp = registry.get("ddp")
        # A subclass inherits ddp's detect and priority; ddp, registered first, wins.
        registry.add(type("DDPVariant", (ddp,), {"name": "ddp-variant"}))


def test_a_third_party_mode_takes_part_in_auto(make_plugin_manager):
    pm = make_plugin_manager(PipelinePlugin())
    assert [auto(pm, n) for n in (1, 2, 4)] == ["single", "ddp", "pipeline"]


def test_a_mode_whose_init_predates_the_recipe_argument_still_gets_it():
    # A third-party mode's __init__(self, world, cfg): the engine now builds every mode
    # as Mode(world, cfg, recipe=...), which raised TypeError for it.
    from engine.parallel import Parallel

    class OldStyle(Parallel):
        name = "old-style"

        def __init__(self, world, cfg):
            super().__init__(world, cfg)
            self.built = True

    recipe = object()
    mode = OldStyle("world", "cfg", recipe=recipe)
    assert (mode.world, mode.cfg, mode.recipe, mode.built) == ("world", "cfg", recipe, True)
    assert OldStyle("world", "cfg").recipe is None
