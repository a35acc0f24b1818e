"""Benchmark: the host CPU a GPU training step burns, the engine's against a hand-written
loop's, counted per thread, with the variants that tell where it goes.

    python tools/bench_gpu_host_cpu.py                     # on a CUDA machine
    python tools/bench_gpu_host_cpu.py --device cpu --size 512 --reps 1   # smoke, CPU

Each variant runs in a fresh process (an OpenMP setting is read when torch loads), one
epoch of recipes/cifar_ddp.py's network on its synthetic data (tools/bench_compile.py's
eager runs: the hand-written loop loads in its own process without pinning; the engine
with its own loader settings). Timed is the training loop (bench_overhead.py's
LoopCPUClock: the median window of 20 steps), wall and process CPU time per step, and
each thread's CPU time over the whole loop (/proc/self/task; ``others``: every thread
but the main one), so that a pool of threads spinning shows as such:

- ``hand``: the tutorial's loop, torch's default threads;
- ``hand pinned``: the same with the engine's loader settings (workers, pinned memory,
  copies that do not block);
- ``engine``: engine-run's settings (loader workers, pinned memory, and on a CUDA device
  the training process's threads cut to what the workers leave it: engine/loader_settings.py);
- ``engine threads-1``: the same with one torch thread from the start (``--threads 1``);
- ``engine all-threads``: the same with one torch thread per CPU (``--threads``, as
  before that cut);
- ``engine all-threads passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP's
  idle threads sleep instead of spinning): where its CPU falls to ``engine``'s, the
  CPU went to spinning, not to work;

Printed per variant: the medians over ``--reps`` rounds of wall and CPU ms per step, and
the round's busiest threads (name: CPU ms per step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

VARIANTS = {  # name: (loop, engine --threads: None, "all" CPUs or a number, env, --set)
    "hand": ("hand", None, {}, []),
    "hand pinned": ("hand pinned", None, {}, []),
    "engine": ("engine", None, {}, []),
    "engine threads-1": ("engine", 1, {}, []),
    "engine all-threads": ("engine", "all", {}, []),
    "engine all-threads passive": ("engine", "all", {"OMP_WAIT_POLICY": "PASSIVE"}, []),
}
TICK = os.sysconf("SC_CLK_TCK")
#: The steps whose CPU ops --ops lists (torch.profiler), past the first windows.
PROFILED = (100, 110)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Every thread of this process: tid -> (name, CPU seconds so far)."""
    threads = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name = ("main" if int(task.name) == os.getpid()
                else stat[stat.index("(") + 1:stat.rindex(")")])
        fields = stat[stat.rindex(")") + 2:].split()
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return threads


