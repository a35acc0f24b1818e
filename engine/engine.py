"""One worker's run: set up (engine/worker_setup.py's steps, into the RunParts record),
resume from the latest good snapshot, ``Trainer.fit()``, tear down
(engine/context.py: WorkerContext.finish). docs/architecture.md tells the whole story.
"""

from __future__ import annotations

import sys
from typing import Any

from engine import (distributed, health, memory_ring, memory_snapshot, phases, preemption,
                    snapshot)
from engine.context import WorkerContext
from engine.errors import EngineError, PeerFailed, RunError, first_line
from engine.stateful import TrainState, is_sharded
from engine.trainer import Trainer  # torch: only workers import engine.engine
from engine.worker_setup import setup_recipe_run, start_worker


class Engine(WorkerContext):
    """A worker under ``engine-run``: the recipe's model and data, trained by the
    Trainer. What it shares with a custom loop's Context is in engine/context.py."""

    def __init__(self, pm, recipe, cfg, world, options: dict[str, Any] | None = None,
                 start_over: str = "--no-resume --overwrite", run_parts=None):
        super().__init__(pm, cfg, world, options, TrainState(),
                         recipe_path=str(recipe.path) if recipe.path else recipe.name,
                         run_parts=run_parts)
        self.recipe = recipe
        self.start_over = start_over  # how the door that launched the run starts afresh
        self.epochs_requested = cfg.epochs

    # ------------------------------------------------------------------- run

    def run(self) -> dict:
        cfg = self.cfg
        with self.lifecycle() as run:
            self.run_parts.parallel = start_worker(self.pm, cfg, self.world, self.options,
                                                   recipe=self.recipe)
            if cfg.preemption:
                self.preemption = preemption.PreemptionFlag()
                self.preemption.install()
            trainer = self._setup()
            self.report_if_complete(cfg.epochs, more="epochs={n}", over=self.start_over)
            if cfg.limit_batches:
                self.print(f"smoke run: {cfg.max_steps} step(s) and {cfg.limit_batches} "
                           "validation batch(es) per process, one epoch, started afresh "
                           f"in {self.out_dir} (a real run never resumes from it)")
            self.pm.hook.engine_run_start(ctx=self)
            outcome = trainer.fit()
            phases.mark(phases.TRAINING_ENDS)
            # The last snapshot is durable (or its write failed) before the run counts
            # as completed.
            self.checkpointer.close()
            phases.mark("final snapshot durable")
            if self.memory is not None:
                # The run ended by itself, its last state on disk: the memory snapshots
                # are of no more use. A failed or killed run keeps them for its restart.
                # (Turned off during the run, they are gone already: nothing to remove.)
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
            # The roll call names ranks that stopped answering (a timeout); a closed
            # connection is the echo of a peer's end, which its own error names.
            missing = None if health.peer_is_gone(exc) else health.missing_ranks()
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
                message += "; " + (self.pm.hook.engine_requeue(ctx=self)
                                   or preemption.NOT_REQUEUED)
            preemption.report(message)

    def _setup(self):
        """Data, model, optimizer and their companions (engine/worker_setup.py), the
        snapshot parts, the resume; returns the Trainer that will train them."""
        parts = setup_recipe_run(self, self.recipe)
        parts.memory = self._memory_snapshots()
        # Before the resume: its progress is a snapshot part. It checks the metrics the
        # config names (engine.metrics.NamedMetrics): a refused run wrote nothing.
        trainer = Trainer(self, parts)
        self.add_core_parts(trainer, lambda: parts.train_loader,
                            recipe_parts=self.recipe.optional("state_parts"))
        snapshot.resume(self)
        # After the resume's config check: a refused resume leaves the old config.json.
        self.write_config()
        return trainer

    def _memory_snapshots(self):
        """This rank's in-memory snapshots (checkpoint.memory_every_steps), or None: off.
        Under fsdp each rank's snapshots hold its own shards (stateful.to_shards). auto
        starts at every step, which measures their cost; the ranks then agree on the
        interval it allows at their check points (engine/snapshot.py's Snapshots)."""
        every = self.cfg.checkpoint.memory_every_steps
        if not every:
            return None
        return self._open_memory_snapshots(1 if every == "auto" else every)

    def _open_memory_snapshots(self, every: int):
        """The run's id (rank 0 keeps it in the run folder: new when the run starts
        afresh), the leftovers of earlier runs removed (each machine's local rank 0),
        and this user's buffer folder checked on every rank. Collective. None, with one
        warning, when any rank cannot use its tmpfs safely: the tier is off everywhere
        together, since a memory snapshot is a collective."""
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
                shm=self.cfg.checkpoint.memory_dir, sharded=is_sharded(self.module))
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
        if memory_ring.wanted(memory):  # fsdp: a copy of each rank's at its successor
            memory.ring = memory_ring.Ring(memory, self.cfg.timeout_s)  # collective
        return memory

