"""engine/launching.py: the launch layer under engine-run, engine.launch and engine.fit;
engine.fit trains a recipe from Python, in this process or in spawned workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import types

import attrs
import pytest

import engine
from engine.config import TrainConfig
from engine.errors import ConfigError, EngineError, PluginCodeError, PluginError
from engine.launching import (ENGINE_RUN, FIT, Door, Launch, RecipeJob, launch_options,
                              report_worker_error)
from engine.testing import fit, make_plugin_manager, run_python  # noqa: F401
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
             "train_step", "eval_step")
    return types.SimpleNamespace(__name__="regression_object",
                                 **{n: getattr(tiny_regression, n) for n in names})


@pytest.mark.parametrize("given", ["path", "module", "object"])
def test_fit_trains_in_this_process_as_engine_run_does(tmp_path, engine_run_summary, given):
    recipe = {"path": str(RECIPE), "module": tiny_regression, "object": as_object()}[given]
    built_in = []
    if given == "object":
        def build_model(cfg):
            built_in.append(os.getpid())
            return tiny_regression.build_model(cfg)

        recipe.build_model = build_model
    summary = fit(recipe, nproc=1, out_dir=str(tmp_path / "run"), **RUN)
    if given == "object":
        assert built_in == [os.getpid()]  # the Trainer ran here: no process was started
    # What summary.json holds, and the run's folder.
    assert summary == {**read_summary(tmp_path / "run"), "out_dir": str(tmp_path / "run")}
    assert summary.keys() - {"out_dir"} == engine_run_summary.keys()
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    # The same recipe, config and seed: the same weights as engine-run's.
    assert summary["weights_sha256"] == engine_run_summary["weights_sha256"]
    assert summary["recipe"] == (str(RECIPE) if given != "object" else "regression_object")


def test_fit_takes_a_plugin_object_as_a_callback(tmp_path):
    class StepCounter:  # what the Hugging Face Trainer would take as a callback
        steps: list = []

        @engine.hookimpl
        def engine_train_step_end(self, engine, step, loss, ctx):
            self.steps.append(step)

    counter = StepCounter()
    summary = fit(RECIPE, nproc=1, out_dir=str(tmp_path / "run"), plugins=[counter],
                  epochs=1)
    assert counter.steps == list(range(1, summary["global_step"] + 1))


def test_fit_resumes_and_refuses_a_fresh_start_over_a_run(tmp_path):
    out = str(tmp_path / "run")
    fit(RECIPE, nproc=1, out_dir=out, epochs=1)
    summary = fit(RECIPE, nproc=1, out_dir=out, epochs=2)
    assert summary["resumed_from"] and summary["epochs_completed"] == 2
    with pytest.raises(ConfigError, match=r"engine.fit\(resume=False\): .* holds a run .*; "
                                          "pass overwrite=True to delete it first"):
        fit(RECIPE, nproc=1, out_dir=out, resume=False)
    fresh = fit(RECIPE, nproc=1, out_dir=out, resume=False, overwrite=True, epochs=1)
    assert fresh["resumed_from"] is None and fresh["global_step"] == 8


@pytest.mark.parametrize("overrides, message", [
    ({"epochz": 3}, "unknown config key 'epochz'; did you mean 'epochs'?"),
    ({"epochs": "three"}, "config key 'epochs': 'three' is not"),
    ({"checkpoint.keep_lats": 1}, "unknown config key 'checkpoint.keep_lats' ('checkpoint' "
                                  "has no field 'keep_lats'); did you mean"),
])
def test_a_bad_override_is_engine_runs_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        fit(RECIPE, nproc=1, out_dir=str(tmp_path), **overrides)
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
        fit(recipe, nproc=1, out_dir=str(tmp_path))
    assert read_summary(tmp_path)["status"] == "failed"
    # It trained nothing: a fresh start in the folder is not refused as over a run.
    assert fit(RECIPE, nproc=1, out_dir=str(tmp_path), resume=False,
               epochs=1)["status"] == "completed"


POSITIVE = "must be a positive int, or None (default: "


@pytest.mark.parametrize("given, message", [
    ({"nproc": "two"}, f"engine.fit(nproc='two'): nproc {POSITIVE}"),
    ({"nproc": 0}, f"engine.fit(nproc=0): nproc {POSITIVE}"),
    ({"threads": 0}, f"engine.fit(threads=0): threads {POSITIVE}"),
    ({"threads": -3}, f"engine.fit(threads=-3): threads {POSITIVE}"),
    ({"resume": 42}, "engine.fit(resume=42): resume must be True (the newest snapshot in "
                     "out_dir), False (start fresh) or the path of a snapshot"),
    ({"resume": "no/such.pt"}, "engine.fit(resume='no/such.pt'): no such snapshot"),
])
def test_a_bad_argument_is_one_line_before_any_worker_starts(tmp_path, given, message):
    out = tmp_path / "run"
    with pytest.raises(EngineError) as info:
        fit(RECIPE, **{"nproc": 2, **given}, out_dir=str(out), epochs=1)
    assert str(info.value).startswith(message), info.value
    assert not out.exists()  # no worker started: not even the lock's folder was made


def test_fit_gives_the_caller_its_threads_back_and_each_call_its_own_clock(tmp_path, capsys):
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)  # the caller's own, not torch's default
    try:
        fit(RECIPE, nproc=1, threads=1, out_dir=str(tmp_path / "a"), epochs=1)
        assert torch.get_num_threads() == before + 1
        capsys.readouterr()
        start = time.perf_counter()
        fit(RECIPE, nproc=1, out_dir=str(tmp_path / "b"), epochs=1)
        took = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    # The second call's time, from its own start: not from the first call's.
    total, start_up = map(float, re.fullmatch(
        rf"done: 1 epoch in ([\d.]+)s \(start-up ([\d.]+)s\), results in "
        rf"{re.escape(str(tmp_path / 'b'))}", done[0]).groups())
    assert start_up <= total <= took + 0.05, (done, took)
    # A third call resumes the first run for one more epoch: its done: line counts the
    # run's epochs and says where this call began.
    fit(RECIPE, nproc=1, out_dir=str(tmp_path / "a"), epochs=2)
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert re.fullmatch(r"done: 2 epochs \(resumed at step \d+\) in [\d.]+s \(start-up "
                        r"[\d.]+s; [\d.]+s over 2 segments\), results in .*", done[0]), done


def test_a_misspelt_argument_of_fit_is_named_as_the_argument(tmp_path):
    with pytest.raises(ConfigError) as info:
        fit(RECIPE, nprocs=2, out_dir=str(tmp_path / "run"), epochs=1)
    assert str(info.value) == ("engine.fit(nprocs=2): 'nprocs' is neither an argument of "
                               "engine.fit nor a config key; did you mean the argument "
                               "nproc=2?")
    assert not (tmp_path / "run").exists()


def test_fit_from_a_script_on_stdin_is_one_line_before_any_worker_starts(tmp_path):
    script = SCRIPT.replace("sys.argv[1]", repr(str(RECIPE))).replace(
        "sys.argv[2]", repr(str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, "-"], input=script, cwd=tmp_path, timeout=120,
                          env=conftest.engine_env(), capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "engine.errors.ConfigError: engine.fit: the main script was read from <stdin>, not "
        "a file, and spawned workers import it: use nproc=1 (trains in this process) or "
        "run the script from a file")
    assert "multiprocessing" not in proc.stderr and not (tmp_path / "run").exists()


def test_engine_run_checks_resume_path_before_any_worker_starts(tmp_path):
    out, missing = tmp_path / "run", str(tmp_path / "nope.pt")
    proc = run_cli(str(RECIPE), f"out_dir={out}", "--nproc", "2", "--resume", missing)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"engine-run: error: --resume {missing!r}: no such snapshot"]
    assert not out.exists()


SCRIPT = """
import json, sys
import engine

