"""Where the test suite's time goes, from a run with ``ENGINE_TEST_PROFILE=FOLDER``
(tests/profiling.py): CPU seconds by kind of process, each xdist worker's busy time (the
longest is the suite's critical path) and the costliest modules and tests.

    ENGINE_TEST_PROFILE=/tmp/prof pytest
    python tools/suite_profile.py /tmp/prof [--top 25] [--markdown]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys


def load(folder: pathlib.Path) -> list[dict]:
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    # Only the suite's own tests: an inner pytest of tests/test_conftest.py runs modules
    # of a temporary folder (profiles from before it stopped writing here).
    records = [r for r in records if r["test"].startswith("tests/")]
    failed = [r["test"] for r in records if r.get("outcome") in ("failed", "error")]
    if failed:
        print(f"suite_profile: {len(failed)} tests failed or erred (their figures are "
              f"short): {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}\n")
    if not records:
        sys.exit(f"suite_profile: no records in {folder}: run pytest with "
                 f"ENGINE_TEST_PROFILE={folder}")
    return records


def table(header: list[str], rows: list[list], markdown: bool) -> str:
    cells = [header, *[[f"{c:.1f}" if isinstance(c, float) else str(c) for c in row]
                       for row in rows]]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "|".join(" --- " for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in cells)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=20, help="modules and tests listed")
    parser.add_argument("--markdown", action="store_true", help="tables for docs")
    args = parser.parse_args(argv)
    records = load(args.folder)

    kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, set()])
    for r in records:
        for name, k in r["kinds"].items():
            kinds[name][0] += k["processes"]
            kinds[name][1] += k["cpu_s"]
            if k["cpu_s"] >= 0.5:
                kinds[name][2].add(r["test"])
    sampled = sum(k[1] for k in kinds.values())
    exact = sum(r["own_cpu_s"] + r["reaped_cpu_s"] + r["forked_cpu_s"] for r in records)
    slurm = sum(k[1] for name, k in kinds.items() if name.startswith("SLURM"))
    rows = [[name, n, cpu, f"{100 * cpu / sampled:.0f}%", len(tests)]
            for name, (n, cpu, tests) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    # The kernel's count leaves out the warm-start servers' own start (reaped at the
    # session's end) and SLURM jobs (slurmd reaps them).
    print(f"CPU seconds by kind of process ({len(records)} tests; sampled every 0.1 s: "
          f"{sampled:.0f} s in all, {slurm:.0f} s of them in SLURM jobs; counted by the "
          f"kernel, reaped: {exact:.0f} s)\n")
    print(table(["kind", "processes", "CPU s", "share", "tests (>= 0.5 s)"], rows,
                args.markdown))

    workers: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0, [], []])
    for r in records:
        w = workers[r["worker"]]
        w[0] += r["wall_s"]
        w[1] += r["own_cpu_s"] + r["reaped_cpu_s"] + r["forked_cpu_s"]
        w[2] += 1
        w[3].append(r["start"])
        w[4].append(r["start"] + r["wall_s"])
    start = min(r["start"] for r in records)
    print("\nxdist workers (the longest busy time is the critical path)\n")
    print(table(["worker", "tests", "busy s", "last test ended at s", "CPU s"],
                [[name, w[2], w[0], max(w[4]) - start, w[1]]
                 for name, w in sorted(workers.items())], args.markdown))

    modules: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0, ""])
    for r in records:
        m = modules[r["test"].split("::", 1)[0]]
        m[0] += 1
        m[1] += r["wall_s"]
        m[2] += sum(k["cpu_s"] for k in r["kinds"].values())
        m[3] = r["worker"]
    print(f"\nthe {args.top} longest modules\n")
    print(table(["module", "tests", "wall s", "CPU s (sampled)", "worker"],
                [[name, *m] for name, m in sorted(modules.items(),
                                                  key=lambda kv: -kv[1][1])[:args.top]],
                args.markdown))

    print(f"\nthe {args.top} longest tests\n")
    longest = sorted(records, key=lambda r: -r["wall_s"])[:args.top]
    print(table(["test", "wall s", "CPU s (sampled)", "main kind"],
                [[r["test"], r["wall_s"], sum(k["cpu_s"] for k in r["kinds"].values()),
                  max(r["kinds"], key=lambda k: r["kinds"][k]["cpu_s"])] for r in longest],
                args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
