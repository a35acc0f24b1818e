"""The process group: created with a finite timeout, errors that name the master.

Every wait here is bounded by ``cfg.timeout_s``: a rank that never joins, or dies,
makes the others fail with a message instead of hanging. :func:`init` does what
``init_process_group(init_method=...)`` does in three steps, each failure with its own
message: open the rendezvous store (a TCPStore at the master, or a FileStore); a roll
call through it (naming the ranks that never checked in or disagree about the world
size); ``init_process_group`` on that store, under a key prefix private to this run.

A file:// store is an append-only file, a crashed run's keys in it, that another rank
may already be writing to, so it is never deleted: each run starts a *session* (rank 0
writes a random id, each rank checks in under it with a token, rank 0's confirmation
lists the tokens it accepted). A rank that read a dead run's id never sees its token
confirmed and checks in again; the process group's keys are under ``engine/<session>/pg/``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import re
import socket
import sys
import time
import uuid
from typing import Callable

from engine import health, phases
from engine.atomic_io import process_state
from engine.errors import LaunchError, first_line, one_line
from engine.launch_env import take_store_socket
from engine.processes import end_when_exiting, process_identity, same_machine, spawned_here
from engine.world import World, format_world_table, tcp_endpoint, whole_world

# torch is imported inside the functions that use it: the launching process imports
# this module (through the dcp plugin, engine.api) and must not pay for torch.

#: How often a waiting rank re-reads the session id (a stale file's is replaced).
POLL_S = 0.5
#: How long a failing rank 0 keeps its store up for the others to read why.
ACK_WAIT_S = 3.0
SESSION_KEY = "engine/session"
#: A rank still waiting for the master after this long says so, once, with the wall
#: clock time it gives up at: timeout_s (300 s by default) of silence looks like a hang.
NOTICE_AFTER_S = 5.0


def init(world: World, backend: str, timeout_s: float) -> None:
    """Create the default process group, or raise a one-line LaunchError in time."""
    import torch.distributed as dist

    phases.mark("seed, threads, device")
    if world.init_method == "env://":
        # Code that reads them (and torch's own env:// handler) sees what we use.
        os.environ["MASTER_ADDR"] = world.master_addr
        os.environ["MASTER_PORT"] = str(world.master_port)
    try:
        store = open_store(world, timeout_s)
        session = roll_call(store, world, timeout_s)
    except LaunchError:
        print_failure_table(world, backend)
        raise
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend=backend, store=dist.PrefixStore(
                                    f"engine/{session}/pg/", store),
                                rank=world.rank, world_size=world.world_size,
                                timeout=timeout)
    except Exception as exc:
        print_failure_table(world, backend)
        raise LaunchError(
            f"rank {world.rank}: process group init ({backend}) via {world.rendezvous} "
            f"failed within {timeout_s:g}s ({gloo_text(one_line(exc))}); "
            f"all {world.world_size} ranks had checked in, so look at the network between "
            "the hosts (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)"
        ) from None
    health.prepare(dist.PrefixStore(f"engine/{session}/health/", store))
    phases.mark("process group")


def gloo_text(line: str) -> str:
    """gloo's error without its source file and its advice: ``[.../pair.cc:561] Connection
    closed by peer [127.0.0.1]:1. This is typically caused by ... GLHF!`` is ``Connection
    closed by peer [127.0.0.1]:1``, in summary.json's ``error`` as on the console."""
    return re.sub(r"\[[^\]\s]+\.cc:\d+\] ", "", line).split(". This is typically caused")[0]


