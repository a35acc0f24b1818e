"""Helpers for the parallel-mode tests: run tiny_parallel_recipe.py through the real
``engine-run`` (spawned gloo processes on the CPU) with the probe plugin loaded, and
read back what the probe recorded."""

from __future__ import annotations

import json
import os
import pathlib

from tests.conftest import REPO, engine_env, read_summary, run_cli

HERE = pathlib.Path(__file__).resolve().parent
TINY_RECIPE = str(HERE / "tiny_parallel_recipe.py")


def tiny_env(cuda_visible_devices: str | None = "") -> dict[str, str]:
    """engine_env with the probe importable. CUDA_VISIBLE_DEVICES: "" hides the GPUs
    (the default, as engine_env), None leaves the machine's setting alone."""
    path = os.pathsep.join(filter(None, [str(HERE), str(REPO),
                                         os.environ.get("PYTHONPATH", "")]))
    env = engine_env(PYTHONPATH=path)
    env.pop("CUDA_VISIBLE_DEVICES")
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def run_tiny(out, *args: str, nproc: int = 2, check: bool = True,
             cuda_visible_devices: str | None = ""):
    """``engine-run tiny_parallel_recipe.py -p tiny_parallel_probe out_dir=OUT --nproc N
    ARGS``; returns the CompletedProcess."""
    return run_cli(TINY_RECIPE, "-p", "tiny_parallel_probe", f"out_dir={out}",
                   "--nproc", str(nproc), *args, env=tiny_env(cuda_visible_devices),
                   check=check)


def probes(out) -> list[dict]:
    """What the probe recorded, one dict per rank."""
    files = sorted(pathlib.Path(out).glob("probe-rank*.json"),
                   key=lambda p: int(p.stem[len("probe-rank"):]))
    return [json.loads(p.read_text()) for p in files]


def weights(out, rank: int = 0) -> dict:
    import torch

    return torch.load(pathlib.Path(out) / f"weights-rank{rank}.pt", weights_only=True,
                      map_location="cpu")


def summary(out) -> dict:
    return read_summary(out)
