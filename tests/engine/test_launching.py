"""engine/launching.py: the launch layer under engine-run, engine.launch and engine.fit;
engine.fit trains a recipe from Python, in this process or in spawned workers."""

from __future__ import annotations

import json
import types

import pytest

import engine
from engine.errors import ConfigError
from engine.testing import run_python
from tests import conftest
from tests.conftest import REPO, read_summary, run_cli
from tests.recipes import tiny_regression

RECIPE = REPO / "tests" / "recipes" / "tiny_regression.py"
RUN = {"epochs": 2, "checkpoint.every_epochs": 1}


@pytest.fixture(scope="module")
def engine_run_summary(tmp_path_factory) -> dict:
    """summary.json of `engine-run` on the same recipe and config, one process."""
    out = tmp_path_factory.mktemp("engine-run")
    run_cli(str(RECIPE), "epochs=2", f"out_dir={out}", "--nproc", "1", check=True)
    return read_summary(out)


def as_object():
    """The recipe as a plain object with its attributes (no file, no module)."""
    names = ("Config", "build_model", "build_datasets", "build_optimizer", "loss_fn",
             "eval_step")
    return types.SimpleNamespace(__name__="regression_object",
                                 **{n: getattr(tiny_regression, n) for n in names})


@pytest.mark.parametrize("given", ["path", "module", "object"])
def test_fit_trains_in_this_process_as_engine_run_does(tmp_path, engine_run_summary, given):
    recipe = {"path": str(RECIPE), "module": tiny_regression, "object": as_object()}[given]
    summary = engine.fit(recipe, nproc=1, out_dir=str(tmp_path / "run"), **RUN)
    assert summary == read_summary(tmp_path / "run")  # what summary.json holds
    assert summary.keys() == engine_run_summary.keys()
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    # The same recipe, config and seed: the same weights as engine-run's.
    assert summary["weights_sha256"] == engine_run_summary["weights_sha256"]
    assert summary["recipe"] == (str(RECIPE) if given != "object" else "regression_object")


def test_fit_resumes_and_refuses_a_fresh_start_over_a_run(tmp_path):
    out = str(tmp_path / "run")
    engine.fit(RECIPE, nproc=1, out_dir=out, epochs=1)
    summary = engine.fit(RECIPE, nproc=1, out_dir=out, epochs=2)
    assert summary["resumed_from"] and summary["epochs_completed"] == 2
    with pytest.raises(ConfigError, match=r"engine.fit\(resume=False\): .* holds a run .*; "
                                          "pass overwrite=True to delete it first"):
        engine.fit(RECIPE, nproc=1, out_dir=out, resume=False)
    fresh = engine.fit(RECIPE, nproc=1, out_dir=out, resume=False, overwrite=True, epochs=1)
    assert fresh["resumed_from"] is None and fresh["global_step"] == 8


@pytest.mark.parametrize("overrides, message", [
    ({"epochz": 3}, "unknown config key 'epochz'; did you mean 'epochs'?"),
    ({"epochs": "three"}, "config key 'epochs': 'three' is not"),
    ({"checkpoint.keep_lats": 1}, "unknown config key 'checkpoint.keep_lats' ('checkpoint' "
                                  "has no field 'keep_lats'); did you mean"),
])
def test_a_bad_override_is_engine_runs_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        engine.fit(RECIPE, nproc=1, out_dir=str(tmp_path), **overrides)
    cli = run_cli(str(RECIPE), *[f"{k}={v}" for k, v in overrides.items()],
                  f"out_dir={tmp_path}", "--nproc", "1")
    assert message in str(info.value)
    assert f"error: {info.value}" in cli.stderr  # word for word engine-run's


def test_an_error_in_this_process_reaches_the_caller_as_the_exception(tmp_path):
    recipe = as_object()

    def build_model(cfg):
        raise ValueError("no model today")

    recipe.build_model = build_model
    with pytest.raises(ValueError, match="no model today"):
        engine.fit(recipe, nproc=1, out_dir=str(tmp_path))
    assert read_summary(tmp_path)["status"] == "failed"


SCRIPT = """
import json, sys
import engine

if __name__ == "__main__":
    summary = engine.fit(sys.argv[1], nproc=2, out_dir=sys.argv[2], epochs=2)
    print("SUMMARY " + json.dumps(summary), flush=True)
"""


def test_fit_spawns_two_processes_from_a_guarded_script(tmp_path, engine_run_summary):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = run_python(
        [str(script), str(RECIPE), str(tmp_path / "run")], cwd=tmp_path, check=True,
        env=conftest.engine_env(ENGINE_START_METHOD="fork"))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("SUMMARY "))
    summary = json.loads(line[len("SUMMARY "):])
    assert summary == read_summary(tmp_path / "run")
    assert summary.keys() == engine_run_summary.keys()
    assert (summary["world_size"], summary["status"]) == (2, "completed")


def test_the_library_guides_fit_example_runs(tmp_path):
    guide = (REPO / "docs" / "library.md").read_text()
    block = guide.split("# train.py: python train.py\n", 1)[1].split("```", 1)[0]
    assert '"recipes/cifar_ddp.py"' in block
    (tmp_path / "train.py").write_text(block.replace('"recipes/cifar_ddp.py"', repr(str(RECIPE))))
    proc = run_python([str(tmp_path / "train.py")], cwd=tmp_path, check=True,
                      env=conftest.engine_env(ENGINE_START_METHOD="fork"))
    status, digest, _ = proc.stdout.split()[-3:]
    assert status == "completed"
    summary = read_summary(tmp_path / "runs" / "tiny_regression")
    assert summary["weights_sha256"].startswith(digest) and summary["world_size"] == 2


def test_an_unguarded_script_is_one_line(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.replace('if __name__ == "__main__":\n    ', "if True:\n    "))
    proc = run_python([str(script), str(RECIPE), str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode != 0
    assert (f"engine.fit: {script} starts workers at import time; spawned workers import "
            "unguarded.py again, so put the call under `if __name__ == \"__main__\":`"
            ) in proc.stderr, proc.stderr
