"""Parallel mode ``dp``: ``nn.DataParallel`` over every GPU the process sees.

One process. Each step, DataParallel scatters the (global) batch over the visible GPUs
in equal chunks (the last one smaller when it does not divide), copies the model from
``cuda:0`` to the others, runs the replicas in threads, gathers the outputs on
``cuda:0``, where the loss is computed; backward sums the replicas' gradients into the
model on ``cuda:0``. The gradient is therefore that of the whole batch, exactly as
with ``single``.

Limits (torch's, see docs/parallel.md): the per-step model copy and Python threads make
it slower than ``ddp`` with one process per GPU; BatchNorm normalises each chunk with
its own statistics and only ``cuda:0``'s replica updates the running statistics.

On a machine without GPUs it runs as ``single`` on the CPU and says so once.

``compile.enabled=true`` over several GPUs is refused (see :meth:`DataParallel.check`):
DataParallel's per-step replicas would run the original module's compiled forward.
"""

from __future__ import annotations

import engine
from engine.errors import ConfigError
from engine.parallel import Parallel, require_single_process, visible_gpus

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


class DataParallel(Parallel):
    name = "dp"
    single_process = True
    #: ``auto``: after ddp, before single.
    priority = 20

    @classmethod
    def detect(cls, world) -> bool:
        """One process that sees several GPUs."""
        return world.world_size == 1 and visible_gpus() > 1

    @property
    def devices(self):
        import torch

        visible = visible_gpus()
        if not visible:
            return [torch.device("cpu")]
        return [torch.device("cuda", i) for i in range(visible)]

    def check(self):
        require_single_process(self)
        compiles = getattr(getattr(self.cfg, "compile", None), "enabled", False)
        if compiles and visible_gpus() > 1:
            # DataParallel's replicas share the original's __dict__, and with it the
            # compiled forward, which would run on the original's weights.
            raise ConfigError(
                "compile.enabled=true does not work with parallel mode 'dp': "
                "nn.DataParallel copies the model to every GPU each step and the copies "
                "would run the original's compiled forward; use --parallel ddp (one "
                "process per GPU) or compile.enabled=false")

    def setup_device(self):
        import torch

        if self.device.type == "cpu":
            self.warn("parallel mode 'dp' found no GPU: running as 'single' on the CPU")
            return
        torch.cuda.set_device(self.device)  # cuda:0 holds the model and gathers outputs
        per_gpu = self.cfg.batch_size // self.cfg.grad_accum_steps // len(self.devices)
        if per_gpu == 0:
            self.warn(f"batch_size {self.cfg.batch_size} gives fewer than one sample per "
                      f"micro-step to each of the {len(self.devices)} GPUs; some stay idle")

    def wrap(self, model):
        import torch

        if len(self.devices) < 2:
            return model  # DataParallel over one device would only add overhead
        return torch.nn.DataParallel(model, device_ids=[d.index for d in self.devices])

    def unwrap(self, model):
        import torch

        return model.module if isinstance(model, torch.nn.DataParallel) else model


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(DataParallel)
