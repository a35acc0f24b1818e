"""The copy plan: where each tensor goes in the payload, and the copies that put it there,
done again while the state holds the same tensors. What only the optimizer's step
changes may be left to the background thread (MemorySnapshots.hold)."""

from __future__ import annotations

import torch

from engine.memory.buffer import HEADER_BYTES, PAYLOAD
from engine.shm_codec import align, copier, marker

#: The bytes of the tensors only the optimizer's step changes from which the background
#: thread copies them (below, the thread's wake-up costs more than the copy: at once).
BACKGROUND_BYTES = 4 << 20


class Plan:
    """Where each tensor goes in the payload and the copies that put it there, reused while
    the state holds the same tensors (kept alive: none other at their addresses)."""

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
        return PAYLOAD.size + len(skeleton) <= self.data_at and (held is not None) == self.held

    def copies_into(self, index: int, buffer) -> tuple[list, list]:
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
    """The data pointers of what only ``optimizer``'s step changes (its parameters and
    state), which a save may copy before that step; the rest is copied at once."""
    def pointer(tensor) -> int:
        # A DTensor's (fsdp) data_ptr() is 0: its local tensor's memory is the snapshot's.
        return getattr(tensor, "_local_tensor", tensor).data_ptr()

    held = {pointer(p) for group in optimizer.param_groups for p in group["params"]}
    for state in optimizer.state.values():
        held.update(pointer(v) for v in state.values() if isinstance(v, torch.Tensor))
    return frozenset(held)