def print_failure_table(world: World, backend: str) -> None:
    """The world table, printed by rank 0 whenever init fails."""
    if world.is_rank0:
        table = whole_world([world])
        devices = {w.local_rank: (f"cuda:{w.local_rank}" if backend == "nccl" else "cpu")
                   for w in table}
        print("world (as rank 0 saw it when init failed):\n" +
              format_world_table(table, devices), file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- store


def open_store(world: World, timeout_s: float):
    """The rendezvous store every rank of ``world`` shares."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if world.init_method.startswith("file://"):
        path = pathlib.Path(world.init_method[len("file://"):])
        if not path.parent.is_dir():
            raise LaunchError(
                f"file:// rendezvous {path}: the folder {path.parent} does not exist; give "
                "a path on a file system that every node sees, e.g. file:///shared/rdzv")
        return dist.FileStore(str(path), world.world_size)
    host, port = tcp_endpoint(world)
    if world.rank == 0 and not agent_store_serves(host, port):
        try:
            # wait_for_workers=False: the roll call below waits, and can say who is missing.
            # A launcher that picked the port bound it already (launch_env.master_socket).
            return dist.TCPStore(host, port, world.world_size, is_master=True,
                                 timeout=timeout, wait_for_workers=False, multi_tenant=True,
                                 master_listen_fd=take_store_socket(port))
        except Exception as exc:
            text = first_line(exc)
            if "in use" in text.lower():
                raise LaunchError(
                    f"rank 0: master port {port} on {world.host} is already in use; choose "
                    "another with --master-port PORT or MASTER_PORT=PORT"
                ) from None
            raise LaunchError(
                f"rank 0: cannot host the rendezvous at {host}:{port} "
                f"({type(exc).__name__}: {text}); check --master-addr/MASTER_ADDR: it must "
                "name this host"
            ) from None
    wait_reachable(world, host, port, timeout_s)
    try:
        return dist.TCPStore(host, port, world.world_size, is_master=False, timeout=timeout)
    except Exception as exc:
        raise LaunchError(
            f"rank {world.rank}: cannot reach the master at {host}:{port} within "
            f"{timeout_s:g}s ({one_line(exc)}); check that rank 0 "
            "runs there, that the address resolves and the port is open from this host "
            "(--master-addr/MASTER_ADDR, --master-port/MASTER_PORT)"
        ) from None


def wait_reachable(world: World, host: str, port: int, timeout_s: float) -> None:
    """Knock until the master's port answers. torch's own client retries the same way,
    but logs a C++ stack trace for every attempt; this says it in one line."""
    deadline = time.monotonic() + timeout_s
    patience = Patience(deadline, timeout_s)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise LaunchError(
            f"rank {world.rank}: the master address {host!r} does not resolve ({exc}); "
            "check --master-addr/MASTER_ADDR"
        ) from None
    problem = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port),
                                          timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            problem = exc.strerror or type(exc).__name__
            patience.check(f"rank {world.rank}: waiting for the master at {host}:{port} "
                           f"({problem})")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    raise LaunchError(
        f"rank {world.rank}: cannot reach the master at {host}:{port} within "
        f"{timeout_s:g}s (last attempt: {problem}); check that rank 0 runs there, that "
        "the port is open from this host and that --master-addr/MASTER_ADDR and "
        "--master-port/MASTER_PORT are the same on every node"
    )


class Patience:
    """Says once, :data:`NOTICE_AFTER_S` into a wait, what this rank waits for and until
    when (the local wall clock time), then lets the wait go on."""

    def __init__(self, deadline: float, timeout_s: float):
        self.deadline, self.timeout_s = deadline, timeout_s
        self.notice_at = time.monotonic() + NOTICE_AFTER_S

    def check(self, waiting_for: str | Callable[[], str]) -> None:
        """``waiting_for``: what is awaited (a callable: called only to print the line)."""
        now = time.monotonic()
        if now < self.notice_at or now >= self.deadline:
            return
        self.notice_at = float("inf")
        if callable(waiting_for):
            waiting_for = waiting_for()
        until = time.strftime("%H:%M:%S %Z",
                              time.localtime(time.time() + self.deadline - now))
        print(f"{waiting_for}, until {until} (timeout_s={self.timeout_s:g})",
              file=sys.stderr, flush=True)


def agent_store_serves(host: str, port: int) -> bool:
    """torchrun's agent (and torch.distributed.launch's) already hosts the store at its
    own MASTER_ADDR:MASTER_PORT; then every rank, rank 0 included, is a client."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("MASTER_ADDR") == host
            and os.environ.get("MASTER_PORT") == str(port))


# --------------------------------------------------------------------- roll call


def roll_call(store, world: World, timeout_s: float) -> str:
    """Every rank checks in; returns the session id shared by all of them."""
    deadline = time.monotonic() + timeout_s
    token = uuid.uuid4().hex
    entry = json.dumps({"token": token, "host": world.host, "pid": os.getpid(),
                        "process": process_identity(os.getpid()),
                        "world_size": world.world_size})
    try:
        if world.rank == 0:
            return _lead_roll_call(store, world, deadline, timeout_s, entry)
        return _join_roll_call(store, world, deadline, timeout_s, entry, token)
    except LaunchError:
        raise
    except Exception as exc:  # the store went away: rank 0 stopped (and says why)
        raise LaunchError(
            f"rank {world.rank}: lost the rendezvous at {world.rendezvous} "
            f"({one_line(exc)}); rank 0 stopped, see its error"
        ) from None


