"""Opt-in steps for classification with ``(inputs, targets)`` batches: cross-entropy
(or the recipe's ``loss_fn``) and argmax accuracy. A recipe names them::

    from engine.classification import eval_step, train_step

The loop knows no task: it calls the recipe's ``train_step`` and ``eval_step``, and
these are just one pair a recipe may take (the CIFAR and OCT recipes do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.nn import functional as F

if TYPE_CHECKING:  # for the annotations only
    from engine.context import WorkerContext


def loss_of(ctx: WorkerContext):
    """The recipe's ``loss_fn(outputs, targets)`` (a mean over the batch), else
    cross-entropy."""
    return ctx.loss_fn or F.cross_entropy


def train_step(batch, ctx: WorkerContext):
    """``(inputs, targets)`` batches: the loss of the model as trained."""
    inputs, targets = batch
    return loss_of(ctx)(ctx.model(inputs), targets)


def eval_step(batch, ctx: WorkerContext) -> dict:
    """The summed loss and, when the targets are class indices, the number of correct
    argmax predictions (``val/accuracy``), over ``count`` samples."""
    inputs, targets = batch
    outputs = ctx.module(inputs)
    count = targets.shape[0]
    sums = {"loss": loss_of(ctx)(outputs, targets).double() * count}  # loss_fn: a mean
    if not targets.is_floating_point() and outputs.dim() == targets.dim() + 1:
        sums["accuracy"] = (outputs.argmax(dim=1) == targets).sum()
    sums["count"] = count
    return sums
