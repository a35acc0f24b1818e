"""What the launching process checks and answers before any worker starts: the launch
arguments, a rerun into a completed run's folder, whether spawned workers can import the
script and unpickle the job, a recipe's checks that need no batch (engine/launching.py)."""

from __future__ import annotations

import ast
import multiprocessing
import os
import pathlib
import pickle
import sys
from typing import Any

from engine.errors import CheckpointError, ConfigError
from engine.launch_env import start_method

# engine-run's start imports this module (engine.launching does): what only a run needs
# (config, snapshot, run_dir, trainer, torch...) is imported inside the functions using it.


def check_arguments(door, options: dict) -> None:
    """In one line in the door's words: ``nproc`` and ``threads`` None or a positive int,
    ``resume`` a bool, None or the path of something that exists."""
    def asked(name: str, value: Any) -> str:
        return f"{door.name}({name}={value!r})" if door.library else f"--{name} {value!r}"

    for name, default in (("nproc", "one process per GPU, 2 without a GPU"),
                          ("threads", "the CPUs the load leaves idle, shared by the "
                                      "processes")):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConfigError(f"{asked(name, value)}: {name} must be a positive int"
                              f"{', or None' if door.library else ''} (default: {default})")
    resume = options.get("resume")
    if resume is not None and not isinstance(resume, str):
        raise ConfigError(f"{asked('resume', resume)}: resume must be True (the newest "
                          "snapshot in out_dir), False (start fresh) or the path of a "
                          "snapshot")
    if resume is not None and not os.path.exists(resume):
        raise CheckpointError(f"{asked('resume', resume)}: no such snapshot")


def already_complete(cfg, job, say: bool = True) -> dict | None:
    """A rerun into a completed run's folder, answered from its summary.json and
    config.json, no worker started: the same config, its summary with status
    "already_complete"; another (an lr sweep through one folder), a ConfigError naming
    the changes and how to keep both runs. None: train as usual. For a recipe's job."""
    from engine import config as config_mod
    from engine import snapshot
    from engine.run_dir import completed_run

    if job.options.get("no_resume") or job.options.get("resume"):
        return None
    found = completed_run(cfg.out_dir)
    if found is None:
        return None
    summary, saved = found
    done = int(summary.get("epochs_completed") or 0)
    steps = int(summary.get("global_step") or 0)
    if summary.get("stopped_early") or not (0 < cfg.epochs <= done
                                            or 0 < getattr(cfg, "max_steps", 0) <= steps):
        return None  # more to train: the workers resume and train on (or say it stopped)
    changes = {k: v for k, v in snapshot.config_changes(saved, config_mod.to_dict(cfg)).items()
               if k == "lr" or not snapshot.may_change(k, cfg)}
    door = job.door
    if changes:
        listed = ", ".join(f"{k} {old!r} (asked: {new!r})" for k, (old, new)
                           in sorted(changes.items()))
        who = f"{door.name}: " if door.library else ""  # engine-run's prefix says it
        raise ConfigError(
            f"{who}{cfg.out_dir} holds a completed run trained with {listed}: "
            "nothing would be trained with this config; to keep both runs, give each its "
            f"folder (out_dir={pathlib.Path(cfg.out_dir) / '{version}'}), or use "
            f"{door.start_over} to replace it")
    if say and not 0 < cfg.epochs <= done:  # ended by max_steps, in an epoch
        print(f"already complete: {cfg.out_dir} holds a finished run of {steps} steps "
              f"(asked for max_steps={cfg.max_steps}), nothing to train; to train on, ask "
              f"for more (max_steps={steps + 1} or more); to start over, use "
              f"{door.start_over} or another out_dir", flush=True)
    elif say:
        print(f"already complete: {cfg.out_dir} holds a finished run of {done} "
              f"epoch{'' if done == 1 else 's'} (asked for {cfg.epochs}), nothing to train; "
              f"to train on, ask for more (epochs={done + 1} or more); to start over, use "
              f"{door.start_over} or another out_dir", flush=True)
    return {**summary, "status": "already_complete", "out_dir": cfg.out_dir}