def _lead_roll_call(store, world: World, deadline: float, timeout_s: float, entry: str
                    ) -> str:
    session = uuid.uuid4().hex[:16]
    keys = [f"engine/{session}/rank/{r}" for r in range(world.world_size)]
    store.set(keys[0], entry)
    store.set(SESSION_KEY, session)

    def missing() -> list[int]:
        return [r for r, key in enumerate(keys) if not store.check([key])]

    def waiting_for() -> str:
        return (f"rank 0: waiting for {_ranks(missing())} of {world.world_size} to join "
                f"the rendezvous at {world.rendezvous}")

    patience = Patience(deadline, timeout_s)
    if not health.poll_keys(store, keys, deadline, lambda: patience.check(waiting_for)):
        missing = missing()
        _fail(store, world, session, keys,
              f"{_ranks(missing)} of {world.world_size} never joined the rendezvous at "
              f"{world.rendezvous} within {timeout_s:g}s (timeout_s); check that every "
              "rank was started, with the same world size and master, and can reach it")
    entries = {r: json.loads(store.get(key)) for r, key in enumerate(keys)}
    disagree = {r: e["world_size"] for r, e in entries.items()
                if e["world_size"] != world.world_size}
    if disagree:
        _fail(store, world, session, keys,
              f"the ranks disagree about the world size: rank 0 has {world.world_size}, " +
              ", ".join(f"rank {r} has {ws}" for r, ws in sorted(disagree.items())) +
              " (check WORLD_SIZE / --nnodes / --nproc on every node)")
    tokens = [entries[r]["token"] for r in sorted(entries)]
    store.set(f"engine/{session}/verdict", json.dumps({"ok": True, "tokens": tokens}))
    _note_local_peers(world, entries)
    return session


def _fail(store, world: World, session: str, keys: list[str], message: str) -> None:
    """Tell the ranks that did check in why the run stops, then stop rank 0."""
    joined = [k for k in keys[1:] if store.check([k])]
    tokens = [json.loads(store.get(k))["token"] for k in joined]
    store.set(f"engine/{session}/verdict",
              json.dumps({"ok": False, "message": message, "tokens": tokens}))
    # Rank 0's TCPStore dies with it: give the others a moment to read the verdict.
    acks = [f"engine/{session}/read/{k.rsplit('/', 1)[1]}" for k in joined]
    health.poll_keys(store, acks, time.monotonic() + ACK_WAIT_S)
    raise LaunchError(f"rank 0: {message}")


def _join_roll_call(store, world: World, deadline: float, timeout_s: float, entry: str,
                    token: str) -> str:
    joined = None
    patience = Patience(deadline, timeout_s)
    waiting_for = (f"rank {world.rank}: waiting for rank 0 to complete the rendezvous at "
                   f"{world.rendezvous}")
    while health.poll_keys(store, [SESSION_KEY], deadline,
                           lambda: patience.check(waiting_for)):
        session = store.get(SESSION_KEY).decode()
        if session != joined:
            store.set(f"engine/{session}/rank/{world.rank}", entry)
            joined = session
        verdict_key = f"engine/{session}/verdict"
        if not health.poll_keys(store, [verdict_key],
                                min(deadline, time.monotonic() + POLL_S),
                                lambda: patience.check(waiting_for)):
            continue
        verdict = json.loads(store.get(verdict_key))
        if token not in verdict["tokens"]:
            time.sleep(POLL_S)  # a dead run's session: wait for the live one's id
            continue
        store.set(f"engine/{session}/read/{world.rank}", "1")
        if not verdict["ok"]:
            raise LaunchError(f"rank {world.rank}: rank 0 reports: {verdict['message']}")
        # Rank 0 is the one rank another rank can find missing (health.missing_ranks).
        _note_local_peers(world, {0: json.loads(store.get(f"engine/{session}/rank/0"))})
        return session
    raise LaunchError(
        f"rank {world.rank}: rank 0 did not complete the rendezvous at {world.rendezvous} "
        f"within {timeout_s:g}s (timeout_s); check that rank 0 was started, with the same "
        "world size and master"
    )


