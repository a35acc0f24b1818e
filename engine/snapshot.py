"""What a snapshot holds, and resuming from one.

A snapshot is a dict of tensors and plain values (``torch.load(weights_only=True)``):
the unwrapped model, optimizer, scheduler, grad scaler, train state (epoch, step,
position inside the epoch), sampler seed, the RNG states of every rank, the resolved
config and the engine version.
"""

from __future__ import annotations

import pathlib
import random

import attrs

import engine
from engine import config as config_mod
from engine import distributed
from engine.checkpoint import load_model_state
from engine.errors import CheckpointError


def rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    # CPU tensors only (numpy's and torch's setters refuse others): checkpointers load
    # snapshots onto the CPU for this (Checkpointer.restore_snapshot).
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture(eng) -> dict:
    """The snapshot dict. Collective: every rank must call it (RNG states are gathered)."""
    rngs = distributed.all_gather_object(rng_state())
    state = eng.state
    return {
        "engine_version": engine.__version__,
        "model": eng.module.state_dict(),
        "optimizer": eng.optimizer.state_dict(),
        "scheduler": eng.scheduler.state_dict() if eng.scheduler is not None else None,
        "scaler": eng.scaler.state_dict() if eng.scaler is not None else None,
        "epoch": state.epoch,
        "step": state.step,
        "batch_in_epoch": state.batch_in_epoch,
        "epochs_completed": state.epochs_completed,
        "train_state": attrs.asdict(state),  # every field, those added later included
        "sampler_seed": eng.cfg.seed,
        "world_size": eng.world.world_size,
        "rng": rngs,
        "config": config_mod.to_dict(eng.cfg),
        "metrics": dict(eng.metrics),
    }


def save(eng) -> pathlib.Path | None:
    """Write a snapshot; rank 0 only unless the checkpointer shards over all ranks."""
    return eng.checkpointer.save_snapshot(eng, capture(eng), epoch=eng.state.epoch,
                                          step=eng.state.step, metrics=dict(eng.metrics))


def resume(eng) -> None:
    """Continue from the latest good snapshot, from ``--resume PATH``, or start fresh.

    Rank 0 decides which file (if any) and broadcasts the decision, so the ranks never
    disagree about whether there is something to resume.
    """
    opts = eng.options
    if opts.get("no_resume"):
        return
    chosen = None
    if eng.is_rank0 or eng.checkpointer.all_ranks:
        if opts.get("resume"):
            chosen = str(opts["resume"])
            if not pathlib.Path(chosen).exists():
                chosen = CheckpointError(f"--resume {chosen!r}: no such checkpoint")
        else:
            latest = eng.checkpointer.latest()
            chosen = str(latest) if latest is not None else None
    chosen = distributed.broadcast_object(chosen)
    if isinstance(chosen, CheckpointError):
        raise chosen
    if chosen is None:
        return
    eng.checkpointer.restore_snapshot(eng, pathlib.Path(chosen))
    s = eng.state
    where = f"epoch {s.epoch}, step {s.step}" + (
        f", batch {s.batch_in_epoch} of the epoch" if s.batch_in_epoch else "")
    restarts = (f" (restart {eng.world.restart_count})" if eng.world.restart_count else "")
    eng.print(f"resuming from {chosen}: {where}{restarts}")


def restore(eng, snap: dict, source: str) -> None:
    load_model_state(eng.module, snap["model"], source=source)
    try:
        eng.optimizer.load_state_dict(snap["optimizer"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{source}: optimizer state does not match: {exc}") from None
    if eng.scheduler is not None and snap.get("scheduler") is not None:
        eng.scheduler.load_state_dict(snap["scheduler"])
    if eng.scaler is not None and snap.get("scaler") is not None:
        eng.scaler.load_state_dict(snap["scaler"])
    s = eng.state
    # Fields a snapshot written before they existed lacks keep their defaults.
    for name, value in (snap.get("train_state") or {}).items():
        if hasattr(s, name):
            setattr(s, name, value)
    s.epoch = int(snap["epoch"])
    s.step = int(snap["step"])
    s.batch_in_epoch = int(snap.get("batch_in_epoch", 0))
    s.epochs_completed = int(snap.get("epochs_completed", s.epoch))
    eng.metrics.update(snap.get("metrics") or {})
    rngs = snap.get("rng") or []
    if snap.get("world_size") == eng.world.world_size and eng.world.rank < len(rngs):
        set_rng_state(rngs[eng.world.rank])
    elif rngs:
        eng.warn(f"{source} was written by {snap.get('world_size')} processes, this run has "
                 f"{eng.world.world_size}: RNG states are not restored, so the run will not "
                 "be bit-identical to an uninterrupted one")
