"""The CUDA paths that one GPU proves: the main job on the device, pinned batches where
workers load them, the parallel modes that need no second GPU, AMP, and exact resume
with the CUDA RNG and the GradScaler in the snapshot. Every test skips cleanly on a machine without CUDA.

Run on a GPU machine with: python -m pytest tests/gpu -m cuda -rs
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import QUICK, REPO, engine_env, read_summary, run_cli
from tests.engine.test_snapshot import BASE, RECIPE
from tests.recipes.tiny_parallel_runs import probes, run_tiny, tiny_env, weights

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]

# The CPU exact-resume tests' recipe and settings (tests/engine/test_snapshot.py), with
# deterministic kernels: without them two identical GPU runs differed (H100).
RESUME_BASE = (*BASE, "deterministic=true")
ON_GPU0 = {"CUDA_VISIBLE_DEVICES": "0"}


def test_main_job_trains_on_the_gpus(cifar_recipe, tmp_path):
    out = tmp_path / "cifar"
    # No --nproc, no --parallel: what `engine-run recipes/cifar_ddp.py` picks here.
    run_cli(cifar_recipe, *QUICK, f"out_dir={out}", "-p", "tiny_parallel_probe",
            env=tiny_env(cuda_visible_devices=None), check=True)
    result = read_summary(out)
    assert result["status"] == "completed"
    assert result["world_size"] == GPUS
    assert result["parallel"] == ("ddp" if GPUS > 1 else "single")
    first = probes(out)[0]
    assert first["parameters_on"] == "cuda:0"
    assert first["backend"] == ("nccl" if GPUS > 1 else None)
    # The recipe loads in the training process (num_workers=0): nothing pinned there.
    assert first["train_loader"]["pin_memory"] is False


@pytest.mark.parametrize("workers", [0, 2])
def test_the_train_loader_pins_batches_on_cuda_where_workers_load_them(tmp_path, workers):
    """Pinned by torch's pinning thread where workers load; not on the training thread
    (engine/loader_settings.py's pinned)."""
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "single", "epochs=1", f"num_workers={workers}", nproc=1,
             cuda_visible_devices="0")
    (probe,) = probes(out)
    assert probe["train_loader"] == {"pin_memory": workers > 0, "num_workers": workers}


@pytest.mark.parametrize("mode", ["dp", "ddp", "ddp-multigpu"])
def test_every_mode_on_one_gpu_trains_what_single_trains(tmp_path, mode):
    """With one GPU and one process there is nothing to split or synchronise: each mode
    trains the unwrapped model on cuda:0, the same weights as 'single'."""
    common = ("epochs=2", "batch_size=16", "train_size=64")
    run_tiny(tmp_path / "single", "--parallel", "single", *common, nproc=1,
             cuda_visible_devices="0")
    proc = run_tiny(tmp_path / mode, "--parallel", mode, *common, nproc=1,
                    cuda_visible_devices="0")
    (probe,) = probes(tmp_path / mode)
    assert probe["devices"] == ["cuda:0"] and probe["parameters_on"] == "cuda:0"
    # ddp-multigpu keeps its DataParallel (over one GPU it calls the module directly).
    assert probe["wrappers"] == (["DataParallel", "TinyNet"] if mode == "ddp-multigpu"
                                 else ["TinyNet"])
    if mode != "dp":
        assert "with one process: nothing to synchronise" in proc.stderr
    expected, got = weights(tmp_path / "single"), weights(tmp_path / mode)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory):
    """weights_sha256 of uninterrupted one-GPU runs, by precision; two runs each, so a
    resume test cannot pass or fail because the kernels are not deterministic."""
    digests = {}
    for precision in ("32", "fp16"):
        runs = []
        for i in range(2):
            out = tmp_path_factory.mktemp(f"reference-{precision}-{i}")
            run_cli(RECIPE, *RESUME_BASE, f"precision={precision}",
                    f"out_dir={out}", "--nproc", "1", env=engine_env(**ON_GPU0),
                    check=True)
            runs.append(read_summary(out)["weights_sha256"])
        assert runs[0] == runs[1], f"two identical {precision} runs on the GPU differ"
        digests[precision] = runs[0]
    return digests


