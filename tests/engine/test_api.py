"""The library API: engine.launch and engine.Context.

One-process runs happen in this process (the spawn launcher runs a single worker in
place); the two-process behaviour runs as a script in a subprocess, as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import engine
from engine.checkpoint import model_digest
from engine.errors import ConfigError, PluginError
from engine.testing import run_python
from tests.conftest import engine_env, read_summary

RECORDER = textwrap.dedent("""
    import os

    calls = []

    def engine_log(engine, metrics, step):
        calls.append(("log", engine.rank, metrics, step))
        with open(os.path.join(engine.out_dir, f"log-rank{engine.rank}.txt"), "a") as f:
            f.write(f"{step} {sorted(metrics.items())}\\n")

    def engine_exception(engine, exc):
        calls.append(("exception", type(exc).__name__))

    def engine_run_end(engine, summary):
        calls.append(("run_end", summary["status"]))
""")


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    """A logger plugin module (name: api_recorder_<test>) and its list of calls."""
    name = "api_recorder_" + tmp_path.name.replace("-", "_")
    (tmp_path / f"{name}.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def config(tmp_path, **fields):
    return engine.TrainConfig(out_dir=str(tmp_path / "run"), **fields)


# ----------------------------------------------------------- in this process


def describe(ctx, value):
    """Runs in the worker: what the Context says about the world."""
    return {"rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank,
            "device": ctx.device.type, "is_rank0": ctx.is_rank0, "value": value,
            "mean": ctx.reduce({"a": 2.0, "b": torch.tensor([3.0])}),
            "sum": ctx.reduce({"a": 2.0}, op="sum")}


def test_one_process_runs_here_and_returns_the_result(tmp_path):
    result = engine.launch(describe, "x", nproc=1, config=config(tmp_path))
    assert result == {"rank": 0, "world_size": 1, "local_rank": 0, "device": "cpu",
                      "is_rank0": True, "value": "x", "mean": {"a": 2.0, "b": 3.0},
                      "sum": {"a": 2.0}}
    summary = read_summary(tmp_path / "run")
    assert (summary["status"], summary["world_size"], summary["parallel"]) == (
        "completed", 1, "single")


def ddp_options(ctx):
    return ctx.cfg.ddp.bucket_cap_mb


def test_the_plugins_config_groups_reach_library_mode(tmp_path):
    # engine-run adds the ddp plugin's group to the config; engine.launch must too.
    assert engine.launch(ddp_options, nproc=1, config=config(tmp_path)) == 25


def log_and_fail(ctx, fail):
    ctx.log({"loss": torch.tensor(0.5), "lr": 0.1})
    ctx.log({"loss": 0.25}, step=7)
    if fail:
        raise ValueError("diverged")
    return "ok"


def test_log_reaches_logger_plugins_and_the_run_ends_with_hooks(tmp_path, recorder):
    assert engine.launch(log_and_fail, False, nproc=1, plugins=[recorder],
                         config=config(tmp_path)) == "ok"
    calls = sys.modules[recorder].calls
    assert calls == [("log", 0, {"loss": 0.5, "lr": 0.1}, 0), ("log", 0, {"loss": 0.25}, 7),
                     ("run_end", "completed")]
    assert type(calls[0][2]["loss"]) is float


def test_an_exception_reaches_the_caller_after_the_hooks(tmp_path, recorder):
    with pytest.raises(ValueError, match="diverged"):
        engine.launch(log_and_fail, True, nproc=1, plugins=[recorder],
                      config=config(tmp_path))
    assert sys.modules[recorder].calls[-2:] == [("exception", "ValueError"),
                                                ("run_end", "failed")]
    assert read_summary(tmp_path / "run")["status"] == "failed"


def train(ctx, epochs, lr=0.1):
    """A small custom loop; returns the epochs it ran, the steps and the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = ctx.wrap(model, optimizer)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(inputs, inputs[:, :4].argmax(dim=1))
    loader = ctx.loader(data, batch_size=32)
    ran = []
    for epoch in ctx.epochs(epochs):
        ran.append(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {"ran": ran, "step": ctx.state.step, "weights": model_digest(ctx.module.state_dict())}


def checkpointed_blocks(ctx, epochs):
    """``train``, and how many blocks of the wrapped model recompute their activations."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    result = train(ctx, epochs)
    return {**result, "wrapped": sum(isinstance(m, CheckpointWrapper)
                                     for m in ctx.module.modules())}


def test_a_custom_loop_gets_activation_checkpointing_as_engine_run_does(tmp_path):
    """ctx.wrap takes the Engine's model steps (engine/worker_setup.py): the named blocks
    are wrapped (they were silently left alone), with the same weights as without."""
    plain = engine.launch(checkpointed_blocks, 2, nproc=1, config=config(tmp_path / "a"))
    wrapped = engine.launch(checkpointed_blocks, 2, nproc=1, config=config(
        tmp_path / "b", activation_checkpointing="Linear"))
    assert (plain["wrapped"], wrapped["wrapped"]) == (0, 2)
    assert wrapped["weights"] == plain["weights"]


def test_epochs_resume_from_the_last_snapshot_bit_identically(tmp_path):
    straight = engine.launch(train, 3, nproc=1, config=config(tmp_path / "a"))
    assert (straight["ran"], straight["step"]) == ([0, 1, 2], 9)

    first = engine.launch(train, 2, nproc=1, config=config(tmp_path / "b"))
    assert first["ran"] == [0, 1]
    resumed = engine.launch(train, 3, nproc=1, config=config(tmp_path / "b"))
    assert (resumed["ran"], resumed["step"]) == ([2], 9)
    assert resumed["weights"] == straight["weights"]
    assert read_summary(tmp_path / "b" / "run")["weights_sha256"] == straight["weights"]

    # resume=False is refused where a run is, and removes nothing...
    before = sorted(p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir())
    with pytest.raises(ConfigError) as refused:
        engine.launch(train, 3, nproc=1, resume=False, config=config(tmp_path / "b"))
    assert str(refused.value).startswith(
        f"engine.launch(resume=False): {tmp_path / 'b' / 'run'} holds a run (snapshots "
        "and summary.json); pass overwrite=True to delete it first")
    assert sorted(p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir()) == before
    # ...with overwrite=True it starts over (with the same seed, it ends where the first
    # did).
    again = engine.launch(train, 3, nproc=1, resume=False, overwrite=True,
                          config=config(tmp_path / "b"))
    assert again["ran"] == [0, 1, 2] and again["weights"] == straight["weights"]
    # resume=PATH takes that snapshot.
    snapshot = next((tmp_path / "b" / "run" / "checkpoints").glob("snapshot-e0001-*.pt"))
    picked = engine.launch(train, 3, nproc=1, resume=str(snapshot),
                           config=config(tmp_path / "b"))
    assert (picked["ran"], picked["weights"]) == ([1, 2], straight["weights"])
    # A resume refused because the config changed leaves the run's config.json as it was.
    recorded = (tmp_path / "b" / "run" / "config.json").read_text()
    with pytest.raises(ConfigError, match="seed"):
        engine.launch(train, 3, nproc=1, config=config(tmp_path / "b", seed=12345))
    assert (tmp_path / "b" / "run" / "config.json").read_text() == recorded


def own_loader_train(ctx, epochs):
    """A loop over a torch DataLoader of its own (not ctx.loader's), saving mid-epoch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, inputs[:, :4].argmax(dim=1)), batch_size=32)
    for epoch in ctx.epochs(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if ctx.state.step == 4:  # a snapshot between two batches of a loader the
                ctx.save()  # engine never saw
    return {"step": ctx.state.step, "weights": model_digest(ctx.module.state_dict())}


def test_a_plain_torch_dataloader_of_your_own_trains_saves_and_resumes(tmp_path):
    straight = engine.launch(own_loader_train, 2, nproc=1, config=config(tmp_path / "a"))
    engine.launch(own_loader_train, 1, nproc=1, config=config(tmp_path / "b"))
    resumed = engine.launch(own_loader_train, 2, nproc=1, config=config(tmp_path / "b"))
    assert resumed == straight and straight["step"] == 6


def test_a_finished_run_says_it_is_complete_and_what_to_do(tmp_path, capsys):
    engine.launch(train, 2, nproc=1, config=config(tmp_path))
    capsys.readouterr()
    again = engine.launch(train, 2, nproc=1, config=config(tmp_path))
    assert again["ran"] == []
    assert capsys.readouterr().out.splitlines()[1] == (
        f"already complete: {tmp_path / 'run'} holds a finished run of 2 epochs (asked for "
        "2), nothing to train; to train on, ask for more (ctx.epochs(3) or more); to start "
        "over, use engine.launch(..., resume=False, overwrite=True) or another out_dir")


def test_checkpoint_every_epochs_is_respected(tmp_path):
    cfg = config(tmp_path)
    cfg.checkpoint.every_epochs = 2
    engine.launch(train, 3, nproc=1, config=cfg)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.pt"))
    assert [n.split("-")[1] for n in names] == ["e0002", "e0003"]  # every 2nd, and the last


# ----------------------------------------------------------------- mistakes


def wrap_twice(ctx):
    model = torch.nn.Linear(2, 2)
    ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def epochs_first(ctx):
    for _ in ctx.epochs(2):
        pass


def no_optimizer(ctx):
    ctx.wrap(torch.nn.Linear(2, 2), None)


def bad_reduce(ctx):
    ctx.reduce({"a": 1.0}, op="max")


def too_few_samples(ctx):
    ctx.loader(torch.utils.data.TensorDataset(torch.zeros(3, 2)), batch_size=4,
               drop_last=True)


class Items(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def stream_second(ctx):
    ctx.loader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=4)
    ctx.loader(Items(), batch_size=4)


@pytest.mark.parametrize("fn, message", [
    (wrap_twice, "ctx.wrap was called twice; a Context trains one model (with one "
                 "optimizer)"),
    (epochs_first, "ctx.epochs needs the model: call `model, optimizer = ctx.wrap(model, "
                   "optimizer)` first"),
    (no_optimizer, "ctx.wrap(model, optimizer): None is not a torch optimizer (nor a "
                   "function of the model that builds one)"),

    (bad_reduce, "ctx.reduce: op 'max' is not one of: mean, sum"),
    (too_few_samples, "the training set has 3 samples, fewer than one batch of 4 per "
                      "process; use a smaller batch_size or drop_last=False"),
    (stream_second, "ctx.loader: a training stream must be the run's first training "
                    "loader (snapshots record the first one's position); create it before "
                    "the others"),
])
def test_misuse_inside_the_worker_is_a_clear_error(tmp_path, fn, message):
    with pytest.raises(ConfigError) as err:
        engine.launch(fn, nproc=1, config=config(tmp_path))
    assert str(err.value) == message


def train_sharded(ctx, optimizer_first: bool):
    model = torch.nn.Linear(2, 2)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer_first
                 else lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    model, optimizer = ctx.wrap(model, optimizer)
    before = model.weight.full_tensor().clone()
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    return bool((model.weight.full_tensor() != before).all())


def test_under_fsdp_the_optimizer_is_built_on_the_shards(tmp_path):
    assert engine.launch(train_sharded, False, nproc=1,
                         config=config(tmp_path, parallel="fsdp")) is True
    with pytest.raises(ConfigError) as err:
        engine.launch(train_sharded, True, nproc=1,
                      config=config(tmp_path / "again", parallel="fsdp"))
    assert str(err.value) == (
        "the optimizer holds parameters that the model no longer has after parallel mode "
        "'fsdp' wrapped it (it replaces them); pass a function that builds the optimizer "
        "instead: ctx.wrap(model, lambda m: torch.optim.SGD(m.parameters(), lr=...))")
    # A failed run leaves its process group (a rank may be gone); this one ran here.
    torch.distributed.destroy_process_group()


def test_misuse_of_launch_is_caught_before_any_process_starts(tmp_path):
    with pytest.raises(ConfigError, match="engine.launch needs a function to run in every "
                                          "worker, not 3"):
        engine.launch(3)
    with pytest.raises(ConfigError, match="config must be an engine.TrainConfig"):
        engine.launch(describe, config={"epochs": 2})
    with pytest.raises(ConfigError) as err:
        engine.launch(lambda ctx: None, nproc=2, config=config(tmp_path))
    assert str(err.value).startswith("engine.launch: cannot send <function ")
    assert str(err.value).endswith("; use a module-level function, not a lambda or a "
                                   "nested function, and picklable arguments")
    with pytest.raises(PluginError, match="parallel mode 'hsdp' is not available"):
        engine.launch(describe, config=config(tmp_path, parallel="hsdp"))
    with pytest.raises(ConfigError, match="config key 'lr': -1.0 must be > 0"):
        engine.launch(describe, config=config(tmp_path, lr=-1.0))
    assert not (tmp_path / "run").exists()


def test_every_name_in_all_imports_and_import_engine_stays_light():
    code = ("import sys, engine\n"
            "assert 'torch' not in sys.modules, 'import engine imported torch'\n"
            "from engine import *\n"
            "print(sorted(n for n in engine.__all__ if getattr(engine, n, None) is None))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=engine_env(),
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "[]\n", "")


UNGUARDED = textwrap.dedent("""
    import engine


    def work(ctx):
        return ctx.rank


    engine.launch(work, nproc=2, config=engine.TrainConfig(out_dir="run"))
""")


def test_a_script_without_the_main_guard_gets_one_clear_error(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    proc = run_python([str(script)], cwd=tmp_path, env=engine_env(), timeout=300)
    assert proc.returncode == 1
    # No worker started: no multiprocessing "bootstrapping phase" traceback from them.
    assert "bootstrapping" not in proc.stderr and proc.stderr.count("Traceback") == 1
    assert proc.stderr.splitlines()[-1] == (
        f"engine.errors.ConfigError: engine.launch: {script} starts workers at import "
        "time; spawned workers import unguarded.py again, so put the call under "
        '`if __name__ == "__main__":`')
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ two processes


SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch

    import engine


    def work(ctx, fail_on_rank):
        if fail_on_rank >= 0:  # the others return at once: no collective waits for it
            if ctx.rank == fail_on_rank:
                raise ValueError(f"boom on rank {ctx.rank}")
            return None
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = ctx.wrap(model, optimizer)
        data = torch.utils.data.TensorDataset(torch.arange(64.0).repeat(4, 1).T,
                                              torch.arange(64) % 2)
        loader = ctx.loader(data, batch_size=16)
        seen = {}
        for epoch in ctx.epochs(2):
            seen[epoch] = []
            for x, y in loader:
                seen[epoch].append(x[:, 0].long().tolist())
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        val = [x[:, 0].long().tolist() for x, _ in ctx.loader(data, 10, train=False)]
        ctx.print(f"printed by rank {ctx.rank}")
        ctx.log({"rank_plus_one": ctx.rank + 1})
        with open(f"{ctx.out_dir}/seen-rank{ctx.rank}.json", "w") as f:
            json.dump({"train": seen, "val": val}, f)
        return {"rank": ctx.rank, "world_size": ctx.world_size, "step": ctx.state.step,
                "parallel": type(model).__name__,
                "mean": ctx.reduce({"r": ctx.rank + 1.0}),
                "sum": ctx.reduce({"r": ctx.rank + 1.0}, op="sum")}


    if __name__ == "__main__":
        out_dir, recorder = sys.argv[1:3]
        config = engine.TrainConfig(out_dir=out_dir)
        result = engine.launch(work, -1, nproc=2, config=config, plugins=[recorder])
        print("RESULT " + json.dumps(result), flush=True)
        try:
            engine.launch(work, 1, nproc=2, config=engine.TrainConfig(out_dir=out_dir + "2"))
        except engine.EngineError as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
""")


def test_two_processes_ddp_sharding_reduction_and_rank0_output(tmp_path, recorder):
    script = tmp_path / "two.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    # The workers are forked rather than spawned, to save their start (examples/
    # custom_loop.py's test spawns them, as a user's script does). The failing launch
    # below also checks that a failed forked worker leaves the launching process's
    # exchange folder alone (it ran that process's atexit handlers, which removed it).
    proc = run_python([str(script), str(out), recorder], cwd=tmp_path, timeout=300,
                      env=engine_env(PYTHONPATH=str(tmp_path), ENGINE_START_METHOD="fork"))
    assert "ENGINE_START_METHOD" not in proc.stderr  # forked: no fall-back warning
    lines = proc.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    # rank 0's return value; 64 samples, global batch 16: 8 per rank, 4 steps an epoch.
    assert result == {"rank": 0, "world_size": 2, "step": 8,
                      "parallel": "DistributedDataParallel", "mean": {"r": 1.5},
                      "sum": {"r": 3.0}}
    assert lines.count("printed by rank 0") == 1 and "printed by rank 1" not in proc.stdout
    summary = read_summary(out)
    assert summary["status"] == "completed" and summary["global_step"] == 8
    assert len(set(summary["weights_sha256_per_rank"])) == 1
    # Only rank 0 logs.
    assert (out / "log-rank0.txt").read_text() == "8 [('rank_plus_one', 1.0)]\n"
    assert not (out / "log-rank1.txt").exists()

    seen = [json.loads((out / f"seen-rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in ("0", "1"):
        batches = [seen[r]["train"][epoch] for r in (0, 1)]
        assert all(len(batch) == 8 for rank in batches for batch in rank)
        flat = [sorted(sum(rank, [])) for rank in batches]
        assert not set(flat[0]) & set(flat[1])  # disjoint shards...
        assert sorted(flat[0] + flat[1]) == list(range(64))  # ...covering the data
    assert seen[0]["train"]["0"] != seen[0]["train"]["1"]  # reshuffled every epoch
    val = sorted(sum(seen[0]["val"] + seen[1]["val"], []))
    assert val == list(range(64))  # validation: every sample exactly once

    # The second launch fails on rank 1: one line naming the rank and the error.
    error = next(line for line in lines if line.startswith("ERROR "))
    # On a loaded machine rank 0 may still be finding out about rank 1 when its 2 s of
    # grace end; the line then adds that it was terminated, which is also true.
    assert error.startswith("ERROR WorkerFailed: worker with local rank 1 (rank 1) exited "
                            "with code 1: ValueError: boom on rank 1"), error
    assert "[rank 1] Traceback" in proc.stderr


# ------------------------------------------------------------------ Ctrl-C


CTRL_C_LOOP = textwrap.dedent("""
    import pathlib
    import sys

    import torch

    import engine


    def train(ctx, epochs):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.arange(64.0).repeat(4, 1).T,
                                              torch.arange(64) % 2)
        loader = ctx.loader(data, batch_size=8)  # 8 steps an epoch
        for epoch in ctx.epochs(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if ctx.state.step == 3:
                    pathlib.Path(ctx.out_dir, "stepped").touch()
        return ctx.state.step


    if __name__ == "__main__":
        config = engine.TrainConfig(out_dir=sys.argv[1], log_every=1)
        print("RESULT", engine.launch(train, int(sys.argv[2]), nproc=2, config=config))
""")


def test_ctrl_c_in_a_custom_loop_is_one_line_a_snapshot_of_its_step_and_exit_130(
        tmp_path):
    """Ctrl-C (SIGINT to the script's process group, as a terminal sends it) during a
    custom loop's training: the ranks stop after the same optimizer step with its
    snapshot, the script ends with engine-run's line and exit code (it ended with an
    engine.errors.Interrupted traceback, exit 1, no snapshot at the stop), and the same
    command resumes there."""
    import os
    import re
    import signal
    import time

    from engine.testing import start_python

    script, out = tmp_path / "loop.py", tmp_path / "run"
    script.write_text(CTRL_C_LOOP)
    env = engine_env(ENGINE_START_METHOD="fork")  # workers forked: no start of their own
    proc = start_python([str(script), str(out), "1000"], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (out / "stepped").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(1)
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    # After an optimizer step: mid-epoch, or its last batch (no "end of epoch" yet).
    line = re.fullmatch(r"interrupted at epoch (\d+), step (\d+), batch \d+ of the epoch: "
                        r"snapshot written; the same command resumes", stderr.strip())
    assert line and "RESULT" not in stdout, stderr
    epoch, step = map(int, line.groups())
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"]) == ("interrupted", step)
    assert (out / "checkpoints" / "latest").read_text().strip().endswith(f"s{step:08d}.pt")
    resumed = run_python([str(script), str(out), str(epoch)], env=env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"RESULT {epoch * 8}" in resumed.stdout, resumed.stdout
    assert read_summary(out)["resumed_from"].endswith(f"s{step:08d}.pt")
