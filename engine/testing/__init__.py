"""Fixtures for testing engine plugins: an opt-in pytest plugin (``pytest_plugins =
["engine.testing"]`` in a conftest.py, or ``pytest -p engine.testing``; no ``pytest11``
entry point, so installing the engine changes nobody's test suite). docs/plugins.md,
"Testing a plugin", describes its fixtures and functions, each imported from here: those
of test processes (run_engine, engine_env...) live in :mod:`engine.testing.processes`,
the checkpointer and state part contracts in :mod:`engine.testing.contract`."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

import attrs
import pytest

from engine.cli import build_parser
from engine.config import with_groups
from engine.overrides import apply_overrides
from engine.launching import RecipeJob
from engine.plugin_manager import build_plugin_manager
from engine.recipe import load_recipe
from engine.testing.contract import (  # noqa: F401 (the public names, imported from here)
    CheckpointerContract, assert_same_snapshot, assert_state_part, contract_config,
    contract_state, corrupt_snapshot, save_until_killed)
from engine.testing.processes import (  # noqa: F401 (as above)
    LAUNCHER_VARIABLES, PINNED_MEMORY_INTERVAL, descendants, engine_env, group_processes,
    named_semaphores, pinned, run_engine, run_python, start_engine, start_python)
from engine.world import World

# torch (and engine.engine) is imported inside the functions: this plugin loads without it.

TINY_RECIPE = '''\
"""A tiny recipe for plugin tests: four classes of 8-dimensional points, an MLP."""

import attrs
import torch
from torch import nn
from torch.utils.data import TensorDataset

from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 32
    lr: float = 0.1
    log_every: int = 2
    samples: int = 256


def build_model(cfg):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def build_datasets(cfg, ctx):
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(cfg.samples + 64, 8, generator=g)
    targets = inputs[:, :4].argmax(dim=1)
    n = cfg.samples
    return TensorDataset(inputs[:n], targets[:n]), TensorDataset(inputs[n:], targets[n:])


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr)
'''


def fit(recipe, **arguments: Any) -> dict:
    """``engine.fit`` with the memory tier's interval pinned as :func:`pinned` pins
    engine-run's, unless ``arguments`` give it."""
    from engine import fit as engine_fit  # imports torch: lazily (see the imports)

    return engine_fit(recipe, **{PINNED_MEMORY_INTERVAL.split("=")[0]: 0, **arguments})


def write_distribution(site, name: str, version: str,
                       entry_points: Mapping[str, str] | None = None,
                       files: Mapping[str, str] | None = None) -> pathlib.Path:
    """An installed distribution as pip leaves it (``files``, a ``NAME-VERSION.dist-info``
    with its ``engine.plugins`` entry points) in ``site``: with ``site`` on sys.path,
    entry-point discovery is tested without building a package."""
    site = pathlib.Path(site)
    for relative, text in (files or {}).items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"{ep} = {value}" for ep, value in (entry_points or {}).items()]
    (info / "entry_points.txt").write_text("[engine.plugins]\n" + "\n".join(lines) + "\n")
    return site


def fire_run_end(ctx, status: str = "completed") -> dict:
    """Fire ``engine_run_end`` on a ``make_engine`` engine with a real run's summary."""
    summary = ctx.summary(status)
    ctx.pm.hook.engine_run_end(ctx=ctx, summary=summary)
    return summary


def read_summary(out_dir) -> dict[str, Any]:
    """``<out_dir>/summary.json`` (rank 0 writes it however the run ended)."""
    return json.loads((pathlib.Path(out_dir) / "summary.json").read_text())


def plugin_options(pm, recipe, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``engine.options`` as a worker of ``engine-run RECIPE`` gets it (the plugins'
    options included), then ``given`` (keyed by ``dest``, as ``engine.options`` is)."""
    parser = build_parser()
    pm.hook.engine_addoption.call_historic(kwargs={"parser": parser})
    options = RecipeJob.from_args(parser.parse_args([str(recipe)])).options
    unknown = sorted(set(given or {}) - set(options))
    if unknown:
        raise ValueError(f"make_engine: {', '.join(map(repr, unknown))} is not an option "
                         f"of engine-run or of a loaded plugin; known: "
                         f"{', '.join(sorted(options))}")
    return {**options, **(given or {})}


@attrs.frozen
class RecipeRun:
    returncode: int
    stdout: str
    stderr: str
    out_dir: pathlib.Path

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json of the run (rank 0 writes it however the run ended)."""
        return read_summary(self.out_dir)


# ------------------------------------------------------------------------ fixtures


@pytest.fixture
def tiny_recipe(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("recipe") / "tiny_recipe.py"
    path.write_text(TINY_RECIPE)
    return path


@pytest.fixture
def make_plugin_manager() -> Callable[..., Any]:
    def make(*plugins, autoload: bool = False):
        return build_plugin_manager(plugins, autoload=autoload)

    return make


@pytest.fixture
def make_engine(make_plugin_manager, tiny_recipe, tmp_path) -> Callable[..., Any]:
    from engine.engine import Engine  # imports torch: lazily (see the imports)

    def make(*overrides: str, recipe=None, plugins: Sequence = (), autoload: bool = False,
             options: Mapping[str, Any] | None = None):
        pm = make_plugin_manager(*plugins, autoload=autoload)
        loaded = load_recipe(recipe or tiny_recipe)
        # The plugins' config groups join the recipe's before the overrides, as in a run.
        cfg = apply_overrides(with_groups(loaded.make_config(), pm.config_groups),
                              [f"out_dir={tmp_path / 'run'}", *overrides])
        world = World(rank=0, local_rank=0, world_size=1, local_world_size=1)
        return Engine(pm, loaded, cfg, world, plugin_options(pm, loaded.path, options))

    return make


@pytest.fixture
def run_recipe(tiny_recipe, tmp_path) -> Callable[..., RecipeRun]:
    counter = iter(range(1, 1_000_000))

    def run(*overrides: str, recipe=None, nproc: int = 2, plugins: Sequence[str] = (),
            args: Sequence[str] = (), env: Mapping[str, str] | None = None,
            timeout: float = 300, check: bool = True) -> RecipeRun:
        out_dir = tmp_path / f"run-{next(counter)}"
        command = [str(recipe or tiny_recipe), *overrides, f"out_dir={out_dir}", "--nproc",
                   str(nproc), *args]
        for plugin in plugins:
            command += ["-p", plugin]
        proc = run_engine(command, env=engine_env(env), cwd=tmp_path, timeout=timeout,
                          check=check)
        return RecipeRun(proc.returncode, proc.stdout, proc.stderr, out_dir)

    return run


@pytest.fixture(scope="session")
def install_plugin(tmp_path_factory) -> Callable[..., dict[str, str]]:
    installed: dict[str, dict[str, str]] = {}  # one install per package and session

    def install(path) -> dict[str, str]:
        key = str(pathlib.Path(path).resolve())
        if key not in installed:
            installed[key] = _pip_install_target(path, tmp_path_factory)
        return dict(installed[key])

    return install


def _pip_install_target(path, tmp_path_factory) -> dict[str, str]:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info behind.
    work = tmp_path_factory.mktemp("plugin-build")
    source = work / "src"
    shutil.copytree(path, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    target = work / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--quiet",
                           "--no-deps", "--no-build-isolation", "--target", str(target),
                           str(source)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"pip could not install {path}:\n{proc.stdout}\n{proc.stderr}")
    pythonpath = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": pythonpath}
