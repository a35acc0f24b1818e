"""What every worker has, whichever loop trains: one base for ``engine.engine.Engine``
(``engine-run``) and ``engine.api.Context`` (a loop you write yourself).

A worker context holds the world, the config, the train state, the model and its
companions once they exist, rank-0 output, and the end of the run (:meth:`WorkerContext.
lifecycle`, :meth:`WorkerContext.finish`): the one summary builder and its write rule.
It is the ``ctx`` argument of every hook and of a recipe's functions
(``engine.hookspecs.RunContext`` lists what a plugin may rely on).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pathlib
import time
from typing import Any

import attrs

import engine
from engine import config as config_mod
from engine import distributed, phases, rng, shards, stateful, worker_setup
from engine.atomic_io import atomic_write_text
from engine.compile import explain_failure, seconds_spent
from engine.compile import report as compile_report
from engine.errors import RunError, one_line, warn
from engine.metrics import (SUMMARY_METRICS, throughput_of, throughput_summary,
                            throughput_unit, validation_summary)
from engine.processes import spawned_here
from engine.stateful import SnapshotParts, model_digest, plain_keys
from engine.worker_setup import RunParts

# The metric-name vocabulary is engine/metrics.py's; it stays importable from here for
# plugins that import it from here.
__all__ = ["RunOutcome", "WorkerContext", "utc_now", "weights_digests", "SUMMARY_METRICS",
           "throughput_of", "throughput_summary", "throughput_unit", "validation_summary"]

#: Worker start moved to engine/worker_setup.py (0.2.0); still importable from here.
_MOVED_TO_WORKER_SETUP = frozenset({"start_worker", "seed_everything",
                                    "use_deterministic_kernels", "callers_state_kept"})


def __getattr__(name: str):
    if name in _MOVED_TO_WORKER_SETUP:
        return getattr(worker_setup, name)
    raise AttributeError(f"module 'engine.context' has no attribute {name!r}")


def utc_now(at: float | None = None) -> str:
    """An ISO 8601 timestamp in UTC, to the second (``2026-01-31T12:00:00+00:00``): now,
    or the ``time.time()`` ``at``."""
    when = (datetime.datetime.now(datetime.timezone.utc) if at is None
            else datetime.datetime.fromtimestamp(at, datetime.timezone.utc))
    return when.isoformat(timespec="seconds")


def weights_digests(module, warn) -> dict:
    """Every rank digests its own copy of the weights: DDP promises they are equal, we
    check (a collective: every rank calls it)."""
    if shards.is_sharded(module):
        # One model spread over the ranks (fsdp): the digest of its full state, which
        # only rank 0 gathers; every rank reports that one.
        full = stateful.ModelState(module).state_dict()
        digest = distributed.broadcast_object(model_digest(full) if full else None)
        return {"weights_sha256": digest,
                "weights_sha256_per_rank": distributed.all_gather_object(digest)}
    digests = distributed.all_gather_object(model_digest(plain_keys(module.state_dict())))
    if len(set(digests)) > 1:
        warn("the ranks finished with different weights: "
             + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
    return {"weights_sha256": digests[0], "weights_sha256_per_rank": digests}


class _Part:
    """An attribute of the run kept in its :class:`RunParts` record (``ctx.model`` is
    ``ctx.run_parts.model``): recipes and hooks read it on the run, the training loop on
    the record that engine/worker_setup.py's steps fill."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, ctx, owner=None):
        return self if ctx is None else getattr(ctx.run_parts, self.name)

    def __set__(self, ctx, value) -> None:
        setattr(ctx.run_parts, self.name, value)


