"""OCT-A scans, binary classification, ResNet-18 with DistributedDataParallel.

    python tools/make_oct_dataset.py data/oct                  # a synthetic example
    engine-run recipes/oct_ddp.py data.root=data/oct           # DDP on what the machine has
    engine-run recipes/oct_ddp.py data.root=/data/octa data.balance=true epochs=30

The seeds' OCT-A job: grayscale scans in train/ and val/ class folders (PNG, TIFF or
JPEG, 8- or 16-bit), global batch 12, one process per GPU. Their time went from
55,000 s to 1,700 s by giving the job CPUs and the DataLoader workers to use them:
``num_workers=auto`` (the default here) chooses from the CPUs each process may use
(see the plan with --dry-run), and ``engine-run tune-workers recipes/oct_ddp.py
data.root=...`` measures the choices. Data, augmentations and options: oct_common.py.
"""

from __future__ import annotations

import attrs
from oct_common import OctConfig, build_model, build_oct_datasets, build_optimizer

from engine.classification import eval_step, train_step  # cross-entropy, accuracy

__all__ = ["Config", "build_model", "build_datasets", "build_optimizer"]


@attrs.define
class Config(OctConfig):
    out_dir: str = "runs/oct_ddp"
    parallel: str = "auto"  # ddp with several processes (one per GPU, or 2 on a CPU)


def build_datasets(cfg: Config, ctx):
    return build_oct_datasets(cfg, ctx)
