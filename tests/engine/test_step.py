"""engine/step.py: the non-finite policy and train_step's extras, in-process (one
rank)."""

from __future__ import annotations

import pytest
import torch

from engine.step import NonFiniteLoss, NonFinitePolicy, TrainExtras

CPU = torch.device("cpu")
NAN = torch.tensor(float("nan"))


def test_skip_policy_skips_a_step_with_any_nan_micro_batch_and_starts_clean():
    warnings = []
    policy = NonFinitePolicy("skip", CPU, world_size=1, warn=warnings.append)
    for loss in (NAN, torch.tensor(1.0)):  # the NaN first, the last micro-batch fine
        policy.observe(loss)
    assert policy.allow_step(7) is False
    assert warnings == ["non-finite loss at step 7: step skipped (on_nonfinite=skip)"]
    policy.observe(torch.tensor(2.0))
    assert policy.allow_step(8) is True and policy.skipped_steps == 1
    policy.check_window(float("nan"), first=1, last=2, epoch=0)  # skip never stops


def test_stop_policy_never_syncs_per_step_and_stops_on_a_nan_window():
    policy = NonFinitePolicy("stop", CPU, world_size=1, warn=print)
    policy.observe(NAN)
    assert policy.allow_step(1) is True and policy.finite is None
    with pytest.raises(NonFiniteLoss, match=r"non-finite \(nan\) between steps 3 and 4 "
                                            r"\(epoch 1\); .*on_nonfinite=skip"):
        policy.check_window(float("nan"), first=3, last=4, epoch=1)
    with pytest.raises(NonFiniteLoss, match=r"not finite \(inf\) in epoch 2, by step 9"):
        policy.check_epoch(float("inf"), epoch=2, step=9)


def test_train_step_extras_are_means_per_window_and_per_epoch():
    extras = TrainExtras(["accuracy", "tokens"], CPU)
    for hits, tokens in ((0.5, 10), (1.0, 30)):
        extras.add({"loss": torch.tensor(2.0), "accuracy": torch.tensor(hits), "tokens": tokens})
    sums, batches = extras.take_window()
    assert extras.means(sums.tolist(), batches) == {"train/accuracy": 0.75, "train/tokens": 20.0}
    extras.add({"accuracy": torch.tensor(0.0), "tokens": 20})
    *sums, batches = extras.take_epoch().tolist()  # the open window included
    assert extras.means(sums, batches, prefix="train/epoch_") == {
        "train/epoch_accuracy": 0.5, "train/epoch_tokens": 20.0}
    assert extras.take_epoch().tolist() == [0.0, 0.0, 0.0]  # the next epoch starts empty


def test_a_skipped_steps_extras_leave_the_window_and_the_epoch():
    # on_nonfinite=skip drops a skipped step's losses (LogWindow.settle); its extras
    # went on, and one NaN among them made train/NAME and train/epoch_NAME NaN.
    extras = TrainExtras(["accuracy"], CPU)
    for values, taken in (((0.5, 1.0), True), ((float("nan"), 0.0), False), ((0.0,), True)):
        for value in values:
            extras.add({"loss": torch.tensor(1.0), "accuracy": torch.tensor(value)})
        extras.settle(taken)
    sums, batches = extras.take_window()
    assert extras.means(sums.tolist(), batches) == {"train/accuracy": 0.5}
    extras.add({"accuracy": torch.tensor(float("nan"))})
    extras.settle(False)  # the next window's first step: nothing kept yet
    *sums, batches = extras.take_epoch().tolist()
    assert extras.means(sums, batches, prefix="train/epoch_") == {"train/epoch_accuracy": 0.5}
