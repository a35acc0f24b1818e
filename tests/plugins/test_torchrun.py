"""plugins/torchrun.py: workers started by the real torchrun, on one node, on two
"nodes" on loopback, and under the c10d rendezvous; and the variables it checks."""

from __future__ import annotations

import pytest

from engine.errors import LaunchError
from engine.launcher import LaunchOptions, free_port
from engine.plugin_manager import build_plugin_manager
from engine.plugins.torchrun import TorchrunLauncher
from tests.conftest import BIN, ENGINE_RUN
from tests.plugins.launch_runs import (LATE_S, ONE_THREAD, STOP_TIMEOUT_S, finished,
                                       reference_digest, run, run_together,
                                       run_with_a_stopped_rank, train_args)

TORCHRUN = str(BIN / "torchrun")
ENV = {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "3",
       "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
       "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}


def world_of(env, **options):
    (world,) = TorchrunLauncher(LaunchOptions(**options), env).worlds()
    return world


def test_variables_become_the_world():
    w = world_of(ENV)
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.node_rank,
            w.num_nodes, w.master_addr, w.master_port, w.restart_count, w.run_id,
            w.launcher) == (3, 1, 4, 2, 1, 2, "node0", 29400, 1, "job7", "torchrun")


def test_local_world_size_processes_share_the_machines_cpus():
    env = {**ENV, "SLURM_CPUS_PER_TASK": "16"}  # torchrun under srun, -c 16
    # The slurm plugin's answer, as engine-run asks it (engine_cpu_allocation).
    w = world_of(env, cpu_allocation=build_plugin_manager().hook.engine_cpu_allocation(
        environ=env))
    assert (w.cpu_share().count, w.cpu_share().reason) == (
        8, "16 CPUs (SLURM_CPUS_PER_TASK) shared by 2 local processes = 8 each")


def test_default_rdzv_id_is_not_a_run_id():
    assert world_of({**ENV, "TORCHELASTIC_RUN_ID": "none"}).run_id == ""


@pytest.mark.parametrize("change, message", [
    ({"GROUP_WORLD_SIZE": "3"}, "torchrun: LOCAL_WORLD_SIZE=2 x 3 node(s) "
                                "(GROUP_WORLD_SIZE=3) != WORLD_SIZE=4"),
    ({"GROUP_WORLD_SIZE": None, "WORLD_SIZE": "5", "RANK": "1"},
     "torchrun: LOCAL_WORLD_SIZE=2 x 0 node(s) (WORLD_SIZE / LOCAL_WORLD_SIZE = 2.5) != "
     "WORLD_SIZE=5"),
    ({"RANK": "4"}, "rank 4 is outside world size 4 (torchrun); ranks run from 0 to 3"),
    ({"LOCAL_RANK": "2"}, "local rank 2 is outside local world size 2 (torchrun)"),
    ({"MASTER_PORT": "http"}, "launcher 'torchrun': MASTER_PORT='http' is not an integer"),
    ({"LOCAL_WORLD_SIZE": None}, "launcher 'torchrun' needs the environment variables "
                                 "LOCAL_WORLD_SIZE, which is not set"),
])
def test_variables_that_do_not_add_up(change, message):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(LaunchError) as err:
        world_of(env)
    assert str(err.value).startswith(message)


def torchrun_cmd(out, *torchrun_args: str, target=(ENGINE_RUN,)) -> list[str]:
    return [TORCHRUN, *torchrun_args, *target, *train_args(out), *ONE_THREAD]


def test_standalone(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    proc = run(torchrun_cmd(out, "--standalone", "--nproc-per-node", "2"))
    assert finished(out, "torchrun")["weights_sha256"] == reference_digest(tmp_path_factory)
    assert "error" not in proc.stderr.lower()


def test_two_nodes_on_loopback(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    port = free_port()
    run_together([torchrun_cmd(out, "--nnodes", "2", "--node-rank", str(rank),
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--nproc-per-node", "1")
                  for rank in range(2)])
    assert finished(out, "torchrun")["weights_sha256"] == reference_digest(tmp_path_factory)


def test_c10d_rendezvous_with_the_module_form(tmp_path, tmp_path_factory):
    """torchrun -m engine: the documented alternative to $(which engine-run)."""
    out = tmp_path / "run"
    run(torchrun_cmd(out, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "c10d-test",
                     target=("-m", "engine")))
    assert finished(out, "torchrun")["weights_sha256"] == reference_digest(tmp_path_factory)


#: How long torchrun's own Python takes to exit once its agent is done, at most.
TORCHRUN_EXIT_S = 6

#: What the rank that waited in vain says about a stopped rank 1 on its machine.
STOPPED_RANK_1 = ("rank 0: a collective operation failed at step 3: rank(s) 1 stopped "
                  "answering (rank(s) 1: its process on this machine is stopped, by "
                  "SIGSTOP or a debugger, and is killed so that the job ends)")


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    """torchrun's agent answers a failed worker with SIGTERM to the others and a 30 s
    grace before SIGKILL, which a stopped worker cannot act on: the job ended 45 s after
    a stop with timeout_s=10. Rank 0 kills its stopped peer as it exits."""
    stopped = run_with_a_stopped_rank(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2"], tmp_path / "run")
    proc = stopped.proc
    assert proc.returncode == 1, proc.stderr
    assert STOPPED_RANK_1 in proc.stderr
    # The agent's verdict: rank 1 killed by SIGKILL, rank 0 with its own exit code...
    assert "exitcode  : -9" in proc.stderr and "exitcode  : 1 " in proc.stderr
    # ...within timeout_s + LATE_S of the stop (the agent's 30 s grace, the bug, would
    # be later still). Then torchrun's own interpreter exits, which frees every module
    # of torch: about 0.5 s on an idle machine, 3-4 s on two busy cores, out of the
    # engine's reach.
    verdict = stopped.seconds_until("Root Cause")
    print(f"verdict {verdict:.1f}s and exit {stopped.ended:.1f}s after the stop "
          f"(timeout_s={STOP_TIMEOUT_S})")
    assert verdict < STOP_TIMEOUT_S + LATE_S, stopped.lines
    assert stopped.ended < STOP_TIMEOUT_S + LATE_S + TORCHRUN_EXIT_S, stopped.ended
