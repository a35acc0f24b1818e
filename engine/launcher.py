"""Launchers: how the worker processes come into being, and where each one stands.

A launcher either starts the workers itself (``spawn``) or adopts the process it runs
in, reading the variables another tool set (torchrun, SLURM, legacy launch). Either
way it ends by calling ``worker(world)`` once in every worker process.

Detection order, when no launcher is named: the registered launchers sorted by their
``priority`` (lower first), the first whose :meth:`Launcher.detect` is true wins.
``spawn`` has the highest number, so it is the fallback.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, ClassVar, Mapping

import attrs

from engine.errors import LaunchError
from engine.world import World


@attrs.frozen
class LaunchOptions:
    """What the command line (or the library caller) says about the launch."""

    nproc: int | None = None  # processes on this node; None: the launcher decides
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str = "env://"
    timeout_s: float = 300.0


class Launcher:
    name: ClassVar[str] = ""
    #: Detection order when ``--launcher`` is not given: lower numbers are tried first.
    priority: ClassVar[int] = 100
    #: True when this launcher starts the local workers itself (then the CLI process
    #: is not a worker and must not touch torch.distributed).
    spawns: ClassVar[bool] = False

    def __init__(self, options: LaunchOptions, environ: Mapping[str, str] | None = None):
        self.options = options
        self.environ = dict(os.environ if environ is None else environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """True when the environment shows that this launcher started the process."""
        return False

    def worlds(self) -> list[World]:
        """The worlds of the worker processes on this node (checked, not yet started)."""
        raise NotImplementedError

    def launch(self, worker: Callable[[World], None]) -> None:
        """Run ``worker(world)`` in every worker process of this node and wait."""
        (world,) = self.worlds()
        worker(world)

    def variables(self) -> dict[str, str]:
        """The environment variables this launcher read (for ``doctor`` and errors)."""
        return {}


def choose_launcher(registry, name: str, options: LaunchOptions,
                    environ: Mapping[str, str] | None = None) -> Launcher:
    environ = dict(os.environ if environ is None else environ)
    if name and name != "auto":
        return registry.get(name)(options, environ)
    candidates = sorted(registry.items(), key=lambda item: item[1].priority)
    for _, cls in candidates:
        if cls.detect(environ):
            return cls(options, environ)
    raise LaunchError(
        "no launcher detected and none registered as a fallback; registered: "
        + ", ".join(registry.names())
    )


def require_variables(environ: Mapping[str, str], names: list[str], launcher: str) -> None:
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise LaunchError(
            f"launcher {launcher!r} needs the environment variables {', '.join(missing)}, "
            "which are not set"
        )


def int_variable(environ: Mapping[str, str], name: str, launcher: str) -> int:
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise LaunchError(
            f"launcher {launcher!r}: {name}={text!r} is not an integer"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int, option: str = "--master-port") -> None:
    """Fail before starting workers when the master port is taken on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise LaunchError(
                f"master port {port} on {host} is already in use; choose another with "
                f"{option} PORT (or leave it out and a free port is picked)"
            ) from None
