"""The set-up steps a worker runs, shared by every door that trains: engine-run's and
engine.fit's Engine, the custom loop's Context (engine.api) and tune-workers. One place,
so that the doors cannot drift apart (a custom loop's ``activation_checkpointing`` was
silently ignored while the Engine applied it).

The steps, in the order a run takes them, and the doors that call them: start_worker
(Engine, Context, tune-workers); datasets (Engine); training_loader (Engine,
Context.loader, tune-workers); setup_step_parts, the model (recipe_model, then
transform_model: activation checkpointing and torch.compile, then the parallel wrap) with
its optimizer, loss_fn and fp16 scaler (Engine, tune-workers without the wrap;
Context.wrap takes prepare_model and build_optimizer); schedule_length and
build_scheduler (Engine); open_checkpointer (Engine, Context).

What they build is the run's :class:`RunParts`, the record that the training loop
drives (the Trainer reads it; recipes and hooks see its fields on the run object:
``ctx.model`` is ``ctx.run_parts.model``). :func:`setup_recipe_run` is engine-run's whole
sequence; :func:`callers_state_kept` gives a library caller its thread count back.

torch and the modules that import it are imported inside the steps: ``engine.api``
imports this module, and ``import engine`` / ``engine.launch``'s launching process stay
free of torch until a worker needs it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
from typing import Any, Callable

import attrs

from engine import activation_checkpointing, distributed, loader_settings, phases
from engine import run_dir
from engine.compile import compile_model
from engine.errors import ConfigError
from engine.parallel import choose_parallel


@attrs.define
class RunParts:
    """What the training loop drives, built by the steps of this module; None until a
    step built it. A custom loop's Context fills what it has (its loaders are its own:
    ``train_loader`` is the first, the one snapshots count)."""

    parallel: Any = None  # the parallel mode (engine.parallel.Parallel)
    model: Any = None  # as trained: wrapped by the parallel mode
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None  # fp16's GradScaler
    loss_fn: Callable | None = None  # the recipe's, for its steps (None: theirs)
    checkpointer: Any = None
    train_loader: Any = None
    val_loader: Any = None
    micro_batch: int | None = None  # samples one process feeds per forward pass
    loader_settings: Any = None  # engine.loader_settings.LoaderSettings
    # The run's length in optimizer steps: an epoch's (None: a stream's, not known) and
    # the run's (None: not known).
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    # engine-run's snapshot layer (engine/snapshot.py's Snapshots), which owns the memory
    # tier; None in a custom loop.
    snapshots: Any = None

    @property
    def module(self):
        """The model without its parallel wrapper (what snapshots hold)."""
        return self.parallel.unwrap(self.model)


#: torch's thread count before a worker in this process set the run's (start_worker).
_threads_before: int | None = None


@contextlib.contextmanager
def callers_state_kept():
    """Around a library call (engine.fit, engine.launch): a worker that runs in the
    caller's process sets torch's thread count for the run (``threads=``, or its share
    of the CPUs); the caller gets its own back when the call returns, however it ends.
    The call's phases (the console's ``done: ... in 5.2s (start-up 1.1s)``) count from
    the call's start, not from the process's or an earlier call's."""
    global _threads_before
    phases.restart()
    _threads_before = None
    try:
        yield
    finally:
        if _threads_before is not None:
            import torch  # lazily: see the module docstring

            torch.set_num_threads(_threads_before)
            _threads_before = None


def start_worker(pm, cfg, world, options: dict[str, Any], recipe=None, alone: bool = False):
    """The first steps of every worker: seed every RNG, share the CPUs, choose the
    parallel mode and its devices, create the process group and settle the run's folder
    (not ``alone``: tune-workers). Returns the parallel mode, which reads the settings
    ``recipe`` declares (fsdp: ``shard_units``; None in a custom loop)."""
    import torch  # lazily: see the module docstring

    seed_everything(cfg.seed)
    if cfg.deterministic:
        use_deterministic_kernels()
    global _threads_before
    if _threads_before is None:
        _threads_before = torch.get_num_threads()
    torch.set_num_threads(options.get("threads") or world.cpu_share().count)
    parallel = parallel_mode(pm, cfg, world, recipe)
    if alone:
        return parallel
    if world.distributed:
        distributed.init(world, parallel.backend or "gloo", cfg.timeout_s)
    # out_dir's pattern filled by rank 0, the same for every rank (engine/run_dir.py).
    run_dir.settle(cfg, world, options, run_dir.run_files(pm))
    return parallel


