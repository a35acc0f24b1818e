"""Parallel mode ``single``: one process, one device (the first visible GPU, else CPU).

With several GPUs visible it still uses only ``cuda:0`` and says so loudly: ``dp``
(one process, every GPU) or ``ddp`` (one process per GPU) would use them all.
"""

from __future__ import annotations

import engine
from engine.parallel import Parallel, require_single_process, visible_gpus

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


class SingleDevice(Parallel):
    name = "single"
    single_process = True
    priority = 1000  # ``auto``'s fallback: nothing else claimed the process

    @classmethod
    def detect(cls, world) -> bool:
        return True

    @property
    def devices(self):
        import torch

        return [torch.device("cuda", 0) if visible_gpus() else torch.device("cpu")]

    def check(self):
        require_single_process(self)

    def setup_device(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.warn_idle_gpus(1, "use --parallel ddp (one process per GPU, the fastest) "
                                   "or --parallel dp")


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(SingleDevice)
