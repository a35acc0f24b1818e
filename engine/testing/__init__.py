"""Fixtures for testing engine plugins: an opt-in pytest plugin (``pytest_plugins =
["engine.testing"]`` in a conftest.py, or ``pytest -p engine.testing``; no ``pytest11``
entry point, so installing the engine changes nobody's test suite).

docs/plugins.md, "Testing a plugin", describes the fixtures (``make_plugin_manager``,
``make_engine``, ``tiny_recipe``, ``run_recipe``, ``install_plugin``), the functions
(``fire_run_end``, ``run_engine``, ``read_summary``, ``engine_env``,
``write_distribution``) and :class:`CheckpointerContract` with its helpers. For the
engine's own tests too: :func:`run_python` (``python ARGS`` from the warm server that
:func:`run_engine` forks from), :func:`start_engine` and :func:`start_python` (started
and returned at once, a handle as subprocess.Popen's). A recipe's run gets
``checkpoint.memory_every_steps=0`` unless its arguments set it (:func:`pinned`). State
part contract: :func:`assert_state_part`.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import pytest

from engine.atomic_io import proc_stat
from engine.cli import build_parser
from engine.config import TrainConfig, with_groups
from engine.overrides import apply_overrides
from engine.launch_env import START_METHOD_ENV
from engine.launching import RecipeJob
from engine.plugin_manager import build_plugin_manager
from engine.recipe import load_recipe
from engine.testing import warm_start
from engine.world import World

# torch (and engine.engine, which imports it) is imported inside the functions: loading
# this pytest plugin imports no torch.

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


#: The memory tier's interval a test run gets unless its arguments give one: the default,
#: ``auto``, chooses from measured times, and no test's outcome may depend on the clock.
PINNED_MEMORY_INTERVAL = "checkpoint.memory_every_steps=0"


def pinned(args: Sequence[str]) -> list[str]:
    """``engine-run ARGS`` with :data:`PINNED_MEMORY_INTERVAL` after the recipe (a ``.py``
    file), unless ARGS set ``checkpoint.memory_every_steps`` (``=auto`` to test the
    choice itself); commands (``tune-workers RECIPE``, ``doctor``) are left as they are."""
    args = [str(a) for a in args]
    recipe = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    command = recipe != 0 and not args[0].startswith("-")  # engine-run COMMAND ...
    if recipe is None or command or any(a.startswith("checkpoint.memory_every_steps=")
                                        for a in args):
        return args
    return [*args[:recipe + 1], PINNED_MEMORY_INTERVAL, *args[recipe + 1:]]


def fit(recipe, **arguments: Any) -> dict:
    """``engine.fit`` with the memory tier's interval pinned as :func:`pinned` pins
    engine-run's, unless ``arguments`` give it."""
    from engine import fit as engine_fit  # imports torch: lazily (see the imports)

    return engine_fit(recipe, **{PINNED_MEMORY_INTERVAL.split("=")[0]: 0, **arguments})


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


