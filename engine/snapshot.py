"""Snapshots: capturing the training state, saving it, and resuming from one.

A snapshot is a dict of tensors and plain values (``torch.load(weights_only=True)``):
the unwrapped model, optimizer, scheduler, grad scaler, train state (epoch, step,
position inside the epoch, per rank and as a global sample position), sampler seed,
the epoch's partial loss sums, the RNG states of every rank, the resolved config and
the engine version. This module is the only one that knows the Engine's
side of it; the checkpointer (:class:`engine.checkpoint.Checkpointer`) only stores
the dict and gives it back.
"""

from __future__ import annotations

import pathlib
import random

import attrs

import engine
from engine import config as config_mod
from engine import data, distributed
from engine.checkpoint import load_model_state
from engine.errors import CheckpointError, ConfigError

#: Config keys a resumed run may change: they decide how long the run goes and how it
#: is launched, watched and stored, not what an optimizer step computes, so the run
#: stays the one the snapshot belongs to. Any OTHER key that differs refuses the resume
#: (unless --resume-anyway), notably: batch_size and grad_accum_steps (the batches and
#: their split over processes and micro-steps; the global batch also keeps the epoch's
#: sample position a whole number of micro-steps at any number of processes), seed,
#: drop_last and per_sample_seed (the data order and the augmentation
#: randomness), precision and scheduler_interval, ddp.sync_batchnorm and
#: ddp.broadcast_buffers (the arithmetic), and a recipe's own keys (data, model): the
#: engine cannot judge those, and refusing is the side that never mixes two runs
#: silently. ``lr`` has its own rule (:func:`_apply_lr`). The world size is not a config
#: key: a different one continues the epoch's data order at its global sample position
#: (:func:`_place_in_epoch`), with a warning (the RNG states cannot be restored).
#: A config group (the engine's or a plugin's) says which of its keys may change in the
#: class attribute ``RESUME_SAFE`` (:func:`engine.config.resume_safe`), so the core
#: names none of a plugin's keys.
MAY_CHANGE = frozenset({
    "epochs", "log_every", "num_workers", "timeout_s", "out_dir", "launcher", "init_method",
    "parallel", "checkpointer", "preemption", "requeue", "deterministic", "on_nonfinite",
})


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
    # CPU tensors only (numpy's and torch's setters refuse others): snapshots are loaded
    # onto the CPU for this (load_snapshot).
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture(eng) -> dict:
    """The snapshot dict. Collective: every rank must call it (RNG states are gathered)."""
    rngs = distributed.all_gather_object(rng_state())
    state = eng.state
    loader = getattr(eng, "train_loader", None)  # Context: its first training loader
    trainer = getattr(eng, "trainer", None)
    model, optimizer = _model_and_optimizer_state(eng)
    return {
        "engine_version": engine.__version__,
        "model": model,
        "optimizer": optimizer,
        "scheduler": eng.scheduler.state_dict() if eng.scheduler is not None else None,
        "scaler": eng.scaler.state_dict() if eng.scaler is not None else None,
        "epoch": state.epoch,
        "step": state.step,
        "batch_in_epoch": state.batch_in_epoch,
        # Where the epoch stands whatever the number of processes: samples consumed by
        # all ranks together in the (seed, epoch) order (engine/data.py).
        "samples_in_epoch": None if loader is None else data.samples_consumed(
            state.batch_in_epoch, loader.batch_size, eng.world.world_size,
            len(loader.dataset)),
        # The epoch's training loss so far, so a resumed epoch reports the whole epoch's.
        "epoch_loss": None if trainer is None else trainer.epoch_loss_so_far(),
        "epochs_completed": state.epochs_completed,
        "train_state": attrs.asdict(state),  # every field, those added later included
        "sampler_seed": eng.cfg.seed,
        "world_size": eng.world.world_size,
        "rng": rngs,
        "config": config_mod.to_dict(eng.cfg),
        "metrics": dict(eng.metrics),
    }


def _model_and_optimizer_state(eng) -> tuple[dict, dict]:
    """In the form the checkpointer stores (Checkpointer.distributed_state_dict): a
    sharded format gets get_state_dict's, keyed by parameter name, shards unmerged."""
    if eng.checkpointer.distributed_state_dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(eng.module, eng.optimizer)
    return eng.module.state_dict(), eng.optimizer.state_dict()


