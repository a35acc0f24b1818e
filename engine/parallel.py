"""Parallel modes: which devices a worker uses, and how the model is wrapped.

The recipe's ``batch_size`` is global. Every mode gets ``batch_size / world_size``
samples per process and optimizer step (divided again by ``grad_accum_steps``); a mode
that drives several devices inside one process (``dp``) splits that share further.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

from engine.errors import ConfigError


class Parallel:
    name: ClassVar[str] = ""

    def __init__(self, world, cfg):
        self.world = world
        self.cfg = cfg

    # -------------------------------------------------------------- devices

    @property
    def devices(self) -> list:
        """The torch devices this process computes on; the first is where the batch goes."""
        raise NotImplementedError

    @property
    def device(self):
        return self.devices[0]

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend, or None when no process group is needed."""
        return None

    def check(self) -> None:
        """Raise a ConfigError when this mode cannot run in this world."""

    def setup_device(self) -> None:
        """Called before the process group is created (torch.cuda.set_device)."""

    # ---------------------------------------------------------------- model

    def wrap(self, model):
        """Wrap a model that already lives on ``self.device``."""
        return model

    def unwrap(self, model):
        return model

    def no_sync(self, model):
        """Context for micro-steps that must not synchronise gradients."""
        return contextlib.nullcontext()

    def explain(self, exc: BaseException) -> str | None:
        """A hint for an error raised during a step, or None."""
        return None


def require_single_process(parallel: Parallel) -> None:
    if parallel.world.world_size > 1:
        raise ConfigError(
            f"parallel mode {parallel.name!r} runs in one process, but the world has "
            f"{parallel.world.world_size}; use --parallel ddp, or --nproc 1"
        )
