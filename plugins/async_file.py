"""Checkpointer ``async``: torch-file's files, written by a background process.

``save()`` blocks the training loop only while the snapshot's tensors are copied into
one shared-memory buffer (a memcpy; no serialization, no hashing, no disk). A writer
process then serializes, hashes, fsyncs and commits them exactly as ``torch-file``
does (it *is* a :class:`TorchFileCheckpointer` on the other side of a queue), so both
produce the same layout and a run can switch between them and resume.

Why these choices:

- A process, not a thread: ``torch.save`` pickles and sha256 hashes under the GIL for
  much of its time, and would steal it from the training loop.
- Spawned once, on the first save, and fed through a ``torch.multiprocessing`` queue:
  the buffer travels as a shared-memory handle, never as bytes through a pipe.
- One buffer, reused: the first save allocates it (page faults), later saves only copy.
  That is only safe because a save waits for the previous write first, which is also
  what keeps at most one snapshot in flight (memory stays bounded).
- The writer rebuilds each tensor with ``torch.frombuffer`` at its offset: its own
  storage without a copy, so ``torch.save`` writes the same records as torch-file.

Errors: a failed write (a full disk, say) is reported as a one-line
:class:`~engine.errors.CheckpointError` by the next ``save()``, ``wait()`` or
``close()``; the previous snapshot and the ``latest`` pointer are left as they were. A
writer that dies is noticed within :data:`POLL_S` seconds instead of being waited for.

Exit: ``close()`` (the engine calls it at the end of every run, failed runs included)
waits until the last write is durable. A checkpointer that is never closed is closed
when its process exits, before multiprocessing stops its children.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import queue
import sys
import time
import types

import engine
from engine.errors import CheckpointError
from engine.plugins.torch_file import TorchFileCheckpointer, snapshot_name, warn

#: Seconds between checks that the writer (or, in the writer, the trainer) is alive.
POLL_S = 0.5
#: Tensors start at multiples of this many bytes in the buffer (any dtype's alignment).
ALIGN = 64
#: Where shared memory comes from (torch's file_descriptor sharing uses shm_open).
SHM = "/dev/shm"
MB = 1 << 20


class _Slot:
    """Stands for the ``index``-th tensor of a snapshot while it travels to the writer."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return (_Slot, (self.index,))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def split_tensors(state, tensors: list):
    """A copy of ``state`` with every tensor replaced by a :class:`_Slot`; the tensors
    are appended to ``tensors``. Containers keep their type (an OrderedDict keeps its
    ``_metadata``), so the file the writer produces is the one torch-file would."""
    import torch

    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return _Slot(len(tensors) - 1)
    if isinstance(state, dict):
        out = copy.copy(state)
        for key, value in state.items():
            out[key] = split_tensors(value, tensors)
        return out
    if isinstance(state, list):
        return [split_tensors(v, tensors) for v in state]
    if isinstance(state, tuple):
        items = [split_tensors(v, tensors) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


def fill_slots(skeleton, tensors: list):
    """The inverse of :func:`split_tensors` (in place where the container allows)."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        for key, value in skeleton.items():
            skeleton[key] = fill_slots(value, tensors)
        return skeleton
    if isinstance(skeleton, list):
        return [fill_slots(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        items = [fill_slots(v, tensors) for v in skeleton]
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else tuple(items)
    return skeleton


def plan_layout(tensors: list) -> tuple[list[tuple], int]:
    """(offset, dtype, shape, numel) of each tensor in the buffer, and the bytes needed."""
    layout, offset = [], 0
    for t in tensors:
        layout.append((offset, t.dtype, tuple(t.shape), t.numel()))
        offset += _align(t.numel() * t.element_size())
    return layout, offset


def copy_into(buffer, tensors: list, layout: list) -> None:
    """The only work the training loop waits for: one copy per tensor."""
    for t, (offset, dtype, shape, numel) in zip(tensors, layout):
        if numel:
            nbytes = numel * t.element_size()
            buffer[offset:offset + nbytes].view(dtype).view(shape).copy_(t.detach())


def views_of(buffer, layout: list) -> list:
    """Tensors over the buffer's memory, each with a storage of its own (no copy)."""
    import torch

    memory = buffer.numpy()
    return [torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(shape)
            if numel else torch.empty(shape, dtype=dtype)
            for offset, dtype, shape, numel in layout]


def check_shared_memory(nbytes: int, folder: str = SHM) -> None:
    """Shared memory is only reserved when touched: too little of it would kill the
    trainer with SIGBUS in the middle of the copy. Docker gives containers 64 MB."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return  # not Linux-like: let torch try
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        raise CheckpointError(
            f"the async checkpointer needs {nbytes / MB:.0f} MB of shared memory for a "
            f"snapshot, but {folder} has {free / MB:.0f} MB free; make it larger (docker: "
            "--shm-size) or use --checkpointer torch-file")


# ----------------------------------------------------------------- the writer


def writer_main(jobs, results, directory: str, checkpoint: dict | None) -> None:
    """The writer process: one job at a time, until ``None`` or the trainer is gone."""
    import torch

    torch.set_num_threads(1)  # serialization does not use them; the trainer does
    import multiprocessing
    import signal

    # Ctrl-C, SLURM's pre-emption signal (USR1, then TERM) and a launcher's TERM reach
    # every process of the job. The trainer decides what they mean, and may well want
    # one more snapshot written; this process finishes what it was given and ends when
    # told to or when the trainer is gone. (They were blocked since the spawn.)
    for sig in job_signals():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, job_signals())
    cfg = None if checkpoint is None else types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(**checkpoint))
    writer = TorchFileCheckpointer(pathlib.Path(directory), cfg)
    trainer = multiprocessing.parent_process()
    while True:
        try:
            job = jobs.get(timeout=POLL_S)
        except queue.Empty:
            if trainer is not None and not trainer.is_alive():
                return  # the trainer died: nothing more will come
            continue
        if job is None:
            return
        path = pathlib.Path(job["path"])
        error = None
        try:
            state = fill_slots(job["skeleton"], views_of(job["buffer"], job["layout"]))
            writer.directory.mkdir(parents=True, exist_ok=True)
            writer.write_snapshot(state, path, epoch=job["epoch"], step=job["step"],
                                  metrics=job["metrics"])
            writer.commit(path, job["metrics"])
        except Exception as exc:
            error = f"{type(exc).__name__}: {_first_line(exc)}"
        # Let go of the buffer before saying we are done: the trainer reuses it.
        job = state = None
        results.put((str(path), error))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def job_signals() -> set:
    import signal

    return {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}


@contextlib.contextmanager
def _job_signals_blocked():
    """Around the spawn: the child inherits the blocked set, so no job signal can kill
    it before it has chosen to ignore them. Here they are only held back: one that
    arrives meanwhile is delivered when the set is restored, not lost."""
    import signal

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, job_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _main_module_hidden():
    """Spawn re-imports the parent's ``__main__`` in the child unless it cannot find it.
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
        self._jobs = self._results = None
        self._buffer = None  # shared memory, reused by every save
        self._pending: pathlib.Path | None = None  # the write in flight
        self._at_exit = None

    # --------------------------------------------------------------- saving

    def save(self, state, *, epoch, step, metrics=None):
        self.wait()  # the previous write must be done: it reads the buffer we reuse
        import torch

        tensors: list = []
        skeleton = split_tensors(state, tensors)
        layout, nbytes = plan_layout(tensors)
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one first: both may not fit
            check_shared_memory(nbytes)
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()
        copy_into(self._buffer, tensors, layout)
        self._start_writer()
        path = self.directory / snapshot_name(epoch, step)
        self._jobs.put({"path": str(path), "skeleton": skeleton, "layout": layout,
                        "buffer": self._buffer, "epoch": epoch, "step": step,
                        "metrics": dict(metrics or {})})
        self._pending = path
        return path  # durable once wait() returns

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
        import multiprocessing.util

        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        checkpoint = None
        if self.cfg is not None and getattr(self.cfg, "checkpoint", None) is not None:
            c = self.cfg.checkpoint
            checkpoint = {"keep_last": c.keep_last, "best_metric": c.best_metric,
                          "best_mode": c.best_mode}
        # daemon: never left behind; the exit hook below lets it finish first.
        self._process = ctx.Process(target=writer_main, name="engine-checkpoint-writer",
                                    args=(self._jobs, self._results, str(self.directory),
                                          checkpoint), daemon=True)
        with _main_module_hidden(), _job_signals_blocked():
            self._process.start()
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
            try:
                done, error = self._results.get(timeout=POLL_S)
                break
            except queue.Empty:
                pass
            if not self._process.is_alive():
                try:  # it may have reported just before it went
                    done, error = self._results.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    pass
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

    def _latest_name(self) -> str:
        pointed = self._pointer("latest")
        return str(pointed) if pointed is not None else "there is none"

    def latest(self):
        self.wait()
        return super().latest()

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

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except CheckpointError as exc:
            warn(str(exc))

    def _stop_writer(self) -> None:
        if self._process is None:
            return
        try:
            self._jobs.put(None)
            self._process.join(timeout=30)
        finally:
            if self._process.is_alive():
                self._process.kill()  # it ignores SIGTERM
                self._process.join(timeout=5)
            self._forget_writer()

    def _forget_writer(self, keep_buffer: bool = False) -> None:
        if self._at_exit is not None:
            self._at_exit.cancel()
        for q in (self._jobs, self._results):
            if q is not None:
                q.close()
                q.cancel_join_thread()
        self._process = self._jobs = self._results = self._at_exit = None
        self._pending = None
        if not keep_buffer:
            self._buffer = None


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(AsyncFileCheckpointer)
