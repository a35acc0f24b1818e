"""Parallel modes: which devices a worker uses, and how the model is wrapped.

The built-in modes (single, dp, ddp, ddp-multigpu, fsdp: one plugin file each), their
devices and ``--parallel auto``'s choice by ``priority`` are in docs/parallel.md.

The recipe's ``batch_size`` is global: every mode gets ``batch_size / world_size``
samples per process and optimizer step (divided again by ``grad_accum_steps``); a mode
that drives several devices in one process (``dp``, ``ddp-multigpu``) scatters that
share over them. ``CUDA_VISIBLE_DEVICES`` is respected because torch numbers only the
visible GPUs; a process its launcher gave exactly its own GPUs uses them all
(:func:`gpu_group`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import ClassVar

from engine.errors import ConfigError, warn


class Parallel:
    name: ClassVar[str] = ""
    #: True for modes that run in exactly one process (a launcher can default to 1).
    single_process: ClassVar[bool] = False
    #: Order in which ``--parallel auto`` asks the modes: lower numbers first.
    priority: ClassVar[int] = 100

    @classmethod
    def detect(cls, world) -> bool:
        """True when ``--parallel auto`` should pick this mode for ``world`` (asked
        before any process group or CUDA device is set up)."""
        return False

    def __init__(self, world, cfg, recipe=None):
        self.world = world
        self.cfg = cfg
        # The run's recipe (engine.recipe.Recipe) under engine-run, None in a loop of
        # your own: a mode may read a setting the recipe declares (fsdp: shard_units).
        self.recipe = recipe

    def __init_subclass__(cls, **kwargs) -> None:
        # A mode written before ``recipe`` was an argument (``__init__(self, world,
        # cfg)``) keeps working: the engine passes recipe=, this sets the attribute.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        params = inspect.signature(init).parameters.values()
        if any(p.name == "recipe" or p.kind is p.VAR_KEYWORD for p in params):
            return

        @functools.wraps(init)
        def __init__(self, world, cfg, *args, recipe=None, **kwargs):
            init(self, world, cfg, *args, **kwargs)
            self.recipe = recipe

        cls.__init__ = __init__

    # -------------------------------------------------------------- devices

    @property
    def devices(self) -> list:
        """The torch devices this process computes on; the first is where the batch goes."""
        raise NotImplementedError

    @functools.cached_property
    def device(self):
        # Asked for every batch: worked out once (devices counts the GPUs each time), as
        # a process's device never changes during a run.
        return self.devices[0]

    @property
    def backend(self) -> str | None:
        """The torch.distributed backend, or None when no process group is needed."""
        return None

    def check(self) -> None:
        """Raise a ConfigError when this mode cannot run in this world.

        Called in the launching process for every worker (``--dry-run`` and the plan)
        and again in each worker, so it must not print.
        """

    def describe(self) -> list[tuple[str, str]]:
        """Extra ``(label, text)`` rows for the plan (``--dry-run``), worked out in the
        launching process before any worker starts (fsdp: its units, bytes per rank)."""
        return []

    def setup_device(self) -> None:
        """Called once per worker before the process group is created
        (torch.cuda.set_device; warnings about GPUs the mode leaves idle)."""

    # ---------------------------------------------------------------- model

    def wrap(self, model):
        """Wrap a model that already lives on ``self.device``."""
        return model

    def unwrap(self, model):
        return model

    def no_sync(self, model):
        """Context for micro-steps that must not synchronise gradients."""
        return contextlib.nullcontext()

    def validation(self, model):
        """Context for validation, where each rank runs its own shard of the set, which
        may be one batch shorter than another rank's: forwards must not wait for each
        other (a mode whose forward communicates gathers what it needs first)."""
        return contextlib.nullcontext()

    def sync_buffers(self, model) -> None:
        """Make every rank's buffers (BatchNorm running statistics) equal again after
        training steps, before validation or a snapshot reads them. A no-op for modes
        that keep one copy of the model."""

    def explain(self, exc: BaseException) -> str | None:
        """A hint for an error raised during a step, or None."""
        return None

    # -------------------------------------------------------------- output

    def warn(self, message: str, *, every_node: bool = False) -> None:
        """Print ``warning: message`` once: on rank 0, or on local rank 0 of every node
        for facts about the node (its GPUs), named by host when there are several."""
        if not (self.world.is_local_rank0 if every_node else self.world.is_rank0):
            return
        if every_node and self.world.num_nodes > 1:
            message = f"{self.world.host}: {message}"
        # The mode's own set, also if __init__ was overridden.
        warn(message, said=self.__dict__.setdefault("_said", set()))

    def warn_idle_gpus(self, used: int, how: str) -> None:
        """Warn loudly when this node has GPUs the mode leaves idle. ``used`` is the
        number of GPUs the node's processes use together; ``how`` says what to do."""
        message = idle_gpus_message(self.name, used, visible_gpus(), how)
        if message:
            self.warn(message, every_node=True)


