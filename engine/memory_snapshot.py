"""In-memory snapshots: the newest training state in shared memory every few optimizer
steps (``checkpoint.memory_every_steps``), so that a restarted worker loses at most that
many steps instead of everything since the last disk snapshot (docs/checkpoints.md,
"In memory, from a peer, from disk", says what it trusts, when buffers go, what it costs).

Each rank keeps two buffers, files on a tmpfs that outlive the worker process::

    /dev/shm/engine-memory-<uid>/                  mode 0700, owned by the user
        <run id>-r<rank>-a                         mode 0600
        <run id>-r<rank>-b

/dev/shm is shared by every user and often by every container on a host, so nothing
there is trusted for its name (CWE-377, CWE-59): the folder must be a real folder (not a
link) owned by this user and closed to others (where another user took its name: a
private folder of random name, :func:`own_folder`), a buffer a regular file owned by
this user, opened without following a link and created exclusively; anything else
turns the tier off with one warning. ``<run id>`` (32 random hex digits in the run
folder's ``.engine-memory-id``, new whenever the run starts afresh) is in every buffer:
another run's, or a deleted or overwritten folder's, never match.

A buffer is a header page, the payload, then the exchange region::

    header   magic, sequence number (0: invalid), step, epoch, payload length, xxh3-128
             of the header's fields and the payload, the step the run had reached
             (buffer a; outside the checksum), the run id, where the exchange region
             starts, a JSON line (run folder, host, mount namespace, pid, rank, world size)
    payload  [skeleton length, where the data region starts][skeleton: the snapshot
             dict pickled with every tensor replaced by engine.shm_codec's marker]
             [room for the skeleton to grow][data region: tensor bytes, 64-byte aligned]
    exchange [the payload's sequence number, rows, row size, xxh3-128][one row per
             rank: its RNG states and loss sums at the payload's step]

The content is the disk snapshot's (:func:`engine.snapshot.capture_here`) but for what
that gathers from every rank: each rank keeps its own RNG states and loss sums (its row,
:func:`make_row`), sent to every rank by an all_gather nobody waits for and written into
the exchange region by a background thread (:class:`Exchanges`), so that in the
replicated modes any rank's buffer restores any rank (:func:`complete`).

A save zeroes the sequence of the buffer that does not hold the newest snapshot, copies,
then writes the header, the sequence last; a reader takes the valid buffer (magic,
sequence > 0, this run's id, the checksum) with the highest sequence. The state is
pickled once with a marker at each tensor (:func:`encode`), and the copies planned at
the previous save (:class:`Plan`) are done again while the tensors are the same. Large
states and states on a GPU leave the copy of what only the optimizer's step changes to
the background thread during the next step's forward and backward; that optimizer step
waits for it (:meth:`MemorySnapshots.hold`).

At a resume the ranks agree (:func:`agree`) on the newest snapshot every rank can
restore: from its own buffer, or sent by a rank that has it and its rows; else disk.
Under fsdp a rank's buffer holds its own shards: its successor keeps a copy of it
(engine/memory_ring.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import io
import json
import mmap
import os
import pathlib
import pickle
import queue
import random
import re
import secrets
import socket
import stat
import struct
import sys
import threading
import weakref
from typing import Any

import attrs
from engine.shm import SHM, free_bytes, sweep, unlink_own
from engine.shm_codec import (PlainUnpickler, align, copier, decode, encode,
                              marker)

from engine import distributed, phases, stateful
from engine.atomic_io import atomic_write_text

# torch, numpy and xxhash are imported inside the functions that use them: the launching
# processes import this module (through engine.snapshot) without them.

FOLDER_PREFIX = "engine-memory-"  # + the user id
#: In the run folder, where this user's folder was taken: {host: its private folder}.
FOLDER_FILE = ".engine-memory-folder"
_PRIVATE = re.compile(rf"{FOLDER_PREFIX}\d+-[0-9a-f]{{32}}")
#: The run's id, in the run folder: a buffer without it is not this run's.
RUN_ID_FILE = ".engine-memory-id"
HEADER_BYTES = 4096
# 5: the skeleton's markers are engine.shm_codec's (4: tuples holding a marker string).
MAGIC = b"ENGMEM\x00\x05"
# magic, sequence, step, epoch, payload length, checksum (16 bytes), step reached, run id,
# where the exchange region starts (0: none)
_HEADER = struct.Struct("<8sQQQQ16sQ16sQ")
_REACHED_AT = 56
_EXCHANGE_AT = 80
_JSON_AT = _HEADER.size
#: The exchange region's own header: the sequence of the snapshot its rows belong to,
#: the number of rows, the bytes of each, xxh3-128 of those and the rows.
_EXCHANGE = struct.Struct("<QQQ16s")
_EXCHANGE_HEAD = 64
#: One rank's row in the exchange: its length, then the pickled RNG states and epoch
#: loss; a larger one is left out (a peer then cannot restore that rank's snapshot).
ROW_BYTES = 8 + 16384 + 512
#: What the checksum covers besides the payload: every field but itself and "reached".
_SIGNED = struct.Struct("<8sQQQQ16s")
#: The bytes of the tensors only the optimizer's step changes from which the background
#: thread copies them (below, the thread's wake-up costs more than the copy: at once).
BACKGROUND_BYTES = 4 << 20
# "-held-": the copies of the predecessor's snapshots under fsdp (engine/memory_ring.py).
_NAME = re.compile(r"(?P<run_id>[0-9a-f]{32})-r(?P<rank>\d+)-(?:held-)?[ab]")


class Unsafe(Exception):
    """A folder or buffer in the shared tmpfs that is not this user's own (a link,
    another user's file, a folder open to others, a directory at a buffer's name)."""


class NoRoom(Exception):
    """The tmpfs could not hold a buffer (ENOSPC while reserving its pages)."""


def user_folder(shm: pathlib.Path = SHM) -> pathlib.Path:
    return pathlib.Path(shm) / f"{FOLDER_PREFIX}{os.geteuid()}"


def own_dir(folder: pathlib.Path, create: bool = True, new: bool = False) -> pathlib.Path:
    """``folder``, made 0700 when missing (``create``; ``new``: it must not exist yet);
    Unsafe unless it is a real folder (not a link) of this user's, closed to others."""
    try:
        try:
            if create or new:
                os.mkdir(folder, 0o700)  # never follows a link at the name: EEXIST
        except FileExistsError:
            if new:
                raise
        info = os.lstat(folder)
    except OSError as exc:
        raise Unsafe(f"cannot make {folder}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise Unsafe(f"{folder} is a symbolic link, not this user's folder")
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(f"{folder} is not a folder")
    if info.st_uid != os.geteuid():
        raise Unsafe(f"{folder} belongs to uid {info.st_uid}, not to this user "
                     f"(uid {os.geteuid()})")
    if info.st_mode & 0o077:
        raise Unsafe(f"{folder} is open to other users (mode "
                     f"{stat.S_IMODE(info.st_mode):o}, expected 700)")
    return pathlib.Path(folder)


def _records(fd: int) -> dict:
    try:
        records = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _recorded(records: dict, shm) -> pathlib.Path | None:
    """This host's private folder in ``records`` while it is this user's own."""
    name = records.get(socket.gethostname())
    if isinstance(name, str) and _PRIVATE.fullmatch(name):
        with contextlib.suppress(Unsafe):
            return own_dir(pathlib.Path(shm) / name, create=False)
    return None


def folder_of(run_dir, shm: pathlib.Path = SHM) -> pathlib.Path:
    """Where the run's buffers are on this host: the private folder recorded in the run
    folder (:func:`own_folder`) while it is this user's own, else :func:`user_folder`."""
    try:
        fd = os.open(pathlib.Path(run_dir) / FOLDER_FILE,
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return user_folder(shm)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: read as it is
            fcntl.flock(fd, fcntl.LOCK_SH)  # never while own_folder writes it
        return _recorded(_records(fd), shm) or user_folder(shm)
    finally:
        os.close(fd)


def own_folder(run_dir, shm: pathlib.Path = SHM) -> pathlib.Path:
    """The run's buffer folder on this host (:func:`folder_of`'s, made when missing), or,
    where another user took this user's folder name first, a private folder of random
    name (made as mkdtemp does), recorded in the run folder for its restarts and its
    other local ranks (under the record's lock). Unsafe when none can be had."""
    try:
        return own_dir(folder_of(run_dir, shm))
    except Unsafe as exc:
        taken = exc
    record = pathlib.Path(run_dir) / FOLDER_FILE
    try:
        fd = os.open(record, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            records = _records(fd)
            folder = _recorded(records, shm)  # another local rank's, made meanwhile
            if folder is None:
                folder = own_dir(pathlib.Path(shm) / f"{FOLDER_PREFIX}{os.geteuid()}-"
                                 f"{secrets.token_hex(16)}", new=True)
                text = json.dumps({**records, socket.gethostname(): folder.name}).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, text, 0)
        finally:
            os.close(fd)
    except (OSError, Unsafe) as exc:
        raise Unsafe(f"{taken}; and no private folder could be had instead ({record}: "
                     f"{getattr(exc, 'strerror', None) or exc})") from None
    return folder


def _open_own(path: pathlib.Path, writable: bool) -> int:
    """A descriptor of the buffer at ``path``: never through a link, created exclusively
    when missing (``writable``), and only a regular file of this user's closed to others.
    FileNotFoundError when it is missing and not ``writable``; Unsafe otherwise."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDWR if writable else os.O_RDONLY)
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not writable:
                raise
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unsafe(f"{path} is not a buffer of this user's ({exc.strerror or exc})") \
            from None
    info = os.fstat(fd)
    problem = (None if stat.S_ISREG(info.st_mode) else "not a regular file") or (
        None if info.st_uid == os.geteuid() else f"it belongs to uid {info.st_uid}") or (
        None if not info.st_mode & 0o077 else
        f"it is open to other users (mode {stat.S_IMODE(info.st_mode):o})")
    if problem:
        os.close(fd)
        raise Unsafe(f"{path} is not a buffer of this user's: {problem}")
    return fd


def run_id_of(run_dir) -> str | None:
    """The run id kept in ``run_dir`` (None: none, or not one)."""
    try:
        text = (pathlib.Path(run_dir) / RUN_ID_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if re.fullmatch(r"[0-9a-f]{32}", text) else None


def claim_run_id(run_dir, fresh: bool) -> tuple[str | None, str]:
    """Rank 0 at the start: (the id ``run_dir`` had, the run's id). The old one is
    kept unless the run starts ``fresh`` or has none; a new one is written (atomically)
    into the folder."""
    old = run_id_of(run_dir)
    if old is not None and not fresh:
        return old, old
    new = secrets.token_hex(16)
    atomic_write_text(pathlib.Path(run_dir) / RUN_ID_FILE, new + "\n")
    return old, new


def buffer_paths(run_dir, rank: int, shm: pathlib.Path = SHM, run_id: str | None = None,
                 folder: pathlib.Path | None = None) -> tuple[pathlib.Path, ...]:
    """Rank ``rank``'s two buffers of the run in ``run_dir`` (its id read from there
    unless given; a run without one has none: paths that do not exist)."""
    run_id = run_id or run_id_of(run_dir) or "0" * 32
    return tuple((folder or folder_of(run_dir, shm)) / f"{run_id}-r{rank}-{x}" for x in "ab")


def run_buffers(run_id: str, shm: pathlib.Path = SHM, run_dir=None) -> list[pathlib.Path]:
    """Every rank's buffers of the run ``run_id`` (in ``run_dir``) on this machine."""
    folder = user_folder(shm) if run_dir is None else folder_of(run_dir, shm)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(folder / n for n in names
                  if (m := _NAME.fullmatch(n)) and m["run_id"] == run_id)


# ------------------------------------------------------------ the payload


#: The payload's own header: the skeleton's length, where the data region starts.
_PAYLOAD = struct.Struct("<QQ")


def data_start(skeleton_bytes: int) -> int:
    """Where a plan puts the data region after a skeleton of ``skeleton_bytes``: with
    room for it to grow (metrics, an epoch's loss sums, larger step numbers) while the
    tensors stay where they are, so that the copies' views need not be made again."""
    return align(_PAYLOAD.size + skeleton_bytes + max(1024, skeleton_bytes // 8))


def payload_size(skeleton: bytes, data_size: int) -> int:
    return data_start(len(skeleton)) + data_size


class Plan:
    """Where each tensor of a snapshot goes in the payload, and the numpy copies that
    put it there, reused while the state holds the same tensors (:func:`encode`'s key).
    It keeps its tensors alive: no other tensor can come to live at one's address.
    ``held``: the addresses of the tensors only the optimizer's step changes
    (:func:`held_by`), which the background thread may copy later."""

    def __init__(self, key: list, tensors: list, data_size: int, data_at: int,
                 held: frozenset | None):
        self.key = key
        self.tensors = tensors
        # Each tensor's marker as the encoder returns it, and where the next one starts.
        self.markers = [(offset, marker(offset, t), align(offset + t.numel() * t.element_size()))
                        for offset, t in tensors]
        self.held = held is not None
        self.data_at = data_at
        self.data_size = data_size
        self.later = [held is not None and t.data_ptr() in held for _, t in tensors]
        offset, last = tensors[-1] if tensors else (0, None)
        self.length = data_at + (offset + last.numel() * last.element_size()
                                 if tensors else 0)
        self.device = next((t.device for _, t in tensors if t.is_cuda), None)
        #: Whether the background thread copies the held tensors (BACKGROUND_BYTES).
        self.background = held is not None and (self.device is not None or sum(
            t.numel() * t.element_size() for (_, t), h in zip(tensors, self.later) if h)
            >= BACKGROUND_BYTES)
        self.copies: dict = {}  # buffer index: (its array then, copies now, copies later)

    def fits(self, skeleton: bytes, held) -> bool:
        """Whether a state whose tensors are this plan's (:func:`encode`) can be saved
        by it: its skeleton has room, the same tensors wait for the optimizer."""
        return _PAYLOAD.size + len(skeleton) <= self.data_at and (held is not None) == self.held

    def copies_into(self, index: int, buffer: Buffer) -> tuple[list, list]:
        """The copies into ``buffer`` (this rank's ``index``): those to do now, and those
        of the tensors the optimizer's step changes; made again when it was remapped."""
        made = self.copies.get(index)
        if made is None or made[0] is not buffer.array:
            now, later = [], []
            for (offset, tensor), is_later in zip(self.tensors, self.later):
                copy = copier(buffer.array, buffer.tensor, HEADER_BYTES + self.data_at + offset,
                              tensor)
                if copy is not None:
                    (later if is_later else now).append(copy)
            made = self.copies[index] = (buffer.array, now, later)
        return made[1], made[2]


def held_by(optimizer) -> frozenset:
    """Where the tensors that only ``optimizer``'s step changes live (data pointers: its
    parameters and state), which a save may copy before its next step; anything else
    (a module's buffers, which a forward updates) is copied at once."""
    import torch

    def pointer(tensor) -> int:
        # A DTensor's (fsdp) data_ptr() is 0: its local tensor's memory is the snapshot's.
        return getattr(tensor, "_local_tensor", tensor).data_ptr()

    held = {pointer(p) for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        held.update(pointer(v) for v in state.values() if isinstance(v, torch.Tensor))
    return frozenset(held)


def read_payload(buf) -> dict:
    """The snapshot dict in the payload ``buf`` (a uint8 tensor), its tensors copied out
    (the buffer is written again by later snapshots)."""
    import torch

    length, start = _PAYLOAD.unpack(bytes(buf[:_PAYLOAD.size].tolist()))
    if not _PAYLOAD.size + length <= start <= len(buf):
        raise ValueError("its skeleton and data region overlap or lie outside the payload")
    skeleton = buf[_PAYLOAD.size:_PAYLOAD.size + length].numpy().tobytes()

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
    import xxhash

    digest = xxhash.xxh3_128(fields)
    digest.update(payload)
    return digest.digest()


def _signed(sequence: int, step: int, epoch: int, length: int, run_id: bytes) -> bytes:
    return _SIGNED.pack(MAGIC, sequence, step, epoch, length, run_id)


# ------------------------------------------------------------ one buffer


def intact(payload, sequence: int, step: int, epoch: int, length: int, run_id: bytes,
           digest: bytes) -> bool:
    """Whether ``payload`` (its first ``length`` bytes) and those header fields are the
    snapshot ``digest`` was computed over, as a save signs it: a buffer's own, or a copy
    sent by the ring (engine/memory_ring.py)."""
    return checksum(_signed(sequence, step, epoch, length, run_id), payload[:length]) == digest


def _map(fd: int, size: int, writable: bool):
    """A memory map of ``size`` bytes of ``fd``, and a uint8 tensor over it. Read-only
    descriptors are mapped privately (copy on write, never written): torch wants a
    writable buffer."""
    import torch

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
    #: Every rank's exchange row of this snapshot (world size x ROW_BYTES, uint8), when
    #: the exchange region holds them whole (:meth:`MemorySnapshots.exchange`); None
    #: while they were on their way, or never came.
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
        """Map the file with room for ``payload_bytes`` and an exchange region of
        ``exchange_bytes`` (the pages reserved with posix_fallocate: a full tmpfs is
        NoRoom here, not a SIGBUS during a copy). The header gets the magic, the run id
        and ``info`` at once: a clean-up knows whose the file is before its first
        snapshot. Unsafe when the name is taken by anything but this user's file."""
        import numpy as np

        size = HEADER_BYTES + payload_bytes + exchange_bytes
        self.unmap()
        if self.fd is None:
            self.fd = _open_own(self.path, writable=True)
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
        self.array[_REACHED_AT + 8:_EXCHANGE_AT] = bytearray(run_id)
        self.exchange_at = HEADER_BYTES + payload_bytes if exchange_bytes else 0
        if exchange_bytes:  # no rows yet: a sequence no snapshot has
            self.array[self.exchange_at:self.exchange_at + 8] = 0
        self.array[_EXCHANGE_AT:_JSON_AT] = bytearray(struct.pack("<Q", self.exchange_at))
        self.array[:8] = bytearray(MAGIC)

    def write_header(self, sequence: int, step: int, epoch: int, length: int,
                     run_id: bytes, digest: bytes) -> None:
        array = self.array
        fields = _HEADER.pack(MAGIC, 0, step, epoch, length, digest, 0, run_id,
                              self.exchange_at)
        # Everything but the sequence and "reached" (the step's thread writes it while a
        # background copy finishes)...
        array[16:_REACHED_AT] = bytearray(fields[16:_REACHED_AT])
        array[_REACHED_AT + 8:_HEADER.size] = bytearray(fields[_REACHED_AT + 8:])
        array[8:16] = bytearray(struct.pack("<Q", sequence))  # ...which commits it

    def invalidate(self) -> None:
        self.array[8:16] = 0

    def write_exchange(self, sequence: int, rows) -> bool:
        """Every rank's row of the snapshot ``sequence`` (a uint8 array, world size x
        ROW_BYTES) into the exchange region, its sequence last; False (nothing written)
        when the buffer holds another snapshot by now, or has no room for the rows."""
        at, array = self.exchange_at, self.array
        if (array is None or not at or int(array[8:16].view("<u8")[0]) != sequence
                or at + _EXCHANGE_HEAD + rows.size > len(array)):
            return False
        import xxhash

        world, row_bytes = rows.shape
        fields = _EXCHANGE.pack(0, world, row_bytes, b"")[8:24]
        digest = xxhash.xxh3_128(struct.pack("<Q", sequence) + fields)
        digest.update(rows)
        array[at:at + 8] = 0
        array[at + _EXCHANGE_HEAD:at + _EXCHANGE_HEAD + rows.size] = rows.reshape(-1)
        array[at + 8:at + _EXCHANGE.size] = bytearray(fields + digest.digest())
        array[at:at + 8] = bytearray(struct.pack("<Q", sequence))
        return True

    def note_reached(self, step: int) -> None:
        self.array[_REACHED_AT:_REACHED_AT + 8] = bytearray(struct.pack("<Q", step))

    def payload(self, length: int):
        return self.tensor[HEADER_BYTES:HEADER_BYTES + length]

    def pin(self) -> None:
        """Page-lock the mapping (cudaHostRegister): copies from a GPU go by DMA straight
        into it rather than through a staging buffer."""
        import torch

        if not self.pinned:
            error = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(),
                                                         self.tensor.numel(), 0)
            self.pinned = int(error) == 0  # else the copies still work, unpinned

    def unmap(self) -> None:
        if self.pinned:
            import torch

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


def read_slot(path: pathlib.Path, verify: bool = True,
              run_id: str | None = None) -> Slot | None:
    """The buffer at ``path`` if it holds a whole snapshot of the run ``run_id``."""
    return check_slot(path, verify, run_id)[0]


def check_slot(path: pathlib.Path, verify: bool = True,
               run_id: str | None = None) -> tuple[Slot | None, str | None]:
    """The buffer at ``path`` if it holds a whole snapshot of the run ``run_id`` (any
    run's when None; its checksum checked when ``verify``), and why not: None when it is
    missing or holds no snapshot yet (sequence 0: never written, or torn), else a text."""
    try:
        fd = _open_own(path, writable=False)
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
        _HEADER.unpack(array[:_HEADER.size].tobytes())
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
    import xxhash

    if not at or at + _EXCHANGE_HEAD > len(array):
        return None
    seq, world, row_bytes, digest = _EXCHANGE.unpack(array[at:at + _EXCHANGE.size].tobytes())
    end = at + _EXCHANGE_HEAD + world * row_bytes
    if seq != sequence or not world or row_bytes < 8 or end > len(array):
        return None
    rows = array[at + _EXCHANGE_HEAD:end]
    check = xxhash.xxh3_128(array[at:at + 24].tobytes())
    check.update(rows)
    return rows.reshape(world, row_bytes) if check.digest() == digest else None


def make_row(loss) -> bytes:
    """This rank's exchange row: its RNG states (engine.stateful.rng_state's, in raw
    bytes: quicker to pickle) and its part of the epoch's loss sums ((sum,
    micro-batches) or None), for a peer to keep; b"" when they exceed ROW_BYTES."""
    import torch

    state = {"python": _python_rng(), "numpy": _numpy_rng(),
             "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_initialized():  # (is_available asks the driver, each time)
        state["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
    data = pickle.dumps({"rng": state, "loss": loss}, protocol=pickle.HIGHEST_PROTOCOL)
    return data if 8 + len(data) <= ROW_BYTES else b""


def _python_rng() -> tuple:
    """Python's global RNG state as (version, its 625 words as little-endian bytes,
    gauss), read straight from the CPython RandomObject (getstate() builds a tuple of
    625 ints) once that layout was checked against getstate(); else through it."""
    inst = random.getstate.__self__  # the module's own generator
    if _python_layout[0] is None:
        _python_layout[0] = _raw_python(inst) == _packed_python(inst)
    return _raw_python(inst) if _python_layout[0] else _packed_python(inst)


_python_layout: list = [None]  # whether the generator's words can be read in place


def _raw_python(inst) -> tuple:
    if sys.byteorder != "little" or type(inst).__basicsize__ < 16 + 4 + 624 * 4:
        return ()
    raw = ctypes.string_at(id(inst) + 16, 4 + 624 * 4)  # after ob_refcnt, ob_type
    return (inst.VERSION, raw[4:] + raw[:4], inst.gauss_next)  # words, then the index


def _packed_python(inst) -> tuple:
    version, internal, gauss = inst.getstate()
    return (version, struct.pack(f"<{len(internal)}I", *internal), gauss)


_numpy_seen: list = [None, None]  # numpy's raw generator state, and its state then


def _numpy_rng() -> dict:
    """numpy's global RNG state (np.random.get_state's), as plain values; the getter's
    copy is skipped while the raw generator state (read through ctypes) has not moved
    and no normal deviate was cached (a cached one is drawn without moving it)."""
    import numpy as np

    try:
        raw = ctypes.string_at(np.random.mtrand._rand._bit_generator.ctypes.state_address,
                               624 * 4 + 4)  # MT19937's key and position
    except (AttributeError, TypeError, ValueError):  # no ctypes view: read it each time
        raw = None
    seen_raw, seen = _numpy_seen
    if raw is None or raw != seen_raw or seen["has_gauss"]:
        _, keys, pos, has_gauss, gauss = np.random.get_state()
        seen = {"keys": keys.astype("<u4").tobytes(), "pos": int(pos),
                "has_gauss": int(has_gauss), "gauss": float(gauss)}
        _numpy_seen[:] = [raw, seen]
    return seen


def read_row(row: bytes) -> dict | None:
    """:func:`make_row`'s dict, its RNG states as engine.stateful.rng_state gives them;
    None for an empty row (the states did not fit)."""
    import numpy as np
    import torch

    if not row:
        return None
    plain = PlainUnpickler(io.BytesIO(row)).load()
    rng = plain["rng"]

    def tensor(data: bytes, dtype=np.uint8):
        return torch.from_numpy(np.frombuffer(data, dtype=dtype).copy())

    version, internal, gauss = rng["python"]
    numpy_state = rng["numpy"]
    state = {"python": (version, struct.unpack(f"<{len(internal) // 4}I", internal), gauss),
             "numpy": {**numpy_state,
                       "keys": tensor(numpy_state["keys"], "<u4").to(torch.int64)},
             "torch": tensor(rng["torch"])}
    if "cuda" in rng:
        state["cuda"] = [tensor(b) for b in rng["cuda"]]
    return {"rng": state, "loss": plain["loss"]}


def row_in(rows, rank: int) -> bytes:
    """Rank ``rank``'s row among an exchange region's ``rows`` (b"": none)."""
    if rows is None or rank >= len(rows):
        return b""
    (length,) = struct.unpack("<Q", rows[rank][:8].tobytes())
    return rows[rank][8:8 + length].tobytes() if 8 + length <= rows.shape[1] else b""


def _info(array) -> dict:
    (length,) = struct.unpack("<I", array[_JSON_AT:_JSON_AT + 4].tobytes())
    try:
        info = json.loads(array[_JSON_AT + 4:_JSON_AT + 4 + length].tobytes())
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _read_header(path: pathlib.Path) -> bytes:
    """The header page of this user's buffer at ``path`` (b"" when none)."""
    try:
        fd = _open_own(path, writable=False)
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
    import numpy as np

    header = _read_header(path)
    return _info(np.frombuffer(header, dtype=np.uint8)) if header else {}


def newest(paths, run_id: str | None = None) -> Slot | None:
    """The valid buffer with the highest sequence among ``paths``, or None."""
    slots = [s for s in (read_slot(p, run_id=run_id) for p in paths) if s is not None]
    best = max(slots, key=lambda s: s.sequence, default=None)
    for slot in slots:
        if slot is not best:
            slot.close()
    return best


def load_slot(slot: Slot) -> dict:
    return read_payload(slot.payload())


def writer_gone(path: pathlib.Path) -> bool:
    """Whether no process holds the buffer at ``path`` open for writing (its writer's
    flock, :class:`Buffer`): the kernel drops it however the writer ended."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # and the lock with it
    return True


# ------------------------------------------------------------ a rank's pair


class MemorySnapshots:
    """This rank's two buffers: :meth:`check` at the start, :meth:`save` every
    ``every_steps`` optimizer steps, :meth:`newest` at a resume, :meth:`remove` when
    the run ends by itself."""

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
        #: Whether this run's model is sharded (fsdp): a snapshot of shards restores
        #: only a sharded model, one of whole tensors only a whole one.
        self.sharded = sharded
        self.config = None  # the run's config, pickled once (snapshot.py: shm_codec.Pickled)
        #: Why this rank's last save failed (a full tmpfs, a name taken since): the
        #: ranks agree at the next check point to turn the tier off (trainer.py).
        self.failed: str | None = None
        self.info = {"run_dir": str(os.path.realpath(self.run_dir)),
                     "host": socket.gethostname(), "mnt": mount_namespace(),
                     "pid": os.getpid(), "rank": world.rank, "world_size": world.world_size}
        self.exchange_bytes = _EXCHANGE_HEAD + world.world_size * ROW_BYTES
        self.background = Background(self)
        self.exchanges = Exchanges(world.world_size, self.background)
        self.hook = None  # the next optimizer step's wait (hold)
        self.plan: Plan | None = None  # the last save's (reused while the state allows)
        #: Under fsdp with more than one process, the copies to and from the ring's
        #: neighbours (engine/memory_ring.py's Ring; the Engine opens it); else None.
        self.ring = None

    def _paths(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.paths = buffer_paths(self.run_dir, self.world.rank, run_id=self.run_id,
                                  folder=folder)
        self.buffers = [Buffer(p) for p in self.paths]

    def check(self) -> str | None:
        """None when the run's buffer folder (:func:`own_folder`) is safe to use, else
        why not: the tier must be off."""
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
        header = _read_header(self.paths[0])
        return struct.unpack_from("<Q", header, _REACHED_AT)[0] if header else 0

    def note_reached(self, step: int) -> None:
        """After each optimizer step: the step reached, in buffer a's header (a restart
        says how many steps it recomputes). The snapshot's background copy is done by
        then (:meth:`hold`; or waited for here, where the step was skipped)."""
        if self.hook is not None:
            self.background.wait(self.background.copied)
            self.hook.remove()
            self.hook = None
        if self.buffers[0].tensor is not None:
            self.buffers[0].note_reached(step)

    def reserve(self, state: dict) -> None:
        """Map both buffers with room for ``state``: at the first save, so that a tmpfs
        filling up later cannot take the second one's pages (only a state that grows
        maps again). NoRoom or Unsafe when a buffer cannot be had."""
        skeleton, _, data_size = encode(state)[:3]
        self._reserve(payload_size(skeleton, data_size), range(2))
        if self.ring is not None:  # the predecessor's copies: about as large as its own
            self.ring.reserve(payload_size(skeleton, data_size))

    def _reserve(self, needed: int, indices) -> None:
        if all(b.fd is None for b in self.buffers):  # this process's first: the folder
            own_dir(self.folder)                   # is checked again
        # Room for the skeleton to grow (metrics, an epoch's loss sums) without
        # remapping at the next save.
        capacity = needed + max(64 * 1024, needed // 64)
        for i in indices:
            if self.buffers[i].tensor is None or self.buffers[i].capacity < needed:
                self.buffers[i].map(capacity, self.info, self.raw_id, self.exchange_bytes)

    def save(self, state: dict, *, step: int, epoch: int, held=None) -> bool:
        """Copy ``state`` into the buffer that does not hold the newest snapshot (with the
        previous save's :class:`Plan` while the state holds the same tensors). NoRoom or
        Unsafe when a buffer cannot be had; the newest snapshot stays valid.

        ``held`` (:func:`held_by`'s set, or a callable that returns it, called only when
        a plan is made): the tensors there, the checksum and the header may be left to
        the background thread (on a GPU, or above :data:`BACKGROUND_BYTES`); returns
        whether they were, and the caller then has the optimizer's next step wait for
        them (:meth:`hold`). Everything else is written before this returns."""
        import torch

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
        array, at = buffer.array, HEADER_BYTES + _PAYLOAD.size
        array[HEADER_BYTES:at] = bytearray(_PAYLOAD.pack(len(skeleton), plan.data_at))
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
                digest = checksum(_signed(sequence, step, epoch, length, raw_id),
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
        """Have ``optimizer``'s next step wait for the snapshot finished in the background
        (a step pre-hook, removed after that step: :meth:`note_reached`)."""
        if self.hook is None:
            self.hook = optimizer.register_step_pre_hook(self._wait_for_copy)

    def _wait_for_copy(self, *_) -> None:
        """The held optimizer step's pre-hook, its wait timed as the snapshot's cost
        (phases.MEMORY_WAITS), which memory_every_steps=auto must see."""
        with phases.carve(phases.MEMORY_WAITS, within="training",
                          label="memory snapshot copy wait"):
            self.background.wait(self.background.copied)

    def finish(self) -> None:
        """Wait for what the background thread has yet to do (a snapshot's copy, the
        exchange's rows)."""
        self.background.wait()

    def start_exchange(self, row: bytes) -> None:
        """Every rank before each save (a collective, also where it fails): start sending
        ``row`` (:func:`make_row`) to every rank; :meth:`record_exchange`, after the save,
        has the background thread write every rank's into the snapshot just saved."""
        self.exchanges.start(row)

    def record_exchange(self, saved: bool) -> None:
        self.exchanges.record(self.buffers[self.newest_index] if saved else None,
                              self.sequence)
        if self.ring is not None:  # after the copy and the rows, in the same thread
            self.ring.copy(self.buffers[self.newest_index] if saved else None,
                           self.sequence)


    def room_for(self, state: dict) -> tuple[int, int]:
        """The bytes the buffers of ``state`` take on this machine (two per local rank:
        every local rank asks at once, before any allocates), and the bytes free in
        the tmpfs plus what this run's buffers already take there."""
        skeleton, _, data_size = encode(state)[:3]
        free = free_bytes(self.shm)
        held = 0
        for path in run_buffers(self.run_id, self.shm, self.run_dir):
            try:
                # Its pages, not its size: another local rank's posix_fallocate may be
                # under way, its pages taken from the free space before the size is set
                # (tmpfs sets it at the end), and would look like someone else's.
                held += os.lstat(path).st_blocks * 512
            except OSError:
                pass
        per_rank = 2 * (HEADER_BYTES + payload_size(skeleton, data_size)
                        + self.exchange_bytes)
        if self.ring is not None:  # two copies of the predecessor's, about as large
            per_rank += 2 * (HEADER_BYTES + payload_size(skeleton, data_size))
        # Not to be asked (None): the reservation says whether there is room.
        return (per_rank * self.world.local_world_size,
                (float("inf") if free is None else free) + held)

    def bytes_held(self) -> int:
        """The bytes of this rank's mapped buffers (tools/bench_memory_snapshot.py)."""
        return sum(HEADER_BYTES + b.capacity + self.exchange_bytes for b in self.buffers
                   if b.tensor is not None)

    def close(self, wait: bool = True) -> None:
        """End the background thread (waiting for what it has left unless not ``wait``:
        a failed run) and unmap the buffers; their files stay."""
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
        """Unmap and unlink both buffers, and the predecessor's copies (the run ended,
        or they are stale); returns a warning for each that could not be removed."""
        self.close()
        self.sequence = 0
        self.newest_index = None
        problems = unlink_own(self.paths) + (self.ring.remove() if self.ring else [])
        if self.folder != user_folder(self.shm):  # a private one: gone with the last rank's
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)
        return problems


class Background:
    """This rank's thread that finishes each memory snapshot off the step's path (the
    held copies, checksum and header, then the exchange's rows), in that order. A job
    that fails sets ``memory.failed``: the ranks turn the tier off at the next check."""

    #: How long anything waits for the thread: the process group's own timeout ends a
    #: collective whose peer died well before this.
    TIMEOUT_S = 3600.0

    def __init__(self, memory: MemorySnapshots):
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
        # Imported here, never first in the thread: a process forked while the thread
        # is in an import (a DataLoader worker at an epoch's start) would inherit that
        # module's import lock held, and hang at its own import of it.
        import xxhash  # noqa: F401

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
        """Wait for what is left, then end the thread (a later :meth:`submit` starts
        another); ``wait=False`` (a failed run, whose collectives may never come): the
        thread ends once its jobs are done or failed, not waited for."""
        if self.thread is None:
            return
        if wait:
            self.wait()
        self.queue.put(None)
        if wait:
            self.thread.join(self.TIMEOUT_S)
        self.thread = None

    def wait(self, event=None) -> None:
        """Until the thread has nothing left to do (or ``event``, :attr:`copied`, is
        set)."""
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
    """Every rank's row at each snapshot: an all_gather started without waiting, which
    the background thread waits for and writes into the buffer (a single process: at
    once)."""

    def __init__(self, world_size: int, background: Background):
        self.world_size = world_size
        self.background = background
        self.line = self.line_tensor = None  # this rank's row (numpy, torch)
        self.row = self.rows = self.views = None  # the same, and every rank's (torch)
        self.work = None  # the all_gather started, not yet handed to the thread

    def start(self, row: bytes) -> None:
        import numpy as np

        self.background.wait()  # the previous rows are written, the tensors free
        spread = distributed.is_initialized()
        if self.line is None:
            self._allocate(distributed.collective_device() if spread else None)
        line = self.line
        line[:8] = np.frombuffer(struct.pack("<Q", len(row)), dtype=np.uint8)
        line[8:8 + len(row)] = np.frombuffer(row, dtype=np.uint8)  # b"": did not fit
        if spread:
            import torch.distributed as dist

            if self.row.device.type != "cpu":
                self.row.copy_(self.line_tensor)
            self.work = dist.all_gather(self.views, self.row, async_op=True)

    def _allocate(self, device) -> None:
        """This rank's row and every rank's: on the CPU the row is the collective's own
        tensor (written in place); on a GPU (NCCL) a pinned copy is sent over."""
        import torch

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
                    import torch

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


def remove_leftovers(run_dir, run_id: str, shm: pathlib.Path = SHM,
                     forget: str | None = None) -> tuple[list[pathlib.Path], list[str]]:
    """At a run's start (local rank 0): remove the buffers left behind in the run's
    folder (:func:`folder_of`), and only those: from this host and mount namespace,
    their writer gone (no flock held), and either of this run folder under another id
    or of a run folder that no longer exists; ``forget``: an id whose buffers all go
    (``--no-resume``, ``--resume PATH``). Returns what was removed and a warning for
    each buffer that could not be (docs/checkpoints.md, "When they go")."""
    host, here = socket.gethostname(), os.path.realpath(os.fspath(run_dir))
    mnt = mount_namespace()

    def left_behind(name: str, path: pathlib.Path) -> bool:
        match = _NAME.fullmatch(name)
        if not match or (match["run_id"] == run_id and run_id != forget):
            return False
        if match["run_id"] != forget:
            info = read_info(path)
            theirs = info.get("run_dir")
            if (info.get("host"), info.get("mnt")) != (host, mnt) or \
                    not isinstance(theirs, str):
                return False
            if theirs != here and os.path.isdir(theirs):
                return False
        return writer_gone(path)

    return sweep(folder_of(run_dir, shm), left_behind)


def mount_namespace() -> str | None:
    """This process's mount namespace: containers sharing a tmpfs and a host name
    (--ipc=host --net=host) see other run folders at the same paths."""
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None


# ------------------------------------------------------------ agreeing at a resume


@attrs.define
class Loaded:
    """One of this rank's usable memory snapshots: its checked buffer and its content."""

    slot: Slot
    state: dict

    @property
    def step(self) -> int:
        return self.slot.step

    def close(self) -> None:
        self.slot.close()


def load_all(memory: MemorySnapshots, warn) -> list[Loaded]:
    """This rank's memory snapshots of this run that load whole, newest first (both: a
    peer may need the older one); one that does not (:func:`load_checked`) is one
    ``warn``ing, never a traceback: a good disk snapshot is still there behind it."""
    slots, problems = [], []
    for path in memory.paths:
        slot, problem = check_slot(path, run_id=memory.run_id)
        if problem is not None:
            problems.append(problem)
        elif slot is not None:
            slots.append(slot)
    if problems:  # one line per rank
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        warn(f"the memory snapshot {problems[0]}{more}; not used")
    slots.sort(key=lambda s: -s.sequence)
    if slots:  # the next save writes above the highest sequence, whatever loads
        memory.sequence = slots[0].sequence
    loaded = []
    for slot in slots:
        one, problem = load_checked(slot)
        if one is not None:
            loaded.append(one)
        else:
            warn(f"the memory snapshot {slot.path} does not load ({problem}); not used")
    if loaded:
        memory.newest_index = memory.paths.index(loaded[0].slot.path)
    return loaded


def load_checked(slot: Slot, also=None) -> tuple[Loaded | None, str | None]:
    """``slot`` (its checks passed) decoded into a snapshot, or None and why not (then
    closed): a skeleton with anything but plain values, a tensor outside the payload,
    no config, another step than its header's, or what ``also(state)`` says (a text)."""
    try:
        state = load_slot(slot)
        problem = _not_a_snapshot(state, slot.step) or (also(state) if also else None)
    except Exception as exc:  # whatever a damaged or forged payload raises
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return Loaded(slot, state), None
    slot.close()
    return None, problem


def load_newest(memory: MemorySnapshots, warn) -> Loaded | None:
    """This rank's newest memory snapshot that loads whole (:func:`load_all`), or None."""
    loaded = load_all(memory, warn)
    for other in loaded[1:]:
        other.close()
    return loaded[0] if loaded else None


def _not_a_snapshot(state, step: int) -> str | None:
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a snapshot"
    if not isinstance(state.get("config"), dict):
        return "it holds no config to check against this run's"
    if state.get("step") != step:
        return f"its header says step {step}, its content step {state.get('step')!r}"
    return None


@attrs.define
class MemoryChoice:
    """The newest step every rank can restore (-1: none), the ranks that hold it, the
    rank that sends it to the others, and the step the interrupted run reached."""

    step: int
    holders: list[int]
    reached: int
    source: int = 0
    #: The newest step of a snapshot passed over (fsdp shards or whole tensors where the
    #: run is not alike: agree), and why.
    unusable: tuple[int, str] | None = None
    #: Under fsdp: {a rank without its own snapshot of the step: its successor, which
    #: holds a copy and sends it} (engine/memory_ring.py).
    peers: dict = attrs.field(factory=dict)

    def newer_than(self, disk_step: int | None) -> bool:
        return self.step >= 0 and (disk_step is None or self.step > disk_step)

    def not_used(self, disk_step: int | None) -> str | None:
        """The line that says why a memory snapshot newer than the chosen one and than
        ``disk_step`` (the disk snapshot's) was passed over (``unusable``), or None."""
        if self.unusable is None:
            return None
        step, why = self.unusable
        if step <= max(self.step, -1 if disk_step is None else disk_step):
            return None
        return f"the memory snapshot of step {step} is not used: {why}"

    def missing(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.holders]


def agree(memory: MemorySnapshots, mine: list[Loaded], copies=()) -> MemoryChoice:
    """Collective: every rank returns the same answer: the newest step that every rank
    holds, or that a rank holding it can send with the missing ranks' exchange rows (a
    snapshot of another number of processes needs none: its RNG states are not
    restored). fsdp shards only at their number of processes, each rank's own or its
    successor's copy (``copies``: this rank's of its predecessor's, memory_ring's
    load_held); shards or whole tensors only where this run's model is alike
    (``memory.sharded``). The newest snapshot passed over is the choice's ``unusable``."""
    world_size = memory.world.world_size
    held, unusable, sharded = [], [], []
    for m in mine:
        saved_world = m.state.get("world_size")
        shards = stateful.holds_shards(m.state.get("model"))
        if shards != memory.sharded:  # --parallel changed from or to fsdp: from disk
            unusable.append((m.step, "it holds " + ("fsdp shards" if shards else
                                                    "whole tensors") + ", this run's model "
                             "is " + ("sharded (fsdp)" if memory.sharded else "whole")))
        elif not shards:
            held.append((m.step, m.slot.rows is not None or saved_world != world_size))
        elif saved_world != world_size:  # another split: the disk's dcp snapshots reshard
            unusable.append((m.step, f"it holds the shards of {saved_world} processes "
                                     f"(fsdp), this run has {world_size}"))
        else:  # fsdp: this rank's own shards (its successor has a copy: copies)
            held.append((m.step, False))
            sharded.append(m.step)
    every = distributed.all_gather_object((held, memory.reached(), unusable, sharded,
                                           [m.step for m in copies]))
    reached = max(r for _, r, _, _, _ in every)
    own, ring = [steps for _, _, _, steps, _ in every], [c for *_, c in every]
    if memory.sharded:  # each rank's own shards, or its successor's copy of them
        choice = choose_sharded(own, ring, reached)
    else:
        choice = choose([h for h, *_ in every], reached)
    found = [u for _, _, theirs, _, _ in every for u in theirs]
    for step in {s for steps in own for s in steps}:
        lacking = lacking_sharded(own, ring, step)
        if lacking:
            found.append((step, f"rank(s) {', '.join(map(str, lacking))} had no copy, "
                                "and under fsdp a rank's shards are only in its own memory "
                                "and its successor's: no other peer can send them"))
    newest = max(found, default=None)  # the same on every rank
    if newest is not None and newest[0] > choice.step:
        choice.unusable = newest
    return choice


def choose(held: list[list[tuple[int, bool]]], reached: int) -> MemoryChoice:
    """:func:`agree`'s answer from what each rank holds (``held[rank]``: (step, whether
    a peer can send it: its rows whole) for each of its snapshots): the newest step
    that every rank holds, or that a rank holding it can send to those that do not."""
    for step in sorted({s for h in held for s, _ in h}, reverse=True):
        holders = [r for r, h in enumerate(held) if any(s == step for s, _ in h)]
        senders = [r for r, h in enumerate(held) if (step, True) in h]
        if len(holders) == len(held) or senders:
            return MemoryChoice(step, holders, reached,
                                source=senders[0] if senders else holders[0])
    return MemoryChoice(-1, [], reached)


def choose_sharded(own: list[list[int]], copies: list[list[int]],
                   reached: int) -> MemoryChoice:
    """:func:`agree`'s answer under fsdp (``own[r]``, ``copies[r]``: the steps of rank
    r's own snapshots and of its copies of its predecessor's): the newest step every
    rank restores from its own or its successor's copy; ``peers``: {rank: successor}."""
    world_size = len(own)
    for step in sorted({s for steps in own + copies for s in steps}, reverse=True):
        if lacking_sharded(own, copies, step):
            continue
        holders = [r for r in range(world_size) if step in own[r]]
        peers = {r: (r + 1) % world_size for r in range(world_size) if r not in holders}
        return MemoryChoice(step, holders, reached,
                            source=next(iter(peers.values()), 0), peers=peers)
    return MemoryChoice(-1, [], reached)


def lacking_sharded(own: list[list[int]], copies: list[list[int]], step: int) -> list[int]:
    """The ranks that can restore ``step`` neither from their own snapshot nor from
    their successor's copy (:func:`choose_sharded`)."""
    world_size = len(own)
    return [r for r in range(world_size)
            if step not in own[r] and step not in copies[(r + 1) % world_size]]


def fetch(memory: MemorySnapshots, choice: MemoryChoice, mine: list[Loaded]) -> dict:
    """Collective: the chosen snapshot on every rank, as a resume restores it
    (:func:`complete`): its own, or, where a rank lacks it, broadcast by
    ``choice.source`` with its exchange rows. (Where under fsdp a rank gets its
    successor's copy: engine/memory_ring.py's fetch.)"""
    import torch

    rank, world_size = memory.world.rank, memory.world.world_size
    own = next((m for m in mine if m.step == choice.step), None)
    if own is not None:
        memory.newest_index = memory.paths.index(own.slot.path)
    if not choice.missing(world_size):
        return complete(own.state, rank, world_size, None)
    length = distributed.broadcast_object(
        (own.slot.length, own.slot.rows.shape if own.slot.rows is not None else None)
        if rank == choice.source else None, src=choice.source)
    payload_length, rows_shape = length
    device = distributed.collective_device()
    if rank == choice.source:
        payload = own.slot.payload().to(device, copy=True)
    else:
        payload = torch.empty(payload_length, dtype=torch.uint8, device=device)
    distributed.broadcast_tensor(payload, src=choice.source)
    rows = None
    if rows_shape is not None:
        rows = (torch.from_numpy(own.slot.rows.copy()).to(device) if rank == choice.source
                else torch.empty(rows_shape, dtype=torch.uint8, device=device))
        distributed.broadcast_tensor(rows, src=choice.source)
        rows = rows.cpu().numpy()
    if own is not None:
        return complete(own.state, rank, world_size, None)
    return complete(read_payload(payload.cpu()), rank, world_size, rows)


def complete(state: dict, rank: int, world_size: int, rows) -> dict:
    """A memory snapshot (a rank's own row and loss sums) as a resume restores it: its
    ``rng`` as the disk snapshot's, this rank's states from its own row (or the sender's
    ``rows``), the epoch's loss sums over every rank (a collective, mid-epoch)."""
    part = state.get("rng") or {}
    if "row" not in part:  # a whole state (a test's, or an older form): as it is
        return state
    saved_world = part["world_size"]
    mine = read_row(part["row"] if rows is None else row_in(rows, rank))
    ranks = [None] * saved_world
    if mine is not None and rank < saved_world:
        ranks[rank] = mine["rng"]
    state = {**state, "rng": {"ranks": ranks, "world_size": saved_world}}
    progress = state.get("progress")
    loss = (progress or {}).get("epoch_loss")
    if loss is not None and saved_world != world_size:
        # Another number of processes: the ranks that kept the sums are not these; the
        # resumed epoch's mean loss covers the batches after the resume.
        state["progress"] = {**progress, "epoch_loss": None}
    elif loss is not None:  # every rank is mid-epoch alike (the same step)
        import torch

        # The all-reduce of the same values the disk snapshot's capture sums: the same
        # sums, to the bit.
        totals = torch.tensor(mine["loss"], dtype=torch.float64,
                              device=distributed.collective_device())
        total, batches = distributed.all_reduce_sum(totals).tolist()
        state["progress"] = {**progress, "epoch_loss": {
            "sum": total, "batches": batches, "micro_batch": loss["micro_batch"]}}
    return state
