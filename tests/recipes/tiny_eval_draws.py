"""tests/recipes/tiny_resume.py, with an eval_step that draws from the global RNG (a
random test-time flip, as test-time augmentation does): a validation that did not
leave the training's RNG streams as it found them would change the run's weights."""

from __future__ import annotations

import torch

from engine.classification import eval_step as classify
from tests.recipes.tiny_resume import (Config, build_datasets, build_model,
                                       build_optimizer, build_scheduler, train_step)

__all__ = ["Config", "build_datasets", "build_model", "build_optimizer", "build_scheduler",
           "train_step", "eval_step", "eval_metrics"]


def eval_step(batch, ctx):
    inputs, targets = batch
    if torch.rand(()) < 0.5:
        inputs = inputs.flip(-1)
    return classify((inputs, targets), ctx)


def eval_metrics(sums):
    """The mean loss and accuracy, and how many samples the validation read (a smoke
    run reads only its first batches)."""
    return {"loss": sums["loss"] / sums["count"], "accuracy": sums["accuracy"] / sums["count"],
            "samples": sums["count"]}
