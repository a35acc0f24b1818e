"""tools/bench_cold_python.py, smoke-sized: every case is timed and compared with the
probe back to back."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def test_each_case_is_timed_against_back_to_back():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_cold_python.py"),
                           "--reps", "5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^after (.+?)\s+([\d.]+) us  \(\s*([\d.]+) x\)$", proc.stdout, re.M)
    assert [name for name, _, _ in rows] == [
        "nothing (back to back)", "a convolution (64x3x32x32 -> 64 channels, 5x5)",
        "20 products of 200x200 matrices", "a fill of 12.8 MB", "a 5 ms sleep",
        "5 ms of Python"], proc.stdout
    assert rows[0][2] == "1.0" and all(float(us) > 0 for _, us, _ in rows)
