"""Shared fixtures. Multi-process tests are real: worker processes on the CPU with gloo."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

# OpenMP threads that find no work sleep rather than spin (libgomp's default spins). The
# suite runs more torch threads than the machine has cores (three pytest workers, each
# run's processes, their threads): spinning threads then take the cores from those with
# work. A ResNet step of the bench smoke test took 1.1 s of CPU and 12 s of wall time
# spinning against 0.06 s and 0.5 s passive, on the loaded 2-core machine (issue 39).
# Read once, when torch loads OpenMP: set here, before any import of torch, for this
# process, and inherited by every process the tests start (engine_env copies os.environ).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Bytecode caches, where the environment turned them off (PYTHONDONTWRITEBYTECODE=1, as
# on the CI machines): without them every interpreter the suite starts (torchrun agents
# and workers, srun tasks, spawned workers, inner pytest runs) compiles the engine again,
# and every pytest worker rewrites every test module's asserts again (issue 46). They are
# written under __pycache__ (ignored by git), each file atomically.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# The default torch threads count the machine's load (engine/threads.py's
# choose_threads): pinned to none, so that every run of a test trains with the same
# threads (their number changes a run's last bits) whatever else the machine runs.
os.environ.setdefault("ENGINE_LOAD_AVERAGE", "0")

from engine import testing  # noqa: E402 (after the OpenMP setting)
from engine.testing import read_summary  # noqa: E402,F401 (the tests import it from here)
from tests import profiling, slurm_cluster  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
ENGINE_RUN = str(BIN / "engine-run")


def engine_env(**extra: str) -> dict[str, str]:
    """engine.testing's environment for a run (CPU only, no launcher or SLURM
    variables), with this venv's tools on PATH and the repository importable, so that
    workers can load test plugins: ``-p tests.fault_plugin``."""
    return testing.engine_env({
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                    os.environ.get("PYTHONPATH")])),
        **extra})


def run_cli(*args: str, cwd=None, env=None, timeout: float = 240, check: bool = False,
            script: bool = False) -> subprocess.CompletedProcess:
    """Run ``engine-run ARGS`` in a new process forked from a warm one
    (engine.testing.warm_start: the same engine.cli.main, without paying for Python and
    torch to start again); stdout and stderr are captured as text. ``script``: run the
    installed ``engine-run`` script in a plain subprocess instead, as a user would."""
    return testing.run_engine(args, env=env or engine_env(), cwd=cwd or REPO,
                              timeout=timeout, check=check,
                              program=[ENGINE_RUN] if script else None)


def run_cli_here(*args: str, env=None, check: bool = False) -> subprocess.CompletedProcess:
    """``engine-run ARGS`` run in this process, with ``env`` as the whole environment, for
    commands that start no worker: ``doctor``, ``plugins``, ``--help``, ``--dry-run`` and
    bad input. The same ``engine.cli.main`` the script calls, minus a Python and torch
    start (2-4 s) per call. Plugins must be importable here (not installed by the test)."""
    from engine import cli

    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env or engine_env())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exc:  # argparse: --help and usage errors
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    proc = subprocess.CompletedProcess(["engine-run", *args], code, out.getvalue(),
                                       err.getvalue())
    if check:
        proc.check_returncode()
    return proc


def killed_then_resumed(*args: str, tmp_path, step: int,
                        rank: int = 1) -> subprocess.CompletedProcess:
    """``engine-run ARGS -p tests.fault_plugin`` with rank ``rank`` SIGKILLed right after
    optimizer step ``step``, then the same command again, which resumes; returns the
    resumed run (checked)."""
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(step),
                       ENGINE_FAULT_RANK=str(rank),
                       ENGINE_FAULT_ONCE=str(tmp_path / "fault-done"))
    args = (*args, "-p", "tests.fault_plugin")
    killed = run_cli(*args, env=fault)
    assert killed.returncode != 0, f"the fault was not injected\n{killed.stderr}"
    return run_cli(*args, env=fault, check=True)


def made_once_per_session(tmp_path_factory, name: str, make, timeout: float = 600
                          ) -> pathlib.Path:
    """``<session temp>/<name>``, made by ``make(folder)`` the first time a test of this
    session asks for it, on any pytest-xdist worker: the others wait for it (a lock) and
    then read it, rather than each worker making the same reference run again. A failed
    ``make`` leaves it to the next asker. The folder is to be read, not written."""
    import fcntl
    import shutil
    import time

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the controller's session folder, above each worker's
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + timeout  # the maker's own run has a timeout too
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{name}: another worker held it " \
                    f"for {timeout} s"
                time.sleep(0.2)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@contextlib.contextmanager
def small_disk(folder: pathlib.Path, size: str):
    """A tmpfs of ``size`` mounted on ``folder``: a real full disk (ENOSPC from the
    kernel, mid-write, as torch.save meets it). Root only (CI runs tests as root)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def cifar_recipe() -> str:
    return str(REPO / "recipes" / "cifar_ddp.py")


