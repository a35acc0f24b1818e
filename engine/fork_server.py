"""Processes forked from a server that has imported torch: multiprocessing's forkserver
start, from a server of this module's own (the process-wide one's preload list belongs
to the program). A ``spawn`` start pays a Python start and ``import torch`` each time;
the server pays them once, never runs a tensor operation or starts a thread, and forks
each child, as clean as a spawned one. The children run as those of ``spawn`` do (the
parent's ``sys.path`` and ``__main__``, an unpickled top-level target,
``multiprocessing.parent_process()`` their starter). The server is a child of the first
process that started one and exits with it. Linux only.

Three fork servers, and why not one: this module's preloads torch alone (the async
checkpointer's writer, plugins/async_file.py); :mod:`engine.spares`' zygote is this
server preloading the recipe and plugins too, whose forks the launcher watches through
pidfds (they outlive a zygote that dies); :mod:`engine.testing.warm_start` runs whole
``engine-run`` commands for tests, each with its own session, working directory,
environment and output files: multiprocessing's protocol starts a pickled target and
carries none of these, so that one speaks its own.
"""

from __future__ import annotations

import io
import os
from multiprocessing import (connection, context, forkserver, popen_forkserver, reduction,
                             spawn, util)


class TorchForkServer(forkserver.ForkServer):
    def __init__(self) -> None:
        super().__init__()
        # Only torch: the child's own modules are imported after multiprocessing has
        # put the parent's sys.path in place (the preload runs before that, on the
        # server's default path, and an ImportError there is silently skipped).
        self._preload_modules = ["torch"]


_server: TorchForkServer | None = None  # this process's, started with its first child


def _forget_server_in_child() -> None:
    # A forked child (a DataLoader worker, say) is not the server's parent: it starts
    # its own, should it ever need one.
    global _server
    _server = None


os.register_at_fork(after_in_child=_forget_server_in_child)


class _Popen(popen_forkserver.Popen):
    #: How long the server may take to fork a child (None: no limit). A server that is
    #: still importing answers after its imports; one that never answers would hold
    #: the caller for ever.
    timeout_s: float | None = None

    @staticmethod
    def _fork_server() -> TorchForkServer:
        global _server
        if _server is None:
            _server = TorchForkServer()
        return _server

    def _launch(self, process_obj) -> None:
        # popen_forkserver.Popen._launch, with our server for the process-wide one.
        server = self._fork_server()
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        # The child's sentinel of its parent: it sees EOF when this process is gone.
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        if (self.timeout_s is not None
                and not connection.wait([self.sentinel], self.timeout_s)):
            raise TimeoutError(f"the fork server did not start a process within "
                               f"{self.timeout_s:g}s")
        try:
            self.pid = forkserver.read_signed(self.sentinel)
        except EOFError:
            raise ChildProcessError("the fork server exited before it started the "
                                    "process (its imports failed?)") from None


class TorchForkServerProcess(context.ForkServerProcess):
    """A ``multiprocessing.Process`` forked from this process's :class:`TorchForkServer`
    (started on first use). Its arguments may carry pipes and
    ``multiprocessing.reduction.DupFd`` file descriptors, as with ``forkserver``."""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)