def save(eng) -> pathlib.Path | None:
    """Write a snapshot; rank 0 only unless the checkpointer shards over all ranks.
    Collective (capture). Returns the path on the ranks that saved."""
    state = capture(eng)
    if not (eng.checkpointer.all_ranks or eng.is_rank0):
        return None
    return eng.checkpointer.save(state, epoch=eng.state.epoch, step=eng.state.step,
                                 metrics=dict(eng.metrics))


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
            chosen = _checked_resume_path(eng, str(opts["resume"]))
        else:
            latest = eng.checkpointer.latest()
            chosen = str(latest) if latest is not None else None
            if chosen is None and eng.is_rank0:
                _say_when_every_snapshot_is_unusable(eng)
    chosen = distributed.broadcast_object(chosen)
    if isinstance(chosen, CheckpointError):
        raise chosen
    if chosen is None:
        return
    restore(eng, load_snapshot(eng, pathlib.Path(chosen)), source=chosen)
    # The summary reports it; setattr, as Engine and api.Context both come through here.
    setattr(eng, "resumed_from", chosen)
    s = eng.state
    where = f"epoch {s.epoch}, step {s.step}" + (
        f", batch {s.batch_in_epoch} of the epoch" if s.batch_in_epoch else "")
    restarts = (f" (restart {eng.world.restart_count})" if eng.world.restart_count else "")
    eng.print(f"resuming from {chosen}: {where}{restarts}")


def _checked_resume_path(eng, chosen: str) -> str | CheckpointError:
    """``--resume PATH`` as given, once the checkpointer's own check (its manifest's
    size and checksum) passes: a bit-flipped snapshot loaded without a word before, and
    training went on from damaged weights. Rank 0 decides; the others get its answer.
    No way around it: the checkpointer's load refuses a damaged file too."""
    chosen = resume_target(chosen)
    if not pathlib.Path(chosen).exists():
        return CheckpointError(f"--resume {chosen!r}: no such snapshot")
    problem = eng.checkpointer.verify(pathlib.Path(chosen)) if eng.is_rank0 else None
    if problem is None:
        return chosen
    return CheckpointError(f"--resume {chosen!r}: the snapshot fails its check ({problem}); "
                           "resume from another snapshot")


#: The pointer files a checkpoint folder keeps (plugins/torch_file.py): each holds the
#: name of a snapshot in the same folder.
POINTERS = ("latest", "best")


def resume_target(given: str) -> str:
    """What ``--resume`` names: a snapshot; or a pointer file (``checkpoints/latest``,
    ``checkpoints/best``), or a checkpoint folder or a run folder holding ``latest``,
    taken as the snapshot the pointer names (a user copies the path they see)."""
    path = pathlib.Path(given)
    for pointer in (path, path / "latest", path / "checkpoints" / "latest"):
        if pointer.name in POINTERS and pointer.is_file():
            try:
                name = pointer.read_text().strip()
            except (OSError, UnicodeDecodeError):
                return given  # not a pointer after all: checked as a snapshot
            if name and "/" not in name:
                return str(pointer.parent / name)
    return given


def _say_when_every_snapshot_is_unusable(eng) -> None:
    """No good snapshot among those in the checkpoint folder (each was reported as
    unusable): the run starts over, and says so in one line rather than leaving it to
    be inferred from the warnings. Not refused: a run killed during its first save
    leaves a snapshot without its manifest, and must start again by itself."""
    found = getattr(eng.checkpointer, "snapshots", lambda: [])()
    if found:
        eng.warn(f"none of the {len(found)} snapshot(s) in {eng.checkpointer.directory} is "
                 "usable (see above): training restarts from step 0")


def load_snapshot(eng, path: pathlib.Path) -> dict:
    """The snapshot at ``path``, through the checkpointer; nothing is changed yet."""
    if eng.checkpointer.distributed_state_dict:
        # A sharded format loads in place: this model's and optimizer's own state dicts
        # say what to read and where (get_state_dict creates the optimizer state if it
        # has none yet).
        model, optimizer = _model_and_optimizer_state(eng)
        return eng.checkpointer.load(path, template={"model": model, "optimizer": optimizer})
    # Onto the CPU: load_state_dict copies into the model's and optimizer's devices,
    # and the RNG states must stay CPU tensors (a GPU resume crashed restoring them).
    return eng.checkpointer.load(path, map_location="cpu")


