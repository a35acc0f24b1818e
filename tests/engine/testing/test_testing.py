"""engine.testing, the pytest plugin for plugin authors: opt-in only, and its fixtures
work. Each case runs pytest in a subprocess on a test file written here, as a plugin
author's project would."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata

from engine.testing import write_distribution
from tests.conftest import engine_env

AUTHOR_TESTS = textwrap.dedent('''
    import attrs
    import pytest

    import engine
    from engine.testing import fire_run_end


    class Recorder:
        def __init__(self):
            self.calls = []

        @engine.hookimpl
        def engine_log(self, engine, metrics, step):
            self.calls.append(("log", step, metrics))

        @engine.hookimpl
        def engine_run_end(self, engine, summary):
            self.calls.append(("run_end", summary["status"]))


    def test_make_engine_and_call_hooks(make_engine, tmp_path):
        recorder = Recorder()
        eng = make_engine("epochs=3", plugins=[recorder, "no:console"])
        assert eng.cfg.epochs == 3 and eng.out_dir == tmp_path / "run"
        assert eng.is_rank0 and eng.world.world_size == 1
        eng.pm.hook.engine_log(engine=eng, metrics={"train/loss": 1.5}, step=2)
        summary = fire_run_end(eng, status="failed")
        assert summary["status"] == "failed" and summary["epochs_completed"] == 0
        assert recorder.calls == [("log", 2, {"train/loss": 1.5}), ("run_end", "failed")]


    @attrs.define
    class RecorderGroup:
        flush: bool = False


    class EveryOption:
        @engine.hookimpl
        def engine_addoption(self, parser):
            parser.add_argument("--recorder-every", type=int, default=3)

        @engine.hookimpl
        def engine_register_config_groups(self):
            return {"recorder": RecorderGroup}


    def test_make_engine_passes_plugin_options(make_engine):
        eng = make_engine(plugins=[EveryOption()])
        assert eng.options["recorder_every"] == 3
        assert eng.cfg.recorder.flush is False and eng.cfg.ddp is not None
        eng = make_engine("recorder.flush=true", plugins=[EveryOption()],
                          options={"recorder_every": 5})
        assert eng.options["recorder_every"] == 5 and eng.options["no_resume"] is False
        assert eng.cfg.recorder.flush is True
        with pytest.raises(ValueError, match="make_engine: 'recorder_evry' is not an "
                                             "option of engine-run or of a loaded plugin"):
            make_engine(plugins=[EveryOption()], options={"recorder_evry": 5})


    def test_installed_plugins_stay_out_unless_asked_for(make_plugin_manager):
        assert "noisy" not in make_plugin_manager().infos
        assert "noisy" in make_plugin_manager(autoload=True).infos
        assert "noisy" in make_plugin_manager("noisy").infos


    def test_tiny_recipe_runs_on_two_processes(run_recipe, tiny_recipe):
        run = run_recipe("epochs=1", recipe=tiny_recipe)
        assert run.returncode == 0
        summary = run.summary
        assert (summary["status"], summary["world_size"], summary["parallel"]) == (
            "completed", 2, "ddp")
        assert len(set(summary["weights_sha256_per_rank"])) == 1
        failed = run_recipe("epochs=0", check=False)
        assert failed.returncode == 2 and "'epochs': 0 is not allowed" in failed.stderr
''')


def run_pytest(project, *args):
    env = engine_env(PYTHONPATH=str(project / "site"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)


def make_project(tmp_path, conftest: str | None = None):
    """A plugin author's folder: the tests above, and an installed plugin "noisy"."""
    (tmp_path / "test_author.py").write_text(AUTHOR_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the root
    if conftest is not None:
        (tmp_path / "conftest.py").write_text(conftest)
    write_distribution(tmp_path / "site", "engine-noisy", "1.0", {"noisy": "noisy"},
                       files={"noisy.py": "def engine_log(engine, metrics, step):\n"
                                          "    print('noisy', step)\n"})
    return tmp_path


def test_the_engine_registers_no_pytest11_entry_point():
    groups = {ep.group for ep in metadata.distribution("ddp-engine").entry_points}
    assert "pytest11" not in groups


def test_without_opting_in_the_fixtures_do_not_exist(tmp_path):
    proc = run_pytest(make_project(tmp_path), "-k", "make_engine")
    assert proc.returncode == 1
    assert "fixture 'make_engine' not found" in proc.stdout


def test_opting_in_with_p_gives_fixtures_that_work(tmp_path):
    proc = run_pytest(make_project(tmp_path), "-p", "engine.testing")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 passed" in proc.stdout


def test_opting_in_with_pytest_plugins_in_conftest(tmp_path):
    project = make_project(tmp_path, conftest='pytest_plugins = ["engine.testing"]\n')
    proc = run_pytest(project, "-k", "not two_processes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout
