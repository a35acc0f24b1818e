"""Launcher ``torchrun``: adopt a worker that torchrun (torch.distributed.run) started.

    torchrun --standalone --nproc-per-node 2 $(which engine-run) RECIPE [k=v ...]
    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port P \\
        --nproc-per-node 2 $(which engine-run) RECIPE                 # on every node
    torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:P --rdzv-id JOB \\
        --nproc-per-node 2 -m engine RECIPE                           # elastic rendezvous

torchrun runs a Python file (``$(which engine-run)`` is one) or, with ``-m``, a module
(``-m engine``). It sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK
(the node rank), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_RUN_ID; its agent already hosts the rendezvous store at
MASTER_ADDR:MASTER_PORT, so there is no port to check here. Each process gets an equal
share of the machine's usable CPUs: LOCAL_WORLD_SIZE processes share them.
"""

from __future__ import annotations

import engine
from engine.errors import LaunchError
from engine.launch_env import int_variable, require_variables
from engine.launcher import Launcher
from engine.world import World, machine_share

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")


class TorchrunLauncher(Launcher):
    name = "torchrun"
    priority = 20
    port_held_by_starter = True  # the agent's rendezvous store
    restarts_with = "torchrun --max-restarts N (on several nodes with a c10d rendezvous)"
    reads = REQUIRED + ("GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")

    @classmethod
    def detect(cls, environ, options) -> bool:
        if environ.get("TORCHELASTIC_RUN_ID"):
            return True
        return all(environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")) and bool(
            environ.get("GROUP_RANK") or environ.get("LOCAL_WORLD_SIZE"))

    @classmethod
    def explain_detection(cls, environ, options) -> str:
        if environ.get("TORCHELASTIC_RUN_ID"):
            return f"TORCHELASTIC_RUN_ID={environ['TORCHELASTIC_RUN_ID']} is set"
        return "no TORCHELASTIC_RUN_ID (not started by torchrun)"

    def worlds(self) -> list[World]:
        env = self.environ
        require_variables(env, REQUIRED, self.name)
        number = {k: int_variable(env, k, self.name) for k in REQUIRED if k != "MASTER_ADDR"}
        world_size, local_world_size = number["WORLD_SIZE"], number["LOCAL_WORLD_SIZE"]
        if local_world_size < 1 or world_size < 1:
            raise LaunchError(
                f"torchrun: WORLD_SIZE={world_size} and LOCAL_WORLD_SIZE={local_world_size} "
                "must both be >= 1")
        if "GROUP_WORLD_SIZE" in env:
            nodes = int_variable(env, "GROUP_WORLD_SIZE", self.name)
            source = f"GROUP_WORLD_SIZE={nodes}"
        else:
            nodes, remainder = divmod(world_size, local_world_size)
            source = f"WORLD_SIZE / LOCAL_WORLD_SIZE = {world_size / local_world_size:g}"
            if remainder:
                nodes = 0  # reported just below
        if nodes < 1 or local_world_size * nodes != world_size:
            raise LaunchError(
                f"torchrun: LOCAL_WORLD_SIZE={local_world_size} x {nodes} node(s) "
                f"({source}) != WORLD_SIZE={world_size}; every node must run "
                "--nproc-per-node processes and --nnodes must match the nodes started"
            )
        rank, local_rank = number["RANK"], number["LOCAL_RANK"]
        node_rank = int_variable(env, "GROUP_RANK", self.name,
                                 default=rank // local_world_size)
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        world = World(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=nodes,
            master_addr=env["MASTER_ADDR"],
            master_port=number["MASTER_PORT"],
            init_method=self.options.init_method,
            launcher=self.name,
            restart_count=int_variable(env, "TORCHELASTIC_RESTART_COUNT", self.name,
                                       default=0),
            run_id="" if run_id == "none" else run_id,  # torchrun's default --rdzv-id
            # The machine's CPUs (its scheduler's allocation: engine_cpu_allocation), shared by the
            # --nproc-per-node processes torchrun started.
            cpus=machine_share(local_world_size, self.options.cpu_allocation),
        )
        world.check()
        return [world]


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add(TorchrunLauncher)
