"""``engine-run runs [DIR]``: the table of runs from their summary.json files, nested run
folders, unreadable summaries and the one-line errors. The summaries are written here
with the keys the engine writes (engine/context.py); test_report.py lists a real run."""

from __future__ import annotations

import json
import re

from tests.conftest import run_cli_here

DIGEST = "3f2a9c01d4e7" + "0" * 52


def write_summary(folder, **keys) -> None:
    summary = {"status": "completed", "error": None, "epochs_requested": 2,
               "epochs_completed": 2, "stopped_early": False,
               "started_at": "2026-01-01T10:00:00+00:00", "wall_time_s": 13.2,
               "images_per_sec": 4098.4, "metrics": {}, "weights_sha256": None, **keys}
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def make_runs(root) -> None:
    write_summary(root / "cifar" / "version_0", weights_sha256=DIGEST, wall_time_s=75.0,
                  metrics={"val/accuracy": 0.994, "val/loss": 0.1407})
    # Started before version_0: listed first although its folder sorts after.
    # Written since throughput has a unit (a recipe's own: tokens); the others before,
    # with images_per_sec.
    write_summary(root / "oct", status="failed", error="RunError: the loss became nan",
                  epochs_completed=0, epochs_requested=3, wall_time_s=4000,
                  throughput_unit="tokens", tokens_per_sec=51200.2,
                  started_at="2026-01-01T09:00:00+00:00", metrics={"val/loss": 2.5})
    write_summary(root / "cifar" / "version_1", status="preempted", epochs_completed=1,
                  epochs_requested=5, images_per_sec=None,
                  started_at="2026-01-01T11:00:00+00:00",
                  metrics={"val/accuracy": 0.4645, "val/loss": 2.1668})
    (root / "cifar" / "version_1" / "checkpoints").mkdir()  # no summary: not a run
    (root / "broken").mkdir()
    (root / "broken" / "summary.json").write_text('{"status": "compl')  # cut short


def test_the_table_lists_nested_runs_by_start_time(tmp_path, monkeypatch):
    make_runs(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    proc = run_cli_here("runs")  # DIR defaults to runs
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert cells(lines[0]) == ["RUN", "STATUS", "EPOCHS", "VAL/ACCURACY", "VAL/LOSS",
                               "THROUGHPUT", "WALL", "DIGEST"]
    # Columns line up: every value starts where its heading does.
    assert lines[1].index("failed") == lines[0].index("STATUS")
    assert lines[2].index("1m15s") == lines[0].index("WALL")
    assert [cells(line) for line in lines[1:4]] == [
        ["runs/oct", "failed", "0/3", "-", "2.5000", "51200 tokens/s", "1h06m", "-"],
        ["runs/cifar/version_0", "completed", "2/2", "0.9940", "0.1407", "4098 images/s",
         "1m15s", "3f2a9c01d4e7"],
        ["runs/cifar/version_1", "preempted", "1/5", "0.4645", "2.1668", "-", "13.2s", "-"],
    ]
    # The summary cut short has its row (last: it has no start time, its file is newest).
    assert lines[4].startswith("runs/broken")
    assert "unreadable summary.json: " in lines[4]
    # A failed run's error follows the table.
    assert lines[5:] == ["runs/oct: failed: RunError: the loss became nan"]


def test_a_run_folder_itself_and_odd_summaries(tmp_path):
    write_summary(tmp_path / "run", stopped_early=True, epochs_completed=4,
                  epochs_requested=10, metrics="not a dict", wall_time_s=None)
    (tmp_path / "run" / "sub").mkdir()
    (tmp_path / "run" / "sub" / "summary.json").write_text("[1, 2]")
    proc = run_cli_here("runs", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert cells(lines[0]) == ["RUN", "STATUS", "EPOCHS", "THROUGHPUT", "WALL", "DIGEST"]
    assert cells(lines[1]) == [str(tmp_path / "run"), "completed (early stop)", "4/10",
                               "4098 images/s", "-", "-"]
    assert cells(lines[2]) == [str(tmp_path / "run" / "sub"),
                               "unreadable summary.json: a JSON list, not an object"]


def test_no_runs_says_where_it_looked(tmp_path):
    (tmp_path / "empty" / "tensorboard").mkdir(parents=True)
    proc = run_cli_here("runs", str(tmp_path / "empty"))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout == (f"no runs under {tmp_path / 'empty'}: no summary.json in it or "
                           "its subfolders\n")


def test_a_missing_folder_or_a_file_is_a_usage_error(tmp_path):
    for path, what in ((tmp_path / "nope", "does not exist"),
                       (tmp_path / "file.txt", "is not a folder")):
        if what == "is not a folder":
            path.write_text("x")
        proc = run_cli_here("runs", str(path))
        assert proc.returncode == 2
        assert proc.stderr == (f"engine-run: error: runs: {path} {what}; give the folder "
                               "that holds the runs' out_dirs: engine-run runs DIR\n")


def test_one_table_per_recipe_and_a_resumed_runs_total_wall_time(tmp_path, monkeypatch):
    """Runs of two recipes: each table has its own recipe's val columns (not one per
    metric of every recipe); WALL is a resumed run's total over its segments."""
    monkeypatch.chdir(tmp_path)
    lm = str(tmp_path / "recipes" / "char_lm.py")  # the engine records absolute paths
    write_summary(tmp_path / "runs" / "lm", recipe=lm, wall_time_s=30.0,
                  total_wall_time_s=95.0, segments=2,
                  metrics={"val/loss": 2.06, "val/perplexity": 7.87})
    write_summary(tmp_path / "runs" / "cifar", recipe="/elsewhere/cifar_ddp.py",
                  started_at="2026-01-01T09:00:00+00:00", metrics={"val/accuracy": 0.99})
    proc = run_cli_here("runs")
    assert proc.returncode == 0, proc.stderr
    tables = [block.splitlines() for block in proc.stdout.split("\n\n")]
    assert [t[0] for t in tables] == ["recipe /elsewhere/cifar_ddp.py",
                                      "recipe recipes/char_lm.py"]
    assert [cells(line) for line in tables[0][1:]] == [
        ["RUN", "STATUS", "EPOCHS", "VAL/ACCURACY", "THROUGHPUT", "WALL", "DIGEST"],
        ["runs/cifar", "completed", "2/2", "0.9900", "4098 images/s", "13.2s", "-"]]
    assert [cells(line) for line in tables[1][1:]] == [
        ["RUN", "STATUS", "EPOCHS", "VAL/LOSS", "VAL/PERPLEXITY", "THROUGHPUT", "WALL",
         "DIGEST"],
        ["runs/lm", "completed", "2/2", "2.0600", "7.8700", "4098 images/s", "1m35s", "-"]]
