"""Launcher ``legacy``: adopt a worker started by ``python -m torch.distributed.launch``.

    python -m torch.distributed.launch --nproc-per-node 2 $(which engine-run) RECIPE
    python -m torch.distributed.launch --use_env --nproc-per-node 2 $(which engine-run) RECIPE

Depending on the PyTorch version and ``--use_env``, each worker gets its local rank as
``--local-rank=N`` (PyTorch >= 2.0), ``--local_rank=N`` (older) or only as LOCAL_RANK;
all three are accepted (the CLI takes both spellings of the argument). RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment as always. Before
PyTorch 1.9 there was no LOCAL_WORLD_SIZE: then it is read from the launcher's own
command line (``--nproc-per-node``), or assumed to be WORLD_SIZE (one node).

The module is deprecated: rank 0 says once that torchrun replaces it.
"""

from __future__ import annotations

from typing import Callable

import engine
from engine.errors import LaunchError, warn
from engine.launch_env import int_variable, parent_cmdline, require_variables
from engine.launcher import Launcher
from engine.world import World, machine_share

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LEGACY_MODULE = "torch.distributed.launch"


def started_by_legacy_launch(cmdline: list[str] | None = None) -> bool:
    cmdline = parent_cmdline() if cmdline is None else cmdline
    return any(arg == LEGACY_MODULE or arg.endswith("torch/distributed/launch.py")
               for arg in cmdline)


def option_from_cmdline(cmdline: list[str], *names: str) -> str | None:
    """``--nproc-per-node 2`` or ``--nproc_per_node=2`` from a command line."""
    for i, arg in enumerate(cmdline):
        for name in names:
            if arg == name and i + 1 < len(cmdline):
                return cmdline[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


class LegacyLauncher(Launcher):
    port_held_by_starter = True  # torch.distributed.launch is torchrun underneath
    restarts_with = "python -m torch.distributed.launch --max-restarts N"
    name = "legacy"
    priority = 10  # before torchrun: modern torch.distributed.launch sets its variables
    reads = REQUIRED + ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")

    @classmethod
    def detect(cls, environ, options) -> bool:
        if options is not None and options.local_rank is not None:
            return True  # --local-rank=N: only this launcher passes it
        if started_by_legacy_launch():
            return True  # --use_env on PyTorch >= 1.9: the variables look like torchrun's
        # Before torchelastic (PyTorch < 1.9), --use_env set LOCAL_RANK, RANK and
        # WORLD_SIZE, and none of torchrun's own variables.
        return (bool(environ.get("LOCAL_RANK")) and bool(environ.get("RANK"))
                and bool(environ.get("WORLD_SIZE"))
                and not environ.get("TORCHELASTIC_RUN_ID") and not environ.get("GROUP_RANK"))

    @classmethod
    def explain_detection(cls, environ, options) -> str:
        if options is not None and options.local_rank is not None:
            return f"--local-rank={options.local_rank} on the command line"
        if started_by_legacy_launch():
            return f"the parent process is python -m {LEGACY_MODULE}"
        return "no --local-rank argument, parent is not torch.distributed.launch"

    def worlds(self) -> list[World]:
        env = self.environ
        require_variables(env, REQUIRED, self.name)
        local_rank = self._local_rank()
        rank = int_variable(env, "RANK", self.name)
        world_size = int_variable(env, "WORLD_SIZE", self.name)
        local_world_size, nodes = self._local_world_size(world_size)
        world = World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=int_variable(env, "GROUP_RANK", self.name,
                                   default=rank // local_world_size),
            num_nodes=nodes,
            master_addr=env["MASTER_ADDR"],
            master_port=int_variable(env, "MASTER_PORT", self.name),
            init_method=self.options.init_method,
            launcher=self.name,
            restart_count=int_variable(env, "TORCHELASTIC_RESTART_COUNT", self.name,
                                       default=0),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            # The machine's CPUs (its scheduler's allocation: engine_cpu_allocation), shared by the
            # processes the launch started.
            cpus=machine_share(local_world_size, self.options.cpu_allocation),
        )
        world.check()
        return [world]

    def _local_rank(self) -> int:
        from_arg = self.options.local_rank
        from_env = self.environ.get("LOCAL_RANK")
        if from_arg is None and not from_env:
            raise LaunchError(
                "launcher 'legacy' needs the local rank: a --local-rank=N argument or the "
                "LOCAL_RANK environment variable (python -m torch.distributed.launch "
                "passes one of them), and neither is there")
        if from_arg is not None and from_env and int_variable(
                self.environ, "LOCAL_RANK", self.name) != from_arg:
            raise LaunchError(
                f"launcher 'legacy': --local-rank={from_arg} but LOCAL_RANK={from_env}; "
                "they must agree (was the argument copied from another command?)")
        if from_arg is not None:
            return from_arg
        return int_variable(self.environ, "LOCAL_RANK", self.name)

    def _local_world_size(self, world_size: int) -> tuple[int, int]:
        env = self.environ
        if env.get("LOCAL_WORLD_SIZE"):
            local = int_variable(env, "LOCAL_WORLD_SIZE", self.name)
            source = f"LOCAL_WORLD_SIZE={local}"
        else:
            cmdline = parent_cmdline() if started_by_legacy_launch() else []
            text = option_from_cmdline(cmdline, "--nproc-per-node", "--nproc_per_node")
            local = int(text) if text and text.isdigit() else world_size
            source = (f"--nproc-per-node {local}" if text
                      else f"LOCAL_WORLD_SIZE not set, assuming one node of {local}")
        if local < 1 or world_size % local:
            raise LaunchError(
                f"launcher 'legacy': {source} does not divide WORLD_SIZE={world_size}; "
                "every node must run --nproc-per-node processes")
        return local, world_size // local

    def launch(self, worker: Callable[[World], object]) -> list:
        (world,) = self.worlds()
        if world.is_rank0:
            warn(f"python -m {LEGACY_MODULE} is deprecated and torchrun replaces it: "
                      "torchrun --nproc-per-node N $(which engine-run) RECIPE ... runs the "
                      "same workers (no --local-rank argument, no --use_env needed)")
        return [worker(world)]


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add(LegacyLauncher)
