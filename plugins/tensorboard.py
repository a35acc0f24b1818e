"""Logger ``tensorboard``: scalars under ``<out_dir>/tensorboard``, written by rank 0.

Every ``engine_log`` call becomes one scalar per metric, tagged with the metric's name
(``train/loss``, ``train/epoch_loss``, ``train/samples_per_sec``, ``lr``, ``val/loss``...)
at the global optimizer step; at each epoch's end the scalar ``epoch``, the number of the
epoch that ended (from 1, as the console counts). tensorboard is imported when the run
starts (or, in a custom loop, at the first scalar), never at start-up of the engine;
``-p no:tensorboard`` turns the logger off.

A resumed run writes a new event file into the same folder; it tells TensorBoard to
drop the points the interrupted run had written after the snapshot it resumes from
(``purge_step``), so the curves do not fold back on themselves.

:func:`read_metrics` reads the event files back as curves (``engine-run report``).
"""

from __future__ import annotations

import pathlib
import time

import engine
from engine.errors import PluginError

# torch.utils.tensorboard and tensorboard are imported inside the functions that use them:
# tensorboard is an optional package that takes most of a second to import, and the
# plugin manager loads this plugin in every run's launching process.

FOLDER = "tensorboard"


class TensorBoardLogger:
    def __init__(self):
        self.writer = None
        self.summary_type = None  # tensorboard's Summary protobuf, imported with the writer
        self.resumed_step = 0  # the step the run started (or resumed) from

    @engine.hookimpl
    def engine_run_start(self, ctx):
        self.resumed_step = ctx.state.step
        if ctx.is_rank0 and self.writer is None:
            # Importing tensorboard takes most of a second: here, not inside the loop
            # at the first log interval.
            self.writer = self._open(ctx)

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        if self.writer is None:
            self.writer = self._open(ctx)
        # One event holding every metric of the call, not one add_scalar (one event,
        # one queue hand-off to the writer thread, two pure-Python CRC32Cs) per metric:
        # far less CPU per call (docs/plugins.md has the measurement). TensorBoard
        # reads each value as its own scalar, exactly as add_scalar writes it.
        Summary = self.summary_type
        values = [Summary.Value(tag=name, simple_value=float(value))
                  for name, value in metrics.items() if value is not None]
        if values:
            self.writer._get_file_writer().add_summary(Summary(value=values), step)

    @engine.hookimpl
    def engine_epoch_end(self, ctx, epoch, metrics):
        if self.writer is not None:
            # The epoch number as console and metrics.csv show it (from 1), at the step
            # the epoch ended: TensorBoard's x axis is the step.
            self.writer.add_scalar("epoch", epoch + 1, ctx.state.step)
            self.writer.flush()  # so that a running TensorBoard shows whole epochs

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.resumed_step = 0

    def _open(self, ctx):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise PluginError(
                f"the tensorboard logger needs the tensorboard package ({exc}); install "
                "it with pip install tensorboard, or turn the logger off with "
                "-p no:tensorboard") from None
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.summary_type = Summary
        folder = ctx.out_dir / FOLDER
        purge = {}
        if self.resumed_step:
            purge = {"purge_step": self.resumed_step + 1}
            _wait_past_newest_event_file(folder)
        return SummaryWriter(log_dir=str(folder), **purge)


def _wait_past_newest_event_file(folder: pathlib.Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a name is
    ``events.out.tfevents.<whole seconds>.<host>.<pid>...``: a file begun in the same
    second as the interrupted run's sorts by its pid, as text, and may come first; then
    the purge applies to the old points' past and the curves fold back. A resumed run
    starting within a second of the run it resumes (only a very short run can) waits
    for the next second."""
    seconds = [p.name.split(".")[3] for p in folder.glob("events.out.tfevents.*")]
    newest = max((int(s) for s in seconds if s.isdigit()), default=None)
    remaining = None if newest is None else newest + 1 - time.time()
    if remaining is not None and 0 < remaining <= 1:
        time.sleep(remaining)


def read_metrics(run_dir) -> tuple[dict[str, list[tuple[int, float]]], pathlib.Path] | None:
    """The scalars of a run's event files, ``{tag: [(step, value), ...]}``, and their
    folder; None when the run has none. A resumed run's ``purge_step`` is applied: the
    points the interrupted run wrote after its snapshot are gone."""
    folder = pathlib.Path(run_dir) / FOLDER
    if not (folder.is_dir() and any(folder.glob("events.out.tfevents.*"))):
        return None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # size_guidance 0: every point, not TensorBoard's default sample of 1000. Reload
    # reads every event file in the folder.
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return ({tag: [(e.step, e.value) for e in events.Scalars(tag)]
             for tag in events.Tags()["scalars"]}, folder)


@engine.hookimpl
def engine_register_run_files():
    return [FOLDER]


# One logger per process; its hooks are the module's hooks.
_logger = TensorBoardLogger()
engine_run_start = _logger.engine_run_start
engine_log = _logger.engine_log
engine_epoch_end = _logger.engine_epoch_end
engine_run_end = _logger.engine_run_end
