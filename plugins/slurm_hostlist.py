"""SLURM's compressed lists, read in Python: node lists and tasks per node.

``expand_nodelist("gpu[01-03,07],cpu5")`` -> ``["gpu01", "gpu02", "gpu03", "gpu07",
"cpu5"]``: commas outside brackets separate hosts; inside brackets they separate numbers
and ranges; a range keeps the zero padding of its first number; several bracket groups
in one name expand in order (``a[1-2]-b[3-4]`` -> a1-b3, a1-b4, a2-b3, a2-b4), as
``scontrol show hostnames`` does. :func:`hostnames` adds ``scontrol`` as a cross-check
where it is installed, and as a fallback for forms the parser here refuses.

Also what the job's variables say beyond the lists, for the slurm launcher and for a
launcher that runs inside an allocation (spawn, torchrun, legacy): the job's master
port (:func:`master_port_for_job`) and the CPUs of each task (:func:`allocated_cpus`).
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
import zlib

from typing import Mapping

from engine.errors import LaunchError

SCONTROL_TIMEOUT_S = 10
_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class NodelistError(ValueError):
    pass


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist expression; NodelistError says where it goes wrong."""
    text = nodelist.strip()
    if not text:
        raise NodelistError("it is empty")
    hosts = []
    for item in _split_outside_brackets(text):
        if not item:
            raise NodelistError("it has an empty entry (two commas in a row?)")
        hosts.extend(_expand_item(item))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise NodelistError(f"'[' inside brackets at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise NodelistError(f"']' without '[' at position {i}")
            depth = 0
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise NodelistError("a '[' is never closed")
    items.append(text[start:])
    return items


def _expand_item(item: str) -> list[str]:
    # "a[1-2]-b[3-4]": literal pieces and bracket groups, expanded as a product.
    if item.startswith("["):
        raise NodelistError(f"entry {item!r} starts with a bracket, not a host name")
    pieces: list[list[str]] = []
    rest = item
    while rest:
        literal, bracket, rest = rest.partition("[")
        if literal:
            pieces.append([literal])
        if bracket:
            group, _, rest = rest.partition("]")
            pieces.append(_expand_group(group, item))
    hosts = ["".join(parts) for parts in itertools.product(*pieces)]
    for host in hosts:
        if not _HOST_RE.match(host):
            raise NodelistError(f"{host!r} (from {item!r}) is not a host name")
    return hosts


def _expand_group(group: str, item: str) -> list[str]:
    if not group.strip():
        raise NodelistError(f"empty brackets in {item!r}")
    out = []
    for part in group.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise NodelistError(f"{part!r} in {item!r} is not a number or a range N-M")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise NodelistError(f"range {part!r} in {item!r} runs backwards")
        if int(high) - int(low) > 100_000:
            raise NodelistError(f"range {part!r} in {item!r} is implausibly large")
        width = len(low) if low.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames``, or None when it is not installed or gives no clean
    answer (it prints garbage rather than failing for some malformed lists)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist],
                              capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = proc.stdout.split()
    text = proc.stdout + proc.stderr
    if (proc.returncode != 0 or not hosts or "invalid" in text.lower()
            or "error" in text.lower() or not all(_HOST_RE.match(h) for h in hosts)):
        return None
    return hosts


def hostnames(nodelist: str, variable: str = "SLURM_JOB_NODELIST",
              use_scontrol: bool = True) -> list[str]:
    """The hosts of a SLURM node list: parsed here, checked against scontrol."""
    try:
        hosts: list[str] | None = expand_nodelist(nodelist)
        problem = ""
    except NodelistError as exc:
        hosts, problem = None, str(exc)
    checked = scontrol_hostnames(nodelist) if use_scontrol else None
    if hosts is None:
        if checked is not None:
            return checked  # a form this parser does not know, but SLURM does
        raise LaunchError(
            f"{variable}={nodelist!r} does not parse as a SLURM node list: {problem} "
            "(expected e.g. 'gpu[01-03,07],cpu5')"
        )
    if checked is not None and checked != hosts:
        print(f"warning: {variable}={nodelist!r}: scontrol show hostnames gives "
              f"{' '.join(checked)}, the parser here {' '.join(hosts)}; using scontrol's",
              file=sys.stderr, flush=True)
        return checked
    return hosts


def expand_tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(
                f"{variable}={text!r} does not parse: expected counts such as '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def master_port_for_job(job_id: str) -> int:
    """A port every task of the job computes alike: 15000 + the job id's last 4 digits
    (the range 15000-24999 lies below Linux's ephemeral ports)."""
    if job_id.isdigit():
        return 15000 + int(job_id) % 10000
    return 15000 + zlib.crc32(job_id.encode()) % 10000


def allocated_cpus(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """``(cpus, "SLURM_CPUS_PER_TASK")``: the CPUs SLURM allocated to each task of the
    job, set for every process of the allocation (the batch script and what it starts,
    torchrun's agents included); None outside an allocation, or where the job did not
    ask for CPUs per task. A cluster that does not bind tasks to their CPUs leaves the
    affinity mask at the whole node: this is the number to trust there."""
    allocated = environ.get("SLURM_CPUS_PER_TASK", "")
    if allocated.isdigit() and int(allocated) > 0:
        return int(allocated), "SLURM_CPUS_PER_TASK"
    return None
