"""tools/bench_gpu_host_cpu.py on the CPU, smoke-sized: one variant run as the tool runs
each (``--one``, in its own process), its loop timed and its CPU counted per thread, and
the CPU ops of its profiled steps listed. (The GPU numbers are the benchmark's business:
docs/performance.md.)"""

from __future__ import annotations

import json
import os
import sys

from engine.testing import run_python
from tests.conftest import REPO, engine_env

sys.path.insert(0, str(REPO / "tools"))
import bench_gpu_host_cpu  # noqa: E402


def test_threads_are_counted_by_name_with_the_main_thread_named_main():
    threads = bench_gpu_host_cpu.thread_cpu()
    name, cpu_s = threads[os.getpid()]  # pytest's main thread is this process's first
    assert name == "main" and cpu_s > 0


def test_one_variant_times_its_loop_and_counts_its_threads(tmp_path):
    ops = tmp_path / "ops.txt"
    first, last = bench_gpu_host_cpu.PROFILED
    samples = (last + 1) * 16  # past the profiled steps, batch 16
    proc = run_python([str(REPO / "tools" / "bench_gpu_host_cpu.py"), "--one", "hand",
                       "--device", "cpu", "--size", str(samples), "--batch", "16",
                       "--ops", str(ops)], cwd=REPO, env=engine_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["wall_ms"] > 0 and result["cpu_ms"] > 0
    assert "main" in [name for name, _ in result["busiest"]]
    assert result["threads"] >= 1 and result["torch_threads"] >= 1
    listed = ops.read_text()
    assert listed.startswith(f"== hand: CPU ops of steps {first}-{last}")
    assert "aten::convolution_backward" in listed
