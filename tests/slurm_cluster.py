"""Is the local SLURM cluster of tools/slurm_cluster.sh up? Asked once per session.

Tests marked ``slurm`` need it. When it is down they FAIL with the reason (a broken
install step must not pass as a green run), unless the user said SLURM is deliberately
unavailable on this machine: ``ENGINE_TEST_NO_SLURM=1`` makes them skip instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

OPT_OUT = "ENGINE_TEST_NO_SLURM"
# As many nodes as tools/slurm_cluster.sh starts (SLURM_CLUSTER_NODES, 4 unless set).
NODES = tuple(f"n{i}" for i in range(1, int(os.environ.get("SLURM_CLUSTER_NODES", "4")) + 1))


def opted_out() -> bool:
    return os.environ.get(OPT_OUT, "") not in ("", "0")


@functools.cache
def problem() -> str | None:
    """Why the cluster cannot run a job, or None when every node is idle."""
    if shutil.which("sinfo") is None or shutil.which("srun") is None:
        return "SLURM is not installed (tools/slurm_cluster.sh start installs and starts it)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                              text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo does not answer ({exc}); start the cluster: tools/slurm_cluster.sh start"
    states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
    if proc.returncode != 0 or not all(states.get(n) in ("idle", "mix") for n in NODES):
        seen = proc.stdout.strip() or proc.stderr.strip()
        return (f"the local SLURM cluster is not up (sinfo: {seen}); start it with "
                "tools/slurm_cluster.sh start")
    return None
