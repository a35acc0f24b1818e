"""A plugin for tests: ``-p tests.plugins.epoch_probe`` with ENGINE_EPOCH_PROBE=FILE
appends, on rank 0 at every engine_epoch_end, the hook's ``epoch`` argument,
``engine.state.epoch`` and ``engine.state.epochs_completed`` as a JSON line."""

from __future__ import annotations

import json
import os

import engine


@engine.hookimpl
def engine_epoch_end(ctx, epoch, metrics):
    if ctx.is_rank0:
        with open(os.environ["ENGINE_EPOCH_PROBE"], "a") as f:
            f.write(json.dumps({"epoch": epoch, "state.epoch": ctx.state.epoch,
                                "epochs_completed": ctx.state.epochs_completed}) + "\n")
