#!/usr/bin/env python3
"""What crash consistency and the async checkpointer cost, against a bare torch.save.

    python tools/bench_checkpoint.py                          # 100 MB and 1 GB, 5 rounds
    python tools/bench_checkpoint.py --sizes 10M --repeat 2   # a quick look

For each size it saves the same snapshot-shaped state (model weights plus as much
optimizer momentum, float32, random: nothing compresses) in four ways:

- baseline: ``torch.save(state, path)``, the hand-written save (no fsync, no checksum);
- durable baseline: ``torch.save`` to an open file, then fsync: what any save that
  survives a power cut costs at least (the disk's write speed);
- crash-consistent: the ``torch-file`` checkpointer's save: temp file, xxh3-128 while
  writing, fsync, rename, fsync of the folder, then the manifest and ``latest`` pointer
  written the same way (engine.atomic_io.atomic_write);
- async: how long the ``async`` checkpointer's save() blocks the caller (the copy into
  shared memory); its background write is waited for between rounds, untimed. Next to
  it, the copy floor: the same tensors copied into an already allocated private buffer
  (the least any snapshot of tensors that training goes on changing must wait for,
  whatever it does next), timed before the async save or after its write, in turns.

and loads it back two ways: ``torch.load(path)`` against what a resume does,
``latest()`` (which verifies size and checksum against the manifest) then ``load()``.

Each round runs ``sync`` first (untimed), so that no save pays for the previous one's
dirty pages, and the three saves take turns going first. The ratios use medians over
the rounds. Targets: crash-consistent save <= 1.10 x baseline; async blocking <= 0.05 x
the crash-consistent (synchronous) save. Also printed: crash-consistent against the
durable baseline, and the load ratio (no targets). The first async save (writer start,
buffer allocation) is reported on its own: it happens once per run.

Files go under --dir (default: runs/bench_checkpoint) and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import time

CRASH_CONSISTENT_TARGET = 1.10
ASYNC_TARGET = 0.05


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def make_state(nbytes: int, tensors: int) -> dict:
    """A snapshot-shaped dict: half weights, half momentum, plus the small parts."""
    import torch

    per_tensor = max(1, nbytes // 4 // (2 * tensors))
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(per_tensor, generator=gen)
             for i in range(tensors)}
    momentum = {i: {"momentum_buffer": torch.randn(per_tensor, generator=gen)}
                for i in range(tensors)}
    return {"model": model,
            "optimizer": {"state": momentum,
                          "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                            "params": list(range(tensors))}]},
            "epoch": 1, "step": 100, "rng": [torch.get_rng_state()],
            "config": {"lr": 0.1}, "metrics": {"val/loss": 1.0}}


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values()) * 2


def timed(fn) -> float:
    os.sync()  # untimed: start every save with no dirty pages of an earlier one
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(nbytes: int, repeat: int, tensors: int, folder: pathlib.Path) -> dict:
    import torch

    from engine.plugins.async_file import AsyncFileCheckpointer, copy_into
    from engine.shm_codec import encode
    from engine.plugins.torch_file import TorchFileCheckpointer

    state = make_state(nbytes, tensors)
    bare_dir, safe_dir, async_dir = (folder / "bare", folder / "torch-file",
                                     folder / "async")
    for d in (bare_dir, safe_dir, async_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    safe = TorchFileCheckpointer(safe_dir)  # no cfg: keeps everything, we clean up
    def durable_save(path):
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    bare_times, safe_times, durable_times = [], [], []
    for r in range(repeat):
        bare_path = bare_dir / f"state-{r}.pt"
        durable_path = bare_dir / f"durable-{r}.pt"
        runs = [(bare_times, lambda: torch.save(state, str(bare_path))),
                (safe_times, lambda: safe.save(state, epoch=1, step=r)),
                (durable_times, lambda: durable_save(durable_path))]
        for times, fn in runs[r % 3:] + runs[:r % 3]:  # each goes first in turn
            times.append(timed(fn))
        durable_path.unlink()
        if r == repeat - 1:
            break  # the last round's files are loaded below
        # Untimed: files of earlier rounds would only fill the page cache and disk.
        bare_path.unlink()
        for p in safe_dir.glob("snapshot-*"):
            p.unlink()
    del state  # the loads below must not share memory with it

    bare_loads, safe_loads = [], []
    for r in range(repeat):
        runs = [(bare_loads, lambda: torch.load(bare_path, map_location="cpu",
                                                weights_only=True)),
                (safe_loads, lambda: safe.load(safe.latest(), map_location="cpu"))]
        for times, fn in (runs if r % 2 == 0 else runs[::-1]):
            times.append(timed(fn))
    bare_path.unlink()
    state = make_state(nbytes, tensors)

    _, tensors, floor_bytes, _ = encode(state)
    floor_buffer = torch.empty(floor_bytes, dtype=torch.uint8)
    copy_into(floor_buffer, tensors)  # untimed: the first touch faults pages in
    writer = AsyncFileCheckpointer(async_dir)
    try:
        first = timed(lambda: writer.save(state, epoch=1, step=0))
        writer.wait()
        blocking, floor = [], []
        for r in range(1, repeat + 1):
            # The floor goes before the save or after its write: never next to the
            # writer process, which would take its CPU and memory bandwidth.
            if r % 2 == 0:
                floor.append(timed(lambda: copy_into(floor_buffer, tensors)))
            blocking.append(timed(lambda: writer.save(state, epoch=1, step=r)))
            writer.wait()
            if r % 2 == 1:
                floor.append(timed(lambda: copy_into(floor_buffer, tensors)))
            for p in async_dir.glob("snapshot-*"):
                if not p.name.endswith(f"s{r:08d}.pt") and not p.name.endswith(
                        f"s{r:08d}.pt.json"):
                    p.unlink()
    finally:
        writer.close()
    return {"bytes": state_bytes(state), "bare": bare_times, "safe": safe_times,
            "async_first": first, "async": blocking, "copy_floor": floor,
            "durable": durable_times,
            "bare_load": bare_loads,
            "safe_load": safe_loads}


def breakdown(nbytes: int, repeat: int, tensors: int, folder: pathlib.Path) -> None:
    """Where the crash-consistent save's extra time goes, one ingredient at a time."""
    import torch

    from engine.atomic_io import ChecksumWriter, atomic_write

    state = make_state(nbytes, tensors)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "breakdown.pt"

    def through_file(checksum: str = "", fsync: bool = False):
        def save():
            with open(path, "wb") as raw:
                target = ChecksumWriter(raw, checksum) if checksum else raw
                torch.save(state, target)
                raw.flush()
                if fsync:
                    os.fsync(raw.fileno())
        return save

    def no_crc32():
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(state, str(path))
        finally:
            torch.serialization.set_crc32_options(True)

    steps = [("torch.save(path)", lambda: torch.save(state, str(path))),
             ("  without torch's zip crc32", no_crc32),
             ("torch.save(file object)", through_file()),
             ("  + fsync", through_file(fsync=True)),
             ("  + xxh3_128 inline", through_file("xxh3_128")),
             ("  + sha256 inline (the old way)", through_file("sha256")),
             ("atomic_write (all of it)", lambda: atomic_write(
                 path, lambda f: torch.save(state, f)))]
    print(f"breakdown for {human(state_bytes(state))}, median of {repeat}:")
    for label, fn in steps:
        times = [timed(fn) for _ in range(repeat)]
        print(f"  {label:<32} {statistics.median(times):7.3f}s")
    path.unlink(missing_ok=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100M,1G", help="comma-separated, e.g. 100M,1G")
    p.add_argument("--repeat", type=int, default=5, help="rounds per size")
    p.add_argument("--tensors", type=int, default=32,
                   help="weight tensors (as many momentum buffers)")
    p.add_argument("--dir", default="runs/bench_checkpoint", help="where files go")
    p.add_argument("--keep", action="store_true", help="do not delete --dir at the end")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each ingredient of the crash-consistent save")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # nothing here computes; keep the CPU for I/O and hashing
    folder = pathlib.Path(args.dir)
    results = []
    try:
        for size in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
            results.append(bench_size(size, args.repeat, args.tensors, folder))
            if args.breakdown:
                breakdown(size, args.repeat, args.tensors, folder)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)

    med = statistics.median
    print(f"checkpoint save and load, median of {args.repeat} rounds (min in brackets), "
          f"files under {folder}")
    print(f"{'size':>8}  {'torch.save':>16}  {'crash-consistent':>16}  {'ratio':>6}  "
          f"{'async blocks':>15}  {'vs sync':>7}  {'async first':>11}")
    ok = True
    for r in results:
        bare, safe, blocking = med(r["bare"]), med(r["safe"]), med(r["async"])
        ratio, async_ratio = safe / bare, blocking / safe
        ok &= ratio <= CRASH_CONSISTENT_TARGET and async_ratio <= ASYNC_TARGET
        print(f"{human(r['bytes']):>8}  "
              f"{bare:7.3f}s ({min(r['bare']):.3f})  {safe:7.3f}s ({min(r['safe']):.3f})  "
              f"{ratio:6.2f}  {blocking:6.3f}s ({min(r['async']):.3f})  {async_ratio:7.3f}  "
              f"{r['async_first']:10.3f}s")
    print(f"{'size':>8}  {'torch.save+fsync':>16}  {'crash-consistent':>16}  {'ratio':>6}"
          "   (what crash consistency adds to a durable save)")
    for r in results:
        durable, safe = med(r["durable"]), med(r["safe"])
        print(f"{human(r['bytes']):>8}  {durable:7.3f}s ({min(r['durable']):.3f})  "
              f"{safe:7.3f}s ({min(r['safe']):.3f})  {safe / durable:6.2f}")
    print(f"{'size':>8}  {'copy floor':>16}  {'async blocks':>16}  {'ratio':>6}"
          "   (the memory copy any consistent snapshot waits for)")
    for r in results:
        floor, blocking = med(r["copy_floor"]), med(r["async"])
        print(f"{human(r['bytes']):>8}  {floor:7.3f}s ({min(r['copy_floor']):.3f})  "
              f"{blocking:7.3f}s ({min(r['async']):.3f})  {blocking / floor:6.2f}")
    print(f"{'size':>8}  {'torch.load':>16}  {'latest()+load()':>16}  {'ratio':>6}")
    for r in results:
        bare, safe = med(r["bare_load"]), med(r["safe_load"])
        print(f"{human(r['bytes']):>8}  {bare:7.3f}s ({min(r['bare_load']):.3f})  "
              f"{safe:7.3f}s ({min(r['safe_load']):.3f})  {safe / bare:6.2f}")
    print(f"targets: crash-consistent save <= {CRASH_CONSISTENT_TARGET:.2f} x torch.save, "
          f"async blocking <= {ASYNC_TARGET:.2f} x crash-consistent: "
          f"{'met' if ok else 'NOT met'} (load: reported, no target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
