"""Plugin ``ddp-fp16``: the engine's DDP with gradients all-reduced in float16.

It builds on whatever the registry holds under ``ddp`` (the built-in, unless a plugin
replaced it), so it needs no import of the engine's internals. The weights stay float32
and equal on every rank; only the gradient exchange is compressed.
"""

from __future__ import annotations

import engine


@engine.hookimpl
def engine_register_parallel(registry):
    ddp = registry.get("ddp")

    class CompressedDDP(ddp):
        name = "ddp-fp16"

        def wrap(self, model):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            wrapped = super().wrap(model)
            wrapped.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
            return wrapped

    registry.add(CompressedDDP)
