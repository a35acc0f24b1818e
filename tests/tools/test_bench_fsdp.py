"""tools/bench_fsdp.py, smoke-sized: fsdp against ddp (losses, bytes per rank) and
against a hand-written FSDP2 loop (identical final weights), and the activation memory
that checkpointing saves. The numbers themselves are the benchmark's business; the
sharding's halving of the bytes per rank is arithmetic, so it is checked."""

from __future__ import annotations

import json

from engine.testing import run_python
from tests.conftest import REPO, engine_env


def test_bench_fsdp_reports_equal_losses_half_the_bytes_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_fsdp.py"), "--reps", "1", "--size", "256",
         "--batch", "32", "--json", str(out)],
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["steps"] == 8 and result["losses_close"]
    assert result["bytes_ratio"] <= 0.55, result["bytes_per_rank"]
    assert result["weights_identical"] and result["ratio"] > 0
    saves = result["dcp_saves"]  # async_save of the sharded state, on gloo
    assert 0 < saves["async_blocking_s"] <= saves["async_total_s"]
    memory = result["activation_bytes"]
    assert 0 < memory["Conv2d,Linear"] < memory["none"]
    assert "fsdp / ddp bytes per rank: 0.5" in proc.stdout
