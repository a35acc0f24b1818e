"""The ring of the memory tier under fsdp: each rank keeps a copy of its predecessor's
memory snapshot (its own shards, which no other rank has), so that the loss of one
node's memory still resumes from memory (docs/checkpoints.md, "The ring under fsdp").

Rank r sends its committed snapshot (a header, then the payload) to rank (r + 1) % W,
which keeps it in two buffers of the own buffers' format (``<run id>-r<holder>-held-a``,
``-b``): a job of the background thread, on a gloo group of its own, every wait bounded
(a dead peer or a damaged copy turns the tier off). At a resume a rank without its own
snapshot gets its successor's copy (:func:`fetch`).
"""

from __future__ import annotations

import datetime
import pathlib
import struct

import torch
import torch.distributed as dist

from engine import health, shards
from engine.memory import buffer as ms
from engine.memory.files import buffer_paths
from engine.memory.resume import complete, load_checked
from engine.shm import SHM, unlink_own

#: A transfer's fixed header: sequence (0: none), step, epoch, payload length, the
#: sender's checksum, and the highest sequence among the sender's held copies (a
#: restore: the receiver's next snapshot numbers above it). Padded to HEAD_BYTES.
_HEAD = struct.Struct("<QQQQ16sQ")
HEAD_BYTES = 64
#: Tags of the transfer's messages on the ring's group: the header, the payload, and
#: the receiver's acknowledgement (the sequence it committed, 0: none).
_TAG_HEAD, _TAG_PAYLOAD, _TAG_ACK = 1, 2, 3


def held_paths(run_dir, rank: int, shm: pathlib.Path = SHM,
               run_id: str | None = None) -> tuple[pathlib.Path, ...]:
    """The two buffers in which rank ``rank`` holds its predecessor's copies."""
    return tuple(p.with_name(p.name[:-1] + "held-" + p.name[-1])
                 for p in buffer_paths(run_dir, rank, shm, run_id))


class Ring:
    """This rank's side: what it sends its successor, and the two buffers with its
    predecessor's copies. Created on every rank at once (a collective)."""

    def __init__(self, memory, timeout_s: float):
        self.memory = memory
        rank, world_size = memory.world.rank, memory.world.world_size
        self.next, self.prev = (rank + 1) % world_size, (rank - 1) % world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.group = health.gloo_group("memory ring", timeout_s)
        self.paths = held_paths(memory.run_dir, rank, memory.shm, memory.run_id)
        self.buffers = [ms.Buffer(p) for p in self.paths]
        self.info = {**memory.info, "holds_rank": self.prev}
        # The messages' tensors, made once (the job runs at every snapshot).
        self.head_out, self.head_in, self.ack_out, self.ack_in = (
            torch.zeros(n, dtype=torch.uint8) for n in (HEAD_BYTES, HEAD_BYTES, 8, 8))

    # ------------------------------------------------------ at each snapshot

    def copy(self, buffer, sequence: int) -> None:
        """After a snapshot (every rank: a successor waits for the header): the thread
        sends ``buffer``'s snapshot ``sequence`` (None: none), keeps the predecessor's."""
        self.memory.background.submit(lambda: self._exchange(buffer, sequence))

    def _exchange(self, buffer, sequence: int) -> None:
        sends = self._send(None if buffer is None else buffer.tensor, sequence, self.next)
        try:
            committed, damaged = self._receive_into_held()
            # A damaged copy is acknowledged too (as none): the predecessor goes on.
            self.ack_out[:] = self._bytes(struct.pack("<Q", committed))
            sends.append(dist.isend(self.ack_out, self.prev, group=self.group,
                                          tag=_TAG_ACK))
            self._wait(dist.irecv(self.ack_in, self.next, group=self.group,
                                        tag=_TAG_ACK), "the successor's acknowledgement")
        except RuntimeError:
            _settle(sends)
            raise
        for work in sends:
            self._wait(work, "the copy to the successor")
        if damaged:
            raise RuntimeError(damaged)

    def _send(self, buffer, sequence: int, dst: int, newest: int = 0) -> list:
        """The sends, not waited for, of the snapshot ``sequence`` in ``buffer`` (a uint8
        tensor, a buffer's or a slot's) to ``dst``; a header of sequence 0 if none."""
        fields = None if buffer is None else ms.HEADER.unpack(
            buffer[:ms.HEADER.size].numpy().tobytes())
        if fields is None or fields[1] != sequence or not sequence:
            head, payload = _HEAD.pack(0, 0, 0, 0, bytes(16), newest), None
        else:
            _, seq, step, epoch, length, digest, *_ = fields
            head = _HEAD.pack(seq, step, epoch, length, digest, newest)
            payload = buffer[ms.HEADER_BYTES:ms.HEADER_BYTES + length]
        self.head_out.zero_()
        self.head_out[:len(head)] = self._bytes(head)
        sends = [dist.isend(self.head_out, dst, group=self.group, tag=_TAG_HEAD)]
        if payload is not None and len(payload):
            sends.append(dist.isend(payload, dst, group=self.group, tag=_TAG_PAYLOAD))
        return sends

    def _receive_head(self, src: int) -> tuple:
        self._wait(dist.irecv(self.head_in, src, group=self.group, tag=_TAG_HEAD),
                   f"rank {src}'s header")
        return _HEAD.unpack(self.head_in.numpy()[:_HEAD.size].tobytes())

    def _receive_into_held(self) -> tuple[int, str | None]:
        """The predecessor's snapshot into the older held buffer, checked, then committed:
        the sequence committed (0: none), and what was wrong with a damaged one."""
        sequence, step, epoch, length, digest, _ = self._receive_head(self.prev)
        if not sequence:
            return 0, None
        target = self._older(length)
        target.invalidate()  # a kill from here on leaves it invalid, the other whole
        self._wait(dist.irecv(target.payload(length), self.prev, group=self.group,
                                    tag=_TAG_PAYLOAD), f"rank {self.prev}'s snapshot")
        raw_id = self.memory.raw_id
        if not ms.intact(target.array[ms.HEADER_BYTES:], sequence, step, epoch, length,
                         raw_id, digest):
            return 0, (f"the copy of rank {self.prev}'s memory snapshot of step {step} "
                       "arrived damaged (its checksum does not match)")
        target.write_header(sequence, step, epoch, length, raw_id, digest)
        return sequence, None

    def _older(self, length: int):
        """The held buffer to write next (the older), mapped with room for ``length``."""
        self.reserve(length)
        sequences = [int(b.array[8:16].view("<u8")[0]) for b in self.buffers]
        return self.buffers[0 if sequences[0] <= sequences[1] else 1]

    def reserve(self, length: int) -> None:
        """Both held buffers mapped with room for a payload of ``length`` (grown when a
        copy is larger). NoRoom or Unsafe as for the own buffers."""
        for buffer in self.buffers:
            if buffer.tensor is None or buffer.capacity < length:
                buffer.map(length + max(64 * 1024, length // 64), self.info,
                           self.memory.raw_id)

    def _wait(self, work, what: str) -> None:
        # The group's timeout bounds it too; an explicit one says what was waited for.
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"the memory ring waited for {what}: {exc}") from None

    @staticmethod
    def _bytes(data: bytes):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    # ------------------------------------------------------ the buffers' life

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()

    def remove(self) -> list[str]:
        self.close()
        return unlink_own(self.paths)


