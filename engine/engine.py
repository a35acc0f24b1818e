"""One worker's run: set up (engine/worker_setup.py's steps, into the RunParts record),
resume from the latest good snapshot, ``Trainer.fit()``, tear down
(engine/context.py: WorkerContext.finish). docs/architecture.md tells the whole story.
"""

from __future__ import annotations

import sys
from typing import Any

from engine import distributed, health, phases, preemption
from engine.context import WorkerContext
from engine.errors import EngineError, PeerFailed, RunError, first_line
from engine.stateful import TrainState
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
            self.snapshots.ended()
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
        if self.snapshots is not None:
            self.snapshots.close(wait=error is None and status != "failed")
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
                f"{self.state.step}: {who} (timeout {self.cfg.timeout_s:g}s): "
                f"{distributed.gloo_text(line)}")
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
        # Before the resume: its progress is a snapshot part. It checks the metrics the
        # config names (engine.metrics.NamedMetrics): a refused run wrote nothing.
        trainer = Trainer(self, parts)  # and the snapshot layer, self.snapshots
        self.add_core_parts(trainer, lambda: parts.train_loader,
                            recipe_parts=self.recipe.optional("state_parts"))
        self.snapshots.resume()  # the memory tier opened first, when on
        # After the resume's config check: a refused resume leaves the old config.json.
        self.write_config()
        return trainer