@pytest.mark.parametrize("precision, memory", [("32", False), ("fp16", False),
                                               ("fp16", True)])
def test_killed_gpu_run_resumes_to_identical_weights(gpu_reference, tmp_path, precision,
                                                     memory):
    """Dropout draws from the CUDA generator and fp16 steps through a GradScaler whose
    scale moves: both must come back from the snapshot for the weights to match. With
    ``memory``, from the in-memory snapshot of step 9 (copied from the GPU every step;
    the disk's newest is step 8's)."""
    out = tmp_path / "run"
    fault = {**ON_GPU0, "ENGINE_FAULT_ACTION": "kill",
             "ENGINE_FAULT_STEP": "10" if memory else "9",  # mid-epoch 1
             "ENGINE_FAULT_ONCE": str(tmp_path / "fault-done")}
    args = (RECIPE, *RESUME_BASE, f"precision={precision}", f"out_dir={out}",
            "--nproc", "1", "-p", "tests.fault_plugin",
            *(["checkpoint.memory_every_steps=1"] if memory else []))
    killed = run_cli(*args, env=engine_env(**fault))
    assert killed.returncode != 0, killed.stderr
    resumed = run_cli(*args, env=engine_env(**fault), check=True)
    said = "resumed from memory at step 9 " if memory else "resuming from "
    assert said in resumed.stdout, resumed.stdout
    assert read_summary(out)["weights_sha256"] == gpu_reference[precision]


def test_the_language_model_learns_in_bf16_on_one_gpu(tmp_path):
    """recipes/char_lm.py on the device under bf16 autocast: its own steps, the tied
    output layer and the derived metrics; the loss falls below 0.9 of the unigram
    baseline (the CPU test's bar, tests/recipes/test_char_lm.py)."""
    import math
    import re

    from tests.recipes.test_char_lm import RECIPE, SMALL, SMALL_FRACTION, baseline_of

    out = tmp_path / "lm"
    proc = run_cli(RECIPE, *[a for a in SMALL if a not in ("--nproc", "2")], "--nproc", "1",
                   "precision=bf16", f"out_dir={out}", env=engine_env(**ON_GPU0), check=True)
    metrics = read_summary(out)["metrics"]
    assert metrics["val/loss"] <= SMALL_FRACTION * baseline_of(proc.stdout), proc.stdout
    assert metrics["val/perplexity"] == pytest.approx(math.exp(metrics["val/loss"]))
    assert re.search(r"tokens/s \d+", proc.stdout)


def test_a_memory_snapshot_never_waits_for_the_gpu(tmp_path, monkeypatch):
    """docs/architecture.md promises no per-step host-device synchronisation: from the
    second memory snapshot on (the first maps and pins its buffers), each runs under
    torch.cuda.set_sync_debug_mode("warn") and the loop's thread synchronises nowhere in
    it (the loss sum goes into its row on the GPU; the copies off the device are waited
    for by the background thread, whose waits are not counted: the mode is global)."""
    import threading
    import warnings

    from engine import testing
    from engine.memory import tier

    save, devices, syncs = tier.MemoryTier.save, [], []
    loop = threading.current_thread()

    def watched(self, whole):
        devices.append(self.ctx.device.type)
        torch.cuda.set_sync_debug_mode("warn" if len(devices) > 1 else "default")
        try:
            return save(self, whole)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def shown(message, *args, _show=warnings.showwarning, **kwargs):
        if "synchronizing CUDA operation" in str(message):
            if threading.current_thread() is loop:
                syncs.append(str(message))
            return
        _show(message, *args, **kwargs)

    monkeypatch.setattr(tier.MemoryTier, "save", watched)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", shown)
        testing.fit(REPO / "tests" / "recipes" / "tiny_regression.py", nproc=1, epochs=1,
                    out_dir=str(tmp_path / "run"), **{"checkpoint.memory_every_steps": 1,
                                                      "checkpoint.every_steps": 0})
    assert syncs == []
    assert len(devices) >= 3 and set(devices) == {"cuda"}, devices
