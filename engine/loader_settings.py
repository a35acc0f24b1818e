"""DataLoader settings: what the engine chooses when a recipe says ``num_workers=auto``.

The CPU side can decide a run's time by more than an order of magnitude (docs/data.md
has the figures and the rule). The rule: the CPUs this process may use, as its world
says (:meth:`engine.world.World.cpu_share`, the same number that sets its torch
threads), less one for the training process, become workers, at most
:data:`MAX_AUTO_WORKERS` and at least one (a worker that shares the training process's
only CPU still overlaps loading with the step). Workers are persistent, keep
:data:`MIN_BATCHES_IN_FLIGHT` batches in flight, pin memory only for a CUDA device, and
time out instead of hanging. Without workers nothing is pinned (:func:`pinned`).
``engine-run tune-workers RECIPE`` measures instead of guessing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from engine.world import CpuShare

#: More workers than this rarely help one device and each one costs memory and start-up.
MAX_AUTO_WORKERS = 16
#: Batches in flight per process: enough to absorb a few slow samples (large TIFFs).
MIN_BATCHES_IN_FLIGHT = 4


@attrs.frozen
class LoaderSettings:
    num_workers: int
    persistent_workers: bool
    pin_memory: bool
    prefetch_factor: int | None  # None when num_workers is 0 (torch refuses it then)
    timeout_s: float  # per batch, with workers; 0 without (torch refuses it then)
    reason: str  # one line: where the numbers come from

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``engine.data.train_loader`` / ``val_loader``."""
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "persistent_workers": self.persistent_workers,
                "prefetch_factor": self.prefetch_factor, "timeout": self.timeout_s}

    def describe(self) -> str:
        """For the plan: ``2 per process, persistent, prefetch 2 batches each, ... (auto: ...)``."""
        if self.num_workers == 0:
            extras = "loading in the training process"
        else:
            extras = (f"{'persistent' if self.persistent_workers else 'restarted each epoch'}"
                      f", prefetch {self.prefetch_factor} batches each, timeout "
                      f"{self.timeout_s:g}s")
        extras += ", pinned memory" if self.pin_memory else ""
        return f"{self.num_workers} per process, {extras} ({self.reason})"


def pinned(num_workers: int, device_type: str) -> bool:
    """Whether a loader pins its batches: for a CUDA device, where workers load them.
    Without workers the training thread would pin each batch itself, with torch's
    OpenMP pool spin-waiting on every CPU (docs/performance.md, the GPU section)."""
    return device_type == "cuda" and num_workers > 0


def auto_workers(per_process_cpus: int) -> int:
    """All CPUs but the training process's, at least 1 and at most MAX_AUTO_WORKERS."""
    return max(1, min(per_process_cpus - 1, MAX_AUTO_WORKERS))


def choose(requested: int | str, *, cpus: CpuShare, device_type: str,
           timeout_s: float) -> LoaderSettings:
    """The DataLoader settings for one process; ``requested`` is ``cfg.num_workers``,
    ``cpus`` the process's share (``world.cpu_share()``)."""
    per_process, where = cpus.count, cpus.reason
    auto = auto_workers(per_process)
    if requested == "auto":
        workers = auto
        if per_process == 1:
            reason = f"auto: {where}; 1 worker shares it with training, overlapping the two"
        else:
            reason = f"auto: {where}, 1 kept for training"
        if per_process - 1 > MAX_AUTO_WORKERS:
            reason += f", capped at {MAX_AUTO_WORKERS}"
    else:
        workers = int(requested)
        reason = f"as configured; auto would choose {auto} from {where}"
        if workers >= 2 * per_process:
            reason += f"; {workers} workers compete for {per_process} CPUs"
    if workers == 0:
        return LoaderSettings(0, False, pinned(0, device_type), None, 0.0, reason)
    return LoaderSettings(
        num_workers=workers,
        persistent_workers=True,
        pin_memory=pinned(workers, device_type),
        prefetch_factor=max(2, math.ceil(MIN_BATCHES_IN_FLIGHT / workers)),
        timeout_s=float(timeout_s),
        reason=reason,
    )
