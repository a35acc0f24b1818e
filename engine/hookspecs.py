"""Every hook the engine calls, in one module, all with the ``engine_`` prefix.

Each docstring states the hook's *kind* on a line ``Kind: ...`` (registration,
historic, notification, first result: docs/plugins.md, "Kinds", says what each means),
and ends with the version that added the hook and, for any argument added later, the
version that added that argument ("Since 0.1." / "``foo`` since 0.2."): signatures only
grow, by arguments implementations may leave out. The order in which ``engine-run`` and
a custom loop fire them is in docs/plugins.md, "Hooks in the order they fire".

The ``ctx`` argument is the run object, an :class:`engine.context.WorkerContext` (the
worker's ``Engine``, or a custom loop's ``Context``); :class:`RunContext` lists what a
plugin may use on either. Hooks with ``ctx`` also pass it as ``engine``, its name up to
release 0.2.0, until 0.4.0 (engine/plugin_manager.py: :class:`RunHookCaller`).
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pluggy

if TYPE_CHECKING:  # for the annotations only: the hooks' import stays light
    from engine.context import WorkerContext

hookspec = pluggy.HookspecMarker("engine")


# --------------------------------------------------------------- the ctx argument


@runtime_checkable
class RunContext(Protocol):
    """What a hook may use on its ``ctx`` argument, under ``engine-run`` and in a
    custom loop alike (both are an :class:`engine.context.WorkerContext`). For type
    checkers: ``def engine_log(ctx: RunContext, metrics, step)``.

    Until set-up has made them, ``parallel``, ``model``, ``optimizer``, ``scheduler``,
    ``scaler`` and ``checkpointer`` are None (a custom loop has a model once it called
    ``ctx.wrap``); ``device`` and ``module`` need the parallel mode and the model."""

    pm: Any  #: the plugin manager (``pm.hook`` calls hooks)
    cfg: Any  #: the resolved config, an ``engine.TrainConfig`` (subclass)
    world: Any  #: ``engine.World``: rank, local_rank, world_size, launcher...
    options: dict[str, Any]  #: command-line option values (those plugins added too)
    out_dir: pathlib.Path  #: the run's output folder
    state: Any  #: ``epoch``, ``step`` (optimizer steps), ``epochs_completed``...
    metrics: dict[str, float]  #: the latest reduced or logged values
    #: ``engine.worker_setup.RunParts``: what the loop drives; the attributes from
    #: ``parallel`` to ``checkpointer`` below are its fields.
    run_parts: Any
    parallel: Any  #: the parallel mode (``engine.Parallel``)
    model: Any  #: as trained: wrapped by the parallel mode
    optimizer: Any
    scheduler: Any
    scaler: Any  #: a GradScaler with precision fp16, else None
    checkpointer: Any  #: the checkpoint plugin's ``engine.Checkpointer``
    preemption: Any  #: a PreemptionFlag while training with ``preemption=true``
    recipe_path: str | None  #: the recipe file, or the custom loop's script
    epochs_requested: int | None
    resumed_from: str | None  #: the snapshot a resume loaded, or None
    resume_record: dict | None  #: summary.json's ``resume``: tier, step, steps_lost...
    #: summary.json's ``memory_snapshots``: the memory tier's interval and its cost
    memory_record: dict | None

    @property
    def is_rank0(self) -> bool: ...  #: global rank 0: the rank that writes and logs

    @property
    def rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> Any: ...  #: the torch.device of this process

    @property
    def module(self) -> Any: ...  #: the model without its parallel wrapper

    def print(self, *args: Any, **kwargs: Any) -> None: ...  #: rank 0 only

    def warn(self, message: str) -> None: ...  #: rank 0 only, once per message, stderr

    def warn_here(self, message: str) -> None: ...  #: this rank's, on any rank, stderr

    def summary(self, status: str, error: BaseException | None = None) -> dict: ...


# --------------------------------------------------------------------- registration


@hookspec
def engine_register_launchers(registry):
    """Add launchers: ``registry.add(LauncherClass)``, a :class:`engine.launcher.Launcher`
    registered under its ``name``: how worker processes come into being (spawned, or
    adopted from torchrun / SLURM / legacy launch) and each worker's place in the world.

    Kind: registration. Fires at start-up in every process (CLI and workers).
    Since 0.1.
    """


@hookspec
def engine_register_parallel(registry):
    """Add parallel modes: ``registry.add(ParallelClass)``, an
    :class:`engine.parallel.Parallel` registered under its ``name``: a worker's devices
    and backend, the model's wrapping and unwrapping, the batch's split.

    Kind: registration. Fires at start-up in every process (CLI and workers).
    Since 0.1.
    """


@hookspec
def engine_register_checkpointers(registry):
    """Add checkpointers: ``registry.add(CheckpointerClass)``, an
    :class:`engine.checkpoint.Checkpointer` registered under its ``name``: it writes and
    reads snapshots.

    Kind: registration. Fires at start-up in every process (CLI and workers).
    Since 0.1.
    """


@hookspec
def engine_register_config_groups():
    """Return the config groups this plugin adds: ``{"name": AttrsClass}``.

    Each group becomes a field of every run's config at the class's defaults, so that
    ``cfg.name.field`` works and ``engine-run RECIPE name.field=value`` sets it, like
    the recipe's own groups (the ddp plugin adds ``ddp``). A recipe that declares a
    field of that name keeps its own; a name taken by two plugins is an error. Code that
    reads the group should fall back to the defaults when a config was built without the
    plugin manager (``getattr(cfg, "name", None)``).

    Kind: registration. Fires at start-up in every process (CLI and workers).
    Since 0.2.
    """


@hookspec
def engine_register_commands():
    """Return the ``engine-run`` commands this plugin adds: ``{"name": main}``, where
    ``main(argv) -> int`` runs ``engine-run name ARGS...`` (the slurm plugin adds
    ``sbatch``). Import what the command needs inside ``main``, not at start-up.

    Kind: registration. Fires in the ``engine-run`` process when its first argument is
    not a built-in command or a file.
    Since 0.2.
    """


# ------------------------------------------------------------------------ start-up


@hookspec(historic=True)
def engine_addoption(parser):
    """Add command-line options to ``engine-run`` (an :class:`argparse.ArgumentParser`).

    The parsed values reach every worker in ``ctx.options`` (a dict keyed by the
    option's ``dest``); use a distinctive prefix (``--csv-every``) to avoid clashes.

    Kind: historic. Fires once in the ``engine-run`` process, before the command line
    is parsed; not in custom loops.
    Since 0.1.
    """


# ---------------------------------------------------------------------- the run


@hookspec
def engine_register_state(engine, parts, ctx: WorkerContext):
    """Add stateful parts to the run's snapshots: ``parts.add("ema", obj)`` where
    ``obj`` has ``state_dict()`` and ``load_state_dict(state_dict)`` (the protocol of
    torch.distributed.checkpoint's ``Stateful``). Every snapshot then holds
    ``obj.state_dict()`` under that name, and a resume calls ``obj.load_state_dict``
    with it before training goes on, so that an EMA of the weights, a curriculum or a
    custom sampler resumes exactly. Use it only for what every rank can save alike:
    ``state_dict`` runs on every rank, and a checkpointer that writes on rank 0 keeps
    rank 0's. A name another plugin (or the recipe's ``state_parts``) took is an error
    naming both.

    Kind: registration. Fires on every rank, once per run, one plugin at a time, after
    the model (``ctx.module``), optimizer, scheduler and scaler exist and before the
    resume: under ``engine-run`` in set-up, in a custom loop in ``ctx.wrap``.
    Since 0.2.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_run_start(engine, ctx: WorkerContext):
    """The worker is set up (process group, model, optimizer, data, resumed state) and
    about to train; ``ctx.state`` already holds the resumed epoch and step.

    Kind: notification. Fires on every rank (``ctx.is_rank0`` tells which), once per
    run, under ``engine-run`` only.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_epoch_start(engine, epoch, ctx: WorkerContext):
    """An epoch begins (after ``sampler.set_epoch``); ``epoch`` is its index, from 0 as
    ``sampler.set_epoch`` counts: the console's ``epoch epoch+1/N``.

    Kind: notification. Fires on every rank, under ``engine-run`` only.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_train_step_end(engine, step, loss, ctx: WorkerContext):
    """One optimizer step finished; ``step`` is the global step count after it and
    ``loss`` the step's loss tensor, still on the device (calling ``.item()`` forces a
    host-device synchronisation every step: accumulate on the device instead). The
    parameters' ``.grad`` still hold the step's gradients (freed before the next backward).

    Kind: notification. Fires on every rank; not called at all when no plugin implements
    it, as the Trainer sees after ``engine_run_start`` (where a plugin may
    ``ctx.pm.register`` an implementation, as the profiler does: docs/plugins.md).
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_before_optimizer_step(engine, step, optimizer, ctx: WorkerContext):
    """The gradients of optimizer step ``step`` (the global step count it will make)
    are complete and the optimizer is about to use them: for gradient clipping, logging
    gradient norms, or an exponential moving average of the weights.

    The gradients are the true ones: after the last micro-batch of the accumulation
    group, already averaged over the ranks (DDP reduced them in that backward),
    unscaled under fp16 (``scaler.unscale_(optimizer)`` ran), and clipped to
    ``grad_clip_norm`` when it is set. A step that ``on_nonfinite=skip`` skips does not
    reach this hook. Reading a gradient with ``.item()`` forces a host-device
    synchronisation every step.

    Kind: notification. Fires on every rank, under ``engine-run`` only; not called at
    all (nothing to pay) when no plugin implements it.
    Since 0.2.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_log(engine, metrics, step, ctx: WorkerContext):
    """Scalars to record: ``metrics`` maps names (``train/loss``, ``val/loss``, ``lr``...:
    docs/outputs.md, metric names) to Python floats, at global optimizer step ``step``.
    Logger plugins implement this. ``ctx.state.epoch`` is the index of the epoch the
    metrics belong to: epoch ``state.epoch + 1`` as the console counts.

    Kind: notification. Fires on rank 0 only: every ``log_every`` steps during training
    (the window before: the mean over all ranks arrives one window after its check
    point, so the window ending at step 20 is logged at step 40 or at the epoch's end,
    with ``step=20``), once per epoch with the epoch's metrics after validation, and once
    as training starts or resumes with ``world_size`` (how many processes train from
    that step); in a custom loop, whenever it calls ``ctx.log``.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_validation_start(engine, epoch, ctx: WorkerContext):
    """Validation of epoch ``epoch`` (from 0) is about to run, on the model in eval
    mode: a plugin may put other weights in place for it (the ema plugin's
    ``ema.evaluate=true``) and put them back in :func:`engine_validation_end`.

    Kind: notification. Fires on every rank, after the epoch's training and before its
    validation (when the recipe has a validation set), under ``engine-run`` only.
    Since 0.2.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_validation_end(engine, epoch, metrics, ctx: WorkerContext):
    """Validation of epoch ``epoch`` ended; ``metrics`` holds its reduced ``val/*``
    values (identical on every rank). The model is back in training mode afterwards.

    Kind: notification. Fires on every rank, right after validation, before the
    epoch's ``engine_log``, under ``engine-run`` only.
    Since 0.2.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_epoch_end(engine, epoch, metrics, ctx: WorkerContext):
    """An epoch finished; ``metrics`` holds the epoch's reduced metrics (Python floats,
    identical on every rank). ``epoch`` is its index (from 0); ``ctx.state.epoch`` and
    ``ctx.state.epochs_completed`` are already ``epoch + 1``, the number the console,
    metrics.csv and summary.json give this epoch.

    Kind: notification. Fires on every rank, after that epoch's ``engine_log``, under
    ``engine-run`` only.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_run_end(engine, summary, ctx: WorkerContext):
    """The run ended; ``summary`` is the dict that rank 0 writes to summary.json
    (``summary["status"]``: ``"completed"``, ``"preempted"``, ``"interrupted"`` or
    ``"failed"``), the same keys in a custom loop. Loggers flush and close their files.

    Kind: notification. Fires on every rank, last, however the run ended.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec
def engine_exception(engine, exc, ctx: WorkerContext):
    """The run raised ``exc`` on this rank (the run still fails: this hook observes, it
    cannot recover).

    Kind: notification. Fires on every rank that raised, just before
    ``engine_run_end``.
    Since 0.1.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


