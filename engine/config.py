"""Configuration: attrs classes with defaults, the plugins' groups added to them, and
the checks across fields. A recipe's ``Config`` subclasses :class:`TrainConfig`; setting
keys from text (``key=value``, --config files) is engine/overrides.py's.
"""

from __future__ import annotations

import enum
import functools
import pathlib
from typing import Any, Literal, Mapping

import attrs

from engine import metrics
from engine.errors import ConfigError


def resume_safe(cfg, key: str) -> bool:
    """Whether the dotted ``key`` of a config group may change between a run and its
    resume. A group class says so in its attribute ``RESUME_SAFE``: True for every key
    (when snapshots are kept, where a run is tracked), or the set of its keys that may
    (``ddp``'s bucket size, but not ``sync_batchnorm``, which changes the arithmetic).
    Top-level keys are the snapshot module's (engine.snapshot.MAY_CHANGE)."""
    group, _, rest = key.partition(".")
    if not rest:
        return False
    safe = getattr(type(getattr(cfg, group, None)), "RESUME_SAFE", ())
    return safe is True or rest in safe


def differs_from_default(group: Any, name: str) -> bool:
    """Whether ``group.name`` is not its class's default (a value the user chose)."""
    return getattr(group, name) != attrs.fields_dict(type(group))[name].default


@attrs.define
class CheckpointConfig:
    RESUME_SAFE = True  # when and how many snapshots are kept
    every_epochs: int = 1  # 0: only at the end
    every_steps: int = 0  # 0: never by step count
    every_minutes: float = 0.0  # 0: never by wall time
    # A snapshot in shared memory every N steps (0: never); auto: the smallest N whose
    # snapshots cost at most 2% of the step time, measured while the run trains.
    memory_every_steps: int | Literal["auto"] = "auto"
    memory_dir: str = "/dev/shm"  # the tmpfs for them (this user's folder is made there)
    keep_last: int = 3  # the newest snapshots kept (0: every one)
    # The snapshot at the run's end (false: none there, for a throw-away run; those
    # every_* asks for before it, and a pre-emption's, are written as ever).
    at_end: bool = True
    best_metric: str = ""  # e.g. "val/loss": also keep the best snapshot by it
    # Whether the best is the lowest or the highest; auto: read from the metric's name
    # (loss, error, mae: min; accuracy, f1, auc: max), refused where the name says neither.
    best_mode: Literal["auto", "min", "max"] = "auto"


@attrs.define
class EarlyStoppingConfig:
    """Stop when a validation metric stops improving (off while ``metric`` is empty)."""

    RESUME_SAFE = True  # when to stop is not what a step computes

    metric: str = ""  # e.g. "val/loss": a metric of the epoch (see the console line)
    # min: lower is better; auto: read from the metric's name, as checkpoint.best_mode.
    mode: Literal["auto", "min", "max"] = "auto"
    # Validations without improvement before stopping: one per epoch, more with
    # val_every_steps.
    patience: int = 3
    # An improvement (for the patience count) must beat the last one by more than this;
    # the best (the best snapshot's) is the best value whatever the delta.
    min_delta: float = 0.0


@attrs.define
class CompileConfig:
    """``compile.*``: torch.compile the model (engine/compile.py, docs/compile.md)."""

    # Compiled kernels compute the same steps as eager ones, up to float rounding: a
    # run may resume with compile on or off.
    RESUME_SAFE = True

    enabled: bool = False  # torch.compile the model (compile=true says the same)
    # torch.compile's modes: reduce-overhead adds CUDA graphs, max-autotune searches
    # kernels (long compiles).
    mode: Literal["default", "reduce-overhead", "max-autotune",
                  "max-autotune-no-cudagraphs"] = "default"
    # Class names (``Block`` or ``Block,Attention``): compile every submodule of these
    # classes instead of the whole model; the repeated blocks compile once.
    regional: tuple[str, ...] = ()
    backend: str = "inductor"  # torch.compile's backend (aot_eager: no code generation)
    fullgraph: bool = False  # a graph break is an error instead of a fallback to eager


