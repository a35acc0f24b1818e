"""Where one worker process stands: its ranks, its node and how to reach the master."""

from __future__ import annotations

import socket

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
    launcher: str = "spawn"
    restart_count: int = 0  # torchrun --max-restarts: how many times we were restarted
    run_id: str = ""
    host: str = attrs.field(factory=socket.gethostname)

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
                f"{self.local_world_size} ({self.launcher})"
            )
        if self.local_world_size > self.world_size:
            raise LaunchError(
                f"local world size {self.local_world_size} is larger than world size "
                f"{self.world_size} ({self.launcher})"
            )
        if not 0 < self.master_port < 65536:
            raise LaunchError(f"master port {self.master_port} is not a valid TCP port")

    @property
    def init_url(self) -> str:
        """The init_method URL handed to torch.distributed.init_process_group."""
        if self.init_method == "env://":
            return "env://"
        return self.init_method


def format_world_table(worlds: list[World], devices: list[str] | None = None) -> str:
    """One table of the world as detected, printed before init (and when init fails)."""
    header = ("rank", "local", "node", "host", "device", "master")
    rows = [header]
    for i, w in enumerate(worlds):
        device = devices[i] if devices and i < len(devices) else "-"
        rows.append((str(w.rank), str(w.local_rank), str(w.node_rank), w.host, device,
                     f"{w.master_addr}:{w.master_port}"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip()
                     for row in rows)