def choose_parallel(registry, name: str, world) -> type[Parallel]:
    """The class of parallel mode ``name``; for ``auto`` the first registered mode, in
    ``priority`` order, whose ``detect(world)`` is true."""
    if name != "auto":
        return registry.get(name)
    # sorted() is stable: equal priorities keep the registration order.
    for cls in sorted((cls for _, cls in registry.items()), key=lambda c: c.priority):
        if cls.detect(world):
            return cls
    raise ConfigError(
        "--parallel auto: no registered parallel mode accepts this process (world size "
        f"{world.world_size}); choose one with --parallel NAME, registered: "
        + ", ".join(registry.names()))


# ------------------------------------------------------------------- helpers


def visible_gpus() -> int:
    """How many GPUs this process sees (torch counts only CUDA_VISIBLE_DEVICES)."""
    import torch  # engine-run's start-up imports every parallel mode: no torch there

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def idle_gpus_message(mode: str, used: int, visible: int, how: str) -> str | None:
    if visible <= used:
        return None
    idle = ", ".join(f"cuda:{i}" for i in range(used, visible))
    return (f"{visible} GPUs are visible{visible_devices_note()} but parallel mode "
            f"{mode!r} uses only {used}: {idle} stay idle; {how}")


def visible_devices_note() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value})"


def gpus_bound_by_launcher(world) -> bool:
    """True when the launcher may have given this process GPUs of its own: it set
    CUDA_VISIBLE_DEVICES and did not start all local processes from one parent that
    they share it with (spawn: ``World.shared_devices``)."""
    return not world.shared_devices and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def gpu_group(mode: str, world, per_process: int, visible: int) -> list[int]:
    """The indices (among the visible GPUs) of the ``per_process`` GPUs that the process
    with ``world.local_rank`` drives.

    - All local processes see the same GPUs (spawn, torchrun, SLURM one task per node):
      local rank r takes GPUs ``r*k .. r*k+k-1``; the node needs k x local processes.
    - The launcher bound each process to its own GPUs (``srun --gpus-per-task=k``, so
      CUDA_VISIBLE_DEVICES lists exactly k GPUs and differs between tasks): the process
      takes all k. Only trusted when CUDA_VISIBLE_DEVICES is set and the processes were
      not spawned by us (spawned processes inherit one and the same variable).
    """
    needed = per_process * world.local_world_size
    if visible >= needed:
        first = world.local_rank * per_process
        return list(range(first, first + per_process))
    if visible == per_process and gpus_bound_by_launcher(world):
        return list(range(per_process))
    raise ConfigError(
        f"parallel mode {mode!r} needs {per_process} GPU(s) per process x "
        f"{world.local_world_size} processes on this node = {needed} GPUs, but "
        f"{visible} are visible{visible_devices_note()}; start at most "
        f"{max(1, visible // per_process)} processes per node (--nproc) or make more GPUs "
        "visible"
    )


def require_single_process(parallel: Parallel) -> None:
    if parallel.world.world_size > 1:
        raise ConfigError(
            f"parallel mode {parallel.name!r} runs in one process, but the world has "
            f"{parallel.world.world_size}; use --parallel ddp, or --nproc 1"
        )


def parse_class_names(spec: str) -> list[str]:
    """``"Block, Head"`` -> ``["Block", "Head"]`` (a config value naming module classes)."""
    return [name.strip() for name in spec.split(",") if name.strip()]


def select_blocks(model, classes, key: str) -> list[tuple[str, object]]:
    """``(name, submodule)`` for every submodule of ``model`` (not the model itself)
    whose class is among ``classes``: class names (``fsdp.shard=Block``) or classes (a
    recipe's ``shard_units``). ``key`` is the setting that asked, for the error when a
    class matches nothing, which lists the classes the model does have."""
    def is_a(module, cls) -> bool:
        return type(module).__name__ == cls if isinstance(cls, str) else isinstance(module, cls)

    submodules = [(name, m) for name, m in model.named_modules() if name]
    missing = [getattr(c, "__name__", str(c)) for c in classes
               if not any(is_a(m, c) for _, m in submodules)]
    if missing:
        have = sorted({type(m).__name__ for _, m in submodules})
        raise ConfigError(
            f"{key}: {', '.join(missing)} matches no submodule of {type(model).__name__}; "
            f"its submodule classes are: {', '.join(have) or 'none'}")
    return [(name, m) for name, m in submodules if any(is_a(m, c) for c in classes)]
