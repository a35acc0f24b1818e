"""The thread that finishes each memory snapshot off the step's path (the held copies,
checksum and header, the rows, under fsdp the ring's copy), and the rows' exchange
(an all_gather nobody waits for, written into the buffer by the thread)."""

from __future__ import annotations

import os
import queue
import struct
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from engine import distributed
from engine.memory.buffer import Buffer
from engine.memory.rows import ROW_BYTES


class Background:
    """This rank's thread for the jobs of each snapshot, in order. A job that fails
    sets ``memory.failed``: the ranks turn the tier off at the next check point."""

    #: How long anything waits for the thread: the process group's own timeout ends a
    #: collective whose peer died well before this.
    TIMEOUT_S = 3600.0

    def __init__(self, memory):
        self.memory = memory
        self._forget()
        _LIVE.add(self)

    def _forget(self) -> None:
        """No thread, nothing pending: at the start, and in a forked child (a loader
        worker), which must not wait on what the parent's thread held at the fork."""
        self.queue = self.thread = self.idle = self.lock = None
        self.pending = 0
        self.copied = threading.Event()  # clear while a snapshot's copy is in flight
        self.copied.set()

    def submit(self, job) -> None:
        if self.thread is None:
            self.queue, self.idle, self.lock = queue.SimpleQueue(), threading.Event(), \
                threading.Lock()
            self.thread = threading.Thread(target=self._serve, daemon=True,
                                           name="engine-memory-snapshots")
            self.thread.start()
        with self.lock:
            self.pending += 1
            self.idle.clear()
        self.queue.put(job)

    def _serve(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:  # stop()
                return
            try:
                job()
            except Exception as exc:  # a peer gone, a buffer gone: the tier goes off
                self.memory.failed = self.memory.failed or (
                    f"the background copy failed: {type(exc).__name__}: {exc}")
            finally:
                with self.lock:
                    self.pending -= 1
                    if not self.pending:
                        self.idle.set()

    def stop(self, wait: bool = True) -> None:
        """End the thread once its jobs are done, waiting for them unless not ``wait``
        (a failed run, whose collectives may never come)."""
        if self.thread is None:
            return
        if wait:
            self.wait()
        self.queue.put(None)
        if wait:
            self.thread.join(self.TIMEOUT_S)
        self.thread = None

    def wait(self, event=None) -> None:
        """Until the thread is idle (or ``event``, :attr:`copied`, is set)."""
        event = self.idle if event is None else event
        if event is not None and not event.wait(self.TIMEOUT_S):
            raise RuntimeError(f"a memory snapshot's background copy and exchange did not "
                               f"finish in {self.TIMEOUT_S:.0f} s")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Background of this process


def _forget_threads_in_child() -> None:
    for background in list(_LIVE):
        background._forget()


os.register_at_fork(after_in_child=_forget_threads_in_child)


class Exchanges:
    """Every rank's row at each snapshot: an all_gather not waited for; the thread
    writes the rows into the buffer when they have come."""

    def __init__(self, world_size: int, background: Background):
        self.world_size = world_size
        self.background = background
        self.line = self.line_tensor = None  # this rank's row (numpy, torch)
        self.row = self.rows = self.views = None  # the same, and every rank's (torch)
        self.work = None  # the all_gather started, not yet handed to the thread

    def start(self, row: bytes) -> None:
        self.background.wait()  # the previous rows are written, the tensors free
        spread = distributed.is_initialized()
        if self.line is None:
            self._allocate(distributed.collective_device() if spread else None)
        line = self.line
        line[:8] = np.frombuffer(struct.pack("<Q", len(row)), dtype=np.uint8)
        line[8:8 + len(row)] = np.frombuffer(row, dtype=np.uint8)  # b"": did not fit
        if spread:
            if self.row.device.type != "cpu":
                self.row.copy_(self.line_tensor)
            self.work = dist.all_gather(self.views, self.row, async_op=True)

    def _allocate(self, device) -> None:
        """This rank's row and every rank's: on the CPU the row is the collective's own
        tensor (written in place); on a GPU (NCCL) a pinned copy is sent over."""
        self.line_tensor = torch.zeros(ROW_BYTES, dtype=torch.uint8)
        self.line = self.line_tensor.numpy()
        if device is None:
            return
        self.row = self.line_tensor if device.type == "cpu" else torch.zeros(
            ROW_BYTES, dtype=torch.uint8, device=device)
        self.rows = torch.zeros(self.world_size, ROW_BYTES, dtype=torch.uint8,
                                device=device)
        self.views = list(self.rows.unbind(0))

    def record(self, target: Buffer | None, sequence: int) -> None:
        """The rows of the exchange :meth:`start` began go into ``target`` (the buffer
        just saved, holding the snapshot ``sequence`` once the background thread has
        finished it; None: this rank saved none) when they have come."""
        work, self.work = self.work, None

        def write() -> None:
            if work is not None:
                work.wait()  # the GIL is released meanwhile
                if self.rows.device.type == "cuda":
                    # NCCL's wait only orders this thread's stream after the gather:
                    # the rows are read once that stream got there.
                    torch.cuda.current_stream(self.rows.device).synchronize()
            if target is not None:
                target.write_exchange(sequence, self.line.reshape(1, -1) if work is None
                                      else self.rows.cpu().numpy())

        if work is None and target is None:
            return
        if work is None and not self.background.pending:
            write()  # a single process, its snapshot whole: no thread to wake for it
            return
        self.background.submit(write)
