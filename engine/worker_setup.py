"""The set-up steps a worker runs, shared by every door that trains: engine-run's and
engine.fit's Engine, the custom loop's Context (engine.api) and tune-workers. One place,
so that the doors cannot drift apart (a custom loop's ``activation_checkpointing`` was
silently ignored while the Engine applied it).

- :func:`start_worker`: the first steps of every worker (seed, deterministic kernels,
  threads, parallel mode, process group, run folder); :func:`callers_state_kept` gives a
  library caller its thread count back.
- :func:`prepare_model`: the model transforms, then the parallel wrap.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any

from engine import phases


#: torch's thread count before a worker in this process set the run's (start_worker).
_threads_before: int | None = None


@contextlib.contextmanager
def callers_state_kept():
    """Around a library call (engine.fit, engine.launch): a worker that runs in the
    caller's process sets torch's thread count for the run (``threads=``, or its share
    of the CPUs); the caller gets its own back when the call returns, however it ends.
    The call's phases (the console's ``done: ... in 5.2s (start-up 1.1s)``) count from
    the call's start, not from the process's or an earlier call's."""
    global _threads_before
    phases.restart()
    _threads_before = None
    try:
        yield
    finally:
        if _threads_before is not None:
            import torch

            torch.set_num_threads(_threads_before)
            _threads_before = None


def start_worker(pm, cfg, world, options: dict[str, Any]):
    """The first steps of every worker (a Trainer run or a library user's loop): seed
    every RNG, share the CPUs, choose the parallel mode and its devices, create the
    process group, settle the run's folder. Returns the parallel mode."""
    import torch

    from engine import distributed, health, run_dir

    seed_everything(cfg.seed)
    if cfg.deterministic:
        use_deterministic_kernels()
    global _threads_before
    if _threads_before is None:
        _threads_before = torch.get_num_threads()
    torch.set_num_threads(options.get("threads") or world.cpu_share().count)
    from engine.parallel import choose_parallel

    parallel = choose_parallel(pm.parallel_modes, cfg.parallel, world)(world, cfg)
    parallel.check()
    parallel.setup_device()
    if world.distributed:
        distributed.init(world, parallel.backend or "gloo", cfg.timeout_s)
        health.prepare(cfg.timeout_s)
    # out_dir's pattern filled by rank 0, the same for every rank (engine/run_dir.py).
    run_dir.settle(cfg, world, options, run_dir.run_files(pm))
    return parallel


def use_deterministic_kernels() -> None:
    """Deterministic cuDNN and cuBLAS kernels (``deterministic=true``). Must run before
    the process's first CUDA matrix product: cuBLAS reads its workspace setting when it
    starts."""
    import torch

    # cuBLAS is deterministic only with a fixed workspace (CUDA >= 10.2); a user's own
    # setting wins.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def prepare_model(model, cfg, parallel, device, say):
    """``model`` on ``device`` with the model transforms in torchtitan's order:
    activation checkpointing (``activation_checkpointing``), torch.compile (``compile.*``),
    then the parallel mode's wrap (DDP, fully_shard...); returns the wrapped model.
    ``say``: how the run prints a line (rank 0's)."""
    from engine import activation_checkpointing
    from engine.compile import compile_model

    model = model.to(device)
    model = activation_checkpointing.apply(model, cfg.activation_checkpointing)
    model = compile_model(model, cfg.compile, say)
    return parallel.wrap(model)
