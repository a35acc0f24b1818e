"""How a snapshot's state goes into shared memory and comes back: one codec for the
memory tier's buffers (engine/memory/) and the async checkpointer's
(plugins/async_file.py).

A state dict becomes a *skeleton*, the state pickled (in C) with a marker in each
tensor's place, and a *data region* that holds the tensors' bytes, each at an offset
aligned to :data:`ALIGN` (:func:`encode`). The copies into the data region are numpy
copies (:func:`copier`), which release the GIL during the memcpy and never wake torch's
thread pool. :func:`decode` unpickles a skeleton and builds each tensor where its
marker is read, so every container comes back as it was (an OrderedDict with its
``_metadata``, as torch.save writes it).

What each user does with it: the memory tier keeps the skeleton in the buffer ahead of
the data region and decodes only plain values (anyone could write into a tmpfs);
the async checkpointer sends the skeleton to its writer process through a pipe and
decodes it there as it was pickled, each tensor a view of the buffer with a storage of
its own (what torch.save writes as torch-file does).
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any, Callable

# torch and numpy are imported inside the functions that use them: the launching
# processes import this module (through engine.snapshot and the async plugin) without them.

#: Tensors start at multiples of this many bytes in the data region (any dtype's alignment).
ALIGN = 64


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _tensor(offset: int, dtype: str, shape: tuple):
    """A tensor's marker in a skeleton (pickled by reference): :func:`decode` puts the
    tensor there; nothing else may call it."""
    raise pickle.UnpicklingError("a tensor marker read outside engine.shm_codec.decode")


def _plain(data: bytes):
    """A :class:`Pickled` value in a skeleton: :func:`decode` unpickles it there."""
    raise pickle.UnpicklingError("a pickled value read outside engine.shm_codec.decode")


class Pickled:
    """A plain value pickled once, for a state to hold as it is (the config, the same at
    every snapshot, costs its pickle once); decoded in its place."""

    __slots__ = ("data",)

    def __init__(self, value):
        self.data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self):
        return _plain, (self.data,)


def marker(offset: int, tensor) -> tuple:
    """What the encoder pickles in the place of ``tensor`` at ``offset`` (a reduce
    value, made once per tensor by a plan that reuses it)."""
    return _tensor, (offset, str(tensor.dtype)[6:], tuple(tensor.shape))  # "torch."


@functools.cache
def _encoder_class():
    """A pickler that pickles a state as it is, in C, and puts a marker (:func:`marker`)
    where each tensor is (its bytes go into the data region). Only tensors and the few
    other objects that are not plain containers and numbers reach Python
    (``reducer_override``); a walk over the state in Python cost 70 us a snapshot of
    the CIFAR network's (issue 37). Given the previous snapshot's plan (``key``: each
    tensor's data pointer, dtype, shape and strides; ``markers``: (offset, marker, the
    next offset) of each), a tensor where the plan has the same one gets the plan's
    marker, made once."""
    import torch

    class Encoder(pickle.Pickler):
        def __init__(self, plan):
            self.file = io.BytesIO()
            super().__init__(self.file, protocol=pickle.HIGHEST_PROTOCOL)
            self.plan = plan
            self.same = plan is not None  # every tensor so far is the plan's
            self.tensors: list[tuple[int, Any]] = []  # (offset, tensor)
            self.key: list[tuple] = []  # where each tensor's bytes are, and their form
            self.size = 0

        def reducer_override(self, obj):
            if not isinstance(obj, torch.Tensor):
                return NotImplemented  # torch.Size, dtypes, OrderedDict: as pickle does
            tensor = obj.detach() if obj.requires_grad else obj
            if self.same:
                index = len(self.tensors)
                if index < len(self.plan.key):
                    ptr, dtype, shape, stride = self.plan.key[index]
                    if (tensor.data_ptr() == ptr and tensor.dtype == dtype
                            and tensor.shape == shape and tensor.stride() == stride):
                        offset, reduced, self.size = self.plan.markers[index]
                        self.tensors.append((offset, tensor))
                        return reduced
                self.same = False
                self.key = self.plan.key[:index]
            self.tensors.append((self.size, tensor))
            self.key.append((tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride()))
            reduced = marker(self.size, tensor)
            self.size = align(self.size + tensor.numel() * tensor.element_size())
            return reduced

    return Encoder


def encode(state, plan=None):
    """``state`` pickled with a marker in each tensor's place: (the skeleton, the
    tensors with their offsets in the data region, the data region's size, and None
    where ``plan`` holds these very tensors, else the key of a new plan: where each
    tensor's bytes are, and their form)."""
    encoder = _encoder_class()(plan)
    encoder.dump(state)
    same = encoder.same and len(encoder.tensors) == len(plan.key)
    if plan is not None and not same and encoder.same:  # the plan's, and more or fewer
        encoder.key = plan.key[:len(encoder.tensors)]
    return (encoder.file.getvalue(), encoder.tensors, encoder.size,
            None if same else encoder.key)


