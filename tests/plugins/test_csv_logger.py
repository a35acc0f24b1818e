"""The built-in CSV logger, through its hooks on an engine as ``make_engine`` makes it (no
process): the header, the epoch column (from 1), every call's rows on disk when it
returns, resume without duplicates, rank 0 only. tests/plugins/test_loggers_run.py checks a real run's file."""

from __future__ import annotations

import csv
import os
import re
import sys
import types

from engine.plugins.csv_logger import HEADER, CsvLogger, read_metrics
from engine.testing import (make_engine, make_plugin_manager, run_recipe,  # noqa: F401
                            tiny_recipe)  # (fixtures)
from engine.world import World
from tests.conftest import REPO
from tests.plugins.killed_runs import (ENGINE_RUN_KILL_STEP, killed_custom_loop,
                                       killed_engine_run)


def read(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def train(logger, eng, first_step: int, epochs: int, steps_per_epoch: int = 8) -> None:
    """Fire the hooks as the Trainer does: a log every 4 steps, then the epoch's metrics
    (before the Trainer moves state.epoch on), then engine_epoch_end."""
    step = first_step
    for epoch in range(eng.state.epoch, eng.state.epoch + epochs):
        eng.state.epoch = epoch
        for _ in range(steps_per_epoch // 4):
            step += 4
            logger.engine_log(ctx=eng, metrics={"train/loss": step / 100}, step=step)
        logger.engine_log(ctx=eng, step=step,
                          metrics={"train/epoch_loss": step / 100, "val/accuracy": 0.5})
        eng.state.epoch = epoch + 1
    eng.state.step = step


def test_header_epoch_column_and_every_call_on_disk_when_it_returns(make_engine):
    eng, logger = make_engine(), CsvLogger()
    path = eng.out_dir / "metrics.csv"
    logger.engine_run_start(ctx=eng)
    logger.engine_log(ctx=eng, metrics={"train/loss": 0.5, "lr": 0.1, "x": None}, step=4)
    # On disk at once (another reader sees it: what a SIGKILL now would leave).
    assert read(path) == [HEADER, ["4", "1", "train/loss", "0.5"], ["4", "1", "lr", "0.1"]]
    logger.engine_log(ctx=eng, metrics={"train/epoch_loss": 0.25, "val/acc": 0.75}, step=8)
    assert read(path)[3:] == [["8", "1", "train/epoch_loss", "0.25"], ["8", "1", "val/acc", "0.75"]]
    eng.state.epoch = 1  # the second epoch
    logger.engine_log(ctx=eng, metrics={"train/loss": 0.125}, step=12)
    assert read(path)[-1] == ["12", "2", "train/loss", "0.125"]
    logger.engine_run_end(ctx=eng, summary={"status": "preempted"})
    assert len(read(path)) == 6


def test_a_resume_drops_the_rows_after_the_snapshot_and_a_cut_short_line(make_engine):
    eng = make_engine()
    path = eng.out_dir / "metrics.csv"
    first = CsvLogger()
    first.engine_run_start(ctx=eng)
    train(first, eng, first_step=0, epochs=2)  # steps 4, 8 (epoch 0), 12, 16 (epoch 1)
    first.engine_log(ctx=eng, metrics={"train/loss": 0.2}, step=20)
    with open(path, "a") as f:
        f.write("24,3,train/lo")  # killed in the middle of a line
    before = read(path)

    # Resume from the snapshot at the end of epoch 1 (step 8).
    eng.state.step, eng.state.epoch, eng.resumed_from = 8, 1, "snapshot-e0001-s00000008.pt"
    second = CsvLogger()
    second.engine_run_start(ctx=eng)
    assert read(path) == before[:5]  # header, 4, 8, 8, 8: what the snapshot had seen
    train(second, eng, first_step=8, epochs=1)
    second.engine_run_end(ctx=eng, summary={"status": "completed"})
    rows = read(path)
    assert rows.count(HEADER) == 1
    assert [(r[0], r[1], r[2]) for r in rows[1:]] == [
        ("4", "1", "train/loss"), ("8", "1", "train/loss"), ("8", "1", "train/epoch_loss"),
        ("8", "1", "val/accuracy"), ("12", "2", "train/loss"), ("16", "2", "train/loss"),
        ("16", "2", "train/epoch_loss"), ("16", "2", "val/accuracy")]


def test_the_reader_gives_the_curves_the_logger_wrote(make_engine):
    """read_metrics (what engine-run report reads): by name, (step, value) in logged
    order, the resumed run's points in place of the interrupted run's."""
    eng = make_engine()
    assert read_metrics(eng.out_dir) is None  # no metrics.csv: another reader's turn
    logger = CsvLogger()
    logger.engine_run_start(ctx=eng)
    train(logger, eng, first_step=0, epochs=2)
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    with open(eng.out_dir / "metrics.csv", "a") as f:
        f.write("12,2,train/loss,9.0\n")  # a writer that only appends, resumed at 12
    series, path = read_metrics(eng.out_dir)
    assert path == eng.out_dir / "metrics.csv"
    assert series == {"train/loss": [(4, 0.04), (8, 0.08), (12, 9.0)],
                      "train/epoch_loss": [(8, 0.08), (16, 0.16)],
                      "val/accuracy": [(8, 0.5), (16, 0.5)]}


def test_a_new_run_in_an_old_out_dir_starts_the_file_afresh(make_engine):
    eng = make_engine()
    (eng.out_dir).mkdir(parents=True)
    (eng.out_dir / "metrics.csv").write_text("step,epoch,name,value\n4,0,train/loss,9.0\n")
    logger = CsvLogger()
    logger.engine_run_start(ctx=eng)
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    assert read(eng.out_dir / "metrics.csv") == [HEADER]


def test_a_custom_loop_opens_at_its_first_log_and_keeps_the_earlier_rows(make_engine):
    # engine.launch fires no engine_run_start: the first ctx.log opens the file.
    eng = make_engine()
    (eng.out_dir).mkdir(parents=True)
    (eng.out_dir / "metrics.csv").write_text(
        "step,epoch,name,value\n5,0,loss,1.0\n10,1,loss,0.5\n15,1,loss,0.25\n")
    eng.resumed_from, eng.state.epoch = "snapshot", 1
    logger = CsvLogger()
    logger.engine_log(ctx=eng, metrics={"loss": 0.4}, step=10)
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    assert read(eng.out_dir / "metrics.csv") == [
        HEADER, ["5", "0", "loss", "1.0"], ["10", "2", "loss", "0.4"]]


def test_other_ranks_write_nothing(make_engine):
    eng = make_engine()
    eng.world = World(rank=1, local_rank=1, world_size=2, local_world_size=2)
    logger = CsvLogger()
    logger.engine_run_start(ctx=eng)
    logger.engine_run_end(ctx=eng, summary={"status": "completed"})
    assert not (eng.out_dir / "metrics.csv").exists()


def test_the_docs_example_logger_passes_the_docs_example_test(make_engine, run_recipe,
                                                             monkeypatch):
    # docs/plugins.md shows a CSV logger plugin and, further down, its test: the two
    # must agree (the example once wrote no header while its test expected one). The
    # two-process test runs the sample package's ddp-fp16 mode, not installed: -p.
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "plugins.md").read_text(),
                        re.S)
    (plugin_source,) = [b for b in blocks if b.startswith("# engine_csv_logger/__init__")]
    (test_source,) = [b for b in blocks if "def test_one_row_per_metric" in b]
    plugin = types.ModuleType("engine_csv_logger")
    exec(compile(plugin_source, "docs/plugins.md (plugin)", "exec"), plugin.__dict__)
    monkeypatch.setitem(sys.modules, "engine_csv_logger", plugin)
    tests: dict = {}
    exec(compile(test_source, "docs/plugins.md (test)", "exec"), tests)
    tests["test_one_row_per_metric"](make_engine)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO / "tests" / "sample_plugin"), os.environ.get("PYTHONPATH", "")]))
    tests["test_two_processes"](run_recipe)


