"""The plugin author's own tests, on the fixtures of ``engine.testing``."""

import csv

import engine_csv_logger
from engine.testing import fire_run_end


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_one_row_per_metric_then_closed(make_engine):
    ctx = make_engine(plugins=[engine_csv_logger.CsvLogger()])
    ctx.pm.hook.engine_log(ctx=ctx, metrics={"train/loss": 0.5, "lr": 0.1}, step=3)
    ctx.pm.hook.engine_log(ctx=ctx, metrics={"train/loss": 0.25}, step=6)
    fire_run_end(ctx)
    assert read_rows(ctx.out_dir / "rows.csv") == [
        ["step", "name", "value"],
        ["3", "lr", "0.1"], ["3", "train/loss", "0.5"], ["6", "train/loss", "0.25"]]


def test_two_process_run_with_both_plugins(run_recipe):
    # Installed: the entry points load both plugins with no -p at all.
    run = run_recipe("epochs=1", args=["--parallel", "ddp-fp16", "--csv-file", "m.csv"])
    assert run.summary["parallel"] == "ddp-fp16"
    assert len(set(run.summary["weights_sha256_per_rank"])) == 1
    rows = read_rows(run.out_dir / "m.csv")
    # 256 samples, global batch 32 over 2 processes: 8 steps, logged every 2, plus the
    # epoch's mean (train/epoch_loss) after validation.
    steps = [int(step) for step, name, _ in rows[1:] if name == "train/loss"]
    assert steps == [2, 4, 6, 8]
    assert [int(step) for step, name, _ in rows[1:] if name == "train/epoch_loss"] == [8]
    assert ["8", "val/accuracy"] == [r[:2] for r in rows if r[1] == "val/accuracy"][0]
