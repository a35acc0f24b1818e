"""Parallel mode ``fsdp``: fully sharded data parallel, torch's FSDP2 (``fully_shard``).

Every process holds 1/N of each parameter, of its gradient and of its optimizer state
(N processes); a unit's full parameters exist only while its forward or backward runs
(all-gathered), and its gradients are reduce-scattered back to the shards. So the
model, gradients and optimizer state need about 1/N of the memory they take under
``ddp``, for more communication. Devices and backend are ddp's: cuda:<local rank> with
NCCL, or the CPU with gloo.

Units: ``fully_shard`` is applied to each unit, innermost first, then to the root
(which takes every parameter no unit holds). A unit is gathered and freed as one: units
the size of a transformer block keep the peak memory low and overlap communication with
compute. Which submodules become units, first match wins:

1. ``fsdp.shard=Block,Head`` (class names);
2. the recipe's ``shard_units``: a tuple of module classes (the recipe reaches the
   mode as its constructor's ``recipe`` argument: engine/worker_setup.py's
   parallel_mode, the plan's describe);
3. otherwise every direct child of the model that holds parameters.

The options are this plugin's config group ``fsdp`` (:class:`FSDPConfig`):

- ``shard`` (""): the unit classes, as above.
- ``reshard_after_forward`` (true): free a unit's gathered parameters after its
  forward and gather them again for backward (less memory); false keeps them from
  forward to backward (one all-gather less per unit and step).
- ``reduce_fp32`` (true): with ``precision=bf16``, reduce gradients in fp32.

Precision: ``precision=bf16`` is FSDP2's MixedPrecisionPolicy: parameters gathered and
computed in bf16, the sharded fp32 parameters (and optimizer state) kept as they are.
``fp16`` needs a gradient scaler that knows the shards: refused, use bf16.
``checkpoint.memory_every_steps``: each rank's in-memory snapshot holds its own shards
(engine/shards.py's to_shards), so a restart at the same number of processes resumes
from memory; a rank whose memory is gone, or another number of processes, from disk.

The optimizer is built by the engine after the wrap, on the sharded parameters.
Gradient accumulation turns off the gradients' reduce-scatter for the group's first
micro-batches (``set_requires_gradient_sync``). ``grad_clip_norm`` clips by the norm
over all shards (torch's ``clip_grad_norm_`` reduces it across the ranks).

Snapshots: the ``dcp`` checkpointer saves each rank's own shards (and reshards them at
load: another number of processes resumes); ``torch-file`` and ``async`` save the full
state dict, gathered on rank 0's CPU (engine/stateful.py). One process still shards
(over one rank, in a process group of its own), so its arithmetic and its precision
are those of N processes.
"""

from __future__ import annotations

import contextlib

import attrs

import engine
from engine.errors import ConfigError
from engine.parallel import parse_class_names, select_blocks
from engine.plugins.ddp import DistributedDataParallel

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


@attrs.define
class FSDPConfig:
    """Options of the ``fsdp`` parallel mode (torch.distributed.fsdp.fully_shard)."""

    #: How parameters are gathered and grouped, not what a step computes.
    RESUME_SAFE = frozenset({"shard", "reshard_after_forward"})

    shard: str = ""  # unit classes, comma separated ("" : the recipe's shard_units)
    reshard_after_forward: bool = True  # free gathered parameters after forward
    reduce_fp32: bool = True  # bf16: reduce gradients in fp32


def fsdp_options(cfg) -> FSDPConfig:
    options = getattr(cfg, "fsdp", None)
    return FSDPConfig() if options is None else options


