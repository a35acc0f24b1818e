"""The parallel modes on real GPUs: NCCL, set_device, DP, DDP one process per GPU,
ddp-multigpu, AMP. Every test skips cleanly on a machine without CUDA; the ones that
need several GPUs say how many.

Run on a GPU machine with: python -m pytest tests/gpu -m cuda
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.checkpoint import model_digest
from tests.recipes.tiny_parallel_runs import probes, run_tiny, summary, weights

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]

#: Data-parallel modes against single on the same global batch, on GPUs: the sums
#: run in another order (and cuBLAS may pick other kernels for other batch shapes).
GPU_ATOL = 1e-4


def needs_gpus(n: int):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, {GPUS} visible")


def close(a: dict, b: dict, atol: float = GPU_ATOL) -> bool:
    return all((a[k].float() - b[k].float()).abs().max().item() <= atol for k in a)


COMMON = ("epochs=2", "batch_size=16", "train_size=64")


@pytest.fixture(scope="module")
def single_weights(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_tiny(out, "--parallel", "single", *COMMON, nproc=1, cuda_visible_devices=None)
    (probe,) = probes(out)
    assert probe["devices"] == ["cuda:0"] and probe["parameters_on"] == "cuda:0"
    return weights(out)


def test_single_trains_on_cuda0(single_weights):
    # The fixture checked the device; the weights it trained are finite.
    assert all(torch.isfinite(t.float()).all() for t in single_weights.values())


@needs_gpus(2)
def test_ddp_one_process_per_gpu_with_nccl(tmp_path, single_weights):
    out = tmp_path / "ddp"
    run_tiny(out, "--parallel", "ddp", *COMMON, nproc=2, cuda_visible_devices=None)
    first, second = probes(out)
    assert (first["backend"], second["backend"]) == ("nccl", "nccl")
    # set_device before the group: each rank computes on its own GPU.
    assert (first["parameters_on"], second["parameters_on"]) == ("cuda:0", "cuda:1")
    assert first["rounds"] == first["steps"] == 8
    result = summary(out)
    assert result["weights_sha256_per_rank"] == [result["weights_sha256"]] * 2
    assert close(weights(out), single_weights)


@needs_gpus(2)
def test_dp_uses_every_visible_gpu(tmp_path, single_weights):
    out = tmp_path / "dp"
    proc = run_tiny(out, "--parallel", "dp", *COMMON, nproc=1, cuda_visible_devices=None)
    (probe,) = probes(out)
    assert probe["wrappers"] == ["DataParallel", "TinyNet"]
    assert probe["devices"] == [f"cuda:{i}" for i in range(GPUS)]
    assert "stay idle" not in proc.stderr
    assert close(weights(out), single_weights)


@needs_gpus(2)
def test_ddp_multigpu_one_process_drives_every_gpu(tmp_path, single_weights):
    out = tmp_path / "multi1"
    run_tiny(out, "--parallel", "ddp-multigpu", *COMMON, nproc=1,
             cuda_visible_devices=None)
    (probe,) = probes(out)
    assert probe["devices"] == [f"cuda:{i}" for i in range(GPUS)]  # k = visible GPUs
    assert probe["wrappers"] == ["DataParallel", "TinyNet"]
    assert close(weights(out), single_weights)


@needs_gpus(2)
def test_ddp_multigpu_two_processes_share_the_gpus(tmp_path, single_weights):
    k = GPUS // 2
    out = tmp_path / "multi2"
    run_tiny(out, "--parallel", "ddp-multigpu", *COMMON, nproc=2,
             cuda_visible_devices=None)
    first, second = probes(out)
    assert first["devices"] == [f"cuda:{i}" for i in range(k)]
    assert second["devices"] == [f"cuda:{i}" for i in range(k, 2 * k)]
    assert first["wrappers"] == ["DistributedDataParallel", "DataParallel", "TinyNet"]
    assert first["backend"] == "nccl"
    assert first["rounds"] == first["steps"] == 8
    assert close(weights(out), single_weights)


@needs_gpus(2)
def test_single_warns_about_idle_gpus(tmp_path):
    proc = run_tiny(tmp_path / "run", "--parallel", "single", "epochs=1", nproc=1,
                    cuda_visible_devices=None)
    idle = ", ".join(f"cuda:{i}" for i in range(1, GPUS))
    assert proc.stderr.count(f"but parallel mode 'single' uses only 1: {idle} stay "
                             "idle") == 1


def test_cuda_visible_devices_is_respected(tmp_path):
    last = str(GPUS - 1)
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "single", "epochs=1", nproc=1, cuda_visible_devices=last)
    assert probes(out)[0]["devices"] == ["cuda:0"]  # the only visible one
    # Two DDP processes but one visible GPU: a clear error before anything starts.
    proc = run_tiny(tmp_path / "two", "--parallel", "ddp", "--dry-run", nproc=2,
                    check=False, cuda_visible_devices=last)
    assert proc.returncode == 2
    assert (f"parallel mode 'ddp' needs 1 GPU(s) per process x 2 processes on this node "
            f"= 2 GPUs, but 1 are visible (CUDA_VISIBLE_DEVICES={last})") in proc.stderr


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision(tmp_path, precision):
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    out = tmp_path / precision
    run_tiny(out, "--parallel", "single", *COMMON, f"precision={precision}", nproc=1,
             cuda_visible_devices=None)
    result = summary(out)
    assert result["status"] == "completed"
    assert math.isfinite(result["train_loss"])
    assert all(t.dtype == torch.float32 for t in weights(out).values()
               if t.is_floating_point())  # autocast keeps float32 master weights


@needs_gpus(2)
def test_sync_batchnorm_converts_and_trains(tmp_path):
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "ddp", *COMMON, "model.batchnorm=true",
             "ddp.sync_batchnorm=true", nproc=2, cuda_visible_devices=None)
    first, second = probes(out)
    assert first["sync_batchnorm_layers"] == second["sync_batchnorm_layers"] == 1
    # Global batch statistics: every rank updated its running statistics alike.
    assert model_digest(weights(out, 0)) == model_digest(weights(out, 1))
