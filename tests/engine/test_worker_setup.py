"""engine/worker_setup.py: the set-up steps every door shares.

One engine.fit run and one custom loop (engine.launch), each of one process in this
process, of the same recipe (tests/recipes/tiny_parallel_recipe.py) with activation
checkpointing and torch.compile on: both doors take the same steps, so both models
are checkpointed and compiled, and train to bit-identical weights. The compile backend
is "eager" (dynamo traces the model, no code generation): seconds, not minutes.
"""

from __future__ import annotations

import types

import pytest
import torch

import engine
from engine.testing import fit
from engine.checkpoint import model_digest, plain_keys
from engine.config import CompileConfig
from engine.errors import ConfigError
from engine.worker_setup import RunParts, build_optimizer, schedule_length
from tests.recipes import tiny_parallel_recipe as tiny

#: The same settings through both doors: Linear blocks recompute their activations,
#: the whole model compiled.
SETTINGS = {"activation_checkpointing": "Linear", "epochs": 2, "seed": 3}
COMPILE = {"enabled": True, "backend": "eager"}


def model_report(module) -> dict:
    """What the set-up did to the model: blocks checkpointed, compiled, the weights."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper)

    return {"checkpointed": sum(isinstance(m, CheckpointWrapper) for m in module.modules()),
            "compiled": getattr(module, "_compiled_call_impl", None) is not None,
            "weights": model_digest(plain_keys(module.state_dict()))}


def recipe_loop(ctx):
    """The recipe trained by a custom loop, as the Trainer trains it: the model built
    right after seeding, one optimizer step per batch."""
    cfg = ctx.cfg
    torch.manual_seed(cfg.seed)
    model, optimizer = ctx.wrap(tiny.build_model(cfg),
                                lambda module: tiny.build_optimizer(cfg, module))
    train_set, _ = tiny.build_datasets(cfg, ctx)
    loader = ctx.loader(train_set, batch_size=cfg.batch_size)
    for _ in ctx.epochs(cfg.epochs):
        for inputs, targets in loader:
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model_report(ctx.module)


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """The engine.fit run and the custom loop, with what each did to its model."""
    root = tmp_path_factory.mktemp("doors")
    seen = {}
    recipe = types.SimpleNamespace(
        **{name: getattr(tiny, name) for name in (
            "Config", "build_model", "build_datasets", "build_optimizer", "train_step",
            "eval_step")},
        on_train_end=lambda cfg, ctx: seen.update(model_report(ctx.module)))
    summary = fit(recipe, nproc=1, out_dir=str(root / "fit"), **SETTINGS,
                  **{f"compile.{key}": value for key, value in COMPILE.items()})
    assert summary["status"] == "completed"
    loop = engine.launch(recipe_loop, nproc=1, config=tiny.Config(
        out_dir=str(root / "loop"), compile=CompileConfig(**COMPILE), **SETTINGS))
    return {"fit": seen, "loop": loop}


def test_a_custom_loop_gets_activation_checkpointing_and_compile_as_engine_run_does(doors):
    expected = {"checkpointed": 2, "compiled": True}  # fc1 and fc2
    for door in ("fit", "loop"):
        assert {key: doors[door][key] for key in expected} == expected, door


def test_both_doors_train_the_recipe_to_bit_identical_weights(doors):
    assert doors["loop"]["weights"] == doors["fit"]["weights"]


def test_the_schedule_length_counts_optimizer_steps():
    cfg = tiny.Config(epochs=3, grad_accum_steps=2)
    from engine.data import MapLoader

    batches = MapLoader(range(5))  # 5 micro-batches an epoch: 3 optimizer steps
    assert schedule_length(batches, cfg) == (3, 9)
    cfg.max_steps = 4
    assert schedule_length(batches, cfg) == (3, 4)
    stream = types.SimpleNamespace(sized=False)  # a stream's epochs have no known length
    assert schedule_length(stream, cfg) == (None, 4)


def test_an_optimizer_of_parameters_the_model_lost_is_refused():
    model, stranger = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    parts = RunParts(model=model)
    assert build_optimizer(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                           parts.model).param_groups[0]["lr"] == 0.1
    with pytest.raises(ConfigError, match="holds parameters that the model no longer has"):
        build_optimizer(torch.optim.SGD(stranger.parameters(), lr=0.1), model)
    # A recipe's build_optimizer got the wrapped model's module: nothing was replaced,
    # and ctx.wrap is not what it can change.
    with pytest.raises(ConfigError) as err:
        build_optimizer(lambda m: torch.optim.SGD([*m.parameters(), *stranger.parameters()],
                                                  lr=0.1), model)
    assert str(err.value) == (
        "build_optimizer returned an optimizer holding parameters that are not the "
        "model's (the model it was given): a parallel mode would not synchronise them; "
        "build it from that model's parameters only")
