"""Configuration: attrs classes with defaults, and ``key=value`` overrides by dotted path.

A recipe's ``Config`` subclasses :class:`TrainConfig` and adds its own groups; plugins
add theirs (:func:`with_groups`). Overrides are converted with the field's annotation and
checked; a problem is a one-line ConfigError naming the key, the value and what fits.
"""

from __future__ import annotations

import ast
import difflib
import enum
import functools
import inspect
import io
import json
import pathlib
import re
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal, Mapping

import attrs

from engine import metrics
from engine.errors import ConfigError, first_line


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


# --------------------------------------------------------------------- overrides

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of an attrs class (``from __future__ import annotations``
    leaves them as strings)."""
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:
        raise ConfigError(f"cannot resolve the field types of {cls.__qualname__}: {exc}") from exc


def declared_first(cls: type, name: str) -> tuple[type, Any]:
    """The class that first declared field ``name`` among ``cls``'s bases, and its type
    there. A recipe's Config that re-declares an inherited field to change its default
    (``precision: str = "bf16"``) must not lose the base's choices: every value is
    checked against this type too."""
    for klass in reversed(cls.__mro__):
        if attrs.has(klass) and name in klass.__dict__.get("__annotations__", {}):
            return klass, field_types(klass)[name]
    return cls, field_types(cls)[name]


def check_redeclared(cls: type) -> None:
    """A config class's re-declared fields: their defaults must be values the first
    declaration allows. One line naming the field and how to change a default."""
    for field in attrs.fields(cls):
        base, base_tp = declared_first(cls, field.name)
        if base is cls or isinstance(field.default, attrs.Factory) or attrs.has(base_tp):
            continue
        default = field.default
        if fits(default, base_tp):
            continue
        raise ConfigError(
            f"{cls.__name__}.{field.name}: the default {default!r} is not "
            f"{_describe(base_tp)} ({base.__qualname__}.{field.name}); to change a default, "
            f"give a value that is (e.g. {field.name}: {_annotation(base_tp)} = ...)")


def fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` is one that an override of type ``tp`` could produce."""
    if value is None:
        return tp is type(None) or type(None) in typing.get_args(tp) or tp is Any
    try:
        return convert(str(value).lower() if isinstance(value, bool) else str(value),
                       tp) == value
    except (ValueError, TypeError):
        return False


