"""The thread that finishes each memory snapshot off the step's path (the held copies,
checksum and header, the rows, under fsdp the ring's copy), and the rows' exchange
(each rank's row to its keepers, written into their buffers by the thread)."""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from engine import distributed
from engine.memory.buffer import EXCHANGE_HEAD, Buffer
from engine.memory.rows import LOSS_SUM, ROW_BYTES, ROW_HEAD, offsets


class Background:
    """This rank's thread for the jobs of each snapshot, in order. A job that fails
    sets ``memory.failed``: the ranks turn the tier off at the next check point."""

    #: How long anything waits for the thread (the process group's timeout comes first).
    TIMEOUT_S = 3600.0

    def __init__(self, memory):
        self.memory = memory
        self.cpu_s = 0.0  # the CPU seconds the thread's jobs took (MemoryCost counts them)
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
            started = time.thread_time()
            try:
                job()
            except Exception as exc:  # a peer gone, a buffer gone: the tier goes off
                self.memory.failed = self.memory.failed or (
                    f"the background copy failed: {type(exc).__name__}: {exc}")
            finally:
                self.cpu_s += time.thread_time() - started
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
    """At each snapshot, this rank's row to its keepers and the rows of those it keeps
    (rows.offsets), sent point to point, not waited for: the thread writes them into the
    buffer. Under fsdp none: a rank's snapshot and its ring copy hold its row."""

    def __init__(self, world, background: Background, sharded: bool = False):
        self.rank, size = world.rank, world.world_size
        moves = [] if sharded else offsets(world)
        self.keepers = [(self.rank + o) % size for o in moves]
        self.kept = [(self.rank - o) % size for o in moves]
        self.background = background
        self.rows = self.wire = None  # this rank's row, then the kept ones; on the wire
        self.work = None  # the operations started, not yet handed to the thread

    def bytes(self) -> dict[str, int]:
        """Per snapshot: the bytes of rows sent and received, and of the region kept."""
        return {"sent": len(self.keepers) * ROW_BYTES, "received": len(self.kept) * ROW_BYTES,
                "kept": EXCHANGE_HEAD + (1 + len(self.kept)) * ROW_BYTES}

    def line(self, device=None) -> torch.Tensor:
        """This rank's row as its snapshot holds it: on the group's device (NCCL: the
        GPU; else the CPU, in place), without keepers on ``device`` (the loss sum's)."""
        if self.rows is None:
            device = device if device and not self.keepers else distributed.collective_device()
            self.rows = torch.zeros(1 + len(self.kept), ROW_BYTES, dtype=torch.uint8,
                                    pin_memory=device.type == "cuda")
            self.wire = self.rows if device.type == "cpu" else self.rows.to(device)
            self.sum_slot = self.wire[0, 8:8 + LOSS_SUM.size].view(torch.float64)  # made once
        return self.wire[0]

    def start(self, row: bytes, loss_sum=None) -> None:
        """Send ``row`` (make_row's), ``loss_sum`` (a tensor) copied into it where it is."""
        self.background.wait()  # the previous rows are written, the tensors free
        wire, line = self.line(), self.rows[0].numpy()
        line[:8] = np.frombuffer(ROW_HEAD.pack(len(row), self.rank), dtype=np.uint8)
        line[8:8 + len(row)] = np.frombuffer(row, dtype=np.uint8)  # b"": did not fit
        if self.wire is not self.rows:  # pinned: the thread's write waits for it
            wire.copy_(self.rows[0], non_blocking=True)
        if loss_sum is not None and row:
            self.sum_slot.copy_(loss_sum)
        if self.keepers and distributed.is_initialized():
            self.work = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, self.wire[0], k) for k in self.keepers]
                + [dist.P2POp(dist.irecv, self.wire[1 + i], r) for i, r in enumerate(self.kept)])

    def record(self, target: Buffer | None, sequence: int) -> None:
        """The rows of the exchange :meth:`start` began go into ``target`` (the buffer of
        the snapshot ``sequence``, finished by the thread; None: none saved) once come."""
        work, self.work = self.work, None

        def write() -> None:
            for one in work or ():
                one.wait()  # the GIL is released meanwhile
            if self.wire is not self.rows:
                # NCCL's wait only orders this thread's stream after the transfers: the
                # rows (this rank's loss sum too) are read once that stream got there.
                torch.cuda.current_stream(self.wire.device).synchronize()
                self.rows.copy_(self.wire)
            if target is not None:
                target.write_exchange(sequence, self.rows.numpy())

        if work is None and not self.background.pending:
            write()  # no transfer, the snapshot whole: no thread to wake for it
            return
        self.background.submit(write)
