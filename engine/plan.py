"""The plan of a run: what ``--dry-run`` prints and ``-v`` shows before training."""

from __future__ import annotations

import os
from typing import Any

# torch at the top, as engine.data imports it: only processes that run or plan one import
# this module (engine.cli's train, the workers).
import torch

from engine import cpu_bf16, loader_settings
from engine.data import split_batch
from engine.overrides import format_config
from engine.parallel import choose_parallel
from engine.world import format_world_table


def make_plan(pm, recipe, cfg, launcher, worlds, options: dict[str, Any]) -> dict[str, Any]:
    world = worlds[0]
    parallel_name = resolve_parallel_name(cfg.parallel, world, pm.parallel_modes)
    parallel_cls = pm.parallel_modes.get(parallel_name)
    devices = []
    for w in worlds:
        mode = parallel_cls(w, cfg)
        mode.check()
        devices.append(",".join(str(d) for d in mode.devices))
    mode = parallel_cls(world, cfg, recipe=recipe)
    micro = split_batch(cfg.batch_size, world.world_size, cfg.grad_accum_steps)
    return {
        "recipe": str(recipe.path) if recipe.path else recipe.name,
        "launcher": launcher.name,
        "parallel": parallel_name,
        "parallel_details": mode.describe(),
        "world_size": world.world_size,
        "nodes": world.num_nodes,
        "processes_this_node": world.local_world_size,
        "devices": devices,
        "all_worlds": launcher.all_worlds(),  # every rank, for the world table
        "backend": (parallel_cls(world, cfg).backend or "none") if world.distributed
        else "none (one process)",
        "init_method": cfg.init_method,
        "global_batch": cfg.batch_size,
        "per_process_batch": micro * cfg.grad_accum_steps,
        "micro_batch": micro,
        "grad_accum_steps": cfg.grad_accum_steps,
        "threads_per_process": options.get("threads") or world.cpu_share().count,
        "threads_chosen": options.get("threads_chosen") or "--threads",
        **_loader_plan(cfg, world, parallel_cls),
        "precision": cfg.precision,
        "precision_note": precision_note(cfg.precision, devices),
        "checkpointer": cfg.checkpointer,
        # Sized only when the plan is shown (--dry-run, -v): sizing builds the recipe's
        # model in this process, which a plain run never needs.
        "memory_snapshots": lambda: memory_plan(recipe, cfg, world.world_size),
        "out_dir": cfg.out_dir,
    }


