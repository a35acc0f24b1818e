"""tools/bench_scale.py without training: the growth fits, the figures taken from the
workers' records, the tables, and the counting of collectives and spans that its
plugin side wraps around torch.distributed (here around stand-ins: no process group);
and its smallest setting, one engine-run of 2 ranks."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from engine.testing import run_python
from tests.conftest import REPO, engine_env

TOOL = str(REPO / "tools" / "bench_scale.py")
sys.path.insert(0, str(REPO / "tools"))
import bench_scale  # noqa: E402


def test_fit_tells_constant_log_and_linear_growth():
    sizes = (2, 4, 8, 16)
    assert bench_scale.fit({w: 56.0 for w in sizes})["model"] == "constant"
    linear = bench_scale.fit({w: 16904.0 * w for w in sizes})
    assert linear["model"] == "W" and linear["r2"] == pytest.approx(1.0)
    assert bench_scale.predict(linear, 16384) == pytest.approx(16904.0 * 16384)
    logarithmic = bench_scale.fit({w: 3.0 + 2.0 * math.log2(w) for w in sizes})
    assert logarithmic["model"] == "log W"
    assert bench_scale.predict(logarithmic, 1024) == pytest.approx(3.0 + 2.0 * 10)
    # Within 15% of the mean: constant; a figure that falls with W is not carried up.
    assert bench_scale.fit({2: 1.0, 4: 1.1, 8: 0.95, 16: 1.05})["model"] == "constant"
    falling = bench_scale.fit({2: 4.0, 4: 2.0, 8: 1.0, 16: 0.5})
    assert falling["model"] == "constant" and falling["a"] == pytest.approx(1.875)
    # Two points fit both models exactly: the larger at scale (W) is taken.
    assert bench_scale.fit({2: 1.0, 4: 2.0})["model"] == "W"


def record(rank: int, world_size: int, restart: int = 0, **changes) -> dict:
    """A worker's record as the plugin writes it: snapshots whose exchange receives
    every rank's row of 100 bytes (an all_gather), a check point of 56 bytes."""
    base = {
        "rank": rank, "world_size": world_size, "restart": restart, "steps": 10,
        "training_s": 0.5, "first_step_at": 100.0 + rank, "resumed_step": 0,
        "resume": None,
        "phases": [["command set-up", 2.0, 1.5], ["worker start", 3.0, 0.1],
                   ["process group", 0.2, 0.01], ["resume, run-start hooks", 0.1, 0.02],
                   ["training", 0.5, 0.4]],
        "spans": {"check point": [2, 0.004, 0.001], "memory snapshot": [2, 0.02, 0.004]},
        "missing_spans": [],
        "collectives": [["training", "check point", "all_reduce", 2, 112, 112, 0.001],
                        ["training", "exchange", "all_gather", 2, 200, 200 * world_size,
                         0.001],
                        ["start-up", "engine.run_dir:settle", "broadcast_object_list", 1,
                         50, 0, 0.001]],
        "cpu_s": 0.1, "peak_rss_bytes": 400 << 20, "shm_peak_bytes": 4096,
        "pss_bytes": 100 << 20}
    return {**base, **changes}


def run(world_size: int) -> dict:
    """A kill run: the first attempt's records (killed after step 9), the restarted
    attempt's (resumed from the memory snapshot at step 8)."""
    first = [record(r, world_size) for r in range(world_size)]
    again = [record(r, world_size, restart=1, resumed_step=8, first_step_at=210.0,
                    spans={"resume agreement": [1, 0.003 * world_size, 0.001]},
                    collectives=[["start-up", "resume agreement", "all_gather_object", 1,
                                  37, 37 * world_size, 0.001]])
             for r in range(world_size)]
    return {"world_size": world_size, "kind": "kill", "launched_at": 90.0,
            "records": first + again, "kill": {"killed_at": 200.0, "step": 9},
            "disk_snapshot_bytes": 1000 * world_size}


