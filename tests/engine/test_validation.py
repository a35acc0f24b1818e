"""engine/validation.py: the metric sums of eval_step, reduced, in-process (one rank)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.errors import EngineError
from engine.validation import MetricSums

CPU = torch.device("cpu")


def test_metric_sums_add_tensors_and_numbers_and_divide_by_the_count():
    sums = MetricSums(CPU)
    sums.add({"loss": torch.tensor(3.0), "hits": 2, "count": 4})
    sums.add({"loss": torch.tensor(1.0), "hits": torch.tensor(1), "count": 4})
    assert sums.reduce() == {"val/loss": 0.5, "val/hits": 0.375}
    assert MetricSums(CPU).reduce() == {}  # no batch at all
    with pytest.raises(EngineError, match="eval_step must return a dict of metric sums "
                                          "with a 'count'"):
        MetricSums(CPU).add({"loss": torch.tensor(1.0)})


def test_a_recipe_derives_metrics_from_the_reduced_sums():
    """Perplexity is exp(loss sum / count) over every batch, which no per-batch sum
    divided by a count gives; F1 comes from the summed counts."""
    def derive(sums):
        loss = sums["loss"] / sums["count"]
        f1 = 2 * sums["tp"] / (2 * sums["tp"] + sums["fp"] + sums["fn"])
        return {"loss": loss, "perplexity": math.exp(loss), "f1": f1}

    sums = MetricSums(CPU, derive)
    sums.add({"loss": torch.tensor(2.0), "tp": 3, "fp": 1, "fn": 0, "count": 2})
    sums.add({"loss": torch.tensor(4.0), "tp": 1, "fp": 0, "fn": 2, "count": 4})
    assert sums.reduce() == pytest.approx(
        {"val/loss": 1.0, "val/perplexity": math.e, "val/f1": 8 / 11})
    # With eval_metrics, a count is the recipe's business.
    counted = MetricSums(CPU, lambda sums: {"hits": sums["hits"]})
    counted.add({"hits": 3})
    assert counted.reduce() == {"val/hits": 3.0}
