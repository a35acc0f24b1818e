"""plugins/ddp_multigpu.py on the CPU: k = 1 GPU-less "device" per process, so the
DataParallel layer is a pass-through, but the nesting, unwrapping, accumulation and
the cross-process DDP reduction are real. (k > 1: tests/gpu/test_cuda_parallel.py.)"""

from __future__ import annotations

from engine.checkpoint import model_digest
from engine.config import TrainConfig
from engine.world import World
from tests.conftest import engine_env, run_cli
from tests.recipes.tiny_parallel_runs import TINY_RECIPE, probes, run_tiny, summary, weights


def test_ddp_multigpu_reduces_across_processes_like_ddp(tmp_path):
    args = ("epochs=2", "batch_size=8", "train_size=37", "grad_accum_steps=2")
    run_tiny(tmp_path / "multi", "--parallel", "ddp-multigpu", *args)
    run_tiny(tmp_path / "ddp", "--parallel", "ddp", *args)
    for probe in probes(tmp_path / "multi"):
        assert probe["wrappers"] == ["DistributedDataParallel", "DataParallel", "TinyNet"]
        assert probe["devices"] == ["cpu"]
        # 10 optimizer steps, each with exactly one gradient all-reduce.
        assert (probe["steps"], probe["rounds"], probe["buckets"]) == (10, 10, 10)
    result = summary(tmp_path / "multi")
    assert result["parallel"] == "ddp-multigpu"
    assert result["weights_sha256_per_rank"] == [result["weights_sha256"]] * 2
    # The unwrapped model (no module.module. prefix) equals ddp's, bit for bit.
    multi = weights(tmp_path / "multi")
    assert not any(key.startswith("module.") for key in multi)
    assert model_digest(multi) == model_digest(weights(tmp_path / "ddp"))


def test_plan_shows_the_mode_and_a_cpu_per_rank():
    proc = run_cli(TINY_RECIPE, "--parallel", "ddp-multigpu", "--nproc", "2",
                   "--dry-run", env=engine_env(), check=True)
    assert "  parallel      ddp-multigpu" in proc.stdout
    assert "  backend       gloo" in proc.stdout
    world = proc.stdout.split("world:\n", 1)[1].splitlines()
    assert [row.split()[4] for row in world[1:3]] == ["cpu", "cpu"]


def test_without_gpus_each_process_has_one_cpu_replica():
    from engine.plugins.ddp_multigpu import MultiGPUDistributedDataParallel

    world = World(rank=1, local_rank=1, world_size=2, local_world_size=2)
    mode = MultiGPUDistributedDataParallel(world, TrainConfig())
    assert mode.gpus_per_process == 1
    assert [str(d) for d in mode.devices] == ["cpu"]
    assert mode.backend == "gloo"
