"""tools/bench_lm.py: its checks, on records, without training. A run of the tool at its
smallest setting (10 steps, 1 round after a warm-up, 1 process, one engine variant)
takes 40 s or more here, too long for the suite: it is run by hand (docs/performance.md
has the command)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO

TOOL = REPO / "tools" / "bench_lm.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("bench_lm", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def run(round_index, variant, *, seconds=1.0, loss=3.25, digest="w", windows="x",
        initial="i") -> dict:
    return {"round": round_index, "variant": variant, "seconds": seconds,
            "cpu_seconds": seconds, "faults_per_step": 10.0, "steps": 20,
            "final_loss": loss, "digest": digest, "windows": windows, "initial": initial}


def test_bench_lm_refuses_runs_that_start_from_different_windows(capsys):
    tool = load_tool()
    same = [run(0, tool.HAND), run(0, "on"), run(1, "on"), run(1, tool.HAND)]
    tool.check_same_start(same)  # nothing said
    with pytest.raises(SystemExit) as exc:
        tool.check_same_start([*same, run(2, "off", windows="other")])
    assert exc.value.code == ("bench_lm: the runs started from different training "
                              "windows (other, x); the comparison is void")
    with pytest.raises(SystemExit) as exc:
        tool.check_same_start([*same, run(2, "off", initial="j")])
    assert "different initial weights (i, j)" in exc.value.code


def test_bench_lm_rows_pair_rounds_and_say_whether_losses_and_weights_agree():
    tool = load_tool()
    results = [run(0, tool.HAND, seconds=9.0), run(0, "on", seconds=9.0),
               run(0, "off", seconds=9.0, loss=3.5),  # the warm-up: not timed, but checked
               run(1, tool.HAND, seconds=2.0), run(1, "on", seconds=2.2),
               run(1, "off", seconds=2.0),
               run(2, "off", seconds=4.0), run(2, tool.HAND, seconds=4.0),
               run(2, "on", seconds=4.0, digest="v")]
    results[4]["memory_record"] = {"every_steps": 8, "auto": True, "snapshot_s": 0.01,
                                   "step_s": 0.1, "cost_percent": 1.25,
                                   "measured_percent": 1.5, "measured_error_percent": 0.4}
    on, off = tool.summarize(2, results)
    assert (on["setting"], off["setting"]) == ("engine", "engine, memory off")
    assert on["memory"] == ["8/1.25/1.5+-0.4", "-"]  # the tier at each counted run's end
    assert on["processes"] == 2 and on["rounds"] == 2
    assert on["hand_s"] == 3.0 and on["engine_s"] == 3.1
    assert on["ratio"] == pytest.approx(3.1 / 3.0)
    assert on["paired_ratio"] == pytest.approx((1.1 + 1.0) / 2)
    assert not on["identical"] and not off["identical"]  # round 2's weights, round 0's loss
    assert all(row["identical"] for row in tool.summarize(2, results[3:6]))


def test_bench_lm_refuses_a_process_count_it_does_not_run(capsys):
    with pytest.raises(SystemExit) as exc:
        load_tool().parse_args(["--nproc", "1,4"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --nproc 1,4: choose from 1, 2")
