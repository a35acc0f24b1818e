"""Helpers for the launcher tests: the same small CIFAR run started by every launcher,
and the weights digest it must end with.

The acceptance rule: with the same recipe, seed, world size (2) and global batch, every
launcher finishes with the weights of the plain ``spawn`` run. Every run uses one
torch thread per process (``--threads 1``, or ``srun -c 1`` under SLURM): the number
of threads changes how a convolution sums, and so the last bits of the weights.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import attrs

from engine.testing import pinned
from tests.conftest import (ENGINE_RUN, QUICK, REPO, engine_env, made_once_per_session,
                            read_summary, run_cli)

RECIPE = str(REPO / "recipes" / "cifar_ddp.py")
ONE_THREAD = ("--threads", "1")
RUN_TIMEOUT_S = 300


def train_args(out) -> list[str]:
    """``RECIPE QUICK... out_dir=OUT``: what every launcher runs (the memory tier's
    interval pinned, as engine.testing.pinned pins it: not auto's clock)."""
    return pinned([RECIPE, *QUICK, f"out_dir={out}"])


def reference_digest(tmp_path_factory) -> str:
    """weights_sha256 of ``engine-run RECIPE --launcher spawn --nproc 2 --threads 1``,
    run once per test session (on whichever xdist worker first asks) and shared by the
    launcher test modules."""
    out = made_once_per_session(
        tmp_path_factory, "launcher-reference",
        lambda out: run_cli(*train_args(out), "--launcher", "spawn", "--nproc", "2",
                            *ONE_THREAD, check=True, timeout=RUN_TIMEOUT_S))
    summary = finished(out)
    assert summary["launcher"] == "spawn"
    return summary["weights_sha256"]


def finished(out, launcher: str | None = None) -> dict:
    """The summary of a completed 2-process run whose ranks agree on the weights."""
    summary = read_summary(out)
    assert summary["status"] == "completed", summary
    assert summary["world_size"] == 2, summary
    assert summary["weights_sha256_per_rank"] == [summary["weights_sha256"]] * 2
    if launcher is not None:
        assert summary["launcher"] == launcher, summary
    return summary


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command from the repository root; with ``check``, fail with its output."""
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env or engine_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_together(cmds: list[list[str]], env: dict[str, str] | None = None,
                 timeout: float = RUN_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Start several commands at once (the "nodes" of a run), wait for all of them."""
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env or engine_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    results = []
    try:
        for cmd, p in zip(cmds, procs):
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in results:
        if r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, r.args))} failed ({r.returncode}):\n"
                                 f"{r.stdout[-4000:]}\n{r.stderr[-6000:]}")
    return results


def python_path_env(**extra: str) -> dict[str, str]:
    env = engine_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


#: The stopped-rank runs: a small recipe, a short collective timeout.
STOP_RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
STOP_TIMEOUT_S = 4
#: How late past STOP_TIMEOUT_S a stopped run may end on a loaded 2-core machine (5 s
#: was tight there): the bugs these runs guard against end 30 s later, or never.
LATE_S = 12


@attrs.frozen
class StoppedRun:
    """A run whose rank SIGSTOPped itself: the finished command, and when each line of
    its stderr came, in seconds after the stop."""

    proc: subprocess.CompletedProcess
    lines: list[tuple[float, str]]
    ended: float  # when the command ended, in seconds after the stop

    def seconds_until(self, text: str) -> float:
        """When the first line of stderr holding ``text`` came, after the stop."""
        return next(t for t, line in self.lines if text in line)


def run_with_a_stopped_rank(launch: list[str], out, rank: int = 1) -> StoppedRun:
    """``launch`` + engine-run on the tiny recipe, whose rank ``rank`` SIGSTOPs itself
    after step 3 (tests/fault_plugin.py)."""
    marker = out.parent / f"{out.name}-stopped"
    env = engine_env(ENGINE_FAULT_ACTION="stop", ENGINE_FAULT_STEP="3",
                     ENGINE_FAULT_RANK=str(rank), ENGINE_FAULT_ONCE=str(marker))
    cmd = [*launch, ENGINE_RUN, *pinned([STOP_RECIPE, f"out_dir={out}",
                                         f"timeout_s={STOP_TIMEOUT_S}", "-p", "tests.fault_plugin"])]
    popen = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines, stdout = [], []
    readers = [threading.Thread(target=lambda: stdout.extend(popen.stdout)),
               threading.Thread(target=lambda: lines.extend((time.time(), line)
                                                            for line in popen.stderr))]
    for reader in readers:
        reader.start()
    try:
        popen.wait(RUN_TIMEOUT_S)
    finally:
        popen.kill()
        for reader in readers:
            reader.join()
    ended = time.time()
    proc = subprocess.CompletedProcess(cmd, popen.returncode, "".join(stdout),
                                       "".join(line for _, line in lines))
    assert marker.exists(), f"rank {rank} never stopped:\n{proc.stdout}\n{proc.stderr}"
    stopped = marker.stat().st_mtime
    return StoppedRun(proc, [(t - stopped, line) for t, line in lines], ended - stopped)
