"""``engine-run report RUN_DIR [-o FILE.png]``: a PNG of a run's curves, from the scalars
the loggers' own readers read (metrics.csv, else TensorBoard's event files); matplotlib
is the optional extra ``report``, imported here only.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib

from engine.atomic_io import atomic_write
from engine.commands.runs import require_folder
from engine.errors import EngineError
from engine.metrics import throughput_unit
from engine.plugins import csv_logger, tensorboard

INSTALL = 'pip install -e ".[report]"'

#: name -> [(step, value)] in the order they were logged.
Series = dict[str, list[tuple[int, float]]]


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="engine-run report",
        description="Write a PNG of a run's loss and validation curves.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's out_dir")
    parser.add_argument("-o", "--output", metavar="FILE.png",
                        help="where to write the PNG (default: RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    run_dir = require_folder(args.run_dir, "report", "a run's out_dir: engine-run report "
                                                     "RUN_DIR (engine-run runs lists them)")
    output = pathlib.Path(args.output) if args.output else run_dir / "report.png"
    if not output.parent.is_dir():
        raise EngineError(f"report: cannot write {output}: the folder {output.parent} "
                          "does not exist")
    try:
        import matplotlib  # noqa: F401 (only to say how to install it)
    except ImportError:
        raise EngineError(f"report needs matplotlib, which is not installed; install it "
                          f"with {INSTALL}") from None
    series, source = read_scalars(run_dir)
    curves = Curves.from_series(series)
    if curves.empty:
        raise EngineError(f"report: {source} holds no metric to plot; logged: "
                          f"{', '.join(sorted(series)) or 'nothing'}")
    png = render(curves, title=heading(run_dir))
    atomic_write(output, lambda f: f.write(png))
    print(f"wrote {output} ({curves.describe()}; from {source})")
    return 0


# ------------------------------------------------------------------ reading


def read_scalars(run_dir: pathlib.Path) -> tuple[Series, str]:
    """The run's scalars and where they came from, read by the loggers' own readers:
    the csv logger's metrics.csv, else the TensorBoard event files."""
    for logger in (csv_logger, tensorboard):
        try:
            found = logger.read_metrics(run_dir)
        except EngineError as exc:
            raise EngineError(f"report: {exc}") from None
        if found is not None:
            series, source = found
            return series, str(source)
    raise EngineError(f"report: no metrics in {run_dir}: neither {csv_logger.FILE_NAME} nor "
                      f"TensorBoard event files in {run_dir / tensorboard.FOLDER} (was the "
                      "run made with its loggers turned off, -p no:tensorboard?)")


def heading(run_dir: pathlib.Path) -> str:
    """The run folder, with its status and epochs when its summary.json says them."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return (f"{run_dir}: {summary['status']}, epochs {summary['epochs_completed']}"
                f"/{summary['epochs_requested']}")
    except (OSError, ValueError, KeyError, TypeError):
        return str(run_dir)


# ------------------------------------------------------------------ curves


#: Logged once when a run starts or resumes (the trainer's, at the step it starts from):
#: how many processes train from there. Drawn as a mark, not as a curve.
WORLD_SIZE = "world_size"
#: TensorBoard's epoch counter (plugins/tensorboard.py): the x axis, not a curve.
NOT_CURVES = {WORLD_SIZE, "epoch"}


def is_throughput(name: str) -> bool:
    """``train/samples_per_sec``, ``train/images_per_sec``, ``train/<unit>_per_sec``, and
    the epoch's, ``train/epoch_<unit>_per_sec``."""
    return throughput_unit(name) is not None


