"""A plugin with a state part that implements only the declared protocols
(engine.stateful's Stateful and LocalStateful), as a third-party sharded part would:
``-p tests.engine.memory.rank_part``. Each rank counts its own (``rank + 1`` per
optimizer step: the ranks' values differ), its ``state_dict()`` gathers every rank's
(a collective) and its ``local_state_dict()`` is this rank's alone. At the run's end
each rank writes its value and how often it was gathered to
``<out_dir>/rank_part-rank<R>.json``."""

from __future__ import annotations

import json

import torch.distributed as dist

import engine


class RankPart:
    def __init__(self, rank: int):
        self.rank = rank
        self.value = 0
        self.gathers = 0  # state_dict() calls: a collective each

    def state_dict(self) -> dict:
        self.gathers += 1
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, self.value)
        return {"values": values}

    def local_state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"] if "value" in state else state["values"][self.rank]


_part: RankPart | None = None


@engine.hookimpl
def engine_register_state(ctx, parts):
    global _part
    _part = RankPart(ctx.world.rank)
    parts.add("rank_part", _part)


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    _part.value += ctx.world.rank + 1


@engine.hookimpl
def engine_run_end(ctx, summary):
    (ctx.out_dir / f"rank_part-rank{ctx.world.rank}.json").write_text(
        json.dumps({"value": _part.value, "gathers": _part.gathers}))
