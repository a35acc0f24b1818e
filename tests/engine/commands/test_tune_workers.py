"""``engine-run tune-workers``: the measured table, the best setting, the override."""

from __future__ import annotations

import importlib.util
import os
import re
import threading
import time

import pytest

from engine.commands.tune_workers import (Measurement, Setting, default_workers,
                                          format_result)
from engine.loader_settings import choose
from engine.testing import descendants, named_semaphores
from engine.world import share_cpus
from tests.conftest import REPO, engine_env, run_cli

OCT_DDP = str(REPO / "recipes" / "oct_ddp.py")
TINY_RESUME = str(REPO / "tests" / "recipes" / "tiny_resume.py")
REGRESSION = str(REPO / "tests" / "recipes" / "tiny_regression.py")
ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d./]+)\s+(\d+)%(?:\s+<- (.*))?$")


@pytest.fixture(scope="module")
def oct_data(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_oct_dataset",
                                                  REPO / "tools" / "make_oct_dataset.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    root = tmp_path_factory.mktemp("oct")
    tool.generate(root, train=24, val=4, sizes=(48, 64))
    return root


def table(stdout: str) -> list[tuple[int, int, float, list[float], str]]:
    rows = []
    for line in stdout.splitlines():
        match = ROW.match(line)
        if match:
            per = [float(v) for v in match.group(4).split("/")]
            rows.append((int(match.group(1)), int(match.group(2)), float(match.group(3)),
                         per, match.group(6) or ""))
    return rows


def test_sweep_prints_the_table_the_best_setting_and_its_override(oct_data):
    proc = run_cli("tune-workers", OCT_DDP, f"data.root={oct_data}", "data.image_size=32",
                   "--workers", "0,1", "--batch-sizes", "12,24", "--budget", "0.5",
                   "--nproc", "2", check=True)
    out = proc.stdout
    assert ("tune-workers: oct_ddp.py, 2 process(es) on this node" in out
            and "measuring the training DataLoader (read, decode, augment, batch), 0.5s "
                "per setting" in out)
    rows = table(out)
    assert [(w, b) for w, b, *_ in rows] == [(0, 12), (1, 12), (0, 24), (1, 24)]
    for _, _, total, per_process, _ in rows:
        assert len(per_process) == 2 and all(r > 0 for r in per_process)
        assert total == pytest.approx(sum(per_process), abs=0.2)
    best = max(rows, key=lambda r: r[2])
    assert "best" in best[4] and sum("best" in r[4] for r in rows) == 1
    assert best[2] == max(r[2] for r in rows)
    assert f"best: num_workers={best[0]}, batch_size={best[1]}: {best[2]:.1f} samples/s" in out
    apply = f"apply it: engine-run {OCT_DDP} data.root={oct_data} data.image_size=32 " \
            f"num_workers={best[0]}" + (f" batch_size={best[1]}" if best[1] != 12 else "")
    assert out.rstrip().endswith(apply)
    # The engine's own choice on this machine is in the table, and compared with the best.
    assert re.search(r"the engine's auto choice, num_workers=\d+, reaches \d+% of it", out)


def test_the_sweeps_processes_hold_no_named_semaphores(oct_data):
    """A multiprocessing Queue or Barrier between the measuring processes is named
    semaphores (/dev/shm/sem.mp-*) that a sweep killed as a whole leaves behind: none may
    be mapped by any process of a running 2-process sweep (every process this test
    starts: the warm server, the command and its measuring processes). Spawned, as a
    user's are: with fork, multiprocessing unlinks its semaphores at once."""
    result = {}
    sweep = threading.Thread(target=lambda: result.update(proc=run_cli(
        "tune-workers", OCT_DDP, f"data.root={oct_data}", "data.image_size=32", "--workers",
        "0", "--budget", "1", "--nproc", "2", env=engine_env(ENGINE_START_METHOD="spawn"))))
    sweep.start()
    most, named = 0, set()
    while sweep.is_alive():
        pids = descendants(os.getpid())
        most = max(most, len(pids))
        named |= named_semaphores(pids)
        time.sleep(0.1)
    sweep.join()
    assert result["proc"].returncode == 0, result["proc"].stderr
    assert most >= 3, most  # the command and its two measuring processes were seen
    assert named == set()


def test_full_step_measures_the_training_step_too():
    """The engine's classification train_step, in rounds. A tiny model: oct_ddp's
    ResNet-18 took 20 s here and proves nothing more about the command."""
    proc = run_cli("tune-workers", TINY_RESUME, "--workers", "0", "--budget", "0.5",
                   "--nproc", "1", "--full-step", "--rounds", "2", check=True)
    assert "with the recipe's train_step, backward and optimizer step" in proc.stdout
    assert "0.5s per setting, 2 rounds (medians)" in proc.stdout
    assert proc.stdout.count("  num_workers=0 batch_size=16: ") == 2  # one per round
    ((workers, batch, total, per_process, marks),) = table(proc.stdout)
    assert (workers, batch, len(per_process)) == (0, 16, 1) and total > 0
    assert "best" in marks


def test_full_step_is_the_trainers_step_with_its_non_finite_policy():
    """--full-step measures the step training runs (engine/step.py), accumulation and
    on_nonfinite included: a NaN sample's step is skipped, as the Trainer skips it."""
    proc = run_cli("tune-workers", REGRESSION, "nan_sample=0", "on_nonfinite=skip",
                   "grad_accum_steps=2", "--workers", "0", "--budget", "0.5", "--nproc",
                   "1", "--full-step", check=True)
    assert re.search(r"non-finite loss at step \d+: step skipped \(on_nonfinite=skip\)",
                     proc.stderr), proc.stderr
    ((workers, batch, total, per_process, marks),) = table(proc.stdout)
    assert total > 0 and "best" in marks


@pytest.mark.parametrize("recipe, overrides, unit", [
    # Dict batches, and the recipe's own steps.
    (REPO / "tests" / "recipes" / "tiny_dict_batch.py", (), "samples"),
    # The language model: its train_step, counted in its own unit.
    (REPO / "recipes" / "char_lm.py", ("data.max_chars=200000", "data.train_windows=256",
                                       "model.context=32", "model.width=32"), "tokens"),
])
def test_full_step_runs_the_recipes_own_train_step(recipe, overrides, unit):
    proc = run_cli("tune-workers", str(recipe), *overrides, "--workers", "0",
                   "--budget", "0.5", "--nproc", "1", "--full-step", check=True)
    ((workers, batch, total, per_process, marks),) = table(proc.stdout)
    assert total > 0 and "best" in marks
    assert re.search(rf"num_workers=0 batch_size=\d+: [\d.]+ {unit}/s", proc.stdout)
    assert re.search(rf"best: num_workers=0: [\d.]+ {unit}/s", proc.stdout), proc.stdout


def test_a_recipe_error_in_the_measuring_processes_is_one_line(tmp_path):
    proc = run_cli("tune-workers", OCT_DDP, "--workers", "0", "--budget", "0.5",
                   "--nproc", "2", timeout=240)
    assert proc.returncode == 2
    assert proc.stderr.startswith("engine-run: error: tune-workers, rank ")
    assert "data.root is required" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, message", [
    (("--batch-sizes", "13", "--nproc", "2"),
     "batch_size 13 (global) does not split evenly over 2 processes"),
    (("--budget", "0"), "--budget 0: give a number of seconds > 0"),
    (("--rounds", "0"), "--rounds 0: give an integer >= 1"),
])
def test_bad_options_stop_before_measuring(args, message):
    proc = run_cli("tune-workers", OCT_DDP, "data.root=/nowhere", *args, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_default_sweep_spans_the_cpus_and_includes_auto():
    assert default_workers(per_process_cpus=1, auto=1) == [0, 1, 2]
    assert default_workers(per_process_cpus=2, auto=1) == [0, 1, 2, 4]
    assert default_workers(per_process_cpus=15, auto=14) == [0, 1, 2, 4, 8, 14, 16]


def test_the_override_replaces_the_one_given():
    auto = choose("auto", cpus=share_cpus(2, "affinity", 2), device_type="cpu",
                  timeout_s=60)
    result = {"measurements": [Measurement(Setting(0, 12), 10.0, (5.0, 5.0)),
                               Measurement(Setting(1, 12), 15.0, (7.5, 7.5)),
                               Measurement(Setting(2, 12), 20.0, (10.0, 10.0))],
              "auto": auto, "recipe_batch_size": 12}
    text = format_result(result, "r.py", ["num_workers=0", "epochs=3"])
    assert text.endswith("apply it: engine-run r.py epochs=3 num_workers=2")
    assert "the engine's auto choice, num_workers=1, reaches 75% of it" in text
    lines = text.splitlines()
    assert lines[2].endswith("75%  <- auto") and lines[3].endswith("100%  <- best")
