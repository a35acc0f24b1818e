"""engine/classification.py: the default steps of a recipe that defines none."""

from __future__ import annotations

import torch

from engine.classification import eval_step


def test_default_eval_step_reports_accuracy_for_class_indices_only():
    class Ctx:
        module = staticmethod(lambda x: x)
        loss_fn = staticmethod(torch.nn.functional.mse_loss)

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    ctx = Ctx()
    ctx.loss_fn = torch.nn.functional.cross_entropy
    sums = eval_step((logits, torch.tensor([0, 1, 1])), ctx)
    assert list(sums) == ["loss", "accuracy", "count"] and sums["accuracy"].item() == 2
    regression = eval_step((logits[:, :1], torch.ones(3, 1)), Ctx())
    assert list(regression) == ["loss", "count"]
