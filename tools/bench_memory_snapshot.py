"""Benchmark: what in-memory snapshots (``checkpoint.memory_every_steps=N``) cost per step,
against the same engine with them off, on the CPU.

    python tools/bench_memory_snapshot.py                   # every workload, 5 rounds
    python tools/bench_memory_snapshot.py --workloads cifar --procs 2 --reps 9
    python tools/bench_memory_snapshot.py --workloads mlp100 --every 10
    python tools/bench_memory_snapshot.py --workloads cifar --every auto --sweep ''

Workloads (``--workloads``), each through engine.engine.Engine as engine-run's workers
run it (tools/bench_overhead.py's ``through_engine``), ``single`` for 1 process, ``ddp``
with gloo for 2 (``--parallel fsdp``: fully_shard, each rank's snapshot its shards):

- ``cifar``: recipes/cifar_ddp.py's network, synthetic data, global batch 64, 200 steps
  (so that N = 100 takes two snapshots), 1 and 2 processes;
- ``tiny``: tools/bench_tiny_recipe.py, a Linear 8 -> 8 at global batch 2, 500 steps
  of microseconds: the snapshot's fixed cost (capture, skeleton, checksum, header)
  against the smallest step, 1 and 2 processes;
- ``mlp100``: tools/bench_tiny_recipe.py with ``hidden_width=3584``, an MLP 8 -> 3584 ->
  3584 -> 3584 -> 8 of 103 MB of float32 weights, SGD with momentum (a 206 MB
  snapshot), global batch 8, 20 steps: the copy bandwidth, 1 process.

Sessions: one per workload and process count. Its processes start once and run every
variant in turn, INTERLEAVED as in tools/bench_overhead.py: a warm-up round that is not
counted, then ``--reps`` rounds, the order rotating every round, so that load from
elsewhere on the machine hits every variant alike. The variants: memory snapshots off
(``memory_every_steps=0``), every ``--every`` steps (``auto``: the engine's default,
from every step to the interval its measured costs allow; the N it ended with and
the cost it measured are printed as "auto N" and "auto %"), and on the sessions that
``--sweep`` names (default: CIFAR on 2 processes) every N for each N it lists.

Timed: the training loop only (bench_overhead's LoopCPUClock: from the first request for
a batch to the request that finds none left), so set-up, validation and the final disk
snapshot are outside. Printed per workload, process count and N:

- step off / on: the loop's seconds / steps (medians over the rounds);
- cost: (on - off) / steps, paired by round: median [quartiles] in ms and in % of the
  step time off; the same of the loop's process CPU time (steadier on a shared machine).
  Whole loops: with N above bench_overhead's window of 20 steps most windows hold no
  snapshot and their median would hide it. Where N divides 20, also (win %) the
  median windows' cost, paired by round: barely moved by bursts of load elsewhere;
- snap %: the engine's own clock of its memory snapshots (engine.phases' "memory
  snapshots while training": capture, copy, checksum, header) / steps, in % of the step
  off (exact even where N is large and the loop's noise hides the cost);
- one snapshot, by the same clock read at every step's end (a probe plugin: this
  module): the run's first (it also maps the buffers and checks /dev/shm's room) and
  the median of the others;
- bytes: the payload of the newest buffer (engine.memory.buffer's header, read at the
  epoch's end, before the run removes its buffers; the model's and optimizer's tensor
  bytes are in --json); bandwidth: payload bytes / time of one snapshot;
- where one snapshot's time goes, measured by the probe after the loop (median of 3):
  capture (the snapshot dict, each rank its own share, no collective:
  engine.memory.tier's capture) and its slowest parts (engine/stateful.py's; rng,
  engine/rng.py's: this rank's exchange row), copy (skeleton, tensors into the buffer,
  checksum, header, waited for here, where the loop leaves a large state's to a
  background thread), and payload bytes / copy time;
- the ratio on / off of the step's wall and process CPU time, paired by round (the
  CPU time counts the background thread's and torch's threads' work as well: on a
  machine without an idle core, what overlapping cannot hide);
- weights: bit-identical to the run with snapshots off (a snapshot only reads), every
  round. Exit status 1 where they are not.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_overhead as overhead  # noqa: E402  (tools/, next to this file)

import engine  # noqa: E402

MLP_WIDTH = 3584  # the tiny recipe's MLP: 103 MB of float32 weights
#: workload: bench_overhead's shape (recipe, its config overrides for a size, its
#: training set for a size, default size, global batch), plus the 100 MB MLP.
WORKLOADS = {**overhead.WORKLOADS, "mlp100": (
    overhead.TINY_RECIPE, lambda size: [f"train_size={size}", f"hidden_width={MLP_WIDTH}"],
    lambda module, size: module.make_data(size), 320, 8)}
#: workload: (default steps per run, default process counts)
DEFAULTS = {"cifar": (200, (1, 2)), "tiny": (500, (1, 2)), "mlp100": (20, (1,))}
MODES = {1: "single", 2: "ddp"}
OFF = 0
PROBE = "bench_memory_snapshot"  # this module, as the engine's -p plugin
PROBE_FILE = "BENCH_MEMORY_SNAPSHOT_PROBE"  # where the probe writes, set by the worker


# ------------------------------------------------------------------ the probe plugin
# This module is also a plugin (-p bench_memory_snapshot): its module-level engine_*
# functions are hook implementations, so no other function here may start with engine_.


#: The engine's clock of its memory snapshots (wall seconds, count) at each step's end
#: where it moved: one snapshot's time each, the first (which maps the buffers) apart.
_marks: list[tuple[float, int]] = []


@engine.hookimpl
def engine_run_start(ctx):
    from engine import phases

    _marks[:] = [phases.carved(phases.MEMORY_SNAPSHOTS)[::2]]  # one per run


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    # Fires before the step's own snapshot: it sees the previous step's. Both variants
    # pay for this call alike.
    from engine import phases

    wall, _, count = phases.carved(phases.MEMORY_SNAPSHOTS)
    if count != _marks[-1][1]:
        _marks.append((wall, count))


@engine.hookimpl
def engine_epoch_end(ctx, epoch, metrics):
    """At the epoch's end (after the timed loop, before the run removes its buffers):
    each snapshot's time in the loop, the newest buffer's payload bytes, the bytes both
    buffers hold, the tensor bytes of the model and optimizer, and where one snapshot's
    time goes (:func:`split_times`), into the file that the session's worker named (the
    run folder is rank 0's on every rank)."""
    import torch

    from engine.memory import buffer

    engine_train_step_end(ctx, None, None)  # the last step's snapshot
    tier = ctx.snapshots.memory
    memory = tier.pair if tier is not None else None  # the tier's buffers
    if memory is not None:
        memory.finish()  # the last snapshot's background copy
    slot = buffer.newest(memory.paths) if memory is not None else None
    tensors = [*ctx.module.state_dict().values(),
               *(v for s in ctx.optimizer.state.values() for v in s.values())]
    probe = {"snapshot_times": [b[0] - a[0] for a, b in zip(_marks, _marks[1:])],
             "payload_bytes": slot.length if slot else 0,
             "held_bytes": memory.bytes_held() if memory is not None else 0,
             # summary.json's: the interval the run ended with (auto's choice) and the
             # cost the engine measured.
             "memory_record": ctx.memory_record,
             "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors
                                 if isinstance(t, torch.Tensor)),
             **(split_times(ctx) if slot else {})}
    pathlib.Path(os.environ[PROBE_FILE]).write_text(json.dumps(probe))


