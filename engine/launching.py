"""The one launch layer under the three front doors: ``engine-run`` (engine/cli.py),
``engine.launch`` (engine/api.py, a loop you write) and ``engine.fit`` (below, a recipe
from Python).

A door describes the run as a *job*, a :class:`Worker` (:class:`RecipeJob`: a recipe
and the Trainer; ``engine.api.LoopJob``: the caller's function). :class:`Launch` sets it
up once, in the launching process::

    the arguments checked (engine/launch_checks.py, as every check before workers)
    job.configure: the plugin manager, the config, its groups and overrides
                   (finish_config: out_dir's default, the component names)
    a fresh start refused where out_dir holds a run, unless asked to overwrite
    choose_launcher, its worlds; the threads per process (engine/threads.py)
    Launch.start: a finished run answered; spawned workers checked; launcher.launch(job)

and the launcher calls the job once in every worker (``Worker.__call__``): the plugin
manager and the config again, ``job.run`` (engine/context.py's lifecycle), an error
blamed on the plugin whose code raised it (printed with the rank, or raised to a
library door's caller), rank 0's value back to the launching process.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
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

from engine.errors import (EXIT_INTERRUPTED, ConfigError, EngineError, Interrupted,
                           PeerFailed, PluginCodeError, error_line, exit_code,
                           traceback_wanted)
from engine.launch_checks import (already_complete, check_arguments, check_before_workers,
                                  check_spawnable)
from engine.processes import exit_failed_worker, reports_to_launcher, with_rank
from engine.threads import choose_threads, warn_if_oversubscribed

# engine-run's start imports this module (engine.cli does): the modules only a run needs
# (config, plugin_manager, launcher, run_dir, recipe; engine.engine imports torch) are
# imported inside the functions that use them: --help, the commands start without them.

#: What rank 0's value is called in the exchange folder of a library door.
RESULT_FILE = "result.pickle"


@attrs.frozen
class Door:
    """A front door: its name in error lines, and how its user asks for things."""

    name: str  # engine-run, engine.fit, engine.launch
    fresh_start: str  # how a fresh start is asked for
    overwrite: str  # how to allow removing the run out_dir holds
    start_over: str  # both together, to start a finished run over
    #: A library door (Python): the caller gets an error as the exception itself and rank
    #: 0's value back; spawned workers need a guarded script and a picklable job.
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


def launch_options(pm, cfg, options: dict):
    """The launcher's :class:`~engine.launcher.LaunchOptions`: the job's and the config's."""
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
    """An exception raised in a plugin's code (a launcher's, a hook's) becomes one naming
    the plugin; not those in ``spare``, which a worker here raised to a library caller."""
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
    """What this node's workers sent back: each one's run status (None where unknown)
    and, for a library door, rank 0's value (another node's first worker's; or None)."""

    statuses: list
    result: Any


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
        finished = (already_complete(self.cfg, self.job, say=holds_rank0)
                    if isinstance(self.job, RecipeJob) else None)
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
    """:func:`worker_report`, or ``error: LINE``, every line marked with the rank."""
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
        """Run in this worker: its status ("completed", ...) and a library door's value."""
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
        """The job as a launcher starts it again after a worker failed (--max-restarts): it
        resumes the newest snapshot in the run's folder (--no-resume, --overwrite: the first
        start did); ``--resume PATH`` stays, as a torchrun restart reruns the command."""
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
        """The job of ``engine-run RECIPE ...``: the recipe file, the overrides (component
        flags among them), the -p list, and every option as engine.options."""
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
        """Train the recipe here: its status, its summary and out_dir ({version} filled)."""
        from engine.engine import Engine

        run = Engine(pm, self.loaded_recipe(), cfg, world, self.options,
                     start_over=self.door.start_over)
        summary = run.run()
        return summary["status"], {**summary, "out_dir": str(run.out_dir)}


def fit(recipe, *, nproc: int | None = None, launcher: str | None = None,
        plugins=(), resume: bool | str = True, overwrite: bool = False,
        threads: int | None = None, max_restarts: int = 0, **overrides: Any) -> dict:
    """Train a recipe (a file's path, a module, an object with its attributes) from
    Python, as ``engine-run RECIPE key=value ...`` would, ``overrides`` being config keys
    (``**{"data.source": "synthetic"}``); returns the run's summary and out_dir.
    docs/library.md, "engine.fit", says how errors and Ctrl-C reach the caller."""
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
    """A library door's value, or, for a run Ctrl-C stopped (status "interrupted"), the
    KeyboardInterrupt a caller's script expects (a sweep over ``engine.fit`` stops at the
    first Ctrl-C), the summary with it (``exc.summary``)."""
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
