"""Fixtures for testing engine plugins: an opt-in pytest plugin.

It is not loaded automatically (no ``pytest11`` entry point), so installing the engine
changes nobody's test suite. Enable it in your plugin's tests with::

    # conftest.py (at the root of your tests)
    pytest_plugins = ["engine.testing"]

or on the command line: ``pytest -p engine.testing``. Fixtures:

``make_plugin_manager(*plugins, autoload=False)``
    The engine's plugin manager with the built-ins plus ``plugins`` (plugin objects, or
    the strings of ``-p``: module paths, entry-point names, ``no:NAME``). Entry-point
    autoload is off unless asked for, so other installed plugins cannot interfere.
``make_engine(*overrides, recipe=None, plugins=(), autoload=False, options=None)``
    An :class:`engine.engine.Engine` as a rank-0 worker of a one-process world would
    have it before training (plugin manager, recipe, config with the plugins' config
    groups and ``out_dir`` in a temporary folder, ``engine.options`` with every option's
    default, those the plugins add included, updated by ``options``:
    ``{"csv_every": 5}``), for calling hooks directly:
    ``eng.pm.hook.engine_log(engine=eng, metrics={"train/loss": 1.0}, step=1)``, then
    ``engine.testing.fire_run_end(eng)`` for ``engine_run_end`` with a real summary.
``tiny_recipe``
    The path of a recipe that trains a small network on synthetic data in a second or
    two (``Config``: epochs=2, batch_size=32, log_every=2, 256 samples).
``run_recipe(*overrides, recipe=None, nproc=2, plugins=(), args=(), env=None)``
    Runs ``engine-run`` in a new process, 2 workers on the CPU with gloo by default,
    ``out_dir`` in a temporary folder; returns a :class:`RecipeRun` (return code,
    stdout, stderr, out_dir and the parsed summary.json).
``run_engine(args, env=None, cwd=None, timeout=300, check=False)`` (a function)
    ``engine-run ARGS`` in a new process, forked from a server that has torch imported
    (seconds saved per run: :mod:`engine.warm_start`; ``ENGINE_TEST_FORK=0`` runs a plain
    subprocess instead), whose spawn launcher forks its workers from it as well
    (``ENGINE_START_METHOD=fork`` unless ``env`` says otherwise); ``read_summary(out_dir)``: a run's
    summary.json; ``engine_env(extra)``: the environment for a test run (CPU only, no
    launcher variables).
``run_python(args, env=None, cwd=None, timeout=300, check=False)`` (a function)
    ``python ARGS`` (a script, ``-m MODULE`` or ``-c CODE``) forked from the same warm
    server, for tools and example scripts.
``write_distribution(site, name, version, entry_points, files)`` (a function)
    A minimal installed distribution in a folder, without pip: for tests of discovery.
``install_plugin(path)``
    ``pip install --no-deps --target`` of the package at ``path`` into a temporary
    folder; returns the environment (PYTHONPATH) under which ``engine-run`` finds its
    entry points, for ``run_recipe(env=...)``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Callable, Mapping, Sequence

import attrs
import pytest

from engine.launcher import START_METHOD_ENV

#: Variables of launchers and schedulers that would make a run adopt them; a test run
#: starts its own workers, so they are removed.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

TINY_RECIPE = '''\
"""A tiny recipe for plugin tests: four classes of 8-dimensional points, an MLP."""

import attrs
import torch
from torch import nn
from torch.utils.data import TensorDataset

from engine import TrainConfig


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


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ for a test run: CPU only, no launcher variables, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def write_distribution(site, name: str, version: str,
                       entry_points: Mapping[str, str] | None = None,
                       files: Mapping[str, str] | None = None) -> pathlib.Path:
    """Write an installed distribution as pip would leave it (``files`` and a
    ``NAME-VERSION.dist-info`` folder with its ``engine.plugins`` entry points) into the
    folder ``site``. With ``site`` on sys.path or PYTHONPATH, importlib.metadata finds
    it: a quick way to test entry-point discovery without building a package."""
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


def fire_run_end(eng, status: str = "completed") -> dict:
    """Fire ``engine_run_end`` on an engine from ``make_engine`` with the summary a real
    run would have (``status``, ``epochs_completed``, ``wall_time_s``...); returns it."""
    summary = eng.summary(status)
    eng.pm.hook.engine_run_end(engine=eng, summary=summary)
    return summary


def read_summary(out_dir) -> dict[str, Any]:
    """``<out_dir>/summary.json`` (rank 0 writes it however the run ended)."""
    return json.loads((pathlib.Path(out_dir) / "summary.json").read_text())


def run_engine(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None,
               timeout: float = 300, check: bool = False,
               program: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """``engine-run ARGS`` in a new process (``env``: :func:`engine_env` unless given),
    output captured as text. ``check``: a failed run is an AssertionError showing the
    command and its output. The process is forked from a warm server that has torch
    imported (:mod:`engine.warm_start`; ``ENGINE_TEST_FORK=0`` turns that off); with
    ``program`` (``["engine-run"]``), that program runs in a plain subprocess."""
    from engine import warm_start

    env = dict(env) if env is not None else engine_env()
    if program is None and warm_start.enabled():
        # The server has torch imported: its spawn launchers fork their workers from it
        # too, unless the test chose (2-5 s saved per run; engine.launcher.start_method).
        env.setdefault(START_METHOD_ENV, "fork")
        proc = _warm_starter().run(args, env=env, cwd=cwd, timeout=timeout)
    else:
        command = [*(program or (sys.executable, "-m", "engine")), *map(str, args)]
        proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    return _checked(proc, check, "engine-run")


def run_python(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None,
               timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` (``SCRIPT ...``, ``-m MODULE ...`` or ``-c CODE ...``) in a new
    process forked from the same warm server, as :func:`run_engine` runs engine-run:
    for a tool or an example script, without a Python and torch start per call. Not
    for what a fresh interpreter imports (the server has torch imported)."""
    from engine import warm_start

    env = dict(env) if env is not None else engine_env()
    if warm_start.enabled():
        proc = _warm_starter().run(args, env=env, cwd=cwd, timeout=timeout, python=True)
    else:
        proc = subprocess.run([sys.executable, *map(str, args)], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
    return _checked(proc, check, "python")


def _checked(proc: subprocess.CompletedProcess, check: bool,
             what: str) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed with code {proc.returncode}:\n"
                             f"{' '.join(map(str, proc.args))}\n{proc.stdout}\n{proc.stderr}")
    return proc


@functools.cache
def _warm_starter():
    """One warm-start server per test session (started on its first command)."""
    from engine.warm_start import WarmStarter

    return WarmStarter()


def plugin_options(pm, recipe, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``engine.options`` as a worker of ``engine-run RECIPE`` gets it: the defaults of
    every command-line option, those the plugins add included (``engine_addoption``),
    then ``given`` (keyed by ``dest``, as ``engine.options`` is)."""
    from engine.cli import build_parser
    from engine.launching import RecipeJob

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
    from engine.plugin_manager import build_plugin_manager

    def make(*plugins, autoload: bool = False):
        specs = [p for p in plugins if isinstance(p, str)]
        objects = {_object_name(p): p for p in plugins if not isinstance(p, str)}
        return build_plugin_manager(specs, autoload=autoload, objects=objects)

    return make


def _object_name(plugin: object) -> str:
    return getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin):x}"


@pytest.fixture
def make_engine(make_plugin_manager, tiny_recipe, tmp_path) -> Callable[..., Any]:
    from engine.config import apply_overrides, with_groups
    from engine.engine import Engine
    from engine.recipe import load_recipe
    from engine.world import World

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
