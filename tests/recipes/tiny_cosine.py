"""tests/recipes/tiny_regression.py with a cosine schedule over the run's length: its
total steps when stepped per step, its epochs when per epoch (the resumes that change
the run's length: tests/engine/test_run_length.py)."""

from __future__ import annotations

import torch

from tests.recipes.tiny_regression import (Config, build_datasets, build_model,
                                           build_optimizer, eval_step, loss_fn, train_step)

__all__ = ["Config", "build_datasets", "build_model", "build_optimizer", "build_scheduler",
           "eval_step", "loss_fn", "train_step"]


def build_scheduler(cfg, optimizer, ctx):
    length = ctx.total_steps if cfg.scheduler_interval == "step" else cfg.epochs
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=length)
