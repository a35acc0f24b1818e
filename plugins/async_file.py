"""Checkpointer ``async``: torch-file's files, written by a background process.

``save()`` blocks the training loop only while the snapshot is pickled with a marker in
each tensor's place and its tensors are copied into one shared-memory buffer (numpy
copies; no hashing, no disk): the memory tier's codec (engine/shm_codec.py). A writer
process then serializes, hashes, fsyncs and commits them exactly as ``torch-file``
does (it *is* a :class:`TorchFileCheckpointer` on the other side of a pipe), so both
produce the same layout and a run can switch between them and resume.

Why these choices:

- A process, not a thread: ``torch.save`` pickles and sha256 hashes under the GIL for
  much of its time, and would steal it from the training loop.
- Started once, on the first save, and given the buffer's file descriptor at the start
  (a bigger snapshot gets a new buffer and a new writer). Writers are forked from one
  fork server per trainer process that has imported torch (:mod:`engine.fork_server`):
  torch is imported once per trainer, not once per writer (seconds each on a small
  machine), and a writer is still a clean process (the server never ran a tensor
  operation or started a thread; nothing of the trainer's is inherited). The server
  starts with the first writer, inside :func:`_job_signals_blocked`: it and every
  writer forked from it begin with the job signals blocked. Jobs and results travel
  through two pipes as small pickles (where each tensor is, not its bytes). No
  multiprocessing Queue: each one leaves three named semaphores (/dev/shm/sem.mp-*)
  behind when the job is killed, and sending a tensor through one starts a
  resource-sharer socket in /tmp/pymp-*: nothing of ours can be left there.
- One buffer, reused: the first save allocates it (page faults), later saves only copy.
  That is only safe because a save waits for the previous write first, which is also
  what keeps at most one snapshot in flight (memory stays bounded). The buffer is an
  anonymous memory file (``memfd_create``): it has no name, so no other local user can
  take or block one (a /dev/shm name could be planted first), and a kill leaves nothing
  behind.
- The writer unpickles the skeleton and rebuilds each tensor where its marker is, with
  ``torch.frombuffer`` at its offset: its own storage without a copy, and every
  container as it was (an OrderedDict with its ``_metadata``), so ``torch.save`` writes
  the same records as torch-file.

Errors: a failed write (a full disk, say: named as such, not as torch's "unexpected
pos") is reported as a one-line :class:`~engine.errors.CheckpointError` by the next
``save()``, ``wait()`` or ``close()``; the previous snapshot and the ``latest`` pointer
are left as they were. A writer that dies is noticed within :data:`POLL_S` seconds
instead of being waited for.

Exit: ``close()`` (the engine calls it at the end of every run, failed runs included)
waits until the last write is durable, then removes what killed writers left in the
checkpoint folder (as torch-file does at its first save, and so do we). A checkpointer
that is never closed is closed when its process exits, before multiprocessing stops
its children.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import multiprocessing
import multiprocessing.util
import os
import pathlib
import signal
import sys
import threading
import time
import types
from multiprocessing import resource_tracker
from multiprocessing.connection import Pipe
from multiprocessing.reduction import DupFd

import engine
from engine import shm, shm_codec
from engine.atomic_io import os_error_in
from engine.checkpoint import disk_full_hint, warn
from engine.errors import CheckpointError, first_line
from engine.plugins.torch_file import TorchFileCheckpointer

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).

#: Seconds between checks that the writer (or, in the writer, the trainer) is alive.
POLL_S = 0.5
#: Where shared memory comes from (torch's file_descriptor sharing uses shm_open).
SHM = str(shm.SHM)
MB = 1 << 20


def copy_into(buffer, tensors: list) -> None:
    """The only work the training loop waits for: one copy per tensor (``tensors``:
    (offset, tensor) as engine.shm_codec.encode gives them), numpy's, GIL released."""
    array = buffer.numpy()
    for offset, tensor in tensors:
        copy = shm_codec.copier(array, buffer, offset, tensor)
        if copy is not None:
            copy()