#: Overrides for a CIFAR run that takes a few seconds: small synthetic data, 1 epoch.
QUICK = ("data.source=synthetic", "data.synthetic_size=512", "epochs=1", "log_every=4")


def pytest_configure(config):
    profiling.register(config)  # ENGINE_TEST_PROFILE=FOLDER: where the time goes


# ---------------------------------------------------------------- what may be skipped
#
# A skipped test is a test that did not run, and a green run must not hide that. The only
# skips allowed: tests marked cuda on a machine without a CUDA device, and tests marked
# slurm where the user opted out of SLURM (tests/slurm_cluster.py). Anything else skipped
# fails the session, with the list in the summary.


def pytest_runtest_setup(item):
    if item.get_closest_marker("slurm") is not None:
        problem = slurm_cluster.problem()
        if problem is not None:
            if slurm_cluster.opted_out():
                pytest.skip(f"{problem} ({slurm_cluster.OPT_OUT} is set)")
            pytest.fail(f"{problem}; or set {slurm_cluster.OPT_OUT}=1 where SLURM is "
                        "deliberately unavailable", pytrace=False)


_UNEXPECTED_SKIPS: list[str] = []


def _may_skip(keywords) -> bool:
    # Markers are read from the report's keywords, not from the collected items: with
    # pytest-xdist the reports reach a controller process that collected nothing.
    return "cuda" in keywords or ("slurm" in keywords and slurm_cluster.opted_out())


# ------------------------------------------------------------- parallel workers
#
# `pytest` runs on three pytest-xdist workers (addopts: -n 3 --dist loadscope): most
# tests wait on worker processes, sockets and timeouts rather than on the CPU. loadscope
# gives each test module to one worker, so that a module's shared reference runs
# (module-scoped fixtures) run once. The modules with tests on the local SLURM cluster
# share one scope, so they run one after another on one worker: two jobs at once would
# queue for the cluster's nodes and could run into each other's timeouts.

SLURM_SCOPE = "the local SLURM cluster"


@functools.cache
def _uses_the_slurm_cluster(path: pathlib.Path) -> bool:
    """Whether the module's code (not a string in it: tests/test_conftest.py writes
    modules marked slurm for an inner pytest) names ``pytest.mark.slurm``."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return False
    return any(isinstance(node, ast.Attribute) and node.attr == "slurm" and
               isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(tree))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneScopeForSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if _uses_the_slurm_cluster(config.rootpath / module):
                return SLURM_SCOPE
            return super()._split_scope(nodeid)

    return OneScopeForSlurm(config, log)


# ---------------------------------------------------------------- the quick loop
#
# `pytest -m "not slow"` runs in about a minute: it leaves out every test that starts a
# process (engine-run, workers, torchrun, srun, a script, the async checkpointer's
# writer). Such a test is found by what
# it calls (in its body, its fixtures, or a helper of its module it calls), so a new
# test needs no marker to be placed right.

STARTS_PROCESSES = re.compile(
    r"\b(run_cli|run_recipe|run_engine|run_python|start_python|srun|torchrun_cmd|spawn_workers|"
    r"start_processes|"
    r"launch|mp\.spawn|AsyncFileCheckpointer|WarmStarter)\(|\bsubprocess\.|\bPopen\(")


@functools.cache
def _definitions(path: str) -> dict:
    """Each function's and class's source in a file, keyed by its first line (the first
    decorator's, as a code object's co_firstlineno) and by class name: one parse per
    file, where inspect.getsource tokenizes the file again for each (a third of the
    collection's time, in each pytest worker)."""
    import ast

    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return {}
    lines, found = text.splitlines(keepends=True), {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            source = "".join(lines[first - 1:node.end_lineno])
            found[first] = source
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, source)
    return found


def _source(thing) -> str:
    """The source of a function or class; "" where it cannot be found."""
    thing = inspect.unwrap(thing)  # a @contextmanager helper's own function
    code = getattr(thing, "__code__", None)
    try:
        if code is not None:
            return _definitions(code.co_filename).get(code.co_firstlineno, "")
        return _definitions(inspect.getsourcefile(thing) or "").get(thing.__name__, "")
    except TypeError:  # a built-in class: no file
        return ""


@functools.cache
def _starts_processes(function) -> bool:
    source = _source(function)
    if STARTS_PROCESSES.search(source):
        return True
    module = inspect.getmodule(function)
    helpers = (getattr(module, name, None) for name in re.findall(r"\b(\w+)\(", source))
    # A helper class counts by its whole source: a test calls its methods by attribute.
    return any((inspect.isfunction(h) or inspect.isclass(h)) and h is not function and
               _is_ours(h) and STARTS_PROCESSES.search(_source(h)) for h in helpers)


def _is_ours(function) -> bool:
    """A helper of the test suite or engine.testing (not torch's, not the engine's)."""
    return (function.__module__ or "").startswith(("tests.", "engine.testing"))


def _mark_slow(item) -> None:
    functions = [getattr(item, "function", None)]
    for name in item.fixturenames:
        functions += [d.func for d in item._fixtureinfo.name2fixturedefs.get(name, ())]
    if any(f is not None and _starts_processes(f) for f in functions):
        item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------ the order of modules
#
# With -n 3 --dist loadscope the suite lasts as long as its busiest worker, and a module
# of a few long tests handed out last leaves the other workers idle meanwhile. xdist's
# own order (most tests first, --loadscope-reorder) put exactly those modules last
# (test_memory_kill_loop: 1 test, 44 s), so pyproject.toml turns it off and the modules
# measured longest (their tests' durations summed, 2026-11-29; test_preemption stands
# for the SLURM scope) are handed out first; the rest follow in collection order. A
# module missing here only runs in its turn: no test depends on it.
LONGEST_FIRST = (
    "tests/test_combinations.py", "tests/engine/test_preemption.py",
    "tests/engine/test_snapshot.py", "tests/plugins/test_torchrun.py",
    "tests/engine/memory/test_memory_resume.py", "tests/engine/test_spares.py",
    "tests/plugins/test_legacy.py", "tests/engine/testing/test_testing.py",
    "tests/engine/test_launch_env.py", "tests/engine/testing/test_warm_start.py",
    "tests/test_sample_plugin.py", "tests/engine/test_processes.py",
    "tests/tools/test_memory_kill_loop.py", "tests/examples/test_custom_loop.py",
    "tests/recipes/test_oct.py", "tests/plugins/test_ema.py",
    "tests/recipes/test_cifar_ddp.py", "tests/examples/test_hf_causal_lm.py",
    "tests/plugins/test_async_file.py", "tests/plugins/test_spawn.py",
    "tests/engine/test_health.py", "tests/plugins/test_torch_file.py",
    "tests/engine/test_cli.py", "tests/engine/memory/test_memory_snapshot.py",
    "tests/test_hook_contract.py", "tests/test_conftest.py", "tests/tools/test_bench_fsdp.py",
    "tests/engine/commands/test_tune_workers.py", "tests/engine/test_metrics.py",
    "tests/plugins/test_console.py", "tests/plugins/test_checkpointer_contract.py",
    "tests/engine/test_launching.py", "tests/engine/test_plugin_manager.py",
    "tests/engine/test_trainer.py", "tests/engine/test_compile.py",
    "tests/tools/test_bench_threads.py", "tests/engine/test_streaming.py",
    "tests/plugins/test_fsdp.py", "tests/tools/test_bench_scale.py",
)


def _turn(item) -> int:
    module = item.nodeid.split("::", 1)[0]
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items):
    for item in items:
        _mark_slow(item)
    items.sort(key=_turn)  # stable: the rest keep their order


