#!/usr/bin/env python3
"""Repeats a short 2-process run and counts the runs that did not exit 0, to hunt
exit-time crashes (a worker aborting in C++ teardown after ``done:``).

    python tools/exit_loop.py --runs 200            # tests/recipes/tiny_parallel_recipe.py
    python tools/exit_loop.py --runs 50 -- recipes/cifar_ddp.py data.source=synthetic

Prints one line per failed run (its exit code and last stderr line) and the totals.
Exit status: 0 when every run exited 0.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT = [str(REPO / "tests" / "recipes" / "tiny_parallel_recipe.py"), "epochs=1"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("recipe_and_overrides", nargs="*", help="default: the tiny test recipe")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    run = args.recipe_and_overrides or DEFAULT
    engine_run = str(pathlib.Path(sys.executable).parent / "engine-run")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    failed = aborted = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = pathlib.Path(tmp) / f"run{i}"
            proc = subprocess.run([engine_run, *run, f"out_dir={out}", "--nproc",
                                   str(args.nproc), "--threads", "1"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                failed += 1
                aborted += "terminate called without an active exception" in proc.stderr
                last = (proc.stderr.strip().splitlines() or [""])[-1]
                print(f"run {i + 1}: exit {proc.returncode}: {last}", flush=True)
    print(f"{args.runs} runs: {args.runs - failed} exited 0, {failed} failed "
          f"({aborted} with 'terminate called without an active exception')")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
