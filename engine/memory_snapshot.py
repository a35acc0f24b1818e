"""In-memory snapshots: the newest training state in shared memory every few optimizer
steps (``checkpoint.memory_every_steps``), so that a restarted worker loses at most that
many steps instead of everything since the last disk snapshot.

Each rank keeps two buffers, files in /dev/shm that outlive the worker process::

    /dev/shm/engine-memory-<run key>-r<rank>-a
    /dev/shm/engine-memory-<run key>-r<rank>-b

where ``<run key>`` is 16 hex digits of the sha256 of the run folder's real path. A
buffer is a header page, then the payload::

    header   magic, sequence number (0: invalid), step, epoch, payload length, xxh3-128
             of the payload, the step the run had reached (buffer a), a JSON line (run
             folder, host, rank, world size)
    payload  [skeleton length][skeleton: the snapshot dict pickled with every tensor
             replaced by (marker, offset, dtype, shape)][tensor bytes, 64-byte aligned]

The content is the disk snapshot's (:func:`engine.snapshot.capture`: model, optimizer,
scheduler, scaler, progress, loader position, every rank's RNG states...), so in the
replicated parallel modes every rank's buffer is a whole snapshot that any rank can
resume from: the per-rank parts (RNG states) are gathered into each one.

A save writes into the buffer that does not hold the newest snapshot: it zeroes that
buffer's sequence number first (a kill during the copy leaves it invalid, the other one
valid), copies, then writes the header, the sequence number last. A reader takes the
valid buffer (magic, sequence > 0, its payload's checksum) with the highest sequence, so
a torn or stale buffer is never used.

At a resume the ranks agree (:func:`agree`) on the newest snapshot every rank can
restore: a memory snapshot newer than the newest disk snapshot, from the rank's own
buffer or, where its own is gone (a replaced machine, a wiped /dev/shm), sent by a rank
that has it over the process group; else the disk snapshot.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import pickle
import socket
import struct
from typing import Any

import attrs

#: Where the buffers live: a tmpfs, so that they outlive the process but not the machine.
SHM = pathlib.Path("/dev/shm")
PREFIX = "engine-memory-"
HEADER_BYTES = 4096
ALIGN = 64
MAGIC = b"ENGMEM\x00\x01"
# magic, sequence, step, epoch, payload length, checksum (16 bytes), step reached
_HEADER = struct.Struct("<8sQQQQ16sQ")
_REACHED_AT = _HEADER.size - 8
_JSON_AT = _HEADER.size
#: Marks a tensor's place in the pickled skeleton: (MARKER, offset, dtype, shape).
MARKER = "\x00engine-memory-tensor"


def run_key(run_dir) -> str:
    """16 hex digits naming a run folder's buffers (the folder's real path, hashed)."""
    real = os.path.realpath(os.fspath(run_dir))
    return hashlib.sha256(real.encode()).hexdigest()[:16]


def buffer_paths(run_dir, rank: int, shm: pathlib.Path = SHM) -> tuple[pathlib.Path, ...]:
    stem = f"{PREFIX}{run_key(run_dir)}-r{rank}"
    return shm / f"{stem}-a", shm / f"{stem}-b"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ------------------------------------------------------------ the payload


_PLAIN = {int, float, bool, str, type(None)}


@functools.cache
def _numpy_dtypes() -> frozenset:
    import torch

    return frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                      torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                      torch.complex128})


def encode_plan(state: dict) -> tuple[bytes, list, int]:
    """The pickled skeleton of ``state`` (each tensor replaced by its marker), the
    tensors with their offsets in the data region, and the data region's size."""
    import torch

    tensors: list[tuple[int, Any]] = []
    size = 0

    def walk(value):
        nonlocal size
        if isinstance(value, torch.Tensor):
            tensor = value.detach() if value.requires_grad else value
            entry = (MARKER, size, str(tensor.dtype)[6:], tuple(tensor.shape))  # "torch."
            tensors.append((size, tensor))
            size = _align(size + tensor.numel() * tensor.element_size())
            return entry
        if isinstance(value, dict):
            # Plain values (most of a config) are kept without a call each.
            return {k: v if type(v) in _PLAIN else walk(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            if set(map(type, value)) <= _PLAIN:
                return value  # Python's RNG state: 625 ints, looked at in C
            return type(value)(walk(v) for v in value)
        return value

    skeleton = pickle.dumps(walk(state), protocol=pickle.HIGHEST_PROTOCOL)
    return skeleton, tensors, size


def payload_size(skeleton: bytes, data_size: int) -> int:
    return _align(8 + len(skeleton)) + data_size


def write_payload(buf, skeleton: bytes, tensors: list) -> int:
    """Write the payload into ``buf`` (a uint8 tensor at least :func:`payload_size`
    long, on the CPU); returns its length."""
    import numpy as np

    array = buf.numpy()
    start = _align(8 + len(skeleton))
    array[:8] = np.frombuffer(struct.pack("<Q", len(skeleton)), dtype=np.uint8)
    array[8:8 + len(skeleton)] = np.frombuffer(skeleton, dtype=np.uint8)
    end = start
    for offset, tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        if n:
            copy_bytes(buf, array, start + offset, n, tensor)
        end = start + offset + n
    return end


def copy_bytes(buf, array, at: int, n: int, tensor) -> None:
    """``tensor``'s ``n`` bytes into the buffer at ``at``. From the CPU by numpy's
    memcpy: torch's copy_ hands a few hundred kB to its thread pool, whose wake-up cost
    milliseconds per copy on a busy machine (measured: 1.8 ms against 22 us for 62,000
    floats); from a GPU, copy_ (a device-to-host copy)."""
    import torch

    if tensor.device.type != "cpu":
        buf[at:at + n].copy_(tensor.reshape(-1).view(torch.uint8))
    elif tensor.dtype in _numpy_dtypes():
        array[at:at + n] = tensor.numpy().reshape(-1).view("u1")
    else:  # bfloat16 and others numpy lacks: their bytes
        array[at:at + n] = tensor.reshape(-1).view(torch.uint8).numpy()


class _SkeletonUnpickler(pickle.Unpickler):
    """Plain values only: the containers and numbers a state dict holds, torch's dtypes
    and sizes; anything else in a buffer is refused, as torch.load(weights_only=True)
    refuses it in a file."""

    ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
               ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice")}

    def find_class(self, module, name):
        import torch

        if (module, name) in self.ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(__import__(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a memory snapshot")


def read_payload(buf) -> dict:
    """The snapshot dict in the payload ``buf`` (a uint8 tensor), its tensors copied out
    (the buffer is written again by later snapshots)."""
    import io

    import torch

    length = struct.unpack("<Q", bytes(buf[:8].tolist()))[0]
    skeleton = buf[8:8 + length].numpy().tobytes()
    start = _align(8 + length)

    def build(value):
        if isinstance(value, tuple) and len(value) == 4 and value[0] == MARKER:
            _, offset, dtype, shape = value
            dtype = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if not n:
                return torch.empty(shape, dtype=dtype)
            return buf[start + offset:start + offset + n].view(dtype).view(shape).clone()
        if isinstance(value, dict):
            return {k: build(v) for k, v in value.items()}
        if type(value) in (list, tuple) and not set(map(type, value)) <= _PLAIN:
            return type(value)(build(v) for v in value)
        return value

    return build(_SkeletonUnpickler(io.BytesIO(skeleton)).load())


def checksum(array) -> bytes:
    import xxhash

    return xxhash.xxh3_128(array).digest()


# ------------------------------------------------------------ one buffer


@attrs.define
class Slot:
    """What a buffer's header says, once checked."""

    path: pathlib.Path
    sequence: int
    step: int
    epoch: int
    length: int
    reached: int
    info: dict


class Buffer:
    """One shared-memory file: its header and payload, as a uint8 tensor mapped onto it
    (torch.from_file, MAP_SHARED), and the same bytes as a numpy array."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.tensor = None
        self.array = None
        self.capacity = 0
        self.pinned = False

    def map(self, payload_bytes: int, info: dict) -> None:
        """Map the file with room for ``payload_bytes`` (grown when short; the pages
        reserved with posix_fallocate, so that a full /dev/shm is an error here and not
        a SIGBUS during a copy). The header gets the magic and ``info`` at once, so that
        :func:`remove_leftovers` knows whose the file is before its first snapshot."""
        import torch

        size = HEADER_BYTES + payload_bytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        self.tensor = torch.from_file(str(self.path), shared=True, size=size,
                                      dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.capacity = payload_bytes
        text = json.dumps(info).encode()[:HEADER_BYTES - _JSON_AT - 4]
        self.array[_JSON_AT:_JSON_AT + 4 + len(text)] = bytearray(
            struct.pack("<I", len(text)) + text)
        self.array[:8] = bytearray(MAGIC)

    def write_header(self, sequence: int, step: int, epoch: int, length: int,
                     digest: bytes) -> None:
        array = self.array
        reached = struct.unpack_from("<Q", array[:_HEADER.size].tobytes(), _REACHED_AT)[0]
        fields = _HEADER.pack(MAGIC, 0, step, epoch, length, digest, reached)
        array[16:_HEADER.size] = bytearray(fields[16:])  # everything but the sequence...
        array[8:16] = bytearray(struct.pack("<Q", sequence))  # ...which commits it

    def invalidate(self) -> None:
        self.array[8:16] = 0

    def note_reached(self, step: int) -> None:
        self.array[_REACHED_AT:_REACHED_AT + 8] = bytearray(struct.pack("<Q", step))

    def payload(self, length: int):
        return self.tensor[HEADER_BYTES:HEADER_BYTES + length]

    def pin(self) -> None:
        """Page-lock the mapping (cudaHostRegister), so that copies from a GPU go by DMA
        straight into it rather than through a staging buffer (an H100, 210 MB of state:
        45 -> 31 ms a snapshot, checksum included)."""
        import torch

        if not self.pinned:
            error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(),
                                                         self.tensor.numel(), 0)
            self.pinned = int(error) == 0  # else the copies still work, unpinned

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = self.array = None


def read_slot(path: pathlib.Path, verify: bool = True) -> Slot | None:
    """The buffer at ``path`` if it holds a whole snapshot (its checksum checked when
    ``verify``), else None: missing, torn by a kill during its copy, or foreign."""
    import torch

    try:
        size = path.stat().st_size
        if size < HEADER_BYTES:
            return None
        tensor = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    array = tensor.numpy()
    magic, sequence, step, epoch, length, digest, reached = _HEADER.unpack(
        array[:_HEADER.size].tobytes())
    if magic != MAGIC or not sequence or HEADER_BYTES + length > size:
        return None
    if verify and checksum(array[HEADER_BYTES:HEADER_BYTES + length]) != digest:
        return None
    return Slot(path, sequence, step, epoch, length, reached, _info(array))


def _info(array) -> dict:
    (length,) = struct.unpack("<I", array[_JSON_AT:_JSON_AT + 4].tobytes())
    try:
        return json.loads(array[_JSON_AT + 4:_JSON_AT + 4 + length].tobytes())
    except ValueError:
        return {}


def read_info(path: pathlib.Path) -> dict:
    """The JSON line of the buffer at ``path`` (run folder, host, rank, world size), with
    or without a snapshot in it; {} when it is none of ours."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
    except OSError:
        return {}
    if len(header) < HEADER_BYTES or header[:8] != MAGIC:
        return {}
    import numpy as np

    return _info(np.frombuffer(header, dtype=np.uint8))


def reached_step(path: pathlib.Path) -> int:
    """The step the run had reached when it last wrote to the buffer at ``path`` (0:
    unknown)."""
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER.size)
    except OSError:
        return 0
    if len(header) < _HEADER.size or header[:8] != MAGIC:
        return 0
    return struct.unpack_from("<Q", header, _REACHED_AT)[0]


def newest(paths) -> Slot | None:
    """The valid buffer with the highest sequence among ``paths``, or None."""
    slots = [s for s in (read_slot(p) for p in paths) if s is not None]
    return max(slots, key=lambda s: s.sequence, default=None)


def payload_of(slot: Slot):
    """The payload of a checked buffer, as a uint8 tensor mapped onto the file."""
    import torch

    tensor = torch.from_file(str(slot.path), shared=True, size=HEADER_BYTES + slot.length,
                             dtype=torch.uint8)
    return tensor[HEADER_BYTES:]


def load_slot(slot: Slot) -> dict:
    return read_payload(payload_of(slot))


# ------------------------------------------------------------ a rank's pair


class MemorySnapshots:
    """This rank's two buffers: :meth:`save` every ``every_steps`` optimizer steps,
    :meth:`newest` at a resume, :meth:`remove` when the run ends by itself."""

    def __init__(self, run_dir, world, every_steps: int, shm: pathlib.Path = SHM):
        self.run_dir = pathlib.Path(run_dir)
        self.world = world
        self.every_steps = every_steps
        self.shm = shm
        self.paths = buffer_paths(run_dir, world.rank, shm)
        self.buffers = [Buffer(p) for p in self.paths]
        self.sequence = 0  # the newest valid buffer's; the next save writes above it
        self.newest_index: int | None = None
        self.saves = 0
        self.reached_before = 0  # how far the interrupted run had got (agree() says)
        self.config: dict | None = None  # the run's config as a dict (snapshot.py)
        self.info = {"run_dir": str(os.path.realpath(self.run_dir)),
                     "host": socket.gethostname(), "rank": world.rank,
                     "world_size": world.world_size}

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def newest(self) -> Slot | None:
        slot = newest(self.paths)
        if slot is not None:
            self.sequence = slot.sequence
            self.newest_index = self.paths.index(slot.path)
        return slot

    def reached(self) -> int:
        return reached_step(self.paths[0])

    def note_reached(self, step: int) -> None:
        """The step the run reached (buffer a's header): a restart says how many steps
        it recomputes."""
        if self.buffers[0].tensor is not None:
            self.buffers[0].note_reached(step)

    def save(self, state: dict, *, step: int, epoch: int) -> None:
        """Copy ``state`` into the buffer that does not hold the newest snapshot."""
        skeleton, tensors, data_size = encode_plan(state)
        needed = payload_size(skeleton, data_size)
        index = 1 if self.newest_index == 0 else 0
        buffer = self.buffers[index]
        if buffer.tensor is None or buffer.capacity < needed:
            # Room for the skeleton to grow (metrics, an epoch's loss sums) without
            # remapping at the next save.
            buffer.close()
            buffer.map(needed + max(64 * 1024, needed // 64), self.info)
        if self.buffers[0].tensor is None:  # its header keeps the step reached
            self.buffers[0].map(buffer.capacity, self.info)
        if any(tensor.is_cuda for _, tensor in tensors):
            buffer.pin()
        buffer.invalidate()
        length = write_payload(buffer.payload(buffer.capacity), skeleton, tensors)
        digest = checksum(buffer.array[HEADER_BYTES:HEADER_BYTES + length])
        self.sequence += 1
        buffer.write_header(self.sequence, step, epoch, length, digest)
        self.newest_index = index
        self.saves += 1

    def room_for(self, state: dict) -> tuple[int, int]:
        """The bytes the buffers of ``state`` take on this machine (two per local rank:
        every local rank asks at once, before any allocates), and the bytes free in
        /dev/shm plus what this run's buffers already take there."""
        skeleton, _, data_size = encode_plan(state)
        stat = os.statvfs(self.shm)
        held = sum(p.stat().st_size for p in self.shm.glob(f"{PREFIX}{run_key(self.run_dir)}-*"))
        per_rank = 2 * (HEADER_BYTES + payload_size(skeleton, data_size))
        return per_rank * self.world.local_world_size, stat.f_bavail * stat.f_frsize + held

    def bytes_held(self) -> int:
        """The bytes of this rank's mapped buffers (tools/bench_memory_snapshot.py)."""
        return sum(HEADER_BYTES + b.capacity for b in self.buffers if b.tensor is not None)

    def close(self) -> None:
        for buffer in self.buffers:
            buffer.close()

    def remove(self) -> None:
        """Unmap and unlink both buffers (the run ended, or they are stale)."""
        self.close()
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.sequence = 0
        self.newest_index = None


def remove_leftovers(shm: pathlib.Path = SHM) -> list[pathlib.Path]:
    """Remove the buffers of runs whose folder no longer exists (a deleted experiment's
    leftovers); returns what was removed. Buffers of existing folders stay: a rerun in
    that folder resumes from them, and its end removes them."""
    removed = []
    for path in sorted(shm.glob(f"{PREFIX}*")):
        folder = read_info(path).get("run_dir")
        if folder and not os.path.isdir(folder):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


# ------------------------------------------------------------ agreeing at a resume


@attrs.define
class MemoryChoice:
    """What the ranks' memory snapshots hold: the newest step (-1: none), the ranks
    that hold it, and the step the interrupted run had reached (0: unknown)."""

    step: int
    holders: list[int]
    reached: int

    @property
    def source(self) -> int:
        return self.holders[0]

    def newer_than(self, disk_step: int | None) -> bool:
        return self.step >= 0 and (disk_step is None or self.step > disk_step)

    def missing(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.holders]


def agree(memory: MemorySnapshots) -> MemoryChoice:
    """Collective: every rank says which memory snapshot it holds (its step, or -1) and
    how far the run had got; every rank returns the same answer."""
    from engine import distributed

    slot = memory.newest()
    mine = (slot.step if slot is not None else -1, memory.reached())
    every = distributed.all_gather_object(mine)
    best = max(step for step, _ in every)
    return MemoryChoice(best, [r for r, (step, _) in enumerate(every) if step == best],
                        max(r for _, r in every))


def fetch(memory: MemorySnapshots, choice: MemoryChoice) -> dict:
    """The chosen snapshot on every rank: from its own buffer, or, for the ranks that
    lack it, sent by the first rank that has it (one broadcast of its payload; the
    ranks that hold it take part and keep their own). Collective when a rank lacks it."""
    import torch

    from engine import distributed

    rank, world_size = memory.world.rank, memory.world.world_size
    mine = memory.newest() if rank in choice.holders else None
    if not choice.missing(world_size):
        return load_slot(mine)
    length = distributed.broadcast_object(mine.length if rank == choice.source else None,
                                          src=choice.source)
    device = distributed.collective_device()
    if rank == choice.source:
        payload = payload_of(mine).to(device, copy=True)
    else:
        payload = torch.empty(length, dtype=torch.uint8, device=device)
    distributed.broadcast_tensor(payload, src=choice.source)
    if mine is not None:
        return load_slot(mine)
    return read_payload(payload.cpu())