def fire_run_end(ctx, status: str = "completed") -> dict:
    """Fire ``engine_run_end`` on an engine from ``make_engine`` with the summary a real
    run would have (``status``, ``epochs_completed``, ``wall_time_s``...); returns it."""
    summary = ctx.summary(status)
    ctx.pm.hook.engine_run_end(ctx=ctx, summary=summary)
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
    imported (:mod:`engine.testing.warm_start`; ``ENGINE_TEST_FORK=0`` turns that off); with
    ``program`` (``["engine-run"]``), that program runs in a plain subprocess."""
    env, args = dict(env) if env is not None else engine_env(), pinned(args)
    if program is None and _forkable(env):
        # The server has torch imported: its spawn launchers fork their workers from it
        # too, unless the test chose (engine.launch_env.start_method).
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
    env = dict(env) if env is not None else engine_env()
    if _forkable(env):
        proc = _warm_starter().run(args, env=env, cwd=cwd, timeout=timeout, python=True)
    else:
        proc = subprocess.run([sys.executable, *map(str, args)], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
    return _checked(proc, check, "python")


def start_engine(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None):
    """``engine-run ARGS`` started as :func:`run_engine` runs it, returned at once: a
    process handle with subprocess.Popen's ``pid`` (its own session), ``poll``,
    ``wait``, ``kill`` and ``communicate`` (text output)."""
    env, args = dict(env) if env is not None else engine_env(), pinned(args)
    if _forkable(env):
        env.setdefault(START_METHOD_ENV, "fork")  # as run_engine
        return _warm_starter().start(args, env=env, cwd=cwd)
    return _popen([sys.executable, "-m", "engine", *map(str, args)], env, cwd)


def start_python(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd=None):
    """``python ARGS`` started as :func:`run_python` runs it, returned at once, as
    :func:`start_engine` starts engine-run."""
    env = dict(env) if env is not None else engine_env()
    if _forkable(env):
        return _warm_starter().start(args, env=env, cwd=cwd, python=True)
    return _popen([sys.executable, *map(str, args)], env, cwd)


def _forkable(env: Mapping[str, str]) -> bool:
    """Whether a command with environment ``env`` may be a fork of the warm server: not
    one that may use a GPU of this machine. The server's imports ask torch about CUDA
    (inductor's do), and torch refuses CUDA in a fork of a process that asked ("Cannot
    re-initialize CUDA in forked subprocess"): such a command is a fresh process."""
    return warm_start.enabled() and (env.get("CUDA_VISIBLE_DEVICES") == ""
                                     or not os.path.exists("/dev/nvidiactl"))


def _popen(command: list[str], env: Mapping[str, str], cwd) -> subprocess.Popen:
    """A plain subprocess as the warm server's children are: its own session, text
    output captured, and ``kill()`` ending that session (its workers too)."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.kill = lambda: warm_start.kill_session(proc.pid)
    return proc


def _checked(proc: subprocess.CompletedProcess, check: bool,
             what: str) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed with code {proc.returncode}:\n"
                             f"{' '.join(map(str, proc.args))}\n{proc.stdout}\n{proc.stderr}")
    return proc


@functools.cache
def _warm_starter():
    """One warm-start server per test session (started on its first command)."""
    return warm_start.WarmStarter()


def plugin_options(pm, recipe, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``engine.options`` as a worker of ``engine-run RECIPE`` gets it: the defaults of
    every command-line option, those the plugins add included (``engine_addoption``),
    then ``given`` (keyed by ``dest``, as ``engine.options`` is)."""
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


# ------------------------------------------------------- the checkpointer contract


def contract_state(step: int, numel: int = 24) -> dict:
    """A snapshot-shaped dict whose every tensor holds ``step`` (easy to check whole):
    "model" and "optimizer" as a sharded format gets them (keyed by parameter name),
    and the plain values the rest of a snapshot holds (ints, floats, strings, None,
    nested lists and dicts, a bfloat16 and an empty tensor). ``numel``: the size of the
    model's largest tensor (four bytes each)."""
    import torch

    value = float(step)
    return {"model": {"fc.weight": torch.full((numel,), value),
                      "fc.bias": torch.full((6,), value),
                      "norm.num_batches_tracked": torch.tensor(step)},
            "optimizer": {"state": {"fc.weight": {"momentum_buffer":
                                                  torch.full((numel,), -value)}},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                            "params": ["fc.weight", "fc.bias"]}]},
            "epoch": step, "step": step, "engine_version": "contract",
            "config": {"lr": 0.1, "data": {"source": "synthetic", "sizes": [8, 16]}},
            "progress": {"epoch_loss": None, "history": [0.5, value]},
            "rng": {"torch": torch.full((16,), step % 256, dtype=torch.uint8)},
            "half": torch.full((2, 3), value, dtype=torch.bfloat16),
            "empty": torch.empty(0, 5)}


