#!/usr/bin/env python3
"""Benchmark: images/s of the OCT pipeline at the settings the engine picks (``auto``)
against the best that ``tune-workers`` finds. Target: auto within 10% of the best.

    python tools/bench_oct_pipeline.py                  # OCT-sized scans, about 20 min
    python tools/bench_oct_pipeline.py --quick          # small images, a few minutes

1. A synthetic OCT-A set (tools/make_oct_dataset.py: 304/400 px, 8/16-bit, PNG/TIFF/JPEG).
2. ``tune-workers`` on recipes/oct_ddp.py, the DataLoader alone and the full step, the
   sweep cycled ``--rounds`` times in one session (setting after setting, round after
   round) and the median per setting taken: on a shared machine the load of other jobs
   drifts over minutes, and cycling spreads the drift over all settings alike.
3. The real thing: ``engine-run recipes/oct_ddp.py`` with ``num_workers=auto`` and with
   the best full-step setting, interleaved, ``--repeats`` times each; images/s is the
   trainer's own measure of the last epoch (persistent workers warm), from summary.json.

Prints the machine (CPUs, load) with the numbers.

    python tools/bench_oct_pipeline.py --augment-on-compare --nproc 1 --train 512

instead compares where the scans are decoded and augmented: ``data.augment_on=cpu`` (in
the loader workers) against ``data.augment_on=cuda`` (workers only read the files; the
GPU decodes and augments), both at ``num_workers=auto``, interleaved engine runs. Needs
a CUDA device.
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
    p.add_argument("--rounds", type=int, default=5, help="tune-workers cycles of the sweep")
    p.add_argument("--repeats", type=int, default=3, help="engine runs per setting")
    p.add_argument("--epochs", type=int, default=2, help="epochs per engine run (the last "
                                                          "one is measured)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="small images (64 px crops of 128 px scans), 48 of them")
    p.add_argument("--augment-on-compare", action="store_true",
                   help="compare data.augment_on=cpu with cuda instead (needs a GPU)")
    args = p.parse_args(argv)
    if args.quick:
        args.train, args.image_size, args.budget, args.rounds = 48, 64, 3.0, 3

    sys.path.insert(0, str(REPO / "tools"))
    from make_oct_dataset import generate

    from engine.commands.tune_workers import tune

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

    if args.augment_on_compare:
        return compare_augment_on(args, overrides, tmp)

    print(f"tune-workers, {args.rounds} rounds of {args.budget:g}s per setting, medians:")
    ratios = {}
    best_step = auto_step = None
    for full_step in (False, True):
        result = tune(RECIPE, overrides, budget_s=args.budget, nproc=args.nproc,
                      full_step=full_step, out=io.StringIO(), rounds=args.rounds)
        auto = result["auto"].num_workers
        medians = median_rates(result)
        best = max(medians, key=medians.get)
        ratios[full_step] = medians[auto] / medians[best]
        print(f"  {'full step' if full_step else 'DataLoader alone'}: " + ", ".join(
            f"num_workers={w}: {r:.2f}" for w, r in sorted(medians.items()))
            + f" images/s; auto ({auto}) / best ({best}) = {ratios[full_step]:.3f}")
        if full_step:
            best_step, auto_step = best, auto
    print()

    names = ["auto", str(best_step)]
    medians = interleaved_runs({name: [f"num_workers={name}"] for name in names},
                               overrides, tmp, args)
    run_ratio = medians["auto"] / medians[str(best_step)]
    print(f"engine-run, median of {args.repeats}: auto {medians['auto']:.2f}, "
          f"num_workers={best_step} {medians[str(best_step)]:.2f} images/s; "
          f"auto / best = {run_ratio:.3f}")
    if best_step == auto_step:
        print(f"  (auto chose num_workers={auto_step}, the best: both columns ran the same "
              "settings, so their difference is this machine's run-to-run noise)")
    print(f"\nload at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    verdict = ratios[True] >= TARGET
    print(f"result: auto / best = {ratios[True]:.3f} (tune-workers --full-step), "
          f"{run_ratio:.3f} (engine-run); target >= {TARGET:.2f}: "
          f"{'OK' if verdict else 'BELOW TARGET'}")
    return 0 if verdict else 1


def compare_augment_on(args, overrides: list[str], tmp: pathlib.Path) -> int:
    """Interleaved engine runs with the scans decoded and augmented on the CPU (loader
    workers) and on the GPU; images/s of the last epoch, medians, and their ratio."""
    import torch

    if not torch.cuda.is_available():
        print("bench_oct_pipeline: --augment-on-compare needs a CUDA device",
              file=sys.stderr)
        return 2
    # engine_run hides the GPUs unless CUDA_VISIBLE_DEVICES says otherwise.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES",
                          ",".join(map(str, range(torch.cuda.device_count()))))
    medians = interleaved_runs(
        {name: [f"data.augment_on={name}", "num_workers=auto"] for name in ("cpu", "cuda")},
        overrides, tmp, args)
    print(f"engine-run on {torch.cuda.get_device_name(0)}, median of {args.repeats}: "
          f"augment_on=cpu {medians['cpu']:.1f}, augment_on=cuda {medians['cuda']:.1f} "
          f"images/s; cuda / cpu = {medians['cuda'] / medians['cpu']:.2f}")
    return 0


def interleaved_runs(settings: dict[str, list[str]], overrides: list[str],
                     tmp: pathlib.Path, args) -> dict[str, float]:
    """``engine-run`` the recipe ``args.repeats`` times per setting (name: its extra
    overrides); the median images/s of each setting's last epoch."""
    names = list(settings)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        # Interleaved, and in alternating order (ABBA): the machine's load drifts over
        # both alike, and neither always runs first.
        for name in (names if repeat % 2 == 0 else names[::-1]):
            out = tmp / f"run-{name}-{repeat}"
            engine_run([RECIPE, *overrides, *settings[name], f"epochs={args.epochs}",
                        f"out_dir={out}", "--no-resume", "--nproc", str(args.nproc)])
            summary = json.loads((out / "summary.json").read_text())
            runs[name].append(summary["samples_per_sec"])
            print(f"  engine-run {' '.join(settings[name])}: "
                  f"{summary['samples_per_sec']:.2f} images/s "
                  f"(data wait {summary['data_wait_fraction']:.0%})", flush=True)
    return {name: statistics.median(v) for name, v in runs.items()}


def median_rates(result) -> dict[int, float]:
    """images/s per num_workers (tune() took the median over the rounds)."""
    return {m.setting.num_workers: m.per_sec for m in result["measurements"]}

if __name__ == "__main__":
    sys.exit(main())