@attrs.define
class TrainConfig:
    """Fields every recipe has. ``batch_size`` is the *global* batch per optimizer step;
    the engine splits it across processes (and accumulation steps)."""

    epochs: int = 2  # epochs to train
    # Optimizer steps to train (0: no limit); with epochs, the run ends at whichever
    # comes first, mid-epoch too (a validation and the final snapshot there).
    max_steps: int = 0
    # Validate every N optimizer steps (counted over the run), inside an epoch too;
    # 0: at each epoch's end only (which validates either way).
    val_every_steps: int = 0
    # false: never validate, even where the recipe returns a validation set.
    validate: bool = True
    # Smoke run: K steps and K validation batches per process, one epoch, in the folder
    # out_dir-smoke, started afresh every time (a real run never resumes from it).
    limit_batches: int = 0
    smoke: bool = False  # a smoke run of 2 steps (limit_batches=2)
    batch_size: int = 64  # the global batch per optimizer step, over every process
    lr: float = 0.001  # the learning rate
    seed: int = 0  # seeds every RNG, the data order too
    # GPUs: bit-identical runs and exact resume need deterministic kernels (cuDNN and
    # cuBLAS otherwise pick algorithms whose float sums vary run to run). Slower; an
    # op without a deterministic kernel then stops the run naming the op.
    deterministic: bool = False
    out_dir: str = "runs/default"  # the run's folder ({name} placeholders: docs/configuration.md)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    precision: Literal["32", "bf16", "fp16"] = "32"  # autocast dtype (fp16: a grad scaler)
    scheduler_interval: Literal["epoch", "step"] = "epoch"  # when the scheduler steps
    # ReduceLROnPlateau's metric, stepped on after each validation (e.g. val/loss). A
    # metric of the epoch's end; its direction must be the scheduler's mode.
    scheduler_metric: str = ""
    num_workers: int | Literal["auto"] = 0  # DataLoader workers per process
    drop_last: bool = False  # drop the last incomplete training batch
    # Seed the RNGs from (seed, epoch, sample index) before loading each training sample,
    # so that random augmentation survives a resume exactly. Costs a few RNG reseeds per
    # sample (docs/checkpoints.md); recipes with random transforms turn it on.
    per_sample_seed: bool = False
    log_every: int = 20  # optimizer steps between progress/log refreshes
    launcher: str = "auto"  # how the processes start (engine-run plugins lists them)
    parallel: str = "auto"  # the parallel mode (engine-run plugins lists them)
    checkpointer: str = "torch-file"  # how snapshots are written (engine-run plugins)
    init_method: str = "env://"  # env://, tcp://HOST:PORT or file:///shared/path
    timeout_s: float = 300.0  # process-group init and collective timeout
    # SIGUSR1/SIGTERM: snapshot within two check points and stop; rank 0 then asks the
    # job's scheduler to requeue it (engine/preemption.py; SLURM: the slurm plugin).
    preemption: bool = True  # SIGUSR1/SIGTERM: snapshot and stop
    requeue: bool = True  # after a pre-emption, ask the scheduler to requeue the job
    on_nonfinite: Literal["stop", "skip"] = "stop"  # skip: one host sync per step
    # Clip the gradients' total norm to this before each optimizer step (after the last
    # micro-batch; unscaled first under fp16). none: no clipping.
    grad_clip_norm: float | None = None
    # Module classes (comma separated) whose activations are recomputed in backward
    # instead of kept: memory for compute, same results (engine/activation_checkpointing.py).
    activation_checkpointing: str = ""
    checkpoint: CheckpointConfig = attrs.Factory(CheckpointConfig)
    early_stopping: EarlyStoppingConfig = attrs.Factory(EarlyStoppingConfig)
    compile: CompileConfig = attrs.Factory(CompileConfig)


# ------------------------------------------------------------------ plugin groups


def with_groups(cfg: Any, groups: Mapping[str, type]) -> Any:
    """``cfg`` with the plugins' config groups (``{"ddp": DDPConfig}``) added as fields
    at their defaults, so that ``cfg.ddp`` and the override ``ddp.x=...`` work like a
    group the recipe declared. A group the config class already has (a recipe that
    declares its own ``ddp``) is kept as it is. The values of ``cfg`` carry over."""
    present = attrs.fields_dict(type(cfg))
    missing = tuple((name, group) for name, group in groups.items() if name not in present)
    if not missing:
        return cfg
    grouped = grouped_class(type(cfg), missing)
    return _fill(grouped, {**{name: getattr(cfg, name) for name in present},
                           **{name: group() for name, group in missing}})