# ------------------------------------------------------ the scheduler, the run's files


@hookspec(firstresult=True)
def engine_requeue(engine, ctx: WorkerContext):
    """The run stopped for a pre-emption (SIGUSR1/SIGTERM) and its snapshot is written:
    ask the scheduler that runs this job to start it again, so that it resumes. Return
    one line for the log saying what happened (``"job 42 requeued"``, or why not), or
    None when this job is not the plugin's scheduler's: the next plugin is asked. Do
    not raise: the run is stopping either way. The scheduler, not the launcher: a batch
    script that runs ``engine-run`` with the spawn launcher is still a SLURM job.

    Kind: first result. Fires on rank 0 only, once, after ``engine_run_end`` of a run
    that ended ``"preempted"`` with ``requeue=true``, under ``engine-run`` only.
    Since 0.2.
    ``ctx`` since 0.3. ``engine`` is its old name (the same object, until 0.4.0).
    """


@hookspec(firstresult=True)
def engine_cpu_allocation(environ):
    """``(cpus, source)``, the CPUs the scheduler that runs this job allocated to each
    task, from ``environ`` (``(12, "SLURM_CPUS_PER_TASK")``); None: not this plugin's
    scheduler's job, or none per task. spawn, torchrun and legacy share it out.

    Kind: first result. Fires where the launcher is chosen, before the worlds are made.
    Since 0.3.
    """


@hookspec
def engine_register_run_files():
    """Return the names of the files and folders this plugin writes in a run's
    ``out_dir`` (the csv logger: ``["metrics.csv"]``; tensorboard:
    ``["tensorboard"]``): names directly inside ``out_dir``, no paths. ``--overwrite``
    removes them with the engine's own and nothing else; ``engine-run plugins`` lists
    them. Anything but a list of plain names is a PluginError naming the plugin.

    Kind: registration. Fires when the plugin manager is built, in every process.
    Since 0.2.
    """
