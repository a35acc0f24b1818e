"""tools/bench_resume_skip.py, smoke-sized: the resumed epoch's first batch loads one
batch of samples, not the consumed ones, and the report compares it with a fresh start.
(The timings themselves are the benchmark's business, not a test's.)"""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "bench_resume_skip", REPO / "tools" / "bench_resume_skip.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_resume_skip_loads_one_batch_and_prints_the_comparison(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = load_tool().main(["--size", "3000", "--batch", "30", "--world-size", "3",
                                   "--reps", "1", "--skip-batches", "5", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert result["position"] == 2700 and result["resumed_loads"] == [10]
    assert "x" in printed and "of fresh; samples loaded: [10]" in printed
    assert "skip by loading (estimate)" in printed
