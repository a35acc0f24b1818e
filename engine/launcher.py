"""Launchers: how the worker processes come into being, and where each one stands.

A launcher starts the workers (``spawn``, ``slurm`` with one task per node) or adopts
the process another tool started, calls ``worker(world)`` once in each, and checks the
numbers before any process group exists. Without ``--launcher``, the first by
``priority`` whose :meth:`Launcher.detect` is true (docs/launchers.md):

1. ``legacy`` (10): ``python -m torch.distributed.launch``; before torchrun because
   since PyTorch 2.0 the legacy module *is* torchrun underneath, with the same variables.
2. ``torchrun`` (20).
3. ``slurm`` (30): a task of a job step (``srun``), not an interactive shell.
4. ``spawn`` (1000): nothing else claimed the process: start the workers here.

This module is the interface (:class:`Launcher`, :class:`LaunchOptions`, the choice);
the helpers live beside it: variables and ports in ``engine.launch_env``, local worker
processes in ``engine.processes``.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, ClassVar, Mapping

import attrs

from engine.errors import LaunchError
# A launcher's toolbox, importable from the module that defines its base class (plugins
# written against engine.launcher import them from here).
from engine.launch_env import (START_METHOD_ENV, check_port_free, free_port,  # noqa: F401
                               int_variable, is_local_address, parent_cmdline,
                               require_variables, start_method)
from engine.processes import spawn_workers  # noqa: F401
from engine.world import World, whole_world


@attrs.frozen
class LaunchOptions:
    """What the command line (or the library caller) says about the launch."""

    nproc: int | None = None  # processes on this node (or per SLURM task); None: decide
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str = "env://"
    timeout_s: float = 300.0
    #: ``--local-rank=N`` / ``--local_rank=N``, as torch.distributed.launch passes it.
    local_rank: int | None = None
    #: ``--max-restarts N``: how many times a launcher that starts the workers itself
    #: starts them all again after one fails (spawn, as ``torchrun --max-restarts``).
    max_restarts: int = 0
    #: ``(cpus, source)``: the CPUs the job's scheduler allocated to each task (the
    #: ``engine_cpu_allocation`` hook's answer); None: the affinity mask decides.
    cpu_allocation: tuple[int, str] | None = None


class Launcher:
    name: ClassVar[str] = ""
    #: Detection order when ``--launcher`` is not given: lower numbers are tried first.
    priority: ClassVar[int] = 100
    #: True when this launcher starts the local workers itself (then the CLI process
    #: is not a worker and must not touch torch.distributed). A launcher that decides
    #: at run time (slurm) overrides it with a property.
    spawns: ClassVar[bool] = False
    #: True when the tool that started this process already holds the master port
    #: (torchrun's agent hosts the rendezvous store there): doctor then does not
    #: report the port as taken.
    port_held_by_starter: ClassVar[bool] = False
    #: How the workers are started again after a failure when the engine does not do
    #: it (``--max-restarts`` is refused naming it), or "" when this launcher honours
    #: ``--max-restarts`` itself.
    restarts_with: ClassVar[str] = "the tool that starts the workers"

    def __init__(self, options: LaunchOptions | None = None,
                 environ: Mapping[str, str] | None = None):
        self.options = options or LaunchOptions()
        self.environ = dict(os.environ if environ is None else environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str], options: LaunchOptions) -> bool:
        """True when the environment shows that this launcher started the process."""
        return False

    @classmethod
    def explain_detection(cls, environ: Mapping[str, str], options: LaunchOptions) -> str:
        """One line for ``engine-run doctor``: why detect() says what it says."""
        return ""

    def worlds(self) -> list[World]:
        """The worlds of the worker processes this launcher runs here (checked, not yet
        started): all local processes for spawn, the one process otherwise."""
        raise NotImplementedError

    def all_worlds(self) -> list[World]:
        """Every rank of the run as seen from here, for the world table."""
        return whole_world(self.worlds())

    def launch(self, worker: Callable[[World], object]) -> list | None:
        """Run ``worker(world)`` in every worker process of this node and wait. Returns
        what the workers returned, one entry per local worker (None where it is not
        known): engine-run's workers return the run's status, from which the exit code
        tells a pre-emption apart."""
        (world,) = self.worlds()
        return [worker(world)]

    def variables(self) -> dict[str, str]:
        """The environment variables this launcher reads, as set (for doctor, errors)."""
        return {k: self.environ[k] for k in self.reads if k in self.environ}

    #: Names of the environment variables the launcher reads.
    reads: ClassVar[tuple[str, ...]] = ()


def check_max_restarts(launcher: Launcher) -> None:
    """``--max-restarts N``: a count, for a launcher that restarts its workers itself.
    Refused, not ignored, where another tool started the workers: a run the user
    believes will restart would not."""
    count = launcher.options.max_restarts
    if count < 0:
        raise LaunchError(f"--max-restarts {count} must be >= 0 (0: no restart)")
    if count and launcher.restarts_with:
        raise LaunchError(
            f"--max-restarts is for the spawn launcher; under {launcher.name} the workers "
            f"are started by another tool, so restart them with {launcher.restarts_with}")


def detects(cls: type[Launcher], environ: Mapping[str, str], options: LaunchOptions) -> bool:
    """``cls.detect``; third-party launchers written as ``detect(environ)`` still work."""
    try:
        params = inspect.signature(cls.detect).parameters
    except (TypeError, ValueError):
        params = {}
    if len(params) >= 2:
        return bool(cls.detect(environ, options))
    return bool(cls.detect(environ))


def choose_launcher(registry, name: str, options: LaunchOptions,
                    environ: Mapping[str, str] | None = None) -> Launcher:
    environ = dict(os.environ if environ is None else environ)
    if name and name != "auto":
        return registry.get(name)(options, environ)
    for cls in detection_order(registry):
        if detects(cls, environ, options):
            return cls(options, environ)
    raise LaunchError(
        "no launcher detected and none registered as a fallback; registered: "
        + ", ".join(registry.names())
    )


def detection_order(registry) -> list[type[Launcher]]:
    return [cls for _, cls in sorted(registry.items(), key=lambda item: item[1].priority)]