def copier(array, whole, at: int, tensor):
    """One copy of ``tensor`` to byte ``at`` of a buffer (``array``: its numpy uint8
    view; ``whole``: the same memory as a torch uint8 tensor), as a callable; None for
    a tensor without bytes. From the CPU by numpy's copyto, which releases the GIL
    during the memcpy: torch's copy_ hands a few hundred kB to its thread pool, whose
    wake-up cost milliseconds per copy on a busy machine (measured: 1.8 ms against 22
    us for 62,000 floats); from a GPU, copy_ (a device-to-host copy, not waited for:
    MemorySnapshots.save's finish waits for the stream)."""
    import numpy as np
    import torch

    n = tensor.numel() * tensor.element_size()
    if not n:
        return None
    if tensor.device.type == "cpu":
        try:
            source = tensor.numpy()
        except (TypeError, RuntimeError):  # bfloat16 and others numpy lacks
            source = (tensor.view(torch.uint8).numpy().reshape(-1)
                      if tensor.is_contiguous() else None)
        if source is not None:
            target = array[at:at + n].view(source.dtype).reshape(source.shape)
            return functools.partial(np.copyto, target, source)
    target = whole[at:at + n].view(tensor.dtype).view(tensor.shape)
    return functools.partial(target.copy_, tensor, non_blocking=True)


class PlainUnpickler(pickle.Unpickler):
    """Plain values only: the containers and numbers a state dict holds, torch's dtypes
    and sizes; anything else is refused, as torch.load(weights_only=True) refuses it in
    a file."""

    ALLOWED = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
               ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice")}

    def find_class(self, module, name):
        import torch

        if (module, name) in self.ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(__import__(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a memory snapshot")


def _decoder(base: type, tensor_at: Callable, plain: bool):
    import torch

    def tensor(offset, dtype, shape):
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"a tensor of unknown dtype {dtype!r}")
        return tensor_at(int(offset), kind, torch.Size(shape))

    def value(data):
        return (PlainUnpickler if plain else pickle.Unpickler)(io.BytesIO(data)).load()

    class Decoder(base):
        def find_class(self, module, name):
            if module == __name__ and name == "_tensor":
                return tensor
            if module == __name__ and name == "_plain":
                return value
            return super().find_class(module, name)

    return Decoder


def decode(skeleton: bytes, tensor_at: Callable, plain: bool = True):
    """The state :func:`encode` pickled into ``skeleton``, each tensor made where its
    marker is read by ``tensor_at(offset, dtype, shape)`` (a torch dtype and Size).
    ``plain``: only plain values (:class:`PlainUnpickler`: a buffer in a tmpfs, where
    anyone could have written); False: whatever was pickled (the trainer's own state,
    sent through a pipe)."""
    base = PlainUnpickler if plain else pickle.Unpickler
    return _decoder(base, tensor_at, plain)(io.BytesIO(skeleton)).load()
