"""The suite's skip policy (tests/conftest.py), run on a small suite of its own: a skip
that is not allowed fails the session, with and without pytest-xdist's workers."""

from __future__ import annotations

import os
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


def run_suite(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-rs",
                           "-p", "no:cacheprovider", *options, "test_suite.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("options", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_only_cuda_skips_pass_and_any_other_skip_fails_the_session(tmp_path, options):
    allowed = run_suite(tmp_path, SUITE, *options)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "no CUDA device" in allowed.stdout  # -rs: the reason is printed

    bad = run_suite(tmp_path, SUITE + BAD_SKIP, *options)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "test_skipped_for_no_good_reason was skipped: only tests marked cuda" in bad.stdout
