"""fsdp on CUDA (NCCL, one process per GPU; one process shards over a group of its
own): bf16 mixed precision, the weights it trains, a dcp and a dcp-async snapshot
resumed, tools/bench_fsdp.py --device cuda. Skips without CUDA.

Run on a GPU machine with: python -m pytest tests/gpu/test_cuda_fsdp.py -m cuda -rs
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.testing import run_python
from tests.conftest import REPO, engine_env, read_summary
from tests.recipes.tiny_parallel_runs import probes, run_tiny

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]

COMMON = ("--parallel", "fsdp", "epochs=2", "batch_size=16", "train_size=64")


def test_fsdp_bf16_on_one_gpu_trains_close_to_fp32_and_resumes_from_dcp(tmp_path):
    run_tiny(tmp_path / "fp32", *COMMON, nproc=1, cuda_visible_devices="0")
    proc = run_tiny(tmp_path / "bf16", *COMMON, "precision=bf16", "checkpointer=dcp",
                    nproc=1, cuda_visible_devices="0")
    (probe,) = probes(tmp_path / "bf16")
    assert probe["parameters_on"] == "cuda:0" and probe["backend"] == "nccl", proc.stderr
    assert probe["wrappers"][0].startswith("FSDP")  # fully_shard's class swap
    summary = read_summary(tmp_path / "bf16")
    assert summary["status"] == "completed"
    fp32, bf16 = read_summary(tmp_path / "fp32"), summary
    # bf16 compute (8 bits of mantissa) against fp32: close, not equal.
    assert bf16["train_loss"] == pytest.approx(fp32["train_loss"], rel=0.05)
    # One more epoch from the dcp snapshot, on the same GPU (4 steps an epoch).
    resumed = run_tiny(tmp_path / "bf16", "--parallel", "fsdp", "epochs=3", "batch_size=16",
                       "train_size=64", "precision=bf16", "checkpointer=dcp", nproc=1,
                       cuda_visible_devices="0")
    assert "resuming from" in resumed.stdout
    assert read_summary(tmp_path / "bf16")["global_step"] == 12


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_fsdp_on_two_gpus_matches_ddp(tmp_path):
    run_tiny(tmp_path / "ddp", "--parallel", "ddp", *COMMON[2:], "deterministic=true",
             nproc=2, cuda_visible_devices="0,1")
    run_tiny(tmp_path / "fsdp", *COMMON, "deterministic=true", nproc=2,
             cuda_visible_devices="0,1")
    torch.testing.assert_close(read_summary(tmp_path / "fsdp")["train_loss"],
                               read_summary(tmp_path / "ddp")["train_loss"])
    assert [p["backend"] for p in probes(tmp_path / "fsdp")] == ["nccl", "nccl"]


def test_bench_fsdp_on_one_gpu_reports_samples_per_second_of_both_sides(tmp_path):
    """tools/bench_fsdp.py --device cuda, smoke-sized: the engine's fsdp and the
    hand-written FSDP2 loop, both bf16 (MixedPrecisionPolicy), on one GPU over NCCL."""
    out = tmp_path / "bench.json"
    proc = run_python(
        [str(REPO / "tools" / "bench_fsdp.py"), "--device", "cuda", "--reps", "1",
         "--size", "2560", "--batch", "128", "--json", str(out)],
        cwd=REPO, env={**engine_env(), "CUDA_VISIBLE_DEVICES": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["samples_per_s"]["hand"] > 0 and result["samples_per_s"]["engine"] > 0
    assert result["gpu"] == torch.cuda.get_device_name(0)
    assert "precision bf16" in proc.stdout and "samples/s: hand-written FSDP2" in proc.stdout


def test_fsdp_dcp_async_on_one_gpu_resumes(tmp_path):
    """dcp-async with NCCL training: DCP stages the GPU shards to the host and writes
    them over its gloo group (async_save refuses a group without a CPU backend)."""
    args = ("--parallel", "fsdp", "batch_size=16", "train_size=64", "precision=bf16",
            "checkpointer=dcp-async", "checkpoint.every_steps=2")
    run_tiny(tmp_path, *args, "epochs=2", nproc=1, cuda_visible_devices="0")
    assert read_summary(tmp_path)["status"] == "completed"
    assert not list((tmp_path / "checkpoints").glob(".staging-*"))
    resumed = run_tiny(tmp_path, *args, "epochs=3", nproc=1, cuda_visible_devices="0")
    assert "resuming from" in resumed.stdout
    assert read_summary(tmp_path)["global_step"] == 12
