"""What launchers read from and check in their environment: variables, ports,
addresses, and how local worker processes are started.

A launcher plugin reads the variables another tool set (:func:`require_variables`,
:func:`int_variable`), checks a master port before any worker starts
(:func:`check_port_free`, :func:`is_local_address`) and, when it starts workers itself,
starts them the way :func:`start_method` says.
"""

from __future__ import annotations

import os
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

