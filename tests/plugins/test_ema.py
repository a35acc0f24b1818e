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


# This module is also the probe plugin of the runs below (-p tests.plugins.test_ema): rank
# 0 records what validation saw, into the file ENGINE_TEST_VALIDATION names.
@engine.hookimpl(trylast=True)  # after ema's own: it sees what validation sees
def engine_validation_start(engine, epoch):
    first = next(iter(engine.module.state_dict().values()))
    if hasattr(first, "to_local"):  # fsdp: rank 0's shard starts with the first element
        first = first.to_local()
    _record(engine, {"epoch": epoch, "event": "start", "weight": first.flatten()[0].item()})


@engine.hookimpl
def engine_validation_end(engine, epoch, metrics):
    _record(engine, {"epoch": epoch, "event": "end", "val_loss": metrics["val/loss"]})


def _record(engine, row: dict) -> None:
    path = os.environ.get("ENGINE_TEST_VALIDATION")
    if path and engine.world.rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


#: tiny_regression on 2 processes: 3 epochs of 8 steps, validated after each.
RUN = (REGRESSION, "--nproc", "2", "ema.enabled=true", "ema.decay=0.9",
       "-p", "tests.plugins.test_ema")


def validated(out, *args: str, check: bool = True, env=None):
    """``engine-run RUN ARGS`` recording what validation saw in ``out``.jsonl."""
    log = out.parent / f"{out.name}.jsonl"
    proc = run_cli(*RUN, *args, f"out_dir={out}", check=check,
                   env=(env or conftest.engine_env()) | {"ENGINE_TEST_VALIDATION": str(log)})
    return proc, log


def rows(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """ddp on 2 processes, the average evaluated or not: the reference of every test
    below."""
    runs = {}
    for evaluate in ("false", "true"):
        out = tmp_path_factory.mktemp("ema") / f"ddp-{evaluate}"
        _, log = validated(out, "--parallel", "ddp", f"ema.evaluate={evaluate}")
        runs[evaluate] = (out, rows(log))
    return runs


def test_evaluate_validates_the_average_and_leaves_training_untouched(ddp):
    (plain, plain_rows), (averaged, averaged_rows) = ddp["false"], ddp["true"]
    # The hooks fire around each epoch's validation, start then end.
    assert [(r["epoch"], r["event"]) for r in averaged_rows] == [
        (0, "start"), (0, "end"), (1, "start"), (1, "end"), (2, "start"), (2, "end")]
    # The average was in place while validating, and only then: training is unchanged.
    assert read_summary(plain)["weights_sha256"] == read_summary(averaged)["weights_sha256"]
    assert read_summary(averaged)["val_loss"] != read_summary(plain)["val_loss"]
    # Validation saw the averaged weights.
    assert averaged_rows[0]["weight"] != plain_rows[0]["weight"]


# ------------------------------------------------ fsdp: the average kept as shards

FSDP = ("--parallel", "fsdp", "ema.evaluate=true", "checkpoint.every_steps=4")


def exported(out, part: str) -> dict:
    """The ``part`` weights (model or ema) of the run's latest snapshot, whole, through
    the installed export command (``engine-run export RUN OUT --part PART``)."""
    from engine.commands import export

    path = out.parent / f"{out.name}-{part}.pt"
    assert export.main([str(out), str(path), "--part", part]) == 0
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module", params=["dcp", "torch-file"])
def fsdp_killed(request, tmp_path_factory):
    """fsdp on 2 processes, rank 1 SIGKILLed after step 10 (in epoch 2; the last
    snapshot is step 8's), then resumed: each checkpointer's form of the average (dcp:
    each rank's shards; torch-file: the whole average, gathered on rank 0)."""
    tmp = tmp_path_factory.mktemp(f"fsdp-{request.param}")
    out = tmp / "run"
    fault = conftest.engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP="10",
                                ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp / "once"))
    args = (*FSDP, f"checkpointer={request.param}", "-p", "tests.fault_plugin")
    killed, log = validated(out, *args, check=False, env=fault)
    assert killed.returncode != 0 and (tmp / "once").exists(), killed.stderr
    resumed, _ = validated(out, *args, env=fault)
    assert "resuming from" in resumed.stdout
    return out, rows(log)


def test_fsdp_keeps_the_average_as_shards_and_resumes_it_bit_identically_after_a_kill(
        fsdp_killed, ddp):
    """Killed and resumed under fsdp, the run ends with the weights and the average of
    the uninterrupted ddp run, bit for bit (the same samples per rank, and the average
    computed element for element on the shards), and validated on the same averages."""
    out, validation = fsdp_killed
    reference, reference_rows = ddp["true"]
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["global_step"] == 24
    assert summary["weights_sha256"] == read_summary(reference)["weights_sha256"]
    average, expected = exported(out, "ema"), exported(reference, "ema")
    assert average.keys() == expected.keys() == {"0.weight", "0.bias", "3.weight", "3.bias"}
    for name in expected:
        assert torch.equal(average[name], expected[name]), name
    # Epoch 1 validated before the kill, epochs 2 and 3 after the resume, on the averages.
    assert [r for r in validation if r["event"] == "end"] == [
        r for r in reference_rows if r["event"] == "end"]
    assert summary["val_loss"] == read_summary(reference)["val_loss"]


def test_fsdp_validates_on_the_average_and_exports_it_whole(fsdp_killed, ddp):
    """val/loss is the loss of the exported average on the validation set, not the
    trained weights' (at the end, the average is the one the last validation used)."""
    from tests.recipes import tiny_regression as recipe

    out, validation = fsdp_killed
    inputs, targets = make_val_set(recipe)

    def val_loss(weights) -> float:
        model = recipe.build_model(recipe.Config())
        model.load_state_dict(weights)  # strict: whole tensors, the model's keys
        model.eval()
        with torch.no_grad():
            return ((model(inputs) - targets).pow(2).sum() / len(targets)).item()

    averaged, trained = val_loss(exported(out, "ema")), val_loss(exported(out, "model"))
    assert read_summary(out)["val_loss"] == pytest.approx(averaged, rel=1e-5)
    assert abs(averaged - trained) > 1e-3
    # While validating, the model held the average's first weight, not the trained one.
    assert validation[-2]["weight"] == exported(out, "ema")["0.weight"][0, 0].item()
    assert validation[-2]["weight"] != exported(out, "model")["0.weight"][0, 0].item()
    # engine.load_model builds the recipe's model with the average in it.
    import engine

    loaded = engine.load_model(out, part="ema").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in exported(out, "ema").items())


def make_val_set(recipe):
    dataset = recipe.make_data(recipe.Config().val_size, seed=2)
    return dataset.tensors


def test_exporting_a_part_the_snapshot_lacks_is_one_line(tmp_path):
    from engine.errors import CheckpointError
    from engine.model_io import part_weights, read

    snapshot = tmp_path / "snapshot.pt"
    torch.save({"model": {"weight": torch.zeros(2)}, "step": 3}, snapshot)
    with pytest.raises(CheckpointError) as info:
        part_weights(read(snapshot), "ema")
    assert str(info.value) == (f"{snapshot} holds no 'ema' part (a run with ema.enabled=true "
                               "writes one); part 'model' is the model")
