"""One worker's run: set up, train, tear down.

``Engine.run`` is the whole story of a worker process, top to bottom::

    seed every RNG, set threads
    parallel mode: devices, backend       -> process group (if more than one process)
    data: prepare on local rank 0 first, then build datasets and loaders on every rank
    model on the device, compiled (compile.*), wrapped; optimizer, scheduler, grad scaler
    resume from the latest good snapshot (if any)
    Trainer.fit()                         -> epochs, validation, snapshots
    final snapshot durable; summary.json (rank 0, however the run ended); process group
    destroyed (engine/context.py: WorkerContext.finish)
"""

from __future__ import annotations

import sys
from typing import Any

from engine import phases
from engine.worker_setup import prepare_model, start_worker
from engine.context import WorkerContext
from engine.errors import ConfigError, EngineError, PeerFailed, RunError, first_line
from engine.stateful import TrainState


class Engine(WorkerContext):
    """A worker under ``engine-run``: the recipe's model and data, trained by the
    Trainer. What it shares with a custom loop's Context is in engine/context.py."""

    def __init__(self, pm, recipe, cfg, world, options: dict[str, Any] | None = None,
                 start_over: str = "--no-resume --overwrite"):
        super().__init__(pm, cfg, world, options, TrainState())
        self.recipe = recipe
        self.start_over = start_over  # how the door that launched the run starts afresh
        self.recipe_path = str(recipe.path) if recipe.path else recipe.name
        self.epochs_requested = cfg.epochs
        self.train_loader = None
        self.val_loader = None
        self.memory = None  # in-memory snapshots (engine/memory_snapshot.py), when on

    # ------------------------------------------------------------------- run

    def run(self) -> dict:
        from engine import preemption

        cfg = self.cfg
        with self.lifecycle() as run:
            self.parallel = start_worker(self.pm, cfg, self.world, self.options)
            if cfg.preemption:
                self.preemption = preemption.PreemptionFlag()
                self.preemption.install()
            trainer = self._setup()
            self.report_if_complete(cfg.epochs, more="epochs={n}", over=self.start_over)
            if cfg.limit_batches:
                self.print(f"smoke run: {cfg.max_steps} step(s) and {cfg.limit_batches} "
                           "validation batch(es) per process, one epoch, started afresh "
                           f"in {self.out_dir} (a real run never resumes from it)")
            self.pm.hook.engine_run_start(engine=self)
            outcome = trainer.fit()
            phases.mark(phases.TRAINING_ENDS)
            # The last snapshot is durable (or its write failed) before the run counts
            # as completed.
            self.checkpointer.close()
            phases.mark("final snapshot durable")
            if self.memory is not None:
                # The run ended by itself, its last state on disk: the memory snapshots
                # are of no more use. A failed or killed run keeps them for its restart.
                self.memory.remove()
            if outcome == "completed":
                self.gather_weights()
                self._after_training()
            elif self.preemption is not None and self.preemption.interrupted:
                outcome = "interrupted"  # Ctrl-C: stopped as a pre-emption, not requeued
            run.status = outcome
        if run.status in ("preempted", "interrupted"):
            self._after_preemption()
        return run.summary

    def finish(self, status: str, error: BaseException | None = None) -> dict:
        if self.memory is not None:
            # However the run ended (a run that completed removed them already): the
            # buffers' files stay for a restart, their thread and mappings go. A failed
            # run does not wait for the thread, which may wait on a gone peer.
            self.memory.close(wait=error is None and status != "failed")
        return super().finish(status, error)

    def explain(self, exc: BaseException) -> BaseException:
        """The error a user should see: a hint from the parallel mode, or, when a
        collective failed, which ranks stopped answering."""
        from engine import distributed, health

        if isinstance(exc, EngineError) or not isinstance(exc, Exception):
            return exc
        explained = super().explain(exc)  # a compile failure
        if explained is not exc:
            return explained
        line = first_line(exc)
        hint = self.parallel.explain(exc) if self.parallel is not None else None
        if hint:
            return RunError(f"{type(exc).__name__}: {line}; hint: {hint}")
        if distributed.is_initialized() and health.is_collective_failure(exc):
            missing = health.missing_ranks()
            who = (f"rank(s) {', '.join(map(str, missing))} stopped answering" if missing
                   else "another rank failed or stopped answering")
            stopped = distributed.stopped_local_peers(missing or [])
            if stopped:
                who += (f" (rank(s) {', '.join(map(str, stopped))}: its process on this "
                        "machine is stopped, by SIGSTOP or a debugger, and is killed so "
                        "that the job ends)")
            return (RunError if missing else PeerFailed)(
                f"rank {self.world.rank}: a collective operation failed at step "
                f"{self.state.step}: {who} (timeout {self.cfg.timeout_s:g}s): {line}")
        return exc

    def _after_training(self) -> None:
        """The recipe's ``on_train_end(cfg, ctx)``, on every rank, once the epochs are
        done (a sample of generated text, an export...)."""
        on_train_end = self.recipe.optional("on_train_end")
        if on_train_end is not None:
            on_train_end(self.cfg, self)

    def _after_preemption(self) -> None:
        from engine import preemption

        if self.preemption is not None and self.preemption.interrupted:
            # The one line of a Ctrl-C (the launcher adds none).
            self.print(f"interrupted at {self.state.position()}: snapshot written; the "
                       "same command resumes", file=sys.stderr)
            return
        signal_name = self.preemption.signal_name if self.preemption else None
        message = (f"pre-empted{f' by {signal_name}' if signal_name else ''}: snapshot "
                   f"written at {self.state.position()}")
        if self.is_rank0:
            if self.cfg.requeue:
                # The scheduler's plugin answers (slurm: scontrol requeue).
                message += "; " + (self.pm.hook.engine_requeue(engine=self)
                                   or preemption.NOT_REQUEUED)
            preemption.report(message)

    def _setup(self):
        """Data, model, optimizer and their companions, the snapshot parts, the resume;
        returns the Trainer that will train them."""
        import torch

        from engine import data, distributed

        cfg, world, recipe = self.cfg, self.world, self.recipe
        self.micro_batch = data.split_batch(cfg.batch_size, world.world_size,
                                            cfg.grad_accum_steps)
        if self.is_rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)

        # Local rank 0 downloads/prepares first; the others wait, then read.
        prepare = recipe.optional("prepare_data")
        if prepare is not None:
            with distributed.local_rank0_first(world):
                if world.is_local_rank0:
                    prepare(cfg, self)
        train_set, val_set = recipe.module.build_datasets(cfg, self)
        if val_set is not None:
            recipe.check_eval_step()
        from engine import loader_settings

        # num_workers, persistence, prefetch, pinning, timeout: engine/loader_settings.py
        self.loader_settings = loader_settings.choose(
            cfg.num_workers, cpus=world.cpu_share(), device_type=self.device.type,
            timeout_s=cfg.timeout_s)
        loader_kwargs = self.loader_settings.loader_kwargs()
        from engine import streaming

        if streaming.is_stream(train_set):  # an IterableDataset: engine/streaming.py
            self.train_loader = streaming.StreamLoader(
                train_set, micro_batch=self.micro_batch, world=world,
                drop_last=cfg.drop_last, **loader_kwargs)
        else:
            self.train_loader = data.train_loader(
                train_set, micro_batch=self.micro_batch, world=world, seed=cfg.seed,
                drop_last=cfg.drop_last, per_sample_seed=cfg.per_sample_seed,
                **loader_kwargs)
        if not streaming.is_stream(train_set) and len(self.train_loader) == 0:
            raise ConfigError(
                f"the training set has {len(train_set)} samples, fewer than one batch of "
                f"{self.micro_batch} per process; use a smaller batch_size or drop_last=false")
        self.val_loader = None if val_set is None else data.val_loader(
            val_set, batch=self.micro_batch, world=world, **loader_kwargs)

        # The model is built right after seeding, as a hand-written loop would, so the
        # initial weights are the same as there.
        torch.manual_seed(cfg.seed)
        model = recipe.module.build_model(cfg)
        if not any(True for _ in model.parameters()):
            raise ConfigError(f"the recipe's build_model returned a model without parameters "
                              f"({type(model).__name__}): there is nothing to train")
        self.parallel.recipe = recipe  # a mode may read the recipe's settings (fsdp)
        self.model = prepare_model(model, cfg, self.parallel, self.device, self.print)
        self.optimizer = recipe.module.build_optimizer(cfg, self.module)
        # The run's length, for schedules by step: the optimizer steps of an epoch
        # (a group of grad_accum_steps micro-batches each, the last maybe shorter), and
        # of the run: the epochs', or max_steps where it ends the run sooner. A stream's
        # length is not known: neither is an epoch's (None), and the run's is max_steps'.
        if streaming.is_stream(train_set):
            self.steps_per_epoch, self.total_steps = None, cfg.max_steps or None
        else:
            self.steps_per_epoch = -(-len(self.train_loader) // cfg.grad_accum_steps)
            self.total_steps = self.steps_per_epoch * cfg.epochs
            if cfg.max_steps:
                self.total_steps = min(self.total_steps, cfg.max_steps)
        self.scheduler = build_scheduler(recipe, cfg, self.optimizer, self)
        self.loss_fn = recipe.optional("loss_fn")  # for the recipe's steps (None: theirs)
        if cfg.precision == "fp16":
            if self.device.type != "cuda":
                raise ConfigError("precision 'fp16' needs a CUDA device; on the CPU use "
                                  "precision=bf16")
            self.scaler = torch.amp.GradScaler("cuda")
        from engine.plan import precision_note

        slow = precision_note(cfg.precision, [str(self.device)])
        if slow:  # the run's first lines, rank 0
            self.warn(slow)
        self.checkpointer = self.pm.checkpointers.get(cfg.checkpointer)(
            self.out_dir / "checkpoints", cfg, world)
        self.memory = self._memory_snapshots()
        from engine import snapshot
        from engine.trainer import Trainer

        # Before the resume: its progress is a snapshot part. It checks the metrics the
        # config names (Trainer.check_named_metrics): a refused run wrote nothing.
        trainer = Trainer(self)
        self.add_core_parts(trainer, lambda: self.train_loader,
                            recipe_parts=recipe.optional("state_parts"))
        snapshot.resume(self)
        # After the resume's config check: a refused resume leaves the old config.json.
        self.write_config()
        return trainer

    def _memory_snapshots(self):
        """This rank's in-memory snapshots (checkpoint.memory_every_steps), or None: off,
        or a model sharded by fully_shard (each rank holds only its shard: a restart
        resumes from the newest disk snapshot, docs/checkpoints.md)."""
        from engine import config as config_mod
        from engine import stateful

        every = self.cfg.checkpoint.memory_every_steps
        if not every:
            return None
        if stateful.is_sharded(self.module):
            if config_mod.differs_from_default(self.cfg.checkpoint, "memory_every_steps"):
                self.warn("checkpoint.memory_every_steps is ignored with a sharded model "
                          f"(parallel={self.cfg.parallel}): a restart resumes from the "
                          "newest disk snapshot")
            return None
        return self._open_memory_snapshots(every)

    def _open_memory_snapshots(self, every: int):
        """The run's id (rank 0 keeps it in the run folder: new when the run starts
        afresh), the leftovers of earlier runs removed (each machine's local rank 0),
        and this user's buffer folder checked on every rank. Collective. None, with one
        warning, when any rank cannot use its tmpfs safely: the tier is off everywhere
        together, since a memory snapshot is a collective."""
        from engine import distributed, memory_snapshot

        opts = self.options
        ids = None
        if self.is_rank0:
            try:
                ids = memory_snapshot.claim_run_id(self.out_dir, bool(opts.get("no_resume")))
            except OSError as exc:
                ids = f"cannot write its id into {self.out_dir}: {exc.strerror or exc}"
        ids = distributed.broadcast_object(ids)
        memory = problem = None
        if isinstance(ids, str):
            problem = ids
        else:
            old, run_id = ids
            memory = memory_snapshot.MemorySnapshots(
                self.out_dir, self.world, every, run_id=run_id,
                shm=self.cfg.checkpoint.memory_dir)
            problem = memory.check()
            if problem is None and self.world.is_local_rank0:
                # --no-resume and --resume PATH: none of the run's snapshots is wanted.
                forget = old if opts.get("no_resume") or opts.get("resume") else None
                _, problems = memory_snapshot.remove_leftovers(
                    self.out_dir, run_id, memory.shm, forget=forget)
                for problem in problems:
                    self.warn_here(problem)
        # Also the barrier after the clean-up: no rank reads its buffers before it.
        problems = [p for p in distributed.all_gather_object(problem) if p]
        if problems:
            self.warn(f"checkpoint.memory_every_steps: in-memory snapshots are off: "
                      f"{problems[0]}; the run goes on with disk snapshots")
            return None
        return memory


def build_scheduler(recipe, cfg, optimizer, ctx):
    """The recipe's ``build_scheduler(cfg, optimizer, ctx)`` (``ctx.steps_per_epoch``,
    ``ctx.total_steps``: the run's length), or ``build_scheduler(cfg, optimizer)`` for a
    recipe that needs no more; None without one."""
    import inspect

    build = recipe.optional("build_scheduler")
    if build is None:
        return None
    try:
        takes_ctx = len(inspect.signature(build).parameters) >= 3
    except (TypeError, ValueError):  # a callable without a signature: the old form
        takes_ctx = False
    return build(cfg, optimizer, ctx) if takes_ctx else build(cfg, optimizer)

