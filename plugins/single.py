"""Parallel mode ``single``: one process, one device (the first CUDA device, else CPU)."""

from __future__ import annotations

import engine
from engine.parallel import Parallel, require_single_process


class SingleDevice(Parallel):
    name = "single"

    @property
    def devices(self):
        import torch

        return [torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")]

    def check(self):
        require_single_process(self)


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add("single", SingleDevice)
