"""``engine-run sbatch``: print a SLURM batch script that trains a recipe (a command of
the slurm plugin, see ``engine_register_commands`` in plugins/slurm.py).

    engine-run sbatch recipes/cifar_ddp.py --nodes 2 --gpus-per-node 4 --cpus-per-task 16
    engine-run sbatch recipes/cifar_ddp.py epochs=10 --nodes 2 --gpus-per-node 4 \\
        --layout task-per-node --time 04:00:00 --partition gpu > job.sh && sbatch job.sh

The seeds' two layouts:

- ``task-per-gpu`` (default): ``--ntasks-per-node`` = processes per node, one rank per
  task; ``--cpus-per-task`` CPUs for each of them.
- ``task-per-node``: one task per node that starts the node's processes itself
  (``engine-run --nproc P``); the task's ``--cpus-per-task`` CPUs are shared by them.

Both request the GPUs per node (``--gres=gpu:G``), send SIGUSR1 ``--signal-seconds``
before the time limit (every rank snapshots and stops, and the job is requeued and
resumes: engine/preemption.py), and log to ``OUT_DIR/slurm-<jobid>.out``. SLURM does not
create the log folder, and printing a script writes nothing: when the folder does not
exist yet, the script's "Submit with" line creates it (``mkdir -p DIR && sbatch``) and a
note on stderr says so. ``engine-run`` is called by its absolute path, so the job uses
the same installation as the command that wrote the script.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import shutil
import sys

from engine.cli import plugin_args
from engine.errors import ConfigError
from engine.launching import RecipeJob
from engine.plugin_manager import build_plugin_manager
from engine.plugins.slurm import SlurmLauncher
from engine.run_dir import fixed_part

LAYOUTS = ("task-per-gpu", "task-per-node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-run sbatch",
                                description="Print an sbatch script for a recipe.")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node (0: CPU processes with gloo)")
    p.add_argument("--procs-per-node", type=int,
                   help="training processes per node (default: one per GPU, or 1)")
    p.add_argument("--cpus-per-task", type=int, default=1)
    p.add_argument("--layout", default="task-per-gpu", help=" or ".join(LAYOUTS))
    p.add_argument("--time", help="time limit, e.g. 04:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--mem", help="memory per node, e.g. 64G")
    p.add_argument("--job-name")
    p.add_argument("--signal-seconds", type=int, default=90,
                   help="SIGUSR1 this long before the time limit (0: none)")
    p.add_argument("--output-dir", help="folder of the SLURM log (default: the recipe's "
                                        "out_dir)")
    p.add_argument("--engine-run", help="path of engine-run on the nodes (default: this one)")
    p.epilog = "After --: more engine-run options for the srun line, e.g. -- --threads 4"
    return p


def main(argv) -> int:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_intermixed_args(argv)
    args.extra = extra
    print(make_script(args, argv_text=" ".join(shlex.quote(a) for a in argv)), end="")
    return 0


def make_script(args: argparse.Namespace, argv_text: str = "") -> str:
    nodes, gpus, cpus = args.nodes, args.gpus_per_node, args.cpus_per_task
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes} must be >= 1")
    if gpus < 0:
        raise ConfigError(f"--gpus-per-node {gpus} must be >= 0 (0: CPU processes)")
    if cpus < 1:
        raise ConfigError(f"--cpus-per-task {cpus} must be >= 1")
    if args.layout not in LAYOUTS:
        raise ConfigError(f"--layout {args.layout!r} is not one of: {', '.join(LAYOUTS)}")
    procs = args.procs_per_node or gpus or 1
    if procs < 1:
        raise ConfigError(f"--procs-per-node {procs} must be >= 1")
    if gpus and procs > gpus:
        raise ConfigError(
            f"--procs-per-node {procs} is more than --gpus-per-node {gpus}; parallel mode "
            "ddp needs one GPU per process")
    if args.signal_seconds < 0:
        raise ConfigError(f"--signal-seconds {args.signal_seconds} must be >= 0")

    # A wrong path, override or component name fails here, not in the job; the plugins
    # the srun line loads (-p after --) may add config groups.
    plugins = plugin_args(args.extra)
    job = RecipeJob(tuple(plugins), {}, recipe=args.recipe, overrides=tuple(args.overrides))
    recipe, cfg = job.load(build_plugin_manager(plugins))
    out_dir = cfg.out_dir
    # A pattern ({version}) is filled when the job starts: the log goes to its parent.
    log_dir = pathlib.Path(args.output_dir or fixed_part(out_dir))
    submit = "sbatch THIS_FILE"
    if not log_dir.is_dir():
        # SLURM opens the log before the script runs, so the script cannot create it.
        submit = f"mkdir -p {shlex.quote(str(log_dir))} && {submit}"
        print(f"note: the log folder {log_dir} does not exist yet and SLURM does not create "
              f"it: submit with `{submit}`", file=sys.stderr)
    engine_run = args.engine_run or _this_engine_run()

    per_node = args.layout == "task-per-node"
    tasks = 1 if per_node else procs
    what = (f"{nodes} node(s) x {procs} process(es) = {nodes * procs} ranks, "
            + ("one task per node starting its processes" if per_node
               else "one task per process"))
    lines = [
        "#!/bin/bash",
        f"# {recipe.name}: {what}.",
        "# Written by: engine-run sbatch " + argv_text,
        f"# Submit with: {submit}",
        f"#SBATCH --job-name={args.job_name or recipe.name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --cpus-per-task={cpus}",
    ]
    if gpus:
        lines.append(f"#SBATCH --gres=gpu:{gpus}")
    for option in ("time", "partition", "account", "mem"):
        value = getattr(args, option)
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    lines += [
        f"#SBATCH --chdir={os.getcwd()}",
        f"#SBATCH --output={log_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",  # a requeued run appends to the same log
    ]
    if args.signal_seconds:
        lines += [
            # No "B:": the signal goes to the srun tasks (engine-run), not to this shell.
            f"#SBATCH --signal=USR1@{args.signal_seconds}",
            "#SBATCH --requeue",
        ]
    command = [engine_run, args.recipe, *args.overrides, "--launcher", SlurmLauncher.name]
    if per_node:
        command += ["--nproc", str(procs)]
    command += args.extra
    lines += [
        "",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        "# The master is the first node of the step and the port 15000 + the job id's last",
        "# four digits; export MASTER_ADDR / MASTER_PORT here to choose others.",
        "srun --kill-on-bad-exit=1 " + " ".join(shlex.quote(c) for c in command),
        "",
    ]
    if args.signal_seconds:
        lines.insert(lines.index("set -euo pipefail"),
                     f"# SIGUSR1 {args.signal_seconds}s before the time limit: every rank "
                     "saves a snapshot and stops,\n# the job is requeued and resumes "
                     f"from {out_dir}.")
    return "\n".join(lines)


def _this_engine_run() -> str:
    here = pathlib.Path(sys.argv[0])
    if here.name == "engine-run" and here.exists():
        return str(here.resolve())
    found = shutil.which("engine-run") or str(pathlib.Path(sys.executable).parent /
                                              "engine-run")
    return str(pathlib.Path(found).resolve())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
