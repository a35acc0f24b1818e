"""tools/bench_overhead.py, smoke-sized: it compares every CPU mode with the hand-written
loop, prints the ratios and finds the weights bit-identical. (The numbers themselves
are the benchmark's business, not a test's.)"""

from __future__ import annotations

import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env


@pytest.mark.slow
def test_bench_overhead_reports_ratios_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_overhead.py"), "--reps", "1", "--size", "128",
         "--batch", "32", "--import-reps", "1", "--json", str(out)],
        # The sessions' processes forked rather than spawned, to save their start
        # (ENGINE_START_METHOD, as engine-run's); the weights must not tell.
        cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ENGINE_START_METHOD" not in proc.stderr  # forked: no fall-back warning
    result = json.loads(out.read_text())
    assert [(r["processes"], r["mode"]) for r in result["loops"]] == [
        (1, "single"), (1, "dp"), (2, "ddp"), (2, "ddp-multigpu")]
    for row in result["loops"]:
        assert row["bit_identical"], row
        assert row["ratio"] > 0 and row["hand_s"] > 0
        line = next(li for li in proc.stdout.splitlines() if f" {row['mode']} " in li)
        assert line.endswith("bit-identical") and f"{row['ratio']:.3f}" in line
    imports = result["imports"]
    assert imports["bare_import_engine_imports_torch"] is False
    assert imports["torch_s"] > 0 and imports["ratio"] > 0.5
    assert "imports: what a run imports" in proc.stdout


def test_bench_overhead_rejects_an_unknown_mode():
    proc = run_python([str(REPO / "tools" / "bench_overhead.py"), "--modes", "ddp,fsdp"],
                      cwd=REPO, env=engine_env(), timeout=120)
    assert proc.returncode == 2
    assert ("error: unknown mode(s) fsdp; choose from single, dp, ddp, ddp-multigpu"
            in proc.stderr)