def assert_same_snapshot(loaded, expected, where: str = "snapshot") -> None:
    """``loaded`` holds exactly ``expected``: the same keys, tensors of the same dtype,
    shape and values, the same plain values."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), f"{where}: {type(loaded).__name__}, not a tensor"
        assert (loaded.dtype, loaded.shape) == (expected.dtype, expected.shape), (
            f"{where}: {loaded.dtype} {tuple(loaded.shape)}, expected {expected.dtype} "
            f"{tuple(expected.shape)}")
        assert torch.equal(loaded.cpu(), expected), f"{where}: other values"
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and set(loaded) == set(expected), (
            f"{where}: keys {sorted(map(str, loaded))}, expected {sorted(map(str, expected))}")
        for key, value in expected.items():
            assert_same_snapshot(loaded[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(loaded, (list, tuple)) and len(loaded) == len(expected), (
            f"{where}: {loaded!r}, expected {expected!r}")
        for i, (got, value) in enumerate(zip(loaded, expected)):
            assert_same_snapshot(got, value, f"{where}[{i}]")
    else:
        assert loaded == expected, f"{where}: {loaded!r}, expected {expected!r}"


def assert_state_part(part) -> None:
    """A state part as the engine uses it, checked without a process group: it is
    ``Stateful``; the state a memory snapshot takes of it (``local_state_dict()``, else
    ``state_dict()``) needs no collective, goes through the memory tier's codec and
    comes back through ``load_state_dict`` to itself."""
    from engine import shm_codec
    from engine.stateful import SnapshotParts

    parts = SnapshotParts()
    parts.add("part", part)  # Stateful, or the engine's one-line error
    state = parts.local_state_dict()["part"]
    skeleton, tensors, _, _ = shm_codec.encode(state)
    by_offset = {offset: tensor for offset, tensor in tensors}
    part.load_state_dict(shm_codec.decode(skeleton, lambda offset, dtype, shape: (
        by_offset[offset].detach().cpu().clone().reshape(shape))))
    assert_same_snapshot(parts.local_state_dict()["part"], state, "its state after a load")


def corrupt_snapshot(path, how: str = "flip") -> None:
    """Flip one byte in the middle of the snapshot at ``path`` (its largest file when it
    is a folder), the size unchanged; or, with ``how="truncate"``, cut its last byte
    off."""
    path = pathlib.Path(path)
    target = max(path.iterdir(), key=lambda p: p.stat().st_size) if path.is_dir() else path
    data = bytearray(target.read_bytes())
    if how == "truncate":
        del data[-1]
    else:
        data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def contract_config(keep_last: int = 0, best_metric: str = "", best_mode: str = "max"):
    """A TrainConfig whose ``checkpoint`` group holds these values."""
    cfg = TrainConfig()
    cfg.checkpoint.keep_last = keep_last
    cfg.checkpoint.best_metric = best_metric
    cfg.checkpoint.best_mode = best_mode
    return cfg


#: How the contract's killed writer starts: a new interpreter (no OpenMP pool forked
#: from pytest's, which can deadlock a forked child) that imports the contract class.
_KILLED_WRITER = ("import sys, torch; torch.set_num_threads(1); import engine.testing as t; "
                  "t.save_until_killed(*sys.argv[1:])")


def save_until_killed(contract: str, directory: str, numel: str) -> None:
    """The writer that the contract kills: ``contract`` (``module:Class``) makes the
    checkpointer, which saves :func:`contract_state` of steps 2, 3, ... until killed."""
    module, _, qualname = contract.partition(":")
    cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    checkpointer = cls().make_checkpointer(pathlib.Path(directory), contract_config())
    step = 1
    while True:
        step += 1
        checkpointer.save(contract_state(step, int(numel)), epoch=step, step=step)
        checkpointer.wait()


def _in_flight(directory: pathlib.Path) -> list[str]:
    """Names of writes under way (or killed): temp files and staging folders, which the
    engine's stores name with a leading dot."""
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def _wait_until_group_is_gone(group: int, timeout: float = 60) -> None:
    """Until no live process is left in process group ``group`` (a SIGKILLed process
    inside an fsync dies when the fsync returns; the next start would take its temp
    file for a live writer's). Zombies count as gone, as the store counts them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_processes(group):
            return
        time.sleep(0.01)
    raise AssertionError(f"processes of the killed writer still run after {timeout:g} s")


def _live_processes():
    """(PID, its /proc/PID/stat fields) of every live process; zombies count as gone,
    and so does a process that ends while we look."""
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields and fields[0] != "Z":
            yield entry.name, fields


def group_processes(group: int) -> list[str]:
    """The PIDs of the live processes of process group ``group``."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == group]


def descendants(pid: int) -> list[str]:
    """The PIDs of the live processes started, at any depth, by process ``pid``."""
    children: dict[str, list[str]] = {}
    for child, fields in _live_processes():
        children.setdefault(fields[1], []).append(child)
    found, todo = [], [str(pid)]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def named_semaphores(pids: list[str]) -> set[str]:
    """The /dev/shm/sem.* files these processes have mapped that still have a name (a
    semaphore unlinked as soon as it was made shows as "(deleted)"): what a kill of
    them all would leave behind."""
    names = set()
    for pid in pids:
        try:
            maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(line.split()[-1] for line in maps.splitlines()
                     if "/dev/shm/sem." in line and not line.endswith("(deleted)"))
    return names


