"""What the same few Python operations cost right after a training step's kernels,
against back to back: why a memory snapshot's Python work costs more inside the loop
than after it (issue 37).

    python tools/bench_cold_python.py [--reps 200]

The probe writes 8 packed bytes into a numpy array (what the memory tier's progress
note does after every optimizer step). It is timed right after each of: nothing (back
to back), a convolution as large as the CIFAR network's first (oneDNN, about a
millisecond in C), 20 small matrix products (4 ms in C), a fill of 12.8 MB (the
convolution's output), a 5 ms sleep (the CPU idle), 5 ms of pure Python.

Measured on this project's 2-core VM (2026-11-27): 0.5 us back to back and after the
Python, 1.4 us after the fill, 2-16 us after the products, 25-40 us after the
convolution (50 x) and 9-25 us after the sleep. So it is not the bytes a kernel touches;
what the kernels leave behind (or the idle CPU) makes the next Python operations slow,
and a memory snapshot's
few hundred Python operations, taken right after a step, pay it each time: about 0.7 ms
for the CIFAR network's snapshot inside the loop against 0.2 ms measured back to back
(tools/bench_memory_snapshot.py). Only fewer operations can lower it. Not investigated
further (a GPU box's CPUs may well not show it).
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time


def probe_after(work, reps: int, array) -> float:
    """Median microseconds of the probe right after ``work()``."""
    spent = []
    for i in range(reps):
        work()
        start = time.perf_counter_ns()
        array[56:64] = bytearray(struct.pack("<Q", i))
        spent.append(time.perf_counter_ns() - start)
    return statistics.median(spent) / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    images = torch.randn(64, 3, 32, 32)
    conv = torch.nn.Conv2d(3, 64, 5)
    array = np.zeros(4096, dtype=np.uint8)
    with torch.no_grad():
        square = torch.randn(200, 200)
        output = torch.empty(64 * 64 * 28 * 28)
        cases = [("nothing (back to back)", lambda: None),
                 ("a convolution (64x3x32x32 -> 64 channels, 5x5)", lambda: conv(images)),
                 ("20 products of 200x200 matrices", lambda: [square @ square
                                                               for _ in range(20)]),
                 ("a fill of 12.8 MB", lambda: output.fill_(1.0)),
                 ("a 5 ms sleep", lambda: time.sleep(0.005)),
                 ("5 ms of Python", lambda: sum(range(60_000)))]
        print(f"probe: 8 packed bytes written into a numpy array, median of {args.reps}")
        base = None
        for name, work in cases:
            probe_after(work, 10, array)  # warm-up
            us = probe_after(work, args.reps, array)
            base = base or us
            print(f"after {name:48s} {us:8.2f} us  ({us / base:5.1f} x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
