"""Warm spares for the spawn launcher's restarts (``engine-run --max-restarts N``).

A spawned worker pays a new interpreter and the imports of torch, dynamo, the plugins
and the recipe: most of a restart. A :class:`SparePool`'s zygote (engine/fork_server.py,
which says how it differs from the other fork servers) imports them once and every
worker of the run is its fork. Their parent is the zygote (variables read as a library
loads are its); the launcher sees each fork's end itself (a pidfd): a zygote that dies
or stops is one warning (:meth:`SparePool.serving`), its forks run on, restarts spawn.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from multiprocessing import forkserver, util
from multiprocessing.connection import wait
from typing import Callable, Sequence

from engine.atomic_io import process_state
from engine.errors import warn
from engine.fork_server import TorchForkServer, TorchForkServerProcess, _Popen
from engine.launch_env import fork_unsafe
from engine.plugin_manager import (BUILTIN_PLUGINS, build_plugin_manager,
                                   packages_distributions)
from engine.recipe import load_recipe

# torch is imported inside the functions that start or become workers: not by the launcher.

#: What the zygote preloads (the launcher's sys.path, the recipe, the plugins), handed
#: through its environment: multiprocessing passes it no arguments of ours.
PRELOAD_ENV = "ENGINE_SPARE_PRELOAD"
#: How long the zygote may take to fork a worker (its first fork waits for its imports),
#: and to report the exit status of a fork that ended.
START_TIMEOUT_S = 120.0
REPORT_S = 5.0


class SpareError(RuntimeError):
    """The zygote did not fork a worker: it exited, or did not answer in time."""


class _SpareServer(TorchForkServer):
    def __init__(self) -> None:
        super().__init__()
        self._preload_modules = ["torch", __name__]  # torch even if the engine fails


class _SparePopen(_Popen):
    """A fork whose sentinel is its own pidfd, not the zygote's status pipe (which a
    dead or stopped zygote never writes): :meth:`SparePool.exit_code` reads the status."""

    timeout_s = START_TIMEOUT_S
    pool: "SparePool | None" = None  # set while the pool starts processes

    @classmethod
    def _fork_server(cls) -> TorchForkServer:
        assert cls.pool is not None and cls.pool._server is not None
        return cls.pool._server

    def _launch(self, process_obj) -> None:
        super()._launch(process_obj)
        self._pool, self._status = self.pool, self.sentinel
        self.sentinel = os.pidfd_open(self.pid)
        util.Finalize(self, os.close, (self.sentinel,))

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            if not wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            self.returncode = self._pool.exit_code(self.pid, self._status)
        return self.returncode


class _SpareProcess(TorchForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _SparePopen(process_obj)


class SparePool:
    """The zygote of one launch: :meth:`warm` starts it (it imports in the background),
    :meth:`start` forks the workers, :meth:`close` ends it."""

    error = SpareError  # what start raises when the zygote forks no worker

    def __init__(self, recipe: str | None = None, plugins: Sequence[str] = ()) -> None:
        self.recipe, self.plugins = recipe, list(plugins)
        self._server: _SpareServer | None = None
        self.failed = False  # the zygote died, stopped or fell silent: restarts spawn

    def warm(self, deaf_to: Sequence[signal.Signals] = ()) -> None:
        """Start the zygote, if not running, deaf to ``deaf_to`` (a pre-emption signal
        to the process group; its forks listen again) and to SIGINT from its start
        (multiprocessing's server ignores it only after its imports)."""
        if self._server is None:
            self._server = _SpareServer()
        preload = {"sys_path": sys.path, "recipe": self.recipe, "plugins": self.plugins}
        previous_env = os.environ.get(PRELOAD_ENV)
        os.environ[PRELOAD_ENV] = json.dumps(preload)
        try:
            previous = {s: signal.signal(s, signal.SIG_IGN)
                        for s in (*deaf_to, signal.SIGINT)}
        except ValueError:  # not the main thread: the group's signals reach it
            previous = {}
        try:
            self._server.ensure_running()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if previous_env is None:
                os.environ.pop(PRELOAD_ENV, None)
            else:
                os.environ[PRELOAD_ENV] = previous_env

    def start(self, fn: Callable, args: tuple, nprocs: int, listen_to=()):
        """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)`` with
        forks of the zygote. ``listen_to``: the signals the zygote ignores, back to
        their default in each worker; SIGINT as this process takes it."""
        from torch.multiprocessing.spawn import ProcessContext

        interruptible = signal.getsignal(signal.SIGINT) != signal.SIG_IGN
        self.warm(listen_to)
        processes, error_files = [], []
        environ = dict(os.environ)
        _SparePopen.pool = self
        _adopt_orphans(True)
        try:
            for index in range(nprocs):  # torch's error file per worker
                fd, error_file = tempfile.mkstemp(prefix="pytorch-errorfile-",
                                                  suffix=".pickle")
                os.close(fd)
                os.unlink(error_file)
                process = _SpareProcess(target=_spare_entry, args=(
                    fn, index, args, error_file, environ, tuple(listen_to),
                    interruptible))
                try:
                    process.start()
                except (OSError, EOFError, TimeoutError, ChildProcessError) as exc:
                    for started in processes:
                        started.kill()
                    raise SpareError(f"the warm spare process did not start worker "
                                     f"{index}: {exc}") from None
                processes.append(process)
                error_files.append(error_file)
        finally:
            _SparePopen.pool = None
        return ProcessContext(processes, error_files)

    def serving(self) -> bool:
        """Whether the zygote serves; one that died or is stopped is one warning and is
        ended: its forks run on as this process's children (:func:`_adopt_orphans`)."""
        pid = self._server and self._server._forkserver_pid
        if pid and not self.failed:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                code = os.waitstatus_to_exitcode(status)
                self._fail(f"exited with code {code}" if code >= 0 else
                           f"was killed by {signal.Signals(-code).name}")
            elif process_state(pid) in ("T", "t"):
                self._fail("is stopped (SIGSTOP or a debugger) and was killed")
        return not self.failed

    def exit_code(self, pid: int, status_fd: int) -> int:
        """The exit code of fork ``pid``, which ended: the zygote's report, or, once a
        zygote gone, stopped or silent for ``REPORT_S`` is ended, this process's reap."""
        deadline = time.monotonic() + REPORT_S
        while self.serving() and time.monotonic() < deadline:
            if wait([status_fd], 0.1):
                with contextlib.suppress(EOFError, OSError):
                    return forkserver.read_signed(status_fd)
        if self.serving():
            self._fail(f"did not report the end of its fork {pid} within {REPORT_S:g}s")
        try:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except ChildProcessError:  # reaped by a zygote that died before telling
            return 255

    def _fail(self, what: str) -> None:
        warn(f"the warm spare process (pid {self._server._forkserver_pid}) {what}; the "
             "workers run on, and restarts start new ones with spawn")
        self.failed = True
        self.close()

    def close(self) -> None:
        """End the zygote (SIGKILL: it may still be importing; it holds nothing)."""
        server, self._server = self._server, None
        if server is not None and server._forkserver_pid is not None:
            with contextlib.suppress(OSError):
                os.close(server._forkserver_alive_fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(server._forkserver_pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server._forkserver_pid, 0)
        _adopt_orphans(False)


def _adopt_orphans(adopt: bool) -> None:
    """PR_SET_CHILD_SUBREAPER: the forks of a zygote that dies become our children."""
    ctypes.CDLL(None, use_errno=True).prctl(36, int(adopt), 0, 0, 0)


def _spare_entry(fn, index, args, error_file, environ, listen_to,
                 interruptible=True) -> None:
    """A fork becoming a worker: the launcher's environment and signals, then torch's
    wrapper as start_processes runs it."""
    from torch.multiprocessing.spawn import _wrap

    os.environ.clear()
    os.environ.update(environ)
    for signum in listen_to:
        signal.signal(signum, signal.SIG_DFL)
    if interruptible:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _end_with_the_launcher()
    _wrap(functools.partial(_outliving_the_zygote, fn), index, args, error_file)


def _outliving_the_zygote(fn, index, *args) -> None:
    """``fn`` without torch's parent-death signal: it ends with the launcher instead."""
    from torch.multiprocessing import _prctl_pr_set_pdeathsig

    _prctl_pr_set_pdeathsig(0)
    fn(index, *args)


def _end_with_the_launcher() -> None:
    """SIGINT to this process when the launcher dies, as torch's parent-death signal
    does for a spawned worker: a thread waits in the kernel (no lock a DataLoader
    worker's fork could inherit) on the launcher's sentinel."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="engine-launcher-watch", daemon=True).start()


#: What every run imports after its start: torch, dynamo (the first optimizer's), the
#: engine, packaging (plugin requirements), tensorboard's writer; the plugins too.
RUN_MODULES = ("torch", "torch._dynamo", "engine.cli", "engine.engine",
               "packaging.requirements", "torch.utils.tensorboard",
               "tensorboard.compat.proto.summary_pb2")
#: What a worker imports as it sets up.
WORKER_MODULES = ("engine.trainer", "engine.snapshot", "engine.memory",
                  "engine.data", "engine.health", "engine.loader_settings", "engine.plan",
                  "engine.preemption", "engine.run_dir", "engine.streaming",
                  "engine.activation_checkpointing", "xxhash")


def import_run_modules() -> None:
    """Import :data:`RUN_MODULES` and the built-in plugins: for a process that forks
    workers or commands, so that they need not."""
    for module in RUN_MODULES:
        importlib.import_module(module)
    for _, module in BUILTIN_PLUGINS:
        importlib.import_module(module)
    packages_distributions()  # what a -p module's version is looked up in


def _preload() -> None:
    """In the zygote: the launcher's sys.path, the run's modules, the recipe. A failed
    import is left to each worker; it never stops the zygote."""
    preload = json.loads(os.environ.pop(PRELOAD_ENV))
    sys.path[:] = preload["sys_path"]
    # torch.cuda.is_available() in a recipe module would start CUDA here and poison
    # every fork ("Cannot re-initialize CUDA in forked subprocess"): NVML answers.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import_run_modules()
        for module in WORKER_MODULES:
            importlib.import_module(module)
        build_plugin_manager(preload["plugins"])  # imports the -p and installed ones
        if preload["recipe"]:
            load_recipe(preload["recipe"])
    except Exception as exc:  # noqa: BLE001 (the worker meets it and reports it)
        print(f"warning: the warm spare could not preload: {exc}", file=sys.stderr)
    # A fork of a process with threads (OpenMP's pool too) can deadlock, and cannot use
    # its parent's CUDA context: the launcher says so in one line and spawns instead.
    unsafe = fork_unsafe()
    if unsafe:
        print(f"warning: the warm spare cannot fork safely after its imports (the "
              f"recipe's module?): {unsafe}", file=sys.stderr, flush=True)
        os._exit(1)


if PRELOAD_ENV in os.environ and __name__ != "__main__":
    _preload()
