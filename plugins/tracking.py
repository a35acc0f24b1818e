"""What the experiment-tracking loggers (``mlflow``, ``wandb``) share: importing their
package only when enabled, the config as flat parameters, the run's status.

Not a plugin itself (no hooks); cheap to import: nothing optional at module level.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from typing import Any

from engine.errors import (EXIT_COMPLETED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_PREEMPTED,
                           PluginError)

#: engine-run's exit code for each summary status (engine/errors.py).
EXIT_CODES = {"completed": EXIT_COMPLETED, "failed": EXIT_FAILED,
              "preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}


def import_package(module: str, extra: str, group: str) -> Any:
    """``import module``, or a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(
            f"{group}.enabled=true needs the {module} package ({exc}); install it with "
            f'pip install -e ".[{extra}]" (or pip install {extra}), or drop '
            f"{group}.enabled=true") from None


def require_package(module: str, extra: str, group: str) -> None:
    """Before any worker starts (the launching process, --dry-run): the package is
    installed, found without importing it (importing mlflow or wandb takes seconds)."""
    if importlib.util.find_spec(module) is None:
        raise PluginError(
            f"{group}.enabled=true needs the {module} package, which is not installed; "
            f'install it with pip install -e ".[{extra}]" (or pip install {extra}), or '
            f"drop {group}.enabled=true")


#: MLflow's database stores (``sqlite:///x.db``, ``postgresql+psycopg2://...``).
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def mlflow_store_problem(uri: str | None, environ) -> str | None:
    """What keeps MLflow from opening the store at ``uri`` (the config's, else
    MLFLOW_TRACKING_URI), in one line saying what to install or set; None when nothing
    does, or when the store is MLflow's own default (it depends on the version)."""
    where = "config key 'mlflow.tracking_uri'"
    if not uri:
        uri, where = environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"
    if not uri:
        return None
    scheme = uri.partition(":")[0].partition("+")[0].lower() if "://" in uri else "file"
    if scheme in DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        return (f"{where}: {uri} is a database store, which needs SQLAlchemy; the [mlflow] "
                "extra (mlflow-skinny) lacks it: pip install mlflow (the full package) or "
                "pip install sqlalchemy alembic, or use an http:// tracking server")
    if (scheme == "file" and _refuses_file_store()
            and environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1")):
        return (f"{where}: {uri} is MLflow's file store, which this MLflow refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true is set: export MLFLOW_ALLOW_FILE_STORE=true, "
                "or use sqlite:///mlflow.db (needs SQLAlchemy) or an http:// server")
    return None


def _refuses_file_store() -> bool:
    """Whether the installed MLflow refuses its file store without MLFLOW_ALLOW_FILE_STORE
    (MLflow 3's later releases), read from its source rather than imported."""
    spec = importlib.util.find_spec("mlflow")
    if spec is None or not spec.origin:
        return False
    store = pathlib.Path(spec.origin).parent / "store" / "tracking" / "file_store.py"
    try:
        return "MLFLOW_ALLOW_FILE_STORE" in store.read_text()
    except OSError:
        return False


def enabled(ctx, group: str, extra: str) -> tuple[Any, Any] | None:
    """``(options, package)`` when this rank is rank 0 and ``cfg.<group>.enabled`` is set
    (the package imported then, not before), else None. A config built without the
    plugin manager has no such group: disabled."""
    options = getattr(ctx.cfg, group, None)
    if not (ctx.is_rank0 and options is not None and options.enabled):
        return None
    return options, import_package(group, extra, group)


def flat_config(cfg) -> dict[str, Any]:
    """The resolved config as ``{"lr": 0.1, "ddp.bucket_cap_mb": 25.0, ...}``."""
    # Not at the top: engine-run plugins loads this plugin without engine.config.
    from engine.config import flatten, to_dict

    return flatten(to_dict(cfg))


def summary_scalars(summary: dict) -> dict[str, float]:
    """The numbers of a run's summary (val_accuracy, wall_time_s, global_step...)."""
    return {key: float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def run_name(ctx, given: str | None) -> str:
    """The tracking run's name: the one given, else the out_dir's folder name."""
    return given or ctx.out_dir.name


def experiment_name(ctx) -> str:
    """The recipe's name (its file's stem); a custom loop's script's."""
    path = getattr(ctx, "recipe_path", None)
    return pathlib.Path(path).stem if path else "engine"
