"""compile.* on CUDA with bf16 autocast: inductor's Triton kernels, the case where
compile is meant to pay. Skips without CUDA.

Run on a GPU machine with: python -m pytest tests/gpu/test_cuda_compile.py -m cuda -rs
"""

from __future__ import annotations

import pytest
import torch

from engine.testing import run_python
from tests.conftest import REPO, read_summary
from tests.recipes.tiny_parallel_runs import run_tiny, tiny_env

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]

COMMON = ("--parallel", "single", "epochs=2", "precision=bf16", "train_size=256",
          "batch_size=32")


def test_compiled_bf16_run_on_cuda_matches_eager_and_reports_its_compile(tmp_path):
    run_tiny(tmp_path / "eager", *COMMON, nproc=1, cuda_visible_devices="0")
    run_tiny(tmp_path / "compiled", *COMMON, "compile.enabled=true", nproc=1,
             cuda_visible_devices="0")
    run_tiny(tmp_path / "regional", *COMMON, "compile.enabled=true",
             "compile.regional=Linear", nproc=1, cuda_visible_devices="0")
    eager, compiled, regional = (read_summary(tmp_path / name)
                                 for name in ("eager", "compiled", "regional"))
    for run in (compiled, regional):
        assert run["status"] == "completed"
        # Reported; its value is torch's own count, which torch 2.11 left at 0.0 in these
        # workers forked from the tests' warm server on an H200 (a plain engine-run there
        # reported 5.5 s): issue 27's closing note.
        assert run["compile_s"] is not None and run["compile_s"] >= 0
        # bf16 rounds at every op, and compiled kernels fuse them differently.
        assert run["train_loss"] == pytest.approx(eager["train_loss"], abs=2e-2)
        assert run["val_loss"] == pytest.approx(eager["val_loss"], abs=2e-2)
    snap = torch.load(compiled["final_checkpoint"], map_location="cpu", weights_only=True)
    assert not [k for k in snap["model"] if "_orig_mod" in k]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_compiled_ddp_on_two_gpus_keeps_equal_weights(tmp_path):
    run_tiny(tmp_path / "ddp", "--parallel", "ddp", "epochs=1", "precision=bf16",
             "compile.enabled=true", nproc=2, cuda_visible_devices="0,1")
    summary = read_summary(tmp_path / "ddp")
    assert len(set(summary["weights_sha256_per_rank"])) == 1
    assert summary["compile_s"] > 0


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_dp_over_several_gpus_refuses_compile_in_one_line(tmp_path):
    proc = run_tiny(tmp_path / "dp", "--parallel", "dp", "compile.enabled=true", nproc=1,
                    cuda_visible_devices="0,1", check=False)
    assert proc.returncode == 2
    assert "compile.enabled=true does not work with parallel mode 'dp'" in proc.stderr


def test_bench_compile_runs_on_cuda_with_bf16(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python([str(REPO / "tools" / "bench_compile.py"), "--device", "cuda",
                       "--precision", "bf16", "--size", "2560", "--batch", "64", "--reps",
                       "1", "--json", str(out)], cwd=REPO,
                      env=tiny_env(cuda_visible_devices="0"), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled / eager: engine" in proc.stdout
