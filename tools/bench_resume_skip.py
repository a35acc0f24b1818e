"""Benchmark: how soon a run resumed deep into an epoch gets its first batch.

    python tools/bench_resume_skip.py                         # 1M samples, 90% in, 5 reps
    python tools/bench_resume_skip.py --size 200000 --position 0.5 --world-size 4

A mid-epoch resume must not load the samples the snapshot already consumed: the
training sampler (engine.data.ResumableDistributedSampler) slices the epoch's index
order at the snapshot's global position, so the first batch comes as fast as at the
start of a fresh epoch. Timed here, in one process as rank 0 of ``--world-size``,
through the engine's own training loader (engine.data.train_loader, no workers):

- ``fresh``: start_epoch at position 0, then the first batch;
- ``resumed``: start_epoch at ``--position`` of the epoch (a fraction), then the first
  batch; the dataset counts its loads, which must be one batch's worth;
- ``skip by loading``: what a loop that iterates past the consumed batches would pay,
  timed over ``--skip-batches`` batches and extrapolated to the consumed ones (marked
  as an estimate; 0 leaves it out).

The rounds are interleaved (fresh, resumed, alternating which goes first) so load from
elsewhere on the machine hits both alike; medians are printed. Each sample costs what
a small decoded item does (``--sample-floats`` floats made on access).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1_000_000, help="samples in the epoch")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--world-size", type=int, default=2,
                   help="processes the epoch is split over (this one is rank 0)")
    p.add_argument("--position", type=float, default=0.9,
                   help="how far into the epoch the resume starts (fraction)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-batches", type=int, default=100,
                   help="batches timed for the skip-by-loading estimate (0: none)")
    p.add_argument("--sample-floats", type=int, default=64)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if not 0 <= args.position < 1:
        p.error(f"--position {args.position}: give a fraction of the epoch, 0 <= f < 1")
    return args


class CountingSet:
    """``size`` samples made on access (a tensor of ``floats`` and a label); counts
    every load."""

    def __init__(self, size: int, floats: int):
        self.size, self.floats, self.loads = size, floats, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        import torch

        self.loads += 1
        return torch.full((self.floats,), float(index)), index % 10


def first_batch_seconds(loader, epoch: int, start_sample: int) -> float:
    from engine import data

    begin = time.perf_counter()
    data.start_epoch(loader, epoch, start_sample=start_sample)
    next(iter(loader))
    return time.perf_counter() - begin


def skip_by_loading_seconds(loader, epoch: int, batches: int) -> float:
    from engine import data

    data.start_epoch(loader, epoch)
    it = iter(loader)
    begin = time.perf_counter()
    for _ in range(batches):
        next(it)
    return time.perf_counter() - begin


def main(argv=None) -> int:
    args = parse(argv)
    from engine import data
    from engine.world import World

    world = World(rank=0, local_rank=0, world_size=args.world_size,
                  local_world_size=args.world_size)
    micro = data.split_batch(args.batch, args.world_size, 1)
    per_global_batch = micro * args.world_size
    consumed_batches = int(args.size * args.position) // per_global_batch
    position = consumed_batches * per_global_batch  # a snapshot stops between batches
    dataset = CountingSet(args.size, args.sample_floats)
    loader = data.train_loader(dataset, micro_batch=micro, world=world, seed=0,
                               num_workers=0, pin_memory=False, drop_last=False)
    fresh, resumed, loads = [], [], set()
    for rep in range(args.reps + 1):  # round 0 warms up, not counted
        order = [("fresh", 0), ("resumed", position)]
        for name, start in (order if rep % 2 else order[::-1]):
            before = dataset.loads
            seconds = first_batch_seconds(loader, epoch=rep, start_sample=start)
            if name == "resumed":
                loads.add(dataset.loads - before)
            if rep:
                (fresh if name == "fresh" else resumed).append(seconds)
    result = {
        "size": args.size, "world_size": args.world_size, "micro_batch": micro,
        "position": position, "fresh_s": statistics.median(fresh),
        "resumed_s": statistics.median(resumed), "resumed_loads": sorted(loads),
    }
    result["ratio"] = result["resumed_s"] / result["fresh_s"]
    print(f"epoch of {args.size} samples, rank 0 of {args.world_size}, micro-batch {micro}; "
          f"resumed at sample {position} ({consumed_batches} global batches in); "
          f"medians of {args.reps} interleaved rounds")
    print(f"  fresh epoch, first batch:    {result['fresh_s'] * 1e3:9.2f} ms")
    print(f"  resumed epoch, first batch:  {result['resumed_s'] * 1e3:9.2f} ms  "
          f"(x{result['ratio']:.2f} of fresh; samples loaded: {sorted(loads)}, one "
          f"batch is {micro})")
    if args.skip_batches and consumed_batches:
        timed = min(args.skip_batches, consumed_batches)
        seconds = skip_by_loading_seconds(loader, epoch=0, batches=timed)
        result["skip_by_loading_s_estimate"] = seconds / timed * consumed_batches
        print(f"  skip by loading (estimate):  {result['skip_by_loading_s_estimate']:9.2f} s"
              f"   ({consumed_batches} batches of this rank at {seconds / timed * 1e3:.2f}"
              f" ms each, timed over {timed})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if loads != {micro}:
        print(f"error: the resumed epoch loaded {sorted(loads)} samples before its first "
              f"batch; it must load one batch ({micro})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
