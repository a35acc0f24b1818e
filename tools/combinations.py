"""The feature-combination matrix: which combinations of the engine's features are
tested together, and which are refused before any worker starts (issue 40).

One place says it all: FACTORS (each feature's values and the ``engine-run`` arguments
for each), REFUSED (the pairs of values that cannot go together: the one-line error the
engine gives, which names both and what to use instead), and :func:`rows`, a small
deterministic greedy pairwise generator: every pair of values of two features appears
in some row (a refused pair in a refused row), so a few dozen short runs cover what
would be thousands. tests/test_combinations.py runs every row; docs/combinations.md is
this module's table.

    python tools/combinations.py            # print the table
    python tools/combinations.py --write    # write it to docs/combinations.md
    python tools/combinations.py --check    # exit 1 when docs/combinations.md is stale
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
Row = dict[str, str]
DOC = REPO / "docs" / "combinations.md"
#: The recipe every row trains: two Blocks (the class that activation checkpointing,
#: regional compile and fsdp's units name), STEPS optimizer steps.
RECIPE = "tests/recipes/tiny_matrix.py"
STEPS = 7
#: A disk snapshot every 2 steps (COMMON), and every rank SIGKILLed right after step 6 (before
#: its snapshots): the newest disk snapshot is step 4's (step 2's under dcp-async, which
#: commits a snapshot when the next one starts), the newest in shared memory step 5's.
#: One torch thread per process (the parallel modes get one each on a 2-core machine,
#: and single's second thread spins idle on such tiny ops: 40% of a row's CPU time).
COMMON = ("checkpoint.every_steps=2", "--threads", "1")
KILLED_AFTER = 6
#: The features that change what a step computes: a row must end with the weights of
#: an uninterrupted run alike in these, the others left at their first value (off): they
#: must change no weight.
ARITHMETIC = ("parallel", "precision", "compile", "grad_accum_steps")


def plain(row: Row) -> Row:
    """``row``'s uninterrupted reference: its ARITHMETIC, every other feature off."""
    return {name: row[name] if name in ARITHMETIC else next(iter(values))
            for name, values in FACTORS.items()}


def resumed_at(row: Row) -> tuple[str, int]:
    """Where the restart of ``row`` resumes: ("memory" or "disk", step)."""
    if row["memory tier"] == "on":
        return "memory", KILLED_AFTER - 1
    return "disk", 2 if row["checkpointer"] == "dcp-async" else 4

#: Each feature: its values, in order (the first is the default a refused row keeps),
#: and the engine-run arguments of each value.
FACTORS: dict[str, dict[str, tuple[str, ...]]] = {
    "parallel": {
        "single": ("--parallel", "single", "--nproc", "1"),
        "ddp": ("--parallel", "ddp", "--nproc", "2"),
        "fsdp": ("--parallel", "fsdp", "--nproc", "2"),
    },
    "precision": {
        "32": ("precision=32",),
        "bf16": ("precision=bf16",),
    },
    # aot_eager: dynamo and AOTAutograd trace forward and backward (where compile meets
    # the other features) without inductor's code generation (tens of seconds here).
    "compile": {
        "off": (),
        "whole": ("compile.enabled=true", "compile.backend=aot_eager"),
        "regional": ("compile.enabled=true", "compile.backend=aot_eager",
                     "compile.regional=Block"),
    },
    "activation_checkpointing": {
        "off": (),
        "on": ("activation_checkpointing=Block",),
    },
    "ema": {
        "off": (),
        "on": ("ema.enabled=true", "ema.evaluate=true"),
    },
    "grad_accum_steps": {
        "1": ("grad_accum_steps=1",),
        "2": ("grad_accum_steps=2",),
    },
    "checkpointer": {
        "torch-file": ("checkpointer=torch-file",),
        "async": ("checkpointer=async",),
        "dcp": ("checkpointer=dcp",),
        "dcp-async": ("checkpointer=dcp-async",),
    },
    # on: a snapshot in shared memory every step, so that the restart after the kill
    # resumes from memory (step 3) rather than from the disk (step 2).
    "memory tier": {
        "off": ("checkpoint.memory_every_steps=0",),
        "on": ("checkpoint.memory_every_steps=1",),
    },
}

#: (feature, value, feature, value, the engine's one-line refusal, after "engine-run:
#: error: "). Every other pair of values trains together.
REFUSED: tuple[tuple[str, str, str, str, str], ...] = ()

def _pairs(row: Row) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    items = [(name, row[name]) for name in FACTORS if name in row]
    return set(itertools.combinations(items, 2))


