"""``ema``: an exponential moving average of the weights, saved in every snapshot.

Off until enabled through its config group::

    engine-run RECIPE ema.enabled=true ema.decay=0.999 ema.every_steps=1 ema.evaluate=true

- ``decay`` (0.999): each update keeps ``decay`` of the average and adds ``1 - decay``
  of the weights (torch.optim.swa_utils.get_ema_multi_avg_fn); the first update copies
  the weights.
- ``every_steps`` (1): update after every N-th optimizer step taken (a step that
  ``on_nonfinite=skip`` or fp16's GradScaler skips is not taken, so it does not count).
- ``evaluate`` (false): validate on the averaged weights instead of the trained ones;
  the ``val/*`` metrics (and early stopping, and ``checkpoint.best_metric``) are then the
  average's.

The average is a torch.optim.swa_utils.AveragedModel (parameters and buffers), updated
by an optimizer step hook: nothing runs per step while the plugin is disabled, and no
value is read back from the device while it is enabled. It is a snapshot part named
``ema`` (``engine_register_state``), so a run killed mid-epoch resumes to the same
average as an uninterrupted one. Every rank keeps its own copy: the replicated parallel
modes train the same weights on every rank, so the copies are equal, and a checkpointer
that writes on rank 0 keeps rank 0's. ``python tools/ckpt.py export SNAPSHOT out.pt
--part ema`` writes the averaged weights alone.

Under ``--parallel fsdp`` the model is sharded and cannot be copied whole:
:class:`ShardedMovingAverage` keeps the average as shards beside the model's (a DTensor
per parameter, with the parameter's placements: 1/N of the weights per rank, no full
copy anywhere), updated with the same arithmetic on each rank's own shard, so it is the
average ddp computes from the same weights, bit for bit. Evaluation swaps the shards in
and out before the model is gathered for validation. In a snapshot, ``dcp`` writes the
shards (each rank its own) and ``torch-file``/``async`` the full average, gathered on
rank 0 as the model is; the snapshot's ``ema`` entry has the same keys either way.
"""

from __future__ import annotations

import attrs

import engine
from engine.errors import ConfigError
from engine.shards import from_shards, holds_shards, is_sharded, mesh_of, to_shards

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


def _decay_in_range(instance, attribute, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError("the decay is at least 0 and below 1 (e.g. 0.999)")


def _positive(instance, attribute, value) -> None:
    if value < 1:
        raise ValueError("update every 1 or more optimizer steps")


@attrs.define
class EmaConfig:
    """``ema.*``: every key changes what the run computes or reports, so a resume
    refuses a change of any of them (engine.config.resume_safe)."""

    enabled: bool = False
    decay: float = attrs.field(default=0.999, validator=_decay_in_range)
    every_steps: int = attrs.field(default=1, validator=_positive)
    evaluate: bool = False


class ExponentialMovingAverage:
    """The snapshot part: the averaged copy of ``module`` and the steps it has seen."""

    def __init__(self, module, optimizer, decay: float, every_steps: int):
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.module = module
        self.every_steps = every_steps
        self.steps = 0  # optimizer steps taken since the start of training
        self.average = AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay),
                                     use_buffers=True)
        self.average.requires_grad_(False)
        # Inside optimizer.step(): after every step taken, and only then.
        optimizer.register_step_post_hook(self._after_step)
        self._trained = None  # the trained weights while the average is evaluated

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps % self.every_steps == 0:
            self.average.update_parameters(self.module)

    def state_dict(self) -> dict:
        return {"average": self.average.state_dict(), "steps": self.steps}

    local_state_dict = state_dict  # engine.stateful.LocalStateful: no collective in it

    def load_state_dict(self, state_dict: dict) -> None:
        self.average.load_state_dict(state_dict["average"])
        self.steps = int(state_dict["steps"])

    def weights(self) -> dict:
        """The averaged weights, keyed as the module's own state_dict."""
        return self.average.module.state_dict()

    def swap_in(self) -> None:
        """Put the averaged weights into the module (a copy of the trained ones kept)."""
        import torch

        with torch.no_grad():
            current = self.module.state_dict()
            self._trained = {name: t.detach().clone() for name, t in current.items()}
            for name, tensor in self.weights().items():
                current[name].copy_(tensor)

    def swap_out(self) -> None:
        """The trained weights back, bit for bit."""
        import torch

        if self._trained is None:
            return
        with torch.no_grad():
            current = self.module.state_dict()
            for name, tensor in self._trained.items():
                current[name].copy_(tensor)
        self._trained = None


