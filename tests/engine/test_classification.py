"""engine/classification.py: the opt-in steps for (inputs, targets) classification."""

from __future__ import annotations

import torch

from engine.classification import eval_step, train_step


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


def test_the_loss_is_the_recipes_loss_fn_or_cross_entropy():
    class Ctx:
        model = staticmethod(lambda x: x)
        loss_fn = None

    logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0])
    expected = torch.nn.functional.cross_entropy(logits, targets)
    assert torch.equal(train_step((logits, targets), Ctx()), expected)
    Ctx.loss_fn = staticmethod(lambda outputs, targets: outputs.sum())
    assert train_step((logits, targets), Ctx()).item() == 3.0