@functools.lru_cache(maxsize=None)
def grouped_class(base: type, groups: tuple[tuple[str, type], ...]) -> type:
    """A subclass of the config class ``base`` with one more field per group; one class
    per (base, groups), so that configs of the same run compare equal."""
    cls = attrs.make_class(base.__name__, {name: attrs.field(factory=group)
                                           for name, group in groups}, bases=(base,))
    cls.__module__, cls.__qualname__ = base.__module__, base.__qualname__
    cls.__annotations__ = {name: group for name, group in groups}

    def __reduce__(self):
        # The class is made at run time, so pickle (DataLoader workers, deepcopy)
        # cannot find it by name: rebuild it from its parts.
        return _rebuild, (base, groups, {f.name: getattr(self, f.name)
                                         for f in attrs.fields(cls)})

    cls.__reduce__ = __reduce__
    return cls


def _rebuild(base: type, groups: tuple[tuple[str, type], ...], values: dict) -> Any:
    return _fill(grouped_class(base, groups), values)


def _fill(cls: type, values: dict) -> Any:
    cfg = cls.__new__(cls)
    for name, value in values.items():
        object.__setattr__(cfg, name, value)  # no __init__: values are already checked
    return cfg


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        if attrs.has(type(value)):
            keys.extend(all_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def check(cfg: TrainConfig) -> None:
    """Cross-field checks that apply to every recipe."""
    for name in ("epochs", "batch_size", "grad_accum_steps", "log_every"):
        value = getattr(cfg, name)
        if value < 1:
            raise ConfigError(f"config key {name!r}: {value!r} is not allowed; it must be >= 1")
    check_run_length(cfg)
    if isinstance(cfg.num_workers, int) and cfg.num_workers < 0:
        raise ConfigError(f"config key 'num_workers': {cfg.num_workers!r} must be >= 0")
    if cfg.lr <= 0:
        raise ConfigError(f"config key 'lr': {cfg.lr!r} must be > 0")
    if cfg.grad_clip_norm is not None and not cfg.grad_clip_norm > 0:
        raise ConfigError(f"config key 'grad_clip_norm': {cfg.grad_clip_norm!r} must be > 0 "
                          "(or none: no clipping)")
    if not cfg.timeout_s > 0:
        raise ConfigError(f"config key 'timeout_s': {cfg.timeout_s!r} must be > 0 (the "
                          "seconds any wait for another rank may take)")
    checkpoint = cfg.checkpoint
    for name, meaning in (("keep_last", "keeps every snapshot"),
                          ("every_epochs", "only at the end"),
                          ("every_steps", "never by step count"),
                          ("every_minutes", "never by wall time"),
                          ("memory_every_steps", "no in-memory snapshots")):
        value = getattr(checkpoint, name)
        if value != "auto" and value < 0:
            auto = " or auto" if name == "memory_every_steps" else ""
            raise ConfigError(f"config key 'checkpoint.{name}': {value!r} must be >= 0 "
                              f"(0 {meaning}){auto}")
    stopping = cfg.early_stopping
    if stopping.patience < 1:
        raise ConfigError(f"config key 'early_stopping.patience': {stopping.patience!r} "
                          "must be >= 1")
    if stopping.min_delta < 0:
        raise ConfigError(f"config key 'early_stopping.min_delta': {stopping.min_delta!r} "
                          "must be >= 0")
    for key, metric in (("early_stopping.metric", stopping.metric),
                        ("checkpoint.best_metric", checkpoint.best_metric),
                        ("scheduler_metric", cfg.scheduler_metric)):
        if metric == "train/loss":  # the name's meaning until runs logged train/epoch_loss
            raise ConfigError(f"config key {key!r}: 'train/loss' is the mean of one log "
                              "window, not of an epoch; use train/epoch_loss")
    metrics.check_modes(cfg)  # auto modes read from the names; best and stopping agree
    for field in attrs.fields(type(cfg)):
        group = getattr(cfg, field.name)
        if attrs.has(type(group)) and callable(getattr(group, "check", None)):
            # A plugin's group checks its settings here, before any worker starts: in the
            # launching process, --dry-run and engine.launch (the trackers' stores).
            group.check()
    _check_out_dir(str(cfg.out_dir))
    # Here, not at the top: engine.run_dir imports engine.distributed, which the config does not.
    from engine.run_dir import placeholders

    placeholders(str(cfg.out_dir))  # an unknown {name} is refused now, not at the start
    if not cfg.init_method.startswith(("env://", "tcp://", "file://")):
        raise ConfigError(f"config key 'init_method': {cfg.init_method!r} is not allowed; "
                          "use env://, tcp://HOST:PORT or file:///shared/path")


def check_run_length(cfg) -> None:
    """``max_steps``, ``val_every_steps`` and the smoke switch (``limit_batches``,
    ``smoke``): counts, 0 for off; early stopping at a validation by steps needs a val/
    metric (the epoch's metrics, train/epoch_*, exist at an epoch's end only)."""
    for name, off in (("max_steps", "the epochs decide"),
                      ("val_every_steps", "at each epoch's end only"),
                      ("limit_batches", "not a smoke run")):
        value = getattr(cfg, name)
        if value < 0:
            raise ConfigError(f"config key {name!r}: {value!r} must be >= 0 (0: {off})")
    needs = ([f"val_every_steps={cfg.val_every_steps}"] if cfg.val_every_steps else []) + [
        f"{key}={name}" for key, name in metrics.named(cfg) if name.startswith("val/")]
    if needs and not cfg.validate:
        raise ConfigError(f"config key 'validate': false never validates, and {needs[0]} "
                          "needs validation; leave validate=false out, or that key")
    metric = cfg.early_stopping.metric
    if cfg.val_every_steps and metric and not metric.startswith("val/"):
        raise ConfigError(
            f"config key 'early_stopping.metric': {metric!r} is not known at a validation "
            f"by steps (val_every_steps={cfg.val_every_steps}); name a val/ metric, or "
            "set val_every_steps=0 to stop at epochs' ends")


#: What ``smoke=true`` means: a run of this many steps (limit_batches).
SMOKE_BATCHES = 2
#: The suffix of a smoke run's folder: out_dir=runs/cifar smokes in runs/cifar-smoke.
SMOKE_SUFFIX = "-smoke"


def smoke_batches(cfg) -> int:
    """The steps (and validation batches per process) of a smoke run; 0: a real run."""
    return cfg.limit_batches or (SMOKE_BATCHES if cfg.smoke else 0)


def make_smoke_run(cfg) -> None:
    """A smoke run's config (every process makes the same): one epoch of
    ``smoke_batches`` steps, in a folder of its own (out_dir + ``-smoke``), so that
    nothing it writes is a snapshot a real run could resume from; the validation
    batches are limited where they are read (engine/validation.py)."""
    steps = smoke_batches(cfg)
    if not steps:
        return
    cfg.limit_batches = steps
    cfg.epochs = 1
    cfg.max_steps = min(cfg.max_steps or steps, steps)
    if not str(cfg.out_dir).rstrip("/").endswith(SMOKE_SUFFIX):
        cfg.out_dir = str(cfg.out_dir).rstrip("/") + SMOKE_SUFFIX


def _check_out_dir(out_dir: str) -> None:
    """out_dir, or the first of its parents that exists, must be a folder: creating it
    later failed with a FileExistsError traceback in every worker."""
    path = pathlib.Path(out_dir).expanduser()
    for existing in (path, *path.parents):
        if existing.exists():
            break
    if not existing.is_dir():
        where = "" if existing == path else f" ({existing} is not a folder)"
        raise ConfigError(f"config key 'out_dir': {out_dir!r} cannot be the run's folder"
                          f"{where or ': it is a file'}; give a folder (created when missing)")


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"checkpoint": {"keep_last": 3}}`` -> ``{"checkpoint.keep_last": 3}``: the
    dotted keys of overrides, of the resume check and of the trackers' parameters."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of str/int/float/bool/None (safe for json and weights_only loads)."""

    def plain(value):
        if isinstance(value, pathlib.PurePath):
            return str(value)
        if isinstance(value, enum.Enum):
            return value.name
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(attrs.asdict(cfg, recurse=True))
