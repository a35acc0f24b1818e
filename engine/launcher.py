"""Launchers: how the worker processes come into being, and where each one stands.

A launcher either starts the workers itself (``spawn``, and ``slurm`` with one task per
node) or adopts the process it runs in, reading the variables another tool set
(torchrun, SLURM, legacy launch). Either way it ends by calling ``worker(world)`` once
in every worker process, and it checks the numbers (ranks, sizes, node lists, ports)
before any process group exists.

Detection order, when ``--launcher`` is not given (the registered launchers sorted by
``priority``, lower first; the first whose :meth:`Launcher.detect` is true wins):

1. ``legacy`` (10): ``python -m torch.distributed.launch``: a ``--local-rank=N`` /
   ``--local_rank=N`` argument, a parent process that is ``torch.distributed.launch``,
   or LOCAL_RANK with RANK and WORLD_SIZE but no TORCHELASTIC_RUN_ID. It comes before
   torchrun because since PyTorch 2.0 the legacy module *is* torchrun underneath and
   sets the same variables; only these signs tell the two apart.
2. ``torchrun`` (20): TORCHELASTIC_RUN_ID, or RANK + LOCAL_RANK + WORLD_SIZE together
   with torchrun's own GROUP_RANK / LOCAL_WORLD_SIZE.
3. ``slurm`` (30): a task of a job step (``srun``): SLURM_STEP_ID and SLURM_PROCID set.
   Not inside an interactive allocation (a ``salloc`` shell has no step; an interactive
   step, or a job named ``bash``/``interactive``, is a shell, not a training task) and
   not in the batch script itself: there ``--launcher slurm`` asks for it anyway.
4. ``spawn`` (1000): nothing else claimed the process: start the workers here.

Third-party launchers slot in by priority. ``engine-run doctor`` shows what each
launcher made of the environment.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import sys
from typing import Callable, ClassVar, Mapping, NoReturn

import attrs

from engine.errors import LaunchError, WorkerFailed
from engine.world import World, whole_world


@attrs.frozen
class LaunchOptions:
    """What the command line (or the library caller) says about the launch."""

    nproc: int | None = None  # processes on this node (or per SLURM task); None: decide
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str = "env://"
    timeout_s: float = 300.0
    #: ``--local-rank=N`` / ``--local_rank=N``, as torch.distributed.launch passes it.
    local_rank: int | None = None


class Launcher:
    name: ClassVar[str] = ""
    #: Detection order when ``--launcher`` is not given: lower numbers are tried first.
    priority: ClassVar[int] = 100
    #: True when this launcher starts the local workers itself (then the CLI process
    #: is not a worker and must not touch torch.distributed). A launcher that decides
    #: at run time (slurm) overrides it with a property.
    spawns: ClassVar[bool] = False
    #: True when the tool that started this process already holds the master port
    #: (torchrun's agent hosts the rendezvous store there): doctor then does not
    #: report the port as taken.
    port_held_by_starter: ClassVar[bool] = False

    def __init__(self, options: LaunchOptions | None = None,
                 environ: Mapping[str, str] | None = None):
        self.options = options or LaunchOptions()
        self.environ = dict(os.environ if environ is None else environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str], options: LaunchOptions) -> bool:
        """True when the environment shows that this launcher started the process."""
        return False

    @classmethod
    def explain_detection(cls, environ: Mapping[str, str], options: LaunchOptions) -> str:
        """One line for ``engine-run doctor``: why detect() says what it says."""
        return ""

    def worlds(self) -> list[World]:
        """The worlds of the worker processes this launcher runs here (checked, not yet
        started): all local processes for spawn, the one process otherwise."""
        raise NotImplementedError

    def all_worlds(self) -> list[World]:
        """Every rank of the run as seen from here, for the world table."""
        return whole_world(self.worlds())

    def launch(self, worker: Callable[[World], object]) -> list | None:
        """Run ``worker(world)`` in every worker process of this node and wait. Returns
        what the workers returned, one entry per local worker (None where it is not
        known): engine-run's workers return the run's status, from which the exit code
        tells a pre-emption apart."""
        (world,) = self.worlds()
        return [worker(world)]

    def variables(self) -> dict[str, str]:
        """The environment variables this launcher reads, as set (for doctor, errors)."""
        return {k: self.environ[k] for k in self.reads if k in self.environ}

    #: Names of the environment variables the launcher reads.
    reads: ClassVar[tuple[str, ...]] = ()


def detects(cls: type[Launcher], environ: Mapping[str, str], options: LaunchOptions) -> bool:
    """``cls.detect``; third-party launchers written as ``detect(environ)`` still work."""
    try:
        params = inspect.signature(cls.detect).parameters
    except (TypeError, ValueError):
        params = {}
    if len(params) >= 2:
        return bool(cls.detect(environ, options))
    return bool(cls.detect(environ))


def choose_launcher(registry, name: str, options: LaunchOptions,
                    environ: Mapping[str, str] | None = None) -> Launcher:
    environ = dict(os.environ if environ is None else environ)
    if name and name != "auto":
        return registry.get(name)(options, environ)
    for cls in detection_order(registry):
        if detects(cls, environ, options):
            return cls(options, environ)
    raise LaunchError(
        "no launcher detected and none registered as a fallback; registered: "
        + ", ".join(registry.names())
    )


def detection_order(registry) -> list[type[Launcher]]:
    return [cls for _, cls in sorted(registry.items(), key=lambda item: item[1].priority)]


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


# ---------------------------------------------------------------- local workers


#: Signals the parent passes on to its workers: SIGUSR1 is SLURM's pre-emption warning
#: (sbatch --signal=USR1@90), SIGTERM a polite stop. The workers decide what to do.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
#: What a worker killed by a signal most likely met.
SIGNAL_CAUSES = {
    "SIGKILL": "the out-of-memory killer, or kill -9",
    "SIGUSR1": "a pre-emption request it did not act on: sent before its handler was "
               "installed, or a second request",
    "SIGTERM": "a pre-emption or stop request it did not act on: sent before its "
               "handler was installed, or a second request",
    "SIGSEGV": "a crash in native code",
    "SIGABRT": "a crash in native code",
}


def _start_resource_tracker_deaf_to(signals) -> None:
    """multiprocessing's resource tracker (a helper process for shared memory and
    semaphores) runs in our process group: a pre-emption signal sent to the group would
    kill it (the default action), and it would come back printing tracebacks. Start it
    now with those signals ignored; an ignored signal stays ignored across its exec."""
    from multiprocessing import resource_tracker

    try:
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signals}
    except ValueError:  # not the main thread: leave it to multiprocessing
        return
    try:
        resource_tracker.ensure_running()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


#: ``ENGINE_START_METHOD=fork``: the local workers are forked from the launching process
#: instead of started as new interpreters (spawn, the default). A forked worker starts in
#: milliseconds where a spawned one imports torch again (2-5 s on a small machine); the
#: price is that it inherits the launcher's state, which is why spawn stays the default.
START_METHOD_ENV = "ENGINE_START_METHOD"
START_METHODS = ("spawn", "fork")


def start_method(environ: Mapping[str, str] = os.environ) -> str:
    """How :func:`spawn_workers` starts processes: ``spawn`` unless ``ENGINE_START_METHOD``
    says ``fork``, and only where :func:`_fork_unsafe` finds no reason against it (another
    thread, a thread pool, CUDA); otherwise this warns once and spawns."""
    chosen = environ.get(START_METHOD_ENV, "").strip() or "spawn"
    if chosen not in START_METHODS:
        raise LaunchError(f"{START_METHOD_ENV}={chosen!r} is not a start method; expected "
                          f"{' or '.join(START_METHODS)} (the default: spawn)")
    if chosen == "fork":
        reason = _fork_unsafe()
        if reason:
            warn_once(f"{START_METHOD_ENV}=fork: {reason}, and a forked worker could hang; "
                      "starting the workers with spawn")
            return "spawn"
    return chosen


def _fork_unsafe() -> str | None:
    """Why this process cannot be forked safely, or None."""
    if not hasattr(os, "fork"):
        return "this platform cannot fork"
    import threading

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


def spawn_workers(worker: Callable[[World], object], worlds: list[World],
                  child_env: Mapping[str, str] | None = None) -> list:
    """Start one process per world on this machine, run ``worker`` in each, wait.

    ``child_env`` is set in every child before ``worker`` runs. A worker that fails
    stops the others (torch does that) and becomes one :class:`WorkerFailed` here,
    with the worker's exit code. Returns each worker's return value where it is a short
    string (a run's status), else None.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    method = start_method()
    _start_resource_tracker_deaf_to(FORWARDED_SIGNALS)
    results = multiprocessing.get_context(method).SimpleQueue()
    context = mp.start_processes(_entry, args=(worker, worlds, dict(child_env or {}),
                                               results, method == "fork"),
                                 nprocs=len(worlds), join=False, start_method=method)

    def forward(signum, frame):
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {}
    try:
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    except ValueError:  # not the main thread: the workers get signals from their group
        pass
    failed, stopped, lingering = None, [], []
    try:
        while not context.join(timeout=0, grace_period=GRACE_S):
            failed = _wait_for_a_failure(context.processes, timeout=1.0)
            if failed is not None:
                stopped, lingering = _stop_the_others(context.processes)
    except mp.ProcessExitedException as exc:
        # A worker that raised printed its error itself; one that was killed could not.
        # The one that stopped answering goes last: that line is the one users read.
        index = failed if failed is not None else exc.error_index
        code = context.processes[index].exitcode
        signal_name = _signal_name(code)
        cause = SIGNAL_CAUSES.get(signal_name or "", "killed by hand?")
        error_line = _errors_sent(results).get(index)
        how = (f"was killed by {signal_name} ({cause})" if signal_name else
               f"exited with code {code}: {error_line}" if error_line else
               f"exited with code {code}; its error is printed above")
        message = (f"worker with local rank {worlds[index].local_rank} (rank "
                   f"{worlds[index].rank}) {how}")
        if lingering:
            # Hung, or waiting for the failed one (a rendezvous): it cannot tell which.
            message += (f"; {_ranks_of(worlds, lingering)} was still running {GRACE_S:g}s "
                        "after that and was terminated")
        if stopped:
            message += (f"; {_ranks_of(worlds, stopped)} stopped answering: its process "
                        "was stopped (SIGSTOP or a debugger), so it was killed")
        raise WorkerFailed(message, exit_code=0 if signal_name else code) from None
    except mp.ProcessRaisedException as exc:
        raise WorkerFailed(f"a worker failed:\n{exc}") from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    statuses: list = [None] * len(worlds)
    while not results.empty():  # every child has exited: what they sent is there
        index, status = results.get()
        statuses[index] = status
    return statuses


#: After a worker fails, how long the others get to stop by themselves, and then to
#: act on SIGTERM, before SIGKILL (torch waits 30 s each, issue 16: a job must end
#: within timeout_s plus a few seconds).
GRACE_S = 2.0


def _wait_for_a_failure(processes, timeout: float) -> int | None:
    """Wait up to ``timeout`` for a worker to exit; the index of one that failed."""
    from multiprocessing.connection import wait

    alive = {p.sentinel: i for i, p in enumerate(processes) if p.exitcode is None}
    for sentinel in wait(list(alive), timeout=timeout):
        process = processes[alive[sentinel]]
        # The sentinel closes as the process exits, a moment before it can be reaped.
        process.join(GRACE_S)
        if process.exitcode not in (None, 0):
            return alive[sentinel]
    return None


def _stop_the_others(processes) -> tuple[list[int], list[int]]:
    """After a worker failed: SIGKILL the stopped workers at once (state "T" in
    /proc/PID/stat: SIGSTOP, a debugger; they can neither notice the failure nor act on
    SIGTERM), give the others ``GRACE_S`` to stop by themselves, then SIGTERM, then
    SIGKILL. Returns the indices of the stopped ones and of those that had to be
    terminated."""
    import time

    from engine.atomic_io import process_state

    stopped = [i for i, p in enumerate(processes)
               if p.exitcode is None and process_state(p.pid) in ("T", "t")]
    for index in stopped:
        processes[index].kill()
    lingering = []
    for step in (None, "terminate", "kill"):
        if step is not None:
            for process in processes:
                if process.exitcode is None:
                    getattr(process, step)()
        deadline = time.monotonic() + GRACE_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if step is None:
            lingering = [i for i, p in enumerate(processes) if p.exitcode is None]
    return stopped, lingering


def _signal_name(exit_code: int | None) -> str | None:
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _ranks_of(worlds: list[World], indices: list[int]) -> str:
    return ", ".join(f"worker with local rank {worlds[i].local_rank} (rank {worlds[i].rank})"
                     for i in indices)


def exit_process(code: int, *, forked: bool = False) -> NoReturn:
    """End this process with exit code ``code`` as a normal exit would, minus the
    interpreter's teardown: the exit handlers run (multiprocessing's finalizers, the
    checkpointers' at-exit closes, logging), stdout and stderr are flushed, then
    ``os._exit``, whatever those raise. For a child process (a spawned worker, a
    warm-started command): freeing every module of a torch program took 1.8 s of CPU
    on an idle machine, for nothing when the process ends.

    ``forked``: a worker forked by multiprocessing, which holds copies of the launching
    process's atexit handlers (its TemporaryDirectory removals among them: a failed
    forked worker removed the folder ``engine.launch`` reads rank 0's result from). Only
    its own multiprocessing finalizers run, as when such a worker returns normally."""
    import atexit
    import multiprocessing.util

    try:
        if forked:
            multiprocessing.util._exit_function()
        else:
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def exit_failed_worker(code: int, error_line: str | None = None) -> NoReturn:
    """End a worker whose error is printed already, with exit code ``code``; in a
    worker this module spawned, ``error_line`` goes to the launcher, whose last line
    repeats it (the one line users read, issue 16).

    In a worker this module spawned, :func:`exit_process` ends it: the teardown it skips
    came between a rank's error and the launcher's last line (issue 16: with a rank
    stopped, the job must end within timeout_s + 5 s). Anywhere else (the worker is the
    launching process itself) it raises SystemExit."""
    import multiprocessing

    if multiprocessing.parent_process() is None:
        raise SystemExit(code)
    results, index, forked = _to_launcher or (None, None, False)
    if error_line and results is not None:
        with contextlib.suppress(Exception):  # the launcher is gone: nobody to tell
            results.put((index, (ERROR, error_line[:MAX_ERROR_LINE])))
    exit_process(code, forked=forked)


#: In a worker spawn_workers started: the queue to the launcher, the worker's index and
#: whether it was forked.
_to_launcher: tuple | None = None
#: A failed worker's one-line error travels as (index, (ERROR, line)); short, so that
#: the put never waits for a reader.
ERROR = "error"
MAX_ERROR_LINE = 1000


def _errors_sent(results) -> dict[int, str]:
    """The error lines failed workers sent (read once every worker has exited)."""
    errors = {}
    with contextlib.suppress(Exception):
        while not results.empty():
            index, sent = results.get()
            if isinstance(sent, tuple) and sent[:1] == (ERROR,):
                errors.setdefault(index, sent[1])
    return errors


def _entry(index: int, worker: Callable[[World], object], worlds: list[World],
           child_env: dict[str, str], results, forked: bool) -> None:
    global _to_launcher
    _to_launcher = (results, index, forked)
    os.environ.update(child_env)
    status = worker(worlds[index])
    # Only a short string travels back: a large object could fill the pipe, and the
    # child would then wait for a reader that only reads after every child has exited.
    results.put((index, status if isinstance(status, str) and len(status) <= 64
                 else None))


def warn_once(message: str, _seen: set[str] = set()) -> None:  # noqa: B006 (on purpose)
    if message not in _seen:
        _seen.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)
