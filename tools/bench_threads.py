"""Benchmark: the default torch threads per process against ``--threads 1`` and
``--threads 2``, at 1 and 2 processes, on an idle machine and under a 2-process load.

    python tools/bench_threads.py                      # the table of docs/performance.md
    python tools/bench_threads.py --size 256 --nproc 1 --settings default --loads idle

Each cell is one ``engine-run recipes/cifar_ddp.py data.source=synthetic`` run (the
CIFAR network, ``--size`` synthetic samples, one epoch, global batch 64, no validation
nor snapshot worth timing) and its summary.json's ``samples_per_sec`` (the training
epoch's, start-up excluded). "under load" is measured while this script keeps
``--load`` busy-looping Python processes running (started after the idle rows, ended
before it exits), the load another user's jobs put on a shared machine. The default's
choice (what the plan says: ``-v``) is printed beside it. About 2-3 minutes on 2 cores
(most of it the engine's start-up, 5 s a run, and the oversubscribed cells).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "cifar_ddp.py"
BUSY = "while True: pass"


def one_run(out: pathlib.Path, nproc: int, setting: str, size: int) -> tuple[float, str]:
    """samples/s of one run, and the threads its plan chose."""
    threads = [] if setting == "default" else ["--threads", setting]
    command = [sys.executable, "-m", "engine.cli", str(RECIPE), "data.source=synthetic",
               f"data.synthetic_size={size}", "epochs=1", "checkpoint.memory_every_steps=0",
               f"out_dir={out}", "--nproc", str(nproc), "--no-resume", "--overwrite", "-v",
               *threads]
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_LOAD_AVERAGE"}  # the real
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench_threads: {' '.join(command)} failed:\n{proc.stderr}")
    chosen = re.search(r"^\s+threads\s+(.*)$", proc.stdout, re.MULTILINE)
    summary = json.loads((out / "summary.json").read_text())
    return summary["samples_per_sec"], chosen.group(1) if chosen else "?"


@contextlib.contextmanager
def background_load(processes: int):
    """``processes`` busy loops for the block's time, and a wait for the 1-minute load
    average to see them (the default reads it) of at most 15 s."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(processes)]
    try:
        deadline = time.monotonic() + 15
        while os.getloadavg()[0] < processes * 0.8 and time.monotonic() < deadline:
            time.sleep(1)
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=640,
                   help="synthetic training samples (640: 10 steps of 64; threads that "
                        "take turns on busy CPUs train 36 samples/s, not 2000)")
    p.add_argument("--nproc", default="1,2", help="process counts (comma separated)")
    p.add_argument("--settings", default="default,1,2", help="threads: default or a number")
    p.add_argument("--loads", default="idle,loaded", help="idle, loaded or both")
    p.add_argument("--load", type=int, default=2, help="busy processes of the load")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        for load in args.loads.split(","):
            with background_load(args.load) if load == "loaded" else contextlib.nullcontext():
                for nproc in map(int, args.nproc.split(",")):
                    for setting in args.settings.split(","):
                        rate, chosen = one_run(pathlib.Path(tmp) / "run", nproc, setting,
                                               args.size)
                        rows.append({"load": load, "processes": nproc, "threads": setting,
                                     "samples_per_sec": rate, "chosen": chosen,
                                     "load_average": os.getloadavg()[0]})
                        print(f"{load:<7} {nproc} process(es)  threads {setting:<8} "
                              f"{rate:8.0f} samples/s   ({chosen})", flush=True)
    print("\n| load | processes | threads | samples/s | the plan's threads |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['load']} | {row['processes']} | {row['threads']} | "
              f"{row['samples_per_sec']:.0f} | {row['chosen']} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
