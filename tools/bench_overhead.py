"""Benchmark: the engine's training loop against a hand-written PyTorch loop, on the CPU.

    python tools/bench_overhead.py                       # every CPU mode, 5 repetitions
    python tools/bench_overhead.py --reps 9 --size 8192 --modes ddp
    python tools/bench_overhead.py --workload tiny --reps 15 --modes single,ddp \
        --import-reps 0 --threads 1                     # the per-step cost in microseconds

Two workloads (``--workload``). ``cifar`` (the default) is recipes/cifar_ddp.py's: its
Net, SGD (lr 0.001, momentum 0.9), its synthetic CIFAR-shaped set, seed 0, global batch
64, one epoch: a realistic step of milliseconds. ``tiny`` is tools/bench_tiny_recipe.py:
a Linear 8 -> 8 classifier, global batch 2, 4000 samples, so thousands of steps of a few
microseconds of arithmetic each: what the framework adds per step dominates, and the
difference engine - hand-written divided by the steps is that cost, in microseconds
(the project's budget: 50 us per step). The hand-written side
is the PyTorch DDP tutorial's loop (init_process_group, DDP(model),
DistributedSampler + set_epoch, zero_grad / forward / loss / backward / step), plain
without DDP for one process. It gets one line the tutorial lacks: the same
torch.set_num_threads as the engine, since two processes with all cores each
oversubscribe the CPU and would make the baseline, not the engine, slow.

Sessions: one for 1 process (hand-written, engine ``single``, engine ``dp``, which is
``single`` without GPUs) and one for 2 processes with gloo (hand-written DDP, engine
``ddp``, engine ``ddp-multigpu`` with k = 1). A session's processes start once and run
every variant in turn, INTERLEAVED: a warm-up round that is not counted, then ``--reps``
rounds, the order rotating every round, so that load from elsewhere on the machine
hits every variant alike. Only the training loop is timed, on both sides alike: a
stand-in for the training DataLoader (the hand-written loop's directly, the engine's
through a plugin: the engine runs as engine-run's workers run it, through the
``Engine`` class) reads the clock from the first request for a batch to the request
that finds none left. Process start-up, imports, data generation, validation and
checkpoints are outside the timings.

Printed per mode: median loop seconds of both sides, the ratio engine / hand-written
(target <= 1.02; also of the fastest runs and per round), the same ratio of the loop's
process CPU time (measured on the engine side by a plugin that stands in for the
training DataLoader; on a machine shared with other jobs it is far steadier than wall
time), and whether the final weights are bit-identical (the engine's weights_sha256
against engine.checkpoint.model_digest of the hand-written model). Then the per-step
overhead in microseconds, of wall and of process CPU time: each run's loop is cut into
windows of 20 steps (the engine's log_every, so each window holds one check point, the
engine's periodic work) and the median window / 20 is that run's time per step, which
a job elsewhere taking the CPU for a moment barely moves; engine - hand-written, paired
by round, its median over the rounds, quartiles and extremes.

Then the start-up cost: ``python -X importtime`` of what a run imports (``engine.cli``,
``engine.engine``, ``engine.trainer`` and the built-in plugins) against ``import torch``
alone (target: at most 10% more), and whether a bare ``import engine`` pulls in torch.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from engine import hookimpl

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cifar_ddp.py"
TINY_RECIPE = REPO / "tools" / "bench_tiny_recipe.py"
#: workload: (recipe, its config overrides for --size, its training set for --size,
#: default --size, default --batch)
WORKLOADS = {
    "cifar": (RECIPE, lambda size: ["data.source=synthetic", f"data.synthetic_size={size}"],
              lambda module, size: module.synthetic_cifar(size, seed=1234)[0], 4096, 64),
    "tiny": (TINY_RECIPE, lambda size: [f"train_size={size}"],
             lambda module, size: module.make_data(size), 4000, 2),
}
SESSIONS = {1: ("single", "dp"), 2: ("ddp", "ddp-multigpu")}
HAND = "hand-written"


# --------------------------------------------------------------------- the two sides


def hand_written(rank: int, world_size: int, port: int, args
                 ) -> tuple[float, float, str, int, tuple[float, float]]:
    """The PyTorch DDP tutorial's loop. Returns (loop seconds, loop CPU seconds, weights
    digest, steps, the median window's wall and CPU seconds per step)."""
    import torch.distributed as dist

    from engine.checkpoint import model_digest
    from engine.recipe import load_recipe

    recipe_path, _, make_train_set, _, _ = WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    train_set = make_train_set(recipe.module, args.size)
    model, optimizer, sampler, loader = tutorial_ddp(recipe, train_set, rank, world_size,
                                                     port, args)
    clock = LoopCPUClock(loader)  # what the engine's loop is measured with, too
    sampler.set_epoch(0)
    train_steps(model, optimizer, clock)

    digest = model_digest(getattr(model, "module", model).state_dict())
    if world_size > 1:
        dist.destroy_process_group()
    return clock.wall_seconds, clock.cpu_seconds, digest, len(loader), clock.step_seconds()


