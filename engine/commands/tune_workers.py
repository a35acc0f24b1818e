"""``engine-run tune-workers RECIPE [key=value ...]``: measure DataLoader settings.

For each setting of the sweep it starts the processes a run would start on this node;
each builds the recipe's training DataLoader exactly as the engine does and reads
batches for ``--budget`` seconds after a warm-up that starts the workers and drains what
they prefetched. The rate (samples/s, or the recipe's own unit) is the sum over the
processes, from the steady state. ``--full-step`` also runs every batch through the
Trainer's step (engine/step.py) on the process's device, so the loader competes with the
compute for the CPUs as in a real run (no process group: no gradient all-reduce). The
output ends with the best setting and the override that applies it (docs/data.md).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing import connection
from typing import Any, Sequence

import attrs

from engine import worker_setup
from engine.errors import ConfigError, EngineError, first_line, one_line
from engine.launcher import LaunchOptions, choose_launcher, start_method
from engine.launching import RecipeJob
from engine.metrics import Throughput
from engine.parallel import choose_parallel
from engine.plugin_manager import build_plugin_manager

#: Seconds a setting may take beyond its budget (process start, dataset, warm-up).
STARTUP_ALLOWANCE_S = 180.0
#: Batches read before the window starts: worker start-up, then the prefetched ones.
WARMUP_BATCHES = 2


@attrs.frozen
class Setting:
    num_workers: int
    batch_size: int  # global


@attrs.frozen
class Measurement:
    setting: Setting
    per_sec: float  # samples (or the recipe's unit) a second, all local processes together
    per_process: tuple[float, ...]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 0,1,2,4") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 0, e.g. 0,1,2,4")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine-run tune-workers",
        description="Measure samples/s (or the recipe's unit) of a recipe's training "
                    "DataLoader for a sweep of num_workers (and batch sizes); print the "
                    "table, the best setting and the override that applies it.")
    p.add_argument("recipe", help="a recipe file, e.g. recipes/oct_ddp.py")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, as for a run (e.g. data.root=/data/oct)")
    p.add_argument("--budget", type=float, default=5.0, metavar="SECONDS",
                   help="measuring time per setting, after the warm-up (default 5)")
    p.add_argument("--workers", type=_int_list, metavar="N,N,...",
                   help="num_workers values to try (default: 0, 1, 2, 4... up to twice "
                        "the CPUs per process, and the engine's auto choice)")
    p.add_argument("--batch-sizes", type=_int_list, metavar="B,B,...",
                   help="global batch sizes to try (default: the recipe's batch_size)")
    p.add_argument("--nproc", type=int,
                   help="processes on this node (default: as many as a run would start)")
    p.add_argument("--rounds", type=int, default=1,
                   help="cycle through the sweep this many times and report medians (on a "
                        "shared machine the load drifts; cycling spreads it over all settings)")
    p.add_argument("--full-step", action="store_true",
                   help="also run the recipe's train_step, backward and the optimizer step "
                        "on each batch")
    p.add_argument("-p", dest="plugins", action="append", default=[], metavar="NAME",
                   help="-p module.path loads a plugin, -p no:NAME disables one")
    return p


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_intermixed_args(list(argv))
    if args.budget <= 0:
        raise ConfigError(f"--budget {args.budget:g}: give a number of seconds > 0")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds}: give an integer >= 1")
    result = tune(args.recipe, args.overrides, budget_s=args.budget, workers=args.workers,
                  batch_sizes=args.batch_sizes, nproc=args.nproc, full_step=args.full_step,
                  plugins=args.plugins, out=sys.stdout, rounds=args.rounds)
    print(format_result(result, args.recipe, args.overrides))
    return 0


# ----------------------------------------------------------------------- sweep


def default_workers(per_process_cpus: int, auto: int) -> list[int]:
    """0, 1, 2, 4, ... up to twice the CPUs of one process, plus the auto choice."""
    values = {0, 1, 2, auto}
    n = 4
    while n <= 2 * per_process_cpus:
        values.add(n)
        n *= 2
    return sorted(values)


def tune(recipe_path: str, overrides: Sequence[str] = (), *, budget_s: float = 5.0,
         workers: Sequence[int] | None = None, batch_sizes: Sequence[int] | None = None,
         nproc: int | None = None, full_step: bool = False, plugins: Sequence[str] = (),
         out=None, rounds: int = 1) -> dict[str, Any]:
    """Measure every setting (``rounds`` times, cycling, medians); returns the
    measurements and what the engine would choose."""
    # This imports torch: kept out of the module, so that --help and a bad argument
    # answer at once (as in _measure_settings, _full_step and _endless).
    from engine import data

    pm = build_plugin_manager(list(plugins))
    job = RecipeJob(tuple(plugins), {}, recipe=str(recipe_path), overrides=tuple(overrides))
    recipe, cfg = job.load(pm)
    allocation = pm.hook.engine_cpu_allocation(environ=os.environ)
    launcher = choose_launcher(pm.launchers, cfg.launcher, LaunchOptions(
        nproc=nproc, init_method=cfg.init_method, cpu_allocation=allocation))
    worlds = launcher.worlds()
    world = worlds[0]
    # Its devices only: the launching process sets up no device, no process group.
    device = choose_parallel(pm.parallel_modes, cfg.parallel, world)(world, cfg).devices[0]
    cpus = world.cpu_share()
    per_process, where = cpus.count, cpus.reason
    auto = worker_setup.loader_settings_for(cfg, world, device, "auto")
    batch_sizes = list(batch_sizes or [cfg.batch_size])
    for batch in batch_sizes:  # every batch size must split, before anything starts
        data.split_batch(batch, world.world_size, cfg.grad_accum_steps)
    settings = [Setting(w, b) for b in batch_sizes
                for w in (workers or default_workers(per_process, auto.num_workers))]
    if out is not None:
        what = ("the training DataLoader with the recipe's train_step, backward and "
                "optimizer step"
                if full_step else "the training DataLoader (read, decode, augment, batch)")
        print(f"tune-workers: {recipe.path.name}, {len(worlds)} process(es) on this node, "
              f"{where}; measuring {what}, {budget_s:g}s per setting"
              + (f", {rounds} rounds (medians)" if rounds > 1 else ""), file=out, flush=True)
    unit = Throughput(recipe).unit
    raw = _run_sweep(job, worlds, settings * rounds, budget_s, full_step, out, unit)
    return {"measurements": [_median(setting, raw) for setting in settings], "rounds": rounds,
            "auto": auto, "device": device.type, "processes": len(worlds), "cpus": where,
            "full_step": full_step, "recipe_batch_size": cfg.batch_size, "unit": unit}


def _run_sweep(job, worlds, settings: list[Setting], budget_s: float, full_step: bool,
               out=None, unit: str = "samples") -> list[Measurement]:
    # As engine-run's launcher starts its workers: spawn, or fork with ENGINE_START_METHOD.
    # One pipe to each process, not a multiprocessing Queue and Barrier: their locks are
    # named semaphores (/dev/shm/sem.mp-*) that a sweep killed as a whole leaves behind.
    ctx = multiprocessing.get_context(start_method())
    pipes = [ctx.Pipe() for _ in worlds]
    procs = [ctx.Process(target=_measure_process,
                         args=(job, w, settings, budget_s, full_step, child),
                         daemon=False)
             for w, (_, child) in zip(worlds, pipes)]
    for proc in procs:
        proc.start()
    for _, child in pipes:
        child.close()  # ours closed: a process that dies is an EOF on its pipe
    hub = _Hub({w.rank: parent for w, (parent, _) in zip(worlds, pipes)})
    measurements = []
    try:
        for setting in settings:
            rates = {}
            deadline = time.monotonic() + budget_s + STARTUP_ALLOWANCE_S
            while len(rates) < len(worlds):
                kind, rank, payload = hub.next_result(deadline)
                if kind == "timeout":
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    raise EngineError(
                        f"tune-workers: no measurement of num_workers={setting.num_workers} "
                        f"within {budget_s + STARTUP_ALLOWANCE_S:g}s"
                        + (f" (a measuring process exited with code {dead[0]})" if dead
                           else ""))
                if kind == "error":
                    raise EngineError(f"tune-workers, rank {rank}: {payload}")
                rates[rank] = payload
            per_process = tuple(rates[r] for r in sorted(rates))
            measurements.append(Measurement(setting, sum(per_process), per_process))
            if out is not None:
                print(f"  num_workers={setting.num_workers} batch_size={setting.batch_size}:"
                      f" {sum(per_process):.1f} {unit}/s", file=out, flush=True)
        hub.next_result(time.monotonic() + 60)  # the last barrier: every loader stopped
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    return measurements


class _Hub:
    """The parent's end of the measuring processes' pipes. A process sends
    ``("ready", rank, None)`` at each barrier and waits for ``"go"``, which goes to all
    once every process is ready; ``("ok", rank, rate)`` and ``("error", rank, message)``
    are results. A pipe that closes (its process died) is an error."""

    def __init__(self, conns: dict):
        self.ranks = {conn: rank for rank, conn in conns.items()}
        self.conns = list(conns.values())
        self.ready = set()

    def next_result(self, deadline: float) -> tuple[str, int | None, Any]:
        """The next ok or error (barriers are served on the way), or ``("timeout", None,
        None)`` at ``deadline``."""
        while True:
            remaining = deadline - time.monotonic()
            ready = (connection.wait(self.conns, timeout=max(0.0, remaining))
                     if remaining > 0 else [])
            if not ready:
                return "timeout", None, None
            for conn in ready:
                try:
                    kind, rank, payload = conn.recv()
                except (EOFError, OSError):
                    return "error", self.ranks[conn], "its process ended without a word"
                if kind != "ready":
                    return kind, rank, payload
                self.ready.add(rank)
                if len(self.ready) == len(self.conns):
                    self.ready.clear()
                    for each in self.conns:
                        try:
                            each.send("go")
                        except OSError:
                            return "error", self.ranks[each], "its process ended without a word"


def _median(setting: Setting, raw: list[Measurement]) -> Measurement:
    mine = [m for m in raw if m.setting == setting]
    per_process = tuple(statistics.median(rates) for rates in zip(*(m.per_process
                                                                      for m in mine)))
    return Measurement(setting, statistics.median(m.per_sec for m in mine), per_process)


def _measure_process(job, world, settings, budget_s, full_step, conn) -> None:
    """One local process: build the dataset once, then measure each setting in turn,
    in step with the other processes (a barrier before each window)."""
    try:
        _measure_settings(job, world, settings, budget_s, full_step, conn)
    except BaseException as exc:  # reported to the parent as one line, never a hang
        message = first_line(exc) if isinstance(exc, EngineError) else one_line(exc)
        try:
            conn.send(("error", world.rank, message))
        except OSError:
            pass  # the parent is gone


def _barrier(conn, rank: int, timeout: float) -> None:
    """Wait until every measuring process is here (the parent says go), ``timeout``
    seconds at most."""
    conn.send(("ready", rank, None))
    if not conn.poll(timeout):
        raise EngineError(f"the other measuring processes did not reach the same point "
                          f"within {timeout:g}s")
    conn.recv()


def _measure_settings(job, world, settings, budget_s, full_step, conn) -> None:
    import torch  # torch and the modules below: lazily, as in tune

    from engine import data, streaming
    from engine.engine import Engine

    pm = build_plugin_manager(list(job.plugins))
    recipe, cfg = job.load(pm)
    parallel = worker_setup.start_worker(pm, cfg, world, {}, recipe=recipe, alone=True)
    # The recipe's ctx, as in a run's worker.
    ctx = Engine(pm, recipe, cfg, world, {}, run_parts=worker_setup.RunParts(parallel=parallel))
    device = ctx.device
    timeout = budget_s + STARTUP_ALLOWANCE_S  # every wait below has this finite timeout

    def wait(seconds: float) -> None:
        _barrier(conn, world.rank, seconds)

    prepare = recipe.optional("prepare_data")
    if prepare is not None and world.is_local_rank0:
        prepare(cfg, ctx)
    wait(timeout)  # local rank 0 has prepared the data
    train_set, _ = recipe.module.build_datasets(cfg, ctx)

    count = Throughput(recipe).count or streaming.batch_samples  # as a stream's count
    step = _full_step(recipe, cfg, ctx) if full_step else None

    for setting in settings:
        micro = data.split_batch(setting.batch_size, world.world_size, cfg.grad_accum_steps)
        chosen = worker_setup.loader_settings_for(cfg, world, device, setting.num_workers)
        loader = worker_setup.training_loader(
            train_set, micro_batch=micro, world=world, seed=cfg.seed, drop_last=cfg.drop_last,
            per_sample_seed=cfg.per_sample_seed, **chosen.loader_kwargs())
        batches = _endless(loader)
        for _ in range(WARMUP_BATCHES):  # starts the workers (and the step's allocations)
            batch = next(batches)
            if step is not None:
                step(batch)
        wait(timeout)
        # What the workers prefetched while we waited arrives at once: not a rate.
        for _ in range(chosen.num_workers * (chosen.prefetch_factor or 0)):
            next(batches)
        arrivals, done = [], 0
        start = time.perf_counter()
        while True:
            batch = next(batches)
            if step is not None:
                step(batch)
            now = time.perf_counter()
            if arrivals:  # the first arrival opens the window
                done += count(batch)
            arrivals.append(now)
            if now - start >= budget_s and len(arrivals) >= 2:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            arrivals[-1] = time.perf_counter()
        conn.send(("ok", world.rank, done / max(arrivals[-1] - arrivals[0], 1e-9)))
        del batches, loader  # stop this setting's workers before the next one starts
        wait(timeout)


def _full_step(recipe, cfg, ctx):
    """Each micro-batch through the Trainer's step (engine/step.py), on the model a run
    builds (engine/worker_setup.py; not wrapped: there is no process group here)."""
    from engine.step import StepRunner  # imports torch: lazily, as in tune

    parts = worker_setup.setup_step_parts(ctx.run_parts, recipe, cfg, ctx.print, wrap=False)
    runner = StepRunner(parts, cfg, recipe.train_step, ctx, world_size=1, warn=ctx.warn,
                        synced=False)
    accum, batches = cfg.grad_accum_steps, itertools.count()

    def step(batch):
        group, at = divmod(next(batches), accum)  # at: the micro-batch's place in it
        runner.micro_batch(batch, accum, at == 0, at == accum - 1)
        if at == accum - 1:
            runner.optimizer_step(group + 1)

    return step


def _endless(loader):
    """Batches across epoch boundaries, as training reads them."""
    from engine.data import start_epoch  # imports torch: lazily, as in tune

    epoch = 0
    while True:
        start_epoch(loader, epoch)
        yield from loader
        epoch += 1


# ---------------------------------------------------------------------- report


def format_result(result: dict[str, Any], recipe_path: str, overrides: Sequence[str]) -> str:
    measurements: list[Measurement] = result["measurements"]
    auto = result["auto"]
    best = max(measurements, key=lambda m: m.per_sec)
    unit = result.get("unit", "samples")
    several_batches = len({m.setting.batch_size for m in measurements}) > 1
    lines = [f"  {'num_workers':>11}  {'global batch':>12}  {unit + '/s':>9}  "
             f"{'per process':>11}  {'vs best':>7}"]
    for m in measurements:
        share = m.per_sec / best.per_sec if best.per_sec else 0.0
        marks = []
        if m is best:
            marks.append("best")
        if m.setting.num_workers == auto.num_workers and (
                m.setting.batch_size == result["recipe_batch_size"]):
            marks.append("auto")
        per = "/".join(f"{r:.1f}" for r in m.per_process)
        lines.append(f"  {m.setting.num_workers:>11}  {m.setting.batch_size:>12}  "
                     f"{m.per_sec:>9.1f}  {per:>11}  {share:>7.0%}"
                     + (f"  <- {', '.join(marks)}" if marks else ""))
    auto_rows = [m for m in measurements if m.setting.num_workers == auto.num_workers
                 and m.setting.batch_size == result["recipe_batch_size"]]
    lines.append("")
    lines.append(f"best: num_workers={best.setting.num_workers}"
                 + (f", batch_size={best.setting.batch_size}" if several_batches else "")
                 + f": {best.per_sec:.1f} {unit}/s")
    if auto_rows:
        share = auto_rows[0].per_sec / best.per_sec if best.per_sec else 0.0
        lines.append(f"the engine's auto choice, num_workers={auto.num_workers}, reaches "
                     f"{share:.0%} of it ({auto.reason})")
    else:
        lines.append(f"the engine's auto choice would be num_workers={auto.num_workers} "
                     f"({auto.reason}); not measured")
    kept = [o for o in overrides if not o.startswith(("num_workers=", "batch_size="))]
    apply = [f"num_workers={best.setting.num_workers}"]
    if several_batches and best.setting.batch_size != result["recipe_batch_size"]:
        apply.append(f"batch_size={best.setting.batch_size}")
    lines.append("apply it: engine-run " + " ".join([recipe_path, *kept, *apply]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