class CheckpointerContract:
    """What the engine relies on from a checkpointer, as tests. Subclass it in a test
    module and name your class; pytest runs every check against it::

        class TestMyStore(CheckpointerContract):
            checkpointer_class = MyStore

    The checks: ``save`` then ``latest()`` then ``load`` round-trips a state dict of
    tensors and plain values (at another ``map_location`` too, and in a new
    checkpointer, as the next run sees it); ``snapshots()`` lists them oldest first; a
    snapshot saved again under its name replaces the old one whole;
    ``checkpoint.keep_last`` prunes the oldest; ``best()`` names the best by
    ``checkpoint.best_metric`` and is never pruned; ``resolve()`` takes a pointer, a
    checkpoint folder or a run folder for the snapshot it names; ``verify()`` reports a
    corrupt and a truncated snapshot, and ``latest()`` skips it for the previous one; a
    write killed half-way (SIGKILL of a real process, its whole process group)
    leaves the previous snapshot usable, and the next start removes what it left
    (names that start with a dot); ``close()`` may be called twice.

    Override :meth:`make_checkpointer` when the class needs more than
    ``(directory, cfg)``. The killed write runs in a new process that imports the test
    class by its module and name, so define it at the top level of a test module
    pytest can import by name (a rootdir-relative module, as pytest's importlib and
    prepend modes give). A check that does not apply to a class (a format that keeps
    no ``best``) is overridden in the subclass with a ``pytest.skip`` saying why.
    """

    #: The checkpointer class under test.
    checkpointer_class: type | None = None
    #: Elements of the largest tensor of the snapshot the killed writer saves (four
    #: bytes each): large enough that the write takes a while.
    killed_write_numel: int = 8 << 20

    def make_checkpointer(self, directory: pathlib.Path, cfg):
        """A checkpointer of the class under test, storing in ``directory``."""
        return self.checkpointer_class(directory, cfg)

    @pytest.fixture
    def open_checkpointer(self, tmp_path):
        """``open_checkpointer(keep_last=0, best_metric="", best_mode="max",
        directory=None)``: a checkpointer of the class under test in
        ``tmp_path/checkpoints`` (unless ``directory``); closed after the test."""
        made = []

        def open_(keep_last: int = 0, best_metric: str = "", best_mode: str = "max",
                  directory=None):
            checkpointer = self.make_checkpointer(
                pathlib.Path(directory or tmp_path / "checkpoints"),
                contract_config(keep_last, best_metric, best_mode))
            made.append(checkpointer)
            return checkpointer

        yield open_
        for checkpointer in made:
            checkpointer.close()

    # ---------------------------------------------------------------- checks

    def test_save_latest_load_round_trip(self, open_checkpointer):
        ck = open_checkpointer()
        assert ck.latest() is None and ck.snapshots() == []
        first = ck.save(contract_state(1), epoch=1, step=10, metrics={"val/loss": 2.0})
        second = ck.save(contract_state(2), epoch=1, step=20, metrics={"val/loss": 1.0})
        ck.wait()
        assert first != second and ck.snapshots() == [first, second]
        assert ck.latest() == second
        assert ck.verify(first) is None and ck.verify(second) is None
        assert_same_snapshot(ck.load(second), contract_state(2))
        assert_same_snapshot(ck.load(first, map_location="cpu"), contract_state(1))
        next_run = open_checkpointer()
        assert next_run.latest() == second and next_run.snapshots() == [first, second]
        assert_same_snapshot(next_run.load(second), contract_state(2))

    def test_a_snapshot_saved_again_under_its_name_replaces_the_old_one_whole(
            self, open_checkpointer):
        ck = open_checkpointer()
        ck.save(contract_state(1), epoch=3, step=7)
        path = ck.save(contract_state(2), epoch=3, step=7)
        ck.wait()
        assert ck.snapshots() == [path] and ck.latest() == path
        assert_same_snapshot(ck.load(path), contract_state(2))

    def test_keep_last_prunes_the_oldest(self, open_checkpointer):
        ck = open_checkpointer(keep_last=2)
        paths = [ck.save(contract_state(step), epoch=step, step=step) for step in (1, 2, 3, 4)]
        ck.wait()
        assert ck.snapshots() == paths[2:]
        assert not any(path.exists() for path in paths[:2])
        assert ck.latest() == paths[3]
        assert_same_snapshot(ck.load(paths[2]), contract_state(3))

    @pytest.mark.parametrize("mode, values, best_index", [
        ("max", [0.2, 0.9, 0.4, 0.5, 0.3], 1), ("min", [0.5, 0.1, 0.4, 0.3, 0.2], 1)])
    def test_best_is_pointed_at_and_never_pruned(self, open_checkpointer, mode, values,
                                                 best_index):
        ck = open_checkpointer(keep_last=2, best_metric="val/score", best_mode=mode)
        assert ck.best() is None
        paths = [ck.save(contract_state(step), epoch=step, step=step,
                         metrics={"val/score": value})
                 for step, value in enumerate(values, start=1)]
        ck.wait()
        best = paths[best_index]
        assert ck.best() == best
        assert ck.snapshots() == [best, *paths[-2:]]
        assert ck.latest() == paths[-1]
        assert_same_snapshot(ck.load(best), contract_state(best_index + 1))

    def test_resolve_takes_a_pointer_or_a_folder_for_the_snapshot_it_names(
            self, open_checkpointer):
        ck = open_checkpointer(best_metric="val/score")
        best = ck.save(contract_state(1), epoch=1, step=1, metrics={"val/score": 1.0})
        latest = ck.save(contract_state(2), epoch=2, step=2, metrics={"val/score": 0.0})
        ck.wait()
        folder = ck.directory
        for given in (folder / "latest", folder, folder.parent):
            assert ck.resolve(str(given)) == latest, given
        assert ck.resolve(str(folder / "best")) == best
        assert ck.resolve(str(best)) == best  # a snapshot is itself
        missing = folder.parent / "nope"
        assert ck.resolve(str(missing)) == missing

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_verify_reports_a_damaged_snapshot_and_latest_skips_it(self, open_checkpointer,
                                                                     how):
        ck = open_checkpointer()
        first = ck.save(contract_state(1), epoch=1, step=1)
        second = ck.save(contract_state(2), epoch=2, step=2)
        ck.wait()
        corrupt_snapshot(second, how)
        problem = ck.verify(second)
        assert isinstance(problem, str) and problem, problem
        assert ck.verify(first) is None
        assert ck.latest() == first
        assert_same_snapshot(ck.load(first), contract_state(1))

    def test_a_write_killed_half_way_leaves_the_previous_snapshot_usable(
            self, open_checkpointer, tmp_path):
        """A real writer process, SIGKILLed (with its process group: a store's helper
        processes too) as soon as its write has put something in the folder, up to
        three times until one kill leaves the write unfinished."""
        ck = open_checkpointer()
        first = ck.save(contract_state(1), epoch=1, step=1)
        ck.close()
        env = engine_env({"PYTHONPATH": os.pathsep.join(filter(None, sys.path))})
        contract = f"{type(self).__module__}:{type(self).__qualname__}"
        for _ in range(3):
            before = set(os.listdir(ck.directory))
            proc = subprocess.Popen(
                [sys.executable, "-c", _KILLED_WRITER, contract, str(ck.directory),
                 str(self.killed_write_numel)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            try:
                deadline = time.monotonic() + 120
                while set(os.listdir(ck.directory)) == before:  # the write has begun
                    assert proc.poll() is None, f"the writer exited:\n{proc.communicate()[1]}"
                    assert time.monotonic() < deadline, "no write started in 120 s"
                    time.sleep(0.001)
                os.killpg(proc.pid, signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=60)
            _wait_until_group_is_gone(proc.pid)
            unfinished = _in_flight(ck.directory)
            next_run = open_checkpointer()
            chosen = next_run.latest()
            assert chosen is not None
            if unfinished:  # the kill landed inside the write: it never counted
                assert chosen == first, (chosen, unfinished)
            loaded = next_run.load(chosen)
            assert_same_snapshot(loaded, contract_state(loaded["step"], loaded["model"][
                "fc.weight"].numel()))
            assert _in_flight(ck.directory) == [], "the next start left leftovers"
            if unfinished:
                return
        pytest.fail("three kills, each after its write had finished: make "
                    "killed_write_numel larger")

    def test_close_may_be_called_twice(self, open_checkpointer, tmp_path):
        ck = open_checkpointer()
        path = ck.save(contract_state(1), epoch=1, step=1)
        ck.close()
        ck.close()
        assert ck.latest() == path
        unused = open_checkpointer(directory=tmp_path / "unused")
        unused.close()
        unused.close()
        assert not (tmp_path / "unused").exists(), "closing one that never saved wrote"
