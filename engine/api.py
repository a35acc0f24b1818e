"""The library API: DDP, resume and rank-0 logging for a training loop you write yourself
(docs/library.md; examples/custom_loop.py shows a loop before and after)::

    def train(ctx, epochs):                                  # ctx: an engine.Context
        model, optimizer = ctx.wrap(model, optimizer)        # device + DDP (or --parallel)
        loader = ctx.loader(dataset, batch_size=64)          # global batch, split, sharded
        for epoch in ctx.epochs(epochs):                     # resumes; snapshot per epoch
            ...                                              # your step, unchanged
            ctx.log(ctx.reduce({"loss": total / len(loader)}))   # rank 0: loggers

    if __name__ == "__main__":                               # needed: workers re-import
        engine.launch(train, 3, nproc=2)

:func:`launch` goes through engine-run's launch layer (engine/launching.py) and calls
``fn(ctx, *args)`` once in every worker. The :class:`Context` reuses the engine's parts
(parallel modes, process group, samplers, snapshots through the checkpoint plugins, the
``engine_log`` / ``engine_run_end`` hooks), so plugins work unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import sys
from typing import Any, Callable, Iterator, Sequence

import attrs

from engine import distributed, loader_settings, snapshot
from engine.config import TrainConfig, check, differs_from_default, with_groups
from engine.context import WorkerContext
from engine.errors import ConfigError
from engine.launching import (LAUNCH, Launch, Worker, finish_config, interrupted_raises,
                              library_options)
from engine.preemption import PreemptionFlag
from engine.stateful import TrainState
from engine.worker_setup import (build_optimizer, callers_state_kept, open_checkpointer,
                                 prepare_model, start_worker, training_loader)


def launch(fn: Callable[..., Any], *args: Any, nproc: int | None = None,
           config=None, plugins: Sequence[str] = (), resume: bool | str = True,
           overwrite: bool = False, threads: int | None = None, nnodes: int = 1,
           node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
           max_restarts: int = 0) -> Any:
    """Run ``fn(ctx, *args)`` in every worker process and return its result.

    ``fn`` must be picklable when workers are spawned (a module-level function, the
    call guarded by ``if __name__ == "__main__"``). ``config``: an
    :class:`engine.TrainConfig` or a subclass. ``plugins`` and ``max_restarts`` are
    engine-run's ``-p`` and --max-restarts (``ctx.epochs`` resumes restarted workers).

    Returns what ``fn`` returned on rank 0 (picklable, when this call spawned the
    workers). A failed worker raises an EngineError naming it; Ctrl-C stops the workers
    after an optimizer step with a snapshot and raises engine.errors.Interrupted (a
    script that does not catch it exits 130, as engine-run).
    """
    if not callable(fn):
        raise ConfigError(f"engine.launch needs a function to run in every worker, "
                          f"not {fn!r}")
    cfg = copy.deepcopy(config) if config is not None else TrainConfig()
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"engine.launch: config must be an engine.TrainConfig (or a "
                          f"subclass), not {type(cfg).__name__}")
    check(cfg)
    options = library_options(resume, overwrite, threads, nproc=nproc, nnodes=nnodes,
                              node_rank=node_rank, master_addr=master_addr,
                              master_port=master_port, max_restarts=max_restarts,
                              local_rank=_local_rank_argument(sys.argv[1:]))
    job = LoopJob(tuple(plugins), options, door=LAUNCH, fn=fn, args=tuple(args), cfg=cfg)
    with callers_state_kept():
        return interrupted_raises(Launch(job).start())


def _local_rank_argument(argv: Sequence[str]) -> int | None:
    """torch.distributed.launch passes ``--local-rank=N`` to the script: the legacy
    launcher adopts the process by it (as it does by LOCAL_RANK)."""
    for i, arg in enumerate(argv):
        for flag in ("--local-rank", "--local_rank"):
            text = arg[len(flag) + 1:] if arg.startswith(flag + "=") else (
                argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if text is not None and text.isdigit():
                return int(text)
    return None


def script_path(fn) -> str | None:
    """The file that defines ``fn`` (the user's script, usually), if any."""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    return getattr(module, "__file__", None)


def _script_name(fn) -> str:
    path = script_path(fn)
    if path:
        return pathlib.Path(path).stem
    return getattr(fn, "__name__", "custom_loop").strip("<>") or "custom_loop"


@attrs.frozen
class LoopJob(Worker):
    """``fn(ctx, *args)`` with an engine.api.Context in every worker (engine.launch).
    ``cfg`` is the caller's config, before the plugins' groups join it."""

    fn: Callable[..., Any] = None
    args: tuple = ()
    cfg: Any = None

    def describe(self) -> str:
        return f"{self.fn!r} and its arguments"

    def configure(self, pm):
        # The plugins' config groups (cfg.ddp from the ddp plugin), as engine-run adds
        # them; to a copy: every process makes its own from the caller's.
        return finish_config(pm, with_groups(copy.deepcopy(self.cfg), pm.config_groups),
                             _script_name(self.fn))

    def run(self, pm, cfg, world) -> tuple[str, Any]:
        ctx = Context(pm, cfg, world, self.options, recipe_path=script_path(self.fn))
        with ctx.lifecycle() as run:
            ctx.setup()
            try:
                value, status = self.fn(ctx, *self.args), "completed"
                ctx.write_config_unless_resumed()
            except _Stopped:
                status, value = "interrupted", None
            ctx.checkpointer.close()  # the last snapshot durable before the run ends
            run.status = status
        if run.status == "interrupted":  # the line engine-run's Ctrl-C prints
            ctx.print(f"interrupted at {ctx.state.position()}: snapshot written; the same "
                      "command resumes", file=sys.stderr)
        return run.status, value


class _Stopped(KeyboardInterrupt):
    """Ctrl-C, agreed on by the ranks after an optimizer step, whose snapshot is written."""


class Context(WorkerContext):
    """One worker's view of the run, for a loop you write yourself; also the ``ctx``
    of the hooks it fires (what hooks may rely on: ``engine.hookspecs.RunContext``)."""

    def __init__(self, pm, cfg, world, options: dict | None = None,
                 recipe_path: str | None = None):
        super().__init__(pm, cfg, world, options, TrainState(), recipe_path=recipe_path)
        self._train_loaders: list = []
        self._resumed = False

    # ---------------------------------------------------------------- set-up

    def setup(self) -> None:
        """Seed, threads, parallel mode, process group, checkpointer (as Engine.run);
        config.json waits for the resume decision (:meth:`resume`)."""
        cfg, world = self.cfg, self.world
        self.run_parts.parallel = start_worker(self.pm, cfg, world, self.options)
        if self.is_rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)  # the loop may write there
        self.run_parts.checkpointer = open_checkpointer(self.pm, cfg, world, self.out_dir)

    def finish(self, status: str, error: BaseException | None = None) -> dict:
        if status == "failed" and self.checkpointer is not None:  # the config is known
            with contextlib.suppress(OSError):  # the run's own error is the one reported
                self.write_config_unless_resumed()
        return super().finish(status, error)

    def write_config_unless_resumed(self) -> None:
        """config.json for a loop that never called ``ctx.epochs`` or ``ctx.resume``
        (their resume writes it): there was no resume decision to wait for."""
        if not self._resumed:
            self.write_config()

    @property
    def module(self):
        """The model without its parallel wrapper (what snapshots hold)."""
        self._need_model("ctx.module")
        return self.parallel.unwrap(self.model)

    # ------------------------------------------------------- model and data

    def wrap(self, model, optimizer, *, scheduler=None, scaler=None):
        """Move ``model`` to the device and wrap it for the parallel mode (DDP when
        there are several processes); returns ``(model, optimizer)``.

        The optimizer may be built before or after: it keeps the same parameters;
        except under ``fsdp``, which replaces them with shards: pass a function of the
        wrapped model that builds it (``lambda m: torch.optim.AdamW(m.parameters())``).
        ``scheduler`` and ``scaler`` (a GradScaler), when given, are saved in snapshots
        too. Every optimizer step counts in ``ctx.state.step``."""
        if self.model is not None:
            raise ConfigError("ctx.wrap was called twice; a Context trains one model "
                              "(with one optimizer)")
        if not (hasattr(optimizer, "state_dict") or callable(optimizer)):
            raise ConfigError(f"ctx.wrap(model, optimizer): {optimizer!r} is not a torch "
                              "optimizer (nor a function of the model that builds one)")
        # Activation checkpointing, compile, the wrap, the optimizer: the steps engine-run
        # takes (engine/worker_setup.py).
        parts = self.run_parts
        parts.model = prepare_model(model, self.cfg, parts.parallel, self.device, self.print)
        optimizer = build_optimizer(optimizer, parts.module, parts.parallel)
        parts.optimizer, parts.scheduler, parts.scaler = optimizer, scheduler, scaler
        # What snapshots hold (engine/stateful.py); the loop's own parts: ctx.add_state.
        self.add_core_parts(self.state, lambda: self.train_loader)
        # Counted on the host by a post-step hook: no device synchronisation.
        optimizer.register_step_post_hook(self._count_step)
        if self.cfg.preemption:  # Ctrl-C: a stop after a step, with its snapshot
            self.preemption, self._stop_sums = PreemptionFlag(), None
            self.preemption.install(("SIGINT",))
        return self.model, optimizer

    def _count_step(self, optimizer, args, kwargs) -> None:
        self.state.step += 1
        if self.preemption is not None and self._agree_to_stop():
            self.save()
            raise _Stopped

    def _agree_to_stop(self) -> bool:
        """Whether Ctrl-C reached any rank, as the Trainer learns it: a sum started every
        ``log_every`` steps is read at the next (done by then: no wait)."""
        if self.world_size == 1 or self.state.step % self.cfg.log_every:
            return self.world_size == 1 and bool(self.preemption)
        import torch  # as in reduce

        sums, self._stop_sums = self._stop_sums, distributed.start_all_reduce_sum(
            torch.tensor([float(bool(self.preemption))], device=self.device))
        return sums is not None and sums.values()[0] > 0

    def loader(self, dataset, batch_size: int, *, train: bool = True,
               num_workers: int = 0, drop_last: bool = False):
        """A DataLoader over this rank's share of ``dataset``.

        ``batch_size`` is the global batch, as in a recipe: each of the N processes
        loads ``batch_size / N`` samples per step (an uneven split is an error).
        Training loaders shuffle with a distributed sampler that ``ctx.epochs`` (or
        ``ctx.set_epoch``) moves to each new epoch; ``train=False`` gives a validation
        loader where every sample is seen exactly once over all ranks.

        A stream (an IterableDataset) gives each rank its part; train its training
        loader's ``padding`` batches with loss times 0 (docs/library.md, "Streams")."""
        # they import torch: kept out of engine.launch's launcher
        from engine import data, streaming

        micro_batch = data.split_batch(batch_size, self.world_size, 1)
        pin_memory = loader_settings.pinned(num_workers, self.device.type)
        if not train:
            return streaming.val_loader(dataset, batch=micro_batch, world=self.world,
                                        num_workers=num_workers, pin_memory=pin_memory)
        if streaming.is_stream(dataset):
            return self._stream_loader(dataset, micro_batch, num_workers=num_workers,
                                       pin_memory=pin_memory, drop_last=drop_last)
        loader = training_loader(dataset, micro_batch=micro_batch, world=self.world,
                                 seed=self.cfg.seed, num_workers=num_workers,
                                 pin_memory=pin_memory, drop_last=drop_last,
                                 drop_last_name="drop_last=False")
        if not self._train_loaders:  # the first one tells where the epoch stands
            loader.counts_in = self.state
            self.run_parts.train_loader = loader  # its position is the one snapshots record
        self._train_loaders.append(loader)
        return loader

    def _stream_loader(self, dataset, micro_batch: int, **loader_kwargs):
        """A stream's training loader (engine/streaming.py), counting in ``ctx.state``."""
        from engine import streaming  # imports torch (see loader)

        if self._train_loaders:
            raise ConfigError(
                "ctx.loader: a training stream must be the run's first training loader "
                "(snapshots record the first one's position); create it before the others")
        if self._resumed and self.state.batch_in_epoch:
            raise ConfigError(
                "ctx.loader: the run resumed mid-epoch before its training stream had a "
                "loader, so the stream's position was not restored; call ctx.loader "
                "before ctx.epochs() or ctx.resume()")
        loader = streaming.StreamLoader(dataset, micro_batch=micro_batch, world=self.world,
                                        **loader_kwargs)
        loader.counts_in = self.state
        self.run_parts.train_loader = loader
        self._train_loaders.append(loader)
        return loader

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle every training loader for ``epoch`` (``ctx.epochs`` does this).
        For the epoch a snapshot stopped in (``ctx.state.epoch``) the loaders start
        where it stopped; ``ctx.state`` then follows this epoch."""
        batches = self.state.batch_in_epoch if epoch == self.state.epoch else 0
        self.state.epoch, self.state.batch_in_epoch = epoch, batches
        for loader in self._train_loaders:  # the position in global samples
            loader.start_epoch(epoch, start_sample=batches * loader.batch_size
                               * self.world_size)

    # --------------------------------------------------------------- epochs

    def epochs(self, total: int) -> Iterator[int]:
        """Resume, then yield the epochs still to run (counted from 0), each after
        ``set_epoch``; a snapshot follows every epoch whose body completes (every
        ``cfg.checkpoint.every_epochs``, and the last). Leaving the loop early (break,
        an exception) saves nothing for the unfinished epoch."""
        self._need_model("ctx.epochs")
        self.epochs_requested = total
        self.resume()
        self.report_if_complete(total, more="ctx.epochs({n})",
                                over="engine.launch(..., resume=False, overwrite=True)")
        every = self.cfg.checkpoint.every_epochs
        while self.state.epoch < total:
            epoch = self.state.epoch
            self.set_epoch(epoch)
            yield epoch
            self.state.epoch = self.state.epochs_completed = epoch + 1
            self.state.batch_in_epoch = 0
            if (every and (epoch + 1) % every == 0) or epoch + 1 == total:
                self.save()

    def resume(self) -> None:
        """Load the latest good snapshot (or ``resume=PATH``) once; a no-op when there
        is none or ``resume=False``. Collective: every rank calls it."""
        self._need_model("ctx.resume")
        if self._resumed:
            return
        self._resumed = True
        if differs_from_default(self.cfg.checkpoint, "memory_every_steps"):
            self.warn("checkpoint.memory_every_steps is for engine-run's training loop: a "
                      "custom loop's snapshots are ctx.save()'s, on disk")
        if self.cfg.scheduler_metric:
            self.warn("scheduler_metric is for engine-run's training loop: a custom loop "
                      "steps its own scheduler (scheduler.step(metrics['val/loss']))")
        snapshot.resume(self)
        # After the resume's config check (as Engine._setup): a resume refused because
        # the config changed leaves the run's own config.json.
        self.write_config()

    def save(self):
        """Write a snapshot through the checkpoint plugin. Collective: every rank calls
        it (rank 0 writes, unless the checkpointer shards). Returns the path on the
        writing rank, else None."""
        self._need_model("ctx.save")
        self.parallel.sync_buffers(self.model)  # BatchNorm statistics equal on every rank
        return snapshot.save(self)

    # -------------------------------------------------------------- metrics

    def reduce(self, metrics: dict[str, Any], op: str = "mean") -> dict[str, float]:
        """Combine scalars (numbers or one-element tensors) over all ranks in one
        collective; returns Python floats, the same on every rank. Collective."""
        import torch  # kept out of engine.launch's launching process (as engine.data)

        if op not in ("mean", "sum"):
            raise ConfigError(f"ctx.reduce: op {op!r} is not one of: mean, sum")
        names = list(metrics)
        if not names:
            return {}
        values = torch.stack([torch.as_tensor(metrics[n]).detach().reshape(())
                              .to(self.device, torch.float64) for n in names])
        distributed.all_reduce_sum(values)
        if op == "mean":
            values /= self.world_size
        reduced = dict(zip(names, values.tolist()))
        self.metrics.update(reduced)
        return reduced

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Hand scalars to the logger plugins (``engine_log``) on rank 0; the other
        ranks return at once. ``step`` defaults to the optimizer steps so far."""
        if not self.is_rank0:
            return
        values = {name: float(value) for name, value in metrics.items()}
        self.metrics.update(values)
        self.pm.hook.engine_log(ctx=self, metrics=values,
                                step=self.state.step if step is None else step)

    def barrier(self) -> None:
        distributed.barrier()

    def _need_model(self, what: str) -> None:
        if self.model is None:
            raise ConfigError(f"{what} needs the model: call "
                              "`model, optimizer = ctx.wrap(model, optimizer)` first")