def split_times(eng, times: int = 3) -> dict:
    """Where a memory snapshot's time goes, each the median of ``times`` after the
    loop: capture (the snapshot dict, each rank its own share: engine.memory.tier's
    capture), each snapshot part's share of it (``rng``: this rank's exchange row),
    and the copy (engine.memory.pair's save as the loop calls it, and the wait for
    its background part: skeleton, tensors into the buffer, checksum, header). These
    extra snapshots come after the last step: the weights and the timed loop are
    untouched."""
    import time

    from engine import snapshot
    from engine.memory import copy_plan, rows, tier
    from engine.stateful import LocalStateful

    parts = eng.snapshot_parts
    spent: dict[str, list[float]] = {"capture": [], "copy": [],
                                     **{name: [] for name in parts.names()}}
    for _ in range(times):
        for name in parts.names():
            # As the tier's capture takes it: a rank's own share (fsdp: its shards).
            part = (parts[name].local_state_dict if isinstance(parts[name], LocalStateful)
                    else parts[name].state_dict)
            if name == "rng":
                part = functools.partial(rows.make_row, None)
            start = time.perf_counter()
            part()
            spent[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        memory = eng.snapshots.memory.pair
        state = tier.capture(eng, memory.config, snapshot.capture,
                             memory.exchanges.line(eng.device))[0]
        middle = time.perf_counter()
        memory.save(state, step=eng.state.step, epoch=eng.state.epoch,
                    held=functools.partial(copy_plan.held_by, eng.optimizer))
        memory.finish()  # a large state's background copy: counted here
        spent["capture"].append(middle - start)
        spent["copy"].append(time.perf_counter() - middle)
    medians = {name: statistics.median(values) for name, values in spent.items()}
    return {"capture_s": medians.pop("capture"), "copy_s": medians.pop("copy"),
            "parts_s": medians}


# ------------------------------------------------------------------------ sessions


def one_run(every: int | str, rank: int, world_size: int, port: int, out_dir: str,
            args) -> dict:
    """One run of the session's workload with memory_every_steps=``every``: the loop's
    wall and CPU seconds, steps, weights digest, the engine's clock of its memory
    snapshots and the probe's bytes."""
    from engine import phases

    run_args = argparse.Namespace(**{
        **vars(args), "plugin": [*args.plugin, PROBE],
        "set": [f"checkpoint.memory_every_steps={every}", *args.set]})
    probe_path = pathlib.Path(out_dir) / f"memory_probe.rank{rank}.json"
    os.environ[PROBE_FILE] = str(probe_path)
    before = phases.carved(phases.MEMORY_SNAPSHOTS)  # a process runs several engines
    seconds, cpu, digest, steps, (window_step, _) = overhead.through_engine(
        args.parallel or MODES[world_size], rank, world_size, port, out_dir, run_args,
        WORKLOADS)
    wall, _, snapshots = (after - earlier for after, earlier in
                          zip(phases.carved(phases.MEMORY_SNAPSHOTS), before))
    probe = json.loads(probe_path.read_text())
    return {"every": every, "seconds": seconds, "cpu_seconds": cpu, "steps": steps,
            "window_step_s": window_step, "digest": digest, "snapshot_s": wall,
            "snapshots": snapshots, **probe}


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    overhead.quiet(rank, log_path)
    for (round_index, every), port in zip(schedule, ports):
        with tempfile.TemporaryDirectory() as out_dir:
            record = {"round": round_index,
                      **one_run(every, rank, world_size, port, out_dir, args)}
        if rank == 0:  # every rank runs the same loop; rank 0 speaks for the session
            with open(results_path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------ summary


def summarize(workload: str, world_size: int, results: list[dict]) -> list[dict]:
    """One row per N: step times, the cost paired by round, one snapshot's time, its
    bytes and bandwidth, and whether the weights match the runs without snapshots."""
    counted = [r for r in results if r["round"] > 0]
    off = {r["round"]: r for r in counted if r["every"] == OFF}
    off_digests = {r["digest"] for r in results if r["every"] == OFF}
    rows = []
    for every in dict.fromkeys(r["every"] for r in counted if r["every"] != OFF):
        runs = [r for r in counted if r["every"] == every]
        steps = runs[0]["steps"]

        def per_step(r, key="seconds"):
            return r[key] / r["steps"]

        cost = [per_step(r) - per_step(off[r["round"]]) for r in runs]
        cost_pct = [100 * c / per_step(off[r["round"]]) for c, r in zip(cost, runs)]
        cpu_pct = [100 * (per_step(r, "cpu_seconds") / per_step(off[r["round"]], "cpu_seconds")
                          - 1) for r in runs]
        ratio = [per_step(r) / per_step(off[r["round"]]) for r in runs]
        # One snapshot: the median of a run's snapshots after its first (which maps
        # the buffers and checks /dev/shm's room), the median of that over the runs.
        one = [statistics.median(r["snapshot_times"][1:] or r["snapshot_times"])
               for r in runs if r["snapshot_times"]]
        snapshot_s = statistics.median(one) if one else 0.0
        share = [100 * per_step(r, "snapshot_s") / per_step(off[r["round"]]) for r in runs]
        payload = runs[-1]["payload_bytes"]
        copy_s = statistics.median(r["copy_s"] for r in runs)
        digests = {r["digest"] for r in results if r["every"] == every}
        rows.append({
            "workload": workload, "processes": world_size, "every": every,
            "reps": len(runs), "steps": steps, "snapshots": runs[0]["snapshots"],
            "step_off_ms": 1e3 * statistics.median(per_step(r) for r in off.values()),
            "step_on_ms": 1e3 * statistics.median(per_step(r) for r in runs),
            "cost_ms": overhead.spread([1e3 * c for c in cost]),
            "cost_pct": overhead.spread(cost_pct), "cpu_cost_pct": overhead.spread(cpu_pct),
            "cpu_step_off_ms": 1e3 * statistics.median(
                per_step(r, "cpu_seconds") for r in off.values()),
            "cpu_step_on_ms": 1e3 * statistics.median(per_step(r, "cpu_seconds") for r in runs),
            "ratio": overhead.spread(ratio),
            "cpu_ratio": overhead.spread([1 + p / 100 for p in cpu_pct]),
            "window_cost_pct": window_cost_pct(every, runs, off),
            "snapshot_ms": 1e3 * snapshot_s, "snapshot_share_pct": overhead.spread(share),
            "first_snapshot_ms": 1e3 * statistics.median(
                r["snapshot_times"][0] for r in runs if r["snapshot_times"]),
            "payload_bytes": payload, "held_bytes": runs[-1]["held_bytes"],
            # The interval each run ended with (auto: its choice) and the engine's
            # measured cost at it, in % of the step (MemoryCost.record, rank 0's).
            "chosen_every": [(r.get("memory_record") or {}).get("every_steps") for r in runs],
            "engine_cost_pct": [(r.get("memory_record") or {}).get("cost_percent")
                                for r in runs],
            "tensor_bytes": runs[-1]["tensor_bytes"],
            "bandwidth_gb_s": payload / snapshot_s / 1e9 if snapshot_s else 0.0,
            "capture_ms": 1e3 * statistics.median(r["capture_s"] for r in runs),
            "copy_ms": 1e3 * copy_s,
            "copy_gb_s": payload / copy_s / 1e9,
            "capture_parts_ms": {name: 1e3 * statistics.median(r["parts_s"][name] for r in runs)
                                 for name in runs[0]["parts_s"]},
            "bit_identical": len(off_digests) == 1 and digests == off_digests,
        })
    return rows


def window_cost_pct(every: int, runs: list[dict], off: dict) -> dict | None:
    """The per-step cost in % from the median windows of ``overhead.WINDOW`` steps,
    paired by round; None where N does not divide the window (most windows would hold
    no snapshot, or windows would differ in how many they hold) or no run has a window."""
    if not isinstance(every, int) or overhead.WINDOW % every or any(
            r["window_step_s"] != r["window_step_s"] for r in runs):  # NaN: < 1 window
        return None
    return overhead.spread([100 * (r["window_step_s"] / off[r["round"]]["window_step_s"] - 1)
                            for r in runs])


def report(rows: list[dict], args, log_path: str) -> None:
    threads = args.threads_option or "the engine's default"
    print(f"memory snapshots (checkpoint.memory_every_steps=N) against off, threads per "
          f"process: {threads}, {args.reps} interleaved rounds (engine output: "
          f"{log_path}.rank*)")
    print("step: loop seconds / steps, median over rounds; cost: (on - off) / steps, "
          "paired by round, median [quartiles], in ms and in % of the step off; cpu %: the "
          "same of process CPU time; win %: the same of bench_overhead's median windows of "
          f"{overhead.WINDOW} steps (robust to bursts of load; only where N divides "
          f"{overhead.WINDOW}); snap %: the engine's clock of its memory snapshots / steps, "
          "in % of the step off")
    print(f"{'workload':<8} {'procs':>5} {'N':>4} {'steps':>5} {'snaps':>5} "
          f"{'step off':>9} {'step on':>9}  {'cost ms':<25} {'cost %':<22} "
          f"{'cpu %':>6} {'win %':>6} {'snap %':>7}  weights")
    for r in rows:
        c, p = r["cost_ms"], r["cost_pct"]
        same = "bit-identical" if r["bit_identical"] else "DIFFERENT"
        window = ("-" if r["window_cost_pct"] is None
                  else f"{r['window_cost_pct']['median']:.2f}")
        print(f"{r['workload']:<8} {r['processes']:>5} {r['every']:>4} {r['steps']:>5} "
              f"{r['snapshots']:>5} {r['step_off_ms']:>7.3f}ms {r['step_on_ms']:>7.3f}ms  "
              f"{c['median']:7.3f} [{c['q1']:6.3f} {c['q3']:6.3f}]  "
              f"{p['median']:6.2f} [{p['q1']:6.2f} {p['q3']:6.2f}]  "
              f"{r['cpu_cost_pct']['median']:6.2f} {window:>6} "
              f"{r['snapshot_share_pct']['median']:7.2f}  {same}")
    print("ratio on / off per step, paired by round: median [quartiles]; of wall time and "
          "of the loop's process CPU time (the training thread, the background thread and "
          "torch's threads together: what a busy machine cannot hide), with the CPU ms per "
          "step off and on (medians)")
    print(f"{'workload':<8} {'procs':>5} {'N':>4}  {'wall ratio':<24} {'cpu ratio':<24} "
          f"{'cpu off':>9} {'cpu on':>9}")
    for r in rows:
        w, c = r["ratio"], r["cpu_ratio"]
        print(f"{r['workload']:<8} {r['processes']:>5} {r['every']:>4}  "
              f"{w['median']:6.3f} [{w['q1']:6.3f} {w['q3']:6.3f}]   "
              f"{c['median']:6.3f} [{c['q1']:6.3f} {c['q3']:6.3f}]   "
              f"{r['cpu_step_off_ms']:7.3f}ms {r['cpu_step_on_ms']:7.3f}ms")
    print("one snapshot in the loop (the engine's clock; first: the run's first, which maps "
          "the buffers; then the median of the others); MB: its payload; GB/s: payload / "
          "one snapshot; after the loop (medians of 3): capture (the snapshot dict; its "
          "slowest parts) and copy (into the buffer, checksum, header), payload / copy")
    print(f"{'workload':<8} {'procs':>5} {'N':>4} {'first ms':>9} {'one ms':>8} {'MB':>8} "
          f"{'GB/s':>6}  {'capture ms':>10} {'copy ms':>8} {'GB/s':>6}  slowest parts (ms)")
    for r in rows:
        parts = sorted(r["capture_parts_ms"].items(), key=lambda item: -item[1])[:3]
        print(f"{r['workload']:<8} {r['processes']:>5} {r['every']:>4} "
              f"{r['first_snapshot_ms']:9.3f} {r['snapshot_ms']:8.3f} "
              f"{r['payload_bytes'] / 1e6:8.3f} {r['bandwidth_gb_s']:6.2f}  "
              f"{r['capture_ms']:10.3f} {r['copy_ms']:8.3f} {r['copy_gb_s']:6.2f}  "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in parts))
    auto = [r for r in rows if r["every"] == "auto"]
    if auto:
        print("auto: each round's interval at the run's end, and the engine's measured cost "
              "at it in % of the step time (summary.json's memory_snapshots; budget 2%)")
    for r in auto:
        chosen = ", ".join(str(n) for n in r["chosen_every"])
        cost = ", ".join("-" if c is None else f"{c:.2f}" for c in r["engine_cost_pct"])
        print(f"  {r['workload']}, {r['processes']} process(es): N {chosen}; cost % {cost}")


# ------------------------------------------------------------------------- main


def parse_sweep(text: str) -> dict[tuple[str, int], list[int]]:
    """'cifar:2:10,100' -> {('cifar', 2): [10, 100]} ('' -> no sweep)."""
    if not text:
        return {}
    try:
        workload, procs, values = text.split(":")
        return {(workload, int(procs)): [int(v) for v in values.split(",")]}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected WORKLOAD:PROCS:N[,N...], e.g. cifar:2:10,100") from None


def parse_every(text: str) -> int | str:
    """--every: a number of steps (>= 1) or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of steps or auto") \
            from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--workloads", default="cifar,tiny,mlp100",
                   help=f"comma-separated, from {', '.join(DEFAULTS)}")
    p.add_argument("--procs", help="comma-separated process counts (1, 2) for every "
                                   "workload (default: cifar and tiny 1,2; mlp100 1)")
    p.add_argument("--every", type=parse_every, default=1,
                   help="N of memory_every_steps=N (or auto), against 0 (off)")
    p.add_argument("--sweep", type=parse_sweep, default="cifar:2:10,100",
                   metavar="WORKLOAD:PROCS:N,...",
                   help="more values of N on one session (default cifar:2:10,100; '': none)")
    p.add_argument("--steps", type=int,
                   help="training steps per run, every workload (default: cifar 200, "
                        "tiny 500, mlp100 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int,
                   help="torch threads per process (default: the engine's choice)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. width=512 (repeatable)")
    p.add_argument("-p", "--plugin", action="append", default=[], metavar="SPEC",
                   help="engine-run's -p for every run (repeatable)")
    p.add_argument("--parallel", choices=("single", "ddp", "fsdp"),
                   help="the parallel mode of every session (default: single for 1 "
                        "process, ddp for 2); fsdp: each rank's snapshot holds its shards")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in DEFAULTS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from "
                f"{', '.join(DEFAULTS)}")
    args.procs = None if args.procs is None else [int(n) for n in args.procs.split(",")]
    if args.procs and not set(args.procs) <= set(MODES):
        p.error(f"--procs {','.join(map(str, args.procs))}: choose from 1, 2")
    if args.reps < 1 or (args.every != "auto" and args.every < 1) or (
            args.steps is not None and args.steps < 1):
        p.error("--reps, --every and --steps must be >= 1 (--every: or auto)")
    args.threads_option = args.threads
    return args


def sessions(args) -> list[tuple[str, int, list[int]]]:
    """(workload, processes, the values of memory_every_steps, 0 first) of each session."""
    plan = []
    for workload in args.workloads:
        for procs in args.procs or DEFAULTS[workload][1]:
            extra = args.sweep.get((workload, procs), [])
            plan.append((workload, procs, list(dict.fromkeys([OFF, args.every, *extra]))))
    return plan


def main(argv=None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    args = parse_args(argv)
    from engine.world import World

    with tempfile.NamedTemporaryFile(prefix="bench_memory_snapshot-", suffix=".log",
                                     delete=False) as log:
        log_path = log.name
    rows, runs = [], []
    for workload, procs, variants in sessions(args):
        *_, batch = WORKLOADS[workload]
        steps = args.steps or DEFAULTS[workload][0]
        session_args = argparse.Namespace(**{
            **vars(args), "workload": workload, "batch": batch, "size": steps * batch,
            # The engine's default: what a spawn worker of this many processes gets.
            "threads": args.threads_option or World(0, 0, procs, procs).cpu_share().count})
        results = overhead.run_workers(session_worker, procs,
                                       overhead.interleaved(variants, args.reps),
                                       session_args, log_path)
        rows += summarize(workload, procs, results)
        runs += [{"workload": workload, "processes": procs, **r} for r in results]
    report(rows, args, log_path)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs},
                                                      indent=1))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
