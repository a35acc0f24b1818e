"""engine/shm_codec.py: a state through the skeleton and data region and back, as the
memory tier and the async checkpointer use it."""

from __future__ import annotations

import collections
import os
import pickle

import pytest
import torch

from engine import shm_codec

Point = collections.namedtuple("Point", "x y")


def state_with_everything() -> dict:
    weights = collections.OrderedDict(w=torch.arange(6.0).reshape(2, 3),
                                      b=torch.zeros(3, dtype=torch.bfloat16))
    weights._metadata = collections.OrderedDict({"": {"version": 2}})  # as state_dict's
    return {
        "model": weights,
        "strided": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),
        "grad": torch.ones(2, requires_grad=True),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "plain": [1, 2.5, None, "x", b"y", (3, {4}), frozenset({5}), torch.Size([2, 2]),
                  torch.float16],
        "config": shm_codec.Pickled({"lr": 0.1, "layers": [1, 2]}),
    }


def encoded_and_decoded(state, plain=True):
    skeleton, tensors, size, key = shm_codec.encode(state)
    buffer = torch.zeros(size, dtype=torch.uint8)
    array = buffer.numpy()
    for offset, tensor in tensors:
        assert offset % shm_codec.ALIGN == 0
        copy = shm_codec.copier(array, buffer, offset, tensor)
        if copy is not None:
            copy()

    def tensor_at(offset, dtype, shape):
        n = shape.numel() * dtype.itemsize
        return buffer[offset:offset + n].view(dtype).view(shape).clone()

    return shm_codec.decode(skeleton, tensor_at, plain=plain), key


def test_a_state_comes_back_with_its_containers_and_every_tensor_bit_for_bit():
    state = state_with_everything()
    back, key = encoded_and_decoded(state)
    # The containers as they were: torch.save and load_state_dict read _metadata.
    assert type(back["model"]) is collections.OrderedDict
    assert back["model"]._metadata == {"": {"version": 2}}
    assert back["plain"] == [1, 2.5, None, "x", b"y", (3, {4}), frozenset({5}),
                             torch.Size([2, 2]), torch.float16]
    assert back["config"] == {"lr": 0.1, "layers": [1, 2]}
    for name, want in [("strided", state["strided"]), ("grad", state["grad"].detach()),
                       ("empty", state["empty"]), ("scalar", state["scalar"]),
                       ("w", state["model"]["w"]), ("b", state["model"]["b"])]:
        got = back[name] if name not in ("w", "b") else back["model"][name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), name
    assert len(key) == 6  # every tensor's place, for a plan to reuse


def test_a_trusted_skeleton_keeps_any_picklable_value_a_plain_one_refuses_it():
    state = {"point": Point(1, torch.ones(2))}
    back, _ = encoded_and_decoded(state, plain=False)  # the async checkpointer's
    assert type(back["point"]) is Point and torch.equal(back["point"].y, torch.ones(2))
    with pytest.raises(pickle.UnpicklingError,
                       match="test_shm_codec.Point is not allowed in a memory snapshot"):
        encoded_and_decoded(state)  # a tmpfs buffer's: plain values only


class Planted:
    def __reduce__(self):
        return os.system, ("true",)


def test_a_planted_skeleton_cannot_call_anything():
    skeleton = pickle.dumps({"x": Planted()})
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed"):
        shm_codec.decode(skeleton, lambda *a: None)


def test_a_marker_outside_decode_is_an_error_not_a_silent_tuple():
    skeleton, _, _, _ = shm_codec.encode({"w": torch.ones(2)})
    with pytest.raises(pickle.UnpicklingError, match="outside engine.shm_codec.decode"):
        pickle.loads(skeleton)