def use_deterministic_kernels() -> None:
    """Deterministic cuDNN and cuBLAS kernels (``deterministic=true``). Must run before
    the process's first CUDA matrix product: cuBLAS reads its workspace setting when it
    starts."""
    import torch  # lazily: see the module docstring

    # cuBLAS is deterministic only with a fixed workspace (CUDA >= 10.2); a user's own
    # setting wins.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def seed_everything(seed: int) -> None:
    import numpy as np  # lazily, as torch
    import torch  # lazily: see the module docstring

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def parallel_mode(pm, cfg, world, recipe=None):
    """The run's parallel mode, checked, its device set up (before any process group):
    ``--parallel`` (or auto's choice), given the recipe whose settings it may read."""
    parallel = choose_parallel(pm.parallel_modes, cfg.parallel, world)(world, cfg,
                                                                       recipe=recipe)
    parallel.check()
    parallel.setup_device()
    return parallel


def setup_recipe_run(ctx, recipe) -> RunParts:
    """engine-run's set-up, once the worker started: data, model, optimizer and their
    companions, the checkpointer, in ``ctx.run_parts`` (returned). The recipe's functions
    get ``ctx`` and see each part as soon as it exists (its ``build_scheduler`` reads
    ``ctx.total_steps``)."""
    from engine import streaming  # imports torch: lazily
    from engine.plan import precision_note  # imports torch: lazily

    cfg, world, parts = ctx.cfg, ctx.world, ctx.run_parts
    parts.micro_batch = micro_batch(cfg, world)
    if ctx.is_rank0:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
    train_set, val_set = datasets(recipe, cfg, ctx)
    parts.loader_settings = loader_settings_for(cfg, world, ctx.device)
    loader_kwargs = parts.loader_settings.loader_kwargs()
    if streaming.is_stream(train_set):  # an IterableDataset: engine/streaming.py
        parts.train_loader = streaming.StreamLoader(
            train_set, micro_batch=parts.micro_batch, world=world, drop_last=cfg.drop_last,
            **loader_kwargs)
    else:
        parts.train_loader = training_loader(
            train_set, micro_batch=parts.micro_batch, world=world, seed=cfg.seed,
            drop_last=cfg.drop_last, per_sample_seed=cfg.per_sample_seed, **loader_kwargs)
    if val_set is not None:  # map-style, or a stream
        parts.val_loader = streaming.val_loader(val_set, batch=parts.micro_batch,
                                                world=world, **loader_kwargs)
    setup_step_parts(parts, recipe, cfg, ctx.print)
    parts.steps_per_epoch, parts.total_steps = schedule_length(parts.train_loader, cfg)
    parts.scheduler = build_scheduler(recipe, cfg, parts.optimizer, ctx)
    slow = precision_note(cfg.precision, [str(ctx.device)])
    if slow:  # the run's first lines, rank 0
        ctx.warn(slow)
    parts.checkpointer = open_checkpointer(ctx.pm, cfg, world, ctx.out_dir)
    return parts


def setup_step_parts(parts: RunParts, recipe, cfg, say, wrap: bool = True) -> RunParts:
    """What the step drives, in ``parts`` (returned): the recipe's model, transformed and
    wrapped (not ``wrap``: tune-workers' ``--full-step``, which has no process group),
    its optimizer, loss_fn and fp16 scaler."""
    model = transform_model(recipe_model(recipe, cfg), cfg, parts.parallel.device, say)
    parts.model = parts.parallel.wrap(model) if wrap else model
    parts.optimizer = build_optimizer(
        lambda module: recipe.module.build_optimizer(cfg, module), parts.module,
        parts.parallel)
    parts.loss_fn = recipe.optional("loss_fn")
    parts.scaler = grad_scaler(cfg.precision, parts.parallel.device)
    return parts


def micro_batch(cfg, world) -> int:
    """The samples one process feeds per forward pass (engine.data.split_batch)."""
    from engine import data  # imports torch: lazily

    return data.split_batch(cfg.batch_size, world.world_size, cfg.grad_accum_steps)


def datasets(recipe, cfg, ctx):
    """The recipe's ``(train_set, val_set)``: its ``prepare_data`` first on each
    machine's local rank 0 (downloads, unpacking), the others waiting, then its
    ``build_datasets`` on every rank."""
    prepare = recipe.optional("prepare_data")
    if prepare is not None:
        with distributed.local_rank0_first(ctx.world):
            if ctx.world.is_local_rank0:
                prepare(cfg, ctx)
    train_set, val_set = recipe.module.build_datasets(cfg, ctx)
    val_set = val_set if cfg.validate else None  # validate=false: left unused
    if val_set is not None:
        recipe.check_eval_step()
    return train_set, val_set


def loader_settings_for(cfg, world, device, num_workers=None):
    """num_workers (the config's, or ``num_workers``), persistence, prefetch, pinning,
    timeout: engine/loader_settings.py."""
    return loader_settings.choose(
        cfg.num_workers if num_workers is None else num_workers, cpus=world.cpu_share(),
        device_type=device.type, timeout_s=cfg.timeout_s)


