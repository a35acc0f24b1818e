"""This rank's pair of buffers (:class:`MemorySnapshots`), written alternately::

    /dev/shm/engine-memory-<uid>/<run id>-r<rank>-a, -b      (folder 0700, files 0600)

The state is pickled once with a marker at each tensor (engine.shm_codec); the copies
planned at a save (copy_plan.py) are done again while the tensors are the same."""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import struct

import torch

from engine import phases
from engine.memory.background import Background, Exchanges
from engine.memory.buffer import (HEADER_BYTES, PAYLOAD, REACHED_AT, Buffer, Slot,
                                  checksum, data_start, newest, payload_size,
                                  read_header, signed)
from engine.memory.copy_plan import Plan
from engine.memory.files import (Unsafe, buffer_paths, folder_of, mount_namespace,
                                 own_dir, own_folder, run_buffers, user_folder)
from engine.shm import SHM, free_bytes, unlink_own
from engine.shm_codec import encode


class MemorySnapshots:
    """This rank's two buffers: :meth:`check` at the start, :meth:`save` every
    ``every_steps`` optimizer steps, :meth:`remove` when the run ends by itself."""

    def __init__(self, run_dir, world, every_steps: int, run_id: str,
                 shm: pathlib.Path = SHM, sharded: bool = False):
        self.run_dir = pathlib.Path(run_dir)
        self.world = world
        self.every_steps = every_steps
        self.shm = pathlib.Path(shm)
        self.run_id = run_id  # claim_run_id's, the same on every rank
        self.raw_id = bytes.fromhex(self.run_id)
        self._paths(folder_of(run_dir, shm))
        self.sequence = 0  # the newest valid buffer's; the next save writes above it
        self.newest_index: int | None = None
        self.saves = 0
        self.reached_before = 0  # how far the interrupted run had got (agree() says)
        self.sharded = sharded  # fsdp: its shards restore only a sharded model
        self.config = None  # the run's config, pickled once (snapshot.py: shm_codec.Pickled)
        self.failed: str | None = None  # why the last save failed: off at the next check
        self.info = {"run_dir": str(os.path.realpath(self.run_dir)),
                     "host": socket.gethostname(), "mnt": mount_namespace(),
                     "pid": os.getpid(), "rank": world.rank, "world_size": world.world_size}
        self.background = Background(self)
        self.exchanges = Exchanges(world, self.background, sharded)
        self.exchange_bytes = self.exchanges.bytes()["kept"]
        self.hook = None  # the next optimizer step's wait (hold)
        self.plan: Plan | None = None  # the last save's (reused while the state allows)
        self.ring = None  # fsdp, more than one process: ring.py's Ring (the tier's)

    def _paths(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.paths = buffer_paths(self.run_dir, self.world.rank, run_id=self.run_id,
                                  folder=folder)
        self.buffers = [Buffer(p) for p in self.paths]

    def check(self) -> str | None:
        """Why the run's buffer folder (:func:`own_folder`) is not safe (None: it is)."""
        try:
            self._paths(own_folder(self.run_dir, self.shm))
        except Unsafe as exc:
            return str(exc)
        return None

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def newest(self) -> Slot | None:
        slot = newest(self.paths, self.run_id)
        if slot is not None:
            self.sequence = slot.sequence
            self.newest_index = self.paths.index(slot.path)
        return slot

    def reached(self) -> int:
        """The step the run had reached at its last write to buffer a (0: unknown)."""
        header = read_header(self.paths[0])
        return struct.unpack_from("<Q", header, REACHED_AT)[0] if header else 0

    def note_reached(self, step: int) -> None:
        """After each optimizer step: the step reached, in buffer a's header (a restart
        says how many steps it lost), the background copy done by then (:meth:`hold`)."""
        if self.hook is not None:
            self.background.wait(self.background.copied)
            self.hook.remove()
            self.hook = None
        if self.buffers[0].tensor is not None:
            self.buffers[0].note_reached(step)

    def reserve(self, state: dict) -> None:
        """Map both buffers with room for ``state`` at the first save: a tmpfs filling
        up later cannot take the second one's pages. NoRoom or Unsafe."""
        skeleton, _, data_size = encode(state)[:3]
        self._reserve(payload_size(skeleton, data_size), range(2))
        if self.ring is not None:  # the predecessor's copies: about as large as its own
            self.ring.reserve(payload_size(skeleton, data_size))

    def _reserve(self, needed: int, indices) -> None:
        if all(b.fd is None for b in self.buffers):  # this process's first: the folder
            own_dir(self.folder)                   # is checked again
        # Room for the skeleton to grow without remapping at the next save.
        capacity = needed + max(64 * 1024, needed // 64)
        for i in indices:
            if self.buffers[i].tensor is None or self.buffers[i].capacity < needed:
                self.buffers[i].map(capacity, self.info, self.raw_id, self.exchange_bytes)

    def save(self, state: dict, *, step: int, epoch: int, held=None) -> bool:
        """Copy ``state`` into the buffer without the newest snapshot (the last save's
        :class:`Plan` while the tensors are the same); NoRoom or Unsafe, the newest kept.
        ``held`` (held_by's, or a callable giving it): tensors whose copy, the checksum
        and header may go to the background thread; returns whether they did (hold)."""
        plan = self.plan
        skeleton, tensors, data_size, key = encode(state, plan)
        if key is not None or not plan.fits(skeleton, held):
            plan = self.plan = Plan(key or plan.key, tensors, data_size,
                                    data_start(len(skeleton)),
                                    held() if callable(held) else held)
        index = 1 if self.newest_index == 0 else 0
        buffer = self.buffers[index]
        # Both at the first save (reserve), the target alone when the state grew.
        self._reserve(plan.data_at + plan.data_size,
                      [index] if self.buffers[1 - index].tensor is not None
                      else [index, 1 - index])
        now, later = plan.copies_into(index, buffer)
        stream = None
        if plan.device is not None:
            buffer.pin()
            # The background copies go on the stream the step's kernels are on: after
            # the optimizer step that made the state, as the step's own copies would.
            stream = torch.cuda.current_stream(plan.device)
        buffer.invalidate()
        array, at = buffer.array, HEADER_BYTES + PAYLOAD.size
        array[HEADER_BYTES:at] = bytearray(PAYLOAD.pack(len(skeleton), plan.data_at))
        array[at:at + len(skeleton)] = bytearray(skeleton)
        for copy in now:
            copy()
        self.sequence += 1
        sequence, raw_id, length = self.sequence, self.raw_id, plan.length

        def finish() -> None:
            try:
                with (contextlib.nullcontext() if stream is None
                      else torch.cuda.stream(stream)):
                    for copy in later:
                        copy()
                if stream is not None:  # every copy off the GPU, none waited for, done
                    stream.synchronize()
                digest = checksum(signed(sequence, step, epoch, length, raw_id),
                                  array[HEADER_BYTES:HEADER_BYTES + length])
                buffer.write_header(sequence, step, epoch, length, raw_id, digest)
            finally:
                self.background.copied.set()

        self.newest_index = index
        self.saves += 1
        if not plan.background:
            finish()
            return False
        self.background.copied.clear()
        self.background.submit(finish)
        return True

    def hold(self, optimizer) -> None:
        """``optimizer``'s next step waits for the background copy (a pre-hook)."""
        if self.hook is None:
            self.hook = optimizer.register_step_pre_hook(self._wait_for_copy)

    def _wait_for_copy(self, *_) -> None:
        """The wait, timed as the snapshot's cost (phases.MEMORY_WAITS) for auto."""
        with phases.carve(phases.MEMORY_WAITS, within="training",
                          label="memory snapshot copy wait"):
            self.background.wait(self.background.copied)

    def finish(self) -> None:
        """Wait for what the background thread has yet to do."""
        self.background.wait()

    def record_exchange(self, saved: bool) -> None:
        """After ``exchanges.start`` and the save: the thread writes the rows into it."""
        target = self.buffers[self.newest_index] if saved else None
        self.exchanges.record(target, self.sequence)
        if self.ring is not None:  # after the copy and the rows, in the same thread
            self.ring.copy(target, self.sequence)

    def room_for(self, state: dict) -> tuple[int, int]:
        """The bytes the buffers of ``state`` take on this machine (every local rank asks
        at once), and the bytes free in the tmpfs plus what this run's already take."""
        skeleton, _, data_size = encode(state)[:3]
        free = free_bytes(self.shm)
        held = 0
        for path in run_buffers(self.run_id, self.shm, self.run_dir):
            try:
                # Its pages, not its size: tmpfs sets the size after another local rank's
                # posix_fallocate has taken the pages from the free space.
                held += os.lstat(path).st_blocks * 512
            except OSError:
                pass
        one = HEADER_BYTES + payload_size(skeleton, data_size)
        # fsdp: two copies of the predecessor's, about as large.
        per_rank = 2 * (one + self.exchange_bytes) + (2 * one if self.ring else 0)
        # Not to be asked (None): the reservation says whether there is room.
        return (per_rank * self.world.local_world_size,
                (float("inf") if free is None else free) + held)

    def bytes_held(self) -> int:
        """The bytes of this rank's mapped buffers (tools/bench_memory_snapshot.py)."""
        return sum(HEADER_BYTES + b.capacity + self.exchange_bytes for b in self.buffers
                   if b.tensor is not None)

    def close(self, wait: bool = True) -> None:
        """End the thread (waiting for it unless not ``wait``), unmap; the files stay."""
        self.background.stop(wait)
        self.plan = None  # its tensors and its views of the buffers
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for buffer in self.buffers:
            buffer.close()
        if self.ring is not None:
            self.ring.close()

    def remove(self) -> list[str]:
        """Unlink both buffers and the predecessor's copies; a warning for each left."""
        self.close()
        self.sequence = 0
        self.newest_index = None
        problems = unlink_own(self.paths) + (self.ring.remove() if self.ring else [])
        if self.folder != user_folder(self.shm):  # a private one: gone with the last rank's
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)
        return problems
