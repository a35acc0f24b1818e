"""Local worker processes: started, watched, stopped and ended.

:func:`spawn_workers` starts one process per world on this machine (the ``spawn``
launcher, and ``slurm`` with one task per node), passes pre-emption signals on to them
and, when one fails, stops the others and raises one :class:`~engine.errors.WorkerFailed`
that names it; with ``spares`` (the spawn launcher's ``--max-restarts``) the workers
are forks of a warm zygote (engine/spares.py) instead of new interpreters. Inside a
worker, :func:`exit_failed_worker` ends it after its error is
printed and sends that error's line to the launcher; :func:`exit_process` ends a child
process without the interpreter's teardown.
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

# engine-run's start imports this module (engine.cli): engine.atomic_io (hashlib, ctypes)
# and torch are imported inside the functions that read /proc or start workers.


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
    """Start one process per world on this machine, run ``worker`` in each, wait.

    ``child_env`` is set in every child before ``worker`` runs. A worker that fails
    stops the others (torch does that) and becomes one :class:`WorkerFailed` here,
    with the worker's exit code. Returns each worker's return value where it is a short
    string (a run's status), else None.

    ``spares``: an :class:`engine.spares.SparePool` whose zygote forks the workers
    instead of ``spawn``. ``restart_follows``: the caller restarts the workers after
    a failure it may restart: when a worker was killed (SIGKILL, the OOM killer) the
    others are killed at once, not given the grace that lets them print why they stop
    (they resume anyway); a worker that raised keeps it, so that the error that caused
    the restart is printed, not only another rank's echo of it.

    ``store_socket``: the master port's listening socket (launch_env.master_socket),
    handed to rank 0's process for its store; this process closes its own copy once
    the workers are started, so that the port listens only while rank 0 lives.
    """
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

    def forward(signum, frame):
        if signum == signal.SIGINT:
            if interrupted:  # the second Ctrl-C: now
                _kill(context.processes)
                raise Interrupted("interrupted again: the workers were killed; the same "
                                  "command resumes from the newest snapshot")
            interrupted.append(time.monotonic())
        stopping.append(signum)
        for process in context.processes:
            # Ctrl-C reached the workers of our process group from the terminal already.
            if process.is_alive() and (signum != signal.SIGINT
                                       or os.getpgid(process.pid) != os.getpgrp()):
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
            failed = _wait_for_a_failure(context.processes, timeout=1.0)
            code = None if failed is None else context.processes[failed].exitcode
            if restart_follows and _signal_name(code) and _restartable(code, stopping):
                # Every worker is replaced, and a killed one has no error to report
                # that the others' could echo first: no grace.
                _kill(context.processes)
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
        # The one that stopped answering goes last: that line is the one users read.
        signal_name = _signal_name(code)
        cause = SIGNAL_CAUSES.get(signal_name or "", "killed by hand?")
        message = _failure_report(worlds, index, code, reports)
        if signal_name:
            message = (f"worker with local rank {worlds[index].local_rank} (rank "
                       f"{worlds[index].rank}) was killed by {signal_name} ({cause})")
        elif not message:
            message = (f"worker with local rank {worlds[index].local_rank} (rank "
                       f"{worlds[index].rank}) exited with code {code}; its error is "
                       "printed above")
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
    """Whether a worker that ended with exit code ``code`` may be restarted: killed by
    a signal other than SIGINT, or failed with an error (not a usage error, not a
    stop asked for: ``stopping`` holds the signals passed on)."""
    signal_name = _signal_name(code)
    return not stopping and (code == EXIT_FAILED or (
        signal_name is not None and signal_name != "SIGINT"))


#: After the first Ctrl-C, how long the workers get to reach their next check points
#: and write the snapshot (engine/preemption.py) before they are killed.
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
    """Print the failed workers' errors, each different one once (a traceback, or an
    ``error:`` line, marked with the first rank that raised it), and return the
    launcher's last line: worker ``index``'s error, naming the ranks that failed the
    same way. An error that every worker raised alike and that needs no traceback (the
    same ConfigError on every rank) is that last line alone. "" when ``index`` sent
    none."""
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
    message = (f"worker with local rank {worlds[index].local_rank} (rank "
               f"{worlds[index].rank}) exited with code {code}: {told[0]}")
    if alike:
        ranks = [worlds[i].rank for i in alike]
        message += (f"; rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))} failed the same way")
    return message


#: After a worker fails, how long the others get to stop by themselves, and then to
#: act on SIGTERM, before SIGKILL: a job whose rank failed must end within timeout_s
#: plus a few seconds (torch's own waits are far longer).
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
    """After a worker failed: SIGKILL the stopped workers at once (state "T" in
    /proc/PID/stat: SIGSTOP, a debugger; they can neither notice the failure nor act on
    SIGTERM), give the others ``GRACE_S`` to stop by themselves, then SIGTERM, then
    SIGKILL. Returns the indices of the stopped ones and of those that had to be
    terminated."""
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
    """What tells process ``pid`` apart from every other process, on any machine: the
    kernel's boot id and the process's start time in clock ticks since boot (a PID
    alone may be reused, or belong to another machine or PID namespace); "" where
    /proc cannot say."""
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
    """SIGKILL process ``pid`` if it is still the one ``identity`` names and it is
    stopped (state "T" or "t": SIGSTOP, a debugger): it can act on no other signal, and
    a launcher that asks it to stop waits in vain. True when it was killed."""
    from engine.atomic_io import process_state  # lazily: see the imports

    if not identity or process_identity(pid) != identity:
        return False
    if process_state(pid) not in ("T", "t"):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


#: Stopped processes of ranks on this machine that this rank found missing after a
#: failed collective, as (pid, identity): ended as this rank exits (end_stopped_peers).
_stopped_peers: list[tuple[int, str]] = []


def end_when_exiting(pid: int, identity: str) -> None:
    """Have :func:`exit_failed_worker` kill the stopped process ``pid`` (if it still is
    the one ``identity`` names and still stopped), after this rank's error is printed:
    torchrun's agent gives a stopped worker its 30 s grace after SIGTERM, which a
    stopped process cannot act on, and srun without --kill-on-bad-exit waits for it
    forever; a killed one ends the job at once. Killed last, right before this process
    ends: the launcher stops every other worker as soon as it sees one die."""
    _stopped_peers.append((pid, identity))


def end_stopped_peers() -> None:
    """Kill the stopped peers :func:`end_when_exiting` noted."""
    while _stopped_peers:
        kill_if_stopped(*_stopped_peers.pop())


def spawned_here() -> bool:
    """Whether this process is a worker :func:`spawn_workers` started: its launcher
    watches it and its siblings, and names and kills a stopped one itself."""
    return _to_launcher is not None


def exit_process(code: int, *, forked: bool = False,
                 last: Callable[[], object] | None = None) -> NoReturn:
    """End this process with exit code ``code`` as a normal exit would, minus the
    interpreter's teardown: the exit handlers run (multiprocessing's finalizers, the
    checkpointers' at-exit closes, logging), stdout and stderr are flushed, then
    ``os._exit``, whatever those raise. For a child process (a spawned worker, a
    warm-started command): freeing every module of a torch program costs seconds of
    CPU (docs/launchers.md), for nothing when the process ends.

    ``forked``: a worker forked by multiprocessing, which holds copies of the launching
    process's atexit handlers (its TemporaryDirectory removals among them: a failed
    forked worker removed the folder ``engine.launch`` reads rank 0's result from). Only
    its own multiprocessing finalizers run, as when such a worker returns normally.

    ``last``: called after all that, right before the process ends."""
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


def reports_to_launcher() -> bool:
    """Whether this process is a worker :func:`spawn_workers` started, whose launcher
    reports the first failure of the job."""
    return _to_launcher is not None


def exit_failed_worker(code: int, error_line: str | None = None,
                       traceback_text: str | None = "") -> NoReturn:
    """End a worker whose error is printed already, with exit code ``code``; in a
    worker this module spawned, its error is not printed: ``error_line`` and
    ``traceback_text`` (engine.launching.worker_report) go to the launcher, which prints
    them once for all the workers that failed alike (:func:`_failure_report`).
    ``traceback_text`` is None for an echo of another rank's failure (PeerFailed), which
    only the launcher's last line names.

    In a worker this module spawned, :func:`exit_process` ends it: the teardown it skips
    came between a rank's error and the launcher's last line (with a rank stopped, the
    job must end within timeout_s plus a few seconds). So it does in a worker that has
    just killed a stopped peer (:func:`end_when_exiting`). Anywhere else (the worker is
    the launching process itself) it raises SystemExit."""
    to_launcher, forked = _to_launcher or (None, False)
    if error_line and to_launcher is not None:
        with contextlib.suppress(Exception):  # the launcher is gone: nobody to tell
            # The traceback's end is what tells the error: cut its start if too long.
            to_launcher.send((ERROR, error_line[:MAX_ERROR_LINE],
                              traceback_text and traceback_text[-MAX_TRACEBACK:]))
    if _stopped_peers:
        # The launcher that sees the stopped peer die stops the job at once (torchrun:
        # SIGTERM to this rank): so the peer dies last, just before this process ends,
        # which skips the interpreter's seconds of teardown.
        exit_process(code, last=end_stopped_peers)
    if multiprocessing.parent_process() is None:
        raise SystemExit(code)
    exit_process(code, forked=forked)


#: In a worker spawn_workers started: its pipe to the launcher, and whether it was
#: forked.
_to_launcher: tuple | None = None


def started_by_this_launcher() -> bool:
    """Whether this process is a worker that engine-run's own launcher started (spawn,
    a warm spare's fork): what the launcher said at its start, the workers need not
    say again."""
    return _to_launcher is not None
#: A failed worker's error travels as (ERROR, line, traceback); short, so that the send
#: never waits for a reader (a pipe holds 64 kB).
ERROR = "error"
MAX_ERROR_LINE = 1000
MAX_TRACEBACK = 12_000  # characters: up to 48 kB of UTF-8


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
    os.environ.update(child_env)
    if store_socket is not None:
        if worlds[index].rank == 0:
            keep_store_socket(store_socket)
        else:
            store_socket.close()  # only rank 0's store listens
    status = worker(worlds[index])
    # Only a short string travels back: a large object could fill the pipe, and the
    # child would then wait for a reader that only reads after every child has exited.
    pipes[index].send(status if isinstance(status, str) and len(status) <= 64 else None)
    # A worker that finished ends as a failed one does (exit_process): the exit handlers
    # run (the checkpointers close), then the
    # process ends without the interpreter freeing every module of a torch program,
    # which took seconds per worker and held the command's end back.
    exit_process(0, forked=forked)