def training_loader(dataset, *, micro_batch: int, world, seed: int, drop_last: bool,
                    drop_last_name: str = "drop_last=false", **loader_kwargs):
    """The training loader of a map-style ``dataset`` (engine.data.train_loader): this
    rank's share, ``micro_batch`` samples a batch; refused, naming what to change
    (``drop_last_name``: how the caller spells it), when it would have no batch."""
    from engine import data  # imports torch: lazily

    loader = data.train_loader(dataset, micro_batch=micro_batch, world=world, seed=seed,
                               drop_last=drop_last, **loader_kwargs)
    if len(loader) == 0:
        raise ConfigError(
            f"the training set has {len(dataset)} samples, fewer than one batch of "
            f"{micro_batch} per process; use a smaller batch_size or {drop_last_name}")
    return loader


def recipe_model(recipe, cfg):
    """The recipe's ``build_model(cfg)``, built right after seeding, as a hand-written
    loop would, so that the initial weights are the same as there; refused without
    parameters."""
    import torch  # lazily: see the module docstring

    torch.manual_seed(cfg.seed)
    model = recipe.module.build_model(cfg)
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"the recipe's build_model returned a model without parameters "
                          f"({type(model).__name__}): there is nothing to train")
    return model


def transform_model(model, cfg, device, say):
    """``model`` on ``device`` with the model transforms in torchtitan's order:
    activation checkpointing (``activation_checkpointing``), then torch.compile
    (``compile.*``). ``say``: how the run prints a line (rank 0's)."""
    model = model.to(device)
    model = activation_checkpointing.apply(model, cfg.activation_checkpointing)
    return compile_model(model, cfg.compile, say)


def prepare_model(model, cfg, parallel, device, say):
    """:func:`transform_model`, then the parallel mode's wrap (DDP, fully_shard...);
    returns the wrapped model."""
    return parallel.wrap(transform_model(model, cfg, device, say))


def build_optimizer(build, module, parallel=None):
    """The optimizer: ``build`` when it is one already (a custom loop may build it
    before the wrap), else ``build(module)`` on the wrapped model's parameters; checked
    to hold only parameters the model has (fsdp's wrap replaces them with shards)."""
    built_before = hasattr(build, "state_dict")
    optimizer = build if built_before else build(module)
    held = {id(p) for p in module.parameters()}
    if any(id(p) not in held for g in optimizer.param_groups for p in g["params"]):
        if not built_before:  # no wrap came between: the function added parameters
            raise ConfigError(
                "build_optimizer returned an optimizer holding parameters that are not "
                "the model's (the model it was given): a parallel mode would not "
                "synchronise them; build it from that model's parameters only")
        name = parallel.name if parallel is not None else "none"
        raise ConfigError(
            f"the optimizer holds parameters that the model no longer has after parallel "
            f"mode {name!r} wrapped it (it replaces them); pass a function that "
            "builds the optimizer instead: ctx.wrap(model, lambda m: "
            "torch.optim.SGD(m.parameters(), lr=...))")
    return optimizer


def schedule_length(train_loader, cfg) -> tuple[int | None, int | None]:
    """The run's length, for schedules by step: the optimizer steps of an epoch (a group
    of grad_accum_steps micro-batches each, the last maybe shorter), and of the run: the
    epochs', or max_steps where it ends the run sooner. A stream's length is not known:
    neither is an epoch's (None), and the run's is max_steps' (None without)."""
    if not train_loader.sized:
        return None, cfg.max_steps or None
    steps_per_epoch = -(-len(train_loader) // cfg.grad_accum_steps)
    total = steps_per_epoch * cfg.epochs
    return steps_per_epoch, min(total, cfg.max_steps) if cfg.max_steps else total


def build_scheduler(recipe, cfg, optimizer, ctx):
    """The recipe's ``build_scheduler(cfg, optimizer, ctx)`` (``ctx.steps_per_epoch``,
    ``ctx.total_steps``: the run's length), or ``build_scheduler(cfg, optimizer)`` for a
    recipe that needs no more; None without one."""
    build = recipe.optional("build_scheduler")
    if build is None:
        return None
    try:
        takes_ctx = len(inspect.signature(build).parameters) >= 3
    except (TypeError, ValueError):  # a callable without a signature: the old form
        takes_ctx = False
    return build(cfg, optimizer, ctx) if takes_ctx else build(cfg, optimizer)


def grad_scaler(precision: str, device):
    """fp16's GradScaler (None at other precisions); fp16 needs CUDA."""
    if precision != "fp16":
        return None
    if device.type != "cuda":
        raise ConfigError("precision 'fp16' needs a CUDA device; on the CPU use "
                          "precision=bf16")
    import torch  # lazily: see the module docstring

    return torch.amp.GradScaler("cuda")


def open_checkpointer(pm, cfg, world, out_dir):
    """The checkpoint plugin (``checkpointer=``) on ``<out_dir>/checkpoints``."""
    return pm.checkpointers.get(cfg.checkpointer)(out_dir / "checkpoints", cfg, world)
