"""A process's RNG states (Python, numpy, torch, CUDA): taken and set again, gathered
from every rank in one collective, and the snapshot part that holds them. torch and numpy
are imported inside the functions that use them: the launching process imports this
module (via engine.stateful).
"""

from __future__ import annotations

import pickle
import random
import struct

from engine import distributed


def rng_state() -> dict:
    """This process's Python, numpy, torch (and CUDA) RNG states, as tensors and plain
    values (``torch.load(weights_only=True)`` reads them)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    # CPU tensors only (numpy's and torch's setters refuse others): snapshots are loaded
    # onto the CPU for this (snapshot.load_snapshot).
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: Room for one rank's pickled RNG states in :func:`gather_rng_states` (larger: the slow way).
RNG_BYTES = 16384


def gather_rng_states() -> list[dict] | None:
    """Every rank's :func:`rng_state` on rank 0, the one that writes a snapshot's states
    (None on the others: none receives W ranks' states), in one gather of a fixed-size
    byte tensor; torch's gather_object (pickles, sizes gathered everywhere) only where a
    rank's states exceed it, as a summed flag says."""
    import torch

    state = rng_state()
    if not distributed.is_initialized():
        return [state]
    data = pickle.dumps(_rng_as_bytes(state), protocol=pickle.HIGHEST_PROTOCOL)
    device = distributed.collective_device()
    too_long = torch.tensor([float(len(data) > RNG_BYTES)], device=device)
    if distributed.all_reduce_sum(too_long).item():
        return distributed.gather_object(state)
    row = bytearray(8 + RNG_BYTES)
    row[:8 + len(data)] = struct.pack("<Q", len(data)) + data
    rows = distributed.gather_tensor(torch.frombuffer(row, dtype=torch.uint8).to(device))
    if rows is None:
        return None
    rows = rows.cpu().numpy()
    lengths = [struct.unpack("<Q", r[:8].tobytes())[0] for r in rows]
    return [_rng_from_bytes(pickle.loads(r[8:8 + n].tobytes())) for r, n in zip(rows, lengths)]


def _rng_as_bytes(state: dict) -> dict:
    """:func:`rng_state` with its tensors as bytes (for :func:`gather_rng_states`)."""
    plain = {**state, "numpy": {**state["numpy"], "keys": state["numpy"]["keys"].numpy()
                                .tobytes()}, "torch": state["torch"].numpy().tobytes()}
    if "cuda" in state:
        plain["cuda"] = [t.cpu().numpy().tobytes() for t in state["cuda"]]
    return plain


def _rng_from_bytes(plain: dict) -> dict:
    import torch

    def tensor(data: bytes, dtype):
        return torch.frombuffer(bytearray(data), dtype=dtype).clone()

    state = {**plain, "numpy": {**plain["numpy"], "keys": tensor(plain["numpy"]["keys"],
                                                                  torch.int64)},
             "torch": tensor(plain["torch"], torch.uint8)}
    if "cuda" in plain:
        state["cuda"] = [tensor(b, torch.uint8) for b in plain["cuda"]]
    return state


class RngStates:
    """Every rank's RNG states, gathered into rank 0's snapshot (the one written: it
    holds them all; another rank's holds None); each rank restores its own from the file,
    when the number of processes is the same."""

    def __init__(self, world, warn):
        self.world = world
        self.warn = warn

    def state_dict(self) -> dict:
        return {"ranks": gather_rng_states(), "world_size": self.world.world_size}

    def local_state_dict(self) -> dict:
        """Whose they are: the memory tier keeps this rank's states in its exchange
        row (engine/memory/rows.py), sent to its keepers off the step's path."""
        return {"world_size": self.world.world_size, "rank": self.world.rank}

    def load_state_dict(self, state_dict: dict) -> None:
        ranks = state_dict.get("ranks") or []
        saved_world = state_dict.get("world_size", len(ranks))
        if saved_world == self.world.world_size and self.world.rank < len(ranks):
            set_rng_state(ranks[self.world.rank])
        elif ranks:
            self.warn(f"the snapshot was written by {saved_world} processes, this run has "
                      f"{self.world.world_size}: RNG states are not restored, so the run "
                      "will not be bit-identical to an uninterrupted one (the data order "
                      "is: see docs/checkpoints.md, Changing the number of processes)")
