"""Local worker processes: started, watched, stopped and ended.

:func:`spawn_workers` starts one process per world on this machine (spawn, slurm with
one task per node; with ``spares``, forks of a warm zygote: engine/spares.py), passes
Ctrl-C and pre-emption signals on, and, when one fails, stops the others and raises one
:class:`~engine.errors.WorkerFailed` that names it. In a worker,
:func:`exit_failed_worker` sends its error to the launcher and ends it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Callable, Mapping, NoReturn

from engine import phases
from engine.errors import EXIT_FAILED, EXIT_INTERRUPTED, Interrupted, WorkerFailed
from engine.launch_env import keep_store_socket, start_method
from engine.world import World

# engine-run's start imports this module: engine.atomic_io and torch are imported
# inside the functions that read /proc or start workers.

#: Signals the parent passes on to its workers (with Ctrl-C): SIGUSR1, SLURM's
#: pre-emption warning (sbatch --signal=USR1@90), and SIGTERM, a polite stop.
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
    """Start multiprocessing's resource tracker (in our process group) deaf to
    ``signals``: one sent to the group killed it, and it came back printing tracebacks."""
    try:
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in signals}
    except ValueError:  # not the main thread: leave it to multiprocessing
        return
    try:
        resource_tracker.ensure_running()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def spawn_workers(worker: Callable[[World], object], worlds: list[World],
                  child_env: Mapping[str, str] | None = None, spares=None,
                  restart_follows: bool = False, store_socket=None) -> list:
    """Run ``worker`` in one process per world on this machine (``child_env`` set in
    each) and wait; returns each one's value where it is a short string (a run's status).
    A failed worker stops the others and becomes one :class:`WorkerFailed` here.
    ``spares``: a :class:`engine.spares.SparePool` whose zygote forks them.
    ``restart_follows``: a restart follows a kill, so the others are killed at once.
    ``store_socket``: the master port's listening socket, handed to rank 0's store."""
    import torch.multiprocessing as mp  # lazily: see the imports

    method = start_method()
    _start_resource_tracker_deaf_to(FORWARDED_SIGNALS)
    # One pipe from each worker, not a multiprocessing queue: a queue's locks are named
    # semaphores (/dev/shm/sem.mp-*) that a run killed as a whole leaves behind.
    pipes = [multiprocessing.get_context(method).Pipe(duplex=False) for _ in worlds]
    args = (worker, worlds, dict(child_env or {}), [w for _, w in pipes],
            method == "fork" and spares is None, store_socket)
    try:
        if spares is not None:
            context = spares.start(_entry, args, len(worlds), listen_to=FORWARDED_SIGNALS)
        else:
            context = mp.start_processes(_entry, args=args, nprocs=len(worlds),
                                         join=False, start_method=method)
    finally:
        if store_socket is not None:
            store_socket.close()  # rank 0 has its own copy (or no worker started)
    for _, writer in pipes:
        writer.close()  # the workers have theirs
    readers = [r for r, _ in pipes]

    stopping = []  # the signals passed on: the run is being stopped, not restarted
    interrupted = []  # when the first Ctrl-C came (time.monotonic())

    def forward(signum, frame):  # the workers decide what to do
        if signum == signal.SIGINT:
            if interrupted:  # the second Ctrl-C: now
                _kill(context.processes)
                raise Interrupted("interrupted again: the workers were killed; the same "
                                  "command resumes from the newest snapshot")
            interrupted.append(time.monotonic())
        stopping.append(signum)
        # A terminal's Ctrl-C reached the workers too, `kill -INT PID` only this process:
        # a worker takes a second copy within moments as the same request.
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {}
    try:
        for signum in (*FORWARDED_SIGNALS, signal.SIGINT):
            previous[signum] = signal.signal(signum, forward)
    except ValueError:  # not the main thread: the workers get signals from their group
        pass
    failed, stopped, lingering = None, [], []
    try:
        while not context.join(timeout=0, grace_period=GRACE_S):
            if interrupted and time.monotonic() - interrupted[0] > INTERRUPT_WAIT_S:
                _kill(context.processes)
                raise Interrupted(f"interrupted: the workers did not stop within "
                                  f"{INTERRUPT_WAIT_S:g}s and were killed; the same command "
                                  "resumes from the newest snapshot")
            if spares is not None:
                spares.serving()  # a dead or stopped zygote: one warning, ended
            failed = _wait_for_a_failure(context.processes, timeout=1.0)
            code = None if failed is None else context.processes[failed].exitcode
            if restart_follows and _signal_name(code) and _restartable(code, stopping):
                _kill(context.processes)  # all replaced, and no error to say: no grace
            elif failed is not None:
                stopped, lingering = _stop_the_others(context.processes)
        # Every child has exited: what each sent is in its pipe.
        return [next((sent for sent in _sent(r) if not isinstance(sent, tuple)), None)
                for r in readers]
    except mp.ProcessExitedException as exc:
        index = failed if failed is not None else exc.error_index
        code = context.processes[index].exitcode
        if interrupted or code == EXIT_INTERRUPTED:
            # Ctrl-C before the workers took it as a stop request: they ended quietly.
            raise Interrupted("interrupted") from None
        reports = [_error_sent(r) for r in readers]
        index = _first_told(index, reports)
        code = context.processes[index].exitcode
        # A worker that raised sent its error; one that was killed could not.
        signal_name, who = _signal_name(code), _ranks_of(worlds, [index])
        cause = SIGNAL_CAUSES.get(signal_name or "", "killed by hand?")
        message = _failure_report(worlds, index, code, reports)
        if signal_name:
            message = f"{who} was killed by {signal_name} ({cause})"
        elif not message:
            message = f"{who} exited with code {code} and reported no error"
        if lingering:
            # Hung, or waiting for the failed one (a rendezvous): it cannot tell which.
            message += (f"; {_ranks_of(worlds, lingering)} was still running {GRACE_S:g}s "
                        "after that and was terminated")
        if stopped:
            message += (f"; {_ranks_of(worlds, stopped)} stopped answering: its process "
                        "was stopped (SIGSTOP or a debugger), so it was killed")
        failure = (f"worker rank {worlds[index].rank} "
                   + (f"was killed by {signal_name}" if signal_name
                      else f"exited with code {code}"))
        raise WorkerFailed(message, exit_code=0 if signal_name else code, failure=failure,
                           restartable=_restartable(code, stopping)) from None
    except mp.ProcessRaisedException as exc:
        raise WorkerFailed(f"a worker failed:\n{exc}", exit_code=EXIT_FAILED,
                           failure="a worker raised an exception",
                           restartable=not stopping) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for reader in readers:
            reader.close()


def _restartable(code: int | None, stopping: list) -> bool:
    """Whether a worker that ended with ``code`` may be restarted: killed by a signal
    but SIGINT, or failed (exit 1), unless a stop was asked for (``stopping``)."""
    signal_name = _signal_name(code)
    return not stopping and (code == EXIT_FAILED or (
        signal_name is not None and signal_name != "SIGINT"))


#: After the first Ctrl-C, how long the workers get to stop with their snapshot.
INTERRUPT_WAIT_S = 30.0


def _kill(processes) -> None:
    """SIGKILL every worker still running, and reap it."""
    for process in processes:
        if process.exitcode is None:
            process.kill()
    for process in processes:
        process.join(GRACE_S)


def with_rank(rank: int, text: str) -> str:
    """Every line of ``text`` marked with the rank that printed it."""
    return "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())


def _first_told(index: int, reports: list) -> int:
    """The worker whose error to show first: ``index`` (the first that failed), unless
    its error only echoes another rank's failure (PeerFailed) and another one's does
    not."""
    if reports[index] is not None and reports[index][1] is None:
        return next((i for i, r in enumerate(reports) if r is not None and r[1] is not None),
                    index)
    return index


def _failure_report(worlds: list[World], index: int, code: int, reports: list) -> str:
    """Print the failed workers' errors, each different one once (marked with the
    first rank that raised it), and return the last line: worker ``index``'s error,
    naming the ranks that failed alike ("" if it sent none). An error every worker
    raised alike without a traceback is that last line alone."""
    told = reports[index]
    alike = [i for i, r in enumerate(reports) if i != index and told and r and r[0] == told[0]]
    if told and not told[1] and len(alike) == len(reports) - 1:
        return told[0]
    shown = set()
    for i in [index, *range(len(reports))]:
        if reports[i] is None or reports[i][1] is None or reports[i][0] in shown:
            continue  # killed, an echo of another rank's failure, or printed already
        line, text = reports[i]
        shown.add(line)
        print(with_rank(worlds[i].rank, text or f"error: {line}\n"), file=sys.stderr,
              end="", flush=True)
    if told is None:
        return ""
    message = f"{_ranks_of(worlds, [index])} exited with code {code}: {told[0]}"
    if alike:
        ranks = [worlds[i].rank for i in alike]
        message += (f"; rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))} failed the same way")
    return message


#: After a worker fails, how long the others get to stop by themselves, then to act on
#: SIGTERM, before SIGKILL: a failed job ends within timeout_s plus a few seconds.
GRACE_S = 2.0


def _wait_for_a_failure(processes, timeout: float) -> int | None:
    """Wait up to ``timeout`` for a worker to exit; the index of one that failed."""
    alive = {p.sentinel: i for i, p in enumerate(processes) if p.exitcode is None}
    for sentinel in wait(list(alive), timeout=timeout):
        process = processes[alive[sentinel]]
        # The sentinel closes as the process exits, a moment before it can be reaped.
        process.join(GRACE_S)
        if process.exitcode not in (None, 0):
            return alive[sentinel]
    return None


def _stop_the_others(processes) -> tuple[list[int], list[int]]:
    """After a worker failed: SIGKILL the stopped workers (SIGSTOP, a debugger: deaf
    to SIGTERM) at once, give the others ``GRACE_S`` to stop, then SIGTERM, then
    SIGKILL. Returns the indices of the stopped ones and of those terminated."""
    from engine.atomic_io import process_state  # lazily: see the imports

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


def process_identity(pid: int) -> str:
    """What tells process ``pid`` apart from any other, on any machine (a PID may be
    reused): the kernel's boot id and its start time; "" where /proc cannot say."""
    from engine.atomic_io import proc_stat  # lazily: see the imports

    boot, fields = boot_id(), proc_stat(pid)
    return f"{boot}/{fields[19]}" if boot and len(fields) > 19 else ""


