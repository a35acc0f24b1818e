"""Benchmark: the engine against a hand-written loop on examples/hf_causal_lm.py's GPT-2,
on the CPU.

    python tools/bench_lm.py                          # 300 steps, 5 rounds, 1 and 2 processes
    python tools/bench_lm.py --steps 20 --rounds 1    # a dry run: does it work, same losses?
    python tools/bench_lm.py --nproc 2 --memory off --data data/hf

The workload: examples/hf_causal_lm.py's GPT-2 (2 layers, 4 heads, width 128, context
128, vocabulary 257), global batch 32, AdamW (lr 3e-3), gradient clipping at 1.0, fp32,
``--steps`` optimizer steps (300: within the first epoch of 436; beyond it, the engine's
epoch end is timed too), log window 10 steps (the example's), ``--threads`` torch
threads per process (1), on the example's data (``python examples/hf_causal_lm.py
make-data DIR``: no download; made in a temporary folder unless ``--data DIR`` names
one). Both sides train on its ``train`` split alone: without a validation split the
engine validates nothing, as the hand-written loop.

The two sides, in the same processes (spawned, as engine-run's; 1 process, then 2 with
gloo):

- the engine: examples/hf_causal_lm.py through engine.engine.Engine, as engine-run's
  workers run it (tools/bench_overhead.py's ``through_engine``), at its defaults
  (``parallel=auto``, in-memory snapshots ``auto``) except ``max_steps``, enough epochs
  for them, and ``checkpoint.every_epochs=0`` (no disk snapshot at an epoch's end: only
  the final one, after the timed window); with ``--memory off`` or ``both`` also with
  ``checkpoint.memory_every_steps=0``;
- by hand: the example's windows (its ``build_datasets``), its model seeded as the
  engine seeds it, ``DDP(model)`` with more than one process, its AdamW, a
  ``DistributedSampler`` and a ``DataLoader``, and per step the example's
  ``train_step``, ``zero_grad(set_to_none=True)`` just before ``backward`` (where the
  engine frees the gradients), ``clip_grad_norm_``, ``optimizer.step()``; the loss summed
  on the device and one all-reduce of it per log window.

Asserted before anything is compared: every run of either side trained on the same
windows (a digest of every token) from the same initial weights (their digest); the
order of the windows is the sampler's, seeded alike. Reported: whether the final
weights (the engine's ``weights_sha256``) and the last log window's mean loss over the
ranks (the engine's ``train_loss``) are identical. Exit status 1 where they are not.

Sessions: one per process count. Its processes start once and run every variant in
turn, INTERLEAVED as in bench_overhead: a warm-up round that is not counted, then
``--rounds`` rounds, the order rotating every round, so that load from elsewhere on the
machine hits every variant alike. Rank 0 reports.

Timed, on both sides alike, from just before training (the engine: its last
``engine_run_start`` hook; by hand: before the first ``set_epoch``) to the end of the
last optimizer step (the engine: its ``engine_train_step_end`` hook; by hand: after
``optimizer.step()``), so set-up, the final snapshot and the last window's all-reduce
are outside: wall seconds, the process's CPU seconds, and its minor page faults
(``ru_minflt``) from the end of step 1 to the end of the last, per step. Printed: a
markdown table, one row per process count and engine variant, with medians over the
rounds and the ratios engine / hand-written (time: of the medians, and in brackets the
median of the per-round ratios; CPU: of the medians). Target (issue 52): at most 1.02
in training time at 1 and 2 processes with the defaults, on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_overhead as overhead  # noqa: E402  (tools/, next to this file)

from engine import hookimpl  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "hf_causal_lm.py"
#: The issue's setting, over the example's defaults (2 layers, 4 heads, AdamW lr 3e-3,
#: grad_clip_norm 1.0, log_every 10, fp32). batch_size is the global batch.
BATCH = 32
SETTING = ("model.layers=2", "model.width=128", "model.context=128", f"batch_size={BATCH}")
HAND = "hand-written"
#: engine variants: their config overrides
MEMORY = {"on": ("engine", ()),
          "off": ("engine, memory off", ("checkpoint.memory_every_steps=0",))}
WORKLOAD = "gpt2"  # through_engine's name for it


def example_overrides(args) -> list[str]:
    """The config both sides build from (the engine's adds its variant's)."""
    return [*SETTING, f"data.disk={args.train_only}", f"seed={args.seed}",
            f"max_steps={args.steps}", f"epochs={args.steps}"]


# ------------------------------------------------------------------- measuring


class Marks:
    """Wall clock, process CPU time and minor page faults at named points of a run."""

    def __init__(self):
        self.at = {}

    def mark(self, name) -> None:
        self.at[name] = (time.perf_counter(), time.process_time(),
                         resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def record(self, steps: int) -> dict:
        """The timed window (from "start" to the last step's end) and the faults per
        step after the first."""
        (wall0, cpu0, _), (wall1, cpu1, faults1) = self.at["start"], self.at[steps]
        faults_per_step = ((faults1 - self.at[1][2]) / (steps - 1) if steps > 1
                           else float("nan"))
        return {"seconds": wall1 - wall0, "cpu_seconds": cpu1 - cpu0,
                "faults_per_step": faults_per_step}


def windows_digest(dataset) -> str:
    """sha256 of every token of every training window, in the dataset's order."""
    return hashlib.sha256(dataset[:]["input_ids"].numpy().tobytes()).hexdigest()


class EngineClock(Marks):
    """The engine side's plugin object: the same marks as the hand-written loop's, and
    the digests of the windows and initial weights the run starts from."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps
        self.windows = self.initial = self.final_loss = self.memory = None

    @hookimpl(trylast=True)  # after every other plugin's: training starts next
    def engine_run_start(self, ctx):
        from engine.checkpoint import model_digest

        self.windows = windows_digest(ctx.train_loader.dataset)
        self.initial = model_digest(ctx.module.state_dict())
        self.mark("start")

    @hookimpl
    def engine_train_step_end(self, ctx, step, loss):
        if step == 1 or step == self.steps:
            self.mark(step)

    @hookimpl
    def engine_run_end(self, ctx, summary):
        # Every rank's summary has it (rank 0 writes it); a failed run's may not.
        self.final_loss = summary.get("train_loss")
        self.memory = ctx.memory_record  # the tier's interval and costs (None: off)


# --------------------------------------------------------------------- the two sides


def hand_written(rank: int, world_size: int, port: int, args) -> dict:
    """The plain loop (the module's docstring). Returns the run's record."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from engine.checkpoint import model_digest
    from engine.overrides import apply_overrides
    from engine.recipe import load_recipe

    recipe = load_recipe(EXAMPLE)
    example = recipe.module
    cfg = apply_overrides(recipe.make_config(), example_overrides(args))
    torch.set_num_threads(args.threads)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
    quiet = types.SimpleNamespace(print=lambda *_: None, rank=rank, world_size=world_size)
    train_set, _ = example.build_datasets(cfg, quiet)
    torch.manual_seed(cfg.seed)
    model = example.build_model(cfg)
    initial = model_digest(model.state_dict())
    model.train()
    if world_size > 1:
        model = DDP(model)
    optimizer = example.build_optimizer(cfg, model)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=cfg.seed)
    # Through bench_overhead's clock, as the engine's loader is (through_engine's).
    batches = overhead.LoopCPUClock(DataLoader(train_set, batch_size=cfg.batch_size
                                               // world_size, sampler=sampler))
    step_ctx = types.SimpleNamespace(model=model)  # what the example's train_step reads
    window_loss = torch.zeros(())
    final_loss = float("nan")
    marks = Marks()
    marks.mark("start")
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in batches:
            loss = example.train_step(batch, step_ctx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
            optimizer.step()
            window_loss += loss.detach()
            step += 1
            if step in (1, args.steps):
                marks.mark(step)
            if step % cfg.log_every == 0:
                if world_size > 1:
                    dist.all_reduce(window_loss)
                final_loss = window_loss.item() / cfg.log_every / world_size
                window_loss.zero_()
            if step == args.steps:
                break
        epoch += 1
    digest = model_digest(getattr(model, "module", model).state_dict())
    if world_size > 1:
        dist.destroy_process_group()
    return {**marks.record(step), "steps": step, "final_loss": final_loss,
            "digest": digest, "windows": windows_digest(train_set), "initial": initial}


def through_engine(memory: str, rank: int, world_size: int, port: int, out_dir: str,
                   args) -> dict:
    """The example through engine.engine.Engine (bench_overhead's through_engine), with
    an :class:`EngineClock`. Returns the run's record."""
    clock = EngineClock(args.steps)
    engine_args = argparse.Namespace(
        workload=WORKLOAD, size=None, batch=BATCH, seed=args.seed, threads=args.threads,
        plugin=[clock], set=[*example_overrides(args), "checkpoint.every_epochs=0",
                             *MEMORY[memory][1]])
    # through_engine's own loop clock sees no loader run out (max_steps ends the run
    # mid-epoch): its times are not used.
    workloads = {WORKLOAD: (EXAMPLE, lambda size: [], None, None, None)}
    _, _, digest, steps, _ = overhead.through_engine("auto", rank, world_size, port,
                                                     out_dir, engine_args, workloads)
    return {**clock.record(steps), "steps": steps, "final_loss": clock.final_loss,
            "digest": digest, "windows": clock.windows, "initial": clock.initial,
            "memory_record": clock.memory}


# ------------------------------------------------------------------------ sessions


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    overhead.quiet(rank, log_path)
    for (round_index, variant), port in zip(schedule, ports):
        with tempfile.TemporaryDirectory() as out_dir:
            record = (hand_written(rank, world_size, port, args) if variant == HAND
                      else through_engine(variant, rank, world_size, port, out_dir, args))
        if rank == 0:  # every rank runs the same loop; rank 0 speaks for the session
            with open(results_path, "a") as f:
                f.write(json.dumps({"round": round_index, "variant": variant,
                                    **record}) + "\n")


def check_same_start(results: list[dict]) -> None:
    """Every run, of either side, from the same windows and initial weights: otherwise
    nothing here compares like with like."""
    for key, what in (("windows", "training windows"), ("initial", "initial weights")):
        seen = {r[key] for r in results}
        if len(seen) != 1:
            sys.exit(f"bench_lm: the runs started from different {what} "
                     f"({', '.join(sorted(s[:12] for s in seen))}); the comparison is void")


def summarize(world_size: int, results: list[dict]) -> list[dict]:
    counted = [r for r in results if r["round"] > 0]
    hand = [r for r in counted if r["variant"] == HAND]
    hand_by_round = {r["round"]: r for r in hand}
    hand_s = statistics.median(r["seconds"] for r in hand)
    hand_cpu = statistics.median(r["cpu_seconds"] for r in hand)
    hand_results = {(r["digest"], r["final_loss"]) for r in results if r["variant"] == HAND}
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in counted if r["variant"] != HAND):
        runs = [r for r in counted if r["variant"] == variant]
        engine_s = statistics.median(r["seconds"] for r in runs)
        engine_cpu = statistics.median(r["cpu_seconds"] for r in runs)
        engine_results = {(r["digest"], r["final_loss"])
                          for r in results if r["variant"] == variant}
        rows.append({
            "processes": world_size, "setting": MEMORY[variant][0], "memory": variant,
            "rounds": len(runs), "steps": runs[0]["steps"],
            "engine_s": engine_s, "hand_s": hand_s, "ratio": engine_s / hand_s,
            "paired_ratio": statistics.median(
                r["seconds"] / hand_by_round[r["round"]]["seconds"] for r in runs),
            "engine_cpu_s": engine_cpu, "hand_cpu_s": hand_cpu,
            "cpu_ratio": engine_cpu / hand_cpu,
            "engine_faults_per_step": statistics.median(r["faults_per_step"] for r in runs),
            "hand_faults_per_step": statistics.median(r["faults_per_step"] for r in hand),
            "engine_loss": runs[-1]["final_loss"], "hand_loss": hand[-1]["final_loss"],
            # the tier at each counted run's end (rank 0's): interval, estimate, audit
            "memory": [auto_said(r.get("memory_record")) for r in runs],
            # every round, the warm-up's too: one result on each side, and the same
            "identical": len(hand_results) == 1 and engine_results == hand_results,
        })
    return rows


def report(rows: list[dict], args, log_path: str) -> None:
    print(f"examples/hf_causal_lm.py's GPT-2 (2 layers, width 128, context 128), global "
          f"batch 32, AdamW, clipping, fp32, {args.steps} steps, {args.threads} thread(s) "
          f"per process, {args.rounds} interleaved round(s) after a warm-up (engine "
          f"output: {log_path}.rank*)")
    print("times: medians over the rounds, from just before training to the end of the "
          "last step; ratio: engine / hand-written of the medians [median of the "
          "per-round ratios]; faults: minor page faults per step after the first, "
          "medians; final loss: the last log window's mean over the ranks; identical: "
          "final loss and weights, every round; auto: the memory tier at each counted "
          "run's end, interval / its estimated % / its last audit's measured % of the "
          "step time +- that audit's standard error (rank 0's)")
    print()
    print("| processes | setting | engine s | hand s | ratio train time | ratio CPU "
          "| minor faults/step engine / hand | final loss engine / hand | identical | auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['processes']} | {r['setting']} | {r['engine_s']:.3f} "
              f"| {r['hand_s']:.3f} | {r['ratio']:.3f} [{r['paired_ratio']:.3f}] "
              f"| {r['cpu_ratio']:.3f} | {r['engine_faults_per_step']:,.0f} / "
              f"{r['hand_faults_per_step']:,.0f} | {r['engine_loss']:.6f} / "
              f"{r['hand_loss']:.6f} | {'yes' if r['identical'] else 'NO'} "
              f"| {', '.join(r['memory'])} |")


def auto_said(record: dict | None) -> str:
    """summary.json's memory_snapshots as interval / estimated % / measured % +- its error."""
    if not record:
        return "-"
    said = "/".join(str(record.get(key)) for key in
                    ("every_steps", "cost_percent", "measured_percent"))
    error = record.get("measured_error_percent")
    return said if error is None else f"{said}+-{error}"


# ------------------------------------------------------------------------- data


def train_only(data: str | None, work: pathlib.Path) -> str:
    """A save_to_disk folder of the example data's ``train`` split alone (no validation
    split: the engine then validates nothing); ``data``: a make-data folder, or None to
    make one in ``work``."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    from engine.recipe import load_recipe

    if data is None:
        data = work / "made"
        load_recipe(EXAMPLE).module.make_data(data)
    disk = pathlib.Path(data) / "disk"
    if not disk.is_dir():
        sys.exit(f"bench_lm: --data {data} has no disk/ folder; give a folder written by "
                 "python examples/hf_causal_lm.py make-data DIR")
    datasets.disable_progress_bars()
    out = work / "train-only"
    datasets.load_from_disk(str(disk))["train"].save_to_disk(str(out))
    return str(out)


# ------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=5,
                   help="counted rounds (plus 1 warm-up)")
    p.add_argument("--nproc", default="1,2", help="process counts, comma-separated (1, 2)")
    p.add_argument("--memory", choices=("on", "off", "both"), default="both",
                   help="the engine's in-memory snapshots: on (its default, auto), off "
                        "(checkpoint.memory_every_steps=0), or both variants")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="a folder from python examples/hf_causal_lm.py "
                                  "make-data DIR (default: made in a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    try:
        args.nproc = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        p.error(f"--nproc {args.nproc}: expected process counts, e.g. 1,2")
    if not set(args.nproc) <= {1, 2}:
        p.error(f"--nproc {','.join(map(str, args.nproc))}: choose from 1, 2")
    if args.steps < 10 or args.rounds < 1 or args.threads < 1:
        p.error("--steps must be >= 10 (one log window), --rounds and --threads >= 1")
    return args


def main(argv=None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    args = parse_args(argv)
    with tempfile.NamedTemporaryFile(prefix="bench_lm-", suffix=".log", delete=False) as log:
        log_path = log.name
    variants = [HAND, *(["on", "off"] if args.memory == "both" else [args.memory])]
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench_lm-data-") as work:
        args.train_only = train_only(args.data, pathlib.Path(work))
        for world_size in args.nproc:
            results = overhead.run_workers(session_worker, world_size,
                                           overhead.interleaved(variants, args.rounds),
                                           args, log_path)
            check_same_start(results)
            rows += summarize(world_size, results)
            runs += [{"processes": world_size, **r} for r in results]
    check_same_start(runs)  # across the process counts too
    report(rows, args, log_path)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs},
                                                      indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
