"""tools/bench_threads.py, smoke-sized: one run trains and its row gives the samples/s
and the threads its plan chose. (The numbers are the benchmark's business.)"""

from __future__ import annotations

import json

from engine.testing import run_python
from tests.conftest import REPO, engine_env

TOOL = REPO / "tools" / "bench_threads.py"


def test_bench_threads_prints_a_row_per_setting_with_the_chosen_threads(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python([str(TOOL), "--size", "64", "--nproc", "1", "--settings", "default,1",
                       "--loads", "idle", "--json", str(out)], cwd=REPO, env=engine_env(),
                      timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    default, one = json.loads(out.read_text())["rows"]
    assert (default["threads"], one["threads"]) == ("default", "1")
    assert default["chosen"].startswith(("1 per process (default: ", "2 per process (default: "))
    assert one["chosen"] == "1 per process (--threads)"
    assert default["samples_per_sec"] > 0 and one["samples_per_sec"] > 0
    assert "| idle | 1 | default |" in proc.stdout
