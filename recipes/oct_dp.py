"""OCT-A scans, binary classification, ResNet-18 with DataParallel: one process drives
every visible GPU (the seeds' "DP" column; DDP is faster, see oct_ddp.py).

    engine-run recipes/oct_dp.py data.root=data/oct --nproc 1

One process means one DataLoader for all GPUs: it needs the CPUs of the whole node
(``num_workers=auto`` gives it all but one). Data, augmentations and options:
oct_common.py.
"""

from __future__ import annotations

import attrs
from oct_common import OctConfig, build_model, build_oct_datasets, build_optimizer

from engine.classification import eval_step, train_step  # cross-entropy, accuracy

__all__ = ["Config", "build_model", "build_datasets", "build_optimizer"]


@attrs.define
class Config(OctConfig):
    out_dir: str = "runs/oct_dp"
    parallel: str = "dp"  # on a machine without GPUs it runs as a single device


def build_datasets(cfg: Config, ctx):
    return build_oct_datasets(cfg, ctx)
