"""The one launch layer under the three front doors: ``engine-run`` (engine/cli.py),
``engine.launch`` (engine/api.py, a loop you write) and ``engine.fit`` (below, a recipe
from Python).

A door describes the run as a *job*, a :class:`Worker` (:class:`RecipeJob`: a recipe
and the Trainer; ``engine.api.LoopJob``: the caller's function). :class:`Launch` sets it
up once, in the launching process::

    the arguments checked (check_arguments); the plugin manager
    job.configure: the config, its groups and overrides (finish_config: out_dir's
                   default, the component names; a recipe's checks that need no batch)
    a fresh start refused where out_dir holds a run, unless asked to overwrite
    choose_launcher, its worlds; the threads per process (choose_threads)
    Launch.start: a library door's spawned workers checked; launcher.launch(job)

and the launcher calls the job once in every worker (``Worker.__call__``): the plugin
manager and the config again, ``job.run`` (engine/context.py's lifecycle), an error
blamed on the plugin whose code raised it (printed with the rank, or raised to a
library door's caller), rank 0's value back to the launching process.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import multiprocessing
import os
import pathlib
import pickle
import re
import signal
import sys
import tempfile
import traceback
from typing import Any, Sequence

import attrs

from engine.errors import (EXIT_INTERRUPTED, CheckpointError, ConfigError, EngineError,
                           Interrupted, PeerFailed, PluginCodeError, error_line, exit_code,
                           traceback_wanted, warn)
from engine.launch_env import start_method
from engine.processes import exit_failed_worker, reports_to_launcher, with_rank
from engine.world import usable_cpus

# engine-run's start imports this module (engine.cli does): the engine modules that only
# a run needs (config, plugin_manager, launcher, run_dir, snapshot, recipe...) are
# imported inside the functions that use them, so that --help, --version and the
# commands start without them; engine.engine and worker_setup import torch.

#: What rank 0's value is called in the exchange folder of a library door.
RESULT_FILE = "result.pickle"
#: The 1-minute load average the default threads count, where set (choose_threads).
LOAD_ENV = "ENGINE_LOAD_AVERAGE"


@attrs.frozen
class Door:
    """A front door: its name in error lines, and how its user asks for things."""

    name: str  # engine-run, engine.fit, engine.launch
    fresh_start: str  # how a fresh start is asked for
    overwrite: str  # how to allow removing the run out_dir holds
    start_over: str  # both together, to start a finished run over
    #: A library door (Python): an error in the launching process reaches the caller as
    #: the exception itself, rank 0's value comes back, and spawned workers need a
    #: guarded script and a picklable job.
    library: bool = True


ENGINE_RUN = Door("engine-run", "--no-resume", "add --overwrite",
                  "--no-resume --overwrite", library=False)
FIT = Door("engine.fit", "engine.fit(resume=False)", "pass overwrite=True",
           "engine.fit(..., resume=False, overwrite=True)")
LAUNCH = Door("engine.launch", "engine.launch(resume=False)", "pass overwrite=True",
              "engine.launch(..., resume=False, overwrite=True)")


# ------------------------------------------------------- the launching process


def finish_config(pm, cfg, run_name: str):
    """The last steps of every job's config: ``out_dir`` defaults to ``runs/<run_name>``;
    every component it names is checked before any process starts."""
    if cfg.out_dir == "runs/default":
        cfg.out_dir = f"runs/{run_name}"
    if hasattr(cfg, "limit_batches"):  # a custom loop's config may not be a TrainConfig
        from engine.config import make_smoke_run

        make_smoke_run(cfg)  # limit_batches/smoke: one short epoch in out_dir-smoke
    if cfg.launcher != "auto":
        pm.launchers.get(cfg.launcher)
    if cfg.parallel != "auto":
        pm.parallel_modes.get(cfg.parallel)
    pm.checkpointers.get(cfg.checkpointer)
    return cfg


def library_options(resume: bool | str | os.PathLike, overwrite: bool,
                    threads: int | None = None, **launch: Any) -> dict[str, Any]:
    """``engine.options`` of a run started from Python, as engine-run's flags set them
    (``resume``: --no-resume, --resume PATH; ``overwrite``, ``threads``, nproc...)."""
    if isinstance(resume, os.PathLike):
        resume = os.fspath(resume)
    return {"no_resume": resume is False, "overwrite": resume is False and overwrite,
            # Anything but a bool or None stays, for check_arguments to refuse or take.
            "resume": None if resume is None or isinstance(resume, bool) else resume,
            "threads": threads, **launch}


def check_arguments(door: Door, options: dict) -> None:
    """The launch arguments, checked before any worker starts, in one line in the door's
    words: ``nproc`` and ``threads`` None or a positive int, ``resume`` a bool, None or
    the path of something that exists."""
    def asked(name: str, value: Any) -> str:
        return f"{door.name}({name}={value!r})" if door.library else f"--{name} {value!r}"

    for name, default in (("nproc", "one process per GPU, 2 without a GPU"),
                          ("threads", "the CPUs the load leaves idle, shared by the "
                                      "processes")):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConfigError(f"{asked(name, value)}: {name} must be a positive int"
                              f"{', or None' if door.library else ''} (default: {default})")
    resume = options.get("resume")
    if resume is not None and not isinstance(resume, str):
        raise ConfigError(f"{asked('resume', resume)}: resume must be True (the newest "
                          "snapshot in out_dir), False (start fresh) or the path of a "
                          "snapshot")
    if resume is not None and not os.path.exists(resume):
        raise CheckpointError(f"{asked('resume', resume)}: no such snapshot")


def launch_options(pm, cfg, options: dict):
    """The launcher's :class:`~engine.launcher.LaunchOptions`: the job's options (nproc,
    nnodes, node_rank, master_addr, master_port, local_rank, max_restarts) and the
    config's."""
    from engine.launcher import LaunchOptions

    nproc = options.get("nproc")
    if nproc is None and cfg.parallel != "auto" and getattr(
            pm.parallel_modes.get(cfg.parallel), "single_process", False):
        nproc = 1  # --parallel single or dp: one process, not one per GPU
    return LaunchOptions(nproc=nproc, nnodes=options.get("nnodes") or 1,
                         node_rank=options.get("node_rank") or 0,
                         master_addr=options.get("master_addr"),
                         master_port=options.get("master_port"),
                         init_method=cfg.init_method, timeout_s=cfg.timeout_s,
                         local_rank=options.get("local_rank"),
                         max_restarts=options.get("max_restarts") or 0,
                         cpu_allocation=pm.hook.engine_cpu_allocation(environ=os.environ))


