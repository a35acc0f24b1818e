"""Public names are an API: config keys, engine-run's options and commands, the hooks and
their arguments, the keys of summary.json and the metrics a run logs. Each one is listed
in tests/engine/public_names.txt; a name that disappears or appears fails here, so that a
rename cannot go unnoticed. A renamed name keeps working for a stated deprecation
period, with a one-line warning naming the new one, and both go in CHANGELOG.md.

``ENGINE_UPDATE_PUBLIC_NAMES=1 pytest tests/engine/test_public_names.py`` rewrites the
list after a deliberate change (then say it in CHANGELOG.md).
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import pathlib

import pytest

LISTED = pathlib.Path(__file__).with_name("public_names.txt")


def declared_names() -> set[str]:
    """What the code declares: config keys (with the built-in plugins' groups), options,
    commands, hooks with their arguments."""
    from engine import cli, config, hookspecs
    from engine.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    cfg = config.with_groups(config.TrainConfig(), pm.config_groups)
    names = {f"config {key}" for key in config.all_keys(cfg)}
    names |= {f"option {flag}" for action in cli.build_parser(pm)._actions
              for flag in action.option_strings}
    names |= {f"command {name}" for name in cli.COMMANDS}
    names |= {f"hook {name}({', '.join(inspect.signature(spec).parameters)})"
              for name, spec in vars(hookspecs).items()
              if name.startswith("engine_") and callable(spec)}
    return names


def produced_names(run: pathlib.Path) -> set[str]:
    """What a completed 2-process run wrote: summary.json's keys, metrics.csv's columns
    and the names of the metrics it logged."""
    summary = json.loads((run / "summary.json").read_text())
    names = {f"summary {key}" for key in summary}
    names |= {f"summary metrics.{key}" for key in summary["metrics"]}
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names |= {f"metrics.csv {column}" for column in rows[0]}
    names |= {f"metric {row['name']}" for row in rows}
    return names


def test_every_public_name_is_listed_and_every_listed_one_still_exists(reference):
    reference[2]  # the session's completed 2-process run of tests/recipes/tiny_resume.py
    current = declared_names() | produced_names(reference.folders[2])
    if os.environ.get("ENGINE_UPDATE_PUBLIC_NAMES") == "1":
        LISTED.write_text("".join(f"{name}\n" for name in sorted(current)))
    listed = set(LISTED.read_text().splitlines())
    gone, new = sorted(listed - current), sorted(current - listed)
    if gone:
        pytest.fail(f"public names gone: {', '.join(gone)}. A renamed name keeps working "
                    "for a deprecation period with a one-line warning naming the new one "
                    "(CHANGELOG.md says so); remove it from tests/engine/public_names.txt "
                    "when the period ends")
    assert not new, (f"new public names: {', '.join(new)}: add them to "
                     "tests/engine/public_names.txt (ENGINE_UPDATE_PUBLIC_NAMES=1 rewrites "
                     "it) and to CHANGELOG.md")
