"""The hooks fire as engine/hookspecs.py and docs/plugins.md say: which, on which ranks,
in which order, with which arguments. A recorder plugin (-p) writes every call it gets
to a file per rank during real engine-run runs."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from engine.testing import TINY_RECIPE
from tests.conftest import engine_env, run_cli

RECORDER = textwrap.dedent('''
    """Records every hook call, one JSON line per call, in $RECORDER_DIR."""
    import json
    import os

    import engine

    def record(name, *values):
        path = os.path.join(os.environ["RECORDER_DIR"], name)
        with open(path, "a") as f:
            f.write(json.dumps(values) + "\\n")

    def rank_record(ctx, *values):
        record(f"rank{ctx.world.rank}.jsonl", *values)

    def engine_register_launchers(registry):
        record(f"register-{os.getpid()}.jsonl", "launchers", registry.kind)

    def engine_register_parallel(registry):
        record(f"register-{os.getpid()}.jsonl", "parallel", registry.kind)

    def engine_register_checkpointers(registry):
        record(f"register-{os.getpid()}.jsonl", "checkpointers", registry.kind)

    def engine_addoption(parser):
        parser.add_argument("--recorder-tag", default="-")

    def engine_run_start(ctx):
        rank_record(ctx, "run_start", ctx.state.step, ctx.options["recorder_tag"])

    def engine_epoch_start(ctx, epoch):
        rank_record(ctx, "epoch_start", epoch)

    def engine_train_step_end(ctx, step, loss):
        rank_record(ctx, "train_step_end", step, type(loss).__name__, list(loss.shape))
        if step == int(os.environ.get("RECORDER_FAIL_AT_STEP", "0")):
            raise RuntimeError(f"recorder fails at step {step}")

    def engine_log(ctx, metrics, step):
        rank_record(ctx, "log", step, sorted(metrics))

    def engine_epoch_end(ctx, epoch, metrics):
        rank_record(ctx, "epoch_end", epoch, sorted(metrics))

    def engine_exception(ctx, exc):
        rank_record(ctx, "exception", type(exc).__name__, str(exc))

    def engine_run_end(ctx, summary):
        rank_record(ctx, "run_end", summary["status"])
''')


@pytest.fixture
def recorder(tmp_path):
    (tmp_path / "hook_recorder.py").write_text(RECORDER)
    (tmp_path / "tiny.py").write_text(TINY_RECIPE)
    calls = tmp_path / "calls"
    calls.mkdir()
    return tmp_path


def read(path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(recorder, *args, check=False, **env):
    # Without the memory tier: a memory snapshot finishes the check point in flight at
    # its step (its log comes at once), and the default interval (auto) is measured, so
    # the order would depend on the machine's speed.
    return run_cli(str(recorder / "tiny.py"), f"out_dir={recorder / 'run'}", "-p",
                   "hook_recorder", "checkpoint.memory_every_steps=0", *args, cwd=recorder,
                   check=check,
                   env=engine_env(PYTHONPATH=str(recorder),
                                  RECORDER_DIR=str(recorder / "calls"), **env))


def expected_calls(rank: int, epochs: int, steps_per_epoch: int, log_every: int) -> list:
    calls = [["run_start", 0, "hello"]]
    if rank == 0:
        calls.append(["log", 0])  # world_size, at the step the run starts from
    step = 0
    for epoch in range(epochs):
        calls.append(["epoch_start", epoch])
        window = None  # a check point's window is logged at the next one (or epoch end)
        for _ in range(steps_per_epoch):
            step += 1
            calls.append(["train_step_end", step, "Tensor", []])
            if step % log_every == 0:
                if rank == 0 and window is not None:
                    calls.append(["log", window])
                window = step
        if rank == 0:
            if window is not None:
                calls.append(["log", window])
            calls.append(["log", step])  # the epoch's metrics, after validation
        calls.append(["epoch_end", epoch])
    calls.append(["run_end", "completed"])
    return calls


def test_hooks_fire_in_the_documented_order_on_the_documented_ranks(recorder):
    run(recorder, "epochs=2", "--nproc", "2", "--recorder-tag", "hello", check=True)
    for rank in (0, 1):
        calls = read(recorder / "calls" / f"rank{rank}.jsonl")
        # Metric names are checked below; the order and arguments here.
        shape = [c[:2] if c[0] in ("log", "epoch_end") else c for c in calls]
        # 256 samples, global batch 32 over 2 processes: 8 steps an epoch; log_every=2.
        assert shape == expected_calls(rank, epochs=2, steps_per_epoch=8, log_every=2)
    logs = [c for c in read(recorder / "calls" / "rank0.jsonl") if c[0] == "log"]
    assert logs.pop(0)[2] == ["world_size"]  # the names; at step 0, as the run starts
    assert "train/loss" in logs[0][2] and "val/accuracy" not in logs[0][2]
    assert {"train/epoch_loss", "val/loss", "val/accuracy"} <= set(logs[4][2])
    assert "train/loss" not in logs[4][2]  # one name, one meaning: that is a window's
    epoch_end = [c for c in read(recorder / "calls" / "rank1.jsonl") if c[0] == "epoch_end"]
    assert epoch_end[0][2] == logs[4][2]  # every rank gets the epoch's metrics

    # Registration: once per hook in every process (the CLI and the two workers).
    registrations = sorted(recorder.joinpath("calls").glob("register-*.jsonl"))
    assert len(registrations) == 3
    for path in registrations:
        assert read(path) == [["launchers", "launcher"], ["parallel", "parallel mode"],
                              ["checkpointers", "checkpointer"]]


def test_a_failing_run_fires_exception_then_run_end(recorder):
    proc = run(recorder, "epochs=1", "--nproc", "1", "--recorder-tag", "hello",
               RECORDER_FAIL_AT_STEP="5")
    assert proc.returncode != 0
    assert "RuntimeError: recorder fails at step 5" in proc.stderr
    calls = read(recorder / "calls" / "rank0.jsonl")
    # The processes training from step 0 are logged first (world_size); step 2's window is
    # logged at the check point of step 4; step 4's was in flight.
    assert calls == [
        ["run_start", 0, "hello"], ["log", 0, ["world_size"]], ["epoch_start", 0],
        *[["train_step_end", step, "Tensor", []] for step in (1, 2, 3, 4)],
        ["log", 2, calls[7][2]], ["train_step_end", 5, "Tensor", []],
        ["exception", "RuntimeError", "recorder fails at step 5"], ["run_end", "failed"]]


def documented_order() -> list[str]:
    """The hooks named in docs/plugins.md's "Hooks in the order they fire" block, in
    order (``engine_register_launchers / _parallel``: both registrations)."""
    from tests.conftest import REPO

    text = (REPO / "docs" / "plugins.md").read_text()
    block = text.split("## Hooks in the order they fire", 1)[1].split("```text\n", 1)[1]
    names = []
    for line in block.split("```", 1)[0].splitlines():
        first = re.match(r"\s*(engine_[a-z_]+)((?:\s*/\s*_[a-z_]+)*)", line)
        if first:
            stem = re.match(r"engine_[a-z]+", first.group(1)).group(0)  # engine_register
            names += [first.group(1)] + [stem + tail for tail in
                                         re.findall(r"/\s*(_[a-z_]+)", first.group(2))]
    return names


def test_the_one_written_order_names_every_hook():
    """The order is written once (docs/plugins.md; engine/hookspecs.py points there): it
    names every hook of engine/hookspecs.py and nothing else."""
    import engine.hookspecs as specs

    hooks = {name for name in dir(specs) if name.startswith("engine_")}
    assert set(documented_order()) == hooks