def test_figures_from_records_and_their_table():
    sizes = [2, 4, 8, 16]
    runs = [run(w) for w in sizes]
    table = bench_scale.figures(runs)
    assert table["start-up to first step"] == {w: 100.0 + (w - 1) / 2 - 90.0 for w in sizes}
    # The worker's own CPU from its start to its first step: not the launcher's set-up.
    assert table["start-up CPU (worker's phases)"][2] == pytest.approx(0.13)
    assert table["check point collective bytes"] == {w: 56.0 for w in sizes}
    assert table["exchange: bytes received per snapshot"] == {w: 100.0 * w for w in sizes}
    assert table["kill to first new step"] == {w: 10.0 for w in sizes}
    assert table["restart: steps lost"] == {w: 1 for w in sizes}
    assert table["restart: agreement bytes received"] == {w: 37 * w for w in sizes}
    rows = {r["figure"]: r for r in bench_scale.rows(table)}
    exchange = rows["exchange: bytes received per snapshot"]
    assert exchange["fit"]["model"] == "W"
    assert exchange["at"][16384] == pytest.approx(100.0 * 16384)
    assert rows["check point collective bytes"]["fit"]["model"] == "constant"
    text = bench_scale.markdown(list(rows.values()), sizes)
    lines = text.splitlines()
    assert lines[0].startswith("| figure (per rank, median) | W=2 | W=4 | W=8 | W=16 | growth")
    assert "| exchange: bytes received per snapshot | 200 B | 400 B | 800 B | 1.56 KiB | " \
           "W (R² 1.00) | 100 KiB | 400 KiB | 1.56 MiB |" in lines
    # A wall time is fitted but not carried to 16k: W processes on 2 cores distort it.
    kill = [li for li in lines if li.startswith("| kill to first new step (t) |")]
    assert kill and kill[0].endswith("| constant | - | - | - |")
    details = bench_scale.breakdown_markdown(bench_scale.breakdown(runs), sizes).splitlines()
    assert "| training | exchange | all_gather | 2, 200 B / 400 B | 2, 200 B / 800 B | " \
           "2, 200 B / 1.56 KiB | 2, 200 B / 3.12 KiB | W |" in details


def test_collectives_are_counted_per_span_with_their_bytes():
    calls = []

    def all_reduce(tensor, op=None):
        calls.append(tensor)

    def all_gather(out, tensor):
        for t in out:
            t.copy_(tensor)

    reduce = bench_scale.counted("all_reduce", all_reduce)
    gather = bench_scale.counted("all_gather", all_gather)
    bench_scale._collectives.clear()
    bench_scale._spans.clear()
    in_span = bench_scale.timed("check point", lambda: reduce(torch.zeros(14)))
    in_span()
    gather([torch.empty(4, dtype=torch.uint8) for _ in range(3)],
           torch.ones(4, dtype=torch.uint8))
    assert len(calls) == 1
    rows = {(where, kind): row for (stage, where, kind), row in
            bench_scale._collectives.items()}
    assert rows[("check point", "all_reduce")][:3] == [1, 56, 56]
    # Outside a span: the caller, a rank's 4 bytes sent and 3 ranks' received.
    caller = f"{__name__}:test_collectives_are_counted_per_span_with_their_bytes"
    assert rows[(caller, "all_gather")][:3] == [1, 4, 12]
    assert bench_scale._spans["check point"][0] == 1
    # The stage is this process's (engine.phases: "end" once an in-process run of another
    # test on this worker ended), the same for every call.
    assert {stage for stage, _, _ in bench_scale._collectives} == {bench_scale.stage()}


def test_the_smallest_setting_measures_two_ranks(tmp_path):
    """One engine-run of 2 ranks, 4 steps (8-11 s on the shared 2-core machine): every
    worker's record came back, its collectives were counted (the check point's
    all-reduce: its 14 float32 sums) and the table holds them."""
    out = tmp_path / "bench.json"
    proc = run_python(
        [TOOL, "--sizes", "2", "--no-kill", "--steps", "4", "--log-every", "2",
         "--memory-every", "2", "--disk-every", "3", "--kill-step", "1",
         "--json", str(out)],
        # Forked from engine-run rather than from a warm spare, to save an interpreter
        # (as bench_memory_snapshot's smoke test): the plugin wraps the forks' collectives.
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert sorted(r["rank"] for r in run["records"]) == [0, 1]
    figures = {r["figure"]: r["values"]["2"] for r in result["rows"]}
    assert figures["check point collective bytes"] == 52
    assert figures["peak /dev/shm per rank"] > 0 and figures["disk snapshot file"] > 0
    assert figures["start-up to first step"] > 0
    assert "| check point collective bytes | 52 B | constant | 52 B | 52 B | 52 B |" \
        in proc.stdout


def test_tcp_connections_counts_this_process_s_established_connections():
    """The figure that shows gloo's pairs per rank: a connection made here adds its two
    ends (both this process's)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        before = bench_scale.tcp_connections()
        with socket.create_connection(server.getsockname()) as client, \
                server.accept()[0] as accepted:
            assert bench_scale.tcp_connections() == before + 2, (client, accepted)
