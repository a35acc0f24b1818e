"""The one launch layer under the three front doors: ``engine-run`` (engine/cli.py),
``engine.launch`` (engine/api.py, a loop you write) and ``engine.fit`` (below, a recipe
from Python).

Every door does the same, in this order::

    plugin manager (built-ins, entry points, the caller's -p plugins)
    the config: the recipe's (or the caller's) with the plugins' groups and the overrides
    finish_config: the out_dir default, every component name checked        (here)
    refuse a fresh start where out_dir holds a run, unless asked to overwrite
    choose_launcher, then launcher.launch(job): in every worker, job(world)
        Worker.__call__: the plugin manager again, job.run(pm, world), and on an
        error the rank's report and exit (or, run in the caller's own process, the
        exception itself)

``job.run`` is where the doors differ: :class:`RecipeJob` runs the Trainer
(engine.engine.Engine), ``engine.api.LoopJob`` the caller's function with an
``engine.api.Context``. Either way the run's own lifecycle (hooks, summary,
teardown) is engine/context.py's ``WorkerContext.lifecycle``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import re
import sys
import tempfile
import traceback
from typing import Any, Callable

import attrs

from engine.errors import (ConfigError, EngineError, PluginCodeError, error_line, exit_code,
                           traceback_wanted)

#: What a worker's result file is called in the exchange folder of the launching process.
RESULT_FILE = "result.pickle"


# ------------------------------------------------------------- shared set-up


def finish_config(pm, cfg, run_name: str):
    """The steps every door takes once the config is complete: ``out_dir`` defaults to
    ``runs/<run_name>``, and every component the config names is checked now, before
    any process starts (an unknown name lists what is registered)."""
    if cfg.out_dir == "runs/default":
        cfg.out_dir = f"runs/{run_name}"
    if cfg.launcher != "auto":
        pm.launchers.get(cfg.launcher)
    if cfg.parallel != "auto":
        pm.parallel_modes.get(cfg.parallel)
    pm.checkpointers.get(cfg.checkpointer)
    return cfg


def resume_options(resume: bool | str | os.PathLike, overwrite: bool) -> dict[str, Any]:
    """The options of the Python doors' ``resume=``/``overwrite=`` arguments, as
    engine-run's --no-resume, --overwrite and --resume PATH set them."""
    return {"no_resume": resume is False, "overwrite": resume is False and overwrite,
            "resume": str(resume) if isinstance(resume, (str, os.PathLike)) else None}


def refuse_fresh_start_unless_asked(cfg, options: dict, asked: str, overwrite: str) -> None:
    """A fresh start where ``out_dir`` holds a run is refused before any process
    starts, unless the caller asked to overwrite it: what the user had is never removed
    unasked."""
    if options.get("no_resume") and not options.get("overwrite"):
        from engine.run_dir import refuse_fresh_start

        refuse_fresh_start(cfg.out_dir, asked=asked, overwrite=overwrite)


# ---------------------------------------------------------- a worker process


def report_worker_error(rank: int, exc: BaseException) -> None:
    """One line for an error the user can act on and for an error in a plugin's code
    (with ENGINE_TRACEBACK=1 the traceback first); the traceback for anything else (the
    recipe's own code needs it), every line marked with the rank."""
    text = ""
    if traceback_wanted() or not isinstance(exc, EngineError):
        text = "".join(traceback.format_exception(exc.__cause__ or exc)
                       if isinstance(exc, PluginCodeError) else traceback.format_exc())
    if isinstance(exc, EngineError):
        text += f"error: {error_line(exc)}\n"
    print("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()),
          file=sys.stderr, end="", flush=True)


@attrs.frozen
class Worker:
    """What every worker process runs, whichever door launched it (picklable, for
    spawned processes): the plugin manager, :meth:`run`, and what follows an error.

    A worker in a process of its own reports its error with its rank and exits with
    the error's code (the launcher names it on its last line). One run in the caller's
    own process (a single process, or a launcher that adopted the process) raises the
    exception itself when ``raise_in_process`` (the Python doors: the caller gets it),
    else reports and exits as a spawned one does (engine-run). With an
    ``exchange_dir``, rank 0 leaves :meth:`run`'s value there for the caller."""

    plugins: tuple[str, ...]
    options: dict
    parent_pid: int | None = None  # the launching process (None: not known)
    exchange_dir: str | None = None  # where rank 0's value goes back to the caller
    raise_in_process: bool = False
    result: list = attrs.field(factory=list, eq=False)  # run's value, when in-process

    def run(self, pm, world) -> Any:
        raise NotImplementedError

    def __call__(self, world) -> str | None:
        from engine.processes import exit_failed_worker
        from engine.plugin_manager import attribute, build_plugin_manager

        in_process = os.getpid() == self.parent_pid
        pm = None
        try:
            pm = build_plugin_manager(self.plugins)
            value = self.run(pm, world)
        except SystemExit:
            raise
        except BaseException as exc:
            if in_process and self.raise_in_process:
                raise
            shown = attribute(pm, exc)
            report_worker_error(world.rank, shown)
            exit_failed_worker(exit_code(shown), error_line(shown))
        if in_process:
            self.result.append(value)
        elif self.exchange_dir and (world.rank == 0 or (world.local_rank == 0
                                                        and world.node_rank != 0)):
            with open(os.path.join(self.exchange_dir, RESULT_FILE), "wb") as f:
                pickle.dump(value, f)
        # The spawn launcher collects these: "preempted" makes engine-run exit 75.
        return value.get("status") if isinstance(value, dict) else None

    def launched_result(self) -> Any:
        """After ``launcher.launch(self)``: rank 0's value (None if it left none)."""
        if self.result:
            return self.result[0]
        path = pathlib.Path(self.exchange_dir or "") / RESULT_FILE
        if self.exchange_dir and path.exists():
            with open(path, "rb") as f:
                return pickle.load(f)
        return None


