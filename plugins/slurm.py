"""Launcher ``slurm``: tasks started by ``srun``, in either of the seeds' two layouts.

One task per process (per GPU): ``srun --ntasks-per-node=G engine-run RECIPE``; every
task is one rank. One task per node: ``srun --ntasks-per-node=1 engine-run RECIPE
[--nproc G]``; every task starts G local processes (default: the GPUs it sees, else 1),
and the ranks are task * G + i. Either way:

- rank from SLURM_PROCID, tasks from SLURM_STEP_NUM_TASKS (SLURM_NTASKS), local rank
  from SLURM_LOCALID, node rank from SLURM_NODEID;
- master address: MASTER_ADDR if set, else the first host of the step's node list
  (SLURM_STEP_NODELIST; SLURM_JOB_NODELIST outside a step variable), where task 0 runs;
  expanded in Python (plugins/slurm_hostlist.py) and cross-checked with ``scontrol``;
- master port: MASTER_PORT if set, else 15000 + the last four digits of SLURM_JOB_ID;
- CPUs: each task has SLURM_CPUS_PER_TASK of its own; a task that starts G processes
  gives each of them a G-th (the world's ``cpus``, which sets the torch threads and
  ``num_workers=auto``). Without the variable, the default rule of
  :meth:`engine.world.World.cpu_share`.

After a pre-emption snapshot, rank 0 of a SLURM job (whatever launched it: srun tasks,
or a batch script running engine-run with spawn) runs ``scontrol requeue`` on the job
(``engine_requeue``).

The step's own variables are read rather than the job's: inside ``sbatch -N2
--ntasks-per-node=2``, ``srun -N1 -n1`` still sees SLURM_NTASKS_PER_NODE=2 and the job's
two-node list. Numbers that do not add up are an error before any process starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable, Mapping

import engine
from engine.plugins import slurm_hostlist as slurm
from engine.errors import LaunchError
from engine.launch_env import check_port_free, int_variable, is_local_address, require_variables
from engine.launcher import Launcher
from engine.processes import spawn_workers
from engine.world import CpuShare, World, share_cpus

#: Step ids that are shells or bookkeeping, not tasks: SLURM's interactive step,
#: batch script and external step, by name and by number.
NOT_TASK_STEPS = {"interactive", "batch", "extern", "4294967290", "4294967291",
                  "4294967292", "4294967294", "4294967295"}
#: Job names of interactive shells (salloc, srun --pty bash).
SHELL_JOB_NAMES = {"bash", "sh", "zsh", "fish", "tcsh", "csh", "interactive"}

REQUIRED = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")


def _step_id(environ) -> str:
    return environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or ""


def _first(environ, *names: str) -> tuple[str, str]:
    """(name, value) of the first variable that is set; ("", "") if none."""
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return "", ""


def visible_gpus(environ) -> int:
    """GPUs this task may use, from the variables (no CUDA initialisation here)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
    gpus = environ.get("SLURM_GPUS_ON_NODE", "")
    return int(gpus) if gpus.isdigit() else 0


