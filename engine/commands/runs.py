"""``engine-run runs [DIR]``: the runs under a folder, one row each, from their summary.json.

    $ engine-run runs
    RUN                     STATUS     EPOCHS  VAL/BITS_PER_CHAR  VAL/LOSS  VAL/PERPLEXITY  THROUGHPUT      WALL  DIGEST
    runs/char_lm/version_0  completed  2/2     2.9768             2.0634    7.8726          15281 tokens/s  1m17s 3f2a9c01d4e7
    runs/char_lm/version_1  preempted  1/2     3.3492             2.3215    10.1910         23117 tokens/s  38.0s -
    runs/broken               unreadable summary.json: Expecting value: line 1 column 1 (char 0)

A run is any folder under DIR (at any depth: ``runs/cifar_ddp/version_3``) holding a
summary.json; rows are sorted by the run's start time. Runs of several recipes get one
table per recipe, each with the ``val/*`` metrics its runs logged as columns. WALL is
the run's wall time, over every segment of a resumed run (``total_wall_time_s``). A
failed run's error is repeated below the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib

from engine.errors import EngineError

SUMMARY = "summary.json"
DIGEST_CHARS = 12


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="engine-run runs",
        description="A table of the runs under DIR (any folder holding a summary.json), "
                    "sorted by start time.")
    parser.add_argument("dir", nargs="?", default="runs", metavar="DIR",
                        help="the folder to look in, recursively (default: runs)")
    args = parser.parse_args(argv)
    root = require_folder(args.dir, "runs", "the folder that holds the runs' out_dirs: "
                                           "engine-run runs DIR")
    runs = [read_run(path) for path in find_summaries(root)]
    if not runs:
        print(f"no runs under {root}: no {SUMMARY} in it or its subfolders")
        return 0
    runs.sort(key=lambda run: (run["started"], run["path"]))
    groups = by_recipe(runs)
    print("\n\n".join(
        (f"recipe {recipe}\n" if len(groups) > 1 else "") + format_table(members)
        for recipe, members in groups.items()))
    for run in runs:
        if run["summary"] and run["summary"].get("error"):
            print(f"{run['path']}: {run['summary']['status']}: {run['summary']['error']}")
    return 0


def require_folder(path: str, command: str, give: str) -> pathlib.Path:
    """``path`` as a Path, or the one-line usage error of ``command`` saying what to give."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise EngineError(f"{command}: {folder} {what}; give {give}")
    return folder


def find_summaries(root: pathlib.Path) -> list[pathlib.Path]:
    """Every summary.json under ``root``, ``root`` itself included (symlinks not followed)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        if SUMMARY in files:
            found.append(pathlib.Path(folder) / SUMMARY)
    return found


def read_run(path: pathlib.Path) -> dict:
    """``{"path", "started", "summary", "problem"}``: the summary, or why it is unreadable
    (a run killed while the file was being replaced, a hand edit)."""
    run = {"path": str(path.parent), "summary": None, "problem": None}
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON {type(summary).__name__}, not an object")
        run["summary"] = summary
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        run["problem"] = f"unreadable {SUMMARY}: {exc}"
    started = (run["summary"] or {}).get("started_at")
    if not isinstance(started, str):
        # Without a start time the file's own age places the row (ISO text compares
        # like the timestamps the summary holds).
        try:
            started = datetime.datetime.fromtimestamp(
                path.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")
        except OSError:
            started = ""
    run["started"] = started
    return run


def by_recipe(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs by the recipe they trained (summary.json's ``recipe``), in the order of
    each recipe's first run: one table each, so that a recipe's table has the columns
    of its own metrics, not one per metric of every recipe."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        recipe = (run["summary"] or {}).get("recipe")
        groups.setdefault(shown_path(recipe) if isinstance(recipe, str) else "unknown",
                          []).append(run)
    return groups


def shown_path(path: str) -> str:
    """A recipe's recorded (absolute) path, relative to the working folder when under it."""
    try:
        return str(pathlib.Path(path).relative_to(pathlib.Path.cwd()))
    except ValueError:
        return path


def val_names(runs: list[dict]) -> list[str]:
    """The ``val/*`` metrics any run has, sorted."""
    names = set()
    for run in runs:
        metrics = (run["summary"] or {}).get("metrics")
        if isinstance(metrics, dict):
            names.update(n for n in metrics if n.startswith("val/"))
    return sorted(names)


def format_table(runs: list[dict]) -> str:
    names = val_names(runs)
    header = ["RUN", "STATUS", "EPOCHS", *(n.upper() for n in names), "THROUGHPUT", "WALL",
              "DIGEST"]
    rows = [row(run, names) for run in runs]
    full = [r for r in rows if len(r) == len(header)]
    widths = [max(len(header[i]), *(len(r[i]) for r in (rows if i == 0 else full)))
              for i in range(len(header))]
    lines = []
    for cells in [header, *rows]:
        if len(cells) == 2:  # an unreadable summary: the path, then the problem
            lines.append(f"{cells[0]:<{widths[0]}}  {cells[1]}")
        else:
            lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


def row(run: dict, names: list[str]) -> list[str]:
    summary = run["summary"]
    if summary is None:
        return [run["path"], run["problem"]]
    metrics = summary.get("metrics") if isinstance(summary.get("metrics"), dict) else {}
    status = str(summary.get("status") or "-")
    if summary.get("stopped_early"):
        status += " (early stop)"
    epochs = f"{text(summary.get('epochs_completed'))}/{text(summary.get('epochs_requested'))}"
    digest = summary.get("weights_sha256")
    return [run["path"], status, epochs, *(number(metrics.get(n)) for n in names),
            throughput(summary),
            duration(total_wall_time(summary)),
            digest[:DIGEST_CHARS] if isinstance(digest, str) else "-"]


def throughput(summary: dict) -> str:
    """``4098 samples/s``, ``51200 tokens/s``; a summary written before throughput had
    a unit holds ``images_per_sec``."""
    unit = summary.get("throughput_unit")
    if not isinstance(unit, str):
        unit, value = "images", summary.get("images_per_sec")
    else:
        value = summary.get(f"{unit}_per_sec")
    shown = number(value, "{:.0f}")
    return shown if shown == "-" else f"{shown} {unit}/s"


def total_wall_time(summary: dict):
    """The run's wall time over all its segments (a resumed run's total); a summary
    written before totals existed has its last segment's only."""
    total = summary.get("total_wall_time_s")
    return total if total is not None else summary.get("wall_time_s")


def text(value) -> str:
    return "-" if value is None else str(value)


def number(value, fmt: str = "{:.4f}") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return fmt.format(value)


def duration(seconds) -> str:
    """``13.2s``, ``4m05s``, ``2h03m``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"