if __name__ == "__main__":
    summary = engine.fit(sys.argv[1], nproc=2, out_dir=sys.argv[2], epochs=2,
                         **{"checkpoint.memory_every_steps": 0})  # not auto's clock
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
    assert summary == {**read_summary(tmp_path / "run"), "out_dir": str(tmp_path / "run")}
    assert summary.keys() - {"out_dir"} == engine_run_summary.keys()
    assert (summary["world_size"], summary["status"]) == (2, "completed")


@pytest.mark.clock  # the docs' example verbatim, auto's interval included (the weights
# and the status it asserts are the same at any interval)
@pytest.mark.parametrize("document", ["docs/library.md", "README.md"])
def test_the_fit_examples_run(tmp_path, document):
    text = (REPO / document).read_text()
    block = text.split("# train.py: python train.py\n", 1)[1].split("```", 1)[0]
    assert '"recipes/cifar_ddp.py"' in block
    script = textwrap.dedent(block).replace('"recipes/cifar_ddp.py"', repr(str(RECIPE)))
    (tmp_path / "train.py").write_text(script)
    proc = run_python([str(tmp_path / "train.py")], cwd=tmp_path, check=True,
                      env=conftest.engine_env(ENGINE_START_METHOD="fork"))
    summary = read_summary(tmp_path / "runs" / "tiny_regression")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    status, digest = proc.stdout.splitlines()[-1].split()[:2]  # what the example prints
    assert status == "completed" and summary["weights_sha256"].startswith(digest)