class Curves:
    """What the panels show, as (x, y) lists, and where the run resumed."""

    def __init__(self, by_step, by_epoch, resumes=()):
        self.by_step: dict[str, tuple[list, list]] = by_step  # train/loss, lr, throughput...
        self.by_epoch: dict[str, tuple[list, list]] = by_epoch  # val/*, the epoch means
        # (step, processes before, processes from there) for each resume
        self.resumes: list[tuple[int, int, int]] = list(resumes)

    @property
    def empty(self) -> bool:
        return not self.by_step and not self.by_epoch

    @classmethod
    def from_series(cls, series: Series) -> "Curves":
        val = {name: points for name, points in series.items() if name.startswith("val/")}
        window, mean = split_train_loss(series, val)
        # An epoch ends where its mean loss logs (an old run's: its validation): the
        # n-th such step ends epoch n (counted from 1, as the console and metrics.csv
        # count them). A validation between (val_every_steps) puts its metric by step.
        ends = {step for points in ([mean] if mean else val.values()) for step, _ in points}
        epoch_of = {step: n for n, step in enumerate(sorted(ends), start=1)}
        by_step = {"train/loss": unzip(sorted(window))} if window else {}
        by_epoch = {}
        if mean:
            by_epoch["train/epoch_loss"] = unzip(sorted((epoch_of[s], v) for s, v in mean))
        # Runs before train/epoch_<unit>_per_sec logged the epoch's throughput under the
        # window's name at the epoch's end: there the window's curve leaves it out, as
        # train/loss does.
        old_trainer_run = bool(mean) and not any(
            name.startswith("train/epoch_") and is_throughput(name) for name in series)
        for name, points in sorted(series.items()):
            if name in NOT_CURVES or name in ("train/loss", "train/epoch_loss"):
                continue
            if is_throughput(name):
                # The window's and the epoch's throughput in one panel, by step (an
                # epoch's at the step it ended).
                if old_trainer_run:
                    points = [p for p in points if p not in last_at(points, ends)]
            elif ends and all(s in ends for s, _ in points):
                by_epoch[name] = unzip(sorted((epoch_of[s], v) for s, v in points))
                continue
            by_step[name] = unzip(sorted(points))
        starts = series.get(WORLD_SIZE, [])
        resumes = [(step, int(before), int(n))
                   for (_, before), (step, n) in zip(starts, starts[1:])]
        return cls(by_step, by_epoch, resumes)

    def panels(self) -> list[tuple[str, str, dict]]:
        """``(title, x label, {label: (x, y)})`` for each panel, in the order drawn: the
        training loss, the loss by epoch, the learning rate, the throughput, then every
        other metric, by step or by epoch as it was logged."""
        panels = []
        steps, epochs = dict(self.by_step), dict(self.by_epoch)
        for title, names, xlabel, source in (
                ("training loss (train/loss: mean of each log window)", ["train/loss"],
                 "optimizer step", steps),
                ("loss by epoch", [n for n in epochs if "loss" in n], "epoch", epochs),
                ("learning rate", ["lr"], "optimizer step", steps),
                ("throughput", [n for n in steps if is_throughput(n)], "optimizer step",
                 steps)):
            lines = {n: source.pop(n) for n in names if n in source}
            if lines:
                panels.append((title, xlabel, lines))
        panels += [(name, "optimizer step", {name: xy}) for name, xy in steps.items()]
        panels += [(name, "epoch", {name: xy}) for name, xy in epochs.items()]
        return panels

    def describe(self) -> str:
        parts = []
        if self.by_step:
            parts.append(f"{', '.join(self.by_step)} by step")
        if self.by_epoch:
            parts.append(f"{', '.join(sorted(self.by_epoch))} by epoch")
        parts += [f"resumed at step {step}: {before} -> {n} processes"
                  for step, before, n in self.resumes]
        return "; ".join(parts)


def split_train_loss(series: Series, val: Series) -> tuple[list, list]:
    """The window losses (``train/loss``) and the epoch means (``train/epoch_loss``). A run
    from before train/epoch_loss logged the epoch's mean as train/loss too, after the
    validation metrics' step's window (if any): there the last train/loss of a step with
    val/* metrics is the epoch's mean, and it is no window's."""
    train = series.get("train/loss", [])
    if "train/epoch_loss" in series or not val:
        return list(train), list(series.get("train/epoch_loss", []))
    ends = {step for points in val.values() for step, _ in points}
    means = last_at(train, ends)
    return [p for p in train if p not in means], means


def last_at(points: list, steps: set) -> list:
    """The last of ``points`` logged at each of ``steps``, in logged order."""
    last = {step: i for i, (step, _) in enumerate(points) if step in steps}
    return [points[i] for i in sorted(last.values())]


def unzip(pairs) -> tuple[list, list]:
    return [x for x, _ in pairs], [y for _, y in pairs]


def render(curves: Curves, title: str) -> bytes:
    """The PNG: matplotlib's object API on the Agg canvas (no pyplot, no display, no
    global state touched)."""
    # matplotlib is optional (the report extra): imported only to draw
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = curves.panels()
    columns = min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(6.4 * columns, 4.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, (name, xlabel, lines) in zip(axes, panels):
        for label, (x, y) in lines.items():
            # Per-epoch points get markers: a one-epoch run is a single point.
            ax.plot(x, y, label=label, marker="o" if xlabel == "epoch" else None)
        if xlabel == "optimizer step":
            for step, before, n in curves.resumes:  # where a resumed run took over
                ax.axvline(step, color="grey", linestyle="--", linewidth=1)
                ax.annotate(f"resumed: {before} -> {n} processes", (step, 1),
                            xycoords=("data", "axes fraction"), rotation=90, va="top",
                            ha="right", fontsize=8, color="grey")
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if xlabel == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(lines) > 1:
            ax.legend()
        elif name not in lines:  # a panel named for what it shows: say which metric
            ax.set_ylabel(next(iter(lines)))
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