def test_a_sigkilled_custom_loop_keeps_every_row_it_logged(tmp_path_factory):
    """engine.launch fires no epoch-end hook: its rows must reach the file as logged. The
    loop logs train/mse every step (4 per epoch) and val/mse per epoch, and kills itself
    when its fourth epoch starts."""
    out = killed_custom_loop(tmp_path_factory)
    rows = [row[:3] for row in read(out / "metrics.csv")[1:]]
    expected = []
    for epoch in (1, 2, 3):
        expected += [[str(step), str(epoch), "train/mse"]
                     for step in range(4 * epoch - 3, 4 * epoch + 1)]
        expected.append([str(4 * epoch), str(epoch), "val/mse"])
    assert rows == expected


def test_a_sigkilled_engine_run_keeps_the_rows_of_its_last_check_point(tmp_path_factory):
    """Killed after step 13, in epoch 2: the window of steps 9-10, logged at the check
    point of step 12, is in the file with every row of epoch 1."""
    out = killed_engine_run(tmp_path_factory)
    rows = read(out / "metrics.csv")[1:]
    windows = [(int(step), int(epoch)) for step, epoch, name, _ in rows if name == "train/loss"]
    assert windows == [(2, 1), (4, 1), (6, 1), (8, 1), (10, 2)]
    assert ENGINE_RUN_KILL_STEP > 12
    assert [(int(s), int(e)) for s, e, name, _ in rows if name == "train/epoch_loss"] == [(8, 1)]
