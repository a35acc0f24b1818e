"""``profiler``: a torch.profiler trace of chosen optimizer steps.

Off until asked for through its config group::

    engine-run RECIPE profile.steps=10:13                  # steps 10, 11 and 12, rank 0
    engine-run RECIPE profile.steps=10:13 profile.ranks=all profile.memory=true

- ``steps`` (``START:END``): the optimizer steps to record, END excluded, counted from 0
  as torch.profiler counts: step N is the one that starts when N steps are done (the
  engine's ``state.step`` is N), so ``2:4`` records the third and fourth step. The step
  before START runs under the profiler too, unrecorded (its warm-up), when this run
  trains it. END beyond the run's last step is a one-line error.
- ``ranks`` (``0``): which ranks record; ``all`` for every rank (one trace each).
- ``memory`` (false): record allocations in the trace and, on CUDA, a memory snapshot
  (torch.cuda.memory._record_memory_history) dumped as ``rank<R>.memory.pickle``, which
  https://pytorch.org/memory_viz opens.

Each rank writes ``<out_dir>/profile/steps<START>-<END>/rank<R>.<ns>.pt.trace.json``
(torch.profiler.tensorboard_trace_handler's layout: a run folder per window, a worker
per rank), which Perfetto (https://ui.perfetto.dev), chrome://tracing and TensorBoard's
PyTorch profiler plugin (``pip install torch-tb-profiler``, then ``tensorboard --logdir
<out_dir>/profile``) open. In it,
``ProfilerStep#N`` spans step N, from the end of step N-1's optimizer step (so the check
point and snapshot after step N-1 open it) to the end of step N's, and the engine's own
phases are ranges named ``engine: data wait``, ``engine: forward/backward``,
``engine: optimizer step``, ``engine: check point`` and ``engine: snapshot``
(engine/phases.py). docs/profiling.md says how to read one.

A run without ``profile.steps`` costs nothing per step: this module's per-step hook
lives on a :class:`StepProfiler` registered at ``engine_run_start`` only on a rank that
records, and the ranges are a shared no-op while no profiler records.
"""

from __future__ import annotations

import os
from typing import Literal

import attrs

import engine
from engine import phases
from engine.errors import ConfigError

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).

FOLDER = "profile"


def parse_steps(text: str) -> tuple[int, int] | None:
    """``START:END`` as two ints, None for ""; ValueError naming what is wrong."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        first, stop = int(start), int(end)
    except ValueError:
        raise ValueError("give START:END, the optimizer steps to record counted from 0 "
                         "with END excluded, e.g. 2:4 for steps 2 and 3") from None
    if first < 0 or stop <= first:
        raise ValueError(f"START must be >= 0 and END above START, e.g. {max(first, 0)}:"
                         f"{max(first, 0) + 2}")
    return first, stop


def _steps_valid(instance, attribute, value) -> None:
    parse_steps(value)


@attrs.define
class ProfileConfig:
    RESUME_SAFE = True  # what is recorded, not what a step computes

    steps: str = attrs.field(default="", validator=_steps_valid)  # "START:END"; "": off
    ranks: Literal["0", "all"] = "0"
    memory: bool = False


class StepProfiler:
    """One rank's torch.profiler over the window ``[start, end)``, started at the end
    of the step before the window (the warm-up) and stopped at its end. A per-run
    plugin object: its ``engine_train_step_end`` exists only on a rank that records."""

    def __init__(self, ctx, start: int, end: int, memory: bool):
        self.ctx = ctx
        self.start, self.end, self.memory = start, end, memory
        self.folder = ctx.out_dir / FOLDER / f"steps{start}-{end}"
        self.cuda = ctx.device.type == "cuda"
        self.profiler = None
        # Where the profiler starts: the warm-up step before the window if this run
        # trains it, else the window's (or the resumed run's) first step.
        self.begin_at = max(ctx.state.step, start - 1)

    def action(self, step: int):
        from torch.profiler import ProfilerAction

        if step == self.start - 1:
            return ProfilerAction.WARMUP
        if step == self.end - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.RECORD if self.start <= step < self.end else ProfilerAction.NONE

    def begin(self, step: int) -> None:
        """At the end of step ``step - 1``: profile from step ``step`` on."""
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        if not self.cuda:  # kineto's log lines about the GPU it looked for are noise here
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(
            activities=activities, record_shapes=True, profile_memory=self.memory,
            # The schedule is asked about step 0 once, at construction: answer for the
            # first step this profiler sees, which step_num then names.
            schedule=lambda n: self.action(max(n, step)),
            on_trace_ready=tensorboard_trace_handler(
                str(self.folder), worker_name=f"rank{self.ctx.rank}"))
        self.profiler.step_num = step  # ProfilerStep#N is the engine's step N
        if self.memory and self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        phases.label_ranges(True)
        self.profiler.start()

    @engine.hookimpl
    def engine_train_step_end(self, step):
        if self.profiler is not None:
            self.profiler.step()  # at step == end the trace is written
            if step >= self.end:
                self.finish()
        elif step == self.begin_at:
            self.begin(step)

    def finish(self) -> None:
        """Stop the profiler (writing what it recorded, when the run ends early) and
        the memory history; say where the files are."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        phases.label_ranges(False)
        if self.ctx.pm.is_registered(self):  # the rest of the run calls nothing of it
            self.ctx.pm.unregister(self)
        if self.memory and self.cuda:
            import torch

            self.folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(
                str(self.folder / f"rank{self.ctx.rank}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        last = min(self.end, self.ctx.state.step) - 1  # a run may end inside the window
        # TensorBoard shows nothing of a trace without its PyTorch profiler plugin.
        self.ctx.print(f"profiler: steps {self.start} to {last} traced in "
                       f"{self.folder} (open with https://ui.perfetto.dev, or "
                       f"tensorboard --logdir {self.folder.parent} after "
                       "pip install torch-tb-profiler)")


_PER_RUN = "profiler-steps"


@engine.hookimpl
def engine_register_config_groups():
    return {"profile": ProfileConfig}


@engine.hookimpl
def engine_register_run_files():
    return [FOLDER]


@engine.hookimpl
def engine_run_start(ctx):
    options = getattr(ctx.cfg, "profile", None) or ProfileConfig()
    window = parse_steps(options.steps)
    if window is None:
        return
    start, end = window
    total = ctx.total_steps  # None for a stream, whose length nobody knows
    if total is not None and end > total:
        raise ConfigError(f"config key 'profile.steps': {options.steps!r} ends beyond the "
                          f"run: it takes {total} optimizer steps (0 to {total - 1}); "
                          f"choose END <= {total}")
    if ctx.state.step >= end:
        ctx.warn(f"profile.steps={options.steps}: this run resumed after step "
                 f"{ctx.state.step - 1}, past the window; nothing is profiled")
        return
    if options.ranks == "0" and not ctx.is_rank0:
        return
    profiler = StepProfiler(ctx, start, end, options.memory)
    if options.memory and not profiler.cuda:
        ctx.warn("profile.memory=true: the memory snapshot needs CUDA; on the CPU the "
                 "trace records the allocations only")
    phases.arm(True)
    ctx.pm.register(profiler, name=_PER_RUN)
    if profiler.begin_at == ctx.state.step:
        profiler.begin(ctx.state.step)


@engine.hookimpl
def engine_run_end(ctx):
    phases.arm(False)
    profiler = ctx.pm.get_plugin(_PER_RUN)
    if profiler is not None:  # the run ended before the window did
        profiler.finish()  # writes what it recorded
        if ctx.pm.is_registered(profiler):  # it never began (pre-empted before it)
            ctx.pm.unregister(profiler)
