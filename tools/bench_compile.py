"""Benchmark: torch.compile through the engine (``compile.enabled=true``) against eager,
and against a hand-written compiled loop, one process.

    python tools/bench_compile.py                          # CIFAR net on the CPU, 3 rounds
    python tools/bench_compile.py --device cuda --precision bf16 --size 16384 --batch 256
    python tools/bench_compile.py --workload tiny --size 80 --batch 2 --reps 1 \
        --backend aot_eager                                # the smoke test's size

Four variants, each a fresh model trained for one epoch in this one process: the
hand-written loop (tools/bench_overhead.py's tutorial steps: zero_grad / forward / loss /
backward / step, with the recipe's model, optimizer and data, the batch moved to the
device and autocast for ``--precision bf16``) eager and with ``model.compile()``, and
``engine.engine.Engine`` (parallel ``single``) without and with ``compile.enabled=true``.
A warm-up round, not counted, runs every variant once: it pays the compile (torch keeps
its compiled graphs in the process, and inductor's on disk, so a later round's fresh
model reuses them) and gives the compile time: the engine's ``compile_s`` (torch's own
count, in the summary) and the hand-written loop's, by the same count. Then ``--reps``
counted rounds, the order rotating every round so that load from elsewhere on the
machine hits every variant alike.

Timed is the step: bench_overhead.py's LoopCPUClock cuts each run's loop into windows of
20 steps (the engine's check point interval) and the median window / 20 is that run's
time per step, untouched by the first steps that compile; the same of the process CPU
time, far steadier when other jobs load the machine. Printed: the medians over the
rounds per variant, engine / hand-written for eager and for compiled (target <= 1.02),
compiled / eager for both (the speed-up, or the loss, that compile brings here), and the
compile time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_overhead import WORKLOADS, LoopCPUClock, spread, through_engine  # noqa: E402

VARIANTS = ("hand eager", "engine eager", "hand compiled", "engine compiled")


def hand_written(args, compiled: bool) -> tuple[tuple[float, float], float | None]:
    """The tutorial's loop on ``args.device``; returns (seconds per step of wall and of
    process CPU time, compile seconds of this run by torch's count, None when eager)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from engine.compile import seconds_spent
    from engine.recipe import load_recipe

    recipe_path, _, make_train_set, _, _ = WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    cfg = recipe.make_config()
    train_set = make_train_set(recipe.module, args.size)
    torch.manual_seed(args.seed)
    model = recipe.module.build_model(cfg).to(args.device)
    if compiled:
        model.compile(backend=args.backend, mode=None if args.mode == "default" else args.mode)
    optimizer = recipe.module.build_optimizer(cfg, model)
    loader = DataLoader(train_set, batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    autocast = (torch.autocast(args.device, dtype=torch.bfloat16)
                if args.precision == "bf16" else contextlib.nullcontext())
    criterion = nn.CrossEntropyLoss()
    clock = LoopCPUClock(loader)
    before = seconds_spent() or 0.0
    for inputs, labels in clock:
        inputs, labels = inputs.to(args.device), labels.to(args.device)
        optimizer.zero_grad()
        with autocast:
            loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    spent = (seconds_spent() or 0.0) - before if compiled else None
    return clock.step_seconds(), spent


def through_engine_step(args, compiled: bool) -> tuple[tuple[float, float], float | None]:
    """bench_overhead.py's Engine run with the compile and precision overrides; returns
    (seconds per step of wall and of process CPU time, compile seconds of this run by
    torch's count, as its summary's compile_s)."""
    from engine.compile import seconds_spent
    from engine.launcher import free_port

    engine_args = argparse.Namespace(**vars(args))
    engine_args.set = [f"precision={args.precision}"] + (
        ["compile.enabled=true", f"compile.backend={args.backend}",
         f"compile.mode={args.mode}"] if compiled else [])
    before = seconds_spent() or 0.0
    # The engine prints its progress; keep it out of the benchmark's table.
    with tempfile.TemporaryDirectory() as out_dir, open(args.log, "a") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        *_, per_step = through_engine("single", 0, 1, free_port(), out_dir, engine_args)
    return per_step, (seconds_spent() or 0.0) - before if compiled else None


def run(args) -> dict:
    runners = {"hand eager": lambda: hand_written(args, False),
               "hand compiled": lambda: hand_written(args, True),
               "engine eager": lambda: through_engine_step(args, False),
               "engine compiled": lambda: through_engine_step(args, True)}
    # The engine's compiled run first in the warm-up: it pays the cold compile, which the
    # hand-written one then finds in torch's caches (its compile time says so).
    order = ["engine compiled", "hand compiled", "engine eager", "hand eager"]
    step_s = {v: [] for v in VARIANTS}
    step_cpu_s = {v: [] for v in VARIANTS}
    compile_s = {}
    for round_index in range(args.reps + 1):
        shift = round_index % len(order)
        for variant in order[shift:] + order[:shift]:
            (wall, cpu), spent = runners[variant]()
            if round_index == 0:
                compile_s[variant] = spent
            else:
                step_s[variant].append(wall)
                step_cpu_s[variant].append(cpu)
    return {**ratios(step_s), "cpu": ratios(step_cpu_s),
            "step_ms_spread": {v: spread([s * 1e3 for s in step_s[v]]) for v in VARIANTS},
            "compile_s_engine": compile_s["engine compiled"],
            "compile_s_hand_after": compile_s["hand compiled"]}


def ratios(step_s: dict[str, list[float]]) -> dict:
    """The median step per variant (ms) and the ratios between them."""
    median = {v: statistics.median(s) for v, s in step_s.items()}
    return {
        "step_ms": {v: median[v] * 1e3 for v in VARIANTS},
        "engine_vs_hand_eager": median["engine eager"] / median["hand eager"],
        "engine_vs_hand_compiled": median["engine compiled"] / median["hand compiled"],
        "compiled_vs_eager_engine": median["engine compiled"] / median["engine eager"],
        "compiled_vs_eager_hand": median["hand compiled"] / median["hand eager"],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="cifar",
                   help="cifar: recipes/cifar_ddp.py's net (default); tiny: a Linear 8->8")
    p.add_argument("--size", type=int, help="training samples (default: cifar 4096)")
    p.add_argument("--batch", type=int, help="batch (default: cifar 64, tiny 2)")
    p.add_argument("--reps", type=int, default=3, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("32", "bf16"), default="32")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--mode", default="default", help="torch.compile's mode")
    p.add_argument("--threads", type=int, help="torch threads (default: all the CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    *_, default_size, default_batch = WORKLOADS[args.workload]
    args.size = default_size if args.size is None else args.size
    args.batch = default_batch if args.batch is None else args.batch
    if args.reps < 1 or args.size < 20 * args.batch:
        p.error("--reps must be >= 1 and --size at least 20 batches (one timed window)")
    args.plugin = []
    args.threads = args.threads or os.cpu_count()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the engine's single mode takes the CPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    with tempfile.NamedTemporaryFile(prefix="bench_compile-", suffix=".log",
                                     delete=False) as log:
        args.log = log.name
    result = run(args)
    print(f"{args.workload} on {args.device}, precision {args.precision}, {args.size} "
          f"samples x 1 epoch, batch {args.batch}, backend {args.backend}, mode "
          f"{args.mode}, {args.threads} threads, {args.reps} interleaved rounds "
          f"(medians of the per-run median step; engine output: {args.log})")
    print(f"{'':<20}{'hand-written':>14}{'engine':>14}{'engine/hand':>13}")
    for clock, numbers in (("wall", result), ("process CPU", result["cpu"])):
        ms = numbers["step_ms"]
        for kind in ("eager", "compiled"):
            print(f"{clock + ' ' + kind:<20}{ms[f'hand {kind}']:>11.3f} ms"
                  f"{ms[f'engine {kind}']:>11.3f} ms{numbers[f'engine_vs_hand_{kind}']:>13.3f}")
        print(f"{clock + ' compiled / eager':<20}: engine "
              f"{numbers['compiled_vs_eager_engine']:.3f}, hand-written "
              f"{numbers['compiled_vs_eager_hand']:.3f} (below 1: compile pays)")
    print(f"compile time: engine {result['compile_s_engine']} s (cold, the warm-up's "
          f"first run); hand-written after it {result['compile_s_hand_after']} s "
          "(torch's caches warm)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": {
            k: v for k, v in vars(args).items() if k not in ("plugin", "log")}, **result},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