def tutorial_ddp(recipe, train_set, rank: int, world_size: int, port: int, args):
    """The PyTorch DDP tutorial's set-up, with ``args.threads`` torch threads: the
    process group (gloo, more than one process), the recipe's model seeded with
    ``args.seed`` (as the engine seeds it) in DDP, the recipe's optimizer, a
    DistributedSampler and its DataLoader of ``args.batch`` samples over all processes.
    Returns (model, optimizer, sampler, loader)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    cfg = recipe.make_config()  # for the recipe's model and optimizer (lr, momentum)
    torch.set_num_threads(args.threads)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    model = recipe.module.build_model(cfg)
    if world_size > 1:
        model = DDP(model)
    optimizer = recipe.module.build_optimizer(cfg, model)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch // world_size, sampler=sampler)
    return model, optimizer, sampler, loader


def train_steps(model, optimizer, batches) -> None:
    """The tutorial's steps over ``batches``: zero_grad, forward, loss, backward, step."""
    from torch import nn

    criterion = nn.CrossEntropyLoss()
    for inputs, labels in batches:
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()


#: Steps per window of the per-step timing: the engine's default log_every, so that
#: every window holds one check point.
WINDOW = 20


class LoopCPUClock:
    """Stands in for a training DataLoader (the engine's, through a plugin; the
    hand-written loop's, directly) and measures the loop over it: the wall and process
    CPU time from the first request for a batch to the request that finds none left,
    which comes after the last step; and the wall and CPU time of every ``WINDOW`` consecutive
    steps (request to request), whose median over a run is barely moved by other jobs
    that take the CPU away now and then. Everything else is delegated."""

    def __init__(self, loader):
        self.loader = loader
        self.wall_seconds = self.cpu_seconds = None
        self.windows = []  # (wall seconds, CPU seconds) of each whole window of steps

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        start = time.process_time()
        marks = [(time.perf_counter(), start)]
        for i, batch in enumerate(self.loader, 1):
            yield batch
            if i % WINDOW == 0:
                marks.append((time.perf_counter(), time.process_time()))
        import torch

        if torch.cuda.is_initialized():  # the last steps' kernels belong to the loop
            torch.cuda.synchronize()
        self.wall_seconds = time.perf_counter() - marks[0][0]
        self.cpu_seconds = time.process_time() - start
        self.windows = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]

    def step_seconds(self) -> tuple[float, float]:
        """The median window's wall and CPU seconds per step (NaN for a run shorter than
        one window: the smoke test's)."""
        if not self.windows:
            return float("nan"), float("nan")
        return (statistics.median(w for w, _ in self.windows) / WINDOW,
                statistics.median(c for _, c in self.windows) / WINDOW)


class CPUClockPlugin:
    def __init__(self):
        self.clock = None

    @hookimpl
    def engine_run_start(self, ctx):
        self.clock = ctx.train_loader = LoopCPUClock(ctx.train_loader)


