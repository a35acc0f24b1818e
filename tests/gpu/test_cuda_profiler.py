"""plugins/profiler.py on CUDA: the trace holds the GPU's kernels, and profile.memory
dumps a CUDA memory snapshot that https://pytorch.org/memory_viz opens. Skips on a
machine without CUDA.

Run on a GPU machine with: python -m pytest tests/gpu/test_cuda_profiler.py -m cuda -rs
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests.conftest import REPO, engine_env, run_cli

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")


def test_a_gpu_trace_has_the_kernels_and_memory_true_dumps_a_cuda_snapshot(tmp_path):
    out = tmp_path / "run"
    run_cli(RECIPE, "epochs=1", "profile.steps=2:4", "profile.memory=true",
            f"out_dir={out}", "--nproc", "1", env=engine_env(CUDA_VISIBLE_DEVICES="0"),
            check=True)
    folder = out / "profile" / "steps2-4"
    (trace_file,) = folder.glob("rank0.*.pt.trace.json")
    events = json.loads(trace_file.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3", "engine: forward/backward"} <= names
    assert any(e.get("cat") == "kernel" for e in events), "no CUDA kernel in the trace"
    with open(folder / "rank0.memory.pickle", "rb") as f:
        snapshot = pickle.load(f)
    # torch.cuda.memory._snapshot()'s format: the allocator's segments and, per device,
    # the allocation events recorded while the history was on.
    assert snapshot["segments"] and any(snapshot["device_traces"]), snapshot.keys()
