"""Loading a recipe: a plain Python file with a ``Config`` class, factories and steps.

A recipe defines (docs/writing-a-recipe.md walks through one)::

    class Config(engine.TrainConfig): ...          # attrs class, defaults for everything
    def build_model(cfg) -> nn.Module
    def build_datasets(cfg, ctx: WorkerContext) -> (train_dataset, val_dataset or None)
    def build_optimizer(cfg, model) -> torch.optim.Optimizer
    def train_step(batch, ctx: WorkerContext) -> loss  # the forward and the loss (below)
    def eval_step(batch, ctx: WorkerContext) -> dict   # the sums (below); with a val set

or, for ``(inputs, targets)`` classification batches, names the opt-in helper
(its loss and argmax hits: engine/classification.py)::

    from engine.classification import eval_step, train_step

and may define::

    def prepare_data(cfg, ctx)          # downloads; run by local rank 0 before the others
    def build_scheduler(cfg, optimizer, ctx)  # an LR scheduler (cfg.scheduler_interval:
                                        # step|epoch); ctx.steps_per_epoch, ctx.total_steps:
                                        # the run's length ((cfg, optimizer) works too)
    def loss_fn(outputs, targets)       # ctx.loss_fn, for the steps (the helper's loss)
    def eval_metrics(sums) -> dict      # metrics from the reduced sums (below)
    def on_train_end(cfg, ctx)          # every rank, after the last epoch (a sample...)
    def state_parts(cfg, ctx) -> dict   # more state that snapshots carry: {name: part}
    throughput_unit = "tokens"          # train/tokens_per_sec instead of samples_per_sec,
    def count_throughput(batch) -> int  # counted in each micro-batch (from its shapes)
    shard_units = (Block,)              # the block classes for sharding (fsdp) and
                                        # activation checkpointing
    REQUIRED_PLUGINS = ["name>=1.0"]    # plugins the recipe cannot run without

``ctx`` is the run object, an :class:`engine.context.WorkerContext` (:data:`StepFunction`
types a step with it). What the steps get and return (batches, the loss or a dict of
extras, the sums with their ``count``, the metrics they become): docs/writing-a-recipe.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable

import attrs

from engine.config import TrainConfig
from engine.overrides import check_redeclared
from engine.errors import ConfigError

if TYPE_CHECKING:  # for the annotations only: no import at start-up
    from engine.context import WorkerContext

#: A recipe's ``train_step`` or ``eval_step``: ``(batch, ctx) -> loss or dict``.
StepFunction = Callable[[Any, "WorkerContext"], Any]

REQUIRED = ("Config", "build_model", "build_datasets", "build_optimizer")
#: What a recipe without its steps is told: the loop knows no task.
STEPS_HINT = ("define train_step(batch, ctx) -> loss and eval_step(batch, ctx) -> "
              "{'loss': sum, ..., 'count': n}, or name the classification helper for "
              "(inputs, targets) batches: from engine.classification import eval_step, "
              "train_step")


@attrs.frozen
class Recipe:
    path: pathlib.Path | None  # the recipe file (None: an object given to engine.fit)
    module: Any  # the recipe's namespace: a module, or any object with its attributes
    title: str | None = None  # the name of a recipe without a file

    @property
    def name(self) -> str:
        return self.title or self.path.stem

    def make_config(self) -> TrainConfig:
        return self.module.Config()

    def optional(self, name: str) -> Callable[..., Any] | None:
        return getattr(self.module, name, None)

    @property
    def train_step(self) -> StepFunction:
        return self.module.train_step

    def check_eval_step(self) -> None:
        """A recipe with a validation set needs an ``eval_step``."""
        if self.optional("eval_step") is None:
            raise ConfigError(f"recipe {self.name!r} returns a validation set but defines "
                              f"no eval_step: {STEPS_HINT}")

    @property
    def required_plugins(self) -> list[str]:
        return list(getattr(self.module, "REQUIRED_PLUGINS", []))


def load_recipe(path: str | pathlib.Path) -> Recipe:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(
            f"recipe file {str(path)!r} not found"
            + (" (it is a directory)" if path.is_dir() else "")
            + "; give the path of a recipe such as recipes/cifar_ddp.py"
        )
    path = path.resolve()
    module_name = _module_name(path)
    if module_name in sys.modules:
        return Recipe(path, sys.modules[module_name])
    # Recipes may share code with sibling files (``from oct_common import ...``), and
    # processes started with "spawn" (DataLoader workers) import the recipe by name to
    # unpickle its datasets: the folder goes on sys.path, which they inherit.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # typing.get_type_hints needs the module registered
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise ConfigError(
            f"recipe {str(path)!r} line {exc.lineno}: SyntaxError: {exc.msg}"
        ) from exc
    except Exception as exc:
        del sys.modules[module_name]
        line = _line_in(path, exc)
        raise ConfigError(
            f"recipe {str(path)!r} line {line}: {type(exc).__name__}: {exc}"
        ) from exc
    _check_recipe(repr(str(path)), module)
    return Recipe(path, module)


def recipe_from_object(obj: Any) -> Recipe:
    """A recipe given as an object with the recipe's attributes (engine.fit): a class,
    an instance, a SimpleNamespace... Its name is the object's ``__name__`` or its
    class's."""
    title = getattr(obj, "__name__", None) or type(obj).__name__
    _check_recipe(repr(title), obj)
    return Recipe(None, obj, title=title)


def _check_recipe(named: str, module: Any) -> None:
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise ConfigError(
            f"recipe {named} does not define {', '.join(missing)} "
            f"(a recipe needs {', '.join(REQUIRED)})"
        )
    if not callable(getattr(module, "train_step", None)):
        raise ConfigError(f"recipe {named} defines no train_step: {STEPS_HINT}")
    config_cls = module.Config
    if not (isinstance(config_cls, type) and attrs.has(config_cls)
            and issubclass(config_cls, TrainConfig)):
        raise ConfigError(
            f"recipe {named}: Config must be an attrs class that subclasses "
            "engine.TrainConfig"
        )
    try:
        check_redeclared(config_cls)
    except ConfigError as exc:
        raise ConfigError(f"recipe {named}: {exc}") from None


def _module_name(path: pathlib.Path) -> str:
    """The file's stem, so that other processes can import it by name; a unique name
    when the stem is taken by another module (then spawned workers cannot import it)."""
    stem = path.stem
    existing = sys.modules.get(stem)
    if stem.isidentifier() and existing is not None and getattr(existing, "__file__", None) \
            and pathlib.Path(existing.__file__).resolve() == path:
        return stem
    if stem.isidentifier() and existing is None:
        try:
            found = importlib.util.find_spec(stem)
        except (ImportError, ValueError):
            found = None
        if found is None or (found.origin and pathlib.Path(found.origin).resolve() == path):
            return stem
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    return f"engine_recipe_{stem}_{digest}"


def _line_in(path: pathlib.Path, exc: BaseException) -> int | str:
    """The deepest traceback line that lies in the recipe file itself."""
    line: int | str = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        if pathlib.Path(frame.filename).resolve() == path:
            line = frame.lineno
    return line