def hand_loop(run, pinned: bool) -> tuple[float, float]:
    """The tutorial's loop on ``run.device`` (tools/bench_compile.py's, its model, data
    and optimizer), loading in its own process without pinning, or (``pinned``) with
    the engine's automatic loader settings for this machine: workers, pinned memory,
    copies that do not block. Returns the median window's wall and CPU seconds per step."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    import bench_compile
    from bench_overhead import LoopCPUClock
    from engine import loader_settings

    recipe, cfg = bench_compile.run_config(run)
    train_set = bench_compile.training_set(recipe, cfg, run)
    torch.manual_seed(run.seed)
    model = recipe.module.build_model(cfg).to(run.device)
    optimizer = recipe.module.build_optimizer(cfg, model)
    kwargs = {}
    if pinned:
        workers = loader_settings.auto_workers(len(os.sched_getaffinity(0)))
        kwargs = {"num_workers": workers, "pin_memory": run.device == "cuda",
                  "persistent_workers": True, "prefetch_factor": max(2, -(-4 // workers))}
    loader = DataLoader(train_set, batch_size=run.batch, shuffle=True, **kwargs)
    clock = LoopCPUClock(loader)
    for inputs, labels in clock:
        inputs = inputs.to(run.device, non_blocking=pinned)
        labels = labels.to(run.device, non_blocking=pinned)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    if run.device == "cuda":
        torch.cuda.synchronize()
    return clock.step_seconds()


def one_variant(args) -> dict:
    """Runs ``args.one`` in this process; returns its step times and threads' CPU."""
    import bench_compile
    import bench_overhead

    loop, threads, _, overrides = VARIANTS[args.one]
    marks = {}
    clock_iter = bench_overhead.LoopCPUClock.__iter__

    def counted(self):  # the loop's threads: from the first batch to the last step
        import torch

        marks["torch_threads"] = torch.get_num_threads()  # the main thread's, now
        marks["before"] = thread_cpu()
        profiler = None
        for i, batch in enumerate(clock_iter(self)):
            if args.ops and i == PROFILED[0]:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                profiler.__enter__()
            elif profiler is not None and i == PROFILED[1]:
                profiler.__exit__(None, None, None)
                with open(args.ops, "a") as f:
                    f.write(f"== {args.one}: CPU ops of steps {PROFILED[0]}-{PROFILED[1]}\n")
                    f.write(profiler.key_averages(group_by_input_shape=True).table(
                        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40,
                        max_shapes_column_width=60) + "\n")
                profiler = None
            yield batch
        marks["after"] = thread_cpu()
        marks["steps"] = len(self.loader)
    bench_overhead.LoopCPUClock.__iter__ = counted

    run = argparse.Namespace(
        workload="cifar", size=args.size, batch=args.batch, seed=0, device=args.device,
        precision="32", backend="inductor", mode="default", plugin=[],
        threads=os.cpu_count() if threads == "all" else threads, log=args.log)
    if loop.startswith("hand"):
        wall, cpu = hand_loop(run, pinned=loop == "hand pinned")
    else:
        from engine.launcher import free_port

        run.set = overrides
        # The engine prints its progress; keep it out of the benchmark's output.
        with tempfile.TemporaryDirectory() as out_dir, open(args.log, "a") as log, \
                contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            *_, (wall, cpu) = bench_overhead.through_engine(
                "single", 0, 1, free_port(), out_dir, run, bench_compile.COMPILE_WORKLOADS)
    steps = marks["steps"]
    before, after = marks["before"], marks["after"]
    per_thread = sorted(((name, (cpu_s - before.get(tid, (name, 0.0))[1]) / steps)
                         for tid, (name, cpu_s) in after.items()), key=lambda t: -t[1])
    return {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3, "threads": len(after),
            "torch_threads": marks["torch_threads"],
            "busiest": [(name, round(s * 1e3, 2)) for name, s in per_thread[:6]],
            "others_ms": sum(s for name, s in per_thread if name != "main") * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--size", type=int, default=16384, help="training samples")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=2, help="rounds, each variant once")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--ops", metavar="PATH", help="append each variant's CPU ops of 10 "
                   "steps here (torch.profiler, by input shape), in its first round")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a variant, in this process
    p.add_argument("--log", default=os.devnull, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_variant(args)))
        return 0
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    results = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.reps):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                env = {**os.environ, **VARIANTS[name][2]}
                started = time.monotonic()
                out = subprocess.run(
                    [sys.executable, __file__, "--one", name, "--device", args.device,
                     *(["--ops", args.ops] if args.ops and round_index == 0 else []),
                     "--size", str(args.size), "--batch", str(args.batch),
                     "--log", os.path.join(tmp, "engine.log")],
                    env=env, capture_output=True, text=True, timeout=600)
                if out.returncode:
                    print(f"{name}: failed ({out.returncode}):\n{out.stderr[-3000:]}")
                    return 1
                result = json.loads(out.stdout.strip().splitlines()[-1])
                result["process_s"] = time.monotonic() - started
                results[name].append(result)
    print(f"device {args.device}, {os.cpu_count()} CPUs, CIFAR net, batch {args.batch}, "
          f"{args.size} samples, {args.reps} round(s); per step, medians over rounds")
    print(f"{'variant':28} {'wall ms':>8} {'CPU ms':>8} {'others':>8}  busiest threads "
          "(CPU ms per step, last round)")
    for name, runs in results.items():
        wall = statistics.median(r["wall_ms"] for r in runs)
        cpu = statistics.median(r["cpu_ms"] for r in runs)
        others = statistics.median(r["others_ms"] for r in runs)
        busiest = ", ".join(f"{n} {ms:g}" for n, ms in runs[-1]["busiest"])
        print(f"{name:28} {wall:8.2f} {cpu:8.2f} {others:8.2f}  {busiest} "
              f"({runs[-1]['threads']} threads, torch {runs[-1]['torch_threads']})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
