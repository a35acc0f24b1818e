"""plugins/slurm.py: tasks started by srun, in both layouts, on the real four-node
cluster of tools/slurm_cluster.sh (tests/slurm_cluster.py says whether it is up), and
the variables checked before anything starts."""

from __future__ import annotations

import re
import socket

import pytest

from engine.errors import LaunchError
from engine.launcher import LaunchOptions
from engine.plugin_manager import build_plugin_manager
from engine.plugins.slurm import SlurmLauncher, job_to_requeue, requeue
from tests.conftest import ENGINE_RUN, REPO, engine_env, read_summary, run_cli
from tests.plugins.launch_runs import (LATE_S, RECIPE, STOP_TIMEOUT_S, finished,
                                       reference_digest, run, run_with_a_stopped_rank,
                                       train_args)

# srun -N1 -n2 -c1: two tasks on node n2 (tasks 0 and 1).
STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n2",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NAME": "train", "SLURMD_NODENAME": "n2"}
# srun -N3 -n5 on gpu[01-03] (2, 2, 1 tasks), this task the last one.
UNEVEN = {**STEP, "SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
          "SLURM_NTASKS": "5", "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_NUM_NODES": "3",
          "SLURM_STEP_NODELIST": "gpu[01-03]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
          "SLURMD_NODENAME": "gpu03"}


def worlds_of(env, **options):
    return SlurmLauncher(LaunchOptions(**options), env).worlds()


def test_one_task_per_process():
    (w,) = worlds_of(STEP)
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.node_rank,
            w.num_nodes, w.host, w.launcher, w.run_id) == (
        1, 1, 2, 2, 0, 1, "n2", "slurm", "1234.0")
    # The step's first node is the master (not the job's), the port comes from the job id.
    assert (w.master_addr, w.master_port) == ("n2", 15000 + 1234)


def test_one_task_per_node_starting_its_processes():
    launcher = SlurmLauncher(LaunchOptions(nproc=4), UNEVEN)
    assert launcher.spawns
    worlds = launcher.worlds()
    assert [(w.rank, w.local_rank, w.world_size, w.local_world_size, w.node_rank)
            for w in worlds] == [(16 + i, i, 20, 4, 2) for i in range(4)]
    assert [(w.rank, w.host) for w in launcher.all_worlds()][::4] == [
        (0, "gpu01"), (4, "gpu01"), (8, "gpu02"), (12, "gpu02"), (16, "gpu03")]


