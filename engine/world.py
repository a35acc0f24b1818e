"""Where one worker process stands: its ranks, its node, how to reach the master, and
the CPUs it may use."""

from __future__ import annotations

import os
import socket
from typing import Mapping, Sequence

import attrs

from engine.errors import LaunchError


@attrs.frozen
class World:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    init_method: str = "env://"
    launcher: str = "unknown"  # the name of the launcher that computed this world
    restart_count: int = 0  # torchrun --max-restarts: how many times we were restarted
    #: Shared by every rank of one run and different between runs (a uuid from spawn,
    #: TORCHELASTIC_RUN_ID, SLURM job.step); "" when the launcher cannot know one.
    run_id: str = ""
    host: str = attrs.field(factory=socket.gethostname)
    #: (host, processes) of every node in node-rank order, where the launcher knows it
    #: (SLURM's nodelist does; torchrun does not). Only used to print the world table.
    layout: tuple[tuple[str, int], ...] = ()
    #: True when the launcher started every local process from one parent with one
    #: CUDA_VISIBLE_DEVICES (spawn), so that the variable says nothing about which GPUs
    #: are a process's own; see engine.parallel.gpus_bound_by_launcher.
    shared_devices: bool = False
    #: The CPUs of each local process, as the launcher counted them (spawn and torchrun:
    #: the machine's share, a SLURM allocation's where there is one; slurm: its task's);
    #: None: the default rule of :meth:`cpu_share`.
    cpus: CpuShare | None = None

    def cpu_share(self) -> CpuShare:
        """The CPUs this process may use, for its torch threads and its DataLoader
        workers alike: the launcher's answer (:attr:`cpus`), else the CPUs this process
        may run on (the affinity mask) shared by the processes of this node."""
        if self.cpus is not None:
            return self.cpus
        return machine_share(self.local_world_size)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank0(self) -> bool:
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def check(self) -> None:
        """Inconsistent numbers are an error before any process group exists."""
        if self.world_size < 1:
            raise LaunchError(f"world size {self.world_size} must be >= 1 ({self.launcher})")
        if not 0 <= self.rank < self.world_size:
            raise LaunchError(
                f"rank {self.rank} is outside world size {self.world_size} ({self.launcher}); "
                f"ranks run from 0 to {self.world_size - 1}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchError(
                f"local rank {self.local_rank} is outside local world size "
                f"{self.local_world_size} ({self.launcher}); local ranks run from 0 to "
                f"{self.local_world_size - 1}"
            )
        if self.local_world_size > self.world_size:
            raise LaunchError(
                f"local world size {self.local_world_size} is larger than world size "
                f"{self.world_size} ({self.launcher})"
            )
        if not 0 <= self.node_rank < self.num_nodes:
            raise LaunchError(
                f"node rank {self.node_rank} is outside {self.num_nodes} node(s) "
                f"({self.launcher}); node ranks run from 0 to {self.num_nodes - 1}"
            )
        if not 0 < self.master_port < 65536:
            raise LaunchError(
                f"master port {self.master_port} is not a valid TCP port (1-65535)")
        check_init_method(self.init_method)

    @property
    def init_url(self) -> str:
        """The init_method URL handed to torch.distributed.init_process_group."""
        if self.init_method == "env://":
            return "env://"
        return self.init_method

    @property
    def rendezvous(self) -> str:
        """Where the ranks meet, for messages: ``host:port`` or the file:// URL."""
        if self.init_method.startswith("file://"):
            return self.init_method
        host, port = tcp_endpoint(self)
        return f"{host}:{port}"


@attrs.frozen
class CpuShare:
    """The CPUs one process may count on, and where that number comes from."""

    #: At least one: it becomes torch.set_num_threads.
    count: int = attrs.field(validator=[attrs.validators.instance_of(int),
                                        attrs.validators.ge(1)])
    reason: str  # for the plan and tune-workers: "8 CPUs (affinity) shared by 2 ..."
    #: ``(cpus, source)``: the CPUs that were shared and where that number came from
    #: (the launching process's oversubscription warning); None where not known.
    shared: tuple[int, str] | None = attrs.field(default=None, eq=False)


