"""engine/launcher.py: which launcher a process belongs to (the documented detection
order), and the checks a named launcher makes before any worker starts."""

from __future__ import annotations

import pytest

import engine.launch_env
import engine.processes
from engine.errors import LaunchError
from engine.launcher import (Launcher, LaunchOptions, check_max_restarts, choose_launcher,
                             detection_order)
from engine.plugin_manager import build_plugin_manager
from engine.world import World


TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
OLD_LEGACY = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}
SRUN = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NAME": "train"}
SALLOC_SHELL = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                "SLURM_JOB_NAME": "interactive", "SLURM_JOB_NODELIST": "n1"}


@pytest.fixture(scope="module")
def registry():
    return build_plugin_manager(autoload=False).launchers


def chosen(registry, environ, **options) -> str:
    return choose_launcher(registry, "auto", LaunchOptions(**options), environ).name


def test_detection_order_is_documented_order(registry):
    names = [cls.name for cls in detection_order(registry)]
    assert names == ["legacy", "torchrun", "slurm", "spawn"]
    import engine.launcher

    doc = engine.launcher.__doc__
    for number, name in enumerate(names, start=1):
        assert f"\n{number}. ``{name}``" in doc


@pytest.mark.parametrize("environ, options, expected", [
    ({}, {}, "spawn"),
    (TORCHRUN, {}, "torchrun"),
    ({k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}, {}, "torchrun"),
    (TORCHRUN, {"local_rank": 1}, "legacy"),  # torch >= 2: legacy launch sets the same
    (OLD_LEGACY, {}, "legacy"),  # --use_env before torchelastic: LOCAL_RANK only
    ({**OLD_LEGACY, "LOCAL_RANK": ""}, {"local_rank": 0}, "legacy"),
    (SRUN, {}, "slurm"),
    ({**SRUN, **TORCHRUN}, {}, "torchrun"),  # srun torchrun ...: torchrun's workers
    (SALLOC_SHELL, {}, "spawn"),  # a salloc shell: no job step
    ({**SRUN, "SLURM_JOB_NAME": "bash", "SLURM_STEP_NUM_TASKS": "1"}, {}, "spawn"),
    ({**SRUN, "SLURM_JOB_NAME": "bash"}, {}, "slurm"),  # srun -n2 bash -c engine-run
    ({**SRUN, "SLURM_STEP_ID": "4294967290"}, {}, "spawn"),  # the interactive step
    ({**SRUN, "SLURM_STEP_ID": ""}, {}, "spawn"),  # the batch script itself
])
def test_detection(registry, environ, options, expected):
    assert chosen(registry, environ, **options) == expected


def test_a_launcher_asked_for_by_name_is_used_without_detection(registry):
    launcher = choose_launcher(registry, "slurm", LaunchOptions(),
                               {**SALLOC_SHELL, "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    (world,) = launcher.worlds()
    assert (world.launcher, world.rank, world.world_size, world.master_addr) == (
        "slurm", 0, 1, "n1")


@pytest.mark.parametrize("name, missing", [
    ("torchrun", "RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ("legacy", "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ("slurm", "SLURM_JOB_ID, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID"),
])
def test_named_launcher_lists_the_missing_variables(registry, name, missing):
    with pytest.raises(LaunchError) as err:
        choose_launcher(registry, name, LaunchOptions(), {}).worlds()
    assert str(err.value).startswith(
        f"launcher {name!r} needs the environment variables {missing}, which are not set")


def test_unknown_launcher_name_lists_the_registered(registry):
    from engine.errors import PluginError

    with pytest.raises(PluginError, match="launcher 'torchrunn' is not available.*did you "
                                          "mean 'torchrun'"):
        choose_launcher(registry, "torchrunn", LaunchOptions(), {})



@pytest.mark.parametrize("name, count, message", [
    ("spawn", -1, "--max-restarts -1 must be >= 0 (0: no restart)"),
    ("torchrun", 2, "--max-restarts is for the spawn launcher; under torchrun the workers are "
                    "started by another tool, so restart them with torchrun --max-restarts N"),
    ("slurm", 2, "--max-restarts is for the spawn launcher; under slurm the workers are "
                 "started by another tool, so restart them with sbatch --requeue"),
    ("legacy", 1, "--max-restarts is for the spawn launcher; under legacy the workers are "
                  "started by another tool, so restart them with python -m "
                  "torch.distributed.launch --max-restarts N"),
])
def test_max_restarts_is_a_count_for_a_launcher_that_starts_the_workers(registry, name,
                                                                         count, message):
    with pytest.raises(LaunchError) as err:
        check_max_restarts(registry.get(name)(LaunchOptions(max_restarts=count), {}))
    assert str(err.value).startswith(message)
    check_max_restarts(registry.get(name)(LaunchOptions(), {}))  # the default: no restart
    check_max_restarts(registry.get("spawn")(LaunchOptions(max_restarts=3), {}))


class OldStyle(Launcher):
    """A third-party launcher written against detect(environ)."""

    name = "old-style"
    priority = 5

    @classmethod
    def detect(cls, environ):
        return environ.get("OLD_STYLE") == "1"

    def worlds(self):
        return [World(rank=0, local_rank=0, world_size=1, local_world_size=1)]


def test_third_party_detect_with_one_argument_still_works():
    pm = build_plugin_manager(autoload=False)
    pm.launchers.add("old-style", OldStyle)
    assert chosen(pm.launchers, {"OLD_STYLE": "1"}) == "old-style"
    assert chosen(pm.launchers, {}) == "spawn"



def test_a_launchers_toolbox_is_importable_from_the_interface_module():
    # Launchers written against engine.launcher import their helpers from it
    # (docs/plugins.md); the helpers live in engine.launch_env and engine.processes.
    import engine.launcher

    for name in ("require_variables", "int_variable", "parent_cmdline", "free_port",
                 "check_port_free", "is_local_address", "start_method"):
        assert getattr(engine.launcher, name) is getattr(engine.launch_env, name)
    assert engine.launcher.spawn_workers is engine.processes.spawn_workers
