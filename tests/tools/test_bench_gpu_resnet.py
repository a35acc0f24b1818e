"""tools/bench_gpu_resnet.py: without CUDA it says so and exits; its plumbing (recipe,
engine timer plugin, hand-written loop, variants) runs as a tiny CPU smoke test."""

from __future__ import annotations

import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env

BENCH = str(REPO / "tools" / "bench_gpu_resnet.py")


def test_without_cuda_it_exits_with_a_clear_message():
    proc = run_python([BENCH], cwd=REPO, env=engine_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "bench_gpu_resnet: no CUDA device visible (torch.cuda.is_available() is False); "
        "run it on a GPU machine, or use --cpu-smoke to check the plumbing on the CPU")


@pytest.mark.slow
def test_cpu_smoke_runs_both_tables_each_mode_at_its_process_count(tmp_path):
    # Both tables in one run (one start of the tool); its sessions' processes forked
    # rather than spawned, to save their start (ENGINE_START_METHOD, as engine-run's).
    out = tmp_path / "bench.json"
    proc = run_python(
        [BENCH, "--cpu-smoke", "--variants", "fp32,channels_last+bf16", "--modes",
         "single,dp,ddp", "--nproc", "2", "--image-size", "16", "--batch", "4", "--steps",
         "1", "--workers", "0", "--reps", "1", "--json", str(out)],
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ENGINE_START_METHOD" not in proc.stderr  # forked: no fall-back warning
    rows = json.loads(out.read_text())
    # The variants run at the default mode of 2 processes (ddp), each mode at its own.
    assert [(r.get("variant"), r.get("mode"), r["processes"]) for r in rows] == [
        ("fp32", None, 2), ("channels_last+bf16", None, 2),
        (None, "single", 1), (None, "dp", 1), (None, "ddp", 2)]
    assert all(r["hand"] > 0 and r["engine"] > 0 for r in rows)
    assert rows[0]["gain"] == 1.0 and rows[2]["vs_single"] == 1.0
    # fp32 at ddp, a line of both tables, was measured once (one round: the same figures).
    assert (rows[0]["hand"], rows[0]["engine"]) == (rows[4]["hand"], rows[4]["engine"])
    assert "CPU smoke test (not a measurement)" in proc.stdout


def test_nothing_to_measure_is_an_error():
    proc = run_python([BENCH, "--cpu-smoke", "--variants", ""], cwd=REPO, env=engine_env(),
                      timeout=120)
    assert proc.returncode == 2
    assert "nothing to measure: give --variants or --modes" in proc.stderr
