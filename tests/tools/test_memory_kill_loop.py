"""tools/memory_kill_loop.py, smoke-sized: one worker killed under the spawn launcher
(its warm spare), its run compared with an uninterrupted one. (The engine's side, a
resume from memory and its steps lost, under torchrun too, is
tests/engine/test_memory_resume.py's; this shows the tool measures it. The spawn mode:
9 CPU-s against torchrun mode's 24, whose fresh worker interpreters the engine tests
already pay.)"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def test_one_kill_is_measured_and_passes():
    """The kill also wipes the killed rank's memory snapshots (--wipe 1: a node lost with
    its memory): the tool checks it resumed from a peer's copy."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "memory_kill_loop.py"),
                           "--kills", "1", "--epochs", "1", "--seed", "0", "--launcher", "spawn",
                           "--wipe", "1"],
                          capture_output=True, text=True, timeout=300)
    printed = proc.stdout
    assert proc.returncode == 0, printed + proc.stderr
    line = next(line for line in printed.splitlines() if line.startswith("kill 1/1:"))
    step = int(re.search(r" at step (\d+) \(its memory wiped\) ->", line)[1])
    assert f"resumed from peer at step {step - 1}, 1 step(s) recomputed" in line, line
    assert re.search(r"kill -> first new step [\d.]+s \(new worker process [\d.]+s, set up "
                     r"and resumed [\d.]+s\), weights identical", line), line
    assert re.search(r"total: 1 kills .* 1/1 bit-identical, steps recomputed max 1, "
                     r"kill -> first new step median [\d.]+s max [\d.]+s.* resumed from "
                     r"peer 1, 0 problem", printed), printed
    # Where the restart's time goes: the restarted workers' start-up phases, in order.
    assert re.search(r"where the time goes .*: .*process group [\d.]+, .*data, model "
                     r"[\d.]+, .*first new step [\d.]+$", printed, re.M), printed
