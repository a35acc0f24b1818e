"""The suite's policies (tests/conftest.py), each run on a small suite of its own: a skip
that is not allowed fails the session, with and without pytest-xdist's workers; the
modules that use the SLURM cluster run on one worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

SUITE = '''
import pytest

@pytest.mark.cuda
def test_needs_cuda():
    pytest.skip("no CUDA device")

def test_passes():
    pass
'''
BAD_SKIP = '''
def test_skipped_for_no_good_reason():
    pytest.skip("the data is not there")
'''
# What a run leaves whose memory interval auto chose from measured times; left to the
# clock without a word, it fails its test; under @pytest.mark.clock it is what is tested.
CLOCK = '''
import json

def chose_from_the_clock(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps(
        {"memory_snapshots": {"every_steps": 4, "auto": True}}))

def test_a_run_left_to_the_clock(tmp_path):
    chose_from_the_clock(tmp_path)

@pytest.mark.clock
def test_a_run_about_the_clock(tmp_path):
    chose_from_the_clock(tmp_path)
'''


def run_suite(tmp_path, source: str, *options: str, modules: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    modules = modules or {"test_suite.py": source}
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-rs",
                           "-p", "no:cacheprovider", *options, *modules],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("options", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_only_cuda_skips_pass_and_any_other_skip_fails_the_session(tmp_path, options):
    allowed = run_suite(tmp_path, SUITE, *options)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "no CUDA device" in allowed.stdout  # -rs: the reason is printed

    bad = run_suite(tmp_path, SUITE + BAD_SKIP + CLOCK, *options)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "test_skipped_for_no_good_reason was skipped: only tests marked cuda" in bad.stdout
    # The run folder of the test that left the choice to the clock fails it at its
    # tear-down; the marked one passes.
    assert "ERROR at teardown of test_a_run_left_to_the_clock" in bad.stdout, bad.stdout
    assert "the run chose its memory interval from measured times" in bad.stdout
    assert "1 error" in bad.stdout and "test_a_run_about_the_clock" not in bad.stdout


def test_a_test_runs_environment_pins_the_load_the_default_threads_follow(monkeypatch):
    from engine.testing import engine_env

    monkeypatch.delenv("ENGINE_LOAD_AVERAGE", raising=False)  # a plugin's suite: no pin
    assert engine_env()["ENGINE_LOAD_AVERAGE"] == "0"
    assert engine_env({"ENGINE_LOAD_AVERAGE": "1.5"})["ENGINE_LOAD_AVERAGE"] == "1.5"


def test_a_recipe_run_started_by_the_helpers_gets_a_fixed_memory_interval():
    from engine.testing import pinned

    fixed = "checkpoint.memory_every_steps=0"
    assert pinned(["r.py", "epochs=1"]) == ["r.py", fixed, "epochs=1"]
    assert pinned(["-p", "tests.fault_plugin", "r.py"])[-1] == fixed
    asked = ["r.py", "checkpoint.memory_every_steps=auto"]  # a test of the choice itself
    assert pinned(asked) == asked
    for command in (["tune-workers", "r.py"], ["doctor"], ["export", "runs/x"]):
        assert pinned(command) == command  # no training run: nothing to pin


SLURM_MODULE = '''
import pytest

@pytest.mark.slurm
def test_on_the_cluster():
    pass

def test_beside_it():
    pass
'''


def test_modules_using_the_slurm_cluster_run_on_one_worker(tmp_path):
    # Two modules, two workers: plain loadscope gives each worker one module.
    modules = {"test_a.py": SLURM_MODULE, "test_b.py": SLURM_MODULE}
    ran = run_suite(tmp_path, "", "-n", "2", "--dist", "loadscope", "-v", modules=modules,
                    env={"ENGINE_TEST_NO_SLURM": "1"})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    workers = re.findall(r"\[(gw\d+)\] \[ *\d+%\] \w+ test_[ab]\.py::", ran.stdout)
    assert len(workers) == 4 and len(set(workers)) == 1, ran.stdout
