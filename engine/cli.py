"""``engine-run``: the command line: ``engine-run RECIPE [key=value ...] [options]``
trains, ``engine-run COMMAND`` runs one of :data:`COMMANDS` (``--help`` lists them) or a
plugin's (the ``engine_register_commands`` hook)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from typing import Sequence

import engine
from engine import phases
from engine.errors import (EXIT_COMPLETED, EXIT_INTERRUPTED, EXIT_PREEMPTED, TRACEBACK_ENV,
                           EngineError, error_line, exit_code, traceback_wanted)
from engine.launching import Launch, RecipeJob, blaming_plugins
from engine.processes import exit_process

COMMANDS = {
    "plugins": "engine.commands.plugins",
    "doctor": "engine.commands.doctor",
    "tune-workers": "engine.commands.tune_workers",
    "runs": "engine.commands.runs",
    "report": "engine.commands.report",
    "export": "engine.commands.export",
    "shards": "engine.commands.shards",
}
#: What a command name looks like (a recipe is a path: it has a '/' or a '.').
COMMAND_NAME = re.compile(r"[a-z][a-z0-9-]*\Z")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes (docs/configuration.md, engine/errors.py): 0 completed, 1 the run
    failed, 2 usage or configuration, 75 pre-empted (run again to resume), 130
    interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--traceback" in argv:
        os.environ[TRACEBACK_ENV] = "1"  # the workers (spawned or adopted) see it too
    # engine-run --version, or after a recipe; a command's own options are its own.
    if "--version" in argv and not COMMAND_NAME.match(argv[0]):
        print(version_line())
        return EXIT_COMPLETED
    try:
        if argv and argv[0] in COMMANDS:
            return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
        command = plugin_command(argv)
        if command is not None:
            return command(argv[1:])
        return run(argv)
    except EngineError as exc:
        if traceback_wanted():
            traceback.print_exc()
        line = error_line(exc).removeprefix("engine-run: ")  # the run lock names its door
        print(f"engine-run: error: {line}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt as exc:  # engine.errors.Interrupted says what became of it
        print(f"engine-run: {exc or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


def version_line() -> str:
    """``engine-run 0.1.0 (torch 2.5.1, Python 3.11.7)``: torch's version from its
    installed metadata, without importing it (seconds)."""
    from importlib import metadata  # lazily: only --version reads it

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"engine-run {engine.__version__} (torch {torch_version}, Python {python})"


def plugin_command(argv: Sequence[str]):
    """The plugin command that ``argv[0]`` names (``sbatch``), or None."""
    if not argv or not COMMAND_NAME.match(argv[0]) or os.path.exists(argv[0]):
        return None
    # lazily: the built-in commands (engine-run runs, report...) start without it
    from engine.plugin_manager import build_plugin_manager

    return build_plugin_manager(plugin_args(argv)).commands().get(argv[0])


def plugin_args(argv: Sequence[str]) -> list[str]:
    """The ``-p`` values, read before the full parse (plugins may add options)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "-p" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("-p") and len(arg) > 2 and not arg.startswith("--"):
            found.append(arg[2:])
    return found


def choices(registry, default: str | None = None) -> dict[str, str]:
    """``metavar`` and ``help`` words for an option that names a component: whatever the
    registry holds, third-party plugins' components included."""
    names = ([default] if default == "auto" else []) + sorted(registry.names())
    text = "one of: " + ", ".join(names) if names else "none registered"
    if default:
        text += f" (default: {'detect' if default == 'auto' else default})"
    return {"metavar": "NAME", "help": text}


