"""``ema``: an exponential moving average of the weights, saved in every snapshot.

Off until enabled through its config group::

    engine-run RECIPE ema.enabled=true ema.decay=0.999 ema.every_steps=1 ema.evaluate=true

- ``decay`` (0.999): each update keeps ``decay`` of the average and adds ``1 - decay``
  of the weights (torch.optim.swa_utils.get_ema_multi_avg_fn); the first update copies
  the weights.
- ``every_steps`` (1): update after every N-th optimizer step taken (a step that
  ``on_nonfinite=skip`` or fp16's GradScaler skips is not taken, so it does not count).
- ``evaluate`` (false): validate on the averaged weights instead of the trained ones;
  the ``val/*`` metrics (and early stopping, and ``checkpoint.best_metric``) are then the
  average's.

The average is a torch.optim.swa_utils.AveragedModel (parameters and buffers), updated
by an optimizer step hook: nothing runs per step while the plugin is disabled, and no
value is read back from the device while it is enabled. It is a snapshot part named
``ema`` (``engine_register_state``), so a run killed mid-epoch resumes to the same
average as an uninterrupted one. Every rank keeps its own copy: the replicated parallel
modes train the same weights on every rank, so the copies are equal, and a checkpointer
that writes on rank 0 keeps rank 0's. ``python tools/ckpt.py export SNAPSHOT out.pt
--part ema`` writes the averaged weights alone.
"""

from __future__ import annotations

import attrs

import engine
from engine.errors import ConfigError


def _decay_in_range(instance, attribute, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError("the decay is at least 0 and below 1 (e.g. 0.999)")


def _positive(instance, attribute, value) -> None:
    if value < 1:
        raise ValueError("update every 1 or more optimizer steps")


@attrs.define
class EmaConfig:
    """``ema.*``: every key changes what the run computes or reports, so a resume
    refuses a change of any of them (engine.config.resume_safe)."""

    enabled: bool = False
    decay: float = attrs.field(default=0.999, validator=_decay_in_range)
    every_steps: int = attrs.field(default=1, validator=_positive)
    evaluate: bool = False


class ExponentialMovingAverage:
    """The snapshot part: the averaged copy of ``module`` and the steps it has seen."""

    def __init__(self, module, optimizer, decay: float, every_steps: int):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.module = module
        self.every_steps = every_steps
        self.steps = 0  # optimizer steps taken since the start of training
        self.average = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay),
                                     use_buffers=True)
        self.average.requires_grad_(False)
        # Inside optimizer.step(): after every step taken, and only then.
        optimizer.register_step_post_hook(self._after_step)
        self._trained = None  # the trained weights while the average is evaluated

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps % self.every_steps == 0:
            self.average.update_parameters(self.module)

    def state_dict(self) -> dict:
        return {"average": self.average.state_dict(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.average.load_state_dict(state_dict["average"])
        self.steps = int(state_dict["steps"])

    def weights(self) -> dict:
        """The averaged weights, keyed as the module's own state_dict."""
        return self.average.module.state_dict()

    def swap_in(self) -> None:
        """Put the averaged weights into the module (a copy of the trained ones kept)."""
        import torch

        with torch.no_grad():
            current = self.module.state_dict()
            self._trained = {name: t.detach().clone() for name, t in current.items()}
            for name, tensor in self.weights().items():
                current[name].copy_(tensor)

    def swap_out(self) -> None:
        """The trained weights back, bit for bit."""
        import torch

        if self._trained is None:
            return
        with torch.no_grad():
            current = self.module.state_dict()
            for name, tensor in self._trained.items():
                current[name].copy_(tensor)
        self._trained = None


@engine.hookimpl
def engine_register_config_groups():
    return {"ema": EmaConfig}


def _options(cfg) -> EmaConfig:
    return getattr(cfg, "ema", None) or EmaConfig()


@engine.hookimpl
def engine_register_state(engine, parts):
    options = _options(engine.cfg)
    if options.evaluate and not options.enabled:
        raise ConfigError("config key 'ema.evaluate': there is no average to evaluate "
                          "unless ema.enabled=true")
    if options.enabled:
        parts.add("ema", ExponentialMovingAverage(engine.module, engine.optimizer,
                                                  options.decay, options.every_steps))


def _evaluated_average(engine) -> ExponentialMovingAverage | None:
    if not _options(engine.cfg).evaluate or "ema" not in engine.snapshot_parts:
        return None
    return engine.snapshot_parts["ema"]


@engine.hookimpl
def engine_validation_start(engine):
    average = _evaluated_average(engine)
    if average is not None:
        average.swap_in()


@engine.hookimpl
def engine_validation_end(engine):
    average = _evaluated_average(engine)
    if average is not None:
        average.swap_out()
