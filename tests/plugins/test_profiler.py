"""plugins/profiler.py: profile.steps records those optimizer steps in a trace that
Perfetto, chrome://tracing and TensorBoard's profiler plugin read, with the engine's
phases as named ranges; bad windows are one line."""

from __future__ import annotations

import json

import pytest

from engine.plugins.profiler import parse_steps
from tests import conftest
from tests.conftest import REPO, run_cli, run_cli_here

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
# 96 samples, global batch 16: 6 optimizer steps an epoch, steps 0 to 5.
ONE_EPOCH = ("epochs=1", "log_every=1", "checkpoint.every_steps=3")
RANGES = {"engine: data wait", "engine: forward/backward", "engine: optimizer step",
          "engine: check point", "engine: snapshot"}


def test_a_window_is_start_and_end_with_end_excluded():
    assert parse_steps("2:4") == (2, 4)
    assert parse_steps("0:1") == (0, 1)
    assert parse_steps("") is None


@pytest.mark.parametrize("steps, message", [
    ("4:2", "'4:2' is not allowed: START must be >= 0 and END above START, e.g. 4:6"),
    ("-1:3", "START must be >= 0 and END above START"),
    ("3", "'3' is not allowed: give START:END, the optimizer steps to record counted from "
     "0 with END excluded, e.g. 2:4 for steps 2 and 3"),
    ("a:b", "give START:END"),
])
def test_a_bad_window_is_one_line_before_anything_starts(tmp_path, steps, message):
    proc = run_cli_here(RECIPE, f"profile.steps={steps}", f"out_dir={tmp_path}", "--dry-run")
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.count("\n") == 1 and "config key 'profile.steps'" in proc.stderr
    assert message in proc.stderr, proc.stderr


def test_a_window_past_the_runs_last_step_names_how_many_steps_the_run_has(tmp_path):
    proc = run_cli(RECIPE, "epochs=1", "profile.steps=4:9", f"out_dir={tmp_path}",
                   "--nproc", "1")
    assert proc.returncode == 2
    assert ("config key 'profile.steps': '4:9' ends beyond the run: it takes 6 optimizer "
            "steps (0 to 5); choose END <= 6") in proc.stderr.splitlines()[-1], proc.stderr


def spans(trace) -> list[dict]:
    """The complete events ("X") of the steps and the engine's ranges, by start time."""
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and (
        e["name"].startswith("ProfilerStep#") or e["name"] in RANGES)),
        key=lambda e: e["ts"])


def test_two_ranks_trace_the_chosen_steps_with_the_engines_phases_as_ranges(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(RECIPE, *ONE_EPOCH, "profile.steps=2:4", "profile.ranks=all",
                   f"out_dir={out}", "--nproc", "2", check=True)
    folder = out / "profile" / "steps2-4"
    # TensorBoard needs its profiler plugin for a trace: the line says so.
    assert (f"profiler: steps 2 to 3 traced in {folder} (open with https://ui.perfetto.dev, "
            f"or tensorboard --logdir {folder.parent} after pip install torch-tb-profiler)"
            ) in proc.stdout.splitlines()
    # tensorboard_trace_handler's layout: <run folder>/<worker>.<ns>.pt.trace.json
    files = sorted(folder.glob("*.pt.trace.json"))
    assert [f.name.split(".")[0] for f in files] == ["rank0", "rank1"], files
    for path in files:
        events = spans(json.loads(path.read_text()))
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3"]
        inside = [e for e in events if e not in steps]
        # Every range lies inside a recorded step: the warm-up step left nothing.
        assert all(any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                       for s in steps) for e in inside), path
        names = [e["name"] for e in inside]
        assert set(names) == RANGES, path
        # One micro-batch a step: a fetch, forward/backward and a step each; a check
        # point after every step (log_every=1), the snapshot after step 2 (every_steps=3).
        for name in ("engine: data wait", "engine: forward/backward",
                     "engine: optimizer step", "engine: check point"):
            assert names.count(name) == 2, (path, names)
        assert names.count("engine: snapshot") == 1
        snapshot = next(e for e in inside if e["name"] == "engine: snapshot")
        assert steps[1]["ts"] <= snapshot["ts"]  # it follows step 2: it opens step 3


def test_a_run_that_fails_inside_the_window_keeps_the_steps_it_recorded(tmp_path):
    out = tmp_path / "run"
    fault = conftest.engine_env(ENGINE_FAULT_ACTION="raise", ENGINE_FAULT_STEP="3")
    proc = run_cli(RECIPE, *ONE_EPOCH, "profile.steps=1:5", f"out_dir={out}", "--nproc",
                   "1", "-p", "tests.fault_plugin", env=fault)
    assert proc.returncode == 1 and "injected failure" in proc.stderr, proc.stderr
    assert "profiler: steps 1 to 2 traced in" in proc.stdout, proc.stdout
    (path,) = (out / "profile" / "steps1-5").glob("rank0.*.pt.trace.json")
    steps = [e["name"] for e in spans(json.loads(path.read_text()))
             if e["name"].startswith("ProfilerStep#")]
    assert steps[:2] == ["ProfilerStep#1", "ProfilerStep#2"], steps
