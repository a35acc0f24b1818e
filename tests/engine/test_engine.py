"""engine/engine.py: what every worker sets up before training."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli
from tests.recipes.tiny_parallel_runs import probes, run_tiny


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_switches_torch_to_deterministic_kernels(tmp_path, deterministic):
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "single", "epochs=1", f"deterministic={deterministic}",
             nproc=1)
    (probe,) = probes(out)
    assert probe["deterministic_algorithms"] is deterministic


def test_a_failed_run_writes_summary_json_with_status_failed(tmp_path):
    """Rank 0 raises mid-epoch: it still writes summary.json, without any collective
    on the way (rank 1 is left waiting in one and is stopped by the launcher)."""
    env = engine_env(ENGINE_FAULT_ACTION="raise", ENGINE_FAULT_STEP="3",
                     ENGINE_FAULT_RANK="0")
    proc = run_cli(str(REPO / "tests" / "recipes" / "tiny_resume.py"), f"out_dir={tmp_path}",
                   "--nproc", "2", "-p", "tests.fault_plugin", env=env, timeout=200)
    assert proc.returncode == 1, proc.stderr  # a run failure
    # The error names the plugin and hook it came from.
    assert ("[rank 0] error: plugin 'tests.fault_plugin' (hook engine_train_step_end): "
            "RuntimeError: injected failure on rank 0") in proc.stderr
    summary = read_summary(tmp_path)
    assert (summary["status"], summary["global_step"], summary["world_size"]) == (
        "failed", 3, 2)
    assert summary["error"] == "RuntimeError: injected failure on rank 0"
    assert summary["weights_sha256"] is None  # a collective: not on the failure path


def test_rerunning_a_finished_run_says_it_is_complete_and_what_to_do(tmp_path):
    args = (str(REPO / "tests" / "recipes" / "tiny_resume.py"), f"out_dir={tmp_path}",
            "--nproc", "1")
    run_cli(*args, "epochs=2", check=True)
    for asked in (1, 2):
        again = run_cli(*args, f"epochs={asked}", check=True)
        assert (f"already complete: {tmp_path} holds a finished run of 2 epochs (asked for "
                f"{asked}), nothing to train; to train on, ask for more (epochs=3 or "
                "more); to start over, use --no-resume --overwrite or another out_dir") in again.stdout
    # Another lr into the finished run: refused once, by engine-run, before any worker.
    changed = run_cli(*args, "epochs=2", "lr=0.01")
    assert changed.returncode == 2, changed.stderr
    assert changed.stderr.splitlines() == [
        f"engine-run: error: {tmp_path} holds a completed run trained with lr "
        "0.05 (asked: 0.01): nothing would be trained with this config; to keep both runs, "
        f"give each its folder (out_dir={tmp_path / '{version}'}), or use "
        "--no-resume --overwrite to replace it"], changed.stderr
    assert "[rank" not in changed.stdout
    more = run_cli(*args, "epochs=3", check=True)
    assert "already complete" not in more.stdout and read_summary(tmp_path)[
        "epochs_completed"] == 3


def test_a_model_without_parameters_is_named_as_the_problem(tmp_path):
    recipe = tmp_path / "no_parameters.py"
    recipe.write_text("import torch\n"
                      "from tests.recipes.tiny_regression import *  # noqa\n"
                      "from tests.recipes.tiny_regression import Config  # noqa\n\n"
                      "def build_model(cfg):\n    return torch.nn.Identity()\n\n"
                      "def build_optimizer(cfg, model):\n    return None\n")
    proc = run_cli(str(recipe), "epochs=1", f"out_dir={tmp_path / 'run'}", "--nproc", "2")
    assert proc.returncode == 2
    assert ("error: the recipe's build_model returned a model without parameters "
            "(Identity): there is nothing to train") in proc.stderr, proc.stderr


def test_build_scheduler_gets_the_run_length_when_it_takes_ctx():
    """``build_scheduler(cfg, optimizer, ctx)`` sees ctx.steps_per_epoch and
    ctx.total_steps; the two-argument form of older recipes still works."""
    import types

    import engine
    from engine.worker_setup import build_scheduler
    from engine.recipe import recipe_from_object

    seen = []
    recipe = types.SimpleNamespace(
        Config=engine.TrainConfig, build_model=None, build_datasets=None, build_optimizer=None,
        train_step=lambda batch, ctx: None,
        build_scheduler=lambda cfg, optimizer, ctx: seen.append(ctx.total_steps) or "new")
    ctx = types.SimpleNamespace(steps_per_epoch=6, total_steps=12)
    assert build_scheduler(recipe_from_object(recipe), None, None, ctx) == "new"
    assert seen == [12]
    recipe.build_scheduler = lambda cfg, optimizer: "old"
    assert build_scheduler(recipe_from_object(recipe), None, None, ctx) == "old"
    del recipe.build_scheduler
    assert build_scheduler(recipe_from_object(recipe), None, None, ctx) is None