def through_engine(mode: str, rank: int, world_size: int, port: int, out_dir: str,
                   args, workloads: dict = WORKLOADS
                   ) -> tuple[float, float, str, int, tuple[float, float]]:
    """The same workload through engine.engine.Engine, as engine-run's workers run it
    (``workloads``: where ``args.workload`` is defined; bench_compile.py adds its own)."""
    from engine.config import with_groups
    from engine.overrides import apply_overrides
    from engine.engine import Engine
    from engine.plugin_manager import build_plugin_manager
    from engine.recipe import load_recipe
    from engine.world import World

    pm = build_plugin_manager(args.plugin, autoload=False)
    cpu_clock = CPUClockPlugin()
    pm.register_object(cpu_clock, "bench-cpu-clock")
    recipe_path, size_overrides, _, _, _ = workloads[args.workload]
    recipe = load_recipe(recipe_path)
    # The plugins' config groups (ddp.*) join the recipe's before the overrides, as in
    # engine-run, so that --set can reach them.
    cfg = apply_overrides(with_groups(recipe.make_config(), pm.config_groups), [
        f"parallel={mode}", *size_overrides(args.size),
        "epochs=1", f"batch_size={args.batch}", f"seed={args.seed}", f"out_dir={out_dir}",
        *getattr(args, "set", []),
    ])
    world = World(rank=rank, local_rank=rank, world_size=world_size,
                  local_world_size=world_size, master_port=port)
    summary = Engine(pm, recipe, cfg, world, {"threads": args.threads}).run()
    # Both loops timed alike: from the first request for a batch to the one that finds
    # none left (whatever unit the recipe counts its throughput in).
    clock = cpu_clock.clock
    return (clock.wall_seconds, clock.cpu_seconds, summary["weights_sha256"],
            summary["global_step"], clock.step_seconds())


# ------------------------------------------------------------------------ sessions


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    quiet(rank, log_path)
    for (round_index, variant), port in zip(schedule, ports):
        with tempfile.TemporaryDirectory() as out_dir:
            if variant == HAND:
                seconds, cpu, digest, steps, per_step = hand_written(rank, world_size,
                                                                     port, args)
            else:
                seconds, cpu, digest, steps, per_step = through_engine(
                    variant, rank, world_size, port, out_dir, args)
        if rank == 0:  # every rank times the same loop; rank 0 speaks for the session
            with open(results_path, "a") as f:
                f.write(json.dumps({"round": round_index, "variant": variant,
                                    "seconds": seconds, "cpu_seconds": cpu,
                                    "steps": steps, "step_s": per_step[0],
                                    "step_cpu_s": per_step[1], "digest": digest}) + "\n")


def quiet(rank: int, log_path: str) -> None:
    """The engine prints its progress: into ``log_path``.rank<rank>, out of the
    benchmark's table."""
    log = open(f"{log_path}.rank{rank}", "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)


def interleaved(variants: list, reps: int) -> list[tuple[int, object]]:
    """(round, variant) in the order they run: round 0, a warm-up that is not counted,
    then ``reps`` rounds, the order rotating every round."""
    schedule = []
    for round_index in range(reps + 1):
        shift = round_index % len(variants)
        schedule += [(round_index, v) for v in variants[shift:] + variants[:shift]]
    return schedule


def run_session(world_size: int, modes: list[str], args, log_path: str) -> list[dict]:
    return run_workers(session_worker, world_size, interleaved([HAND, *modes], args.reps),
                       args, log_path)


def run_workers(worker, world_size: int, schedule: list, args, log_path: str
                ) -> list[dict]:
    """Start ``world_size`` processes that run ``worker(rank, world_size, schedule,
    ports, args, results_path, log_path)`` once; returns the records they appended to
    results_path (a JSON line each)."""
    import torch.multiprocessing as mp

    from engine.launcher import free_port, start_method

    ports = [free_port() for _ in schedule]  # a fresh rendezvous for every run
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        results_path = f.name
    try:
        # spawn, as engine-run's launcher; ENGINE_START_METHOD=fork forks (the smoke test)
        mp.start_processes(worker, nprocs=world_size, start_method=start_method(),
                           args=(world_size, schedule, ports, args, results_path,
                                 log_path))
        lines = pathlib.Path(results_path).read_text().splitlines()
    finally:
        os.unlink(results_path)
    return [json.loads(line) for line in lines]


def summarize(world_size: int, results: list[dict]) -> list[dict]:
    counted = [r for r in results if r["round"] > 0]
    hand = [r for r in counted if r["variant"] == HAND]
    hand_median = statistics.median(r["seconds"] for r in hand)
    hand_digests = {r["digest"] for r in results if r["variant"] == HAND}
    rows = []
    for mode in dict.fromkeys(r["variant"] for r in counted if r["variant"] != HAND):
        runs = [r for r in counted if r["variant"] == mode]
        by_round = {r["round"]: r["seconds"] for r in hand}
        paired = [r["seconds"] / by_round[r["round"]] for r in runs]
        median = statistics.median(r["seconds"] for r in runs)
        digests = {r["digest"] for r in results if r["variant"] == mode}
        fastest = min(r["seconds"] for r in runs)
        cpu = statistics.median(r["cpu_seconds"] for r in runs)
        hand_cpu = statistics.median(r["cpu_seconds"] for r in hand)
        hand_step = {r["round"]: (r["step_s"], r["step_cpu_s"]) for r in hand}
        step_us = [(r["step_s"] - hand_step[r["round"]][0]) * 1e6 for r in runs]
        step_cpu_us = [(r["step_cpu_s"] - hand_step[r["round"]][1]) * 1e6 for r in runs]
        rows.append({
            "processes": world_size, "mode": mode, "reps": len(runs),
            "steps": runs[0]["steps"],
            "hand_step_us": statistics.median(r["step_s"] for r in hand) * 1e6,
            "engine_step_us": statistics.median(r["step_s"] for r in runs) * 1e6,
            "step_us": spread(step_us), "step_cpu_us": spread(step_cpu_us),
            "hand_s": hand_median, "engine_s": median, "ratio": median / hand_median,
            "min_ratio": fastest / min(r["seconds"] for r in hand),
            "paired_ratio": statistics.median(paired),
            "hand_cpu_s": hand_cpu, "engine_cpu_s": cpu, "cpu_ratio": cpu / hand_cpu,
            "bit_identical": len(hand_digests) == 1 and digests == hand_digests,
        })
    return rows


def spread(values: list[float]) -> dict:
    """Median, quartiles and extremes of per-round values."""
    if len(values) < 2:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3,
            "min": min(values), "max": max(values)}


