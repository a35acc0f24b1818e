"""Pre-emption: SIGUSR1 (``#SBATCH --signal=USR1@90``) or SIGTERM (the time limit, or a
scheduler taking the node back) means "save and stop soon".

The signal handler only sets a flag: nothing else is safe inside a handler, and a
snapshot needs every rank. The Trainer's check points tell every rank and stop them
together with a snapshot, and rank 0 asks the scheduler to requeue the job (the
``engine_requeue`` hook); the requeued job resumes from that snapshot (the steps:
docs/fault-tolerance.md, "Pre-emption"). Ctrl-C (SIGINT) takes the same path instead
of a KeyboardInterrupt inside the recipe's forward: the run ends "interrupted" with its
snapshot, and the same command resumes. A second one ends the process at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys
import time

from engine.processes import spawned_here

#: A second signal this soon after the first is the same request delivered twice: a
#: signal sent to the whole process group (``scancel --signal``, ``kill -- -PGID``, the
#: SLURM time limit) reaches each worker directly and again forwarded by its launcher.
DUPLICATE_WINDOW_S = 5.0


#: Linux's SO_TIMESTAMP (the socket module does not name it): the kernel stamps each
#: datagram with the time it was written.
_SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29 if sys.platform == "linux" else None)


#: The kernel's stamp: a struct timeval (seconds, microseconds).
_TIMEVAL = struct.Struct("ll")


class _ArrivalClock:
    """When each signal arrived, not when its Python handler ran (seconds later in a
    main thread inside a long C call: a signal sent to the group and forwarded by the
    launcher looked like two requests). Python writes a byte to the wakeup fd as each
    signal arrives; a datagram socket with SO_TIMESTAMP has the kernel stamp it. Where
    that cannot be set up (not the main thread, asyncio's fd), the handler's time."""

    def __init__(self, signums) -> None:
        self._sockets = None
        # The signals whose arrivals are kept: the wakeup fd gets a byte for every
        # signal with a Python handler (a DataLoader's SIGCHLD too).
        self._pending: dict[int, list[float]] = {int(s): [] for s in signums}
        if _SO_TIMESTAMP is None:
            return
        reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            reader.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMP, 1)
            reader.setblocking(False)
            writer.setblocking(False)
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (OSError, ValueError):  # no such option here, or not the main thread
            reader.close()
            writer.close()
            return
        if previous != -1:  # someone else's (an event loop's): leave it theirs
            signal.set_wakeup_fd(previous)
            reader.close()
            writer.close()
            return
        self._sockets = (reader, writer)

    def arrivals(self, signum: int) -> list[float]:
        """The arrival times (time.time()) of ``signum`` not asked for before; [now]
        where the stamps are not available."""
        if self._sockets is not None:
            while True:
                try:
                    data, ancillary, _, _ = self._sockets[0].recvmsg(
                        1, socket.CMSG_SPACE(_TIMEVAL.size))
                except (BlockingIOError, OSError):
                    break
                for level, kind, stamp in ancillary:
                    if (level, kind) == (socket.SOL_SOCKET, _SO_TIMESTAMP) and data:
                        seconds, micros = _TIMEVAL.unpack(stamp[:_TIMEVAL.size])
                        if data[0] in self._pending:
                            self._pending[data[0]].append(seconds + micros / 1e6)
        arrived, self._pending[signum] = self._pending.get(signum) or [time.time()], []
        return arrived

    def close(self) -> None:
        if self._sockets is not None:
            with contextlib.suppress(ValueError):  # not the main thread: left as it is
                current = signal.set_wakeup_fd(-1)
                if current != self._sockets[1].fileno():  # an event loop's since: keep it
                    signal.set_wakeup_fd(current)
            for sock in self._sockets:
                sock.close()
            self._sockets = None


class PreemptionFlag:
    """Set by a signal; read by the Trainer at step boundaries."""

    def __init__(self):
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous = {}
        self._clock: _ArrivalClock | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    @property
    def interrupted(self) -> bool:
        """The request was Ctrl-C's (the run ends "interrupted", not "preempted")."""
        return self.signal_name == "SIGINT"

    def install(self, names=("SIGUSR1", "SIGTERM", "SIGINT")) -> None:
        for name in names:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (a library user's thread)
                return
        self._clock = _ArrivalClock(self._previous)

    def uninstall(self, ignore_more: bool = False) -> None:
        """Put the previous handlers back; with ``ignore_more`` (the pre-emption snapshot
        is written and the process is on its way out) ignore these signals instead:
        the requeue that rank 0 asks for makes SLURM send SIGTERM to every task of the
        step, and a worker killed by it while exiting turned a clean pre-emption into a
        failed step ("killed by SIGTERM")."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if ignore_more else previous)
        self._previous.clear()
        if self._clock is not None:
            self._clock.close()
            self._clock = None

    def _handle(self, signum, frame) -> None:
        arrivals = self._clock.arrivals(signum) if self._clock else [time.time()]
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self._first_at = arrivals.pop(0)
        if any(at - self._first_at > self._window(signum) for at in arrivals):
            # A second request, later: the user (or the scheduler) means it. Die as asked
            # (SIGINT: a KeyboardInterrupt, which the worker ends on without a traceback).
            self.uninstall()
            os.kill(os.getpid(), signum)

    @staticmethod
    def _window(signum) -> float:
        """How soon a second signal counts as the first one again. A second Ctrl-C is
        the user's, but in a worker spawn_workers started: its launcher passes Ctrl-C
        on (and kills it on a second one)."""
        return 0.0 if signum == signal.SIGINT and not spawned_here() else DUPLICATE_WINDOW_S


class StopRequest:
    """Pre-emption's slot in the loop's check points (engine/check_point.py): ``requested``
    on every rank at the same check point once any rank's flag was up."""

    def __init__(self, flag: PreemptionFlag | None):
        self.flag = flag
        self.requested = False

    def check_values(self, window_s: float, window_steps: int) -> list[float]:
        return [float(bool(self.flag))]

    def check_agreed(self, sums) -> None:
        if sums[0] > 0:
            self.requested = True


#: What the log says when no plugin's scheduler runs this job (engine_requeue).
NOT_REQUEUED = "not requeued (start the run again to resume)"


def report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