def test_gpus_of_a_lone_task_decide_its_processes():
    env = {**UNEVEN, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert len(worlds_of(env)) == 4  # one task on gpu03, four GPUs: four processes
    env = {**STEP, "CUDA_VISIBLE_DEVICES": "0,1"}
    assert len(worlds_of(env)) == 1  # two tasks on the node: one process each


def test_each_task_has_its_cpus_and_a_task_shares_them_among_its_processes():
    """The CPU rule of slurm: SLURM_CPUS_PER_TASK is one task's, whole for a task that
    is one process, shared by the processes a task starts; the world carries it (the
    children of a task see the task's variables)."""
    (w,) = worlds_of({**STEP, "SLURM_CPUS_PER_TASK": "6"})
    assert (w.cpu_share().count, w.cpu_share().reason) == (
        6, "6 CPUs (SLURM_CPUS_PER_TASK) for this process")
    spawned = worlds_of({**UNEVEN, "SLURM_CPUS_PER_TASK": "8"}, nproc=4)
    assert {(w.cpu_share().count, w.cpu_share().reason) for w in spawned} == {
        (2, "8 CPUs (SLURM_CPUS_PER_TASK) shared by 4 local processes = 2 each")}
    # Without the variable, the default rule: the machine's CPUs shared by this node's
    # processes (both tasks of STEP run here).
    (w,) = worlds_of({k: v for k, v in STEP.items() if k != "SLURM_CPUS_PER_TASK"})
    assert w.cpus is None and w.cpu_share().reason.endswith("shared by 2 local processes "
                                                            f"= {w.cpu_share().count} each")


def test_master_variables_win():
    (w,) = worlds_of({**STEP, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "23456"})
    assert (w.master_addr, w.master_port) == ("10.1.1.1", 23456)


@pytest.mark.parametrize("change, message", [
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     "SLURM_STEP_TASKS_PER_NODE='2(x2)' (4 tasks on 2 node(s)) does not add up to "
     "SLURM_STEP_NUM_TASKS=2 on 1 node(s)"),
    ({"SLURM_STEP_NUM_NODES": "2"},
     "SLURM_STEP_NUM_NODES=2 but SLURM_STEP_NODELIST='n2' names 1 host(s) (n2)"),
    ({"SLURM_STEP_NODELIST": "n[2-"},
     "SLURM_STEP_NODELIST='n[2-' does not parse as a SLURM node list: a '[' is never closed"),
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is outside SLURM_STEP_NUM_TASKS=2 (0..1)"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is outside the 2 task(s) on node 0"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_STEP_TASKS_PER_NODE": None,
      "SLURM_STEP_NUM_NODES": None, "SLURM_STEP_NUM_TASKS": None, "SLURM_JOB_NODELIST": "n2",
      "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS_PER_NODE": "4"},
     "SLURM_NTASKS_PER_NODE=4 x 1 node(s) != SLURM_NTASKS=2"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
     "launcher 'slurm' needs the environment variables SLURM_JOB_NODELIST (or "
     "SLURM_STEP_NODELIST), which are not set"),
    ({"SLURM_NODEID": None}, "launcher 'slurm' needs the environment variables "
                             "SLURM_NODEID, which is not set"),
])
def test_variables_that_do_not_add_up(change, message, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the parser's verdict, not scontrol's
    env = {k: v for k, v in {**STEP, **change}.items() if v is not None}
    with pytest.raises(LaunchError) as err:
        worlds_of(env)
    assert str(err.value).startswith(message)


# ---------------------------------------------------------------- requeue


def test_requeue_reports_a_missing_scontrol(tmp_path):
    message = requeue({"SLURM_JOB_ID": "4242", "PATH": str(tmp_path)})
    assert message == ("scontrol not found on PATH: job 4242 was not requeued; resubmit it "
                       "to resume from the snapshot")


def test_array_jobs_are_requeued_by_their_array_id():
    env = {"SLURM_JOB_ID": "100", "SLURM_ARRAY_JOB_ID": "90", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_to_requeue(env) == "90_3"
    assert job_to_requeue({"SLURM_JOB_ID": "100"}) == "100"
    assert requeue({}) is None  # not a SLURM job: another scheduler's plugin may answer


def test_the_slurm_plugin_answers_the_cpu_allocation_of_a_slurm_job_only():
    """engine_cpu_allocation: the slurm plugin's answer is what spawn, torchrun and
    legacy share among their processes (they import nothing of the slurm plugin); a
    third-party scheduler's plugin answers for its own jobs."""
    hook = build_plugin_manager().hook.engine_cpu_allocation
    assert hook(environ={"SLURM_CPUS_PER_TASK": "12"}) == (12, "SLURM_CPUS_PER_TASK")
    assert hook(environ={"SLURM_JOB_ID": "42"}) is None  # no CPUs asked per task

    class Scheduler:
        @staticmethod
        def engine_cpu_allocation(environ):
            return (int(environ["MY_CPUS"]), "MY_CPUS") if "MY_CPUS" in environ else None

    pm = build_plugin_manager()
    pm.register(Scheduler, "scheduler")
    assert pm.hook.engine_cpu_allocation(environ={"MY_CPUS": "3"}) == (3, "MY_CPUS")


def test_the_requeue_hook_answers_for_slurm_jobs_only(tmp_path, monkeypatch):
    """engine_requeue is first-result: the slurm plugin answers inside a SLURM job
    (whatever launched the processes) and leaves other jobs to other plugins."""
    class Scheduler:
        @staticmethod
        def engine_requeue(engine):
            return "requeued by another scheduler"

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert build_plugin_manager().hook.engine_requeue(engine=None) is None
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol here
    assert build_plugin_manager().hook.engine_requeue(engine=None) == (
        "scontrol not found on PATH: job 4242 was not requeued; resubmit it to resume "
        "from the snapshot")
    monkeypatch.delenv("SLURM_JOB_ID")
    pm = build_plugin_manager(objects={"scheduler": Scheduler()})
    assert pm.hook.engine_requeue(engine=None) == "requeued by another scheduler"


# ---------------------------------------------------------------- the cluster


# tests/conftest.py fails these when the cluster is down (or skips them with
# ENGINE_TEST_NO_SLURM=1): tests/slurm_cluster.py.
cluster = pytest.mark.slurm


def srun(*args: str, timeout: float = 300, check: bool = True):
    # -c1: one CPU per task, so SLURM_CPUS_PER_TASK sets one thread per process, as the
    # reference run has. --kill-on-bad-exit: one failed task stops the step.
    return run(["srun", "--kill-on-bad-exit=1", *args], timeout=timeout, check=check)


@cluster
def test_one_task_per_node_on_two_nodes(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    srun("-N2", "-n2", "-c1", ENGINE_RUN, *train_args(out), "-v")
    assert finished(out, "slurm")["weights_sha256"] == reference_digest(tmp_path_factory)


@cluster
def test_four_nodes_one_task_each(tmp_path):
    """More than two nodes: the step's hostlist n[1-4] expands, rank 0 is on the first of
    four nodes and every node holds one rank, and the four ranks end on the same weights."""
    out = tmp_path / "run"
    proc = srun("-N4", "-n4", "-c1", ENGINE_RUN, *train_args(out), "-v")
    table = proc.stdout.split("world:\n")[1].splitlines()[:5]
    assert [row.split()[:3] for row in table] == [
        ["rank", "local", "node"], ["0", "0", "0"], ["1", "0", "1"], ["2", "0", "2"],
        ["3", "0", "3"]]
    summary = read_summary(out)
    assert (summary["status"], summary["world_size"], summary["launcher"]) == (
        "completed", 4, "slurm")
    assert summary["weights_sha256_per_rank"] == [summary["weights_sha256"]] * 4


@cluster
def test_one_task_per_process_on_one_node(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    proc = srun("-N1", "-n2", "-c1", ENGINE_RUN, *train_args(out), "-v")
    assert finished(out, "slurm")["weights_sha256"] == reference_digest(tmp_path_factory)
    # Rank 0 printed the world it detected: two ranks on one node, master derived.
    table = proc.stdout.split("world:\n")[1].splitlines()[:3]
    assert [row.split()[:3] for row in table] == [["rank", "local", "node"],
                                                   ["0", "0", "0"], ["1", "1", "0"]]


@cluster
def test_a_stopped_task_ends_the_step_within_the_timeout(tmp_path):
    """srun without --kill-on-bad-exit waits for every task: with rank 1 stopped
    (SIGSTOP), for ever. Rank 0 names it after timeout_s and kills it as it exits."""
    stopped = run_with_a_stopped_rank(["srun", "-N1", "-n2", "-c1"], tmp_path / "run")
    assert stopped.proc.returncode != 0
    assert ("rank 0: a collective operation failed at step 3: rank(s) 1 stopped answering "
            "(rank(s) 1: its process on this machine is stopped, by SIGSTOP or a "
            "debugger, and is killed so that the job ends)") in stopped.proc.stderr
    assert "task 1: Killed" in stopped.proc.stderr
    print(f"ended {stopped.ended:.1f}s after the stop (timeout_s={STOP_TIMEOUT_S})")
    assert stopped.ended < STOP_TIMEOUT_S + LATE_S, stopped.lines


@cluster
def test_sbatch_script_runs_one_task_per_node_that_spawns(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    script = run_cli("sbatch", *train_args(out), "--nodes", "1", "--procs-per-node", "2",
                     "--cpus-per-task", "2", "--layout", "task-per-node", check=True).stdout
    job = tmp_path / "job.sh"
    job.write_text(script)
    out.mkdir()  # what the script's "Submit with" line says: SLURM does not create it
    submitted = run(["sbatch", "--wait", str(job)], timeout=400)
    job_id = submitted.stdout.split()[-1]
    log = (out / f"slurm-{job_id}.out").read_text()
    assert "done: 1 epoch in" in log, log
    summary = finished(out, "slurm")
    # Two processes started by one task: the task's 2 CPUs shared, one thread each.
    assert summary["weights_sha256"] == reference_digest(tmp_path_factory)


@cluster
def test_both_layouts_give_each_process_its_share_of_the_tasks_cpus():
    """The CPU rule on a real step: one task of 2 CPUs that starts 2 processes, and 2
    tasks of 1 CPU, give each process 1 thread, and num_workers=auto counts the same
    share (the plan rank 0 prints is what each worker sets)."""
    def plan(srun_args: list[str], engine_args: list[str]) -> dict[str, str]:
        proc = srun("-N1", *srun_args, ENGINE_RUN, RECIPE, "data.source=synthetic",
                    "num_workers=auto", *engine_args, "--dry-run", timeout=200)
        section = proc.stdout.split("plan:\n")[1].split("world:\n")[0]
        return dict(row.split(None, 1) for row in section.splitlines())

    spawning = plan(["-n1", "-c2"], ["--nproc", "2"])
    per_process = plan(["-n2", "-c1"], [])
    # (each row goes on to say why: the CPUs the task's processes share)
    assert [spawning["threads"].split(" (")[0], per_process["threads"].split(" (")[0]] == [
        "1 per process", "1 per process"]
    assert "auto: 2 CPUs (SLURM_CPUS_PER_TASK) shared by 2 local processes = 1 each" in \
        spawning["num_workers"]
    assert "auto: 1 CPU (SLURM_CPUS_PER_TASK) for this process" in per_process["num_workers"]


@cluster
def test_doctor_in_every_task():
    proc = srun("-N2", "-n2", ENGINE_RUN, "doctor", timeout=200)
    assert proc.stdout.count("ok      launcher slurm (detected)") == 2
    assert "ranks 0 of 2" in proc.stdout and "ranks 1 of 2" in proc.stdout


@cluster
def test_master_port_in_use_stops_the_step_early(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = engine_env(MASTER_PORT=str(port))
        proc = run(["srun", "--kill-on-bad-exit=1", "-N1", "-n2", "-c1", ENGINE_RUN,
                    *train_args(tmp_path / "run"), "timeout_s=20"], env=env, check=False,
                   timeout=200)
    assert proc.returncode != 0
    assert re.search(f"engine-run: error: master port {port} on n[1-4] is already in use; "
                     "choose another with MASTER_PORT=PORT in the job's environment \\(the "
                     "port was MASTER_PORT\\)", proc.stderr), proc.stderr


@cluster
def test_a_nodelist_that_does_not_parse_stops_every_task(tmp_path):
    proc = run(["srun", "-N1", "-n1", "env", "SLURM_STEP_NODELIST=n[1-", ENGINE_RUN,
                *train_args(tmp_path / "run")], check=False, timeout=200)
    assert proc.returncode == 2
    assert "engine-run: error: SLURM_STEP_NODELIST='n[1-' does not parse as a SLURM node " \
           "list: a '[' is never closed" in proc.stderr


def test_cluster_script_is_executable():
    # .ci/run starts the cluster only when the script is executable.
    assert (REPO / "tools" / "slurm_cluster.sh").stat().st_mode & 0o111
