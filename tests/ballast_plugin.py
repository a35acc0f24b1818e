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
"""

from __future__ import annotations

import os

import engine


class Ballast:
    def __init__(self, ctx, megabytes: float, grow_at: int = 0):
        import torch

        self.ctx = ctx
        self.tensor = torch.empty(int(megabytes * 2**20) // 4, dtype=torch.float32)
        self.grow_at = grow_at  # 0: never

    def state_dict(self) -> dict:
        import torch

        step = self.ctx.state.step
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
    parts.add("ballast", Ballast(ctx, float(os.environ.get("ENGINE_BALLAST_MB", "32")),
                                 grow_at))
