"""A test plugin (``-p tiny_parallel_probe``, with tests/recipes on PYTHONPATH) that
records what the parallel mode did, from inside a real run.

At ``engine_run_start`` it notes the wrapper chain and the DDP settings and, when the
model is DDP-wrapped, registers a communication hook that counts the gradient
all-reduces (one call per bucket; bucket 0 once per reduction round). At
``engine_run_end`` every rank writes ``<out_dir>/probe-rank<R>.json`` and its final
unwrapped state_dict to ``<out_dir>/weights-rank<R>.pt``.
"""

from __future__ import annotations

import json
import pathlib

import engine

DDP_SETTINGS = ("bucket_bytes_cap", "gradient_as_bucket_view", "static_graph",
                "find_unused_parameters", "forward_sync_buffers")


def counting_allreduce(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state["buckets"] += 1
    if bucket.index() == 0:
        state["rounds"] += 1
    return allreduce_hook(None, bucket)


# One run per process, so module state is the run's state.
_record: dict = {}
_counts = {"buckets": 0, "rounds": 0}


@engine.hookimpl
def engine_run_start(ctx):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    chain, model = [], ctx.model
    while True:
        chain.append(type(model).__name__)
        if not hasattr(model, "module"):
            break
        model = model.module
    _record.update({
        "wrappers": chain,
        "devices": [str(d) for d in ctx.parallel.devices],
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "parameters_on": str(next(ctx.module.parameters()).device),
        "sync_batchnorm_layers": sum(type(m).__name__ == "SyncBatchNorm"
                                     for m in ctx.module.modules()),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "train_loader": {"pin_memory": ctx.train_loader.pin_memory,
                         "num_workers": ctx.train_loader.num_workers},
    })
    if isinstance(ctx.model, DDP):
        _record["ddp"] = {k: getattr(ctx.model, k) for k in DDP_SETTINGS}
        ctx.model.register_comm_hook(_counts, counting_allreduce)


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    # The rank-tally buffer right after each step, before anything at the epoch's end
    # could touch it (a host sync per step: fine in a test).
    buffers = dict(ctx.module.named_buffers())
    if "tally.tally" in buffers:
        _record["tally_after_last_step"] = buffers["tally.tally"].item()


@engine.hookimpl
def engine_run_end(ctx, summary):
    import torch

    out = pathlib.Path(ctx.cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = ctx.world.rank
    record = {**_record, **_counts, "steps": ctx.state.step, "status": summary["status"]}
    (out / f"probe-rank{rank}.json").write_text(json.dumps(record, indent=1))
    if ctx.model is not None:
        torch.save(ctx.module.state_dict(), out / f"weights-rank{rank}.pt")