def launch_and_collect(launcher, job: Worker, door: str) -> Any:
    """Launch ``job`` in every worker and return rank 0's value: for the Python doors,
    which give the caller what the run returned. Spawned workers must be able to import
    the caller's script (checked first)."""
    with tempfile.TemporaryDirectory(prefix="engine-launch-") as tmp:
        job = attrs.evolve(job, parent_pid=os.getpid(), exchange_dir=tmp)
        if launcher.spawns and len(launcher.worlds()) > 1:
            check_spawnable(job, door)  # one process runs in this one: anything goes
        # A failed worker raises WorkerFailed here, naming the rank and its error line.
        launcher.launch(job)
        return job.launched_result()


def check_spawnable(job: Worker, door: str) -> None:
    """Before spawning: a spawned worker imports the caller's main script and unpickles
    the job; say so in one line (naming the ``door``) when that cannot work."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise ConfigError(
            f"{door} ran again inside a spawned worker: the workers import your "
            "script, so guard the call with `if __name__ == \"__main__\":`")
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


def _unguarded_main_script() -> pathlib.Path | None:
    """The main script, when the code that launched runs at its top level outside an
    ``if __name__ ...`` block; else None.

    A spawned worker imports the main script before it runs anything: an unguarded
    call would launch again there, and multiprocessing would fail in every worker with
    a traceback about "bootstrapping". Checked here, before any process starts."""
    import ast

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


# ------------------------------------------------------------ a recipe's run


@attrs.frozen
class RecipeJob(Worker):
    """A recipe trained by the Trainer (engine-run and engine.fit): everything a worker
    needs to rebuild the run. ``recipe`` is a recipe file's path, or an object with
    the recipe's attributes (engine.fit)."""

    recipe: Any = None
    overrides: tuple[str, ...] = ()
    #: ``--config FILE`` and the overrides read from it (applied before ``overrides``).
    config_file: str | None = None
    file_overrides: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RecipeJob":
        from engine.config import load_config_file

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

    @property
    def recipe_path(self) -> str | None:
        return self.recipe if isinstance(self.recipe, str) else None

    def describe(self) -> str:
        return f"recipe {self.recipe!r}"

    def load(self, pm):
        """The recipe and its resolved config (the same in every process)."""
        from engine.config import apply_overrides, with_groups
        from engine.plugin_manager import require_plugins
        from engine.recipe import load_recipe, recipe_from_object

        recipe = (load_recipe(self.recipe) if isinstance(self.recipe, str)
                  else recipe_from_object(self.recipe))
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

    def launch_options(self, cfg, pm=None):
        from engine.launcher import LaunchOptions

        o = self.options
        nproc = o.get("nproc")
        if nproc is None and pm is not None and cfg.parallel != "auto" and getattr(
                pm.parallel_modes.get(cfg.parallel), "single_process", False):
            nproc = 1  # --parallel single or dp: one process, not one per GPU
        return LaunchOptions(nproc=nproc, nnodes=o.get("nnodes") or 1,
                             node_rank=o.get("node_rank") or 0,
                             master_addr=o.get("master_addr"),
                             master_port=o.get("master_port"),
                             init_method=cfg.init_method, timeout_s=cfg.timeout_s,
                             local_rank=o.get("local_rank"))

    def run(self, pm, world) -> dict:
        """Train the recipe in this worker; returns the run's summary."""
        from engine.engine import Engine

        recipe, cfg = self.load(pm)
        return Engine(pm, recipe, cfg, world, self.options).run()


def fit(recipe, *, nproc: int | None = None, launcher: str | None = None,
        plugins=(), resume: bool | str = True, overwrite: bool = False,
        threads: int | None = None, **overrides: Any) -> dict:
    """Train a recipe from Python, as ``engine-run RECIPE key=value ...`` would; returns
    the run's summary (the keys of summary.json).

    ``recipe`` is a recipe file's path, a recipe module, or any object with the recipe's
    attributes (``Config``, ``build_model``, ``build_datasets``, ``build_optimizer``...).
    ``overrides`` are config keys (``epochs=3``; dotted keys as
    ``**{"data.source": "synthetic"}``), checked as engine-run checks ``key=value``.
    ``nproc=1`` (or a launcher that adopts this process: torchrun, SLURM) trains in this
    process, and an error reaches the caller as the exception itself; with more, the
    workers are spawned (guard the call with ``if __name__ == "__main__":``), and a
    failed worker raises an EngineError naming its rank. A pre-empted run returns its
    summary with ``status`` "preempted".
    """
    from engine.plugin_manager import build_plugin_manager

    items = [f"{key}={_override_text(value)}" for key, value in overrides.items()]
    if launcher is not None:
        items.append(f"launcher={launcher}")
    options = {"nproc": nproc, "threads": threads, **resume_options(resume, overwrite)}
    job = RecipeJob(tuple(plugins), options, raise_in_process=True,
                    recipe=_recipe_reference(recipe), overrides=tuple(items))
    pm = build_plugin_manager(job.plugins)
    recipe_loaded, cfg = job.load(pm)
    refuse_fresh_start_unless_asked(cfg, options, asked="engine.fit(resume=False)",
                                    overwrite="pass overwrite=True")
    from engine.launcher import choose_launcher

    chosen = choose_launcher(pm.launchers, cfg.launcher, job.launch_options(cfg, pm))
    return launch_and_collect(chosen, job, "engine.fit")


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
