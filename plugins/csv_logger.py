"""Logger ``csv``: every logged scalar as a row of ``<out_dir>/metrics.csv``, rank 0 only.

The file is in long format, one row per metric and logged event, with a header::

    step,epoch,name,value
    4,1,train/loss,2.2931
    4,1,train/samples_per_sec,1523.4
    4,1,lr,0.1
    8,1,train/loss,2.1187
    ...
    8,1,train/epoch_loss,2.2013
    8,1,val/loss,2.0456
    8,1,val/accuracy,0.25

- ``step``: the global optimizer step the metric was logged at (``engine_log``'s
  ``step``), an integer;
- ``epoch``: the number of the epoch the row belongs to, counted from 1 as the console's
  ``epoch 1/2`` counts (``engine.state.epoch + 1`` when it was logged; the epoch's own
  metrics, logged after validation, carry the epoch they summarise);
- ``name``: the metric's name as the engine logs it (``train/loss`` the mean of one log
  window, ``train/epoch_loss`` the epoch's mean, ``lr``, ``val/accuracy``, a recipe's own
  ``val/...``);
- ``value``: a float, written with ``repr`` so that it reads back exactly.

Long format because the metric names are not known in advance: validation metrics
appear only at the end of an epoch, a recipe or a custom loop logs its own names, and a
wide file would need its header rewritten each time a new one appears. To plot one
curve, keep the rows of one ``name`` (pandas: ``df.pivot_table(index="step",
columns="name", values="value")`` gives the wide table).

The rows of each ``engine_log`` call are handed to the operating system when the call
ends (one ``write`` per call: per log interval, at each check point, never per step in
``engine-run``), so a run killed hard (SIGKILL, OOM killer) leaves every row it logged
before, in both loops: what it logged up to its last check point or snapshot is there
(a lost node may lose what the kernel had not yet written, and the last line may be cut
short). Nothing waits for the disk: no fsync.

On resume the file is continued, not duplicated: at the start of a resumed run the
rows logged after the snapshot's step (by the interrupted run, after the snapshot it
resumes from) are dropped, a cut-short last line too, and the header is kept once; then
the new rows are appended. A run that does not resume (a new run in an old out_dir)
starts the file afresh. In a custom loop (``engine.launch``), which fires no
``engine_run_start``, the file is opened at the first ``ctx.log`` and, after a resume,
keeps the rows logged before that call's step. ``-p no:csv`` turns the logger off.

:func:`read_metrics` reads the file back as curves (``engine-run report`` uses it).
"""

from __future__ import annotations

import csv
import os
import pathlib

import engine
from engine.errors import EngineError

FILE_NAME = "metrics.csv"
HEADER = ["step", "epoch", "name", "value"]


def read_rows(path) -> list[tuple[int, int, str, float]]:
    """The complete rows of a metrics.csv as ``(step, epoch, name, value)``; a line that
    is not a complete row (the header, a last line cut short by a kill) is skipped."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            try:
                step, epoch, name, value = row
                rows.append((int(step), int(epoch), name, float(value)))
            except ValueError:  # the header, a wrong field count, a cut-short number
                continue
    return rows


def read_metrics(run_dir) -> tuple[dict[str, list[tuple[int, float]]], pathlib.Path] | None:
    """The scalars of a run's metrics.csv, ``{name: [(step, value), ...]}`` in the order
    they were logged, and the file's path; None when the run has no metrics.csv. A file
    with another header is an EngineError naming the missing columns."""
    path = pathlib.Path(run_dir) / FILE_NAME
    if not path.is_file():
        return None
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header != HEADER:
        missing = [column for column in HEADER if column not in header]
        what = (f"it lacks the column(s) {', '.join(missing)}" if missing
                else f"its columns are {','.join(header)}")
        raise EngineError(f"{path} is not a metrics file: {what} (expected the header "
                          f"{','.join(HEADER)})")
    series: dict[str, list[tuple[int, float]]] = {}
    for step, _, name, value in read_rows(path):
        points = series.setdefault(name, [])
        # A step that goes back is a resumed run logging again from its snapshot: its
        # points replace the interrupted run's from that step on (this logger drops them
        # itself when it resumes; a writer that only appends does not). The same step
        # twice is no restart (a file from before train/epoch_loss: the window's
        # train/loss, then the epoch's).
        if points and points[-1][0] > step:
            while points and points[-1][0] >= step:
                points.pop()
        points.append((step, value))
    return series, path


class CsvLogger:
    def __init__(self):
        self.file = None
        self.writer = None
        self.resumed = False

    @engine.hookimpl
    def engine_run_start(self, ctx):
        if not ctx.is_rank0:
            return
        self.resumed = ctx.resumed_from is not None
        self._open(ctx, keep_below=ctx.state.step + 1)  # the snapshot's step kept

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        if self.file is None:
            # A custom loop: keep what an interrupted run logged before this step.
            self.resumed = ctx.resumed_from is not None
            self._open(ctx, keep_below=step)
        epoch = ctx.state.epoch + 1  # the epoch in progress, counted from 1
        self.writer.writerows([step, epoch, name, repr(float(value))]
                              for name, value in metrics.items() if value is not None)
        # One write per call: a kill loses nothing logged before (the module docstring).
        self.file.flush()

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if self.file is not None:
            self.file.close()
        self.__init__()  # the next run in this process (tests, engine.launch) starts clean

    def _open(self, ctx, keep_below: int) -> None:
        path = ctx.out_dir / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = ([row for row in read_rows(path) if row[0] < keep_below]
                if self.resumed and path.exists() else [])
        # Rewrite rather than append: the interrupted run may have logged past the
        # snapshot, or died in the middle of a line. Through a temporary file, so that a
        # kill now leaves the old file or the new one, never half of one.
        temporary = path.with_name(f".{FILE_NAME}.tmp")
        with open(temporary, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(HEADER)
            writer.writerows([step, epoch, name, repr(value)]
                             for step, epoch, name, value in kept)
        os.replace(temporary, path)
        self.file = open(path, "a", newline="", buffering=1 << 20)
        self.writer = csv.writer(self.file)


@engine.hookimpl
def engine_register_run_files():
    return [FILE_NAME]


# One logger per process; its hooks are the module's hooks.
_logger = CsvLogger()
engine_run_start = _logger.engine_run_start
engine_log = _logger.engine_log
engine_run_end = _logger.engine_run_end
