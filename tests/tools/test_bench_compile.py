"""tools/bench_compile.py, smoke-sized: the language-model workload (recipes/char_lm.py:
its datasets, scheduler and gradient clipping in the hand-written loop too) at 20 steps
of 2 windows, with the aot_eager backend (a real torch.compile that generates no code, so
that the smoke run takes seconds, not the minute of an inductor compile here). It times
the four variants and prints the ratios, the tokens/s and the compile time. (The numbers
themselves are the benchmark's business.)"""

from __future__ import annotations

import json

import pytest

from engine.testing import run_python
from tests.conftest import REPO, engine_env


def test_bench_compile_compares_compiled_and_eager_engine_and_hand_written_lm(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_compile.py"), "--workload", "char_lm", "--size", "40",
         "--batch", "2", "--reps", "1", "--backend", "aot_eager", "--threads", "1",
         "--json", str(out)], cwd=REPO, env=engine_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for numbers in (result, result["cpu"]):  # of wall and of process CPU time
        assert set(numbers["step_ms"]) == {"hand eager", "engine eager", "hand compiled",
                                           "engine compiled"}
        assert all(ms > 0 for ms in numbers["step_ms"].values())
        for key in ("engine_vs_hand_eager", "engine_vs_hand_compiled",
                    "compiled_vs_eager_engine", "compiled_vs_eager_hand"):
            assert numbers[key] > 0, key
    assert result["unit"] == "tokens"  # 2 windows of model.context=64 characters a step
    per_step_s = {v: ms / 1e3 for v, ms in result["step_ms"].items()}
    assert result["per_sec"] == pytest.approx({v: 2 * 64 / s for v, s in per_step_s.items()})
    assert "tokens/s (wall): hand eager" in proc.stdout
    assert result["compile_s_engine"] > 0  # the warm-up's compiled engine run compiled
    assert f"{result['engine_vs_hand_compiled']:.3f}" in proc.stdout
    assert "compile time: engine" in proc.stdout
    assert "epoch 1/1" not in proc.stdout  # the engine's progress went to the log
