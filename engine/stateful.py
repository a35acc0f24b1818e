"""Stateful parts: everything an exact resume needs, each behind ``state_dict()`` and
``load_state_dict()`` (torch.distributed.checkpoint's ``Stateful``; a module, an
optimizer, a scheduler, a GradScaler already are parts). A snapshot is the walk over a
run's registered parts (:class:`SnapshotParts`) plus a small header, a resume the walk
back: no module reaches into another's attributes. The core registers, in this order::

    model       the unwrapped module (a sharded checkpointer gets the sharded form)
    optimizer
    scheduler   when there is one
    scaler      when there is one (fp16)
    progress    the loop's: epoch, step, early-stopping count (under engine-run the
                Trainer, which adds the epoch's partial loss sums)
    loader      where the epoch stands: the batches consumed per rank and the global
                sample position, at which another number of processes resumes
    metrics     the latest reduced values (what the summary reports after a resume)
    ...         the recipe's ``state_parts(cfg, ctx)`` and the plugins'
                ``engine_register_state(engine, parts)``
    rng         every rank's RNG states (gathered: a collective; engine/rng.py)

A part's ``state_dict`` may be a collective (rng, progress): every rank walks the parts
in the same order. Under a sharded checkpointer (dcp) a part whose state holds DTensors
is written as shards, and one whose ``sharded`` attribute is true is loaded in place
into its own ``state_dict()`` (model, optimizer, the ema plugin's average under fsdp).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Protocol, runtime_checkable

import attrs

from engine.errors import CheckpointError, ConfigError, EngineError, first_line
from engine.shards import (distributed_options, from_shards, holds_shards, holds_tensors,
                           is_sharded, mesh_of, to_shards)

# torch is imported inside the functions that use it: engine.checkpoint imports this module.

#: Snapshot keys that are the header, not parts: a part may not take these names.
HEADER = frozenset({"engine_version", "config", "recipe", "world_size", "threads", "epoch",
                    "step", "batch_in_epoch", "epochs_completed"})


@runtime_checkable
class Stateful(Protocol):
    """What a part is (torch.distributed.checkpoint.stateful.Stateful's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class LocalStateful(Protocol):
    """A part that also gives this rank's own state without a collective: what an
    in-memory snapshot holds (engine/memory/); ``load_state_dict`` takes it back. A
    part without it gives ``state_dict()`` there: no collective, no DTensor then."""

    def local_state_dict(self) -> dict[str, Any]: ...


class SnapshotParts:
    """The parts of one run, by name, in registration order (the order of the walk)."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}
        self._owners: dict[str, str] = {}
        #: Who adds parts now (a plugin, "the recipe"): named when two owners take one name.
        self.current_owner = "the engine"

    def add(self, name: str, part: Stateful) -> None:
        """Register ``part`` under ``name``; its state goes into every snapshot under
        that key and comes back into it on resume."""
        owner = self.current_owner
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{owner} adds a state part named {name!r}; a part's name is a "
                              "Python identifier, e.g. 'ema'")
        if name in HEADER:
            raise ConfigError(f"{owner} adds a state part named {name!r}, which snapshots use "
                              f"for their header; choose another name")
        if name in self._parts:
            raise ConfigError(f"state part {name!r} is added twice: by {self._owners[name]} "
                              f"and by {owner}; each part needs its own name")
        if not isinstance(part, Stateful):
            raise ConfigError(f"{owner} adds state part {name!r} as {type(part).__name__}, "
                              "which has no state_dict() and load_state_dict(state_dict)")
        self._parts[name] = part
        self._owners[name] = owner

    def names(self) -> list[str]:
        return list(self._parts)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def __getitem__(self, name: str) -> Stateful:
        return self._parts[name]

    def state_dict(self) -> dict[str, Any]:
        """``{name: part.state_dict()}``. Collective: every rank calls it."""
        return {name: part.state_dict() for name, part in self._parts.items()}

    def local_state_dict(self) -> dict[str, Any]:
        """Each part's own state on this rank (:class:`LocalStateful`); no collective."""
        return {name: part.local_state_dict() if isinstance(part, LocalStateful)
                else part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(self, snap: dict[str, Any], *, source: str, warn) -> None:
        """Each part's state from ``snap`` (a snapshot read from ``source``). A part the
        snapshot has no state for keeps its initial state, with a warning; state the
        snapshot holds for a part this run does not have is left, with a warning."""
        for name, part in self._parts.items():
            if snap.get(name) is None:
                warn(f"{source} holds no state for part {name!r} (added by "
                     f"{self._owners[name]}): it starts from this run's initial state")
                continue
            try:
                part.load_state_dict(snap[name])
            except EngineError as exc:
                raise type(exc)(f"{source}: {exc}") from None
            except Exception as exc:
                raise CheckpointError(
                    f"{source}: its {name!r} state does not load into this run's "
                    f"({type(exc).__name__}: {first_line(exc)})") from None
        unknown = sorted(k for k, v in snap.items()
                         if k not in self._parts and k not in HEADER and v is not None)
        if unknown:
            warn(f"{source} holds state for part(s) {', '.join(unknown)} that this run does "
                 "not have (a plugin or recipe part no longer added?): left unused")


# ------------------------------------------------------------- the core's parts


@attrs.define
class TrainState:
    """Where training stands: the loop's progress (``engine.state``), a part of every
    snapshot (the Trainer adds its epoch's loss sums to it)."""

    # The index of the epoch in progress (or of the next one, at a boundary), from 0 as
    # range() and sampler.set_epoch count: epoch N of the console is index N - 1
    # (docs/outputs.md: epoch numbering). Between epochs it equals epochs_completed.
    epoch: int = 0
    step: int = 0  # optimizer steps taken since the start of training
    batch_in_epoch: int = 0  # micro-batches of the current epoch already consumed
    epochs_completed: int = 0
    # Early stopping (early_stopping.*): its metric's best value, the epoch (from 1) and
    # step of that validation; the value an improvement must beat by more than min_delta
    # and the validations since it was set; whether the run stopped.
    best_metric: float | None = None
    best_epoch: int = 0
    epochs_without_improvement: int = 0
    stopped_early: bool = False
    reference_metric: float | None = None
    best_step: int = 0
    best_saved: float | None = None  # checkpoint.best_metric's best (Trainer.best_improved)

    # batch_in_epoch is the loader part's (LoaderPosition): it converts it to another
    # number of processes.
    def state_dict(self) -> dict:
        state = attrs.asdict(self)
        del state["batch_in_epoch"]
        return state

    local_state_dict = state_dict  # LocalStateful: every rank keeps the same

    def position(self) -> str:
        """Where training stands, for a person, epochs from 1 as on the console: ``epoch 2,
        step 10, batch 4 of the epoch``, ``the end of epoch 1, step 8``."""
        if self.batch_in_epoch:
            return (f"epoch {self.epoch + 1}, step {self.step}, batch {self.batch_in_epoch} "
                    "of the epoch")
        if self.epoch:
            return f"the end of epoch {self.epoch}, step {self.step}"
        return f"the start, step {self.step}"

    def load_state_dict(self, state_dict: dict) -> None:
        # Fields a snapshot written before they existed lacks keep their defaults.
        for field in attrs.fields(type(self)):
            if field.name != "batch_in_epoch" and field.name in state_dict:
                setattr(self, field.name, state_dict[field.name])


# ------------------------------------------------------ the model's keys and digest


def model_digest(state_dict: dict) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, keys sorted, whatever
    its device or memory layout."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            digest.update(f"{name}={tensor!r};".encode())
            continue
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


#: torch.compile's key segment (an OptimizedModule keeps its module as ``_orig_mod``).
COMPILED_SEGMENT = "_orig_mod"


def plain_keys(state_dict: dict) -> dict:
    """The keys a plain model has: without DDP/DataParallel's ``module.`` prefix (when
    every key carries it) and without torch.compile's ``_orig_mod.`` at any depth (a
    whole model compiled, or blocks of it)."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
    return {uncompiled_key(k): v for k, v in state_dict.items()}


def uncompiled_key(key: str) -> str:
    if COMPILED_SEGMENT not in key:
        return key
    return ".".join(part for part in key.split(".") if part != COMPILED_SEGMENT)


def add_module_prefix(state_dict: dict) -> dict:
    return {k if k.startswith("module.") else f"module.{k}": v for k, v in state_dict.items()}


def load_model_state(model, state_dict: dict, source: str = "checkpoint") -> None:
    """Load into a plain, compiled or DDP/DP-wrapped model, with or without the
    ``module.`` and ``_orig_mod.`` parts of the keys."""
    target = getattr(model, "module", model)
    state_dict = plain_keys(state_dict)
    # The plain key of each of the target's own keys (a compiled target's have _orig_mod).
    own_key = {uncompiled_key(k): k for k in target.state_dict()}
    expected = set(own_key)
    given = set(state_dict)
    missing = sorted(expected - given)
    unexpected = sorted(given - expected)
    if missing or unexpected:
        def some(keys):
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")

        parts = []
        if missing:
            parts.append(f"missing keys: {some(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {some(unexpected)}")
        raise CheckpointError(f"{source} does not match the model; " + "; ".join(parts))
    try:
        target.load_state_dict({own_key[k]: v for k, v in state_dict.items()})
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = next((line.strip() for line in first[1:] if line.strip()), first[0])
        raise CheckpointError(f"{source} does not match the model: {detail}") from None


class ModelState:
    """The unwrapped module, under a plain model's keys (no torch.compile ``_orig_mod.``):
    a snapshot loads into a compiled and a plain model alike. ``sharded``: torch's
    distributed form (by parameter name, sharded tensors left sharded), for a
    checkpointer that stores it (:func:`engine.shards.distributed_options`)."""

    def __init__(self, module, sharded: bool = False):
        self.module = module
        self.sharded = sharded

    def state_dict(self) -> dict:
        options = distributed_options(self.module, self.sharded)
        if options is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.module, options=options)  # plain keys
        return plain_keys(self.module.state_dict())

    def local_state_dict(self) -> dict:
        """:meth:`state_dict`, or, for a model that fully_shard split, this rank's own
        shards (:func:`to_shards`): the full state would be a gather."""
        if not is_sharded(self.module):
            return self.state_dict()
        return to_shards(plain_keys(self.module.state_dict()))

    def load_state_dict(self, state_dict: dict) -> None:
        if holds_shards(state_dict):  # local_state_dict's: this rank's shards, in place
            load_model_state(self.module, from_shards(state_dict, mesh_of(self.module)),
                             source="its model state")
            return
        options = distributed_options(self.module, self.sharded)
        if options is not None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.module, state_dict, options=options)
            return
        load_model_state(self.module, state_dict, source="its model state")


class OptimizerState:
    """The optimizer; ``sharded`` as for :class:`ModelState`."""

    def __init__(self, module, optimizer, sharded: bool = False):
        self.module = module
        self.optimizer = optimizer
        self.sharded = sharded

    def state_dict(self) -> dict:
        options = distributed_options(self.module, self.sharded)
        if options is not None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.module, self.optimizer, options=options)
        return self.optimizer.state_dict()

    def local_state_dict(self) -> dict:
        """As :meth:`ModelState.local_state_dict`: under fully_shard the optimizer's own
        state dict (keyed by parameter index) with this rank's shards of its state."""
        if not is_sharded(self.module):
            return self.state_dict()
        return to_shards(self.optimizer.state_dict())

    def _keyed_by_name(self, state_dict: dict) -> dict:
        """``state_dict`` (keyed by index) keyed by the names torch's state_dict helpers
        give this optimizer's parameters: the index counts the parameters of every
        group in order, and the helpers list the names in the same order."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        named = get_optimizer_state_dict(self.module, self.optimizer,
                                         options=StateDictOptions())
        names = [name for group in named["param_groups"] for name in group["params"]]
        try:
            return {"state": {names[i]: v for i, v in state_dict["state"].items()},
                    "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                     for g in state_dict["param_groups"]]}
        except IndexError:
            raise CheckpointError(
                f"optimizer state does not match: it holds more parameters than this "
                f"model's optimizer ({len(names)})") from None

    def load_state_dict(self, state_dict: dict) -> None:
        try:
            self._load(state_dict)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"optimizer state does not match: {first_line(exc)}"
                                  ) from None

    def _load(self, state_dict: dict) -> None:
        if holds_shards(state_dict):
            # A memory snapshot's: the optimizer's own loader takes it (a state it has
            # not created yet, before its first step, included).
            self.optimizer.load_state_dict(from_shards(state_dict, mesh_of(self.module)))
            return
        options = distributed_options(self.module, self.sharded)
        if options is not None:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_optimizer_state_dict)

            if options.full_state_dict and not holds_tensors(state_dict.get("state")):
                # Nothing to slice into shards (plain SGD keeps no state), and torch's
                # full-state loader fails on that ("Expected device to be set").
                options = StateDictOptions()
            if _keyed_by_index(state_dict):
                # A whole model's optimizer (a run under ddp or single resumed under
                # fsdp): torch's loader here wants the parameters' names.
                state_dict = self._keyed_by_name(state_dict)
            set_optimizer_state_dict(self.module, self.optimizer, state_dict,
                                     options=options)
            return
        if state_dict.get("param_groups") and not _keyed_by_index(state_dict):
            # Keyed by the parameters' names: a sharded run's, gathered by a single-file
            # checkpointer (fsdp resumed under ddp or single). torch's helper maps the
            # names onto this optimizer (a plain loader took the first key for an index).
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.module, self.optimizer, state_dict)
            return
        self.optimizer.load_state_dict(state_dict)


def _keyed_by_index(state_dict: dict) -> bool:
    """True for an optimizer state in torch's own form (``optimizer.state_dict()``: the
    parameters by their index), False for the named form of torch's state_dict helpers."""
    groups = state_dict.get("param_groups") or [{}]
    return any(isinstance(p, int) for p in groups[0].get("params", ()))


class LoaderPosition:
    """Where the epoch stands: ``state``'s ``batch_in_epoch``, and the first training
    loader's position (engine.data.TrainingLoader: any number of processes resumes a
    map-style dataset's global position)."""

    def __init__(self, state, loader: Callable[[], Any], world_size: int, warn=print):
        self.warn = warn  # a stream's resume notice
        self.state = state  # the TrainState whose batch_in_epoch this part owns
        self.loader = loader  # the first training loader, once it exists (or None)
        self.world_size = world_size

    def state_dict(self) -> dict:
        loader = self.loader()
        if loader is None:  # a library loop that made no training loader
            return {"batch_in_epoch": self.state.batch_in_epoch, "samples_in_epoch": None,
                    "world_size": self.world_size}
        return loader.position_state(self.state.batch_in_epoch, self.world_size)

    def load_state_dict(self, state_dict: dict) -> None:
        loader = self.loader()
        if loader is not None:  # where its epoch resumes: engine.data.TrainingLoader
            self.state.batch_in_epoch = loader.restore(state_dict, self.world_size, self.warn)
            return
        batches = int(state_dict.get("batch_in_epoch") or 0)
        saved_world = state_dict.get("world_size", self.world_size)
        if batches and state_dict.get("samples_in_epoch") is not None \
                and saved_world != self.world_size:
            raise ConfigError(
                f"the snapshot stopped mid-epoch with {saved_world} processes; to resume it "
                f"with {self.world_size}, create the training loader (ctx.loader) before "
                "ctx.epochs() or ctx.resume()")
        self.state.batch_in_epoch = batches


class Metrics:
    """The latest reduced or logged values (a dict the run keeps updating)."""

    def __init__(self, metrics: dict):
        self.metrics = metrics

    def state_dict(self) -> dict:
        return dict(self.metrics)

    local_state_dict = state_dict  # LocalStateful: every rank keeps the same

    def load_state_dict(self, state_dict: dict) -> None:
        self.metrics.update(state_dict)


def add_extra_parts(parts: SnapshotParts, pm, ctx, recipe_parts=None) -> None:
    """The recipe's parts (``state_parts(cfg, ctx)``: a dict of name to part), then
    each plugin's ``engine_register_state(ctx, parts)``, one plugin at a time so that
    a name taken twice names both owners."""
    if recipe_parts is not None:
        parts.current_owner = "the recipe (state_parts)"
        found = recipe_parts(ctx.cfg, ctx)
        if not isinstance(found, dict):
            raise ConfigError("the recipe's state_parts(cfg, ctx) must return a dict of "
                              f"name to part, not {type(found).__name__}")
        for name, part in found.items():
            parts.add(name, part)
    for impl in pm.hook.engine_register_state.get_hookimpls():
        parts.current_owner = f"plugin {impl.plugin_name!r}"
        given = {"ctx": ctx, "engine": ctx, "parts": parts}  # engine: the old name
        impl.function(*[given[a] for a in impl.argnames])
    parts.current_owner = "the engine"