class ShardedMovingAverage:
    """The snapshot part under fsdp: the average of a model that fully_shard split over
    the ranks, kept as shards of the same layout. Its state is AveragedModel's
    (``{"average": {"n_averaged": ..., "module.<name>": ...}, "steps": ...}``): with a
    sharded checkpointer (``sharded``, as the model part's: engine/stateful.py) the
    shards as DTensors, else the full tensors on rank 0 (none on the others)."""

    def __init__(self, module, optimizer, decay: float, every_steps: int, sharded: bool):
        import torch
        from torch.optim.swa_utils import get_ema_multi_avg_fn

        self.module = module
        self.every_steps = every_steps
        self.sharded = sharded
        self.steps = 0  # optimizer steps taken since the start of training
        self.n_averaged = 0  # updates so far (counted on the host: no device read)
        self._average_fn = get_ema_multi_avg_fn(decay)
        # Parameters and persistent buffers under their state_dict names: what
        # AveragedModel's state_dict holds. A tied weight is averaged once, under its
        # first name, and saved under each (``aliases``: every name to the first).
        self.aliases = _first_names(module)
        self.names = list(dict.fromkeys(self.aliases.values()))
        with torch.no_grad():
            # A DTensor's clone keeps its mesh and placements: a shard on every rank.
            self.average = {name: t.detach().clone()
                            for name, t in zip(self.names, self._model_tensors())}
        # Inside optimizer.step(): after every step taken, and only then.
        optimizer.register_step_post_hook(self._after_step)
        self._trained = None  # this rank's trained shards while the average is evaluated

    def _model_tensors(self) -> list:
        """The model's parameters and buffers in the order of ``names``, looked up each
        time (fully_shard may give a parameter new storage when a state is loaded)."""
        state = self.module.state_dict(keep_vars=True)
        return [state[name] for name in self.names]

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if self.steps % self.every_steps == 0:
            self.update()

    def update(self) -> None:
        """AveragedModel.update_parameters on this rank's shards, element for element:
        the first update copies, the later ones apply torch's EMA function per dtype."""
        import torch

        with torch.no_grad():
            averaged = [_local(t) for t in self.average.values()]
            current = [_local(t.detach()) for t in self._model_tensors()]
            if self.n_averaged == 0:
                torch._foreach_copy_(averaged, current)
            else:
                groups: dict = {}  # AveragedModel groups by device and dtype
                for a, c in zip(averaged, current):
                    group = groups.setdefault((a.device, a.dtype), ([], []))
                    group[0].append(a)
                    group[1].append(c)
                for group_averaged, group_current in groups.values():
                    self._average_fn(group_averaged, group_current, None)
        self.n_averaged += 1

    def state_dict(self) -> dict:
        """Collective (every rank calls it, as it does the model part's)."""
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        if dist.get_world_size() > 1:
            # Buffers are not sharded and each rank's follow its own batches: rank 0's
            # on every rank at a snapshot, as the model's (sync_buffers), so a resumed
            # run has what an uninterrupted one has.
            for tensor in self.average.values():
                if not _is_dtensor(tensor):
                    dist.broadcast(tensor, src=0)
        tensors = self.average
        if not self.sharded:  # the whole average, on rank 0's CPU
            tensors = {}
            for name, tensor in self.average.items():
                full = tensor.full_tensor() if _is_dtensor(tensor) else tensor  # collective
                if rank == 0:
                    tensors[name] = full.detach().cpu().clone()
        average = {}
        if self.sharded or rank == 0:
            average = {f"module.{alias}": tensors[name] for alias, name in self.aliases.items()}
            average["n_averaged"] = torch.tensor(self.n_averaged, dtype=torch.long)
        return {"average": average, "steps": self.steps}

    def local_state_dict(self) -> dict:
        """This rank's own shards and buffers as they are (engine.stateful.LocalStateful:
        an in-memory snapshot's), whatever the checkpointer: no gather, no broadcast on
        the snapshot's path; the restart at this number of processes puts each rank's
        back. ``n_averaged`` as a number: a new tensor at every snapshot
        would make the memory tier plan its copies again."""
        average = {f"module.{alias}": self.average[name] for alias, name in self.aliases.items()}
        average["n_averaged"] = self.n_averaged
        return to_shards({"average": average, "steps": self.steps})

    def load_state_dict(self, state_dict: dict) -> None:
        import torch

        if holds_shards(state_dict):  # a memory snapshot's (local_state_dict)
            state_dict = from_shards(state_dict, mesh_of(self.module))
        saved = state_dict["average"]
        missing = [name for name in self.names if f"module.{name}" not in saved]
        if missing:
            raise KeyError(f"the average has no {', '.join(missing[:3])}")
        with torch.no_grad():
            for name, tensor in self.average.items():
                value = saved[f"module.{name}"]
                if value is tensor:  # a sharded checkpointer loaded it in place
                    continue
                if _is_dtensor(tensor) and not _is_dtensor(value):
                    # The full average (torch-file): this rank's shard of it, cut here.
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value.to(tensor.device), tensor.device_mesh,
                                              tensor.placements, src_data_rank=None)
                _local(tensor).copy_(_local(value))
        self.n_averaged = int(saved["n_averaged"])
        self.steps = int(state_dict["steps"])

    def weights(self) -> dict:
        """The averaged weights keyed as the module's state_dict: this rank's shards."""
        return dict(self.average)

    def swap_in(self) -> None:
        """The averaged shards into the model's, before validation gathers the model;
        this rank's trained shards kept meanwhile (1/N of the weights)."""
        import torch

        with torch.no_grad():
            current = [_local(t.detach()) for t in self._model_tensors()]
            self._trained = [t.clone() for t in current]
            torch._foreach_copy_(current, [_local(t) for t in self.average.values()])

    def swap_out(self) -> None:
        """The trained shards back, bit for bit."""
        import torch

        if self._trained is None:
            return
        with torch.no_grad():
            torch._foreach_copy_([_local(t.detach()) for t in self._model_tensors()],
                                 self._trained)
        self._trained = None


