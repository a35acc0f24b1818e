"""What launchers read from and check in their environment: variables, ports,
addresses, and how local worker processes are started.

A launcher plugin reads the variables another tool set (:func:`require_variables`,
:func:`int_variable`), checks a master port before any worker starts
(:func:`check_port_free`, :func:`is_local_address`) and, when it starts workers itself,
starts them the way :func:`start_method` says.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
from typing import Mapping

from engine.errors import LaunchError, warn

# ------------------------------------------------------------------- variables


def require_variables(environ: Mapping[str, str], names: list[str] | tuple[str, ...],
                      launcher: str) -> None:
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise LaunchError(
            f"launcher {launcher!r} needs the environment variables {', '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not set; was this process "
            f"started by {launcher}? (or leave out --launcher to detect)"
        )


def int_variable(environ: Mapping[str, str], name: str, launcher: str,
                 default: int | None = None) -> int:
    text = environ.get(name, "")
    if not text and default is not None:
        return default
    try:
        return int(text)
    except ValueError:
        raise LaunchError(
            f"launcher {launcher!r}: {name}={text!r} is not an integer"
        ) from None


def parent_cmdline() -> list[str]:
    """The command line of the parent process (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


# ------------------------------------------------------------------------ ports


#: free_port draws from the ports below the kernel's ephemeral range down to this one,
#: above those of SLURM jobs (plugins/slurm_hostlist.master_port_for_job: 15000-24999).
LOWEST_FREE_PORT = 25000


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it later (a test's or a user's explicit
    --master-port). It is drawn below the kernel's ephemeral range, whose ports the
    kernel gives to every outgoing connection and so could give away in between; only a
    process that binds this very port can take it. (Where this process hosts the store
    itself, :func:`master_socket` holds the port from the start instead.)"""
    low = ephemeral_low()
    if low - LOWEST_FREE_PORT >= 1000:  # else the kernel picks, below
        draw = random.Random()  # not the global one: a seeded run would draw the same
        for _ in range(64):
            port = draw.randrange(LOWEST_FREE_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))  # a machine whose ephemeral range starts low: the kernel picks
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first of the ports the kernel gives to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def master_socket() -> socket.socket:
    """A socket listening on a port the kernel picks, on every address of this machine:
    the master port of a run whose launcher picks it. Rank 0's store serves on this very
    socket (:func:`keep_store_socket`), so that no other process can take the port
    between the pick and the store's start: a port picked free and bound by rank 0 a
    second later was taken by another process's connection in between, and a CI run
    failed with "master port ... is already in use"."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=socket.SOMAXCONN)
    return socket.create_server(("", 0), backlog=socket.SOMAXCONN)


#: The master socket handed to this process (rank 0's) by its launcher, until its
#: store takes it.
_store_socket: socket.socket | None = None


def keep_store_socket(sock: socket.socket) -> None:
    """Rank 0's process keeps the master socket its launcher bound (:func:`master_socket`)
    for its store to serve on."""
    global _store_socket
    _store_socket = sock


def take_store_socket(port: int) -> int | None:
    """The file descriptor of the master socket this process was handed, if it listens
    on ``port``, for the store to own from now on; else None (the store binds the port)."""
    global _store_socket
    sock, _store_socket = _store_socket, None
    if sock is None:
        return None
    if sock.getsockname()[1] != port:
        sock.close()
        return None
    return sock.detach()


def check_port_free(host: str, port: int, option: str = "--master-port PORT") -> None:
    """Fail before starting workers when the master port is taken on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise LaunchError(
                f"master port {port} on {host} is already in use; choose another with "
                f"{option}"
            ) from None


def is_local_address(host: str) -> bool:
    """True when ``host`` names this machine (then its ports can be checked here)."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return True
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return bool(addresses & mine)


# ---------------------------------------------------------------- start method


#: ``ENGINE_START_METHOD=fork``: the local workers are forked from the launching process
#: instead of started as new interpreters (spawn, the default). A forked worker starts
#: without importing torch again (docs/launchers.md has the cost); the price is that it
#: inherits the launcher's state, which is why spawn stays the default.
START_METHOD_ENV = "ENGINE_START_METHOD"
START_METHODS = ("spawn", "fork")


def start_method(environ: Mapping[str, str] = os.environ) -> str:
    """How local workers are started (``engine.processes.spawn_workers``): ``spawn``
    unless ``ENGINE_START_METHOD`` says ``fork``, and only where :func:`fork_unsafe`
    finds no reason against it (another thread, a thread pool, CUDA); otherwise this
    warns once and spawns."""
    chosen = environ.get(START_METHOD_ENV, "").strip() or "spawn"
    if chosen not in START_METHODS:
        raise LaunchError(f"{START_METHOD_ENV}={chosen!r} is not a start method; expected "
                          f"{' or '.join(START_METHODS)} (the default: spawn)")
    if chosen == "fork":
        reason = fork_unsafe()
        if reason:
            warn(f"{START_METHOD_ENV}=fork: {reason}, and a forked worker could hang; "
                      "starting the workers with spawn")
            return "spawn"
    return chosen


def fork_unsafe() -> str | None:
    """Why this process cannot be forked safely, or None (the warm spare of
    engine/spares.py asks too)."""
    if not hasattr(os, "fork"):
        return "this platform cannot fork"
    if threading.active_count() > 1:
        return f"this process runs {threading.active_count()} Python threads"
    # Native threads: import torch starts one, idle in a futex, which DataLoader's forked
    # workers meet too. More means a pool is running, typically OpenMP's after a tensor
    # operation here: a forked worker that uses more than one thread then hangs in it.
    try:
        native = {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:  # no /proc: nothing to count
        native = set()
    pools = native - {t.native_id for t in threading.enumerate()}
    if len(pools) > 1:
        return (f"this process runs {len(pools)} native threads (a thread pool: tensor "
                "operations ran here before the launch)")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "this process has initialised CUDA"
    return None

