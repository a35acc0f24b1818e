"""tools/bench_memory_snapshot.py, smoke-sized: memory snapshots at auto (every step
until a check point measured them: here none does) and every 5 steps against off, on
the tiny workload in 2 gloo processes, 20 steps (one window). The numbers themselves
are the benchmark's business; the count of snapshots, their bytes against the model's
and optimizer's, the interval auto used, and the identical weights are checked."""

from __future__ import annotations

import json

from engine.testing import run_python
from tests.conftest import REPO, engine_env

TOOL = str(REPO / "tools" / "bench_memory_snapshot.py")


def test_bench_memory_snapshot_reports_cost_bytes_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [TOOL, "--workloads", "tiny", "--procs", "2", "--steps", "20", "--reps", "1",
         "--every", "auto", "--sweep", "tiny:2:5", "--json", str(out)],
        # Forked rather than spawned, to save the processes' start (as bench_overhead's
        # smoke test); the weights must not tell.
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    # Exit 0: the runs with memory snapshots ended with the weights of the runs without.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["workload"], r["processes"], r["every"], r["steps"], r["snapshots"])
            for r in rows] == [("tiny", 2, "auto", 20, 20), ("tiny", 2, 5, 20, 4)]
    # auto's first check point (step 20) only starts the measuring: every step all along.
    assert rows[0]["chosen_every"] == [1] and rows[1]["chosen_every"] == [5]
    assert "  tiny, 2 process(es): N 1; cost % -" in proc.stdout  # nothing measured
    for row in rows:
        assert row["bit_identical"], row
        # The payload holds the model and its momentum (and more: RNG states, progress);
        # both buffers are mapped, each with room for it.
        assert row["payload_bytes"] >= row["tensor_bytes"] == 2 * 4 * (8 * 8 + 8)
        assert row["held_bytes"] >= 2 * row["payload_bytes"]
        assert row["snapshot_ms"] > 0 and row["bandwidth_gb_s"] > 0
        assert row["capture_ms"] > 0 and row["copy_ms"] > 0 and row["copy_gb_s"] > 0
        assert row["first_snapshot_ms"] > 0
        # 5 divides the window of 20 steps; auto's interval is not known beforehand.
        assert (row["window_cost_pct"] is None) == (row["every"] == "auto")
        assert {"model", "optimizer", "rng"} <= set(row["capture_parts_ms"])
        assert row["step_off_ms"] > 0 and row["reps"] == 1
        # A line in each table: the cost, the ratios on / off of wall and CPU time per
        # step, then the one snapshot's time and bytes.
        cost, ratio, one = [li for li in proc.stdout.splitlines()
                            if li.startswith(f"tiny         2 {row['every']:>4}")]
        assert cost.endswith("bit-identical")
        assert row["cpu_step_on_ms"] > 0 and row["cpu_ratio"]["median"] > 0
        assert (f"{row['ratio']['median']:6.3f}" in ratio
                and f"{row['cpu_ratio']['median']:6.3f}" in ratio)
        assert f"{row['payload_bytes'] / 1e6:8.3f}" in one and "rng " in one
    # Off is off: its runs took no memory snapshot and had no buffer.
    off = [r for r in result["runs"] if r["every"] == 0]
    assert len(off) == 2 and all(r["snapshots"] == 0 == r["payload_bytes"] for r in off)
    # The probe's per-snapshot times are the engine's clock, one by one.
    for run in result["runs"]:
        assert len(run["snapshot_times"]) == run["snapshots"]
        assert abs(sum(run["snapshot_times"]) - run["snapshot_s"]) < 1e-6


def test_bench_memory_snapshot_rejects_an_unknown_workload_in_one_line():
    proc = run_python([TOOL, "--workloads", "cifar,resnet"], cwd=REPO, env=engine_env(),
                      timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "error: unknown workload(s) resnet; choose from cifar, tiny, mlp100")
