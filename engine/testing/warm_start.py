"""``engine-run`` commands (and Python scripts) for test suites, each in a fresh process
forked from a warm one.

A test that runs ``engine-run`` in a subprocess pays a Python start, ``import torch`` and
``torch._dynamo``'s before its first line runs. The :class:`WarmStarter`'s server imports
them and the engine once, then forks one child per command, with its own pid, session,
environment, working directory, stdout and stderr, running ``engine.cli.main``: exit
codes, signals and spawned workers are a real run's. Why its protocol is not
multiprocessing's: engine/fork_server.py. What differs from a new interpreter:
PYTHONPATH entries are put on ``sys.path`` by hand; variables read when a library loads
(OMP_NUM_THREADS) are the server's.

Commands run side by side (:meth:`WarmStarter.start`, a handle as subprocess.Popen) or
one at a time (:meth:`WarmStarter.run`). ``run(..., python=True)`` runs Python command
lines (``SCRIPT ARGS``, ``-m MODULE ARGS``, ``-c CODE ARGS``) through :mod:`runpy` as a
new interpreter would set them up. Not for what a new interpreter itself is under test
(the server has torch imported).

The server never runs a tensor operation or starts a thread before it forks (checked),
so forking it is safe. Linux only; ``ENGINE_TEST_FORK=0`` runs real subprocesses instead.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Mapping, Sequence

from engine.cli import main
from engine.processes import exit_process

#: ``ENGINE_TEST_FORK=0``: every command in a real ``python -m engine`` subprocess.
DISABLE_ENV = "ENGINE_TEST_FORK"


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get(DISABLE_ENV, "1") != "0"


class WarmStarter:
    """The client side: one server process, started on first use; commands run side by
    side (:meth:`start`) or one after the other (:meth:`run`), from any thread."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._pending = b""
        self._next_id = 0
        self._pids: dict[int, int] = {}  # request id -> its process's pid
        self._exits: dict[int, int] = {}  # request id -> its exit code, once it ended
        #: CPU seconds (user + system) of the commands run so far, each with the workers
        #: it reaped: the server reaps them, so they are in no rusage of the client's.
        self.cpu_s = 0.0
        # Once: close() stops whichever server runs at exit (one after a restart too).
        atexit.register(self.close)

    def run(self, args: Sequence[str], *, env: Mapping[str, str], cwd, timeout: float,
            python: bool = False) -> subprocess.CompletedProcess:
        """``engine-run ARGS``, or with ``python``, ``python ARGS``; waits for its end."""
        deadline = time.monotonic() + timeout
        process = self.start(args, env=env, cwd=cwd, timeout=timeout, python=python)
        try:
            out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise subprocess.TimeoutExpired(process.args, timeout, exc.output,
                                            exc.stderr) from None
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def start(self, args: Sequence[str], *, env: Mapping[str, str], cwd,
              timeout: float = 300, python: bool = False) -> WarmProcess:
        """Start ``engine-run ARGS`` (or ``python ARGS``) and return at once: a process
        handle as subprocess.Popen's, its output captured (``communicate``). ``timeout``
        bounds the wait for the server to fork it (its first start imports torch)."""
        program = "python" if python else "engine-run"
        folder = tempfile.mkdtemp(prefix="engine-run-")
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            request = {"id": ident, "argv": [str(a) for a in args], "env": dict(env),
                       "python": python, "cwd": os.fspath(cwd or os.getcwd()),
                       "out": out, "err": err}
            server = self._started()
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
        deadline = time.monotonic() + timeout
        while ident not in self._pids:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([program, *request["argv"]], timeout)
            self._read_replies(deadline)
        return WarmProcess(self, ident, self._pids.pop(ident), [program, *request["argv"]],
                           folder)

    def _started(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, "-c", "from engine.testing.warm_start import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            self._pending = b""
        return self._server

    def _exit_code(self, ident: int, deadline: float) -> int | None:
        """The exit code of request ``ident``, waiting for it until ``deadline``; None
        when it is still running then."""
        while ident not in self._exits:
            self._read_replies(deadline)  # once at least: poll() reads what came
            if ident not in self._exits and time.monotonic() >= deadline:
                return None
        return self._exits.pop(ident)

    def _read_replies(self, deadline: float) -> None:
        """Read what the server answered (``pid ID PID``, ``exit ID CODE CPU_S``) for at
        most a tenth of a second, or until ``deadline``: other threads may be waiting
        for their own commands' answers."""
        with self._lock:
            server = self._server
            if server is None:
                raise RuntimeError("the warm-start server is gone")
            if b"\n" not in self._pending:
                wait = min(0.1, max(0.0, deadline - time.monotonic()))
                ready, _, _ = select.select([server.stdout], [], [], wait)
                if not ready:
                    return
                # Raw reads and our own buffer: a buffered readline could swallow the
                # next line, which select would then never report.
                chunk = os.read(server.stdout.fileno(), 4096)
                if not chunk:
                    self._server = None
                    raise RuntimeError(f"the warm-start server exited (code "
                                       f"{server.wait()}); set {DISABLE_ENV}=0 to run real "
                                       "subprocesses")
                self._pending += chunk
            while b"\n" in self._pending:
                line, _, self._pending = self._pending.partition(b"\n")
                kind, ident, value = line.decode().split(" ", 2)
                if kind == "pid":
                    self._pids[int(ident)] = int(value)
                elif kind == "exit":
                    code, _, cpu_s = value.partition(" ")
                    self.cpu_s += float(cpu_s or 0)
                    self._exits[int(ident)] = int(code)
                else:
                    raise RuntimeError(f"warm-start server: unexpected answer {line!r}")

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        self._server = None


class WarmProcess:
    """A command the server forked, as a subprocess.Popen with captured text output:
    ``pid``, ``args``, ``returncode``, ``poll()``, ``wait()``, ``communicate()`` and
    ``kill()`` (its whole session: its workers too, as a timeout of subprocess.run
    kills the process)."""

    def __init__(self, starter: WarmStarter, ident: int, pid: int, args: list[str],
                 folder: str) -> None:
        self._starter, self._ident, self._folder = starter, ident, folder
        self.pid, self.args = pid, args
        # Its output folder goes with the handle when nobody read it (a test that only
        # waited for it, or killed it).
        weakref.finalize(self, shutil.rmtree, folder, True)
        self.returncode: int | None = None
        self._output: tuple[str, str] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter._exit_code(self._ident, time.monotonic())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        if self.returncode is None:
            self.returncode = self._starter._exit_code(self._ident, deadline)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once it ended; on a timeout it is killed (its session),
        and the TimeoutExpired carries what it had printed."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(30)
            out, err = self._read_output()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err) from None
        return self._read_output()

    def kill(self) -> None:
        kill_session(self.pid)

    def _read_output(self) -> tuple[str, str]:
        if self._output is None:
            self._output = (_read(os.path.join(self._folder, "stdout")),
                            _read(os.path.join(self._folder, "stderr")))
            shutil.rmtree(self._folder, ignore_errors=True)
        return self._output


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


