"""Launcher ``spawn``: start the local workers with torch.multiprocessing.

One machine: ``engine-run RECIPE`` starts one process per visible GPU, or 2 on a
CPU-only machine (``--nproc N`` to choose). Several machines, the seeds' "run it on
every node" style: the same command on each node with ``--nnodes N --node-rank R
--master-addr HOST --master-port P``; global rank = node_rank * nproc + local_rank.
"""

from __future__ import annotations

import os
from typing import Callable

import engine
from engine.errors import LaunchError
from engine.launcher import Launcher, check_port_free, free_port
from engine.world import World


def default_nproc() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 2
    import torch

    return torch.cuda.device_count() or 2


class SpawnLauncher(Launcher):
    name = "spawn"
    priority = 1000  # the fallback: nothing else claimed the process
    spawns = True

    @classmethod
    def detect(cls, environ) -> bool:
        return True

    def worlds(self) -> list[World]:
        opts = self.options
        nproc = opts.nproc or default_nproc()
        if nproc < 1:
            raise LaunchError(f"--nproc {nproc} must be >= 1")
        if opts.nnodes < 1 or not 0 <= opts.node_rank < opts.nnodes:
            raise LaunchError(
                f"--node-rank {opts.node_rank} must lie in 0..{opts.nnodes - 1} "
                f"for --nnodes {opts.nnodes}"
            )
        if opts.nnodes > 1 and (not opts.master_addr or not opts.master_port):
            raise LaunchError(
                "spawn on several nodes needs --master-addr HOST and --master-port PORT "
                "(the address of node 0, the same on every node)"
            )
        addr = opts.master_addr or "127.0.0.1"
        port = opts.master_port or self._port
        worlds = [
            World(
                rank=opts.node_rank * nproc + local_rank,
                local_rank=local_rank,
                world_size=opts.nnodes * nproc,
                local_world_size=nproc,
                node_rank=opts.node_rank,
                num_nodes=opts.nnodes,
                master_addr=addr,
                master_port=port,
                init_method=opts.init_method,
                launcher=self.name,
            )
            for local_rank in range(nproc)
        ]
        for w in worlds:
            w.check()
        return worlds

    @property
    def _port(self) -> int:
        # Picked once per launcher so that worlds() is stable between plan and launch.
        if not hasattr(self, "_picked_port"):
            self._picked_port = free_port()
        return self._picked_port

    def launch(self, worker: Callable[[World], None]) -> None:
        worlds = self.worlds()
        if self.options.master_port and worlds[0].node_rank == 0:
            check_port_free(worlds[0].master_addr, self.options.master_port)
        if len(worlds) == 1:
            worker(worlds[0])  # no point in a child process
            return
        import torch.multiprocessing as mp

        try:
            mp.start_processes(_entry, args=(worker, worlds), nprocs=len(worlds),
                               join=True, start_method="spawn")
        except mp.ProcessExitedException as exc:
            raise LaunchError(
                f"worker with local rank {exc.error_index} (rank "
                f"{worlds[exc.error_index].rank}) exited with code {exc.exit_code}"
            ) from None
        except mp.ProcessRaisedException as exc:
            raise LaunchError(f"a worker failed:\n{exc}") from None


def _entry(local_rank: int, worker: Callable[[World], None], worlds: list[World]) -> None:
    worker(worlds[local_rank])


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add("spawn", SpawnLauncher)