class FullyShardedDataParallel(DistributedDataParallel):
    name = "fsdp"
    #: Never chosen by ``--parallel auto``: sharding is a choice (ddp is faster when
    #: the model fits).
    priority = 100

    @classmethod
    def detect(cls, world) -> bool:
        return False

    @property
    def options(self) -> FSDPConfig:
        return fsdp_options(self.cfg)

    def check(self):
        import torch

        device = self.devices[0]  # raises when the node lacks GPUs for its processes
        if (self.cfg.precision == "bf16" and device.type == "cuda"
                and not torch.cuda.is_bf16_supported()):
            raise ConfigError(
                f"precision 'bf16' with parallel mode 'fsdp': {torch.cuda.get_device_name()} "
                "has no bf16 support; use precision=32 (fsdp keeps fp32 then)")
        if self.cfg.precision == "fp16":
            raise ConfigError(
                "precision 'fp16' with parallel mode 'fsdp': the gradient scaler cannot "
                "unscale sharded gradients; use precision=bf16 (no scaler needed) or "
                "--parallel ddp")

    def setup_device(self):
        super().setup_device()
        if self.world.world_size == 1:
            # fully_shard needs a process group: one process gets one of its own
            # (an in-memory store, nothing to rendezvous with).
            import torch.distributed as dist

            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0,
                                    world_size=1)

    # ---------------------------------------------------------------- model

    def units(self, model) -> list[tuple[str, object]]:
        """``(name, submodule)`` of the submodules that become FSDP units, checked
        (see the module docstring for the choice)."""
        names = parse_class_names(self.options.shard)
        declared = self.recipe.optional("shard_units") if self.recipe is not None else None
        if names:
            found = select_blocks(model, names, f"fsdp.shard={self.options.shard}")
        elif declared:
            if not all(isinstance(c, type) for c in declared):
                raise ConfigError(f"the recipe's shard_units must be a tuple of module "
                                  f"classes, not {declared!r}")
            found = select_blocks(model, declared, "the recipe's shard_units")
        else:
            found = [(name, child) for name, child in model.named_children()
                     if any(True for _ in child.parameters())]
        check_units(model, [name for name, _ in found])
        return found

    def mixed_precision(self):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.cfg.precision != "bf16":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32 if self.options.reduce_fp32 else torch.bfloat16)

    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        units = self.units(model)
        settings = {"reshard_after_forward": self.options.reshard_after_forward,
                    "mp_policy": self.mixed_precision()}
        # Innermost first (named_modules lists parents before children): a unit's
        # parameters are those no inner unit took.
        for _, unit in reversed(units):
            fully_shard(unit, **settings)
        fully_shard(model, **settings)
        return model

    def unwrap(self, model):
        return model  # fully_shard changes the module in place: there is no wrapper

    @contextlib.contextmanager
    def no_sync(self, model):
        # Gradients accumulate unsharded in each rank; the group's last backward
        # reduce-scatters the sum.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    @contextlib.contextmanager
    def validation(self, model):
        """Each rank validates its own shard of the set, one batch more on some ranks:
        a forward that all-gathers would wait for a rank that has none left. So every
        unit is gathered once, before, and kept gathered until the end (one full copy
        of the parameters per rank meanwhile)."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            model.set_reshard_after_forward(self.options.reshard_after_forward)
            for unit in units:
                unit.reshard()

    def sync_buffers(self, model):
        """Buffers are not sharded: each rank's BatchNorm statistics follow its own
        batches. Rank 0's, on every rank, before validation or a snapshot."""
        import torch.distributed as dist

        if self.world.world_size > 1:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def explain(self, exc):
        return None

    # ----------------------------------------------------------------- plan

    def describe(self):
        """The units and the bytes each rank holds, from the model built on the meta
        device (no memory, no weights)."""
        import torch

        if self.recipe is None:
            return []
        try:
            with torch.device("meta"):
                model = self.recipe.module.build_model(self.cfg)
            units = self.units(model)
        except ConfigError:
            raise
        except Exception as exc:  # a recipe whose model cannot be built on meta
            return [("fsdp units", f"not known before the run ({type(exc).__name__})")]
        return [("fsdp units", describe_units(model, units)),
                ("fsdp per rank", describe_bytes(model, self.world.world_size))]


def check_units(model, unit_names: list[str]) -> None:
    """Refuse a unit choice that fully_shard would fail on later, in one line: a
    parameter shared by two units (tied weights), or a unit whose own parameters have
    several dtypes among its trainable parameters."""
    def owner(module_name: str) -> str:
        inside = [u for u in unit_names if module_name == u or module_name.startswith(u + ".")]
        return max(inside, key=len, default="")  # "": the root

    where: dict[int, tuple[str, str]] = {}
    dtypes: dict[str, set] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        unit = owner(module_name)
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if param.requires_grad:  # what fully_shard asks one dtype of
                dtypes.setdefault(unit, set()).add(param.dtype)
            first = where.setdefault(id(param), (full, unit))
            if first[1] != unit:
                raise ConfigError(
                    f"fsdp: {first[0]} and {full} are one tied parameter in two units "
                    f"({_unit(first[1])} and {_unit(unit)}); shard a module that holds "
                    "both (fsdp.shard=...) or leave one side to the root")
    for unit, kinds in dtypes.items():
        if len(kinds) > 1:
            listed = ", ".join(sorted(str(d).replace("torch.", "") for d in kinds))
            raise ConfigError(
                f"fsdp: {_unit(unit)} holds parameters of dtypes {listed}; fully_shard "
                "needs one dtype per unit: build the model in one dtype (set precision "
                "for bf16 compute) or make the odd layers units of their own (fsdp.shard=)")


def _unit(name: str) -> str:
    return f"unit {name!r}" if name else "the root"


def describe_units(model, units) -> str:
    listed = ", ".join(f"{name} ({type(m).__name__})" for name, m in units[:6])
    more = f", ... {len(units) - 6} more" if len(units) > 6 else ""
    return f"{len(units)} + the root" + (f": {listed}{more}" if units else "")


def describe_bytes(model, world_size: int) -> str:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return (f"parameters {_size(params / world_size)} of {_size(params)} (gradients and "
            f"optimizer state shard alike, 1/{world_size} each)")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(FullyShardedDataParallel)


@engine.hookimpl
def engine_register_config_groups():
    return {"fsdp": FSDPConfig}
