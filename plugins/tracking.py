"""What the experiment-tracking loggers (``mlflow``, ``wandb``) share: importing their
package only when enabled, the config as flat parameters, the run's status.

Not a plugin itself (no hooks); cheap to import: nothing optional at module level.
"""

from __future__ import annotations

import importlib
import pathlib
from typing import Any

from engine.errors import EXIT_COMPLETED, EXIT_FAILED, EXIT_PREEMPTED, PluginError

#: engine-run's exit code for each summary status (engine/errors.py).
EXIT_CODES = {"completed": EXIT_COMPLETED, "failed": EXIT_FAILED,
              "preempted": EXIT_PREEMPTED}


def import_package(module: str, extra: str, group: str) -> Any:
    """``import module``, or a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(
            f"{group}.enabled=true needs the {module} package ({exc}); install it with "
            f'pip install -e ".[{extra}]" (or pip install {extra}), or drop '
            f"{group}.enabled=true") from None


def enabled(engine, group: str, extra: str) -> tuple[Any, Any] | None:
    """``(options, package)`` when this rank is rank 0 and ``cfg.<group>.enabled`` is set
    (the package imported then, not before), else None. A config built without the
    plugin manager has no such group: disabled."""
    options = getattr(engine.cfg, group, None)
    if not (engine.is_rank0 and options is not None and options.enabled):
        return None
    return options, import_package(group, extra, group)


def flat_config(cfg) -> dict[str, Any]:
    """The resolved config as ``{"lr": 0.1, "ddp.bucket_cap_mb": 25.0, ...}``."""
    from engine.config import flatten, to_dict

    return flatten(to_dict(cfg))


def summary_scalars(summary: dict) -> dict[str, float]:
    """The numbers of a run's summary (val_accuracy, wall_time_s, global_step...)."""
    return {key: float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def run_name(engine, given: str | None) -> str:
    """The tracking run's name: the one given, else the out_dir's folder name."""
    return given or engine.out_dir.name


def experiment_name(engine) -> str:
    """The recipe's name (its file's stem); a custom loop's script's."""
    path = getattr(engine, "recipe_path", None)
    return pathlib.Path(path).stem if path else "engine"
