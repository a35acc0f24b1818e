"""Warm spares for the spawn launcher's restarts (``engine-run --max-restarts N``).

A worker started with ``spawn`` pays a new interpreter, ``import torch``, the
``torch._dynamo`` import that the first optimizer triggers, the engine's plugins and the
recipe's module before its first line of training: 6-9 s of a 10 s restart on a busy
2-core machine (tools/memory_kill_loop.py --launcher spawn). A :class:`SparePool` pays
them once, before any failure: a zygote process (multiprocessing's fork server protocol,
engine/fork_server.py) imports all of that, starts no thread and runs no tensor
operation, then waits on its socket. Every worker of the run is a fork of it, the first
ones and each replacement after a failure, so a restart forks a ready process in
milliseconds; the new workers resume from the memory tier (docs/checkpoints.md).

This is stage A of issue 37 point 3: on a failure every worker is replaced, not only
the failed one (after a kill, the survivors are killed at once, without the grace a
run that ends gets: engine.processes.spawn_workers); the process group is formed again
on a fresh port (plugins/spawn.py).

The children run as those of ``spawn`` do: the launcher's ``sys.path`` and ``__main__``
come with them, ``multiprocessing.parent_process()`` is the launcher, their environment
is the launcher's at their start, and they stop (SIGINT) when the launcher dies. What
differs: their parent process is the zygote, and variables read when a library loads
(OMP_NUM_THREADS, ...) are those the zygote started with.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
from multiprocessing.connection import wait
from typing import Callable, Sequence

from engine.fork_server import TorchForkServer, TorchForkServerProcess, _Popen
from engine.launch_env import fork_unsafe
from engine.plugin_manager import (BUILTIN_PLUGINS, build_plugin_manager,
                                   packages_distributions)
from engine.recipe import load_recipe

# torch is imported inside the functions that start or become workers: the launcher's
# process, which imports this module (spawn with restarts), never imports torch; the
# zygote imports it as it starts.

#: What the zygote preloads, handed to it through its environment (its own start
#: reads it; multiprocessing passes it no arguments of ours): the launcher's sys.path
#: and the recipe file to import.
PRELOAD_ENV = "ENGINE_SPARE_PRELOAD"
#: How long the zygote may take to fork a worker: its first fork waits for its
#: imports (torch, dynamo, the engine, the recipe: 3-10 s on a busy machine).
START_TIMEOUT_S = 120.0


class SpareError(RuntimeError):
    """The zygote did not fork a worker: it exited, or did not answer in time."""


class _SpareServer(TorchForkServer):
    def __init__(self) -> None:
        super().__init__()
        # torch first: a failed engine import below still leaves it preloaded.
        self._preload_modules = ["torch", __name__]


class _SparePopen(_Popen):
    timeout_s = START_TIMEOUT_S
    server: _SpareServer | None = None  # the pool's, set while it starts processes

    @classmethod
    def _fork_server(cls) -> TorchForkServer:
        assert cls.server is not None
        return cls.server


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

    def warm(self, deaf_to: Sequence[signal.Signals] = ()) -> None:
        """Start the zygote, if not running, with ``deaf_to`` ignored (a pre-emption
        signal sent to the process group must not kill it; its forks listen again), and
        SIGINT: multiprocessing's server ignores it only once its imports are done, and
        a Ctrl-C during them printed the zygote's KeyboardInterrupt traceback."""
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
        """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)``,
        each process a fork of the zygote: a torch ProcessContext. ``listen_to``: the
        signals the zygote ignores, back to their default in each worker."""
        from torch.multiprocessing.spawn import ProcessContext

        # A spawned worker takes Ctrl-C as this process does: ignored where it is here
        # (a job in the background), else Python's KeyboardInterrupt.
        interruptible = signal.getsignal(signal.SIGINT) != signal.SIG_IGN
        self.warm(listen_to)
        processes, error_files = [], []
        environ = dict(os.environ)
        _SparePopen.server = self._server
        try:
            for index in range(nprocs):
                # torch's own way to hand a worker's exception back: a file per worker.
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
            _SparePopen.server = None
        return ProcessContext(processes, error_files)

    def close(self) -> None:
        """End the zygote, once its workers have ended (they are its children: torch
        has them receive SIGINT when it dies). It also ends by itself when this process
        exits; SIGKILL here, since it may still be importing (a spare that timed out),
        and it holds nothing worth a graceful end."""
        server, self._server = self._server, None
        if server is None or server._forkserver_pid is None:
            return
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(server._forkserver_pid, 0)


def _spare_entry(fn, index, args, error_file, environ, listen_to,
                 interruptible=True) -> None:
    """A fork of the zygote becoming a worker: the launcher's environment, the signals
    it ignores back to their default (SIGINT to Python's KeyboardInterrupt where the
    launcher takes it), then torch's wrapper as start_processes runs it."""
    from torch.multiprocessing.spawn import _wrap

    os.environ.clear()
    os.environ.update(environ)
    for signum in listen_to:
        signal.signal(signum, signal.SIG_DFL)
    if interruptible:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _end_with_the_launcher()
    _wrap(fn, index, args, error_file)


def _end_with_the_launcher() -> None:
    """torch has a spawned worker receive SIGINT when its parent, the launcher, dies
    (prctl's parent-death signal: the worker stops at its next check point with its
    snapshot). A fork's parent is the zygote, which outlives the launcher while its
    forks hold its socket: so a thread waits for the launcher's end (its sentinel, a
    pipe the launcher holds open) and sends this process the same SIGINT. It only
    waits in the kernel, so the DataLoader workers this process forks inherit no lock
    of it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="engine-launcher-watch", daemon=True).start()


#: What every run imports after its start (seconds of CPU a process): torch and the
#: dynamo import the first optimizer triggers, the engine, packaging (plugin
#: requirements) and tensorboard's writer (rank 0's logger); the built-in plugins too.
RUN_MODULES = ("torch", "torch._dynamo", "engine.cli", "engine.engine",
               "packaging.requirements", "torch.utils.tensorboard",
               "tensorboard.compat.proto.summary_pb2")
#: What a worker imports as it sets up (a restarted worker's start: 0.4 s of CPU).
WORKER_MODULES = ("engine.trainer", "engine.snapshot", "engine.memory_snapshot",
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
    """In the zygote, as this module is preloaded: the launcher's sys.path, the run's
    modules, the recipe. A failure leaves that part for each worker to import; it
    never stops the zygote (the workers then start as cold as spawned ones)."""
    preload = json.loads(os.environ.pop(PRELOAD_ENV))
    sys.path[:] = preload["sys_path"]
    # A recipe module that asks torch.cuda.is_available() as it is imported (a common
    # line) would start the CUDA driver here (cudaGetDeviceCount) and poison every fork:
    # torch then refuses CUDA in them ("Cannot re-initialize CUDA in forked
    # subprocess"). With this, NVML answers where it works (a GPU machine), as torch
    # documents; the forks get the launcher's environment back (_spare_entry).
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
    # Forking a process with threads can deadlock the child (OpenMP's pool too, which a
    # tensor operation in the recipe's module starts: not a Python thread), and a fork
    # cannot use a CUDA context its parent created: the rule of ENGINE_START_METHOD=fork.
    # Stop the zygote; the launcher then says so in one line and spawns the workers.
    unsafe = fork_unsafe()
    if unsafe:
        print(f"warning: the warm spare cannot fork safely after its imports (the "
              f"recipe's module?): {unsafe}", file=sys.stderr, flush=True)
        os._exit(1)


if PRELOAD_ENV in os.environ and __name__ != "__main__":
    _preload()
