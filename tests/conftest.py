"""Shared fixtures. Multi-process tests are real: worker processes on the CPU with gloo."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from engine import testing
from engine.testing import read_summary  # noqa: F401 (the tests import it from here)

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
ENGINE_RUN = str(BIN / "engine-run")


def engine_env(**extra: str) -> dict[str, str]:
    """engine.testing's environment for a run (CPU only, no launcher or SLURM
    variables), with this venv's tools on PATH and the repository importable, so that
    workers can load test plugins: ``-p tests.fault_plugin``."""
    return testing.engine_env({
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                    os.environ.get("PYTHONPATH")])),
        **extra})


def run_cli(*args: str, cwd=None, env=None, timeout: float = 240, check: bool = False
            ) -> subprocess.CompletedProcess:
    """Run ``engine-run ARGS`` in a subprocess; stdout and stderr are captured as text."""
    return testing.run_engine(args, env=env or engine_env(), cwd=cwd or REPO,
                              timeout=timeout, check=check, program=[ENGINE_RUN])


@pytest.fixture
def cifar_recipe() -> str:
    return str(REPO / "recipes" / "cifar_ddp.py")


#: Overrides for a CIFAR run that takes a few seconds: small synthetic data, 1 epoch.
QUICK = ("data.source=synthetic", "data.synthetic_size=512", "epochs=1", "log_every=4")
