"""Launcher ``spawn``: start the local workers with torch.multiprocessing.

One machine: ``engine-run RECIPE`` starts one process per visible GPU, or 2 on a
CPU-only machine (``--nproc N`` to choose). Several machines, the seeds' "run it on
every node" style: the same command on each node with ``--nnodes N --node-rank R
--master-addr HOST --master-port P``; global rank = node_rank * nproc + local_rank.
Each process gets an equal share of this machine's usable CPUs (the SLURM allocation
when engine-run runs in a batch script, else the affinity mask): the world's ``cpus``.

``--max-restarts N`` (one machine): when a worker fails, the others are stopped and all
start again, up to N times, as ``torchrun --max-restarts`` does: each attempt's worlds
carry ``restart_count`` and a fresh master port, and the workers resume from the run's
newest snapshot (its folder and lock stay: this process holds the lock throughout).
With restarts, every worker is a fork of a warm spare started before the first one
(engine/spares.py), so that a restart forks a ready process instead of a new
interpreter importing torch; a spare that forks nothing, dies or stops is one warning,
then spawn.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from typing import Callable

import attrs

import engine
from engine.errors import LaunchError, WorkerFailed, warn
from engine.launch_env import check_port_free, is_local_address, master_socket, start_method
from engine.launcher import Launcher
from engine.processes import spawn_workers
from engine.world import World, machine_share, tcp_endpoint

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


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
    restarts_with = ""  # --max-restarts N: launch() restarts the workers itself
    reads = ("CUDA_VISIBLE_DEVICES", "ENGINE_RUN_ID")

    @classmethod
    def detect(cls, environ, options) -> bool:
        return True

    @classmethod
    def explain_detection(cls, environ, options) -> str:
        return "the fallback: starts the workers on this machine"

    def worlds(self) -> list[World]:
        opts = self.options
        nproc = default_nproc() if opts.nproc is None else opts.nproc
        if nproc < 1:
            raise LaunchError(f"--nproc {nproc} must be >= 1")
        if opts.nnodes < 1:
            raise LaunchError(f"--nnodes {opts.nnodes} must be >= 1")
        if not 0 <= opts.node_rank < opts.nnodes:
            raise LaunchError(
                f"--node-rank {opts.node_rank} must lie in 0..{opts.nnodes - 1} "
                f"for --nnodes {opts.nnodes}"
            )
        if opts.nnodes > 1 and opts.max_restarts:
            raise LaunchError(
                f"--max-restarts {opts.max_restarts} with spawn on {opts.nnodes} nodes: each "
                "node would restart its own workers, which cannot rejoin the other nodes' "
                "run; use torchrun --max-restarts N with a c10d rendezvous "
                "(docs/launchers.md#torchrun)")
        if (opts.nnodes > 1 and opts.init_method == "env://"
                and (not opts.master_addr or not opts.master_port)):
            raise LaunchError(
                "spawn on several nodes needs --master-addr HOST and --master-port PORT "
                "(the address of node 0 and a free port there, the same on every node), "
                "or --init-method tcp://HOST:PORT or file:///shared/path"
            )
        addr = opts.master_addr or "127.0.0.1"
        port = opts.master_port or self._port
        host = socket.gethostname()
        layout = tuple((host if node == opts.node_rank else (addr if node == 0 else "?"),
                        nproc) for node in range(opts.nnodes))
        # This machine's CPUs (its scheduler's allocation: engine_cpu_allocation), shared.
        cpus = machine_share(nproc, opts.cpu_allocation)
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
                shared_devices=True,  # the children inherit this process's variables
                run_id=self._run_id,
                host=host,
                layout=layout,
                cpus=cpus,
            )
            for local_rank in range(nproc)
        ]
        for w in worlds:
            w.check()
        return worlds

    @property
    def _port(self) -> int:
        # Picked once per launcher so that worlds() is stable between plan and launch:
        # the port of a socket listening from now on, which rank 0's store takes over.
        if not hasattr(self, "_picked_port"):
            self._store_socket = master_socket()
            self._picked_port = self._store_socket.getsockname()[1]
        return self._picked_port

    @property
    def port_held_by_starter(self) -> bool:
        """Whether this launcher picked the master port (worlds() did): it holds the
        port from the pick on (doctor does not report it as taken)."""
        return getattr(self, "_store_socket", None) is not None

    def _master_port_ready(self, first: World):
        """The socket of the master port this launcher picked (bound since the pick),
        to hand to rank 0; None where the user chose the port, once it is checked free."""
        sock, self._store_socket = getattr(self, "_store_socket", None), None
        if sock is not None and first.init_method == "env://":
            return sock
        if sock is not None:
            sock.close()  # tcp:// or file:// chose the rendezvous, not the picked port
        _check_master_port(first)
        return None

    @property
    def _run_id(self) -> str:
        # One machine: this process starts every rank, so a fresh id is shared by all.
        # Several machines: only the user can give all nodes the same id.
        if self.options.nnodes > 1:
            return self.environ.get("ENGINE_RUN_ID", "")
        if not hasattr(self, "_picked_run_id"):
            self._picked_run_id = uuid.uuid4().hex[:12]
        return self._picked_run_id

    def launch(self, worker: Callable[[World], object]) -> list:
        worlds, most = self.worlds(), self.options.max_restarts
        if len(worlds) == 1 and not most:
            store_socket = self._master_port_ready(worlds[0])
            if store_socket is not None:
                store_socket.close()  # a run of one process opens no store
            return [worker(worlds[0])]  # no point in a child process
        # With restarts, every worker is a fork of a warm spare (engine/spares.py),
        # started now: a restart then forks a ready process instead of a new
        # interpreter that imports torch. Where the user chose to fork the workers
        # from this process (ENGINE_START_METHOD=fork), it is the warm process: the
        # replacements are its forks too, and a zygote would only add an interpreter.
        spares = _spares_for(worker) if most and start_method() != "fork" else None
        spare_error = type(spares).error if spares is not None else ()
        restart = 0
        try:
            while True:
                try:
                    return spawn_workers(worker, worlds, spares=spares,
                                         restart_follows=restart < most,
                                         store_socket=self._master_port_ready(worlds[0]))
                except WorkerFailed as failed:
                    if restart == most or not failed.restartable:
                        raise  # the error and exit code of a run without restarts
                    restart += 1
                    if spares is not None and not spares.serving():
                        spares = None  # it said so once: spawn from now on
                    which = (f"all {len(worlds)} workers" if len(worlds) > 1
                             else "the worker")
                    how = " from the warm spare" if spares is not None else ""
                    print(f"{failed.failure}; restarting {which}{how} (restart {restart} "
                          f"of {most})", file=sys.stderr, flush=True)
                except spare_error as exc:
                    warn(f"{exc}; starting the workers with spawn instead")
                    spares.close()
                    spares = None
                    worlds = self._restarted(worlds, restart)  # its port went with it
                    continue  # no worker ran: not a restart
                worlds = self._restarted(worlds, restart)
                if hasattr(worker, "restarted"):  # a job (engine.launching.Worker): it
                    worker = worker.restarted()  # resumes, never starts afresh again
        finally:
            if spares is not None:
                spares.close()

    def _restarted(self, worlds: list[World], count: int) -> list[World]:
        """The worlds of restart ``count``: torchrun's TORCHELASTIC_RESTART_COUNT, and
        a fresh port where this launcher picked the last one (the dead rank 0's store
        may linger on it)."""
        port = worlds[0].master_port
        if self.options.master_port is None:
            self._store_socket = master_socket()
            port = self._store_socket.getsockname()[1]
        return [attrs.evolve(w, restart_count=count, master_port=port) for w in worlds]


def _spares_for(worker):
    """The warm spare of a launch with restarts (an engine.spares.SparePool): it
    preloads the job's plugins (-p), and the recipe's module when the job names a
    recipe file (engine-run's, engine.fit's with a path)."""
    from engine.spares import SparePool  # only with restarts: multiprocessing's parts

    recipe = getattr(worker, "recipe", None)
    return SparePool(recipe if isinstance(recipe, str) else None,
                     getattr(worker, "plugins", ()))


def _check_master_port(first: World) -> None:
    """A master port already taken on this machine, reported before any worker starts."""
    if first.node_rank == 0 and not first.init_method.startswith("file://"):
        host, port = tcp_endpoint(first)
        # Only an address of this machine can be checked here; rank 0's store reports
        # a port taken elsewhere when it starts.
        if is_local_address(host):
            option = ("--init-method tcp://HOST:PORT" if first.init_method != "env://"
                      else "--master-port PORT (or leave it out and a free port is "
                           "picked)")
            check_port_free(host, port, option)


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add(SpawnLauncher)