@functools.cache
def boot_id() -> str:
    """This machine's kernel, as it names itself until the next boot; "" if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def same_machine(identity: str) -> bool:
    """Whether a :func:`process_identity` is of a process on this machine's kernel."""
    return bool(boot_id()) and identity.split("/")[0] == boot_id()


def kill_if_stopped(pid: int, identity: str) -> bool:
    """SIGKILL process ``pid`` if it is still the one ``identity`` names and stopped
    (SIGSTOP, a debugger: deaf to any other signal). True when it was killed."""
    from engine.atomic_io import process_state  # lazily: see the imports

    if not identity or process_identity(pid) != identity:
        return False
    if process_state(pid) not in ("T", "t"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


#: (pid, identity) of stopped local ranks found missing after a failed collective.
_stopped_peers: list[tuple[int, str]] = []


def end_when_exiting(pid: int, identity: str) -> None:
    """Have :func:`exit_failed_worker` kill the stopped process ``pid`` (if still the
    one ``identity`` names, and stopped) right before this process ends: torchrun's
    agent and srun wait for a stopped worker in vain; a killed one ends the job."""
    _stopped_peers.append((pid, identity))


def end_stopped_peers() -> None:
    """Kill the stopped peers :func:`end_when_exiting` noted."""
    while _stopped_peers:
        kill_if_stopped(*_stopped_peers.pop())


def spawned_here() -> bool:
    """Whether this process is a worker :func:`spawn_workers` started: its launcher
    watches it (names and kills a stopped one, passes Ctrl-C on) and reports the job's
    first failure; what the launcher said at its start, it need not say again."""
    return _to_launcher is not None


reports_to_launcher = started_by_this_launcher = spawned_here


def exit_process(code: int, *, forked: bool = False,
                 last: Callable[[], object] | None = None) -> NoReturn:
    """End this process with exit code ``code`` as a normal exit would (the exit
    handlers run, stdout and stderr are flushed), minus the interpreter's teardown of
    every module (docs/launchers.md), then ``os._exit`` whatever those raise.
    ``forked``: a worker forked by multiprocessing, whose copies of the launching
    process's atexit handlers must not run (its TemporaryDirectory removals): only its
    own multiprocessing finalizers run. ``last``: called right before the end."""
    try:
        if forked:
            multiprocessing.util._exit_function()
        else:
            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if last is not None:
            with contextlib.suppress(Exception):
                last()
        os._exit(code)


def exit_failed_worker(code: int, error_line: str | None = None,
                       traceback_text: str | None = "") -> NoReturn:
    """End a worker with exit code ``code``. In a worker this module spawned, its error
    is not printed yet: ``error_line`` and ``traceback_text`` go to the launcher, which
    prints them once for the workers that failed alike (:func:`_failure_report`;
    ``traceback_text`` None: an echo of another rank's failure). Such a worker, and one
    that killed a stopped peer, ends by :func:`exit_process` (no teardown between its
    error and the job's end); the launching process itself raises SystemExit."""
    to_launcher, forked = _to_launcher or (None, False)
    if error_line and to_launcher is not None:
        with contextlib.suppress(Exception):  # the launcher is gone: nobody to tell
            # The traceback's end is what tells the error: cut its start if too long.
            to_launcher.send((ERROR, error_line[:MAX_ERROR_LINE],
                              traceback_text and traceback_text[-MAX_TRACEBACK:]))
    if _stopped_peers:  # killed last: its death stops the job (torchrun: SIGTERM here)
        exit_process(code, last=end_stopped_peers)
    if multiprocessing.parent_process() is None:
        raise SystemExit(code)
    exit_process(code, forked=forked)


#: In a worker spawn_workers started: its pipe to the launcher, and whether it was
#: forked.
_to_launcher: tuple | None = None

#: A failed worker's error travels as (ERROR, line, traceback); short, so that the send
#: never waits for a reader (a pipe holds 64 kB).
ERROR = "error"
MAX_ERROR_LINE = 1000
MAX_TRACEBACK = 12_000  # characters: up to 48 kB of UTF-8


def _interrupted_once(signum, frame) -> NoReturn:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: the launcher kills
    raise KeyboardInterrupt


def _sent(reader) -> list:
    """What a worker sent through its pipe (read once it has exited)."""
    messages = []
    with contextlib.suppress(EOFError, OSError):
        while reader.poll():
            messages.append(reader.recv())
    return messages


def _error_sent(reader) -> tuple[str, str | None] | None:
    """The error a failed worker sent, if any: its line and its traceback ("" for an
    error its line says, None for an echo of another rank's failure)."""
    return next((sent[1:] for sent in _sent(reader)
                 if isinstance(sent, tuple) and sent[:1] == (ERROR,)), None)


def _entry(index: int, worker: Callable[[World], object], worlds: list[World],
           child_env: dict[str, str], pipes: list, forked: bool,
           store_socket=None) -> None:
    global _to_launcher
    _to_launcher = (pipes[index], forked)
    phases.mark("worker start")
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # Until the run takes Ctrl-C as a stop request: one KeyboardInterrupt, not a
        # second for the copy the launcher passes on.
        signal.signal(signal.SIGINT, _interrupted_once)
    os.environ.update(child_env)
    if store_socket is not None:
        if worlds[index].rank == 0:
            keep_store_socket(store_socket)
        else:
            store_socket.close()  # only rank 0's store listens
    status = worker(worlds[index])
    # Only a short string: a large one could fill the pipe, read once all have exited.
    pipes[index].send(status if isinstance(status, str) and len(status) <= 64 else None)
    exit_process(0, forked=forked)  # the exit handlers, not the interpreter's teardown
