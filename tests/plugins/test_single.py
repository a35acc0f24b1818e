"""plugins/single.py: one process, one device; the engine's loop equals a plain one."""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from engine.checkpoint import model_digest
from engine.recipe import load_recipe
from tests.conftest import engine_env, run_cli
from tests.recipes.tiny_parallel_runs import TINY_RECIPE, probes, run_tiny, summary, weights


def hand_written_weights(epochs: int, batch_size: int, seed: int = 0) -> dict:
    """The tiny recipe trained by a plain PyTorch loop, the way a user writes it."""
    recipe = load_recipe(TINY_RECIPE).module
    cfg = recipe.Config()
    train_set, _ = recipe.build_datasets(cfg, None)
    torch.manual_seed(seed)
    model = recipe.build_model(cfg)
    optimizer = recipe.build_optimizer(cfg, model)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    return model.state_dict()


def test_single_trains_exactly_like_a_hand_written_loop(tmp_path):
    out = tmp_path / "single"
    run_tiny(out, "--parallel", "single", "epochs=2", "batch_size=8", nproc=1)
    (probe,) = probes(out)
    assert probe["wrappers"] == ["TinyNet"]  # nothing wraps the model
    assert probe["devices"] == ["cpu"]
    assert summary(out)["parallel"] == "single"
    expected = model_digest(hand_written_weights(epochs=2, batch_size=8))
    assert model_digest(weights(out)) == expected
    assert summary(out)["weights_sha256"] == expected


def test_auto_picks_single_for_one_process_without_gpus(tmp_path):
    proc = run_cli(TINY_RECIPE, "--nproc", "1", "--dry-run", env=engine_env(), check=True)
    assert "  parallel      single" in proc.stdout
    assert "  backend       none (one process)" in proc.stdout


def test_single_refuses_two_processes():
    proc = run_cli(TINY_RECIPE, "--parallel", "single", "--nproc", "2", "--dry-run",
                   env=engine_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "engine-run: error: parallel mode 'single' runs in one process, but the world "
        "has 2; use --parallel ddp, or --nproc 1")
