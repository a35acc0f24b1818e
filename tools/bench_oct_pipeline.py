#!/usr/bin/env python3
"""Benchmark: images/s of the OCT pipeline at the settings the engine picks (``auto``)
against the best that ``tune-workers`` finds. Target: auto within 10% of the best.

    python tools/bench_oct_pipeline.py                  # OCT-sized scans, about 15 min
    python tools/bench_oct_pipeline.py --quick          # small images, a few minutes

1. A synthetic OCT-A set (tools/make_oct_dataset.py: 304/400 px, 8/16-bit, PNG/TIFF/JPEG).
2. ``tune-workers`` on recipes/oct_ddp.py, the DataLoader alone and the full step: the
   tables, and auto's share of the best.
3. The real thing: ``engine-run recipes/oct_ddp.py`` for auto and for every num_workers
   of the sweep, interleaved, ``--repeats`` times each; images/s is the trainer's own
   measure of the last epoch (persistent workers warm) from summary.json; medians.

Prints the machine (CPUs, load) with the numbers: on a shared machine the load of other
jobs moves them, which is why the runs are interleaved.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "oct_ddp.py")
TARGET = 0.90


def engine_run(args: list[str], timeout: float = 1800) -> None:
    bin_dir = pathlib.Path(sys.executable).parent
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    proc = subprocess.run([str(bin_dir / "engine-run"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"engine-run {' '.join(args)} failed:\n{proc.stderr[-2000:]}")


def machine() -> str:
    cpus = len(os.sched_getaffinity(0))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpus} CPUs ({model or platform.machine()}), load {load}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="an OCT folder to use (default: generate one)")
    p.add_argument("--train", type=int, default=96, help="generated training images")
    p.add_argument("--image-size", type=int, default=224, help="the network's input size")
    p.add_argument("--budget", type=float, default=10.0, help="tune-workers s per setting")
    p.add_argument("--repeats", type=int, default=2, help="engine runs per setting")
    p.add_argument("--epochs", type=int, default=2, help="epochs per engine run (the last "
                                                          "one is measured)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="small images (64 px crops of 128 px scans), 48 of them")
    args = p.parse_args(argv)
    if args.quick:
        args.train, args.image_size, args.budget = 48, 64, 4.0

    sys.path.insert(0, str(REPO / "tools"))
    from make_oct_dataset import generate

    from engine.commands.tune_workers import format_result, images_per_sec_of, tune

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_oct_"))
    if args.data:
        root = pathlib.Path(args.data)
    else:
        root = tmp / "oct"
        generate(root, train=args.train, val=max(args.nproc, args.train // 4),
                 sizes=(128,) if args.quick else (304, 400))
    overrides = [f"data.root={root}", f"data.image_size={args.image_size}"]
    print(f"machine: {machine()}")
    print(f"data: {root} ({args.train} training images), recipe oct_ddp.py, "
          f"{args.nproc} processes, crops of {args.image_size} px\n")

    tuned = {}
    for full_step in (False, True):
        result = tune(RECIPE, overrides, budget_s=args.budget, nproc=args.nproc,
                      full_step=full_step, out=io.StringIO())
        tuned[full_step] = result
        print(("full step" if full_step else "DataLoader alone") + ":")
        print(format_result(result, RECIPE, overrides) + "\n")

    auto = tuned[True]["auto"].num_workers
    sweep = sorted({m.setting.num_workers for m in tuned[True]["measurements"]})
    runs: dict[str, list[float]] = {"auto": [], **{str(w): [] for w in sweep}}
    for repeat in range(args.repeats):
        for name in runs:  # interleaved: the machine's load drifts over all settings alike
            out = tmp / f"run-{name}-{repeat}"
            engine_run([RECIPE, *overrides, f"num_workers={name}", f"epochs={args.epochs}",
                        f"out_dir={out}", "--no-resume", "--nproc", str(args.nproc)])
            summary = json.loads((out / "summary.json").read_text())
            runs[name].append(summary["images_per_sec"])
            print(f"  engine-run num_workers={name}: {summary['images_per_sec']:.2f} images/s"
                  f" (data wait {summary['data_wait_fraction']:.0%})", flush=True)

    medians = {name: statistics.median(v) for name, v in runs.items()}
    best_name = max((n for n in medians if n != "auto"), key=medians.get)
    ratio = medians["auto"] / medians[best_name]
    print(f"\nengine-run, median of {args.repeats} (images/s, last epoch):")
    for name, value in medians.items():
        print(f"  num_workers={name:>4}: {value:8.2f}"
              + (f"   (auto = {auto})" if name == "auto" else ""))
    print(f"auto / best (num_workers={best_name}): {ratio:.3f}  target >= {TARGET:.2f}  "
          f"{'OK' if ratio >= TARGET else 'BELOW TARGET'}")
    step_best = max(tuned[True]["measurements"], key=lambda m: m.images_per_sec)
    step_auto = images_per_sec_of(tuned[True], auto)
    print(f"tune-workers --full-step: auto {step_auto:.2f}, best {step_best.images_per_sec:.2f}"
          f" (num_workers={step_best.setting.num_workers}): "
          f"{step_auto / step_best.images_per_sec:.3f}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
