"""``engine-run report RUN_DIR [-o FILE.png]``: a PNG of a run's curves, to look at.

    $ engine-run report runs/cifar_ddp
    wrote runs/cifar_ddp/report.png (train/loss by step; val/accuracy, val/loss by epoch; from runs/cifar_ddp/tensorboard)

Panels: the training loss by optimizer step; the loss by epoch (val/loss and the epoch's
mean train/loss); then every other ``val/*`` metric by epoch. The scalars are read by
the loggers' own readers: the csv logger's metrics.csv when the run has one, else the
tensorboard logger's event files, so runs made before the csv logger existed have
reports too. matplotlib is the optional extra
``report`` (``pip install -e ".[report]"``); it and tensorboard are imported here only.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib

from engine.errors import EngineError

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
    from engine.commands.runs import require_folder

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
        raise EngineError(f"report: {source} holds no train/loss and no val/* metric; "
                          f"logged: {', '.join(sorted(series)) or 'nothing'}")
    from engine.atomic_io import atomic_write

    png = render(curves, title=heading(run_dir))
    atomic_write(output, lambda f: f.write(png))
    print(f"wrote {output} ({curves.describe()}; from {source})")
    return 0


# ------------------------------------------------------------------ reading


def read_scalars(run_dir: pathlib.Path) -> tuple[Series, str]:
    """The run's scalars and where they came from, read by the loggers' own readers:
    the csv logger's metrics.csv, else the TensorBoard event files."""
    from engine.plugins import csv_logger, tensorboard

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


class Curves:
    """What the panels show, as (x, y) lists."""

    def __init__(self, by_step, by_epoch):
        self.by_step: dict[str, tuple[list, list]] = by_step  # train/loss
        self.by_epoch: dict[str, tuple[list, list]] = by_epoch  # val/*, train/loss mean

    @property
    def empty(self) -> bool:
        return not self.by_step and not self.by_epoch

    @classmethod
    def from_series(cls, series: Series) -> "Curves":
        train = series.get("train/loss", [])
        val = {name: points for name, points in series.items() if name.startswith("val/")}
        # An epoch ends where validation logs (the trainer validates every epoch): the
        # n-th step with val/* metrics ends epoch n, from either source. The trainer logs
        # the epoch's metrics, its mean train/loss included, in one call at that step,
        # after any window's train/loss of the same step.
        ends = sorted({step for points in val.values() for step, _ in points})
        epoch_of = {step: n for n, step in enumerate(ends, start=1)}
        first, last = {}, {}
        for step, value in train:
            first.setdefault(step, value)
            last[step] = value
        window = sorted((s, v) for s, v in first.items())
        by_step = {"train/loss": unzip(window)} if window else {}
        by_epoch = {name: unzip(sorted((epoch_of[s], v) for s, v in points))
                    for name, points in sorted(val.items())}
        mean = sorted((epoch_of[s], v) for s, v in last.items() if s in epoch_of)
        if mean:
            by_epoch["train/loss (epoch mean)"] = unzip(mean)
        return cls(by_step, by_epoch)

    def describe(self) -> str:
        parts = []
        if self.by_step:
            parts.append("train/loss by step")
        val = sorted(n for n in self.by_epoch if n.startswith("val/"))
        if val:
            parts.append(f"{', '.join(val)} by epoch")
        return "; ".join(parts)


def unzip(pairs) -> tuple[list, list]:
    return [x for x, _ in pairs], [y for _, y in pairs]


def render(curves: Curves, title: str) -> bytes:
    """The PNG: matplotlib's object API on the Agg canvas (no pyplot, no display, no
    global state touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = []  # (title, x label, {label: (x, y)})
    if curves.by_step:
        panels.append(("training loss", "optimizer step", curves.by_step))
    loss = {n: xy for n, xy in curves.by_epoch.items() if "loss" in n}
    if loss:
        panels.append(("loss by epoch", "epoch", loss))
    for name, xy in curves.by_epoch.items():
        if name not in loss:
            panels.append((name, "epoch", {name: xy}))
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
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if xlabel == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(lines) > 1:
            ax.legend()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
