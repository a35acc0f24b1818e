"""Run as a script by test_torch_file.py: back-to-back saves in forked children, each
killed with SIGKILL at a random moment; after every kill, the newest good snapshot must
verify, load and be whole. Prints a JSON report.

A process that has run no tensor operation before (a new interpreter, or one forked
from the tests' warm server), with one torch thread: forking a process whose OpenMP pool
is running (pytest's, after other tests) deadlocks the child.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

torch.set_num_threads(1)

from engine.config import TrainConfig  # noqa: E402
from engine.plugins.torch_file import TorchFileCheckpointer  # noqa: E402

NUMEL = 350_000  # about 2 MB per snapshot


def state_for(step: int) -> dict:
    return {"model": {"a": torch.full((NUMEL,), float(step)),
                      "b": torch.full((NUMEL // 2,), float(step))},
            "epoch": step, "step": step}


def save_forever(directory: str, first_step: int) -> None:
    ckpt = TorchFileCheckpointer(directory, TrainConfig())
    step = first_step
    while True:
        step += 1
        ckpt.save(state_for(step), epoch=step, step=step)


def main(directory: str, kills: int) -> dict:
    TorchFileCheckpointer(directory, TrainConfig()).save(state_for(1), epoch=1, step=1)
    started = time.perf_counter()
    TorchFileCheckpointer(directory + "-timing", TrainConfig()).save(state_for(2), epoch=2,
                                                                     step=2)
    window = 3 * (time.perf_counter() - started) + 0.01
    rng = random.Random()
    report = {"kills": 0, "mid_write": 0, "unloadable": [], "window_s": window}
    step = 1000
    for _ in range(kills):
        step += 1000
        pid = os.fork()
        if pid == 0:
            try:
                save_forever(directory, step)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, window))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        report["kills"] += 1
        report["mid_write"] += any(n.startswith(".") for n in os.listdir(directory))
        reader = TorchFileCheckpointer(directory, TrainConfig())
        latest = reader.latest()
        try:
            snap = reader.load(latest)
            whole = all(bool((t == snap["step"]).all()) for t in snap["model"].values())
        except Exception as exc:  # reported, not raised: the test asserts on the report
            whole = f"{type(exc).__name__}: {exc}"
        if whole is not True:
            report["unloadable"].append(f"{latest}: {whole}")
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
