"""tools/bench_token_shards.py, smoke-sized: the engine on token shards, the hand-written
memory-map loop and the loader alone all run, the ratio is printed, and the engine's
weights are those of the hand-written loop (the same work, the same windows in the same
order). The numbers are the benchmark's business, not a test's."""

from __future__ import annotations

import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env


@pytest.mark.slow
def test_bench_token_shards_reports_the_ratio_and_identical_weights(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python([str(REPO / "tools" / "bench_token_shards.py"), "--reps", "1",
                       "--chars", "6000", "--batch", "8", "--json", str(out)],
                      cwd=REPO, env=engine_env(ENGINE_START_METHOD="fork"), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())["summary"]
    hand = summary["hand-written"]
    for variant in ("engine", "engine auto"):
        assert summary[variant]["digests"] == hand["digests"], summary
        assert summary[variant]["paired_ratio"] > 0
    assert summary["loader alone"]["tokens_per_s_0_workers"] > 0
    assert f"engine / hand-written = {summary['engine']['paired_ratio']:.3f}" in proc.stdout
