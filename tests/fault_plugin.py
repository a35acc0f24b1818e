"""A plugin that injects faults, for tests: ``-p tests.fault_plugin`` plus variables.

ENGINE_FAULT_ACTION  kill (SIGKILL itself), raise, hang, signal (SIGUSR1 to itself, or
                     ENGINE_FAULT_SIGNAL: SIGTERM), stop (SIGSTOP itself: alive, but
                     answers nothing), interrupt (Ctrl-C: SIGINT to engine-run's whole
                     process group, as a terminal sends it), interrupt-twice (the same,
                     then again a second later, while this rank hangs deaf to it)
ENGINE_FAULT_STEP    act right after this optimizer step ...
ENGINE_FAULT_EPOCH   ... or at the start of this epoch
ENGINE_FAULT_RANK    the rank that acts (default 0)
ENGINE_FAULT_ONCE    a marker file: act only when it does not exist yet (then create it),
                     so that the resumed run goes through
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import engine


def _act(eng) -> None:
    if eng.world.rank != int(os.environ.get("ENGINE_FAULT_RANK", "0")):
        return
    marker = os.environ.get("ENGINE_FAULT_ONCE")
    if marker:
        path = pathlib.Path(marker)
        if path.exists():
            return
        path.write_text(f"{eng.state.epoch} {eng.state.step}\n")
    action = os.environ.get("ENGINE_FAULT_ACTION", "kill")
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
            time.sleep(1)  # the launcher took the first: signals of one kind do not queue
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a shutdown stuck for good
            os.killpg(os.getpgrp(), signal.SIGINT)
            while True:
                time.sleep(1)


@engine.hookimpl
def engine_train_step_end(engine, step, loss):
    if str(step) == os.environ.get("ENGINE_FAULT_STEP"):
        _act(engine)


@engine.hookimpl
def engine_epoch_start(engine, epoch):
    if str(epoch) == os.environ.get("ENGINE_FAULT_EPOCH"):
        _act(engine)
