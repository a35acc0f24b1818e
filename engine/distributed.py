"""The process group: created with a finite timeout, errors that name the master.

Every wait here is bounded by ``cfg.timeout_s``: a rank that never joins, or dies,
makes the others fail with a message instead of hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib

from engine.errors import LaunchError
from engine.world import World, format_world_table


def init(world: World, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    if world.init_method == "env://":
        os.environ["MASTER_ADDR"] = world.master_addr
        os.environ["MASTER_PORT"] = str(world.master_port)
    elif world.init_method.startswith("file://"):
        prepare_file_rendezvous(world)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend=backend, init_method=world.init_url,
                                rank=world.rank, world_size=world.world_size,
                                timeout=timeout)
    except Exception as exc:
        where = (f"{world.master_addr}:{world.master_port}" if world.init_method == "env://"
                 else world.init_method)
        if world.is_rank0:
            print(format_world_table([world]), flush=True)
        raise LaunchError(
            f"rank {world.rank}: process group init via {where} failed within "
            f"{timeout_s:g}s ({type(exc).__name__}: {str(exc).splitlines()[0]}); check that "
            f"the master is reachable and all {world.world_size} ranks were started"
        ) from None


def prepare_file_rendezvous(world: World) -> None:
    """A file:// rendezvous file left by an earlier run makes the next one hang or fail.

    Rank 0 removes a stale file before init; the others wait a moment for that to happen
    by retrying inside torch's own rendezvous.
    """
    path = pathlib.Path(world.init_method[len("file://"):])
    if world.rank == 0 and path.exists():
        path.unlink()
        print(f"removed stale rendezvous file {path} left by an earlier run", flush=True)


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_initialized():
        import torch.distributed as dist

        dist.barrier()


@contextlib.contextmanager
def local_rank0_first(world: World):
    """Local rank 0 runs the body first (a download, say); the others run it after."""
    if not world.is_local_rank0:
        barrier()
    yield
    if world.is_local_rank0:
        barrier()


def all_reduce_sum(tensor):
    if is_initialized():
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj, src: int = 0):
    if not is_initialized():
        return obj
    import torch.distributed as dist

    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj) -> list:
    if not is_initialized():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def destroy() -> None:
    if is_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()
