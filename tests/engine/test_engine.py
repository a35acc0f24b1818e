"""engine/engine.py: what every worker sets up before training."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli
from tests.recipes.tiny_parallel_runs import probes, run_tiny


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_switches_torch_to_deterministic_kernels(tmp_path, deterministic):
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "single", "epochs=1", f"deterministic={deterministic}",
             nproc=1)
    (probe,) = probes(out)
    assert probe["deterministic_algorithms"] is deterministic


def test_a_failed_run_writes_summary_json_with_status_failed(tmp_path):
    """Rank 0 raises mid-epoch: it still writes summary.json, without any collective
    on the way (rank 1 is left waiting in one and is stopped by the launcher)."""
    env = engine_env(ENGINE_FAULT_ACTION="raise", ENGINE_FAULT_STEP="3",
                     ENGINE_FAULT_RANK="0")
    proc = run_cli(str(REPO / "tests" / "recipes" / "tiny_resume.py"), f"out_dir={tmp_path}",
                   "--nproc", "2", "-p", "tests.fault_plugin", env=env, timeout=200)
    assert proc.returncode != 0
    assert "[rank 0] RuntimeError: injected failure on rank 0" in proc.stderr
    summary = read_summary(tmp_path)
    assert (summary["status"], summary["global_step"], summary["world_size"]) == (
        "failed", 3, 2)
    assert "weights_sha256" not in summary  # a collective: not on the failure path
