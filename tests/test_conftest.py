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

    bad = run_suite(tmp_path, SUITE + BAD_SKIP, *options)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "test_skipped_for_no_good_reason was skipped: only tests marked cuda" in bad.stdout


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