def _refused(row: Row) -> str | None:
    for a, va, b, vb, message in REFUSED:
        if row.get(a) == va and row.get(b) == vb:
            return message
    return None


def rows() -> list[Row]:
    """The supported rows, greedy pairwise (AETG's way, without its randomness): each
    row is the best of the candidates seeded by each pair still uncovered, a candidate
    giving every other feature in turn, those of most values first, the value that
    covers most uncovered pairs (the first such value on a tie, never one refused with
    a value already chosen); the best covers most uncovered pairs (the first on a tie)."""
    names = list(FACTORS)
    # Those of most values first, the later features first among equals: 13 rows (14
    # in the order of FACTORS, the lower bound 12: checkpointer x parallel).
    filling = sorted(reversed(names), key=lambda name: -len(FACTORS[name]))
    uncovered = [pair for a, b in itertools.combinations(names, 2)
                 for pair in itertools.product([(a, v) for v in FACTORS[a]],
                                               [(b, v) for v in FACTORS[b]])
                 if _refused(dict(pair)) is None]
    result = []
    while uncovered:
        remaining = set(uncovered)

        def completed(seed) -> Row:
            row = dict(seed)
            for name in filling:
                if name not in row:
                    allowed = [v for v in FACTORS[name] if _refused({**row, name: v}) is None]
                    row[name] = max(allowed, key=lambda v: len(  # max keeps the first of equals
                        _pairs({**row, name: v}) & remaining))
            return {name: row[name] for name in names}

        row = max((completed(seed) for seed in uncovered),
                  key=lambda r: len(_pairs(r) & remaining))
        result.append(row)
        covered = _pairs(row)
        uncovered = [pair for pair in uncovered if pair not in covered]
    return result


def refused_rows() -> list[tuple[Row, str]]:
    """One row per refused pair: the pair, every other feature at its first value."""
    result = []
    for a, va, b, vb, message in REFUSED:
        row = {name: next(iter(values)) for name, values in FACTORS.items()}
        row.update({a: va, b: vb})
        result.append((row, message))
    return result


def arguments(row: Row) -> list[str]:
    """The engine-run arguments of ``row`` (after the recipe)."""
    return [arg for name in FACTORS for arg in FACTORS[name][row[name]]]


def table() -> str:
    """docs/combinations.md."""
    names = list(FACTORS)
    header = "| # | " + " | ".join(names) + " |"
    rule = "|---|" + "|".join("---" for _ in names) + "|"
    lines = [
        "# Feature combinations",
        "",
        "<!-- Generated by `python tools/combinations.py --write` from the matrix in",
        "     tools/combinations.py; tests/test_combinations.py fails when this is stale. -->",
        "",
        "Features are tested together, not only one at a time: every pair of values of two",
        "features below is trained together in some row of tests/test_combinations.py",
        "(pairwise coverage; a greedy generator picks the rows). Each supported row trains",
        f"`{RECIPE}` ({STEPS} optimizer steps, `{' '.join(COMMON)}`), is SIGKILLed on",
        f"every rank right after step {KILLED_AFTER}, restarts (`--max-restarts 1`) and "
        "resumes: from shared",
        f"memory at step {KILLED_AFTER - 1} with the memory tier on, else from the newest "
        "disk snapshot (step",
        "4; step 2 under `dcp-async`, which commits a snapshot when the next one starts).",
        "It must end with the weights of an uninterrupted run alike in",
        f"{', '.join(ARITHMETIC)} with the other features off, bit for bit",
        "(`weights_sha256`): they change no weight.",
        "",
        "How each value is set (`engine-run RECIPE ...`):",
        "",
        "| feature | value | arguments |",
        "|---|---|---|",
        *(f"| {name} | {value} | {f'`{chr(32).join(args)}`' if args else '-'} |"
          for name, values in FACTORS.items() for value, args in values.items()),
        "",
        "## Supported",
        "",
        header,
        rule,
    ]
    for number, row in enumerate(rows(), 1):
        lines.append(f"| {number} | " + " | ".join(row[n] for n in names) + " |")
    lines += ["", "## Refused before any worker starts", ""]
    if not REFUSED:
        lines.append("None: every pair of the values above trains together.")
    else:
        lines += ["| settings | the one-line error |", "|---|---|"]
        for a, va, b, vb, message in REFUSED:
            lines.append(f"| {a}={va} with {b}={vb} | {message} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(REPO)}")
    action.add_argument("--check", action="store_true",
                        help=f"exit 1 when {DOC.relative_to(REPO)} is not the table")
    args = parser.parse_args(argv)
    text = table()
    if args.write:
        DOC.write_text(text)
    elif args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(REPO)} is stale: run python tools/combinations.py "
                  "--write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