# ------------------------------------------------------------- no choice from the clock
#
# A test's outcome must not depend on how fast the machine is. The one choice the engine
# makes from measured times is the memory tier's interval at its default,
# checkpoint.memory_every_steps=auto: a run that took a memory snapshot on a slow machine
# resumed from memory where its test asserted a resume from disk (CI, issue 46). The
# helpers that start runs pin it (engine.testing.pinned); a test about the choice itself
# gives `auto` and says so with @pytest.mark.clock. After each other test, a run left in
# its tmp_path that chose from the clock fails it, whichever way the run was started.


def _chose_from_the_clock(folder: pathlib.Path) -> list[str]:
    import json

    chose = []
    for summary in folder.rglob("summary.json"):
        try:
            record = json.loads(summary.read_text()).get("memory_snapshots") or {}
        except (OSError, ValueError, AttributeError):
            continue  # not a run's summary (a test's own file, a half-written one)
        if isinstance(record, dict) and record.get("auto"):
            chose.append(str(summary.parent))
    return chose


@pytest.fixture(autouse=True)
def _runs_do_not_choose_from_the_clock(request):
    yield
    folder = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") \
        else None
    if folder is None or request.node.get_closest_marker("clock") is not None:
        return
    chose = _chose_from_the_clock(folder)
    assert not chose, (
        f"{', '.join(chose)}: the run chose its memory interval from measured times "
        "(checkpoint.memory_every_steps=auto), so the test's outcome depends on the "
        "machine's speed; pin it (checkpoint.memory_every_steps=N, as engine.testing."
        "pinned does) or mark the test @pytest.mark.clock if the choice is what it tests")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and not _may_skip(report.keywords):
        _UNEXPECTED_SKIPS.append(report.nodeid)


def pytest_sessionfinish(session):
    if _UNEXPECTED_SKIPS and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _UNEXPECTED_SKIPS:
        terminalreporter.section("skipped tests that must run", red=True)
        for nodeid in _UNEXPECTED_SKIPS:
            terminalreporter.line(f"{nodeid} was skipped: only tests marked cuda (without a "
                                  f"CUDA device) or slurm (with {slurm_cluster.OPT_OUT}=1) "
                                  "may skip; the reason is in the short summary above")