@contextlib.contextmanager
def blaming_plugins(pm, spare: Sequence[BaseException] = ()):
    """An exception raised in a plugin's code (a launcher's, a hook's) becomes one that
    names the plugin; not those in ``spare``: a worker in this process raised them to a
    library caller, through the launcher's frames but not its doing."""
    from engine.plugin_manager import attribute

    try:
        yield
    except Exception as exc:
        blamed = exc if any(exc is e for e in spare) else attribute(pm, exc)
        if blamed is exc:
            raise
        raise blamed from exc


@attrs.frozen
class Finished:
    """What the workers of this node sent back: each one's run status ("completed",
    "preempted"; None where unknown) and, for a library door, rank 0's value (this
    node's first worker's on another node; None if none came back)."""

    statuses: list
    result: Any


def default_threads(cpus: int, load: float, processes: int) -> int:
    """Torch threads per process where none were asked for: the CPUs the load leaves idle
    shared by the processes, rounded; at least one, at most their share."""
    processes = max(1, processes)
    idle = max(0.0, cpus - load) / processes
    return max(1, min(cpus // processes, int(idle + 0.5)))


def choose_threads(share, processes: int) -> tuple[int, str]:
    """:func:`default_threads` here, and the plan's words for it. The load counts every
    CPU of the machine: left out where ours are fewer (a SLURM allocation's); LOAD_ENV,
    where set, stands for it (a test suite's runs pin it: the same threads every run)."""
    cpus, source = share.shared or usable_cpus()
    try:
        load = float(os.environ.get(LOAD_ENV) or (
            os.getloadavg()[0] if cpus >= (os.cpu_count() or cpus) else 0.0))
    except (OSError, ValueError):  # no load average here, or LOAD_ENV no number
        load = 0.0
    return default_threads(cpus, load, processes), (
        f"default: {cpus} CPU(s) ({source}), load {load:.1f}, {processes} process(es); "
        "--threads N sets it")


def warn_if_oversubscribed(local_processes: int, share, threads: int, door: Door) -> None:
    """Processes or threads beyond the CPUs this node may use take turns on them: a
    warning (the run is right, only slow, and a GPU node may not care)."""
    cpus, source = share.shared or usable_cpus()
    if local_processes > cpus:
        warn(f"{local_processes} processes on this node share {cpus} usable CPU(s) "
             f"({source}): each gets 1 torch thread and they take turns, so training "
             f"will be slow; --nproc {cpus} or fewer fits the CPUs")
    elif threads * local_processes > cpus:
        asked = (f"{door.name}(threads={threads})" if door.library
                 else f"--threads {threads}")
        warn(f"{asked} x {local_processes} process(es) = {threads * local_processes} torch "
             f"threads on {cpus} usable CPU(s) ({source}): they take turns, so training "
             f"will be slow; leave threads out (the default fits the CPUs and their load) "
             f"or ask for {max(1, cpus // local_processes)}")


class Launch:
    """A job set up in the launching process, ready to :meth:`start`. ``pm``: the plugin
    manager, when the door built it already (engine-run, for its parser)."""

    def __init__(self, job: "Worker", pm=None):
        from engine.launcher import check_max_restarts, choose_launcher
        from engine.plugin_manager import build_plugin_manager
        from engine.run_dir import refuse_fresh_start, refuse_smoke_over_a_run, refuse_unwritable

        self.job = job
        check_arguments(job.door, job.options)
        self.pm = build_plugin_manager(job.plugins) if pm is None else pm
        with blaming_plugins(self.pm):
            self.cfg = job.configure(self.pm)
            if getattr(self.cfg, "limit_batches", 0):
                # A smoke run starts afresh in its own folder, replacing only a smoke run.
                refuse_smoke_over_a_run(self.cfg.out_dir)
                self.job = job = attrs.evolve(job, options={
                    **job.options, "no_resume": True, "overwrite": True, "resume": None})
            refuse_unwritable(self.cfg.out_dir)
            if job.options.get("no_resume") and not job.options.get("overwrite"):
                # Before any process starts: what the user had is never removed unasked.
                refuse_fresh_start(self.cfg.out_dir, asked=job.door.fresh_start,
                                   overwrite=job.door.overwrite)
            self.launcher = choose_launcher(self.pm.launchers, self.cfg.launcher,
                                            launch_options(self.pm, self.cfg, job.options))
            check_max_restarts(self.launcher)
            self.worlds = self.launcher.worlds()
        share, local = self.worlds[0].cpu_share(), self.worlds[0].local_world_size
        if job.options.get("threads") is None:  # chosen once, here: every worker the same
            threads, why = choose_threads(share, local)
            self.job = job = attrs.evolve(job, options={**job.options, "threads": threads,
                                                        "threads_chosen": why})
        warn_if_oversubscribed(len(self.worlds) if self.launcher.spawns else 1, share,
                               job.options["threads"], job.door)

    def start(self) -> Finished:
        """Run the job in every worker of this node and wait. A failed spawned worker
        raises :class:`~engine.errors.WorkerFailed` here, naming its rank and error."""
        from engine import run_lock

        # A rerun of a finished run is answered from its folder, no worker started (said
        # once: by the process of rank 0 where a launcher adopted every rank's).
        holds_rank0 = bool(self.worlds) and self.worlds[0].rank == 0
        finished = already_complete(self.cfg, self.job, say=holds_rank0)
        if finished is not None:
            return Finished(["already_complete"], finished)
        library = self.job.door.library
        # One run per folder: the process with rank 0 among its workers (or rank 0
        # itself, adopted) holds out_dir's lock until the run ends (engine/run_lock.py).
        with (run_lock.holding(self.cfg.out_dir, self.job.door.name) if holds_rank0
              else contextlib.nullcontext()), \
                (tempfile.TemporaryDirectory(prefix="engine-launch-") if library
                 else contextlib.nullcontext()) as exchange:
            job = attrs.evolve(self.job, launching_pid=os.getpid(), exchange_dir=exchange)
            # One process runs in this one (anything goes), unless it may be restarted.
            if library and self.launcher.spawns and (
                    len(self.worlds) > 1 or self.launcher.options.max_restarts):
                check_spawnable(job)
            with blaming_plugins(self.pm, spare=job.raised):
                statuses = self.launcher.launch(job) or []
            return Finished(statuses, job.launched_result())


def already_complete(cfg, job: "Worker", say: bool = True) -> dict | None:
    """A rerun into a completed run's folder, answered from its summary.json and
    config.json, no worker started: the same config, its summary with status
    "already_complete"; another (an lr sweep through one folder), a ConfigError naming
    the changes and how to keep both runs. None: train as usual."""
    from engine import config as config_mod
    from engine import snapshot
    from engine.run_dir import completed_run

    options = job.options
    if options.get("no_resume") or options.get("resume") or not isinstance(job, RecipeJob):
        return None
    found = completed_run(cfg.out_dir)
    if found is None:
        return None
    summary, saved = found
    done = int(summary.get("epochs_completed") or 0)
    steps = int(summary.get("global_step") or 0)
    if summary.get("stopped_early") or not (0 < cfg.epochs <= done
                                            or 0 < getattr(cfg, "max_steps", 0) <= steps):
        return None  # more to train: the workers resume and train on (or say it stopped)
    changes = {k: v for k, v in snapshot.config_changes(saved, config_mod.to_dict(cfg)).items()
               if k == "lr" or not snapshot.may_change(k, cfg)}
    door = job.door
    if changes:
        listed = ", ".join(f"{k} {old!r} (asked: {new!r})" for k, (old, new)
                           in sorted(changes.items()))
        who = f"{door.name}: " if door.library else ""  # engine-run's prefix says it
        raise ConfigError(
            f"{who}{cfg.out_dir} holds a completed run trained with {listed}: "
            "nothing would be trained with this config; to keep both runs, give each its "
            f"folder (out_dir={pathlib.Path(cfg.out_dir) / '{version}'}), or use "
            f"{door.start_over} to replace it")
    if say and not 0 < cfg.epochs <= done:  # ended by max_steps, in an epoch
        print(f"already complete: {cfg.out_dir} holds a finished run of {steps} steps "
              f"(asked for max_steps={cfg.max_steps}), nothing to train; to train on, ask "
              f"for more (max_steps={steps + 1} or more); to start over, use "
              f"{door.start_over} or another out_dir", flush=True)
    elif say:
        print(f"already complete: {cfg.out_dir} holds a finished run of {done} "
              f"epoch{'' if done == 1 else 's'} (asked for {cfg.epochs}), nothing to train; "
              f"to train on, ask for more (epochs={done + 1} or more); to start over, use "
              f"{door.start_over} or another out_dir", flush=True)
    return {**summary, "status": "already_complete", "out_dir": cfg.out_dir}


def check_spawnable(job: "Worker") -> None:
    """Before spawning: a spawned worker imports the caller's main script and unpickles
    the job; say so in one line (naming the door) when that cannot work."""
    door = job.door.name
    if multiprocessing.parent_process() is not None:
        raise ConfigError(
            f"{door} ran again inside a spawned worker: the workers import your "
            "script, so guard the call with `if __name__ == \"__main__\":`")
    _refuse_a_script_without_a_file(door)
    script = _unguarded_main_script()
    if script is not None:
        raise ConfigError(
            f"{door}: {script} starts workers at import time; spawned workers "
            f"import {script.name} again, so put the call under "
            "`if __name__ == \"__main__\":`")
    try:
        pickle.dumps(job)
    except Exception as exc:
        raise ConfigError(
            f"{door}: cannot send {job.describe()} to the worker processes "
            f"({type(exc).__name__}: {exc}); use a module-level function, not a lambda "
            "or a nested function, and picklable arguments") from None


def _refuse_a_script_without_a_file(door: str) -> None:
    """A main script read on stdin (``python - < train.py``) has no file that spawned
    workers could import (forked ones need none)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path and not os.path.isfile(path) and start_method() == "spawn":
        raise ConfigError(
            f"{door}: the main script was read from {path}, not a file, and spawned "
            "workers import it: use nproc=1 (trains in this process) or run the script "
            "from a file")


def _unguarded_main_script() -> pathlib.Path | None:
    """The main script, when the code that launched runs at its top level outside an
    ``if __name__ ...`` block; else None.

    A spawned worker imports the main script before it runs anything: an unguarded
    call would launch again there, and multiprocessing would fail in every worker with
    a traceback about "bootstrapping". Checked here, before any process starts."""
    frame = sys._getframe(1)
    while frame is not None:  # the main module's top-level frame, if it is a caller
        code, name = frame.f_code.co_name, frame.f_globals.get("__name__")
        if code == "<module>" and name == "__main__":
            break
        frame = frame.f_back
    path = frame and frame.f_globals.get("__file__")
    if not path or not os.path.isfile(path):
        return None  # python -c, an interactive session, a notebook: nothing to import
    try:
        tree = ast.parse(pathlib.Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
                and node.lineno <= line <= (node.end_lineno or node.lineno)):
            return None
    return pathlib.Path(path)



# ---------------------------------------------------------------- every worker


def worker_report(exc: BaseException) -> str:
    """A worker's error beyond its one line: the traceback for an error in the recipe's
    own code (or with ENGINE_TRACEBACK=1, then ``error: LINE``), else nothing."""
    if not (traceback_wanted() or not isinstance(exc, EngineError)):
        return ""
    text = "".join(traceback.format_exception(exc.__cause__ or exc)
                   if isinstance(exc, PluginCodeError) else traceback.format_exc())
    return text + (f"error: {error_line(exc)}\n" if isinstance(exc, EngineError) else "")


def report_worker_error(rank: int, exc: BaseException) -> None:
    """A worker's error as :func:`worker_report` shows it, or ``error: LINE``, every
    line marked with the rank."""
    text = worker_report(exc) or f"error: {error_line(exc)}\n"
    print(with_rank(rank, text), file=sys.stderr, end="", flush=True)


@attrs.frozen
class Worker:
    """A job: what every worker process runs, whichever door launched it (the module
    docstring's second block); picklable, for spawned processes. A subclass says how
    the config is made (:meth:`configure`) and what a worker runs (:meth:`run`)."""

    plugins: tuple  # the -p list; engine.fit's may hold plugin objects too
    options: dict  # engine.options in every worker (no_resume, resume, nproc, ...)
    door: Door = ENGINE_RUN
    launching_pid: int | None = None  # the process that set up the launch
    exchange_dir: str | None = None  # where a spawned rank 0 leaves its value
    # Filled when the worker runs in the launching process: its value, or the error it
    # raised to a library door's caller. New with every copy (attrs.evolve).
    result: list = attrs.field(factory=list, init=False, eq=False)
    raised: list = attrs.field(factory=list, init=False, eq=False)

    def configure(self, pm) -> Any:
        """The run's config, the same in every process (:func:`finish_config` done)."""
        raise NotImplementedError

    def run(self, pm, cfg, world) -> tuple[str, Any]:
        """Run in this worker; returns the run's status ("completed", "preempted") and
        the value a library door returns."""
        raise NotImplementedError

    def describe(self) -> str:
        """What travels to spawned workers, for the error when it cannot."""
        raise NotImplementedError

    def __call__(self, world) -> str:
        """Returns the run's status, which the launcher passes back."""
        from engine.plugin_manager import attribute, build_plugin_manager

        here = os.getpid() == self.launching_pid
        pm = None
        try:
            pm = build_plugin_manager(self.plugins)
            status, value = self.run(pm, self.configure(pm), world)
        except SystemExit:
            raise
        except KeyboardInterrupt:
            # Ctrl-C before training took it as a stop request, or a second one: the
            # launching process says "interrupted" (engine-run: once, exit 130); a
            # spawned worker ends quietly, its summary says "interrupted".
            if here:
                raise
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends it now
            exit_failed_worker(EXIT_INTERRUPTED)
        except BaseException as exc:
            shown = attribute(pm, exc)
            if here and self.door.library:
                self.raised.append(shown)
                if shown is exc:
                    raise  # the caller gets the exception itself
                raise shown from exc
            if reports_to_launcher():
                # The launcher prints it, once for the ranks that failed alike; an echo
                # of another rank's failure (PeerFailed) only on its last line.
                exit_failed_worker(exit_code(shown), error_line(shown), None if isinstance(
                    shown, PeerFailed) else worker_report(shown))
            report_worker_error(world.rank, shown)
            exit_failed_worker(exit_code(shown), error_line(shown))
        if here:
            self.result.append(value)
        elif self.exchange_dir and (world.rank == 0 or (world.local_rank == 0
                                                        and world.node_rank != 0)):
            with open(os.path.join(self.exchange_dir, RESULT_FILE), "wb") as f:
                pickle.dump(value, f)
        return status

    def restarted(self) -> "Worker":
        """The job as a launcher starts it again after a worker failed (spawn
        --max-restarts): it resumes the run's newest snapshot in the run's folder, never
        starts afresh nor clears the folder again (--no-resume, --overwrite: the first
        start did). ``--resume PATH`` stays: the restart begins there again, as a
        torchrun restart, which reruns the same command, does."""
        return attrs.evolve(self, options={**self.options, "no_resume": False,
                                           "overwrite": False})

    def launched_result(self) -> Any:
        """After ``launcher.launch(self)``: rank 0's value (None if it left none)."""
        if self.result:
            return self.result[0]
        path = pathlib.Path(self.exchange_dir or "") / RESULT_FILE
        if self.exchange_dir and path.exists():
            with open(path, "rb") as f:
                return pickle.load(f)
        return None


# ------------------------------------------------------------ a recipe's run


@attrs.frozen
class RecipeJob(Worker):
    """A recipe trained by the Trainer (engine-run, engine.fit): what a worker needs to
    rebuild the run; ``recipe``: a file's path, or an object with its attributes."""

    recipe: Any = None
    overrides: tuple[str, ...] = ()
    #: ``--config FILE`` and the overrides read from it (applied before ``overrides``).
    config_file: str | None = None
    file_overrides: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RecipeJob":
        """The job of ``engine-run RECIPE ...``: the recipe file, the overrides (the
        component flags among them: they win over the recipe), the -p list, and every
        option as engine.options."""
        from engine.overrides import load_config_file

        # Read here, once: spawned workers get the overrides, not the file.
        file_overrides = tuple(load_config_file(args.config)) if args.config else ()
        overrides = list(args.overrides)
        for key in ("launcher", "parallel", "checkpointer", "init_method"):
            value = getattr(args, key)
            if value is not None:
                overrides.append(f"{key}={value}")  # the flag wins over the recipe
        options = {k: v for k, v in vars(args).items()
                   if k not in ("recipe", "overrides", "plugins")
                   and isinstance(v, (str, int, float, bool, type(None), list))}
        options["no_resume"] = args.no_resume or args.overwrite  # --overwrite: afresh
        return cls(tuple(args.plugins), options, recipe=args.recipe,
                   overrides=tuple(overrides), config_file=args.config,
                   file_overrides=file_overrides)

    def describe(self) -> str:
        return f"recipe {self.recipe!r}"

    def loaded_recipe(self):
        """The :class:`~engine.recipe.Recipe` (a file is imported once per process)."""
        from engine.recipe import load_recipe, recipe_from_object

        return (load_recipe(self.recipe) if isinstance(self.recipe, str)
                else recipe_from_object(self.recipe))

    def configure(self, pm):
        return self.load(pm)[1]

    def load(self, pm):
        """The recipe and its resolved config (the same in every process)."""
        from engine.config import with_groups
        from engine.overrides import apply_overrides
        from engine.plugin_manager import require_plugins

        recipe = self.loaded_recipe()
        require_plugins(pm, recipe.required_plugins)
        # The plugins' config groups (ddp...) join the recipe's before the overrides;
        # the config file's come first, so that key=value on the command line wins.
        cfg = with_groups(recipe.make_config(), pm.config_groups)
        try:
            cfg = apply_overrides(cfg, list(self.file_overrides), checked=False)
        except ConfigError as exc:
            raise ConfigError(f"--config {self.config_file}: {exc}") from None
        try:
            cfg = apply_overrides(cfg, list(self.overrides))
        except ConfigError as exc:
            raise self._blame_the_file(exc) from None
        from engine.metrics import check_forms

        check_forms(cfg)  # a metric name no recipe's run logs: refused before any start
        if self.launching_pid is None:  # not launched yet: in the launching process
            check_before_workers(recipe, cfg)
        return recipe, finish_config(pm, cfg, recipe.name)

    def _blame_the_file(self, exc: ConfigError) -> ConfigError:
        """A cross-field check's error about a key only the config file set names the
        file (a bad value on the command line is the command line's)."""
        key = re.match(r"config key '([^']+)'", str(exc))
        given_here = {item.partition("=")[0].strip() for item in self.overrides}
        from_file = {item.partition("=")[0] for item in self.file_overrides}
        if key and key.group(1) in from_file - given_here:
            return ConfigError(f"--config {self.config_file}: {exc}")
        return exc

    def run(self, pm, cfg, world) -> tuple[str, dict]:
        """Train the recipe in this worker; the value is the run's summary and its folder
        (``out_dir``: a ``{version}`` filled)."""
        from engine.engine import Engine

        run = Engine(pm, self.loaded_recipe(), cfg, world, self.options,
                     start_over=self.door.start_over)
        summary = run.run()
        return summary["status"], {**summary, "out_dir": str(run.out_dir)}


def check_before_workers(recipe, cfg) -> None:
    """The worker's checks that need no batch, before the workers start: the throughput
    unit, an engine metric named misspelt or in another unit, a scheduler's metric and
    mode (built for a stand-in parameter on the meta device, else left to the worker)."""
    import difflib
    import types
    import warnings

    import torch

    from engine.metrics import EPOCH_END, named, throughput_unit
    from engine.trainer import EPOCH_LOSS, Throughput, scheduler_metric
    from engine.worker_setup import build_scheduler

    throughput = Throughput(recipe)
    for key, metric in named(cfg):
        epoch_end = key in EPOCH_END or metric.startswith("train/epoch_")
        ours = throughput.epoch_metric if epoch_end else throughput.metric
        known = [EPOCH_LOSS, ours, throughput.epoch_metric, "train/data_wait_fraction", "lr"]
        close = ([ours] if throughput_unit(metric) not in (None, throughput.unit) else
                 difflib.get_close_matches(metric, known, n=1, cutoff=0.9))
        if metric not in known and close:
            raise ConfigError(f"config key {key!r}: {metric!r} is not a metric this run "
                              f"logs (did you mean {close[0]!r}?)")
    scheduler = None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = recipe.module.build_optimizer(cfg, torch.nn.Linear(1, 1))
            steps = cfg.max_steps or cfg.epochs
            scheduler = build_scheduler(recipe, cfg, optimizer, types.SimpleNamespace(
                cfg=cfg, steps_per_epoch=1, total_steps=steps))
    except Exception:  # its functions need the real model or data: the worker checks
        if recipe.optional("build_scheduler") is not None:
            return
    scheduler_metric(scheduler, cfg)


def fit(recipe, *, nproc: int | None = None, launcher: str | None = None,
        plugins=(), resume: bool | str = True, overwrite: bool = False,
        threads: int | None = None, max_restarts: int = 0, **overrides: Any) -> dict:
    """Train a recipe (a file's path, a module, an object with its attributes) from
    Python, as ``engine-run RECIPE key=value ...`` would, ``overrides`` being config keys
    (``**{"data.source": "synthetic"}``); returns the run's summary and out_dir.
    docs/library.md, "engine.fit", says how errors and Ctrl-C reach the caller.
    """
    items = [f"{key}={_override_text(value)}" for key, value in overrides.items()]
    if launcher is not None:
        items.append(f"launcher={launcher}")
    job = RecipeJob(tuple(plugins), library_options(resume, overwrite, threads, nproc=nproc,
                                                    max_restarts=max_restarts),
                    door=FIT, recipe=_recipe_reference(recipe), overrides=tuple(items))
    from engine.overrides import UnknownKey
    from engine.worker_setup import callers_state_kept

    with callers_state_kept():
        try:
            launch = Launch(job)
        except UnknownKey as exc:
            raise _fit_argument_meant(exc, overrides) or exc
        return interrupted_raises(launch.start())


def interrupted_raises(finished: Finished):
    """A library door's value, or, for a run that Ctrl-C stopped (its snapshot written,
    status "interrupted"), the KeyboardInterrupt the caller's script expects: a sweep
    looping over ``engine.fit`` stops at the first Ctrl-C instead of starting the next
    run. The summary travels with it (``exc.summary``)."""
    if "interrupted" not in finished.statuses:
        return finished.result
    exc = Interrupted("interrupted: the run stopped at a check point with its snapshot; "
                      "the same call resumes")
    exc.summary = finished.result
    raise exc


def _fit_argument_meant(exc, overrides: dict) -> ConfigError | None:
    """``engine.fit(nprocs=2)``: an unknown key close to one of fit's own arguments is
    that argument misspelt (as a config key it would suggest ``epochs``)."""
    import difflib  # lazily: as the engine modules (see the imports)

    arguments = [p.name for p in inspect.signature(fit).parameters.values()
                 if p.kind is p.KEYWORD_ONLY]
    close = difflib.get_close_matches(exc.key, arguments, n=1, cutoff=0.75)
    if not close or exc.key not in overrides:
        return None
    value = overrides[exc.key]
    return ConfigError(f"engine.fit({exc.key}={value!r}): {exc.key!r} is neither an "
                       f"argument of engine.fit nor a config key; did you mean the "
                       f"argument {close[0]}={value!r}?")


def _override_text(value: Any) -> str:
    """A Python value as ``key=value`` text: booleans as engine-run spells them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _recipe_reference(recipe) -> Any:
    """What travels to the workers: a recipe file's path (a path, or a module loaded
    from a file: the workers load the same file), else the object itself."""
    if isinstance(recipe, (str, os.PathLike)):
        return str(recipe)
    path = getattr(recipe, "__file__", None)
    if isinstance(recipe, type(os)) and path:
        return str(path)
    return recipe
