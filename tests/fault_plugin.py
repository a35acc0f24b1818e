"""A plugin that injects faults, for tests: ``-p tests.fault_plugin`` plus variables.

ENGINE_FAULT_ACTION  kill (SIGKILL itself), kill-wiping-memory (delete its own in-memory
                     snapshots' buffers and, under fsdp, the copies it holds of its
                     predecessor's, then SIGKILL itself: a node replaced, its /dev/shm
                     gone with it), raise, hang, signal (SIGUSR1 to itself, or
                     ENGINE_FAULT_SIGNAL: SIGTERM), stop (SIGSTOP itself: alive, but
                     answers nothing), interrupt (Ctrl-C: SIGINT to engine-run's whole
                     process group, as a terminal sends it), interrupt-twice (the same,
                     then again once engine-run took the first, while this rank hangs
                     deaf to it)
ENGINE_FAULT_STEP    act right after this optimizer step (or each of a comma list: 9,13) ...
ENGINE_FAULT_EPOCH   ... or at the start of this epoch
ENGINE_FAULT_RANK    the rank that acts (default 0), or ``all``: every rank (a whole
                     machine lost at once, no survivor left waiting on the dead)
ENGINE_FAULT_ONCE    a marker file: act only when it does not exist yet (then create it),
                     so that the resumed run goes through (with ``all``: one marker per
                     rank, the path plus ``.rank<R>``; with a list of steps, one per
                     step, the path plus ``.step<N>``)
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import engine


def _act(eng, step: int | None = None) -> None:
    acting = os.environ.get("ENGINE_FAULT_RANK", "0")
    if acting != "all" and eng.world.rank != int(acting):
        return
    marker = os.environ.get("ENGINE_FAULT_ONCE")
    if marker and acting == "all":
        marker = f"{marker}.rank{eng.world.rank}"
    if marker and step is not None and "," in os.environ.get("ENGINE_FAULT_STEP", ""):
        marker = f"{marker}.step{step}"
    if marker:
        path = pathlib.Path(marker)
        if path.exists():
            return
        path.write_text(f"{eng.state.epoch} {eng.state.step}\n")
    action = os.environ.get("ENGINE_FAULT_ACTION", "kill")
    if action == "kill-wiping-memory":
        # Its last snapshot sent on first (its copy at its successor under fsdp, the
        # rows to every rank): a node lost between two snapshots.
        memory = eng.snapshots.memory.pair  # the tier's buffers
        memory.finish()
        ring = memory.ring  # fsdp with more than one process
        for path in [*memory.paths, *(ring.paths if ring is not None else ())]:
            path.unlink()  # fails loudly where the rank had no buffer to lose
        action = "kill"
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "raise":
        raise RuntimeError(f"injected failure on rank {eng.world.rank}")
    elif action == "hang":
        while True:
            time.sleep(1)
    elif action == "signal":
        name = os.environ.get("ENGINE_FAULT_SIGNAL", "SIGUSR1")
        os.kill(os.getpid(), signal.Signals[name])
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("interrupt"):
        if os.getpgrp() != os.getsid(0):  # never the test runner's group
            raise RuntimeError("ENGINE_FAULT_ACTION=interrupt needs engine-run in a "
                               "session of its own (start_new_session)")
        os.killpg(os.getpgrp(), signal.SIGINT)
        if action == "interrupt-twice":
            # Signals of one kind do not queue: the second must come after the launcher
            # (this worker's parent) took the first. On a loaded machine it may not run
            # for a while: wait until the kernel delivered it, then give its Python
            # handler a moment.
            _wait_delivered(os.getppid(), signal.SIGINT)
            time.sleep(0.5)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a shutdown stuck for good
            os.killpg(os.getpgrp(), signal.SIGINT)
            while True:
                time.sleep(1)


def _wait_delivered(pid: int, signum: int, timeout_s: float = 60) -> None:
    """Until process ``pid`` has no ``signum`` pending (/proc/PID/status: SigPnd for its
    thread, ShdPnd for the process), or fails after ``timeout_s``."""
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + timeout_s
    while True:
        status = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
        pending = [int(line.split()[1], 16) for line in status
                   if line.startswith(("SigPnd:", "ShdPnd:"))]
        if not any(mask & bit for mask in pending):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} left signal {signum} pending for "
                               f"{timeout_s:g}s")
        time.sleep(0.01)


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    if str(step) in os.environ.get("ENGINE_FAULT_STEP", "").split(","):
        _act(ctx, step)


@engine.hookimpl
def engine_epoch_start(ctx, epoch):
    if str(epoch) == os.environ.get("ENGINE_FAULT_EPOCH"):
        _act(ctx)
