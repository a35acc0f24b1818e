"""Plugin ``csv-rows``: every logged metric as a row of ``<out_dir>/rows.csv``.

(The engine has a built-in ``csv`` logger writing ``metrics.csv``; this one shows how a
logger plugin is written, so it takes a name and a file of its own.)

A logger needs two hooks, and so would a W&B or MLflow plugin: ``engine_log`` (rank 0
only: a dict of floats and the global step; open the file or the remote run on the
first call, ``ctx.cfg`` holds the config to record) and ``engine_run_end`` (flush and
close; ``summary["status"]`` says how the run ended). ``engine_addoption`` adds a
command-line option whose value arrives in ``ctx.options``.
"""

from __future__ import annotations

import csv

import engine

HEADER = ["step", "name", "value"]


class CsvLogger:
    def __init__(self):
        self.file = None
        self.writer = None

    @engine.hookimpl
    def engine_addoption(self, parser):
        parser.add_argument("--csv-file", default="rows.csv", metavar="NAME",
                            help="CSV logger: the file under out_dir (default rows.csv)")

    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        if self.file is None:
            self._open(ctx.out_dir / (ctx.options.get("csv_file") or "rows.csv"))
        for name in sorted(metrics):
            if metrics[name] is not None:
                self.writer.writerow([step, name, repr(float(metrics[name]))])
        self.file.flush()  # a crash loses at most the rows of the current call

    @engine.hookimpl
    def engine_run_end(self, ctx, summary):
        if self.file is not None:
            self.file.close()
            self.file = self.writer = None

    def _open(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the file of the interrupted one.
        new = not path.exists() or path.stat().st_size == 0
        self.file = open(path, "a", newline="")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(HEADER)


#: The plugin object the entry point names (``engine_csv_logger:plugin``).
plugin = CsvLogger()