def decode(skeleton: bytes, buffer):
    """The state the trainer encoded, each tensor a view of ``buffer`` with a storage
    of its own (no copy), so that torch.save writes the records torch-file writes."""
    import torch

    memory = buffer.numpy()

    def view(offset: int, dtype, shape):
        count = shape.numel()
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(shape)

    return shm_codec.decode(skeleton, view, plain=False)  # the trainer's own state


def check_shared_memory(nbytes: int, folder: str = SHM) -> None:
    """Shared memory is only reserved when touched: too little of it would kill the
    trainer with SIGBUS in the middle of the copy. Docker gives containers 64 MB."""
    free = shm.free_bytes(folder)
    if free is not None and free < nbytes:  # None: not to be asked, let torch try
        raise CheckpointError(
            f"the async checkpointer needs {nbytes / MB:.0f} MB of shared memory for a "
            f"snapshot, but {folder} has {free / MB:.0f} MB free; make it larger (docker: "
            "--shm-size) or use --checkpointer torch-file")


def shared_buffer(nbytes: int, folder: str = SHM) -> int:
    """A file descriptor of ``nbytes`` of shared memory without a name (nothing to
    plant, block or leave behind), reserved now: its pages are otherwise only taken
    when touched, and too little memory would kill the trainer with SIGBUS in the
    middle of the copy. ``folder``'s free space is asked first, as a bound."""
    check_shared_memory(nbytes, folder)
    fd = os.memfd_create("engine-checkpoint", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        check_shared_memory(1 << 62, folder)  # raises, with the sizes
    return fd


def map_buffer(fd: int, nbytes: int):
    """The shared memory behind ``fd`` as a uint8 tensor (torch keeps the map alive)."""
    import torch

    memory = mmap.mmap(fd, max(nbytes, 1))
    return torch.frombuffer(memory, dtype=torch.uint8)


class _SharedFd:
    """A file descriptor handed to the writer at its start: multiprocessing passes
    it to the child (no socket, no resource sharer, nothing named)."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes

    def __reduce__(self):
        return (_rebuild_buffer, (DupFd(self.fd), self.nbytes))


def _rebuild_buffer(dup, nbytes: int):
    fd = dup.detach()
    try:
        return map_buffer(fd, nbytes)
    finally:
        os.close(fd)  # the map keeps the memory


# ----------------------------------------------------------------- the writer


def writer_main(jobs, results, buffer, directory: str, checkpoint: dict | None) -> None:
    """The writer process: one job at a time, until ``None`` or the trainer is gone.
    ``jobs`` and ``results`` are pipe ends; ``buffer`` the shared memory (a tensor)."""
    import torch

    torch.set_num_threads(1)  # serialization does not use them; the trainer does

    # Ctrl-C, SLURM's pre-emption signal (USR1, then TERM) and a launcher's TERM reach
    # every process of the job. The trainer decides what they mean, and may well want
    # one more snapshot written; this process finishes what it was given and ends when
    # told to or when the trainer is gone. (They were blocked since its start.)
    for sig in job_signals():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, job_signals())
    cfg = None if checkpoint is None else types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(**checkpoint))
    writer = TorchFileCheckpointer(pathlib.Path(directory), cfg)
    trainer = multiprocessing.parent_process()
    while True:
        try:
            if not jobs.poll(POLL_S):
                if trainer is not None and not trainer.is_alive():
                    return  # the trainer died: nothing more will come
                continue
            job = jobs.recv()
        except (EOFError, OSError):
            return  # the trainer's end is closed: it is gone
        if job is None:
            return
        path = pathlib.Path(job["path"])
        error = None
        try:
            state = decode(job["skeleton"], buffer)
            writer.directory.mkdir(parents=True, exist_ok=True)
            writer.write_and_commit(state, path, epoch=job["epoch"], step=job["step"],
                                    metrics=job["metrics"])
        except Exception as exc:
            error = write_error(exc, writer.directory)
        # Let go of the buffer's views before saying we are done: the trainer reuses it.
        job = state = None
        results.send((str(path), error))


def write_error(exc: BaseException, directory: pathlib.Path) -> str:
    """One line for a failed write. torch.save reports a failed write as a RuntimeError
    ("unexpected pos ...") whose context is the OSError: that OSError is what to say."""
    os_error = os_error_in(exc)
    if os_error is None:
        return f"{type(exc).__name__}: {first_line(exc, type(exc).__name__)}"
    return (f"{type(os_error).__name__}: {first_line(os_error, type(os_error).__name__)}"
            + disk_full_hint(os_error, directory))


def job_signals() -> set:
    return {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}


@contextlib.contextmanager
def _job_signals_blocked():
    """Around the start: the child inherits the blocked set, so no job signal can kill
    it before it has chosen to ignore them. Here they are only held back: one that
    arrives meanwhile is delivered when the set is restored, not lost."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, job_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _main_module_hidden():
    """A started process re-imports the parent's ``__main__`` unless it cannot find it.
    The writer needs nothing from it, and a user's script without an
    ``if __name__ == "__main__"`` guard would start training all over again there."""
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


# ------------------------------------------------------------ the checkpointer


class AsyncFileCheckpointer(TorchFileCheckpointer):
    name = "async"
    #: The longest one write may take before wait() gives up on it.
    write_timeout_s: float = 3600.0

    def __init__(self, directory, cfg=None, world=None):
        super().__init__(directory, cfg, world)
        self._process = None
        self._jobs = self._results = None  # our ends of the two pipes
        self._buffer = None  # shared memory (a uint8 tensor), reused by every save
        self._buffer_fd = None  # its file descriptor, handed to each writer
        self._pending: pathlib.Path | None = None  # the write in flight
        self._at_exit = None

    # --------------------------------------------------------------- saving

    def save(self, state, *, epoch, step, metrics=None):
        self.wait()  # the previous write must be done: it reads the buffer we reuse
        skeleton, tensors, nbytes, _ = shm_codec.encode(state)
        if self._buffer is None or self._buffer.numel() < nbytes:
            # The writer maps the buffer it was started with: a new one, a new writer.
            self._stop_writer()
            self._free_buffer()  # first: both may not fit
            self.clean_up_once()
            self._buffer_fd = shared_buffer(nbytes)
            self._buffer = map_buffer(self._buffer_fd, nbytes)
        copy_into(self._buffer, tensors)
        self._start_writer()
        path = self.directory / self.snapshot_name(epoch, step)
        job = {"path": str(path), "skeleton": skeleton,
               "epoch": epoch, "step": step, "metrics": dict(metrics or {})}
        # Sent from a thread: a pipe takes 64 kB without a reader, a large model's job
        # may be more, and a stopped writer must not block the loop (wait() watches it
        # with a timeout). The writer's answer comes after it has read the whole job.
        threading.Thread(target=self._send, args=(self._jobs, job), daemon=True,
                         name="engine-checkpoint-job").start()
        self._pending = path
        return path  # durable once wait() returns

    @staticmethod
    def _send(end, job) -> None:
        try:
            end.send(job)
        except OSError:  # a broken pipe or a closed end: the writer is gone; wait() says how
            pass

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id while it runs (it starts at the first save)."""
        return self._process.pid if self._process is not None else None

    def _start_writer(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                return
            # It died between two saves (the OOM killer, say): no write was lost.
            warn(f"the checkpoint writer process died (exit code {self._process.exitcode}) "
                 "while idle; starting a new one")
            self._forget_writer(keep_buffer=True)
        # Here, not at the top: it brings multiprocessing's fork server modules, which
        # loading the plugin (every run's launching process) does not need.
        from engine.fork_server import TorchForkServerProcess

        jobs_out, self._jobs = Pipe(duplex=False)
        self._results, results_in = Pipe(duplex=False)
        checkpoint = None
        if self.cfg is not None and getattr(self.cfg, "checkpoint", None) is not None:
            c = self.cfg.checkpoint
            checkpoint = {"keep_last": c.keep_last, "best_metric": c.best_metric,
                          "best_mode": c.best_mode}
        # daemon: never left behind; the exit hook below lets it finish first.
        self._process = TorchForkServerProcess(
            target=writer_main, name="engine-checkpoint-writer", daemon=True,
            args=(jobs_out, results_in, _SharedFd(self._buffer_fd, self._buffer.numel()),
                  str(self.directory), checkpoint))
        # multiprocessing's resource tracker first: its start unblocks SIGINT and
        # SIGTERM in this thread (the stdlib's own clean-up), which inside the block
        # below would let the fork server, and so every writer, start without them
        # blocked.
        resource_tracker.ensure_running()
        try:
            with _main_module_hidden(), _job_signals_blocked():
                self._process.start()
        finally:
            # The child has its own copies: with ours closed, a dead writer is an EOF.
            jobs_out.close()
            results_in.close()
        # Runs at interpreter exit before multiprocessing terminates daemonic children
        # (priority >= 0), in the main process and in multiprocessing workers alike.
        self._at_exit = multiprocessing.util.Finalize(None, self._close_at_exit,
                                                      exitpriority=100)

    # -------------------------------------------------------------- waiting

    def wait(self) -> None:
        """Block until the write in flight is durable; raise if it failed."""
        path = self._pending
        if path is None:
            return
        deadline = time.monotonic() + self.write_timeout_s
        while True:
            result = self._result(POLL_S)
            if result is not None:
                done, error = result
                break
            if not self._process.is_alive() or self._results is None:
                self._process.join(timeout=POLL_S)
                code = self._process.exitcode
                self._forget_writer()
                raise CheckpointError(
                    f"the checkpoint writer process died (exit code {code}) while writing "
                    f"{path}; the previous snapshot is untouched: {self._latest_name()}")
            if time.monotonic() > deadline:
                # Stop it: a later save must not refill the buffer it still reads.
                self._process.kill()  # it ignores SIGTERM
                self._process.join(timeout=5)
                self._forget_writer()
                raise CheckpointError(
                    f"writing {path} took longer than {self.write_timeout_s:g}s; the "
                    f"previous snapshot is untouched: {self._latest_name()}")
        self._pending = None
        if error is not None:
            raise CheckpointError(f"writing {done} failed: {error}; the previous snapshot "
                                  f"is untouched: {self._latest_name()}")

    def _result(self, timeout: float):
        """(path, error) from the writer, or None: nothing within ``timeout``, or the
        writer is gone (its end of the pipe closed)."""
        try:
            if self._results.poll(timeout):
                return self._results.recv()
        except (EOFError, OSError):
            self._process.join(timeout=5)  # it is exiting: let is_alive() say so
        return None

    def _latest_name(self) -> str:
        pointed = self.pointer("latest")
        return str(pointed) if pointed is not None else "there is none"

    def latest(self):
        self.wait()
        return super().latest()

    def best(self):
        self.wait()  # the writer moves the pointer
        return super().best()

    # -------------------------------------------------------------- closing

    def close(self) -> None:
        """Wait for the last write, then stop the writer. When an exception is already
        on its way (a failed run's clean-up), a write error is printed, not raised, so
        that it does not hide the original one."""
        unwinding = sys.exc_info()[1] is not None
        try:
            self.wait()
        except CheckpointError as exc:
            if not unwinding:
                raise
            warn(str(exc))
        finally:
            self._stop_writer()
            self._free_buffer()
            self.clean_up()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except CheckpointError as exc:
            warn(str(exc))

    def _stop_writer(self) -> None:
        if self._process is None:
            return
        try:
            self._send(self._jobs, None)  # a few bytes: the writer has read every job
            self._process.join(timeout=30)
        finally:
            if self._process.is_alive():
                self._process.kill()  # it ignores SIGTERM
                self._process.join(timeout=5)
            self._forget_writer()

    def _forget_writer(self, keep_buffer: bool = False) -> None:
        if self._at_exit is not None:
            self._at_exit.cancel()
        for end in (self._jobs, self._results):
            if end is not None:
                end.close()
        self._process = self._jobs = self._results = self._at_exit = None
        self._pending = None
        if not keep_buffer:
            self._free_buffer()

    def _free_buffer(self) -> None:
        self._buffer = None  # the map goes with the last view of it
        if self._buffer_fd is not None:
            os.close(self._buffer_fd)
            self._buffer_fd = None


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(AsyncFileCheckpointer)
