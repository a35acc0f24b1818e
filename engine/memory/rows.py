"""Each rank's exchange row: its RNG states and its part of the epoch's loss sums, kept
by :data:`KEEPERS` peers (:func:`offsets`), so that in the replicated modes a rank whose
memory is lost takes the state from any holder and its row from a keeper (resume.py)."""

from __future__ import annotations

import ctypes
import io
import pickle
import random
import struct
import sys

import numpy as np
import torch

from engine.shm_codec import PlainUnpickler

#: One rank's row in the exchange: its length and rank (:data:`ROW_HEAD`), its epoch loss
#: sum (:data:`LOSS_SUM`, copied from the device: Exchanges.start), the pickled RNG states
#: and micro-batch count; a larger one is left out (no peer keeps it).
ROW_BYTES = 8 + 16384 + 512
ROW_HEAD = struct.Struct("<II")
LOSS_SUM = struct.Struct("<d")
#: How many peers keep each rank's row: two, so that a rank and one of its keepers lost
#: in one failure still leave one (a row is 17 kB: the second costs little).
KEEPERS = 2


def offsets(world) -> list[int]:
    """Rank r's row goes to ranks r + o (mod W) for each o, r keeps those of r - o: up
    to KEEPERS peers, a node apart where there are several (a node's memory goes whole)."""
    size, local = world.world_size, world.local_world_size
    found = [j * (local if local < size else 1) % size for j in range(1, KEEPERS + 1)]
    return found[:found.index(0)] if 0 in found else found  # j * stride wrapped to r


def make_row(loss) -> bytes:
    """This rank's exchange row: its loss sums ((sum, micro-batches) or None) and RNG
    states (engine.rng.rng_state's, as raw bytes); b"" above ROW_BYTES."""
    state = {"python": _python_rng(), "numpy": _numpy_rng(),
             "torch": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_initialized():  # (is_available asks the driver, each time)
        state["cuda"] = [t.numpy().tobytes() for t in torch.cuda.get_rng_state_all()]
    data = LOSS_SUM.pack(loss[0] if loss else 0.0) + pickle.dumps(
        {"rng": state, "batches": loss and loss[1]}, protocol=pickle.HIGHEST_PROTOCOL)
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
    """:func:`make_row`'s dict, its RNG states as engine.rng.rng_state gives them;
    None for an empty row (the states did not fit). ``row``: bytes, or a line (tensor)."""
    if isinstance(row, torch.Tensor):
        row = next((body for _, body in _filled([row.numpy()])), b"")
    if not row:
        return None
    plain = PlainUnpickler(io.BytesIO(row[LOSS_SUM.size:])).load()
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
    loss = plain["batches"] is not None and (LOSS_SUM.unpack_from(row)[0], plain["batches"])
    return {"rng": state, "loss": loss or None}


def _filled(rows):
    """(rank, row) of each row that is not empty among ``rows`` (None: none)."""
    for line in () if rows is None else rows:
        length, rank = ROW_HEAD.unpack(line[:8].tobytes())
        if 0 < length <= len(line) - 8:
            yield rank, line[8:8 + length].tobytes()


def row_in(rows, rank: int) -> bytes:
    """Rank ``rank``'s row among an exchange region's ``rows`` (b"": none)."""
    return next((row for owner, row in _filled(rows) if owner == rank), b"")


def owners(rows) -> tuple[int, ...]:
    """The ranks whose rows ``rows`` holds."""
    return tuple(owner for owner, _ in _filled(rows))
