"""tools/bench_checkpoint.py runs end to end on a tiny state (the numbers themselves
belong to the benchmark, not to a test) and cleans up after itself."""

from __future__ import annotations

import re

from engine.testing import run_python
from tests.conftest import REPO, engine_env


def test_prints_save_load_and_async_ratios_and_removes_its_files(tmp_path):
    folder = tmp_path / "bench"
    proc = run_python(
        [str(REPO / "tools" / "bench_checkpoint.py"), "--sizes", "2M", "--repeat", "2",
         "--tensors", "4", "--dir", str(folder), "--breakdown"],
        cwd=REPO, env=engine_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    save_row, durable_row, floor_row, load_row = [line for line in proc.stdout.splitlines()
                                       if line.strip().startswith("2 MB")]
    # torch.save (min), crash-consistent (min), ratio, async blocks (min), ratio, first
    assert len(re.findall(r"\d+\.\d+", save_row)) == 9, save_row
    # torch.save+fsync, copy floor or torch.load (min), crash-consistent, async blocks or
    # latest()+load() (min), ratio
    for row in (durable_row, floor_row, load_row):
        assert len(re.findall(r"\d+\.\d+", row)) == 5, row
    assert "  + xxh3_128 inline" in proc.stdout
    assert re.search(r"^targets: .*: (met|NOT met) \(load: reported, no target\)$", proc.stdout,
                     re.M)
    assert not folder.exists()
