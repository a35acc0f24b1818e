"""Parallel mode ``ddp``: DistributedDataParallel, one device per process.

On CUDA, local rank i drives GPU i of the visible ones (NCCL); on a CPU-only machine
every process computes on the CPU (gloo). The options come from ``cfg.ddp``.
"""

from __future__ import annotations

import inspect

import engine
from engine.errors import ConfigError
from engine.parallel import Parallel

UNUSED_PARAMETERS_MARKERS = (
    "Expected to have finished reduction in the prior iteration",
    "find_unused_parameters",
)


class DistributedDataParallel(Parallel):
    name = "ddp"

    @property
    def devices(self):
        import torch

        if torch.cuda.is_available():
            return [torch.device("cuda", self.world.local_rank)]
        return [torch.device("cpu")]

    @property
    def backend(self):
        return "nccl" if self.device.type == "cuda" else "gloo"

    def check(self):
        import torch

        visible = torch.cuda.device_count()
        if visible and self.world.local_world_size > visible:
            raise ConfigError(
                f"parallel mode 'ddp' needs one GPU per local process: "
                f"{self.world.local_world_size} processes on this node but {visible} "
                "visible GPUs (CUDA_VISIBLE_DEVICES); start fewer processes with --nproc"
            )

    def setup_device(self):
        import torch

        if self.device.type == "cuda":
            # Before the process group: NCCL binds each rank to the current device.
            torch.cuda.set_device(self.device)

    def wrap(self, model):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        opts = self.cfg.ddp
        if opts.sync_batchnorm:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        extra = {}
        if not opts.broadcast_buffers:
            # Newer torch renamed the option and warns on the old name.
            name = ("forward_sync_buffers" if "forward_sync_buffers" in
                    inspect.signature(DDP.__init__).parameters else "broadcast_buffers")
            extra[name] = False
        return DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            **extra,
        )

    def unwrap(self, model):
        return getattr(model, "module", model)

    def no_sync(self, model):
        return model.no_sync()

    def explain(self, exc):
        text = str(exc)
        if any(marker in text for marker in UNUSED_PARAMETERS_MARKERS):
            return ("some parameters received no gradient in the last step; if the model "
                    "really leaves parameters unused, set ddp.find_unused_parameters=true")
        return None


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add("ddp", DistributedDataParallel)