def build_parser(pm=None) -> argparse.ArgumentParser:
    """The ``engine-run RECIPE`` parser. With the plugin manager ``pm``, the component
    options list what its registries hold and ``-p`` the loaded plugins."""
    p = argparse.ArgumentParser(
        prog="engine-run",
        description="Train a recipe with DDP on whatever the machine or cluster offers. "
                    "Other commands: engine-run {%s} --help"
                    % ",".join([*COMMANDS, *(pm.commands() if pm else ())]),
    )
    p.add_argument("recipe", help="a recipe file, e.g. recipes/cifar_ddp.py")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides by dotted path, e.g. epochs=3 data.root=/data")
    p.add_argument("--config", metavar="FILE",
                   help="overrides from a .toml, .yaml or .json file (key=value given "
                        "here wins); a run's config.json reproduces that run")
    g = p.add_argument_group("launch")
    g.add_argument("--launcher", **(choices(pm.launchers, "auto") if pm else
                                    {"help": "a registered launcher (default: detect)"}))
    g.add_argument("--nproc", type=int, help="processes on this node (spawn)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes (spawn on several nodes)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's rank (spawn)")
    g.add_argument("--master-addr", help="address of the rank-0 node")
    g.add_argument("--master-port", type=int, help="a free TCP port on the rank-0 node")
    g.add_argument("--init-method", help="env:// (default), tcp://HOST:PORT, file:///path")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="spawn: after a worker fails, start all of them again, up to N "
                        "times; they resume from the newest snapshot (default: 0; under "
                        "torchrun: torchrun --max-restarts)")
    # torch.distributed.launch passes one of these to every worker.
    g.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank",
                   help=argparse.SUPPRESS)
    t = p.add_argument_group("training")
    t.add_argument("--parallel", **(choices(pm.parallel_modes, "auto") if pm else
                                    {"help": "a registered parallel mode (default: detect)"}))
    t.add_argument("--checkpointer", **(choices(pm.checkpointers, "torch-file") if pm else
                                        {"help": "a registered checkpointer"}))
    t.add_argument("--resume", metavar="PATH", help="resume from this snapshot")
    t.add_argument("--no-resume", action="store_true",
                   help="start fresh; refused where out_dir holds a run, unless "
                        "--overwrite or out_dir has {version}/{time}")
    t.add_argument("--overwrite", action="store_true",
                   help="start fresh, first deleting the run out_dir holds (snapshots, "
                        "summary.json, config.json and the files its loggers declare)")
    t.add_argument("--resume-anyway", action="store_true",
                   help="resume even if the config changed keys that break exact resume")
    t.add_argument("--threads", type=int, help="torch threads per process (default: "
                   "the CPUs the load leaves idle, shared by the processes)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config and the plan, then exit (with -v: "
                        "each key's allowed values and what it is)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the world table, and at the end how long each phase took")
    p.add_argument("--traceback", action="store_true",
                   help=f"print the traceback of every error (or set {TRACEBACK_ENV}=1)")
    p.add_argument("--version", action="store_true",
                   help="print the engine's and torch's versions and exit")
    loaded = f" (loaded: {', '.join(pm.infos)})" if pm else ""
    p.add_argument("-p", dest="plugins", action="append", default=[], metavar="NAME",
                   help=f"-p module.path loads a plugin, -p no:NAME disables one{loaded}; "
                        "engine-run plugins lists them with what they add")
    return p


def run(argv: Sequence[str]) -> int:
    from engine.plugin_manager import build_plugin_manager  # lazily: as plugin_command

    # --help works with a broken plugin installed: it is left out and named (a run
    # refuses to start with it).
    helping = "-h" in argv or "--help" in argv
    pm = build_plugin_manager(plugin_args(argv), keep_going=helping,
                              scratch_parser=build_parser() if helping else None)
    for broken in pm.broken:
        print(f"engine-run: warning: {broken.describe()}", file=sys.stderr)
    with blaming_plugins(pm):  # the plugins' options and hooks run here too
        return train(pm, argv)


def train(pm, argv: Sequence[str]) -> int:
    from engine import plan  # imports torch: lazily

    parser = build_parser(pm)
    pm.hook.engine_addoption.call_historic(kwargs={"parser": parser})
    args, extras = parser.parse_known_intermixed_args(argv)
    if extras:
        parser.error(unrecognized(extras))
    launch = Launch(RecipeJob.from_args(args), pm)
    worlds = launch.worlds
    the_plan = plan.make_plan(pm, launch.job.loaded_recipe(), launch.cfg, launch.launcher,
                              worlds, launch.job.options)
    show = worlds[0].is_rank0 or launch.launcher.spawns
    if args.dry_run:
        if show:
            print(plan.format_plan(launch.cfg, the_plan, worlds, describe=args.verbose))
        return EXIT_COMPLETED
    if args.verbose and show:
        print(plan.format_plan(launch.cfg, the_plan, worlds, config=False))
    phases.launching()
    statuses = launch.start().statuses
    phases.command_ended(args.verbose and show)
    if "interrupted" in statuses:  # Ctrl-C: rank 0 said where it stopped
        return EXIT_INTERRUPTED
    return EXIT_PREEMPTED if "preempted" in statuses else EXIT_COMPLETED


def unrecognized(extras: Sequence[str]) -> str:
    """argparse's error for arguments no option takes; ``--epochs 3`` is a config key
    given as an option: say how keys are given (``epochs=3``)."""
    keys, rest = [], list(extras)
    while rest:
        token = rest.pop(0)
        if not token.startswith("--") or len(token) < 3:
            continue
        name, sep, value = token[2:].partition("=")
        if not sep:
            value = rest.pop(0) if rest and not rest[0].startswith("-") else "true"
        keys.append(f"{name.replace('-', '_')}={value}")
    message = f"unrecognized arguments: {' '.join(extras)}"
    if keys:
        message += (f"; config keys are given as key=value ({' '.join(keys)}), and the "
                    "options are those of --help")
    return message


def console_main() -> None:
    """The ``engine-run`` command: :func:`main`, then the process ends as a spawned
    worker does (engine.processes.exit_process: exit handlers, flushed output, no
    interpreter teardown, which costs a torch program seconds after its work is done).
    Library callers use :func:`main`, which returns the exit code."""
    exit_process(main())


if __name__ == "__main__":
    console_main()
