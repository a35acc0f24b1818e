"""A plugin that makes snapshots large, for tests and attack loops of the in-memory
snapshots: ``-p tests.ballast_plugin`` with ENGINE_BALLAST_MB (default 32) registers a
snapshot part "ballast" of that many MB of float32, every element the step the
snapshot was taken at (ENGINE_BALLAST_GROW_AT=S: from step S on, twice that size: a
state that grows, for the memory tier's no-room path; ENGINE_BALLAST_GROW_RANK=R: on
rank R alone, the others' stay as they were). Its memory snapshots then take a large share of a step (32 MB
per rank on tiny_resume, 2 processes: about half the training loop's time here, by
``engine-run -v``'s phases), so that kills land in the copy; and a resume checks that
the part it got is whole: every element the step it says (a torn or mixed snapshot
raises, naming the steps).

ENGINE_BALLAST_SLOW=R:S: on rank R, each snapshot of the part takes S seconds more (a
snapshot that costs more on one rank than on the others: memory_every_steps=auto's
ranks must agree on one interval). ENGINE_BALLAST_RECORD=FOLDER: each rank writes the
steps its snapshots of the part were taken at (steps-r<rank>, one a line) and, at the
run's end, its summary.json's memory_snapshots as it measured them (memory-r<rank>.json).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import engine


class Ballast:
    def __init__(self, ctx, megabytes: float, grow_at: int = 0, slow_s: float = 0.0,
                 record: pathlib.Path | None = None):
        import torch

        self.ctx = ctx
        self.tensor = torch.empty(int(megabytes * 2**20) // 4, dtype=torch.float32)
        self.grow_at = grow_at  # 0: never
        self.slow_s = slow_s
        self.record = record

    def state_dict(self) -> dict:
        import torch

        step = self.ctx.state.step
        if self.record is not None:
            with open(self.record / f"steps-r{self.ctx.world.rank}", "a") as f:
                f.write(f"{step}\n")
        time.sleep(self.slow_s)  # the snapshot's cost on this rank, not a wait for anything
        if self.grow_at and step >= self.grow_at:
            self.tensor = torch.empty(self.tensor.numel() * 2, dtype=torch.float32)
            self.grow_at = 0  # once
        self.tensor.fill_(float(step))
        return {"step": step, "tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        import torch

        tensor, step = state["tensor"], state["step"]
        whole = torch.equal(tensor, torch.full_like(tensor, float(step)))
        if not whole:
            steps = sorted(set(tensor.unique().tolist()))[:5]
            raise RuntimeError(f"ballast: a snapshot of step {step} holds the values of "
                               f"steps {steps}: torn or mixed")


@engine.hookimpl
def engine_register_state(ctx, parts):
    grow_at = int(os.environ.get("ENGINE_BALLAST_GROW_AT", "0"))
    rank = os.environ.get("ENGINE_BALLAST_GROW_RANK")
    if rank is not None and int(rank) != ctx.world.rank:
        grow_at = 0
    slow_rank, _, slow_s = os.environ.get("ENGINE_BALLAST_SLOW", ":").partition(":")
    record = os.environ.get("ENGINE_BALLAST_RECORD")
    parts.add("ballast", Ballast(
        ctx, float(os.environ.get("ENGINE_BALLAST_MB", "32")), grow_at,
        slow_s=float(slow_s) if slow_rank == str(ctx.world.rank) else 0.0,
        record=pathlib.Path(record) if record else None))


@engine.hookimpl
def engine_run_end(ctx, summary):
    record = os.environ.get("ENGINE_BALLAST_RECORD")
    if record:
        (pathlib.Path(record) / f"memory-r{ctx.world.rank}.json").write_text(
            json.dumps(ctx.memory_record))
