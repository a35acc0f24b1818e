"""The default steps of a recipe that defines no ``train_step`` or ``eval_step``:
image (or any) classification with ``(inputs, targets)`` batches. The Trainer calls
whichever steps the recipe gives; these are only the fallback, kept out of the loop so
that the loop knows no task.
"""

from __future__ import annotations


def train_step(batch, ctx):
    """The default ``train_step``: ``(inputs, targets)`` batches and the recipe's
    ``loss_fn`` (cross-entropy unless the recipe defines one) on the model as trained."""
    inputs, targets = batch
    return ctx.loss_fn(ctx.model(inputs), targets)


def eval_step(batch, ctx):
    """The default ``eval_step``: the summed loss and, when the targets are class
    indices, the number of correct argmax predictions, over ``count`` samples."""
    inputs, targets = batch
    outputs = ctx.module(inputs)
    count = targets.shape[0]
    sums = {"loss": ctx.loss_fn(outputs, targets).double() * count}  # loss_fn: a mean
    if not targets.is_floating_point() and outputs.dim() == targets.dim() + 1:
        sums["accuracy"] = (outputs.argmax(dim=1) == targets).sum()
    sums["count"] = count
    return sums
