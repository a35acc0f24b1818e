"""tiny_regression with a state part of its own (``state_parts``): a curriculum that
counts the samples it has seen and weights the loss by its level. A resume that lost
the count would weight the rest of the run differently, and the weights would differ.
"""

from __future__ import annotations

from torch.nn import functional as F

from tests.recipes.tiny_regression import (Config, build_datasets, build_model,  # noqa: F401
                                           build_optimizer, eval_step)


class Curriculum:
    def __init__(self):
        self.seen = 0  # training samples this rank has seen

    def weight(self) -> float:
        return 1.0 + 0.25 * (self.seen // 40)

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seen = int(state_dict["seen"])


def state_parts(cfg, ctx):
    return {"curriculum": Curriculum()}


def train_step(batch, ctx):
    curriculum = ctx.snapshot_parts["curriculum"]
    inputs, targets = batch
    curriculum.seen += inputs.shape[0]
    return F.mse_loss(ctx.model(inputs), targets) * curriculum.weight()