# ------------------------------------------------------------ at a resume


def load_held(memory, warn) -> list:
    """This rank's whole copies of its predecessor's snapshots (resume.Loaded, newest
    first): this run's, their checksum right, fsdp shards of this number of processes."""
    ring = memory.ring
    if ring is None:
        return []
    loaded = []
    for path in ring.paths:
        slot, problem = ms.check_slot(path, run_id=memory.run_id)
        if problem is not None:
            warn(f"the copy of rank {ring.prev}'s memory snapshot {problem}; not used")
        if slot is None:
            continue
        one, problem = load_checked(slot, also=lambda state: (
            None if shards.holds_shards(state.get("model"))
            and state.get("world_size") == memory.world.world_size else
            "not fsdp shards of this number of processes"))
        if one is not None:
            loaded.append(one)
        else:
            warn(f"the copy of rank {ring.prev}'s memory snapshot {slot.path} does not "
                 f"load ({problem}); not used")
    return sorted(loaded, key=lambda m: -m.slot.sequence)


def fetch(memory, choice, mine: list, held: list) -> dict:
    """Each rank's chosen snapshot where some rank lacks its own (``choice.peers``): its
    own, or its successor's copy sent over the ring's group, checked; resume.complete."""
    ring, rank = memory.ring, memory.world.rank
    sends = []
    for receiver, sender in choice.peers.items():
        if sender == rank:
            copy = next(m for m in held if m.step == choice.step)
            newest = max(m.slot.sequence for m in held)
            sends += ring._send(copy.slot.tensor, copy.slot.sequence, receiver,
                                newest=newest)
    try:
        state = _own_or_received(memory, choice, mine)
    except RuntimeError:
        _settle(sends)
        raise
    for work in sends:
        ring._wait(work, "the copy to its rank")
    return complete(state, rank, memory.world.world_size, None)


def _own_or_received(memory, choice, mine: list) -> dict:
    """This rank's snapshot of the chosen step: its own, or its successor's copy."""
    ring, rank = memory.ring, memory.world.rank
    own = next((m for m in mine if m.step == choice.step), None)
    if own is not None:
        memory.newest_index = memory.paths.index(own.slot.path)
        state = own.state
    else:
        sender = choice.peers[rank]
        sequence, step, epoch, length, digest, newest = ring._receive_head(sender)
        if sequence == 0 or step != choice.step:
            raise RuntimeError(f"rank {sender} sent no copy of step {choice.step} of this "
                               f"rank's memory snapshot")
        payload = torch.empty(length, dtype=torch.uint8)
        ring._wait(dist.irecv(payload, sender, group=ring.group, tag=_TAG_PAYLOAD),
                   f"rank {sender}'s copy of this rank's snapshot")
        if not ms.intact(payload.numpy(), sequence, step, epoch, length, memory.raw_id,
                         digest):
            raise RuntimeError(f"rank {sender}'s copy of this rank's memory snapshot of "
                               f"step {step} arrived damaged (its checksum does not match)")
        state = ms.read_payload(payload)
        # The next snapshot numbers above every copy the successor holds, so that its
        # held buffers keep overwriting the older one.
        memory.sequence = max(memory.sequence, newest)
    return state


def _settle(sends: list) -> None:
    """Wait for ``sends`` where something else failed (their errors left out): gloo
    drops a send freed before it went out, and its receiver would wait for it."""
    for work in sends:
        try:
            work.wait()
        except RuntimeError:
            pass
