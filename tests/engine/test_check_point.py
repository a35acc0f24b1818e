"""engine/check_point.py: the log window's sums and the check point's named slots, each
handed its own sums back, in-process (one rank: the all-reduce is the values)."""

from __future__ import annotations

import math
import types

import torch

from engine.check_point import CheckPoint, LogWindow, window_mean

CPU = torch.device("cpu")


def test_each_slot_gets_its_own_sums_back_by_name_and_its_metrics_are_logged():
    """Slots given as floats and as a device tensor, registered in any order: each is
    handed the values it gave (summed over one rank), whatever the others' sizes, and
    its metrics are logged between the loss and the throughput."""
    state = types.SimpleNamespace(epoch=0, step=4)
    ctx = types.SimpleNamespace(state=state, world=types.SimpleNamespace(world_size=1),
                                metrics={})
    logged, got, started = [], {}, []
    check = CheckPoint(ctx, types.SimpleNamespace(check_window=lambda *a, **k: None),
                       "train/samples_per_sec", lambda **kw: logged.append(kw))
    check.add("extras", lambda s, n: torch.tensor([3.0, 2.0], dtype=torch.float64),
              lambda sums: got.update(extras=list(sums)) or {"train/acc": 1.5})
    check.add("flags", lambda s, n: [1.0, 0.0, 5.0], lambda sums: got.update(flags=list(sums)),
              started=lambda: started.append(True))
    check.add("one", lambda s, n: [7.0], lambda sums: got.update(one=list(sums)))
    check.window_started()
    window = LogWindow(CPU, samples_per_step=2)
    for loss in (1.0, 2.0):
        window.add_batch(torch.tensor(loss))
    window.steps = 4
    check.start(window, counted=False, lr=0.1)
    assert check.pending is not None and not logged  # read one check point later
    check.finish_pending()
    assert got == {"extras": [3.0, 2.0], "flags": [1.0, 0.0, 5.0], "one": [7.0]}
    assert started == [True]
    ((entry,),) = [logged]
    assert entry["step"] == 4 and list(entry["metrics"]) == [
        "train/loss", "train/acc", "train/samples_per_sec", "lr"]
    assert (entry["metrics"]["train/loss"], entry["metrics"]["lr"]) == (1.5, 0.1)
    assert ctx.metrics == entry["metrics"] and window.batches == 0


def test_log_window_folds_each_window_into_the_epoch_sum():
    window = LogWindow(CPU, samples_per_step=10)
    for value in (1.0, 2.0):
        window.add_batch(torch.tensor(value))
    window.steps = 1
    assert (window.loss.item(), window.batches) == (3.0, 2)
    assert window.per_sec(window.start + 0.5, counted=False) == 20.0
    counted = LogWindow(CPU, samples_per_step=10, world_size=2)
    counted.units = 300  # this rank's tokens, say; the others trained as many
    assert counted.per_sec(counted.start + 0.5, counted=True) == 1200.0
    counted.restart(counted.start + 0.5)
    assert (counted.units, counted.epoch_units) == (0, 300)
    window.restart(window.start + 0.5)
    assert (window.loss.item(), window.batches, window.steps) == (0.0, 0, 0)
    window.add_batch(torch.tensor(4.0))
    assert window.total_loss().item() == 7.0


def test_the_window_loss_is_logged_as_before_the_counts_were_summed():
    # The check point sums the ranks' micro-batch counts; with map-style data every rank
    # has as many, and metrics.csv (repr) must read as before: the sum over one rank's
    # batches, then over the ranks. One division by the product differs in the last
    # digit for about one window in five with 3 processes.
    sums = torch.linspace(0.1, 30.0, 200, dtype=torch.float32).tolist()
    for world_size in (1, 2, 3, 5, 6):
        for per_rank in (1, 3, 7, 16):
            assert [window_mean(s, float(per_rank * world_size), world_size)
                    for s in sums] == [s / per_rank / world_size for s in sums]
    assert window_mean(7.0, 5.0, 2) == 7.0 / 5.0  # a stream's ranks ran 3 and 2
    assert math.isnan(window_mean(0.0, 0.0, 3))  # on_nonfinite=skip skipped them all


def test_a_skipped_step_leaves_the_window_and_the_epoch_loss():
    window = LogWindow(CPU, samples_per_step=8)
    for losses, taken in (((1.0, 3.0), True), ((float("nan"), 5.0), False),
                          ((2.0, 2.0), True)):
        for loss in losses:
            window.add_batch(torch.tensor(loss))
        window.settle(taken)
    assert (window.loss.item(), window.batches, window.skipped_batches) == (8.0, 4, 2)
    window.restart(window.start + 1)
    window.add_batch(torch.tensor(float("inf")))
    window.settle(False)
    assert (window.loss.item(), window.batches, window.skipped_batches) == (0.0, 0, 3)
    assert window.total_loss().item() == 8.0