# ----------------------------------------------------------------------------- server


def serve() -> None:
    """The server: import what every run imports, then fork one child per request line
    on stdin, at once (children run side by side); answer ``pid ID N`` when it started
    and ``exit ID CODE CPU_S`` when it ended (CPU_S: its user and system CPU seconds,
    with those of the workers it reaped). Each child's pidfd tells when it ended."""
    # the server's alone: the clients (every test process) need not import the run's modules
    from engine.spares import import_run_modules

    import_run_modules()  # what every command and worker imports, once here
    # torch.compile's stack, once here instead of in every compiling worker of the
    # tests. Not in import_run_modules: a run's spare would pay it whether or not it
    # compiles.
    for module in ("torch._dynamo.backends.debugging", "torch._inductor.compile_fx"):
        importlib.import_module(module)
    if threading.active_count() != 1:  # forking a threaded process can deadlock the child
        raise SystemExit(f"warm-start server: {threading.active_count()} threads after "
                         "the imports; cannot fork safely")
    # Everything imported so far moves to the collector's permanent generation: a forked
    # child's collections no longer walk (and so write to, copying page by page) the
    # objects it inherited.
    gc.freeze()
    running: dict[int, tuple[int, int]] = {}  # a child's pidfd -> (request id, pid)
    pending, reading = b"", True
    while reading or running:
        ready, _, _ = select.select([0] * reading + list(running), [], [])
        for fd in ready:
            if fd == 0:
                chunk = os.read(0, 1 << 16)
                reading = bool(chunk)  # the client closed its end: serve what runs
                pending += chunk
                while b"\n" in pending:
                    line, _, pending = pending.partition(b"\n")
                    request = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        for other in running:  # its siblings' handles are not its own
                            os.close(other)
                        _child(request)  # never returns
                    running[os.pidfd_open(pid)] = (request["id"], pid)
                    print(f"pid {request['id']} {pid}", flush=True)
            else:
                ident, pid = running.pop(fd)
                os.close(fd)
                _, status, usage = os.wait4(pid, 0)
                print(f"exit {ident} {os.waitstatus_to_exitcode(status)} "
                      f"{usage.ru_utime + usage.ru_stime:.3f}", flush=True)


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()  # its own session and process group, as a subprocess would get
        _redirect(0, os.devnull, os.O_RDONLY)
        _redirect(1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in extra if p not in sys.path]
        try:
            if request.get("python"):
                code = _run_python(request["argv"])
            else:
                sys.argv = ["engine-run", *request["argv"]]
                code = main(request["argv"])
        except SystemExit as exc:  # argparse (--help, usage errors) and sys.exit
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 (the child must reach os._exit)
        traceback.print_exc()
    finally:
        exit_process(code if isinstance(code, int) else 1)


def _run_python(argv: list[str]) -> int:
    """What ``python ARGV`` does after its start: a script, ``-m MODULE`` or ``-c CODE``,
    run as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as that command sets them."""
    if argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__",
                                                    "__builtins__": __builtins__})
    elif argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in sys.argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)
