"""Every hook the engine calls, in one module, all with the ``engine_`` prefix.

Each docstring states the hook's *kind*:

- **registration**: called once at start-up, in plugin registration order (built-ins
  first, then entry points, then ``-p`` extras); the plugin adds components to a
  :class:`engine.registry.Registry`. A name registered twice is an error naming both
  plugins.
- **historic**: remembered by the plugin manager and replayed to plugins registered
  later, so late plugins see it too.
- **notification**: every implementation is called, results are ignored.
- **first result**: implementations are called until one returns something other than
  ``None``; that value is the answer.

The run calls them in this order (``engine.trainer.Trainer.fit`` holds the loop)::

    engine_register_launchers / _parallel / _checkpointers     (start-up, every process)
    engine_addoption                                            (CLI start-up, historic)
    engine_run_start
      for each epoch:
        engine_epoch_start
          for each optimizer step:
            engine_train_step_end          (skipped entirely when nobody implements it)
            engine_log                     (rank 0, every ``log_every`` steps)
        engine_log                         (rank 0, validation metrics)
        engine_epoch_end
    engine_run_end                         (also after a failure, with status "failed")
    engine_exception                       (only when the run raised)

Signatures only ever grow by optional arguments; each docstring notes the version in
which an argument was added.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("engine")


# --------------------------------------------------------------------- registration


@hookspec
def engine_register_launchers(registry):
    """Add launchers: ``registry.add("name", LauncherClass)``.

    Kind: registration. A launcher decides how worker processes come into being
    (spawn them, or adopt the variables of torchrun / SLURM / legacy launch) and
    describes each worker's place in the world. See :class:`engine.launcher.Launcher`.

    Since 0.1.
    """


@hookspec
def engine_register_parallel(registry):
    """Add parallel modes: ``registry.add("name", ParallelClass)``.

    Kind: registration. A parallel mode chooses the devices and backend of a worker,
    wraps and unwraps the model and splits the batch. See
    :class:`engine.parallel.Parallel`.

    Since 0.1.
    """


@hookspec
def engine_register_checkpointers(registry):
    """Add checkpointers: ``registry.add("name", CheckpointerClass)``.

    Kind: registration. A checkpointer writes and reads snapshots. See
    :class:`engine.checkpoint.Checkpointer`.

    Since 0.1.
    """


# ------------------------------------------------------------------------ start-up


@hookspec(historic=True)
def engine_addoption(parser):
    """Add command-line options to ``engine-run`` (an :class:`argparse.ArgumentParser`).

    Kind: historic. Values arrive in ``engine.options`` (an ``argparse.Namespace``).

    Since 0.1.
    """


# ---------------------------------------------------------------------- the run


@hookspec
def engine_run_start(engine):
    """The worker is set up (process group, model, optimizer, data) and about to train.

    Kind: notification. Called on every rank; ``engine.is_rank0`` tells which one
    this is.

    Since 0.1.
    """


@hookspec
def engine_epoch_start(engine, epoch):
    """An epoch begins (after ``sampler.set_epoch``). Kind: notification. Every rank.

    Since 0.1.
    """


@hookspec
def engine_train_step_end(engine, step, loss):
    """One optimizer step finished; ``loss`` is the step's loss tensor, still on the
    device (calling ``.item()`` forces a host-device synchronisation every step).

    Kind: notification. Every rank. When no plugin implements this hook the Trainer
    does not call it at all, so it costs nothing.

    Since 0.1.
    """


@hookspec
def engine_log(engine, metrics, step):
    """Scalars to record: ``metrics`` maps names such as ``train/loss``, ``val/accuracy``,
    ``train/images_per_sec`` or ``lr`` to Python floats, at global optimizer step
    ``step``.

    Kind: notification. Rank 0 only, every ``log_every`` steps during training and once
    per epoch after validation. Logger plugins (console, TensorBoard, CSV...) implement
    this.

    Since 0.1.
    """


@hookspec
def engine_epoch_end(engine, epoch, metrics):
    """An epoch finished; ``metrics`` holds the epoch's reduced metrics (Python floats,
    identical on every rank). Kind: notification. Every rank.

    Since 0.1.
    """


@hookspec
def engine_run_end(engine, summary):
    """The run ended; ``summary`` is the dict that rank 0 writes to summary.json
    (``summary["status"]`` is ``"completed"``, ``"failed"`` or ``"preempted"``).

    Kind: notification. Every rank. Loggers close their files here.

    Since 0.1.
    """


@hookspec
def engine_exception(engine, exc):
    """The run raised ``exc`` on this rank. Kind: notification. Every rank that raised.

    Since 0.1.
    """
