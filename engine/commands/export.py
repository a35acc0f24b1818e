"""``engine-run export RUN OUT [--which latest|best] [--part model|ema]``: a run's
trained weights in a file for inference (engine/model_io.py; docs/outputs.md).

    $ engine-run export runs/cifar_ddp model.safetensors --which best
    wrote model.safetensors: 10 tensors, model digest 0f3c..., sha256 9a1b... (from runs/cifar_ddp/checkpoints/snapshot-e0002-s00000314.pt)

RUN is a run's out_dir, its checkpoints folder, a pointer file or a snapshot of any
checkpointer. OUT ending in ``.safetensors`` is written in that format, anything else
with ``torch.save``; either way the plain model's keys, full tensors under fsdp.
"""

from __future__ import annotations

import argparse
import pathlib


def main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog="engine-run export",
        description="Write a run's trained model weights to a file (.safetensors or .pt) "
                    "for inference.")
    parser.add_argument("run", metavar="RUN",
                        help="a run's out_dir, its checkpoints folder or a snapshot")
    parser.add_argument("output", metavar="OUT",
                        help="the file to write: OUT.safetensors (safetensors) or OUT.pt")
    parser.add_argument("--which", choices=("latest", "best"), default=None,
                        help="the run's snapshot to export (default: latest; best: by "
                             "checkpoint.best_metric)")
    parser.add_argument("--part", choices=("model", "ema"), default="model",
                        help="the trained weights (model) or the ema plugin's average (ema)")
    args = parser.parse_args(argv)
    from engine.model_io import export, read, snapshot_of  # imports torch: not for --help

    ckpt = read(snapshot_of(args.run, args.which))
    print(f"{export(ckpt, pathlib.Path(args.output), args.part)} (from {ckpt.path})")
    return 0