def _annotation(tp: Any) -> str:
    return repr(tp).replace("typing.", "")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if origin in (tuple, list):
        return "a comma-separated list"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of: " + ", ".join(m.name for m in tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             pathlib.Path: "a path"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def convert(value: str, tp: Any) -> Any:
    """Convert the override text ``value`` to type ``tp``; ValueError if it does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == value:
                return choice
        raise ValueError
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and value.lower() in _NONE:
            return None
        # Literal choices first so "auto" in `int | Literal["auto"]` wins over int parsing.
        for arg in sorted(args, key=lambda a: typing.get_origin(a) is not Literal):
            if arg is type(None):
                continue
            try:
                return convert(value, arg)
            except ValueError:
                continue
        raise ValueError
    if origin in (tuple, list):
        args = typing.get_args(tp)
        item_tp = args[0] if args else str
        items = [convert(v.strip(), item_tp) for v in value.split(",") if v.strip()]
        return tuple(items) if origin is tuple else items
    if tp is bool and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if tp in (int, float, str, pathlib.Path):
        return tp(value)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp[value]
        except KeyError:
            raise ValueError from None
    raise ValueError


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        if attrs.has(type(value)):
            keys.extend(all_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


#: Where every key is listed (the unknown-key error points there, not at ~70 keys).
EVERY_KEY = "every key: engine-run RECIPE --dry-run -v"


class UnknownKey(ConfigError):
    """A key the config does not have: one line with the closest keys (within the group
    it names, when it names one: else the group's keys, which are few) and where every
    key is listed. ``key`` is the key given, ``close`` the closest keys, best first."""

    def __init__(self, cfg: Any, key: str, here: str, part: str):
        group = _group(cfg, here) if here else cfg
        prefix = f"{here}." if here else ""
        known = all_keys(group)
        self.key = key
        self.close = [prefix + name for name in
                      difflib.get_close_matches(key[len(prefix):], known, n=3, cutoff=0.6)]
        if len(self.close) == 1:
            hint = f"; did you mean {self.close[0]!r}?"
        elif self.close:
            hint = f"; did you mean one of {', '.join(map(repr, self.close))}?"
        elif here:
            hint = f"; {here!r} has: {', '.join(known)}"
        else:
            hint = ""
        super().__init__(f"unknown config key {key!r}"
                         + (f" ({here!r} has no field {part!r})" if here else "")
                         + f"{hint} ({EVERY_KEY})")


def _group(cfg: Any, dotted: str) -> Any:
    """The group ``cfg.a.b`` that ``"a.b"`` names."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def apply_override(cfg: Any, key: str, text: str) -> None:
    """Set ``key`` (a dotted path) on ``cfg`` from the override text, converted and checked."""
    target = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in attrs.fields(type(target))]
        if part not in names:
            raise UnknownKey(cfg, key, ".".join(parts[:i]), part)
        if i == len(parts) - 1:
            break
        target = getattr(target, part)
        if not attrs.has(type(target)):
            raise ConfigError(
                f"config key {key!r}: {'.'.join(parts[: i + 1])!r} is a value, not a group"
            )
    name = parts[-1]
    current = getattr(target, name)
    if attrs.has(type(current)):
        if "enabled" in attrs.fields_dict(type(current)):
            # A group switched on and off (compile, ema): GROUP=true is GROUP.enabled=true.
            return apply_override(cfg, f"{key}.enabled", text)
        raise ConfigError(
            f"config key {key!r} is a group; set one of its fields, e.g. "
            f"{all_keys(current, key + '.')[0]}=..."
        )
    tp = field_types(type(target))[name]
    base, base_tp = declared_first(type(target), name)
    try:
        value = convert(text, tp)
    except (ValueError, TypeError):
        raise ConfigError(
            f"config key {key!r}: {text!r} is not {_describe(tp)}"
        ) from None
    if base_tp != tp and not fits(value, base_tp):
        # A recipe re-declared the field (to change its default): the engine still
        # reads it as the base declared it.
        raise ConfigError(f"config key {key!r}: {text!r} is not {_describe(base_tp)} "
                          f"({base.__qualname__}.{name})")
    field = attrs.fields_dict(type(target))[name]
    try:
        # attrs classes run a field's validator on setattr too (attrs.define's default).
        setattr(target, name, value)
        if field.validator is not None:
            field.validator(target, field, value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config key {key!r}: {text!r} is not allowed: {exc}") from None


def apply_overrides(cfg: Any, overrides: list[str], checked: bool = True) -> Any:
    """Apply ``key=value`` items in order; then (``checked``) the cross-field checks."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} is not of the form key=value (e.g. epochs=3, data.root=/data)"
            )
        apply_override(cfg, key.strip(), text)
    if checked:
        check(cfg)
    return cfg


def check(cfg: TrainConfig) -> None:
    """Cross-field checks that apply to every recipe."""
    positive = ("epochs", "batch_size", "grad_accum_steps", "log_every")
    for name in positive:
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
    # Here, not at the top: engine.run_dir imports engine.distributed (multiprocessing,
    # subprocess), which importing the config does not need.
    from engine.run_dir import placeholders

    placeholders(str(cfg.out_dir))  # an unknown {name} is refused now, not at the start
    if not cfg.init_method.startswith(("env://", "tcp://", "file://")):
        raise ConfigError(
            f"config key 'init_method': {cfg.init_method!r} is not allowed; "
            "use env://, tcp://HOST:PORT or file:///shared/path"
        )


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
                          f"{where or ': it is a file'}; give a folder (created when "
                          "missing)")


# ------------------------------------------------------------------ config files

#: Keys a run's own config.json does not set when it is given to --config: where the
#: run wrote and how its processes started belong to that run, not to the experiment
#: (its out_dir would resume or clobber the old run, its launcher may be torchrun's).
NOT_REPRODUCED = ("out_dir", "launcher", "init_method")


def load_config_file(path: str) -> list[str]:
    """The overrides (``key=value``) a ``--config`` file holds: TOML, YAML or JSON, by
    its suffix; nested tables and dotted keys both name a field. The parsers are
    imported here, when a file is given (nothing at start-up). A run's own config.json
    (its out_dir is the folder it sits in) leaves out :data:`NOT_REPRODUCED`."""
    file = pathlib.Path(path).expanduser()
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"--config {path}: use a .toml, .yaml/.yml or .json file")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = _parse(text, suffix, path)
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error class
        first = first_line(exc, type(exc).__name__)
        kind = {".json": "JSON", ".toml": "TOML"}.get(suffix, "YAML")
        raise ConfigError(f"--config {path}: not valid {kind}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a table of keys "
                          f"(key = value), not a {type(data).__name__}")
    if _is_runs_own(data, file):
        data = {k: v for k, v in data.items() if k not in NOT_REPRODUCED}
    return [f"{key}={_as_text(value)}" for key, value in flatten(data).items()]


def _parse(text: str, suffix: str, path: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".toml":
        try:
            # The parsers are imported for the format read: tomli and PyYAML are optional
            # packages (a clear error when missing), and PyYAML is slow to import.
            import tomllib
        except ImportError:  # Python 3.10: the same parser as a package
            try:
                import tomli as tomllib  # optional: see above
            except ImportError:
                raise ConfigError(f"--config {path}: reading TOML on Python < 3.11 needs "
                                  "tomli (pip install tomli); or give a .json file") from None
        return tomllib.loads(text)
    try:
        import yaml  # optional: see above
    except ImportError:
        raise ConfigError(f"--config {path}: reading YAML needs PyYAML (pip install "
                          "pyyaml); or give a .toml or .json file") from None
    return yaml.safe_load(text)


def _is_runs_own(data: dict, file: pathlib.Path) -> bool:
    out_dir = data.get("out_dir")
    return isinstance(out_dir, str) and (
        pathlib.Path(out_dir).expanduser().absolute() == file.parent.absolute())


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


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    return str(value)


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


def format_config(cfg: Any, prefix: str = "", describe: bool = False) -> list[str]:
    """``key = value`` per key; ``describe`` (``--dry-run -v``): then the values it allows
    and the one-line description its declaration's comment gives."""
    lines = []
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        if attrs.has(type(value)):
            lines.extend(format_config(value, f"{prefix}{f.name}.", describe))
        elif describe:
            about = field_descriptions(type(cfg)).get(f.name, "")
            lines.append(f"{f'{prefix}{f.name} = {value!r}':<36} [{allowed(type(cfg), f.name)}]"
                         + (f"  {about}" if about else ""))
        else:
            lines.append(f"{prefix}{f.name} = {value!r}")
    return lines


def allowed(cls: type, name: str) -> str:
    """What an override of ``name`` may be (a re-declared field: both declarations)."""
    tp = field_types(cls)[name]
    _, base_tp = declared_first(cls, name)
    both = [tp] if base_tp == tp else [tp, base_tp]
    return " and ".join(_describe(t) for t in both)


@functools.lru_cache(maxsize=None)
def field_descriptions(cls: type) -> dict[str, str]:
    """One line per field, from the comments of the classes' source: the comment at the
    end of the field's line, else the comment lines right above it (first sentence).
    Bases first: a re-declaration with a comment of its own replaces the base's."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass):
            found.update(_field_comments(klass))
    return found


def _field_comments(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # made at run time (a plugin group added to it)
        return {}
    comments = {tok.start[0]: (tok.string.lstrip("#").strip(), tok.line[:tok.start[1]].strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    described = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text, code_before = comments.get(node.end_lineno, ("", ""))
        if not code_before:  # no comment at the end of the line: the lines above
            above, line = [], node.lineno - 1
            while line in comments and not comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            text = " ".join(above)
        if text:  # the first sentence ("e.g. x" is none's end)
            described[node.target.id] = re.split(r"(?<!e\.g)(?<!i\.e)\. ", text)[0]
    return described
