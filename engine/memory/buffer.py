"""A memory snapshot's buffer: its format, its checksum, and reading one back.

A buffer is a header page, the payload, then the exchange region::

    header   magic, sequence number (0: invalid), step, epoch, payload length, xxh3-128
             of the header's fields and the payload, the step the run had reached
             (buffer a; outside the checksum), the run id, where the exchange region
             starts, a JSON line (run folder, host, mount namespace, pid, rank, world size)
    payload  [skeleton length, where the data region starts][skeleton: the snapshot
             dict pickled with every tensor replaced by engine.shm_codec's marker]
             [room for the skeleton to grow][data region: tensor bytes, 64-byte aligned]
    exchange [the payload's sequence number, rows, row size, xxh3-128][this rank's row
             and those it keeps: engine/memory/rows.py's, at the payload's step]

A save zeroes the sequence of the buffer without the newest snapshot, copies, writes the
header, the sequence last; a reader takes the valid buffer with the highest sequence.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import pathlib
import struct
from typing import Any

import attrs
import numpy as np
import torch
import xxhash

from engine.memory.files import RUN_ID_FILE, NoRoom, Unsafe, open_own
from engine.shm_codec import align, decode

HEADER_BYTES = 4096
# 7: a row's loss sum raw, before its pickle (6: each row names its rank, its keepers').
MAGIC = b"ENGMEM\x00\x07"
# magic, sequence, step, epoch, payload length, checksum (16 bytes), step reached, run id,
# where the exchange region starts (0: none)
HEADER = struct.Struct("<8sQQQQ16sQ16sQ")
REACHED_AT = 56
_EXCHANGE_AT = 80
_JSON_AT = HEADER.size
#: The exchange region's own header: the sequence of the snapshot its rows belong to,
#: the number of rows, the bytes of each, xxh3-128 of those and the rows.
_EXCHANGE = struct.Struct("<QQQ16s")
EXCHANGE_HEAD = 64
#: What the checksum covers besides the payload: every field but itself and "reached".
_SIGNED = struct.Struct("<8sQQQQ16s")

#: The payload's own header: the skeleton's length, where the data region starts.
PAYLOAD = struct.Struct("<QQ")


def data_start(skeleton_bytes: int) -> int:
    """Where the data region starts after a skeleton of ``skeleton_bytes``, with room
    for it to grow while the tensors (and the copies' views) stay where they are."""
    return align(PAYLOAD.size + skeleton_bytes + max(1024, skeleton_bytes // 8))


def payload_size(skeleton: bytes, data_size: int) -> int:
    return data_start(len(skeleton)) + data_size


def read_payload(buf) -> dict:
    """The snapshot dict in the payload ``buf`` (a uint8 tensor), its tensors copied out
    (the buffer is written again by later snapshots)."""
    length, start = PAYLOAD.unpack(bytes(buf[:PAYLOAD.size].tolist()))
    if not PAYLOAD.size + length <= start <= len(buf):
        raise ValueError("its skeleton and data region overlap or lie outside the payload")
    skeleton = buf[PAYLOAD.size:PAYLOAD.size + length].numpy().tobytes()

    def tensor_at(offset: int, dtype, shape):
        n = shape.numel() * dtype.itemsize
        if not n:
            return torch.empty(shape, dtype=dtype)
        if not 0 <= offset <= len(buf) - start - n:
            raise ValueError("a tensor lies outside the payload")
        return buf[start + offset:start + offset + n].view(dtype).view(shape).clone()

    return decode(skeleton, tensor_at)


def checksum(fields: bytes, payload) -> bytes:
    """xxh3-128 of the header's fields (:data:`_SIGNED`) and the payload: a header
    whose step, length or run id was changed fails it as a flipped payload bit does."""
    digest = xxhash.xxh3_128(fields)
    digest.update(payload)
    return digest.digest()


def signed(sequence: int, step: int, epoch: int, length: int, run_id: bytes) -> bytes:
    return _SIGNED.pack(MAGIC, sequence, step, epoch, length, run_id)


# ------------------------------------------------------------ one buffer


def intact(payload, sequence: int, step: int, epoch: int, length: int, run_id: bytes,
           digest: bytes) -> bool:
    """Whether ``digest`` is that of ``payload`` (its first ``length`` bytes) and those
    header fields: a buffer's own, or a copy the ring sent."""
    return checksum(signed(sequence, step, epoch, length, run_id), payload[:length]) == digest


def _map(fd: int, size: int, writable: bool):
    """A memory map of ``size`` bytes of ``fd`` and a uint8 tensor over it (read-only
    ones privately: torch wants a writable buffer; never written)."""
    if writable:
        mapping = mmap.mmap(fd, size)
    else:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def _unmap(mapping) -> None:
    try:
        mapping.close()
    except BufferError:  # a tensor still points into it: the map goes with the tensor
        pass


@attrs.define
class Slot:
    """What a buffer's header says, once checked, and the buffer mapped (read-only):
    what is loaded is what was checked, not a file opened again by its name."""

    path: pathlib.Path
    sequence: int
    step: int
    epoch: int
    length: int
    reached: int
    run_id: str
    info: dict
    tensor: Any = attrs.field(default=None, repr=False)  # header and payload, uint8
    mapping: Any = attrs.field(default=None, repr=False)
    #: This snapshot's exchange rows (its own and those it keeps, uint8), when they came
    #: whole; None while they were on their way, or never came.
    rows: Any = attrs.field(default=None, repr=False)

    def payload(self):
        return self.tensor[HEADER_BYTES:HEADER_BYTES + self.length]

    def close(self) -> None:
        self.tensor = None
        if self.mapping is not None:
            _unmap(self.mapping)
            self.mapping = None


class Buffer:
    """One shared-memory file of this rank's, mapped as a uint8 tensor and a numpy array;
    its descriptor holds a shared flock for the run's life (:func:`writer_gone`)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.fd: int | None = None
        self.mapping = None
        self.tensor = None
        self.array = None
        self.capacity = 0
        self.exchange_at = 0  # where the exchange region starts (0: none)
        self.pinned = False

    def map(self, payload_bytes: int, info: dict, run_id: bytes,
            exchange_bytes: int = 0) -> None:
        """Map the file with room for ``payload_bytes`` and ``exchange_bytes``, its pages
        reserved (a full tmpfs is NoRoom here, not a SIGBUS during a copy), the magic, run
        id and ``info`` written at once (whose it is); Unsafe if not this user's file."""
        size = HEADER_BYTES + payload_bytes + exchange_bytes
        self.unmap()
        if self.fd is None:
            self.fd = open_own(self.path, writable=True)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                pass  # a clean-up is looking at it this instant: it is ours all the same
        if os.fstat(self.fd).st_size < size:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                raise NoRoom(f"{self.path}: {exc.strerror or exc}") from None
        self.mapping, self.tensor = _map(self.fd, size, writable=True)
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self.capacity = payload_bytes
        text = json.dumps(info).encode()[:HEADER_BYTES - _JSON_AT - 4]
        self.array[_JSON_AT:_JSON_AT + 4 + len(text)] = bytearray(
            struct.pack("<I", len(text)) + text)
        self.array[REACHED_AT + 8:_EXCHANGE_AT] = bytearray(run_id)
        self.exchange_at = HEADER_BYTES + payload_bytes if exchange_bytes else 0
        if exchange_bytes:  # no rows yet: a sequence no snapshot has
            self.array[self.exchange_at:self.exchange_at + 8] = 0
        self.array[_EXCHANGE_AT:_JSON_AT] = bytearray(struct.pack("<Q", self.exchange_at))
        self.array[:8] = bytearray(MAGIC)

    def write_header(self, sequence: int, step: int, epoch: int, length: int,
                     run_id: bytes, digest: bytes) -> None:
        array = self.array
        fields = HEADER.pack(MAGIC, 0, step, epoch, length, digest, 0, run_id,
                              self.exchange_at)
        # Everything but the sequence and "reached" (the step's thread writes it while a
        # background copy finishes)...
        array[16:REACHED_AT] = bytearray(fields[16:REACHED_AT])
        array[REACHED_AT + 8:HEADER.size] = bytearray(fields[REACHED_AT + 8:])
        array[8:16] = bytearray(struct.pack("<Q", sequence))  # ...which commits it

    def invalidate(self) -> None:
        self.array[8:16] = 0

    def write_exchange(self, sequence: int, rows) -> bool:
        """The rows of the snapshot ``sequence`` (a uint8 array, rows x ROW_BYTES) into
        the exchange region, its sequence last; False (nothing written)
        when the buffer holds another snapshot by now, or has no room for the rows."""
        at, array = self.exchange_at, self.array
        if (array is None or not at or int(array[8:16].view("<u8")[0]) != sequence
                or at + EXCHANGE_HEAD + rows.size > len(array)):
            return False

        world, row_bytes = rows.shape
        fields = _EXCHANGE.pack(0, world, row_bytes, b"")[8:24]
        digest = xxhash.xxh3_128(struct.pack("<Q", sequence) + fields)
        digest.update(rows)
        array[at:at + 8] = 0
        array[at + EXCHANGE_HEAD:at + EXCHANGE_HEAD + rows.size] = rows.reshape(-1)
        array[at + 8:at + _EXCHANGE.size] = bytearray(fields + digest.digest())
        array[at:at + 8] = bytearray(struct.pack("<Q", sequence))
        return True

    def note_reached(self, step: int) -> None:
        self.array[REACHED_AT:REACHED_AT + 8] = bytearray(struct.pack("<Q", step))

    def payload(self, length: int):
        return self.tensor[HEADER_BYTES:HEADER_BYTES + length]

    def pin(self) -> None:
        """Page-lock the mapping (cudaHostRegister): copies from a GPU go by DMA straight
        into it rather than through a staging buffer."""
        if not self.pinned:
            error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(),
                                                         self.tensor.numel(), 0)
            self.pinned = int(error) == 0  # else the copies still work, unpinned

    def unmap(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = self.array = None
        if self.mapping is not None:
            _unmap(self.mapping)
            self.mapping = None

    def close(self) -> None:
        self.unmap()
        if self.fd is not None:
            os.close(self.fd)  # and with it the flock
            self.fd = None


def check_slot(path: pathlib.Path, verify: bool = True,
               run_id: str | None = None) -> tuple[Slot | None, str | None]:
    """The buffer at ``path`` if it holds a whole snapshot of the run ``run_id`` (None:
    any; checksum checked if ``verify``), and why not (None: missing, empty or torn)."""
    try:
        fd = open_own(path, writable=False)
    except (OSError, Unsafe):
        # Missing, or not this user's: never read, and the first save, which must
        # reserve the name, turns the tier off saying why (engine/snapshot.py).
        return None, None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            return None, None  # made, never mapped: a kill right after its creation
        mapping, tensor = _map(fd, size, writable=False)
    except (OSError, ValueError) as exc:
        return None, f"cannot map it: {exc}"
    finally:
        os.close(fd)  # the map holds the file
    array = tensor.numpy()
    magic, sequence, step, epoch, length, digest, reached, raw_id, exchange_at = \
        HEADER.unpack(array[:HEADER.size].tobytes())
    problem = None
    if magic != MAGIC:
        problem = "not a memory snapshot of this engine version"
    elif not sequence:
        pass  # nothing in it yet, or torn: the other buffer has the snapshot
    elif run_id is not None and raw_id != bytes.fromhex(run_id):
        problem = (f"it carries run id {raw_id.hex()}, not this run's ({run_id}, in the "
                   f"run folder's {RUN_ID_FILE})")
    elif HEADER_BYTES + length > size or (verify and not intact(
            array[HEADER_BYTES:], sequence, step, epoch, length, raw_id, digest)):
        problem = "its checksum does not match: damaged or altered"
    if problem is not None or not sequence:
        del array, tensor
        _unmap(mapping)
        return None, problem and f"{path}: {problem}"
    return Slot(path, sequence, step, epoch, length, reached, raw_id.hex(), _info(array),
                tensor=tensor, mapping=mapping,
                rows=_exchange_rows(array, exchange_at, sequence)), None


def _exchange_rows(array, at: int, sequence: int):
    """The exchange region's rows at ``at`` when they are whole and belong to the
    snapshot ``sequence`` (their checksum holds), else None."""
    if not at or at + EXCHANGE_HEAD > len(array):
        return None
    seq, world, row_bytes, digest = _EXCHANGE.unpack(array[at:at + _EXCHANGE.size].tobytes())
    end = at + EXCHANGE_HEAD + world * row_bytes
    if seq != sequence or not world or row_bytes < 8 or end > len(array):
        return None
    rows = array[at + EXCHANGE_HEAD:end]
    check = xxhash.xxh3_128(array[at:at + 24].tobytes())
    check.update(rows)
    return rows.reshape(world, row_bytes) if check.digest() == digest else None


def _info(array) -> dict:
    (length,) = struct.unpack("<I", array[_JSON_AT:_JSON_AT + 4].tobytes())
    try:
        info = json.loads(array[_JSON_AT + 4:_JSON_AT + 4 + length].tobytes())
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def read_header(path: pathlib.Path) -> bytes:
    """The header page of this user's buffer at ``path`` (b"" when none)."""
    try:
        fd = open_own(path, writable=False)
    except (OSError, Unsafe):
        return b""
    try:
        header = os.pread(fd, HEADER_BYTES, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)
    return header if len(header) == HEADER_BYTES and header[:8] == MAGIC else b""


def read_info(path: pathlib.Path) -> dict:
    """The JSON line of the buffer at ``path`` (run folder, host, pid, rank, world
    size), with or without a snapshot in it; {} when it is none of ours."""
    header = read_header(path)
    return _info(np.frombuffer(header, dtype=np.uint8)) if header else {}


def newest(paths, run_id: str | None = None) -> Slot | None:
    """The valid buffer with the highest sequence among ``paths``, or None."""
    slots = [s for s in (check_slot(p, run_id=run_id)[0] for p in paths) if s is not None]
    best = max(slots, key=lambda s: s.sequence, default=None)
    for slot in slots:
        if slot is not best:
            slot.close()
    return best


def load_slot(slot: Slot) -> dict:
    return read_payload(slot.payload())