class SlurmLauncher(Launcher):
    name = "slurm"
    priority = 30
    # srun restarts nothing: SLURM starts a failed job again by requeueing it.
    restarts_with = ("sbatch --requeue (the requeued job resumes from its newest "
                     "snapshot)")
    reads = REQUIRED + (
        "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_STEP_NUM_NODES",
        "SLURM_NNODES", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
        "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
        "SLURM_CPUS_PER_TASK", "SLURM_JOB_NAME", "SLURMD_NODENAME", "SLURM_RESTART_COUNT",
        "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls, environ, options) -> bool:
        step = _step_id(environ)
        if not step or not environ.get("SLURM_PROCID") or step in NOT_TASK_STEPS:
            return False
        if environ.get("SLURM_JOB_NAME", "") in SHELL_JOB_NAMES:
            # A shell started by srun --pty (one task) is where people type engine-run
            # by hand: spawn there. A step of several tasks is a real launch.
            _, tasks = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
            return tasks.isdigit() and int(tasks) > 1
        return True

    @classmethod
    def explain_detection(cls, environ, options) -> str:
        step = _step_id(environ)
        if not environ.get("SLURM_JOB_ID"):
            return "no SLURM_JOB_ID (not in a SLURM job)"
        if not step:
            return ("in a SLURM allocation but not in a job step (salloc shell or batch "
                    "script): run engine-run under srun, or pass --launcher slurm")
        if step in NOT_TASK_STEPS:
            return (f"SLURM_STEP_ID={step} is an interactive/batch step, not an srun task; "
                    "pass --launcher slurm to use it anyway")
        if cls.detect(environ, options):
            return (f"task {environ.get('SLURM_PROCID')} of job step "
                    f"{environ['SLURM_JOB_ID']}.{step}")
        return (f"job name {environ.get('SLURM_JOB_NAME')!r} looks like an interactive "
                "shell; pass --launcher slurm to use the SLURM variables")

    # ----------------------------------------------------------------- worlds

    @property
    def spawns(self) -> bool:
        return self.processes_per_task > 1

    @property
    def processes_per_task(self) -> int:
        if self.options.nproc is not None:
            if self.options.nproc < 1:
                raise LaunchError(f"--nproc {self.options.nproc} must be >= 1")
            return self.options.nproc
        tasks_here = self._numbers()["tasks_per_node"][self._numbers()["node_id"]]
        gpus = visible_gpus(self.environ)
        # One task on this node and several GPUs: the task-per-node layout.
        return gpus if tasks_here == 1 and gpus > 1 else 1

    def _numbers(self) -> dict:
        if hasattr(self, "_cached_numbers"):
            return self._cached_numbers
        env = self.environ
        require_variables(env, REQUIRED, self.name)
        tasks_var, _ = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        list_var, nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                    "SLURM_NODELIST")
        if not tasks_var or not list_var:
            missing = [] if tasks_var else ["SLURM_NTASKS (or SLURM_STEP_NUM_TASKS)"]
            missing += [] if list_var else ["SLURM_JOB_NODELIST (or SLURM_STEP_NODELIST)"]
            raise LaunchError(
                f"launcher 'slurm' needs the environment variables {', '.join(missing)}, "
                "which are not set; was this process started by srun?")
        ntasks = int_variable(env, tasks_var, self.name)
        hosts = slurm.hostnames(nodelist, list_var)
        step_vars = list_var == "SLURM_STEP_NODELIST"
        nodes_var, nodes_text = _first(env, *(("SLURM_STEP_NUM_NODES",) if step_vars else
                                              ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")))
        nnodes = int_variable(env, nodes_var, self.name) if nodes_var else len(hosts)
        if nnodes != len(hosts):
            raise LaunchError(
                f"{nodes_var}={nnodes} but {list_var}={nodelist!r} names {len(hosts)} "
                f"host(s) ({', '.join(hosts[:6])}{'...' if len(hosts) > 6 else ''})")
        per_node_var, per_node_text = _first(
            env, *(("SLURM_STEP_TASKS_PER_NODE",) if step_vars else
                   ("SLURM_TASKS_PER_NODE",)))
        if per_node_var:
            tasks_per_node = slurm.expand_tasks_per_node(per_node_text, per_node_var)
        elif ntasks % nnodes == 0:
            tasks_per_node = [ntasks // nnodes] * nnodes
        else:
            raise LaunchError(
                f"{tasks_var}={ntasks} does not split over {nnodes} node(s) and "
                "SLURM_TASKS_PER_NODE is not set")
        if len(tasks_per_node) != nnodes or sum(tasks_per_node) != ntasks:
            raise LaunchError(
                f"{per_node_var}={per_node_text!r} ({sum(tasks_per_node)} tasks on "
                f"{len(tasks_per_node)} node(s)) does not add up to {tasks_var}={ntasks} "
                f"on {nnodes} node(s)")
        if not step_vars and env.get("SLURM_NTASKS_PER_NODE"):
            # Only outside a step: a step may use fewer tasks than the job asked for.
            per_node = int_variable(env, "SLURM_NTASKS_PER_NODE", self.name)
            if per_node * nnodes != ntasks:
                raise LaunchError(
                    f"SLURM_NTASKS_PER_NODE={per_node} x {nnodes} node(s) != "
                    f"{tasks_var}={ntasks}")
        procid = int_variable(env, "SLURM_PROCID", self.name)
        node_id = int_variable(env, "SLURM_NODEID", self.name)
        local_id = int_variable(env, "SLURM_LOCALID", self.name)
        if not 0 <= procid < ntasks:
            raise LaunchError(
                f"SLURM_PROCID={procid} is outside {tasks_var}={ntasks} (0..{ntasks - 1})")
        if not 0 <= node_id < nnodes:
            raise LaunchError(
                f"SLURM_NODEID={node_id} is outside the {nnodes} node(s) of {list_var}")
        if not 0 <= local_id < tasks_per_node[node_id]:
            raise LaunchError(
                f"SLURM_LOCALID={local_id} is outside the {tasks_per_node[node_id]} "
                f"task(s) on node {node_id} ({per_node_var or tasks_var})")
        self._cached_numbers = {
            "ntasks": ntasks, "hosts": hosts, "tasks_per_node": tasks_per_node,
            "procid": procid, "node_id": node_id, "local_id": local_id,
        }
        return self._cached_numbers

    def master(self) -> tuple[str, int, str]:
        """(address, port, where the port came from)."""
        env = self.environ
        addr = env.get("MASTER_ADDR") or self._numbers()["hosts"][0]
        if env.get("MASTER_PORT"):
            return addr, int_variable(env, "MASTER_PORT", self.name), "MASTER_PORT"
        job = env["SLURM_JOB_ID"]
        return addr, slurm.master_port_for_job(job), f"derived from SLURM_JOB_ID={job}"

    def cpus_per_process(self) -> CpuShare | None:
        """SLURM gives each task SLURM_CPUS_PER_TASK CPUs of its own: all of them for a
        task that is one process, shared by the processes a task starts. None (the
        default rule) when the step did not ask for CPUs per task."""
        allocated = slurm.allocated_cpus(self.environ)
        if allocated is None:
            return None
        return share_cpus(*allocated, self.processes_per_task)

    def worlds(self) -> list[World]:
        n = self._numbers()
        per_task = self.processes_per_task
        addr, port, _ = self.master()
        env = self.environ
        node_id = n["node_id"]
        host = env.get("SLURMD_NODENAME") or n["hosts"][node_id]
        run_id = f"{env['SLURM_JOB_ID']}.{_step_id(env) or 'batch'}"
        if env.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
            run_id += f".r{env['SLURM_RESTART_COUNT']}"
        layout = tuple((h, count * per_task) for h, count in zip(n["hosts"],
                                                                  n["tasks_per_node"]))
        worlds = [
            World(
                rank=n["procid"] * per_task + i,
                local_rank=n["local_id"] * per_task + i,
                world_size=n["ntasks"] * per_task,
                local_world_size=n["tasks_per_node"][node_id] * per_task,
                node_rank=node_id,
                num_nodes=len(n["hosts"]),
                master_addr=addr,
                master_port=port,
                init_method=self.options.init_method,
                launcher=self.name,
                restart_count=int_variable(env, "SLURM_RESTART_COUNT", self.name,
                                           default=0),
                run_id=run_id,
                host=host,
                layout=layout,
                cpus=self.cpus_per_process(),
            )
            for i in range(per_task)
        ]
        for w in worlds:
            w.check()
        return worlds

    # ----------------------------------------------------------------- launch

    def launch(self, worker: Callable[[World], object]) -> list:
        worlds = self.worlds()
        first = worlds[0]
        if first.is_rank0 and first.init_method == "env://":
            addr, port, source = self.master()
            if is_local_address(addr):
                check_port_free(addr, port, f"MASTER_PORT=PORT in the job's environment "
                                            f"(the port was {source})")
        if len(worlds) == 1:
            return [worker(first)]
        return spawn_workers(worker, worlds)  # each world carries its share of the CPUs


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add(SlurmLauncher)


# ------------------------------------------------------------------ requeue


def job_to_requeue(environ: Mapping[str, str]) -> str | None:
    """The id that ``scontrol requeue`` wants: ARRAYJOB_TASK for array jobs."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get(
        "SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID")


def requeue(environ: Mapping[str, str]) -> str | None:
    """Ask SLURM to requeue this job. Returns what happened, for the log, or None
    outside a SLURM job; never raises."""
    job = job_to_requeue(environ)
    if not job:
        return None
    scontrol = shutil.which("scontrol", path=environ.get("PATH", os.defpath))
    if scontrol is None:
        return (f"scontrol not found on PATH: job {job} was not requeued; resubmit it to "
                "resume from the snapshot")
    try:
        proc = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed: {exc}"
    if proc.returncode != 0:
        return f"scontrol requeue {job} failed: {(proc.stderr or proc.stdout).strip()}"
    return f"job {job} requeued"


@engine.hookimpl
def engine_cpu_allocation(environ):
    return slurm.allocated_cpus(environ)


@engine.hookimpl
def engine_requeue(ctx):
    return requeue(os.environ)


def sbatch_command(argv) -> int:
    # The command's module, when the command runs: it imports engine.cli, engine.launching
    # and the plugin manager, which loads this plugin (a cycle at the top).
    from engine.plugins import slurm_sbatch

    return slurm_sbatch.main(argv)


@engine.hookimpl
def engine_register_commands():
    return {"sbatch": sbatch_command}
