"""Parallel mode ``ddp-multigpu``: each process drives k GPUs; data-parallel over
k x processes replicas.

Design: DDP across processes around nn.DataParallel inside each process::

    DistributedDataParallel(DataParallel(model, device_ids=[r*k .. r*k+k-1]),
                            device_ids=None)

In a step, the process's share of the batch is scattered over its k GPUs; DataParallel
copies the model from the first GPU to the others and runs the k replicas in threads;
the outputs are gathered on the first GPU, where the loss is computed. Backward goes
through DataParallel's broadcast, whose backward is a reduce-add: the k replicas'
gradients arrive summed in the parameters on the first GPU. DDP's hooks sit on exactly
those parameters, so DDP then averages the gradients over the processes as usual
(buckets, ``cfg.ddp`` options, ``no_sync`` for accumulation, communication hooks).
The result is the gradient of the mean loss over the global batch, as if k x P
replicas had each taken one chunk of it.

Why this one. DDP itself no longer replicates a module over several ``device_ids``
("device_ids can only be None or contain a single element"), and ``model.cuda()``
followed by ``DDP(model)`` silently trains on one GPU per process. Splitting the model
across the k GPUs (model parallel, DDP with ``device_ids=None``) would give P replicas,
not k x P, and needs every recipe to split its model. Writing our own gradient
reducer would duplicate DDP's bucketing, overlap and hooks. Nesting the two torch
wrappers keeps both well-trodden.

Limits (also in docs/parallel.md):

- Slower than ``ddp`` with one process per GPU (use that when you can start more
  processes): the model is copied to the k GPUs every step, the replicas run in Python
  threads, and all gradients become ready together at the end of backward, so DDP's
  all-reduce does not overlap the backward computation.
- BatchNorm normalises each GPU's chunk with that chunk's statistics, and only the
  first GPU's replica updates the running statistics; ``ddp.sync_batchnorm`` cannot
  work across threads of one process and is refused when k > 1.
- Validation runs the unwrapped model on the first GPU of each process.
- k: ``ddp.gpus_per_process`` (0 = automatic), otherwise the
  visible GPUs shared out evenly over the node's processes.
- On a machine without GPUs every process computes on the CPU with k = 1, where
  DataParallel is a pass-through: the nesting and the cross-process reduction are
  exercised, the in-process scatter/replicate/gather needs CUDA.
"""

from __future__ import annotations

import engine
from engine.errors import ConfigError
from engine.parallel import gpus_bound_by_launcher, visible_gpus
from engine.plugins.ddp import DistributedDataParallel

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


class MultiGPUDistributedDataParallel(DistributedDataParallel):
    name = "ddp-multigpu"
    # Never chosen by ``auto`` (it would inherit ddp's detect): asked for by name.
    detect = classmethod(lambda cls, world: False)
    idle_gpus_advice = ("start more processes (--nproc) or set ddp.gpus_per_process so "
                        "that processes x GPUs per process covers them")

    @property
    def gpus_per_process(self) -> int:
        visible = visible_gpus()
        if not visible:
            return 1
        wanted = self.options.gpus_per_process  # 0: automatic
        if wanted:
            return wanted
        local = self.world.local_world_size
        if visible >= local:
            return visible // local
        # Fewer GPUs than processes: only right when each process was given its own.
        return visible if gpus_bound_by_launcher(self.world) else 1

    def check(self):
        super().check()
        if self.options.sync_batchnorm and len(self.devices) > 1:
            raise ConfigError(
                f"ddp.sync_batchnorm=true does not work with parallel mode "
                f"'ddp-multigpu' at {len(self.devices)} GPUs per process (SyncBatchNorm "
                "needs one GPU per process); use --parallel ddp with one process per "
                "GPU, or ddp.sync_batchnorm=false"
            )

    def setup_device(self):
        super().setup_device()
        if self.device.type == "cuda":
            per_gpu = (self.cfg.batch_size // self.world.world_size
                       // self.cfg.grad_accum_steps // len(self.devices))
            if per_gpu == 0:
                self.warn(f"batch_size {self.cfg.batch_size} gives fewer than one sample "
                          f"per micro-step to each of the {len(self.devices)} GPUs of a "
                          "process; some stay idle")

    def wrap(self, model):
        import torch

        device_ids = [d.index for d in self.devices] if self.device.type == "cuda" else None
        local = torch.nn.DataParallel(model, device_ids=device_ids)
        if self.world.world_size == 1:
            self.warn("parallel mode 'ddp-multigpu' with one process: nothing to "
                      "synchronise across processes, DataParallel only (as 'dp')")
            return local
        # device_ids=None: the wrapped module spans several devices (or is on the CPU).
        return self.ddp(local, device_ids=None)

    def unwrap(self, model):
        import torch

        model = super().unwrap(model)
        return model.module if isinstance(model, torch.nn.DataParallel) else model


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(MultiGPUDistributedDataParallel)
