"""Sharded state (a model that fully_shard split over the ranks, FSDP2): which modules
are, how their state goes through torch's state-dict helpers, a rank's own DTensor
shards as plain values (:func:`to_shards`) and back. FSDP and DTensor are looked up in
sys.modules (a run that never imported them has none); torch is imported inside the
functions that use it: the launching process imports this module (via engine.stateful).
"""

from __future__ import annotations

import sys

from engine.errors import CheckpointError


def is_sharded(module) -> bool:
    """True for a module that fully_shard split over the ranks."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def distributed_options(module, sharded: bool):
    """How a module's and its optimizer's state go through torch's ``get_state_dict``
    helpers, or None for their own ``state_dict()``:

    - ``sharded`` (a checkpointer that stores it, dcp): as they are, each rank its own
      shards (a DTensor's); the checkpointer writes and reshards them.
    - a model sharded by fully_shard, for a single-file checkpointer: the full state,
      gathered shard by shard onto rank 0's CPU (the other ranks get nothing), so the
      file is the plain model's; loading slices each rank's shards out of it."""
    if not (sharded or is_sharded(module)):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)


def _anywhere(tree, test) -> bool:
    """True when ``test`` holds for ``tree`` or for anything in it (nested dicts, lists
    and tuples), the containers themselves included."""
    if test(tree):
        return True
    if isinstance(tree, dict):
        return any(_anywhere(v, test) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_anywhere(v, test) for v in tree)
    return False


def holds_dtensor(tree) -> bool:
    """True when ``tree`` (nested dicts and lists) holds a DTensor: a sharded part's
    state, which a sharded checkpointer stores as shards."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and _anywhere(tree, lambda v: isinstance(v, dtensor.DTensor))


def holds_tensors(tree) -> bool:
    """True when ``tree`` (nested dicts and lists) holds a tensor of one dimension or more."""
    return _anywhere(tree, lambda v: getattr(v, "dim", lambda: 0)() > 0)


#: A DTensor's place in an in-memory snapshot (:func:`to_shards`): ``(SHARD, this
#: rank's local tensor, the global shape, the global stride, the placements as text)``,
#: plain values and a tensor, which the memory tier's restricted unpickler reads.
SHARD = "\x00engine-shard"


def to_shards(tree):
    """``tree`` (nested dicts and lists) with each DTensor replaced by this rank's own
    shard (:data:`SHARD`): no gather, no collective, no copy (the local tensor is the
    DTensor's own storage, which the memory snapshot copies)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return tree
    DTensor = dtensor.DTensor

    def local(value):
        if not isinstance(value, DTensor):
            return None
        # _local_tensor is what to_local() returns, without its autograd function.
        return (SHARD, value._local_tensor, tuple(value.shape), tuple(value.stride()),
                _placements_text(value.placements))

    return _replaced(tree, local)


def _replaced(tree, replace):
    """``tree`` (nested dicts, lists and tuples) with each value for which ``replace``
    gives something other than None replaced by that."""
    new = replace(tree)
    if new is not None:
        return new
    if isinstance(tree, dict):
        return type(tree)((k, _replaced(v, replace)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replaced(v, replace) for v in tree)
    return tree


def _placements_text(placements) -> str:
    """``S0,R`` for (Shard(0), Replicate()): plain text, which a memory snapshot holds."""
    text = []
    for placement in placements:
        if placement.is_shard():
            text.append(f"S{placement.dim}")
        elif placement.is_replicate():
            text.append("R")
        else:  # Partial: a pending reduction, never in a state dict
            raise ValueError(f"a DTensor placed as {placement} cannot be snapshot")
    return ",".join(text)


def is_shard(value) -> bool:
    return type(value) is tuple and len(value) == 5 and value[0] == SHARD


def holds_shards(tree) -> bool:
    """True when ``tree`` holds a shard of :func:`to_shards` (a memory snapshot's, fsdp)."""
    return _anywhere(tree, is_shard)


def mesh_of(module):
    """The device mesh a sharded module's parameters are spread over."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    for parameter in module.parameters():
        if dtensor is not None and isinstance(parameter, dtensor.DTensor):
            return parameter.device_mesh
    raise CheckpointError("the memory snapshot holds fsdp shards and this run's model is "
                          "not sharded: resume with --parallel fsdp, or from a disk "
                          "snapshot with --resume PATH")


def from_shards(tree, mesh):
    """:func:`to_shards` undone: each shard a DTensor over ``mesh`` again, with its
    saved shape, stride and placements (no collective: this rank's shard as it was)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def placement(text: str):
        return Replicate() if text == "R" else Shard(int(text[1:]))

    def build(value):
        if not is_shard(value):
            return None
        _, local, shape, stride, placements = value
        return DTensor.from_local(
            local.to(mesh.device_type), mesh, [placement(p) for p in placements.split(",")],
            run_check=False, shape=tuple(shape), stride=tuple(stride))

    return _replaced(tree, build)