def check_spawnable(job) -> None:
    """Before spawning: a spawned worker imports the caller's main script and unpickles
    the job; say so in one line (naming the door) when that cannot work."""
    door = job.door.name
    if multiprocessing.parent_process() is not None:
        raise ConfigError(
            f"{door} ran again inside a spawned worker: the workers import your "
            "script, so guard the call with `if __name__ == \"__main__\":`")
    _refuse_a_script_without_a_file(door)
    script = _unguarded_main_script()
    if script is not None:
        raise ConfigError(
            f"{door}: {script} starts workers at import time; spawned workers "
            f"import {script.name} again, so put the call under "
            "`if __name__ == \"__main__\":`")
    try:
        pickle.dumps(job)
    except Exception as exc:
        raise ConfigError(
            f"{door}: cannot send {job.describe()} to the worker processes "
            f"({type(exc).__name__}: {exc}); use a module-level function, not a lambda "
            "or a nested function, and picklable arguments") from None


def _refuse_a_script_without_a_file(door: str) -> None:
    """A main script read on stdin has no file spawned workers could import (forked: none)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path and not os.path.isfile(path) and start_method() == "spawn":
        raise ConfigError(
            f"{door}: the main script was read from {path}, not a file, and spawned "
            "workers import it: use nproc=1 (trains in this process) or run the script "
            "from a file")


def _unguarded_main_script() -> pathlib.Path | None:
    """The main script, when the code that launched runs at its top level outside an
    ``if __name__ ...`` block, else None: a spawned worker imports the main script, and an
    unguarded call would launch again there (multiprocessing's "bootstrapping" error)."""
    frame = sys._getframe(1)
    while frame is not None:  # the main module's top-level frame, if it is a caller
        code, name = frame.f_code.co_name, frame.f_globals.get("__name__")
        if code == "<module>" and name == "__main__":
            break
        frame = frame.f_back
    path = frame and frame.f_globals.get("__file__")
    if not path or not os.path.isfile(path):
        return None  # python -c, an interactive session, a notebook: nothing to import
    try:
        tree = ast.parse(pathlib.Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
                and node.lineno <= line <= (node.end_lineno or node.lineno)):
            return None
    return pathlib.Path(path)


def check_before_workers(recipe, cfg) -> None:
    """The worker's checks that need no batch: the throughput unit, a metric misspelt or in
    another unit, a scheduler's metric and mode (on the meta device, else the worker's)."""
    import difflib
    import types
    import warnings

    import torch

    from engine.metrics import EPOCH_END, named, throughput_unit
    from engine.trainer import EPOCH_LOSS, Throughput, scheduler_metric
    from engine.worker_setup import build_scheduler

    throughput = Throughput(recipe)
    for key, metric in named(cfg):
        epoch_end = key in EPOCH_END or metric.startswith("train/epoch_")
        ours = throughput.epoch_metric if epoch_end else throughput.metric
        known = [EPOCH_LOSS, ours, throughput.epoch_metric, "train/data_wait_fraction", "lr"]
        close = ([ours] if throughput_unit(metric) not in (None, throughput.unit) else
                 difflib.get_close_matches(metric, known, n=1, cutoff=0.9))
        if metric not in known and close:
            raise ConfigError(f"config key {key!r}: {metric!r} is not a metric this run "
                              f"logs (did you mean {close[0]!r}?)")
    scheduler = None
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = recipe.module.build_optimizer(cfg, torch.nn.Linear(1, 1))
            steps = cfg.max_steps or cfg.epochs
            scheduler = build_scheduler(recipe, cfg, optimizer, types.SimpleNamespace(
                cfg=cfg, steps_per_epoch=1, total_steps=steps))
    except Exception:  # its functions need the real model or data: the worker checks
        if recipe.optional("build_scheduler") is not None:
            return
    scheduler_metric(scheduler, cfg)