class WorkerContext:
    """One worker's run. Subclasses set up the model and data their own way (the steps
    of engine/worker_setup.py); the parts are None until they exist."""

    parallel = _Part()  # the parallel mode (engine.parallel.Parallel)
    model = _Part()  # as trained: wrapped by the parallel mode
    optimizer = _Part()
    scheduler = _Part()
    scaler = _Part()
    loss_fn = _Part()
    checkpointer = _Part()
    train_loader = _Part()
    val_loader = _Part()
    micro_batch = _Part()
    loader_settings = _Part()
    steps_per_epoch = _Part()
    total_steps = _Part()
    snapshots = _Part()  # engine-run's snapshot layer (engine/snapshot.py), the tier's owner

    def __init__(self, pm, cfg, world, options: dict[str, Any] | None, state,
                 recipe_path: str | None = None, run_parts: RunParts | None = None):
        self.pm = pm
        self.cfg = cfg
        self.world = world
        self.options = dict(options or {})
        self.state = state  # engine.engine.TrainState: epoch, step, epochs_completed...
        self.metrics: dict[str, float] = {}  # the latest reduced or logged values
        # What the loop drives, filled by engine/worker_setup.py's steps.
        self.run_parts = run_parts if run_parts is not None else RunParts()
        self.preemption = None  # engine.preemption.PreemptionFlag while training
        # Everything a snapshot holds, part by part (engine/stateful.py).
        self.snapshot_parts = SnapshotParts()
        self.recipe_path = recipe_path  # the recipe file, or the custom loop's script
        self.epochs_requested: int | None = None
        self.resumed_from: str | None = None  # the snapshot a resume loaded
        # Where the resume came from: {"tier": memory|peer|disk, "step", "steps_lost",
        # "source_rank"} (engine/snapshot.py), or None.
        self.resume_record: dict | None = None
        # summary.json's memory_snapshots: the memory tier's interval and what its
        # snapshots cost (engine/memory/cost.py's MemoryCost.record); None without the tier.
        self.memory_record: dict | None = None
        self._weights: dict | None = None  # the weights digests, once gathered
        self._warned: set[str] = set()
        self._compiled_before = seconds_spent()  # torch.compile's count (compile_s)
        phases.mark("imports, plugins, recipe")
        # This segment's start: the command's (engine-run's, fit's), on the clock that
        # the console's done: line reads too (engine/phases.py), so both say one time.
        self._started_at = utc_now(time.time() - phases.elapsed())

    @property
    def out_dir(self) -> pathlib.Path:
        """The run's folder: ``cfg.out_dir``, its pattern filled once the worker has
        started (engine/run_dir.py)."""
        return pathlib.Path(self.cfg.out_dir)

    @out_dir.setter
    def out_dir(self, value) -> None:
        self.cfg.out_dir = str(value)

    # ------------------------------------------------------------- the world

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def local_rank(self) -> int:
        return self.world.local_rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def is_rank0(self) -> bool:
        return self.world.rank == 0

    @property
    def device(self):
        """The torch device this process computes on (put your batches there)."""
        return self.parallel.device

    @property
    def module(self):
        """The model without its parallel wrapper (what snapshots hold)."""
        return self.run_parts.module

    # ----------------------------------------------------------- state parts

    def add_state(self, name: str, part) -> None:
        """Save ``part`` (anything with ``state_dict()`` and ``load_state_dict()``: an
        EMA of the weights, a curriculum, a custom sampler) in every snapshot under
        ``name``, and restore it on resume. Before the resume, so that it is restored."""
        self.snapshot_parts.current_owner = "the training loop"
        try:
            self.snapshot_parts.add(name, part)
        finally:
            self.snapshot_parts.current_owner = "the engine"

    def add_core_parts(self, progress, loader, recipe_parts=None) -> None:
        """The parts every run has, in the order of engine/stateful.py, once the model,
        optimizer, scheduler, scaler and checkpointer exist: ``progress`` is the loop's
        own (the TrainState, or the Trainer that owns it), ``loader`` returns the first
        training loader (or None); then the recipe's and the plugins' parts."""
        parts = self.snapshot_parts
        sharded = self.checkpointer.distributed_state_dict
        parts.add("model", stateful.ModelState(self.module, sharded))
        parts.add("optimizer", stateful.OptimizerState(self.module, self.optimizer, sharded))
        if self.scheduler is not None:
            parts.add("scheduler", self.scheduler)
        if self.scaler is not None:
            parts.add("scaler", self.scaler)
        parts.add("progress", progress)
        parts.add("loader", stateful.LoaderPosition(self.state, loader, self.world_size,
                                                       self.warn))
        parts.add("metrics", stateful.Metrics(self.metrics))
        stateful.add_extra_parts(parts, self.pm, self, recipe_parts)
        parts.add("rng", rng.RngStates(self.world, self.warn))

    def record_memory(self, record: dict) -> None:
        """summary.json's ``memory_snapshots`` (the memory tier's interval and costs)."""
        self.memory_record = record

    def record_resume(self, source, tier: str, step: int, reached: int,
                      source_rank: int | None = None) -> None:
        """What summary.json's ``resumed_from`` and ``resume`` report
        (engine/snapshot.py's resume): the snapshot loaded, the tier (memory, peer or
        disk), the step resumed at and the steps recomputed (when the interrupted run
        said how far it got)."""
        self.resumed_from = source
        self.resume_record = {"tier": tier, "step": step,
                              "steps_lost": max(0, reached - step) if reached else None,
                              "source_rank": source_rank}

    # --------------------------------------------------------- rank-0 output

    def print(self, *args, **kwargs) -> None:
        """``print`` on rank 0 only (flushed, so it shows up in order in log files)."""
        if self.is_rank0:
            print(*args, **kwargs, flush=True)

    def warn(self, message: str) -> None:
        """A warning on stderr, once per message, on rank 0 only."""
        if self.is_rank0:
            warn(message, said=self._warned)

    def warn_here(self, message: str) -> None:
        """A warning about this rank's own machine (its buffers, its tmpfs), on whichever
        rank it is: rank 0 cannot see it, so :meth:`warn` would drop it."""
        warn(f"rank {self.world.rank}: {message}", said=None)

    def write_config(self) -> None:
        """``<out_dir>/config.json``: the resolved config (rank 0)."""
        if self.is_rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(
                json.dumps(config_mod.to_dict(self.cfg), indent=1))

    def report_if_complete(self, requested: int, more: str, over: str) -> None:
        """Say so when the resumed run has nothing left to train (a re-run asking for
        as many epochs as it has, or fewer), and how to train on or start over: ``more``
        is how to ask for more epochs (``{n}``: the least that trains), ``over`` how to
        start afresh."""
        done = self.state.epochs_completed
        if 0 < requested <= done and self.state.batch_in_epoch == 0:
            self.print(f"already complete: {self.out_dir} holds a finished run of {done} "
                       f"epoch{'' if done == 1 else 's'} (asked for {requested}), nothing to "
                       f"train; to train on, ask for more ({more.format(n=done + 1)} or "
                       f"more); to start over, use {over} or another out_dir")

    # ------------------------------------------------------------------ end

    @contextlib.contextmanager
    def lifecycle(self):
        """The one run lifecycle of both loops (the Engine's and a custom loop's), around
        the body that sets up and trains. A failure fires ``engine_exception`` and is
        replaced by the error the user should read (:meth:`explain`); however the body
        ends, :meth:`finish` follows. The body sets ``run.status`` when it succeeded;
        after the block ``run.summary`` holds the summary::

            with ctx.lifecycle() as run:
                ...                       # set up, train
                run.status = "completed"  # or "preempted"
            return run.summary
        """
        run = RunOutcome()
        try:
            yield run
        except BaseException as exc:
            self.pm.hook.engine_exception(ctx=self, exc=exc)
            if isinstance(exc, KeyboardInterrupt):
                # Ctrl-C before the training loop took it as a stop request, or a second
                # one: an interruption (the newest snapshot resumes), not a failure.
                run.status, run.error = "interrupted", exc
                raise
            run.error = self.explain(exc)
            if run.error is exc:
                raise
            raise run.error from exc
        finally:
            run.summary = self.finish(run.status, run.error)

    def explain(self, exc: BaseException) -> BaseException:
        """The error the user should see for ``exc``: a failed torch.compile in one line
        (the Engine adds the parallel mode's hints)."""
        failed = (None if self.model is None
                  else explain_failure(exc, self.module, self.cfg.compile))
        return failed or exc

    def finish(self, status: str, error: BaseException | None = None) -> dict:
        """The end of the run, however it ends; returns the summary. In order: the
        checkpointer closed (quietly when the run failed: the first error is the one
        reported), the summary built (weights digests, a collective, only when the run
        completed), compile time printed, ``engine_run_end`` on every rank,
        summary.json on rank 0 always, the process group destroyed unless the run
        failed (a rank may be gone).

        Call it on every rank. A run that completed or was pre-empted must have closed
        its checkpointer already (a failed final write then fails the run). A run that
        ended by an exception (``error``; a KeyboardInterrupt for status "interrupted")
        is torn down as a failed one."""
        abrupt = error is not None or status == "failed"
        if self.preemption is not None:
            # A second signal during the teardown of a pre-empted run changes nothing;
            # nor does a second Ctrl-C in a spawned worker (its launcher ends it), while
            # in the launching process it ends the teardown as the user asks.
            self.preemption.uninstall(ignore_more=status == "preempted" or (
                status == "interrupted" and spawned_here()))
        if abrupt and self.checkpointer is not None:
            # Earlier snapshots still in flight finish; the first error is the one
            # reported, so a second one here is not.
            with contextlib.suppress(Exception):
                self.checkpointer.close()
        summary = self.summary(status, error)
        self.print_compile_time(summary)
        self.pm.hook.engine_run_end(ctx=self, summary=summary)
        if self.is_rank0:
            self.write_summary(summary)
        phases.mark("summary")
        if not abrupt:
            distributed.destroy()
        phases.report(self.options.get("verbose") and self.is_rank0)
        return summary

    def summary(self, status: str, error: BaseException | None = None) -> dict:
        """The one summary, the same keys from both loops (``None`` where unknown).
        A collective when the run completed (weights digests): every rank calls it."""
        import torch  # summary.json's torch_version; engine.context itself needs no torch

        summary = {
            "status": status,
            "error": None if error is None or status == "interrupted" else one_line(error),
            "recipe": self.recipe_path,
            "world_size": self.world.world_size,
            "launcher": self.world.launcher,
            "parallel": self.parallel.name if self.parallel else None,
            "epochs_requested": self.epochs_requested,
            "epochs_completed": self.state.epochs_completed,
            "global_step": self.state.step,
            # Early stopping ended the run (now or in the run this one resumed).
            "stopped_early": bool(getattr(self.state, "stopped_early", False)),
            "started_at": self._started_at,
            "ended_at": utc_now(),
            **self.times(),
            **{short: self.metrics.get(long) for long, short in SUMMARY_METRICS.items()},
            **validation_summary(self.metrics),
            **throughput_summary(self.metrics),
            "metrics": dict(self.metrics),
            "resumed_from": _path_or_none(self.resumed_from),
            # Where the resume came from: tier (memory, peer, disk), step, steps_lost.
            "resume": self.resume_record,
            # The memory tier's interval (a crash loses at most that many steps) and cost.
            "memory_snapshots": self.memory_record,
            "final_checkpoint": self._checkpoint(status, "latest"),
            # checkpoint.best_metric set: the snapshot best by it (kept past keep_last).
            "best_checkpoint": self._checkpoint(status, "best"),
            "torch_version": torch.__version__,
            "engine_version": engine.__version__,
            "weights_sha256": None,
            "weights_sha256_per_rank": None,
            "compile_s": None,  # seconds torch.compile took (compile.enabled)
        }
        if self.model is not None and status == "completed":
            if self._weights is None:
                self.gather_weights()
            summary.update(self._weights)
        return summary

    def times(self) -> dict:
        """The summary's times (docs/outputs.md, summary.json). ``wall_time_s``: this segment,
        from the command's start (engine-run's or fit's, as the console's ``done:``
        line) to now; ``training_time_s``: the training loop's part of it. A resumed
        run adds the totals of the segments before it, from the summary.json the last
        one wrote, to its own: ``total_wall_time_s``, ``total_training_time_s`` and
        ``segments`` (the commands that trained the run)."""
        wall, training = phases.elapsed(), phases.training_time()
        own = {"wall_time_s": wall, "training_time_s": training, "segments": 1,
               "total_wall_time_s": wall, "total_training_time_s": training}
        before = self._previous_summary() if self.resumed_from is not None else {}
        if before.get("status") is not None:
            # An earlier attempt of this same command (spawn --max-restarts started the
            # workers again) ended after this segment began: its wall time is in ours.
            same_command = str(before.get("ended_at") or "") > self._started_at
            segments = _seconds(before.get("segments")) or 1
            own["segments"] = int(segments if same_command else segments + 1)
            for key in ("wall_time_s", "training_time_s"):
                earlier = _seconds(before.get(f"total_{key}", before.get(key)))
                if key == "wall_time_s" and same_command:
                    earlier = (earlier or 0.0) - (_seconds(before.get(key)) or 0.0)
                own[f"total_{key}"] = (None if own[key] is None or earlier is None
                                       else own[key] + max(0.0, earlier))
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in own.items()}

    def _previous_summary(self) -> dict:
        """The summary.json the segment before this one wrote ({} when there is none
        or it cannot be read: the totals are then this segment's)."""
        try:
            found = json.loads((self.out_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def print_compile_time(self, summary: dict) -> None:
        """With compile.enabled: ``compile_s`` in the summary, and one line on rank 0."""
        summary["compile_s"], line = compile_report(self.cfg.compile, self._compiled_before)
        if line:
            self.print(line)

    def gather_weights(self) -> None:
        """The closing collective of a completed run: every rank's weights digest. The
        Engine calls it while its errors are still explained, so that a rank whose peer
        failed at the very end says which rank stopped answering, not a traceback."""
        # BatchNorm statistics equal on every rank (a no-op when they already are).
        self.parallel.sync_buffers(self.model)
        self._weights = weights_digests(self.module, self.warn)
        phases.mark("closing digest")

    def _checkpoint(self, status: str, which: str) -> str | None:
        """The checkpointer's ``latest()`` (the newest good snapshot) or ``best()``, as
        rank 0 sees it (the rank that writes the summary; the others say None rather
        than read the disk)."""
        if self.checkpointer is None or not self.is_rank0:
            return None
        try:
            return _path_or_none(getattr(self.checkpointer, which)())
        except Exception:
            if status != "failed":
                raise
            return None  # a failing run's summary is written all the same

    def write_summary(self, summary: dict) -> None:
        path = self.out_dir / "summary.json"
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
        except OSError as exc:
            # One line, not a traceback; and what the training produced is safe.
            kept = summary.get("final_checkpoint")
            error = RunError(
                f"cannot write {path}: {exc.strerror or exc}; "
                + (f"the last snapshot {kept} is intact" if kept else "no snapshot was saved"))
            if summary.get("status") == "failed":
                self.warn(str(error))  # the run's own error is the one to report
                return
            raise error from None


@attrs.define
class RunOutcome:
    """How a run's :meth:`WorkerContext.lifecycle` ended."""

    status: str = "failed"  # the body sets "completed" or "preempted" when it succeeds
    error: BaseException | None = None
    summary: dict | None = None


def _seconds(value) -> float | None:
    """A number read from an older summary.json, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _path_or_none(path) -> str | None:
    return None if path is None else str(path)
