"""examples/custom_loop.py: a hand-written loop that gets DDP, resume and rank-0 output
from the library API with about ten changed lines, run as a user runs it."""

from __future__ import annotations

import ast
import difflib
import pathlib
import re
import subprocess

import pytest

from engine.testing import run_python
from tests.conftest import BIN, REPO, engine_env, read_summary

BEFORE = REPO / "examples" / "custom_loop_before.py"
AFTER = REPO / "examples" / "custom_loop.py"


def code_lines(path: pathlib.Path) -> list[str]:
    """The file without its module docstring, blank lines dropped."""
    text = path.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno
    return [line for line in text.splitlines()[docstring_end:] if line.strip()]


def run(*args: str, cwd, launcher: tuple[str, ...] = (), **env: str):
    """``python ARGS`` forked from a warm interpreter (engine.testing.run_python: the
    script runs as it would in a new one, minus the start), or ``LAUNCHER ARGS``."""
    if launcher:
        proc = subprocess.run([*launcher, *args], cwd=cwd, env=engine_env(**env), text=True,
                              capture_output=True, timeout=300)
    else:
        proc = run_python(args, cwd=cwd, env=engine_env(**env), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_loop_changes_by_at_most_ten_lines():
    diff = list(difflib.unified_diff(code_lines(BEFORE), code_lines(AFTER), lineterm="", n=0))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    assert len(added) <= 10 and len(removed) <= 10, "\n".join(diff)
    assert "+import engine" in added


def test_the_loop_before_is_a_working_single_process_loop(tmp_path):
    proc = run(str(BEFORE), "--epochs", "1", cwd=tmp_path)
    assert re.fullmatch(r"epoch 0: loss \d\.\d{4}\n", proc.stdout)


@pytest.mark.slow
def test_after_two_processes_resume_and_torchrun_give_the_same_weights(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    # Two processes (spawned), one epoch; the output comes from rank 0 only.
    first = run(str(AFTER), "--epochs", "1", cwd=tmp_path / "a")
    assert re.fullmatch(r"epoch 0: loss \d\.\d{4}\n(done: .*\n)?", first.stdout)
    out = tmp_path / "a" / "runs" / "custom_loop"
    one_epoch = read_summary(out)
    assert (one_epoch["world_size"], one_epoch["parallel"], one_epoch["global_step"]) == (
        2, "ddp", 32)  # 2048 samples, global batch 64
    assert len(set(one_epoch["weights_sha256_per_rank"])) == 1

    # The same command with more epochs continues from the snapshot (its workers forked
    # rather than spawned, to save their start: the weights must not tell)...
    second = run(str(AFTER), "--epochs", "2", cwd=tmp_path / "a",
                 ENGINE_START_METHOD="fork")
    assert "ENGINE_START_METHOD" not in second.stderr  # forked: no fall-back warning
    assert second.stdout.splitlines()[0] == (
        "resuming from runs/custom_loop/checkpoints/snapshot-e0001-s00000032.pt: "
        "the end of epoch 1, step 32")
    assert "epoch 0:" not in second.stdout and "epoch 1: loss" in second.stdout
    # ...and ends exactly where an uninterrupted run does.
    run(str(AFTER), "--epochs", "2", cwd=tmp_path / "b", ENGINE_START_METHOD="fork")
    assert (read_summary(out)["weights_sha256"] ==
            read_summary(tmp_path / "b" / "runs" / "custom_loop")["weights_sha256"])

    # Under torchrun the script adopts torchrun's two workers: same world, same weights.
    run("--nproc-per-node", "2", str(AFTER), "--epochs", "1", cwd=tmp_path / "c",
        launcher=(str(BIN / "torchrun"),))
    adopted = read_summary(tmp_path / "c" / "runs" / "custom_loop")
    assert (adopted["status"], adopted["launcher"], adopted["world_size"]) == (
        "completed", "torchrun", 2)
    assert adopted["weights_sha256"] == one_epoch["weights_sha256"]