# ---------------------------------------------------------------------- imports


def import_trace(snippet: str) -> list[tuple[int, str, int]]:
    """(depth, module, cumulative microseconds) of every import ``python -X importtime
    -c SNIPPET`` makes, the interpreter's own start-up included."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", snippet],
                          capture_output=True, text=True, check=True, cwd=REPO, timeout=300)
    trace = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") < 2:
            continue
        _, cumulative, name = line.split("|", 2)
        if cumulative.strip().isdigit():
            depth = (len(name) - len(name.lstrip()) - 1) // 2  # two spaces per level
            trace.append((depth, name.strip(), int(cumulative)))
    return trace


def import_seconds(snippet: str) -> tuple[float, float | None]:
    """Seconds that ``snippet``'s imports take beyond the interpreter's start-up, and
    the share of them that ``import torch`` took inside that same process (None when
    torch is not imported)."""
    baseline = {name for depth, name, _ in import_trace("pass") if depth == 0}
    trace = import_trace(snippet)
    total = sum(us for depth, name, us in trace if depth == 0 and name not in baseline)
    torch_us = next((us for _, name, us in trace if name == "torch"), None)
    return total / 1e6, None if torch_us is None else torch_us / 1e6


RUN_IMPORTS = ("import engine.cli, engine.engine, engine.trainer, engine.data; "
               "from engine.plugin_manager import build_plugin_manager; "
               "build_plugin_manager(autoload=False)")


def measure_imports(reps: int) -> dict:
    """Two ratios: what a run imports against a separate ``import torch`` (interleaved
    processes, medians), and within each run's own process against the torch share
    of it (immune to load changing between processes)."""
    torch_s, run_s, within = [], [], []
    for _ in range(reps):
        torch_s.append(import_seconds("import torch")[0])
        total, torch_part = import_seconds(RUN_IMPORTS)
        run_s.append(total)
        within.append(total / torch_part)
    bare = subprocess.run([sys.executable, "-c",
                           "import sys, engine; print('torch' in sys.modules)"],
                          capture_output=True, text=True, check=True, cwd=REPO, timeout=120)
    return {"torch_s": statistics.median(torch_s), "run_s": statistics.median(run_s),
            "ratio": statistics.median(run_s) / statistics.median(torch_s),
            "ratio_within_process": statistics.median(within),
            "bare_import_engine_imports_torch": bare.stdout.strip() == "True",
            "bare_import_engine_s": import_seconds("import engine")[0]}


# ------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="cifar",
                   help="cifar: the CIFAR net, steps of milliseconds; tiny: a Linear 8->8, "
                        "steps of microseconds (the framework's per-step cost)")
    p.add_argument("--size", type=int,
                   help="training samples, one epoch (default: cifar 4096, tiny 4000)")
    p.add_argument("--batch", type=int, help="global batch (default: cifar 64, tiny 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="single,dp,ddp,ddp-multigpu",
                   help="comma-separated engine modes to compare")
    p.add_argument("--import-reps", type=int, default=5,
                   help="import-time measurements (0: skip)")
    p.add_argument("--threads", type=int,
                   help="torch threads per process on both sides (default: the engine's "
                        "choice, the process's share of the CPUs); 1 steadies the numbers "
                        "on a machine that other jobs load")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the engine side, e.g. log_every=100 "
                        "(repeatable); the hand-written loop has no such knobs")
    p.add_argument("-p", "--plugin", action="append", default=[], metavar="SPEC",
                   help="engine-run's -p for the engine side, e.g. -p no:tensorboard "
                        "(repeatable): what the built-in loggers cost per step")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    *_, default_size, default_batch = WORKLOADS[args.workload]
    args.size = default_size if args.size is None else args.size
    args.batch = default_batch if args.batch is None else args.batch
    args.threads_option = args.threads
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if not any(m in ms for ms in SESSIONS.values())]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from "
                f"{', '.join(m for ms in SESSIONS.values() for m in ms)}")
    if args.reps < 1 or args.size < args.batch:
        p.error("--reps must be >= 1 and --size at least one --batch")
    return args


def main(argv=None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    args = parse_args(argv)
    rows, runs = [], []
    with tempfile.NamedTemporaryFile(prefix="bench_overhead-", suffix=".log",
                                     delete=False) as log:
        log_path = log.name
    for world_size, session_modes in SESSIONS.items():
        modes = [m for m in session_modes if m in args.modes]
        if not modes:
            continue
        from engine.world import World

        # The engine's default: what a spawn worker of this many processes gets.
        args.threads = args.threads_option or World(0, 0, world_size,
                                                    world_size).cpu_share().count
        results = run_session(world_size, modes, args, log_path)
        rows += summarize(world_size, results)
        runs += [{"processes": world_size, **r} for r in results]

    threads = args.threads_option or "the engine's default"
    print(f"{args.workload} training loop, {args.size} samples x 1 epoch, global batch "
          f"{args.batch}, "
          f"threads per process: {threads}, {args.reps} interleaved rounds (engine "
          f"output: {log_path}.rank*)")
    print("wall: loop seconds (medians); ratio = engine / hand-written; min: ratio of the "
          "fastest runs; paired: median of the per-round ratios; cpu: ratio of the "
          "median process CPU seconds of the loop (steadier when other jobs load the "
          "machine)")
    print(f"{'procs':>5}  {'mode':<13} {'hand wall':>10} {'engine wall':>12} "
          f"{'ratio':>6} {'min':>6} {'paired':>6} {'cpu':>6}  weights")
    for r in rows:
        same = "bit-identical" if r["bit_identical"] else "DIFFERENT"
        print(f"{r['processes']:>5}  {r['mode']:<13} {r['hand_s']:>9.3f}s "
              f"{r['engine_s']:>11.3f}s {r['ratio']:>6.3f} {r['min_ratio']:>6.3f} "
              f"{r['paired_ratio']:>6.3f} {r['cpu_ratio']:>6.3f}  {same}")
    print(f"per-step overhead, microseconds: per run, the median over its windows of "
          f"{WINDOW} steps (each holds one of the engine's check points) of the window's "
          f"time / {WINDOW}; engine - hand-written, paired by round: median over the rounds "
          f"[quartiles] (extremes); of wall time and of process CPU time")
    for r in rows:
        cells = [f"{r[key]['median']:7.1f} [{r[key]['q1']:6.1f} {r[key]['q3']:6.1f}] "
                 f"({r[key]['min']:.1f} .. {r[key]['max']:.1f})"
                 for key in ("step_us", "step_cpu_us")]
        print(f"{r['processes']:>5}  {r['mode']:<13} {r['steps']:>6} steps of "
              f"{r['hand_step_us']:.0f} us (hand-written)  wall {cells[0]}  cpu {cells[1]}")
    imports = measure_imports(args.import_reps) if args.import_reps else None
    if imports:
        print(f"imports: what a run imports {imports['run_s']:.3f}s vs import torch "
              f"{imports['torch_s']:.3f}s: ratio {imports['ratio']:.3f}; within the same "
              f"process, all / torch's share: {imports['ratio_within_process']:.3f} "
              f"(medians of {args.import_reps}); bare `import engine` "
              f"{imports['bare_import_engine_s'] * 1000:.1f} ms, imports torch: "
              f"{'yes' if imports['bare_import_engine_imports_torch'] else 'no'}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"loops": rows, "imports": imports,
                                                       "runs": runs}, indent=1))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