#: The other ranks' processes on this machine, from the roll call: rank -> (pid,
#: identity). Rank 0 knows every rank's; the others know rank 0's.
_local_peers: dict[int, tuple[int, str]] = {}


def _note_local_peers(world: World, entries: dict[int, dict]) -> None:
    _local_peers.clear()
    for rank, entry in entries.items():
        identity = entry.get("process", "")
        if rank != world.rank and identity and same_machine(identity):
            _local_peers[rank] = (entry["pid"], identity)


def stopped_local_peers(ranks: list[int]) -> list[int]:
    """Of ``ranks`` (found missing after a failed collective), those whose process runs
    on this machine and is stopped (SIGSTOP, a debugger). Unless this process's launcher
    watches its siblings (spawn), each is killed as this rank exits, so that the launcher
    ends the job within timeout_s plus a few seconds (elsewhere: its launcher decides)."""
    stopped = [r for r in ranks if r in _local_peers
               and process_state(_local_peers[r][0]) in ("T", "t")]
    if not spawned_here():
        for rank in stopped:
            end_when_exiting(*_local_peers[rank])
    return stopped


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {', '.join(map(str, ranks[:8]))}... ({len(ranks)} ranks)"
    return f"ranks {', '.join(map(str, ranks))}"


# ---------------------------------------------------------------- collectives


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_initialized():
        import torch.distributed as dist

        dist.barrier()


@contextlib.contextmanager
def local_rank0_first(world: World):
    """Local rank 0 runs the body first (a download, say); the others run it after."""
    if not world.is_local_rank0:
        barrier()
    yield
    if world.is_local_rank0:
        barrier()


def all_reduce_sum(tensor):
    if is_initialized():
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class Reduction:
    """An all-reduce (sum) started without waiting for it. ``values()`` waits (bounded by
    the group's timeout) and reads the sums back: one log window later, at no cost."""

    __slots__ = ("tensor", "work")

    def __init__(self, tensor, work):
        self.tensor, self.work = tensor, work

    def values(self) -> list[float]:
        if self.work is not None:
            self.work.wait()
        return self.tensor.tolist()


def start_all_reduce_sum(tensor) -> Reduction:
    """Start summing ``tensor`` (in place) over all ranks (a collective)."""
    work = None
    if is_initialized():
        import torch.distributed as dist

        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return Reduction(tensor, work)


def all_gather_tensor(tensor):
    """Every rank's ``tensor``, stacked along a new first dimension, in one collective."""
    if not is_initialized():
        return tensor.unsqueeze(0)
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return torch.stack(out)


def gather_tensor(tensor, dst: int = 0):
    """Every rank's ``tensor`` stacked on rank ``dst``, None on the others."""
    if not is_initialized():
        return tensor.unsqueeze(0)
    import torch
    import torch.distributed as dist

    here = dist.get_rank() == dst
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if here else None
    dist.gather(tensor, out, dst=dst)
    return torch.stack(out) if here else None


def broadcast_object(obj, src: int = 0):
    if not is_initialized():
        return obj
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def broadcast_tensor(tensor, src: int = 0):
    """``tensor`` from rank ``src`` on every rank (in place), on :func:`collective_device`."""
    if is_initialized():
        import torch.distributed as dist

        dist.broadcast(tensor, src=src)
    return tensor


def collective_device():
    """Where the process group's tensors must be: this rank's GPU under NCCL, else CPU."""
    import torch

    if is_initialized():
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj) -> list:
    if not is_initialized():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def first_problem(problem: str | None) -> tuple[int, str] | None:
    """Collective: the first rank with a ``problem``, and it; None where no rank has one.
    One all-reduce of a flag; every rank's problem is gathered only where a rank has one."""
    import torch

    flag = torch.tensor([problem is not None], dtype=torch.int32, device=collective_device())
    if all_reduce_sum(flag).item():
        return next((r, p) for r, p in enumerate(all_gather_object(problem)) if p is not None)
    return None


def gather_object(obj, dst: int = 0) -> list | None:
    if not is_initialized():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def destroy() -> None:
    if is_initialized():
        import torch.distributed as dist

        health.release()
        dist.destroy_process_group()
        phases.mark("process group destroyed")