def _first_names(module) -> dict[str, str]:
    """Every state_dict name of ``module`` to the first name of its tensor."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(tensor), name)
            for name, tensor in module.state_dict(keep_vars=True).items()}


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor):
    """This rank's shard of a DTensor (its own storage: writes go into the DTensor), or
    the tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


@engine.hookimpl
def engine_register_config_groups():
    return {"ema": EmaConfig}


def _options(cfg) -> EmaConfig:
    return getattr(cfg, "ema", None) or EmaConfig()


@engine.hookimpl
def engine_register_state(ctx, parts):
    options = _options(ctx.cfg)
    if options.evaluate and not options.enabled:
        raise ConfigError("config key 'ema.evaluate': there is no average to evaluate "
                          "unless ema.enabled=true")
    if options.enabled:
        if is_sharded(ctx.module):  # fsdp: AveragedModel's deepcopy would fail
            average = ShardedMovingAverage(ctx.module, ctx.optimizer, options.decay,
                                           options.every_steps,
                                           ctx.checkpointer.distributed_state_dict)
        else:
            average = ExponentialMovingAverage(ctx.module, ctx.optimizer,
                                               options.decay, options.every_steps)
        parts.add("ema", average)


def _evaluated_average(ctx) -> ExponentialMovingAverage | None:
    if not _options(ctx.cfg).evaluate or "ema" not in ctx.snapshot_parts:
        return None
    return ctx.snapshot_parts["ema"]


@engine.hookimpl
def engine_validation_start(ctx):
    average = _evaluated_average(ctx)
    if average is not None:
        average.swap_in()


@engine.hookimpl
def engine_validation_end(ctx):
    average = _evaluated_average(ctx)
    if average is not None:
        average.swap_out()
