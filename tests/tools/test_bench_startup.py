"""tools/bench_startup.py, smoke-sized: both whole commands run, train alike (the same
weights), and the report gives wall, train and their difference per side, with the
engine's phases. (The numbers themselves are the benchmark's business, not a test's.)"""

from __future__ import annotations

import importlib.util
import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env

TOOL = REPO / "tools" / "bench_startup.py"


def test_bench_startup_times_both_commands_and_finds_the_same_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python([str(TOOL), "--nproc", "1", "--rounds", "1", "--warmup", "0",
                       "--epochs", "1", "--size", "64", "--json", str(out)],
                      cwd=REPO, env=engine_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["processes"] == 1 and row["rounds"] == 1 and row["same_weights"]
    for side in ("hand-written", "engine"):
        wall, train = row[side]["wall_s"]["median"], row[side]["train_s"]["median"]
        assert wall > train > 0
        assert row[side]["overhead_s"]["median"] == pytest.approx(wall - train)
        line = next(li for li in proc.stdout.splitlines() if f"  {side} " in li)
        assert f"{wall:.2f}" in line and f"{wall - train:.2f}" in line
    phases = list(row["engine_phases_s"])
    assert phases[0] == "command set-up" and "training" in phases
    assert "engine's extra start-up + tear-down" in proc.stdout
    assert "weights the same" in proc.stdout


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_startup", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_bench_startup_refuses_a_batch_that_does_not_split(capsys):
    with pytest.raises(SystemExit) as exc:
        load_tool().parse_args(["--nproc", "1,2", "--batch", "63"])
    assert exc.value.code == 2
    assert ("error: --size must hold one --batch, which must split evenly over --nproc"
            in capsys.readouterr().err)


def test_bench_startup_imports_refuses_no_pairs(capsys, monkeypatch):
    # Its measurement itself runs in tests/engine/test_imports.py's import-cost guard.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main() sets it: restored after
    with pytest.raises(SystemExit) as exc:
        load_tool().main(["imports", "--pairs", "0"])
    assert exc.value.code == 2
    assert ("bench_startup.py imports: error: --pairs 0: expected at least 1 pair of "
            "interpreters" in capsys.readouterr().err)
