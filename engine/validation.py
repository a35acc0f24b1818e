"""Validation: the recipe's ``eval_step`` over this rank's shard of the validation set,
its sums reduced over the ranks, and the val/* names one batch tells before training
(for the metrics a config names). Training goes on as without it: the RNG states and
the model's mode are left as they were.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from engine import data, distributed, rng
from engine.errors import EngineError, PeerFailed


class MetricSums:
    """What ``eval_step`` returns, summed over a rank's batches (tensors on the device:
    no sync per batch; numbers on the host), then over the ranks in one all-reduce; each
    sum divided by the ``count`` sum, or what the recipe's ``eval_metrics(sums)`` derives
    from them (a perplexity, an F1 from counts). The names come from the first batch;
    rank 0 tells the others, so a rank with no batch at all joins the same reduction."""

    def __init__(self, device, derive=None):
        self.device = device
        self.derive = derive
        self.names: list[str] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.numbers: dict[str, float] = {}

    def add(self, sums: dict) -> None:
        if self.names is None:
            if not isinstance(sums, dict) or ("count" not in sums and self.derive is None):
                raise EngineError(
                    "eval_step must return a dict of metric sums with a 'count' (the number "
                    f"of samples they cover), e.g. {{'loss': ..., 'count': n}}; got {sums!r}")
            self.names = list(sums)
        for name in self.names:
            value = sums[name]
            if isinstance(value, torch.Tensor):
                value = value.detach().double()
                if name in self.tensors:
                    self.tensors[name] += value
                else:
                    self.tensors[name] = value.clone()
            else:
                self.numbers[name] = self.numbers.get(name, 0.0) + float(value)

    def reduce(self) -> dict:
        """``{"val/NAME": sum over ranks / count}``, identical on every rank."""
        names = distributed.broadcast_object(self.names)
        if not names:
            return {}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # A name may have come as a tensor from some batches and a number from others.
        values = torch.stack([self.tensors.get(n, zero) + self.numbers.get(n, 0.0)
                              for n in names])
        totals = dict(zip(names, distributed.all_reduce_sum(values).tolist()))
        if totals.get("count", 1) == 0:
            return {}  # no validation sample on any rank
        if self.derive is not None:
            return {f"val/{name}": float(value) for name, value in self.derive(totals).items()}
        count = totals.pop("count")
        return {f"val/{name}": total / count for name, total in totals.items()}


class Validation:
    """A run's validation on ``parts`` (engine.worker_setup.RunParts), under the training
    step's ``autocast`` (engine/step.py)."""

    def __init__(self, ctx, parts, autocast):
        self.ctx, self.parts, self.autocast = ctx, parts, autocast
        self.device = parts.parallel.device
        self.non_blocking = self.device.type == "cuda"
        self.eval_step = ctx.recipe.optional("eval_step")
        self.eval_metrics = ctx.recipe.optional("eval_metrics")

    @torch.no_grad()
    def run(self, epoch: int) -> dict:
        """The recipe's ``eval_step`` over this rank's shard (a smoke run's first
        ``limit_batches``); the sums reduced over the ranks in one all-reduce. An
        eval_step may draw (test-time augmentation): training goes on as without the
        validation, wherever it falls and however often."""
        ctx, parts = self.ctx, self.parts
        if parts.val_loader is None:
            return {}
        limit = ctx.cfg.limit_batches
        batches = itertools.islice(parts.val_loader, limit) if limit else parts.val_loader
        with forked_rng():
            ctx.pm.hook.engine_validation_start(ctx=ctx, epoch=epoch)
            sums = MetricSums(self.device, self.eval_metrics)
            with self.evaluating():
                for batch in batches:
                    sums.add(self.step(batch))
            metrics = sums.reduce()
            ctx.pm.hook.engine_validation_end(ctx=ctx, epoch=epoch, metrics=metrics)
        return metrics

    @contextlib.contextmanager
    def evaluating(self):
        """The unwrapped module in eval mode (no DDP collectives in forward: a shorter
        shard hangs no other rank), its mode restored after."""
        module = self.parts.module
        was_training = module.training
        module.eval()
        try:
            with self.parts.parallel.validation(self.parts.model):
                yield
        finally:
            module.train(was_training)

    def step(self, batch) -> dict:
        batch = data.to_device(batch, self.device, non_blocking=self.non_blocking)
        with self.autocast():
            return self.eval_step(batch, self.ctx)

    @torch.no_grad()
    def names(self) -> list[str] | None:
        """The val/* names validation will log: rank 0's, from one batch (read from the
        dataset, not the loader) through eval_step and eval_metrics. [] without a
        validation sample; None when eval_metrics fails on one batch's sums. Collective:
        every rank runs one batch (fsdp's first forward needs them all), and one
        all_gather tells rank 0's names and who failed (that rank raises its error)."""
        loader = self.parts.val_loader
        if loader is None:
            return []
        names, failure = None, None
        with forked_rng(), self.evaluating():
            try:
                names = self._first_batch_names(loader)
            except Exception as exc:
                failure = exc
        answers = distributed.all_gather_object((failure is not None, names))
        if failure is not None:
            raise failure
        failed = [rank for rank, (raised, _) in enumerate(answers) if raised]
        if failed:
            raise PeerFailed(f"rank(s) {', '.join(map(str, failed))} failed to validate one "
                             "batch before training (their error is the one to read)")
        return answers[0][1]

    def _first_batch_names(self, loader) -> list[str] | None:
        """:meth:`names` on one rank: eval_step on its shard's first batch (a rank whose
        shard is empty takes the set's first samples: every rank runs one forward)."""
        samples = data.first_val_samples(loader)
        if not samples:
            return []  # no validation sample: no val/* metric (MetricSums.reduce)
        sums = self.step(loader.collate_fn(samples))
        MetricSums(self.device, self.eval_metrics).add(sums)  # what it returns is checked
        if self.eval_metrics is None:
            return [f"val/{name}" for name in sums if name != "count"]
        try:
            derived = self.eval_metrics({name: float(value) for name, value in sums.items()})
            return [f"val/{name}" for name in derived]
        except Exception:
            return None


@contextlib.contextmanager
def forked_rng():
    """Every RNG state as it was before, afterwards."""
    saved = rng.rng_state()
    try:
        yield
    finally:
        rng.set_rng_state(saved)