def restore(eng, snap: dict, source: str) -> None:
    """Put ``snap`` (from :func:`load_snapshot`) into the model, optimizer, scheduler,
    scaler, train state and RNGs, after checking its config against this run's."""
    lr_change = check_config(eng, snap.get("config"), source)
    if eng.checkpointer.distributed_state_dict:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(eng.module, eng.optimizer, model_state_dict=snap["model"],
                       optim_state_dict=snap["optimizer"])
    else:
        load_model_state(eng.module, snap["model"], source=source)
        try:
            eng.optimizer.load_state_dict(snap["optimizer"])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{source}: optimizer state does not match: {exc}"
                                  ) from None
    if lr_change is not None:
        _apply_lr(eng, *lr_change, source)
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
    # The Trainer adds them to the resumed epoch's loss (LogWindow.add_resumed).
    setattr(eng, "resumed_epoch_loss", snap.get("epoch_loss"))
    same_world = snap.get("world_size") == eng.world.world_size
    if not same_world:
        _place_in_epoch(eng, snap, source)
    rngs = snap.get("rng") or []
    if same_world and eng.world.rank < len(rngs):
        set_rng_state(rngs[eng.world.rank])
    elif rngs:
        eng.warn(f"{source} was written by {snap.get('world_size')} processes, this run has "
                 f"{eng.world.world_size}: RNG states are not restored, so the run will not "
                 "be bit-identical to an uninterrupted one (the data order is: see "
                 "docs/checkpoints.md, Changing the number of processes)")


def _place_in_epoch(eng, snap: dict, source: str) -> None:
    """Another number of processes: the batches per rank that bring this run to the
    snapshot's global sample position, so the rest of the epoch's order is split over
    the new ranks and every sample is still seen once. With the global batch unchanged
    that is the saved count, but for the epoch's end (the last batches are short) and a
    library loop's loader (its batch size is the loop's, not a config key): there it
    differs, or cannot be reached and the resume is refused. A snapshot written before
    the position was recorded keeps its count (right when the global batch is the same)."""
    s = eng.state
    position = snap.get("samples_in_epoch")
    if not s.batch_in_epoch or position is None:
        return  # at an epoch boundary, or an older snapshot
    loader = getattr(eng, "train_loader", None)
    if loader is None:
        raise ConfigError(
            f"{source} stopped mid-epoch with {snap.get('world_size')} processes; to resume "
            f"it with {eng.world.world_size}, create the training loader (ctx.loader) "
            "before ctx.epochs() or ctx.resume()")
    s.batch_in_epoch = data.batches_at(int(position), loader.batch_size,
                                       eng.world.world_size, len(loader.dataset))


# ------------------------------------------------------------ a changed config


def may_change(key: str, cfg) -> bool:
    return key in MAY_CHANGE or config_mod.resume_safe(cfg, key)


def config_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{key: (saved value, current value)}`` for the keys both configs have and that
    differ. A key only one of them has (a snapshot from an older engine or recipe) is no
    change: there is nothing to compare it with."""
    old, new = config_mod.flatten(saved), config_mod.flatten(current)
    return {k: (old[k], new[k]) for k in old.keys() & new.keys() if old[k] != new[k]}


def check_config(eng, saved: dict | None, source: str) -> tuple | None:
    """Refuse a resume whose config changed a key that breaks exact resume (see
    :data:`MAY_CHANGE`), or load it anyway with ``--resume-anyway`` and say what
    changed. Returns ``(old lr, new lr)`` when the learning rate is to be applied."""
    if not isinstance(saved, dict):
        return None  # written before snapshots held their config
    changes = config_changes(saved, config_mod.to_dict(eng.cfg))
    lr = changes.pop("lr", None)
    # With a scheduler the learning rate is the scheduler's (its state holds the base
    # lrs it scales): a new cfg.lr could only be mixed into it, so it counts as a change
    # that breaks the resume. Without one, the new lr is applied (_apply_lr).
    if lr is not None and eng.scheduler is not None:
        changes["lr"], lr = lr, None
    refused = {k: v for k, v in sorted(changes.items()) if not may_change(k, eng.cfg)}
    if refused:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in refused.items())
        if not eng.options.get("resume_anyway"):
            raise ConfigError(
                f"cannot resume {source}: the config changed {listed}, which would mix two "
                "runs; put the values back, pass --resume-anyway to load the snapshot "
                "with the new values, or --no-resume --overwrite to start fresh")
        eng.warn(f"--resume-anyway: resuming {source} although the config changed "
                 f"{listed}; the run is no longer an exact continuation"
                 + ("; the learning rate stays the scheduler's" if "lr" in refused else ""))
    return lr


def _apply_lr(eng, old: float, new: float, source: str) -> None:
    """Set a changed ``lr`` on the loaded optimizer, which would otherwise keep the
    snapshot's while config.json says the new one. A param group at another lr (a
    recipe's per-group multiple of cfg.lr) is scaled by new/old, keeping the ratio."""
    for group in eng.optimizer.param_groups:
        if group["lr"] == old or not old:
            group["lr"] = new
        else:
            group["lr"] = group["lr"] * new / old
    eng.warn(f"lr changed since {source}: {old!r} -> {new!r}, applied to every optimizer "
             "param group")
