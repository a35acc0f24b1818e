"""Shared fixtures. Multi-process tests are real: worker processes on the CPU with gloo."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
ENGINE_RUN = str(BIN / "engine-run")


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Keep runs on the CPU and away from any real dataset in the user's home.
    env.update({"CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
                # so that workers can load test plugins: -p tests.fault_plugin
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            env.get("PYTHONPATH")]))})
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_STEP_ID"):
        env.pop(var, None)
    env.update(extra)
    return env


def run_cli(*args: str, cwd=None, env=None, timeout: float = 240, check: bool = False
            ) -> subprocess.CompletedProcess:
    """Run ``engine-run ARGS`` in a subprocess; stdout and stderr are captured as text."""
    proc = subprocess.run([ENGINE_RUN, *args], cwd=cwd or REPO, env=env or engine_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"engine-run {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def read_summary(out_dir) -> dict:
    return json.loads((pathlib.Path(out_dir) / "summary.json").read_text())


@pytest.fixture
def cifar_recipe() -> str:
    return str(REPO / "recipes" / "cifar_ddp.py")


#: Overrides for a CIFAR run that takes a few seconds: small synthetic data, 1 epoch.
QUICK = ("data.source=synthetic", "data.synthetic_size=512", "epochs=1", "log_every=4")
