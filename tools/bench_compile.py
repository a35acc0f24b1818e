"""Benchmark: torch.compile through the engine (``compile.enabled=true``) against eager,
and against a hand-written compiled loop, one process.

    python tools/bench_compile.py                          # CIFAR net on the CPU, 3 rounds
    python tools/bench_compile.py --device cuda --precision bf16 --size 16384 --batch 256
    python tools/bench_compile.py --workload tiny --size 80 --batch 2 --reps 1 \
        --backend aot_eager                                # the smoke test's size
    python tools/bench_compile.py --workload char_lm       # the language model, tokens/s
    python tools/bench_compile.py --workload char_lm --device cuda --precision bf16 \
        --size 12800 --batch 128 --reps 2                  # the same on a GPU

Workloads: ``cifar`` (recipes/cifar_ddp.py's net on its synthetic set), ``tiny`` (a
Linear 8->8) and ``char_lm`` (recipes/char_lm.py's transformer on Python's library
sources; ``--size`` training windows of ``model.context`` characters, no validation
beyond 64 windows and no generated sample, whose growing prompt would recompile). For
``char_lm`` the throughput is printed in tokens (characters) per second.

Four variants, each a fresh model trained for one epoch in this one process: the
hand-written loop (tools/bench_overhead.py's tutorial steps: zero_grad / forward / loss /
backward / [gradient clipping] / step / [scheduler step], with the recipe's model,
optimizer, scheduler, data, config and its own train_step where it has one, the batch moved to the device and autocast for
``--precision bf16``) eager and with ``model.compile()``, and
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
from bench_overhead import REPO, WORKLOADS, LoopCPUClock, spread, through_engine  # noqa: E402

VARIANTS = ("hand eager", "engine eager", "hand compiled", "engine compiled")


def char_lm_overrides(size: int) -> list[str]:
    """``size`` training windows; a short validation and no sample at the end (its
    prompt grows a character at a time: every length would recompile)."""
    return [f"data.train_windows={size}", "data.val_windows=64", "sample_chars=0"]


#: bench_overhead.py's workloads and the language model (its training set comes from the
#: recipe's own build_datasets, with the run's config: ``None`` here).
COMPILE_WORKLOADS = {**WORKLOADS, "char_lm": (
    REPO / "recipes" / "char_lm.py", char_lm_overrides, None, 1920, 32)}


def run_config(args):
    """(recipe, its config with the run's overrides, as the engine's run gets them)."""
    from engine.overrides import apply_overrides
    from engine.recipe import load_recipe

    recipe_path, size_overrides, *_ = COMPILE_WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    return recipe, apply_overrides(recipe.make_config(), [
        *size_overrides(args.size), f"seed={args.seed}", f"batch_size={args.batch}"])


def tokens_per_sample(cfg) -> int:
    """The language model's ``model.context`` characters; 1 (a sample) for the others."""
    return getattr(getattr(cfg, "model", None), "context", 1)


def training_set(recipe, cfg, args):
    """The workload's training set: the recipe's own build_datasets for the language
    model (with the run's config), bench_overhead.py's for the others."""
    from types import SimpleNamespace

    make_train_set = COMPILE_WORKLOADS[args.workload][2]
    if make_train_set is not None:
        return make_train_set(recipe.module, args.size)
    return recipe.module.build_datasets(cfg, SimpleNamespace(print=lambda *_, **__: None))[0]


def hand_written(args, compiled: bool) -> tuple[tuple[float, float], float | None]:
    """The tutorial's loop on ``args.device``; returns (seconds per step of wall and of
    process CPU time, compile seconds of this run by torch's count, None when eager)."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader

    from engine.compile import seconds_spent

    recipe, cfg = run_config(args)
    train_set = training_set(recipe, cfg, args)
    torch.manual_seed(args.seed)
    model = recipe.module.build_model(cfg).to(args.device)
    if compiled:
        model.compile(backend=args.backend, mode=None if args.mode == "default" else args.mode)
    optimizer = recipe.module.build_optimizer(cfg, model)
    loader = DataLoader(train_set, batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    build_scheduler = getattr(recipe.module, "build_scheduler", None)
    scheduler = build_scheduler and build_scheduler(
        cfg, optimizer, SimpleNamespace(total_steps=len(loader)))
    autocast = (torch.autocast(args.device, dtype=torch.bfloat16)
                if args.precision == "bf16" else contextlib.nullcontext())
    step = recipe_step(recipe, model)
    clock = LoopCPUClock(loader)
    before = seconds_spent() or 0.0
    for inputs, labels in clock:
        inputs, labels = inputs.to(args.device), labels.to(args.device)
        optimizer.zero_grad()
        with autocast:
            loss = step(inputs, labels)
        loss.backward()
        if cfg.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    spent = (seconds_spent() or 0.0) - before if compiled else None
    return clock.step_seconds(), spent


def recipe_step(recipe, model):
    """The loss of a batch: the recipe's own train_step where it has one (the language
    model's, with its next-character loss and its accuracy metric: the work the engine
    does too; the tiny workload's engine.classification one), the tutorial's
    cross-entropy otherwise (the CIFAR recipe, whose step is the engine's default)."""
    from types import SimpleNamespace

    from torch.nn import functional as F

    train_step = getattr(recipe.module, "train_step", None)
    if train_step is None:
        return lambda inputs, labels: F.cross_entropy(model(inputs), labels)
    ctx = SimpleNamespace(model=model, module=model, loss_fn=recipe.optional("loss_fn"))

    def loss(inputs, labels):
        out = train_step((inputs, labels), ctx)  # the loss, or a dict of it and metrics
        return out["loss"] if isinstance(out, dict) else out
    return loss


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
        *_, per_step = through_engine("single", 0, 1, free_port(), out_dir, engine_args,
                                       COMPILE_WORKLOADS)
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
    per_sample = tokens_per_sample(run_config(args)[1])
    per_step = args.batch * per_sample
    return {**ratios(step_s), "cpu": ratios(step_cpu_s),
            "unit": "tokens" if per_sample > 1 else "samples",
            "per_sec": {v: per_step / (s / 1e3) for v, s in ratios(step_s)["step_ms"].items()},
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
    p.add_argument("--workload", choices=sorted(COMPILE_WORKLOADS), default="cifar",
                   help="cifar: recipes/cifar_ddp.py's net (default); tiny: a Linear 8->8; "
                   "char_lm: recipes/char_lm.py's transformer")
    p.add_argument("--size", type=int, help="training samples (default: cifar 4096, "
                   "char_lm 1920 windows)")
    p.add_argument("--batch", type=int, help="batch (default: cifar 64, tiny 2, char_lm 32)")
    p.add_argument("--reps", type=int, default=3, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("32", "bf16"), default="32")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--mode", default="default", help="torch.compile's mode")
    p.add_argument("--threads", type=int, help="torch threads (default: all the CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    *_, default_size, default_batch = COMPILE_WORKLOADS[args.workload]
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
    rate = result["per_sec"]
    print(f"{result['unit']}/s (wall): " + ", ".join(f"{v} {rate[v]:,.0f}" for v in VARIANTS))
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