def test_an_unguarded_script_is_one_line(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.replace('if __name__ == "__main__":\n    ', "if True:\n    "))
    proc = run_python([str(script), str(RECIPE), str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode != 0
    assert (f"engine.fit: {script} starts workers at import time; spawned workers import "
            "unguarded.py again, so put the call under `if __name__ == \"__main__\":`"
            ) in proc.stderr, proc.stderr


# ------------------------------------------------- the set-up, once for every door


def test_the_config_gets_out_dirs_default_and_its_components_are_checked(
        make_plugin_manager):
    pm = make_plugin_manager()
    assert RecipeJob((), {}, recipe=str(RECIPE)).configure(pm).out_dir == \
        "runs/tiny_regression"
    assert RecipeJob((), {}, recipe=str(RECIPE),
                     overrides=("out_dir=elsewhere",)).configure(pm).out_dir == "elsewhere"
    for key, message in [("launcher", "launcher 'nope' is not available"),
                         ("parallel", "parallel mode 'nope' is not available"),
                         ("checkpointer", "checkpointer 'nope' is not available")]:
        with pytest.raises(PluginError, match=message):
            Launch(RecipeJob((), {}, recipe=str(RECIPE), overrides=(f"{key}=nope",)), pm)


def test_a_single_process_mode_starts_one_process(make_plugin_manager):
    pm = make_plugin_manager()
    assert launch_options(pm, TrainConfig(parallel="dp"), {}).nproc == 1
    assert launch_options(pm, TrainConfig(parallel="ddp"), {}).nproc is None
    assert launch_options(pm, TrainConfig(parallel="single"),
                          {"nproc": 3}).nproc == 3  # what the user asked for


DOOR = Door("door", fresh_start="door(fresh)", overwrite="say overwrite",
            start_over="door(again)")


def test_a_fresh_start_is_refused_in_the_doors_words(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    fresh = {"no_resume": True, "overwrite": False, "nproc": 2}
    job = RecipeJob((), fresh, door=DOOR, recipe=str(RECIPE),
                    overrides=(f"out_dir={tmp_path}",))
    with pytest.raises(ConfigError) as err:
        Launch(job)
    assert str(err.value).startswith(f"door(fresh): {tmp_path} holds a run (summary.json); "
                                     "say overwrite to delete it first")
    allowed = attrs.evolve(job, options={**fresh, "overwrite": True})
    assert [w.rank for w in Launch(allowed).worlds] == [0, 1]


class BrokenLauncherPlugin:
    """A launcher whose own code fails."""

    class Broken(engine.Launcher):
        name = "broken"

        def worlds(self):
            return [].pop()

    @engine.hookimpl
    def engine_register_launchers(self, registry):
        registry.add(self.Broken)


@pytest.mark.parametrize("door", [ENGINE_RUN, FIT])
def test_an_error_in_a_launchers_code_names_the_plugin(make_plugin_manager, door):
    pm = make_plugin_manager(BrokenLauncherPlugin())
    job = RecipeJob((), {}, door=door, recipe=str(RECIPE), overrides=("launcher=broken",))
    with pytest.raises(PluginCodeError, match="launcher 'broken'.*IndexError: pop from "
                                              "empty list"):
        Launch(job, pm)


# ------------------------------------------------------------ the worker's end


def test_a_worker_error_is_printed_with_its_rank(capsys):
    report_worker_error(3, ConfigError("config key 'lr': 0 must be > 0"))
    assert capsys.readouterr().err == "[rank 3] error: config key 'lr': 0 must be > 0\n"
    try:
        raise ValueError("the recipe's own bug")
    except ValueError as exc:  # the recipe's own code: its traceback, every line marked
        report_worker_error(1, exc)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[rank 1] Traceback (most recent call last):"
    assert lines[-1] == "[rank 1] ValueError: the recipe's own bug"
    assert all(line.startswith("[rank 1] ") for line in lines)


def test_a_library_door_raises_in_process_where_engine_run_exits(tmp_path, capsys):
    recipe = as_object()

    def build_model(cfg):
        raise ValueError("no model today")

    recipe.build_model = build_model
    job = RecipeJob((), {"nproc": 1}, door=FIT, recipe=recipe,
                    overrides=(f"out_dir={tmp_path}",))
    # One worker, in this process: a library caller gets the recipe's exception itself
    # (it passed through the spawn plugin's frames, but is not that plugin's doing)...
    with pytest.raises(ValueError, match="no model today"):
        Launch(job).start()
    # ...engine-run's worker prints it, marked with the rank, and exits with its code.
    with pytest.raises(SystemExit) as exited:
        Launch(attrs.evolve(job, door=ENGINE_RUN)).start()
    assert exited.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[rank 0] Traceback (most recent call last):"
    assert err[-1] == "[rank 0] ValueError: no model today"


def test_a_finished_run_says_how_to_start_over_in_fits_words(tmp_path, capsys):
    out = tmp_path / "run"
    done = fit(RECIPE, nproc=1, out_dir=str(out), epochs=1)
    capsys.readouterr()
    again = fit(RECIPE, nproc=1, out_dir=str(out), epochs=1)
    assert again["weights_sha256"] == done["weights_sha256"]
    assert (done["status"], again["status"]) == ("completed", "already_complete")
    assert (f"already complete: {out} holds a finished run of 1 epoch (asked for 1), "
            "nothing to train; to train on, ask for more (epochs=2 or more); to start over, "
            "use engine.fit(..., resume=False, overwrite=True) or another out_dir"
            ) in capsys.readouterr().out


@pytest.fixture
def signal_handlers():
    """The pre-emption signals' handlers put back after the test: a pre-empted run
    leaves its process ignoring them (it is on its way out)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_preempted_fit_returns_its_summary_and_the_next_one_resumes(
        tmp_path, monkeypatch, signal_handlers, capsys):
    out = tmp_path / "run"
    # SIGUSR1 to this process after step 3, as SLURM's warning before the time limit.
    monkeypatch.setenv("ENGINE_FAULT_ACTION", "signal")
    monkeypatch.setenv("ENGINE_FAULT_STEP", "3")
    monkeypatch.setenv("ENGINE_FAULT_ONCE", str(tmp_path / "signalled"))
    fault = ["tests.fault_plugin"]
    preempted = fit(RECIPE, nproc=1, out_dir=str(out), plugins=fault, requeue=False)
    assert preempted["status"] == "preempted" == read_summary(out)["status"]
    # Mid-epoch (8 steps): the flag is read a few steps after the signal.
    assert preempted["epochs_completed"] == 0 and 3 <= preempted["global_step"] < 8
    assert "pre-empted by SIGUSR1: snapshot written" in capsys.readouterr().err
    resumed = fit(RECIPE, nproc=1, out_dir=str(out), plugins=fault, requeue=False,
                  epochs=2)
    assert (resumed["status"], resumed["epochs_completed"]) == ("completed", 2)
    assert resumed["resumed_from"].endswith(f"s{preempted['global_step']:08d}.pt")
