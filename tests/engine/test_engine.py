"""engine/engine.py: what every worker sets up before training."""

from __future__ import annotations

import pytest

from tests.recipes.tiny_parallel_runs import probes, run_tiny


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_switches_torch_to_deterministic_kernels(tmp_path, deterministic):
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "single", "epochs=1", f"deterministic={deterministic}",
             nproc=1)
    (probe,) = probes(out)
    assert probe["deterministic_algorithms"] is deterministic
