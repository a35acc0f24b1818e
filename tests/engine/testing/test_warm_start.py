"""engine/testing/warm_start.py: engine-run commands forked from a warm server behave as the
same commands in a plain subprocess: output, exit code, environment, signals, timeout."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from engine.testing.warm_start import WarmStarter
from tests.conftest import REPO, engine_env


@pytest.fixture(scope="module")
def starter():
    one = WarmStarter()
    yield one
    one.close()


def plain(args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "engine", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args", [("plugins",), ("recipes/cifar_ddp.py", "epochs=zero"),
                                  ("--nproc",)])
def test_output_and_exit_code_are_those_of_a_plain_subprocess(starter, args):
    env = engine_env()
    forked = starter.run(args, env=env, cwd=REPO, timeout=120)
    expected = plain(args, env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        expected.returncode, expected.stdout, expected.stderr)


def test_a_run_gets_the_environment_and_directory_it_was_given(starter, tmp_path):
    # Its own PYTHONPATH entry, importable as a plugin (-p), and its own cwd: the
    # recipe's relative out_dir lands there.
    (tmp_path / "here_plugin.py").write_text(
        "import os, engine\n"
        "@engine.hookimpl\n"
        "def engine_run_start(engine):\n"
        "    print('MARK', os.environ['MARK'], os.getcwd(), flush=True)\n")
    env = engine_env(MARK="42", PYTHONPATH=f"{tmp_path}:{REPO}")
    proc = starter.run([str(REPO / "recipes" / "cifar_ddp.py"), "data.source=synthetic",
                        "data.synthetic_size=64", "epochs=1", "out_dir=rel", "--nproc", "1",
                        "checkpoint.memory_every_steps=0", "-p", "here_plugin"], env=env,
                       cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"MARK 42 {tmp_path}" in proc.stdout
    assert (tmp_path / "rel" / "summary.json").exists()


def test_a_run_killed_by_a_signal_reports_it_as_a_subprocess_would(starter, tmp_path):
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP="1",
                     PYTHONPATH=str(REPO))
    proc = starter.run([str(REPO / "recipes" / "cifar_ddp.py"), "data.source=synthetic",
                        "data.synthetic_size=64", "epochs=1", f"out_dir={tmp_path}",
                        "--nproc", "1", "-p", "tests.fault_plugin"], env=env, cwd=REPO,
                       timeout=240)
    assert proc.returncode == -9


def processes_with(marker: str) -> list[str]:
    found = []
    for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(environ.parent.name)
        except OSError:  # gone, or not ours to read
            pass
    return found


def test_a_command_past_its_timeout_is_killed_with_its_workers(starter, tmp_path):
    marker = f"WARM_START_TEST={tmp_path.name}"
    env = engine_env(ENGINE_FAULT_ACTION="hang", ENGINE_FAULT_STEP="1",
                     PYTHONPATH=str(REPO), WARM_START_TEST=tmp_path.name)
    args = [str(REPO / "recipes" / "cifar_ddp.py"), "data.source=synthetic",
            "data.synthetic_size=64", "epochs=1", f"out_dir={tmp_path}", "--nproc", "2",
            "-p", "tests.fault_plugin"]
    with pytest.raises(subprocess.TimeoutExpired):
        starter.run(args, env=env, cwd=REPO, timeout=8)  # hung or not yet: killed alike
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)  # SIGKILLed: gone as soon as the kernel reaps them
    assert processes_with(marker) == []
    # The starter goes on serving: the next command runs.
    assert starter.run(["plugins"], env=engine_env(), cwd=REPO, timeout=60).returncode == 0


# ------------------------------------------------------------------ python ARGS

SCRIPT = """\
import multiprocessing
import os
import sys


def child(queue):
    queue.put(os.getpid())


if __name__ == "__main__":
    print(__name__, sys.argv[1:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    context = multiprocessing.get_context("spawn")  # finds this script again, as __mp_main__
    queue = context.Queue()
    worker = context.Process(target=child, args=(queue,))
    worker.start()
    print(queue.get(timeout=60) != os.getpid(), flush=True)
    worker.join(60)
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["script", "-m", "-c"])
def test_python_command_lines_run_as_in_a_new_interpreter(starter, tmp_path, how):
    (tmp_path / "probe_script.py").write_text(SCRIPT)
    args = {"script": [str(tmp_path / "probe_script.py")], "-m": ["-m", "probe_script"],
            "-c": ["-c", "import sys; print(__name__, sys.argv[1:], sys.path[0] == '')"
                   "; sys.exit(int(sys.argv[1]))"]}[how]
    env = engine_env(PYTHONPATH=str(REPO))
    forked = starter.run([*args, "3", "x"], env=env, cwd=tmp_path, timeout=120, python=True)
    expected = subprocess.run([sys.executable, *args, "3", "x"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        expected.returncode, expected.stdout, expected.stderr) == (
        3, expected.stdout, "")
    assert expected.stdout.startswith("__main__ ['3', 'x'] True\n")


MEET = """
import pathlib, sys, time
here, there = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
here.touch()
deadline = time.monotonic() + 60
while not there.exists():
    assert time.monotonic() < deadline, "the other command never ran alongside"
    time.sleep(0.01)
print("met", here.name)
"""


def test_commands_started_side_by_side_run_at_once_and_end_apart(starter, tmp_path):
    """Two commands that each wait for the other's file: one at a time, the first would
    wait for ever (60 s, then fail). A third, still running, is killed with its session
    while the others' results come back."""
    a, b = tmp_path / "a", tmp_path / "b"
    first = starter.start(["-c", MEET, a, b], env=engine_env(), cwd=tmp_path, python=True)
    second = starter.start(["-c", MEET, b, a], env=engine_env(), cwd=tmp_path, python=True)
    sleeper = starter.start(["-c", "import time; time.sleep(300)"], env=engine_env(),
                            cwd=tmp_path, python=True)
    assert second.communicate(timeout=120) == ("met b\n", "")
    assert (first.communicate(timeout=120), first.returncode) == (("met a\n", ""), 0)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.communicate(timeout=0.5)
    assert sleeper.returncode == -9  # killed with its session, reaped by the server


def test_the_cpu_of_each_command_is_counted(starter):
    # The server reaps the commands, so no rusage of this process has their CPU:
    # the server reports each one's (the suite's profile, tests/profiling.py, reads it).
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    before = starter.cpu_s
    starter.run(["-c", burn], env=engine_env(), cwd=REPO, timeout=120, python=True)
    assert 0.5 <= starter.cpu_s - before < 60, starter.cpu_s - before


def test_the_old_module_name_still_imports_and_warns_once_naming_the_new_one(
        monkeypatch, capsys):
    import engine
    from engine import errors
    from engine.testing import warm_start

    monkeypatch.delitem(sys.modules, "engine.warm_start", raising=False)
    monkeypatch.delattr(engine, "warm_start", raising=False)
    for said in [m for m in errors._warned if "engine.warm_start" in m]:
        errors._warned.discard(said)  # said by an earlier import in this process
    from engine.warm_start import WarmStarter as old

    assert old is warm_start.WarmStarter
    assert capsys.readouterr().err == ("warning: engine.warm_start moved to "
                                       "engine.testing.warm_start; import it from there "
                                       "(the old name goes in a later release)\n")
