"""plugins/ema.py: the average itself, its options, and evaluation on it in real runs.
(Its exact resume after a kill is in tests/engine/test_stateful.py, with a recipe part.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

import engine
from engine.plugins.ema import ExponentialMovingAverage
from tests import conftest
from tests.conftest import REPO, read_summary, run_cli

REGRESSION = str(REPO / "tests" / "recipes" / "tiny_regression.py")


def trained(steps: int, every_steps: int = 1, decay: float = 0.5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = ExponentialMovingAverage(model, optimizer, decay, every_steps)
    history = []
    for _ in range(steps):
        model(torch.randn(4, 3)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append({k: v.clone() for k, v in model.state_dict().items()})
    return model, average, history


def test_the_average_follows_the_ema_formula_every_n_steps():
    model, average, history = trained(steps=6, every_steps=2, decay=0.5)
    updates = history[1::2]  # after steps 2, 4, 6
    expected = updates[0]["0.weight"]  # the first update copies the weights
    for later in updates[1:]:
        expected = 0.5 * expected + 0.5 * later["0.weight"]
    assert torch.allclose(average.weights()["0.weight"], expected)
    assert average.state_dict()["steps"] == 6
    # Buffers are averaged too (BatchNorm's running mean).
    assert not torch.equal(average.weights()["1.running_mean"],
                           model.state_dict()["1.running_mean"])


def test_swapping_the_average_in_and_out_restores_the_trained_weights_bit_for_bit():
    model, average, _ = trained(steps=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    average.swap_in()
    for name, tensor in average.weights().items():
        assert torch.equal(model.state_dict()[name], tensor)
    average.swap_out()
    for name, tensor in before.items():
        assert torch.equal(model.state_dict()[name], tensor)


def test_a_saved_average_loads_into_a_fresh_one():
    _, average, _ = trained(steps=4)
    _, fresh, _ = trained(steps=1)
    fresh.load_state_dict(average.state_dict())
    assert fresh.steps == 4
    for name, tensor in average.weights().items():
        assert torch.equal(fresh.weights()[name], tensor)


@pytest.mark.parametrize("override, message", [
    ("ema.decay=1.5", "config key 'ema.decay': '1.5' is not allowed: the decay is at least 0 "
     "and below 1 (e.g. 0.999)"),
    ("ema.every_steps=0", "config key 'ema.every_steps': '0' is not allowed: update every 1 "
     "or more optimizer steps"),
])
def test_bad_ema_options_are_one_line(tmp_path, override, message):
    proc = run_cli(REGRESSION, "ema.enabled=true", override, f"out_dir={tmp_path}",
                   "--nproc", "1", "--dry-run")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# This module is also the probe plugin of the next test (-p tests.plugins.test_ema): it
# records what validation saw, into the file ENGINE_TEST_VALIDATION names.
@engine.hookimpl(trylast=True)  # after ema's own: it sees what validation sees
def engine_validation_start(engine, epoch):
    model = engine.module
    first = next(iter(model.state_dict().values()))
    _record({"epoch": epoch, "event": "start", "weight": first.flatten()[0].item()})


@engine.hookimpl
def engine_validation_end(engine, epoch, metrics):
    _record({"epoch": epoch, "event": "end", "val_loss": metrics["val/loss"]})


def _record(row: dict) -> None:
    path = os.environ.get("ENGINE_TEST_VALIDATION")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def test_evaluate_validates_the_average_and_leaves_training_untouched(tmp_path):
    runs = {}
    for evaluate in ("false", "true"):
        out, log = tmp_path / evaluate, tmp_path / f"{evaluate}.jsonl"
        run_cli(REGRESSION, "epochs=2", "ema.enabled=true", "ema.decay=0.9",
                f"ema.evaluate={evaluate}", f"out_dir={out}", "--nproc", "1",
                "-p", "tests.plugins.test_ema", check=True,
                env=conftest.engine_env(ENGINE_TEST_VALIDATION=str(log)))
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        runs[evaluate] = (read_summary(out), rows)
    (plain, plain_rows), (averaged, averaged_rows) = runs["false"], runs["true"]
    # The hooks fire around each epoch's validation, start then end.
    assert [(r["epoch"], r["event"]) for r in averaged_rows] == [
        (0, "start"), (0, "end"), (1, "start"), (1, "end")]
    # The average was in place while validating, and only then: training is unchanged.
    assert plain["weights_sha256"] == averaged["weights_sha256"]
    assert averaged["val_loss"] != plain["val_loss"]
    # Validation saw the averaged weights.
    assert averaged_rows[0]["weight"] != plain_rows[0]["weight"]