def memory_plan(recipe, cfg, world_size: int = 1) -> str | None:
    """What ``checkpoint.memory_every_steps`` holds in /dev/shm, per rank: two buffers of
    a snapshot each (fsdp: four, of its shard), sized from the model built on the meta
    device (``build_model`` runs here: a download in it happens once more) and the
    optimizer's kind."""
    every = cfg.checkpoint.memory_every_steps
    if not every:
        return None
    from engine.memory.cost import MEMORY_BUDGET, MEMORY_INTERVALS  # the tier's: when on
    from engine.memory.files import user_folder

    folder = user_folder(cfg.checkpoint.memory_dir)
    # fsdp: two more, the copies of the predecessor's shards (engine/memory/ring.py).
    ring = cfg.parallel == "fsdp" and world_size > 1
    buffers = "4 buffers per rank (2 its own, 2 its predecessor's)" if ring else \
        "2 buffers per rank"
    where = f"every {every} step(s), {buffers} in {folder}"
    if every == "auto":  # what a crash loses is known once the run measured the cost
        where = (f"every N steps, N auto: the fewest (1 to {MEMORY_INTERVALS[-1]}) whose "
                 f"snapshots cost at most {100 * MEMORY_BUDGET:g}% of the step time, "
                 f"measured while training; {buffers} in {folder}")
    try:
        model_bytes, optimizer_bytes = _state_bytes(recipe, cfg)
    except Exception:  # a recipe that cannot build on the meta device: said at run time
        return f"{where}, each the size of a snapshot (printed at the first one)"
    shard = ""
    if cfg.parallel == "fsdp" and world_size > 1:  # each rank holds its own shards
        model_bytes, optimizer_bytes = -(-model_bytes // world_size), -(-optimizer_bytes
                                                                         // world_size)
        shard = f", this rank's shard of {world_size}"
    total = model_bytes + optimizer_bytes
    return (f"{where}: {4 if ring else 2} x {total / 2**20:.1f} MB (model "
            f"{model_bytes / 2**20:.1f} MB + "
            f"optimizer state {optimizer_bytes / 2**20:.1f} MB{shard}"
            f"{_free_space(cfg.checkpoint.memory_dir)})")


def _state_bytes(recipe, cfg) -> tuple[int, int]:
    """The model's state and (an estimate of) its optimizer's, in bytes."""
    with torch.device("meta"):
        model = recipe.module.build_model(cfg)
        optimizer = recipe.module.build_optimizer(cfg, model)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model_bytes, param_bytes * _state_per_parameter(optimizer)


def _state_per_parameter(optimizer) -> int:
    """How many tensors of a parameter's size the optimizer keeps per parameter: Adam's
    kind two (its moments), SGD with momentum and RMSprop one, plain SGD none."""
    group = optimizer.param_groups[0]
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta"):
        return 2
    if name == "SGD":
        return 1 if group.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return 1


def _free_space(folder: str) -> str:
    try:
        stat = os.statvfs(folder)
    except OSError:
        return ""
    return f"; {stat.f_bavail * stat.f_frsize / 2**20:.0f} MB free there"


def precision_note(precision: str, devices: list[str]) -> str | None:
    """What ``precision`` costs on these devices, when it costs more than it saves: bf16
    on a CPU without bf16 hardware (engine/cpu_bf16.py)."""
    if precision != "bf16" or not all(d.startswith("cpu") for d in devices):
        return None
    return cpu_bf16.note_here()


def _loader_plan(cfg, world, parallel_cls) -> dict[str, Any]:
    device = parallel_cls(world, cfg).devices[0]
    settings = loader_settings.choose(
        cfg.num_workers, cpus=world.cpu_share(),
        device_type=getattr(device, "type", str(device)), timeout_s=cfg.timeout_s)
    return {"num_workers": settings.num_workers, "loader": settings.describe()}


def format_plan(cfg, plan: dict[str, Any], worlds, config: bool = True,
                describe: bool = False) -> str:
    """``describe`` (``--dry-run -v``): each config key with its allowed values and what
    it is."""
    lines = []
    if config:
        lines.append("config:")
        lines.extend(f"  {line}" for line in format_config(cfg, describe=describe))
    lines.append("plan:")
    batch = (f"{plan['global_batch']} global = {plan['world_size']} processes x "
             f"{plan['per_process_batch']}")
    if plan["grad_accum_steps"] > 1:
        batch += (f" (= {plan['grad_accum_steps']} accumulation steps x "
                  f"{plan['micro_batch']})")
    rows = [
        ("recipe", plan["recipe"]),
        ("launcher", plan["launcher"]),
        ("parallel", plan["parallel"]),
        *plan.get("parallel_details", ()),
        ("world size", f"{plan['world_size']} ({plan['nodes']} node(s), "
                       f"{plan['processes_this_node']} process(es) on this node)"),
        ("backend", plan["backend"]),
        ("init method", plan["init_method"]),
        ("batch", batch),
        ("threads", f"{plan['threads_per_process']} per process ({plan['threads_chosen']})"),
        ("num_workers", plan["loader"]),
        ("precision", plan["precision"] + (f"; warning: {plan['precision_note']}"
                                           if plan.get("precision_note") else "")),
        ("checkpointer", plan["checkpointer"]),
        *([("in memory", memory)] if (memory := plan["memory_snapshots"]()) else []),
        ("output dir", plan["out_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines.extend(f"  {k.ljust(width)}  {v}" for k, v in rows)
    lines.append("world:")
    lines.extend("  " + line for line in
                 format_world_table(plan.get("all_worlds") or worlds, {
                     w.local_rank: d for w, d in zip(worlds, plan["devices"])}).splitlines())
    return "\n".join(lines)


def resolve_parallel_name(name: str, world, registry) -> str:
    """The parallel mode to run: ``name``, or for ``auto`` the one the registered modes'
    own ``detect`` picks (engine.parallel.choose_parallel)."""
    return choose_parallel(registry, name, world).name
