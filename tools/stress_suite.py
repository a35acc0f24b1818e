"""Run the whole test suite again and again, and once under an artificial CPU load, and
print per test how often it failed: a suite that fails by chance shows here before it
costs a submission.

    python tools/stress_suite.py                 # 5 runs back to back, then 1 loaded
    python tools/stress_suite.py --runs 2 --loaded 1 --busy 2 -- -x tests/engine

Each run is ``pytest`` as the README gives it (plus ``--junitxml``), in this checkout;
arguments after ``--`` are passed on. A loaded run starts ``--busy`` processes that spin
on the CPU for as long as the run lasts (the load a shared CI machine may have). The
table lists every test that failed or erred in any run; the last line says whether all
runs were clean, and the exit code is 0 only then.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = pathlib.Path(__file__).resolve().parents[1]


def spin() -> None:  # a busy process: all CPU, no memory, no I/O
    while True:
        pass


def failures(junit: pathlib.Path) -> tuple[int, list[str]]:
    """(tests run, node ids that failed or erred) of one junit report."""
    if not junit.exists():
        return 0, ["<no junit report: pytest did not finish>"]
    cases = ET.parse(junit).getroot().iter("testcase")
    count, failed = 0, []
    for case in cases:
        count += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return count, failed


def run_once(label: str, busy: int, extra: list[str], folder: pathlib.Path) -> dict:
    junit = folder / f"{label}.xml"
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
    for process in spinners:
        process.start()
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                               f"--junitxml={junit}", *extra], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        for process in spinners:
            process.kill()
            process.join()
    seconds = time.monotonic() - started
    (folder / f"{label}.log").write_text(proc.stdout)
    count, failed = failures(junit)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"{label}: exit {proc.returncode}, {count} tests, {len(failed)} failed, "
          f"{seconds:.1f} s  ({last})", flush=True)
    return {"label": label, "code": proc.returncode, "failed": failed, "seconds": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs back to back (default 5)")
    parser.add_argument("--loaded", type=int, default=1,
                        help="runs under the artificial load after them (default 1)")
    parser.add_argument("--busy", type=int, default=2,
                        help="busy processes during a loaded run (default 2)")
    parser.add_argument("--keep", type=pathlib.Path, default=None,
                        help="folder for the logs and junit reports (default: a temporary one)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest")
    args = parser.parse_args(argv)
    folder = args.keep or pathlib.Path(tempfile.mkdtemp(prefix="stress-suite-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"stress_suite: {args.runs} runs, then {args.loaded} with {args.busy} busy "
          f"processes on {os.cpu_count()} CPUs; logs in {folder}", flush=True)

    results = [run_once(f"run{i + 1}", 0, args.pytest_args, folder)
               for i in range(args.runs)]
    results += [run_once(f"loaded{i + 1}", args.busy, args.pytest_args, folder)
                for i in range(args.loaded)]

    counts = collections.Counter(test for r in results for test in r["failed"])
    if counts:
        print(f"\n{'failures':>8}  test")
        for test, n in counts.most_common():
            print(f"{n:>5}/{len(results)}  {test}")
    clean = all(r["code"] == 0 for r in results)
    times = ", ".join(f"{r['label']} {r['seconds']:.0f} s" for r in results)
    print(f"\nstress_suite: {'all clean' if clean else 'NOT clean'}: {times}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
