"""DataLoader settings: what the engine chooses when a recipe says ``num_workers=auto``.

In the seeds' OCT-A runs the CPU side decided the time: 10 epochs took 55,000 s with a
few CPUs and ``num_workers=0``, and 1,700 s with 60 CPUs and workers to use them. The
rule here is the one their table points to:

- the CPUs this process may use: ``SLURM_CPUS_PER_TASK`` when SLURM set it, else the
  affinity mask (``engine.data.usable_cpus``);
- shared among the processes that draw on them: all local processes, unless SLURM gave
  each process its own task (one task per GPU), in which case SLURM already divided;
- one CPU stays with the training process (it feeds the device, or is the device);
  the rest become workers, at most :data:`MAX_AUTO_WORKERS` and at least one: with no
  worker every batch is read, decoded and augmented while the device waits, and a
  worker that shares the training process's only CPU still overlaps loading with the
  step (measured in docs/data.md);
- workers are persistent (no re-fork of every worker at each epoch), keep at least
  :data:`MIN_BATCHES_IN_FLIGHT` batches in flight (``prefetch_factor``), pin memory
  only when the batches go to a CUDA device, and time out instead of hanging.

``engine-run tune-workers RECIPE`` measures instead of guessing; its table shows how
close this choice comes to the best one on a given machine.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping

import attrs

#: More workers than this rarely help one device and each one costs memory and start-up.
MAX_AUTO_WORKERS = 16
#: Batches in flight per process: enough to absorb a few slow images (large TIFFs).
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


def slurm_tasks_on_this_node(environ: Mapping[str, str]) -> int | None:
    """Tasks of the current SLURM job step on this node, or None outside a step.

    ``SLURM_STEP_TASKS_PER_NODE`` reads like ``2(x3),1``: 2 tasks on each of the first 3
    nodes, then 1; ``SLURM_NODEID`` says which of them this node is.
    """
    text = environ.get("SLURM_STEP_TASKS_PER_NODE") or ""
    if not text or not environ.get("SLURM_STEP_ID"):
        return None
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    node = environ.get("SLURM_NODEID", "0")
    index = int(node) if node.isdigit() else 0
    return counts[index] if index < len(counts) else counts[-1]


def cpus_per_process(local_world_size: int, environ: Mapping[str, str] | None = None,
                     cpus: int | None = None) -> tuple[int, str]:
    """The CPUs one process may count on, and a few words on where that comes from."""
    from engine.data import usable_cpus

    environ = os.environ if environ is None else environ
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    if cpus is None:
        cpus = usable_cpus()
    source = "SLURM_CPUS_PER_TASK" if slurm.isdigit() and int(slurm) > 0 else "affinity"
    sharing = max(1, local_world_size)
    if source == "SLURM_CPUS_PER_TASK":
        tasks = slurm_tasks_on_this_node(environ)
        if tasks:
            # One task per process: SLURM already gave each its own CPUs.
            sharing = max(1, local_world_size // tasks)
    per_process = max(1, cpus // sharing)
    if sharing == 1:
        return per_process, f"{cpus} CPUs ({source}) for this process"
    return per_process, (f"{cpus} CPUs ({source}) shared by {sharing} local processes "
                         f"= {per_process} each")


def auto_workers(per_process_cpus: int) -> int:
    """All CPUs but the training process's, at least 1 and at most MAX_AUTO_WORKERS."""
    return max(1, min(per_process_cpus - 1, MAX_AUTO_WORKERS))


def choose(requested: int | str, *, local_world_size: int, device_type: str,
           timeout_s: float, environ: Mapping[str, str] | None = None,
           cpus: int | None = None) -> LoaderSettings:
    """The DataLoader settings for one process; ``requested`` is ``cfg.num_workers``."""
    per_process, where = cpus_per_process(local_world_size, environ, cpus)
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
        return LoaderSettings(0, False, device_type == "cuda", None, 0.0, reason)
    return LoaderSettings(
        num_workers=workers,
        persistent_workers=True,
        pin_memory=device_type == "cuda",
        prefetch_factor=max(2, math.ceil(MIN_BATCHES_IN_FLIGHT / workers)),
        timeout_s=float(timeout_s),
        reason=reason,
    )