def share_cpus(cpus: int, source: str, processes: int) -> CpuShare:
    """``cpus`` (found in ``source``) shared by ``processes`` processes, at least one each."""
    processes = max(1, processes)
    count = max(1, cpus // processes)
    found = f"{cpus} CPU{'s' if cpus != 1 else ''} ({source})"
    if processes == 1:
        return CpuShare(count, f"{found} for this process", (cpus, source))
    return CpuShare(count, f"{found} shared by {processes} local processes = {count} each",
                    (cpus, source))


def usable_cpus(allocation: tuple[int, str] | None = None) -> tuple[int, str]:
    """The CPUs this process may run on, and where that comes from: ``allocation``, the
    ``(cpus, source)`` a scheduler allocated (the ``engine_cpu_allocation`` hook's answer:
    a cluster that does not bind tasks to their CPUs leaves the affinity mask at the whole
    node); else the affinity mask."""
    if allocation is not None:
        return allocation
    try:
        return len(os.sched_getaffinity(0)), "affinity"
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1, "affinity"


def machine_share(processes: int, allocation: tuple[int, str] | None = None) -> CpuShare:
    """This machine's usable CPUs (:func:`usable_cpus`) shared by its ``processes``
    local processes: what spawn and torchrun answer, and the default rule."""
    cpus, source = usable_cpus(allocation)
    return share_cpus(cpus, source, processes)


INIT_METHODS = ("env://", "tcp://HOST:PORT", "file:///shared/path")


def check_init_method(url: str) -> None:
    if url == "env://":
        return
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return
    elif url.startswith("file://") and url[len("file://"):].startswith("/"):
        return
    raise LaunchError(
        f"init method {url!r} is not one of {', '.join(INIT_METHODS)} "
        "(file:// needs an absolute path on a file system every node sees)"
    )


def tcp_endpoint(world: World) -> tuple[str, int]:
    """The host and port of rank 0's store for env:// (the master) or tcp://."""
    if world.init_method.startswith("tcp://"):
        host, _, port = world.init_method[len("tcp://"):].rpartition(":")
        return host.strip("[]"), int(port)
    return world.master_addr, world.master_port


def whole_world(worlds: Sequence[World]) -> list[World]:
    """Every rank of the run as this node sees it before init: the rows of this node
    exactly as the launcher computed them, the other nodes' rows inferred from the
    layout (or from equal node sizes), with host ``?`` where it cannot be known."""
    if not worlds:
        return []
    w = worlds[0]
    if w.layout:
        hosts = [host for host, _ in w.layout]
        sizes = [size for _, size in w.layout]
    elif w.local_world_size * w.num_nodes == w.world_size:
        sizes = [w.local_world_size] * w.num_nodes
        hosts = [w.host if node == w.node_rank else (w.master_addr if node == 0 else "?")
                 for node in range(w.num_nodes)]
    else:
        return list(worlds)
    if sum(sizes) != w.world_size:
        return list(worlds)
    rows = []
    for node, (host, size) in enumerate(zip(hosts, sizes)):
        first = sum(sizes[:node])
        rows.extend(attrs.evolve(w, rank=first + local, local_rank=local, node_rank=node,
                                 local_world_size=size, host=host)
                    for local in range(size))
    mine = {x.rank: x for x in worlds}
    if any(rows[x.rank].node_rank != x.node_rank for x in worlds if x.rank < len(rows)):
        return list(worlds)  # ranks not laid out node by node (srun -m cyclic, say)
    return [mine.get(row.rank, row) for row in rows]


def format_world_table(worlds: Sequence[World],
                       devices: Sequence[str] | Mapping[int, str] | None = None) -> str:
    """One table of the world as detected, printed before init (and when init fails).

    ``devices``: a list aligned with ``worlds``, or a mapping from local rank to device
    (the same on every node).
    """
    header = ("rank", "local", "node", "host", "device", "master")
    rows = [header]
    for i, w in enumerate(worlds):
        if isinstance(devices, Mapping):
            device = devices.get(w.local_rank, "-")
        else:
            device = devices[i] if devices and i < len(devices) else "-"
        rows.append((str(w.rank), str(w.local_rank), str(w.node_rank), w.host, device,
                     w.rendezvous))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip()
                     for row in rows)
