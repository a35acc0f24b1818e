"""plugins/dp.py: nn.DataParallel over the visible GPUs; on the CPU it is ``single``
and says so once. (With GPUs: tests/gpu/test_cuda_parallel.py.)"""

from __future__ import annotations

from engine.checkpoint import model_digest
from tests.conftest import engine_env, run_cli
from tests.recipes.tiny_parallel_runs import TINY_RECIPE, probes, run_tiny, summary, weights

NO_GPU = "warning: parallel mode 'dp' found no GPU: running as 'single' on the CPU"


def test_dp_without_gpus_runs_as_single_and_says_so_once(tmp_path):
    args = ("epochs=2", "batch_size=8", "train_size=32")
    proc = run_tiny(tmp_path / "dp", "--parallel", "dp", *args, nproc=1)
    run_tiny(tmp_path / "single", "--parallel", "single", *args, nproc=1)
    assert proc.stderr.count(NO_GPU) == 1
    (probe,) = probes(tmp_path / "dp")
    assert probe["wrappers"] == ["TinyNet"] and probe["devices"] == ["cpu"]
    assert summary(tmp_path / "dp")["parallel"] == "dp"
    assert model_digest(weights(tmp_path / "dp")) == model_digest(
        weights(tmp_path / "single"))


def test_dp_refuses_several_processes():
    proc = run_cli(TINY_RECIPE, "--parallel", "dp", "--nproc", "2", "--dry-run",
                   env=engine_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "engine-run: error: parallel mode 'dp' runs in one process, but the world has 2; "
        "use --parallel ddp, or --nproc 1")


def test_dp_plan_on_a_cpu_machine():
    proc = run_cli(TINY_RECIPE, "--parallel", "dp", "--nproc", "1", "--dry-run",
                   env=engine_env(), check=True)
    assert "  parallel      dp" in proc.stdout
    world = proc.stdout.split("world:\n", 1)[1].splitlines()
    assert world[1].split()[4] == "cpu"
