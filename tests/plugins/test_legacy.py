"""plugins/legacy.py: workers started by the real ``python -m torch.distributed.launch``,
with and without --use_env, and the three ways a local rank can arrive."""

from __future__ import annotations

import sys

import pytest

from engine.cli import build_parser
from engine.errors import LaunchError
from engine.launcher import LaunchOptions, free_port
from engine.plugin_manager import build_plugin_manager
from engine.plugins.legacy import (LegacyLauncher, option_from_cmdline,
                                   started_by_legacy_launch)
from tests.conftest import ENGINE_RUN
from tests.plugins.launch_runs import (ONE_THREAD, finished, reference_digest, run,
                                       train_args)

OLD_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("argv", [["r.py", "--local-rank=1"], ["r.py", "--local_rank=1"],
                                  ["--local-rank=1", "r.py", "epochs=1"]])
def test_both_spellings_of_the_argument_reach_the_launcher(argv):
    assert build_parser().parse_intermixed_args(argv).local_rank == 1


def test_inside_a_slurm_allocation_the_processes_share_its_cpus():
    env = {**OLD_ENV, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "SLURM_CPUS_PER_TASK": "6"}
    # The slurm plugin's answer, as engine-run asks it (engine_cpu_allocation).
    allocation = build_plugin_manager().hook.engine_cpu_allocation(environ=env)
    (world,) = LegacyLauncher(LaunchOptions(cpu_allocation=allocation), env).worlds()
    assert (world.cpu_share().count, world.cpu_share().reason) == (
        3, "6 CPUs (SLURM_CPUS_PER_TASK) shared by 2 local processes = 3 each")


@pytest.mark.parametrize("options, env", [
    (dict(local_rank=1), {}),                # --local-rank=1 (torch >= 2.0 without --use_env)
    (dict(), {"LOCAL_RANK": "1"}),           # --use_env: only the variable
    (dict(local_rank=1), {"LOCAL_RANK": "1"}),  # torch >= 1.9 sets both
])
def test_local_rank_from_argument_or_variable(options, env):
    (world,) = LegacyLauncher(LaunchOptions(**options), {**OLD_ENV, **env}).worlds()
    assert (world.rank, world.local_rank, world.world_size, world.launcher) == (
        1, 1, 2, "legacy")
    # No LOCAL_WORLD_SIZE before torch 1.9 and no launcher parent here: one node assumed.
    assert (world.local_world_size, world.num_nodes) == (2, 1)


@pytest.mark.parametrize("options, env, message", [
    (dict(), {}, "launcher 'legacy' needs the local rank: a --local-rank=N argument or the "
                 "LOCAL_RANK environment variable"),
    (dict(local_rank=0), {"LOCAL_RANK": "1"},
     "launcher 'legacy': --local-rank=0 but LOCAL_RANK=1; they must agree"),
    (dict(local_rank=1), {"LOCAL_WORLD_SIZE": "3"},
     "launcher 'legacy': LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=2"),
    (dict(local_rank=1), {"RANK": "2"}, "rank 2 is outside world size 2 (legacy)"),
])
def test_bad_local_ranks(options, env, message):
    with pytest.raises(LaunchError) as err:
        LegacyLauncher(LaunchOptions(**options), {**OLD_ENV, **env}).worlds()
    assert str(err.value).startswith(message)


def test_reading_the_launchers_command_line():
    cmdline = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=4",
               "--use_env", "train.py"]
    assert started_by_legacy_launch(cmdline)
    assert not started_by_legacy_launch([sys.executable, "-m", "torch.distributed.run"])
    assert option_from_cmdline(cmdline, "--nproc-per-node", "--nproc_per_node") == "4"
    assert option_from_cmdline(["--nproc-per-node", "2"], "--nproc-per-node") == "2"


@pytest.mark.parametrize("use_env, init", [(False, "env://"), (True, "tcp")])
def test_real_legacy_launch(tmp_path, tmp_path_factory, use_env, init):
    # --use_env also tries tcp:// as the init method, to run that through the CLI too.
    out = tmp_path / "run"
    init_args = [] if init == "env://" else ["--init-method", f"tcp://127.0.0.1:{free_port()}"]
    proc = run([sys.executable, "-m", "torch.distributed.launch", *(["--use_env"] * use_env),
                "--nproc-per-node", "2", ENGINE_RUN, *train_args(out), *ONE_THREAD,
                *init_args])
    assert finished(out, "legacy")["weights_sha256"] == reference_digest(tmp_path_factory)
    # Rank 0 says it once (torch's own FutureWarning is separate).
    assert proc.stderr.count("warning: python -m torch.distributed.launch is deprecated "
                             "and torchrun replaces it") == 1
