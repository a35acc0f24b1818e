"""Benchmark: the engine training on token shards against a hand-written loop that reads
the same memory-mapped windows, with the same model; and the shard loader alone.

    python tools/bench_token_shards.py                     # 1 process, 5 rounds
    python tools/bench_token_shards.py --reps 9 --chars 1000000 --nproc 2

The workload is recipes/char_lm.py with ``data.shards=DIR`` (its transformer, AdamW,
warmup-cosine schedule, gradient clipping, the accuracy metric beside the loss, one
epoch), on shards that ``engine.token_shards.write_shards`` writes from ``--chars``
bytes of Python's standard library sources (bytes as tokens).

- hand-written: the recipe's model, optimizer, scheduler and ``train_step``, in a plain
  loop (DDP for more than one process) over the same windows in the same order (the
  engine's sampler's, from the seed), each batch read by slicing ``np.load(mmap_mode="r")``
  maps and stacking: no Dataset, no DataLoader, no collation. Final weights are compared
  with the engine's (bit-identical when both did the same work).
- engine (``num_workers=0``): the engine as engine-run's workers run it, reading the
  windows in the training process as the hand-written loop does: the ratio of their loop
  times is the engine's cost, its token-shard loader's included (target <= 1.02).
- engine auto: the same with ``num_workers=auto`` (what a run chooses).
- loader alone: the engine's training DataLoader over the shards (engine.data.train_loader,
  0 workers and the auto choice), iterated over the epoch without training: its tokens/s
  against the training step's say whether the loader could be the bottleneck.

Rounds are interleaved (a warm-up round not counted, then ``--reps`` rounds with the
order rotating), as tools/bench_overhead.py does, whose loop clock and session runner
this reuses: only the training loop is timed (first request for a batch to the one that
finds none left), in wall time and in process CPU time (steadier on a shared machine).
Printed: medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools import bench_overhead as overhead  # noqa: E402  (the loop clock, sessions)

CHAR_LM = REPO / "recipes" / "char_lm.py"
HAND, ENGINE, ENGINE_AUTO, LOADER = "hand-written", "engine", "engine auto", "loader alone"


def recipe_config(args, *extra: str):
    from engine.overrides import apply_overrides
    from engine.recipe import load_recipe

    recipe = load_recipe(CHAR_LM)
    cfg = apply_overrides(recipe.make_config(), [
        f"data.shards={args.shards}", "epochs=1", f"batch_size={args.batch}",
        f"seed={args.seed}", *extra])
    return recipe, cfg


def training_order(cfg, world_size: int, rank: int) -> tuple[list[int], int]:
    """This rank's training windows in the engine's order for epoch 0 (its sampler from
    the seed), as indices into the shards' windows (char_lm holds out every
    ``data.val_every``-th), and the number of all windows."""
    from engine.data import ResumableDistributedSampler
    from engine.token_shards import TokenShards
    from recipes.char_lm import NotEveryNth

    windows = TokenShards(cfg.data.shards, cfg.model.context)
    train = NotEveryNth(windows, cfg.data.val_every)
    sampler = ResumableDistributedSampler(train, num_replicas=world_size, rank=rank,
                                          seed=cfg.seed)
    sampler.set_epoch(0)
    every = cfg.data.val_every
    return [i + i // (every - 1) + 1 for i in sampler], len(train)


def hand_written(rank: int, world_size: int, port: int, args):
    """The recipe's pieces in a plain loop over memory-mapped windows."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from engine.checkpoint import model_digest

    recipe, cfg = recipe_config(args)
    module = recipe.module
    torch.set_num_threads(args.threads)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world_size)
    torch.manual_seed(cfg.seed)
    model = module.build_model(cfg)
    if world_size > 1:
        model = DDP(model)
    optimizer = module.build_optimizer(cfg, getattr(model, "module", model))
    order, _ = training_order(cfg, world_size, rank)
    micro = args.batch // world_size
    steps = -(-len(order) // micro)
    scheduler = module.build_scheduler(cfg, optimizer, SimpleNamespace(total_steps=steps))

    index = json.loads((pathlib.Path(cfg.data.shards) / "index.json").read_text())
    maps = [np.load(pathlib.Path(cfg.data.shards) / s["file"], mmap_mode="r")
            for s in index["shards"]]
    span = cfg.model.context + 1
    starts = np.concatenate([[0], np.cumsum([len(m) // span for m in maps])]).tolist()

    def batches():
        for k in range(0, len(order), micro):
            rows = []
            for g in order[k:k + micro]:
                shard = bisect.bisect_right(starts, g) - 1
                offset = (g - starts[shard]) * span
                rows.append(maps[shard][offset:offset + span])
            tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
            yield tokens[:, :-1], tokens[:, 1:]

    ctx = SimpleNamespace(model=model)
    clock = overhead.LoopCPUClock(Restartable(batches))
    for batch in clock:
        out = module.train_step(batch, ctx)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    digest = model_digest(getattr(model, "module", model).state_dict())
    if world_size > 1:
        dist.destroy_process_group()
    return clock.wall_seconds, clock.cpu_seconds, digest, steps


class Restartable:
    """An iterable of a generator function's items (what the loop clock wraps)."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return self.make()


def through_engine(workers: str, rank: int, world_size: int, port: int, out_dir: str,
                   args):
    """char_lm on the shards through engine.engine.Engine, timed by bench_overhead's
    loop clock."""
    workload = {"shards": (CHAR_LM, lambda size: [f"data.shards={args.shards}",
                                                  f"num_workers={workers}",
                                                  "sample_chars=0"], None, None, None)}
    engine_args = SimpleNamespace(plugin=[], workload="shards", size=0,
                                  batch=args.batch, seed=args.seed, threads=args.threads,
                                  set=[])
    seconds, cpu, digest, steps, _ = overhead.through_engine(
        "single" if world_size == 1 else "ddp", rank, world_size, port, out_dir,
        engine_args, workloads=workload)
    return seconds, cpu, digest, steps


def loader_alone(rank: int, world_size: int, args) -> tuple[float, float, int, str]:
    """Seconds to read the epoch's training batches through the engine's DataLoader,
    with 0 workers and with the auto choice; and the tokens read."""
    from engine import data, loader_settings
    from engine.token_shards import TokenShards
    from engine.world import World
    from recipes.char_lm import NotEveryNth

    recipe, cfg = recipe_config(args)
    world = World(rank=rank, local_rank=rank, world_size=world_size,
                  local_world_size=world_size)
    auto = loader_settings.choose("auto", cpus=world.cpu_share(), device_type="cpu",
                                  timeout_s=300)
    train = NotEveryNth(TokenShards(cfg.data.shards, cfg.model.context), cfg.data.val_every)
    seconds = []
    for workers in (0, auto.num_workers):
        loader = data.train_loader(train, micro_batch=args.batch // world_size, world=world,
                                   seed=cfg.seed, num_workers=workers, pin_memory=False,
                                   drop_last=False,
                                   prefetch_factor=auto.prefetch_factor if workers else None)
        data.start_epoch(loader, 0)
        iterator = iter(loader)
        first = next(iterator)  # workers started, as the clock of a run starts after
        tokens, start = first[1].numel(), time.perf_counter()
        for _, targets in iterator:
            tokens += targets.numel()
        seconds.append(time.perf_counter() - start)
        del iterator, loader
    return seconds[0], seconds[1], tokens, auto.num_workers


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    overhead.quiet(rank, log_path)
    for (round_index, variant), port in zip(schedule, ports):
        record = {"round": round_index, "variant": variant}
        with tempfile.TemporaryDirectory() as out_dir:
            if variant == HAND:
                seconds, cpu, digest, steps = hand_written(rank, world_size, port, args)
            elif variant == LOADER:
                zero, auto, tokens, workers = loader_alone(rank, world_size, args)
                record.update(zero_s=zero, auto_s=auto, tokens=tokens,
                              auto_workers=workers)
                seconds = cpu = digest = steps = None
            else:
                seconds, cpu, digest, steps = through_engine(
                    "0" if variant == ENGINE else "auto", rank, world_size, port,
                    out_dir, args)
        record.update(seconds=seconds, cpu_seconds=cpu, digest=digest, steps=steps)
        if rank == 0:
            with open(results_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def summarize(results: list[dict], args) -> dict:
    counted = [r for r in results if r["round"] > 0]
    by = {v: [r for r in counted if r["variant"] == v] for v in (HAND, ENGINE, ENGINE_AUTO,
                                                                 LOADER)}
    hand = {r["round"]: r["seconds"] for r in by[HAND]}
    hand_cpu = {r["round"]: r["cpu_seconds"] for r in by[HAND]}
    out = {"steps": by[HAND][0]["steps"]}
    tokens_per_step = args.batch * args.context
    for variant in (HAND, ENGINE, ENGINE_AUTO):
        runs = by[variant]
        out[variant] = {
            "median_s": statistics.median(r["seconds"] for r in runs),
            "median_cpu_s": statistics.median(r["cpu_seconds"] for r in runs),
            "tokens_per_s": statistics.median(r["steps"] * tokens_per_step / r["seconds"]
                                              for r in runs),
            "paired_ratio": statistics.median(r["seconds"] / hand[r["round"]] for r in runs),
            "ratios": [round(r["seconds"] / hand[r["round"]], 4) for r in runs],
            # process CPU time: far steadier than wall time on a machine others load
            "paired_cpu_ratio": statistics.median(r["cpu_seconds"] / hand_cpu[r["round"]]
                                                  for r in runs),
            "cpu_ratios": [round(r["cpu_seconds"] / hand_cpu[r["round"]], 4) for r in runs],
            "digests": sorted({r["digest"] for r in runs}),
        }
    loaders = by[LOADER]
    out[LOADER] = {
        "workers_auto": loaders[0]["auto_workers"],
        "tokens_per_s_0_workers": statistics.median(r["tokens"] * args.nproc / r["zero_s"]
                                                    for r in loaders),
        "tokens_per_s_auto": statistics.median(r["tokens"] * args.nproc / r["auto_s"]
                                               for r in loaders),
    }
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--chars", type=int, default=600_000,
                   help="bytes of the library's sources in the shards (tokens)")
    p.add_argument("--batch", type=int, default=32, help="global batch (windows)")
    p.add_argument("--nproc", type=int, default=1, help="processes (gloo DDP beyond 1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process on every side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-tokens", type=int, default=250_000)
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def write_library_shards(folder: pathlib.Path, chars: int, shard_tokens: int) -> None:
    import sysconfig

    from engine.token_shards import write_shards

    sources, total = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if total >= chars:
            break
        sources.append(path)
        total += path.stat().st_size
    text = folder / "text.txt"
    text.write_bytes(b"".join(s.read_bytes() for s in sources)[:chars])
    write_shards([text], folder / "shards", shard_tokens=shard_tokens)


def main(argv=None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        write_library_shards(pathlib.Path(tmp), args.chars, args.shard_tokens)
        args.shards = str(pathlib.Path(tmp) / "shards")
        _, cfg = recipe_config(args)
        args.context = cfg.model.context
        with tempfile.NamedTemporaryFile(prefix="bench_token_shards-", suffix=".log",
                                         delete=False) as log:
            log_path = log.name
        schedule = overhead.interleaved([HAND, ENGINE, ENGINE_AUTO, LOADER], args.reps)
        results = overhead.run_workers(session_worker, args.nproc, schedule, args, log_path)
    s = summarize(results, args)
    print(f"char_lm on token shards: {args.chars:,} tokens, windows of {args.context + 1}, "
          f"global batch {args.batch}, {args.nproc} process(es), {args.threads} thread(s) "
          f"each, {s['steps']} steps, {args.reps} interleaved rounds (engine output: "
          f"{log_path}.rank*)")
    hand = s[HAND]
    print(f"  {HAND:<24} {hand['median_s']:7.3f}s  {hand['tokens_per_s']:9,.0f} tokens/s")
    for variant, label in ((ENGINE, "engine, num_workers=0"),
                           (ENGINE_AUTO, "engine, num_workers=auto")):
        r = s[variant]
        same = "bit-identical" if r["digests"] == hand["digests"] else "weights differ"
        print(f"  {label:<24} {r['median_s']:7.3f}s  {r['tokens_per_s']:9,.0f} tokens/s  "
              f"ratio to hand-written {r['paired_ratio']:.3f} (median of rounds "
              f"{', '.join(f'{x:.3f}' for x in r['ratios'])}); CPU time ratio "
              f"{r['paired_cpu_ratio']:.3f} (rounds "
              f"{', '.join(f'{x:.3f}' for x in r['cpu_ratios'])}); {same}")
    loader = s[LOADER]
    print(f"  loader alone: {loader['tokens_per_s_0_workers']:,.0f} tokens/s with 0 "
          f"workers, {loader['tokens_per_s_auto']:,.0f} with auto "
          f"({loader['workers_auto']} per process); the training step: "
          f"{s[ENGINE]['tokens_per_s']:,.0f} tokens/s")
    ratio, cpu = s[ENGINE]["paired_ratio"], s[ENGINE]["paired_cpu_ratio"]
    print(f"result: engine / hand-written = {ratio:.3f} (wall), {cpu:.3f} (CPU time); "
          f"target <= 1.02: {'OK' if max(ratio, cpu) <= 1.02 else 'OVER'}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"summary": s, "runs": results},
                                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
