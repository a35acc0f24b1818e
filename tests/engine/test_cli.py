"""engine-run's command line: options listed from the registries, the argument parsing,
error lines and exit codes (real ``engine-run`` subprocesses where the process's exit
is what is tested)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import attrs
import pytest

import engine
from engine.cli import build_parser, main, plugin_args, plugin_command
from engine.launching import RecipeJob
from engine.errors import (CheckpointError, ConfigError, EngineError, LaunchError,
                           PluginCodeError, PluginError, RunError, WorkerFailed, error_line,
                           exit_code, one_line)
from engine.parallel import Parallel
from engine.testing import install_plugin, make_plugin_manager, tiny_recipe  # noqa: F401
from tests.conftest import REPO, engine_env, read_summary, run_cli


class Sharded(Parallel):
    name = "sharded"


class ShardedPlugin:
    @engine.hookimpl
    def engine_register_parallel(self, registry):
        registry.add(Sharded)


def option_help(parser, dest: str) -> str:
    (action,) = [a for a in parser._actions if a.dest == dest]
    return action.help


# ------------------------------------------------------------ choices and --help


def test_component_options_list_what_the_registries_hold(make_plugin_manager):
    pm = make_plugin_manager(ShardedPlugin())
    parser = build_parser(pm)
    assert option_help(parser, "parallel") == (
        "one of: auto, ddp, ddp-multigpu, dp, fsdp, sharded, single (default: detect)")
    assert option_help(parser, "launcher") == (
        "one of: auto, legacy, slurm, spawn, torchrun (default: detect)")
    assert option_help(parser, "checkpointer") == (
        "one of: async, dcp, dcp-async, torch-file (default: torch-file)")
    assert "ShardedPlugin" in option_help(parser, "plugins")
    # Without a plugin manager (a parser built for parsing alone) nothing is listed.
    assert option_help(build_parser(), "parallel") == (
        "a registered parallel mode (default: detect)")


def test_help_lists_an_installed_plugins_components(install_plugin):
    env = engine_env(**install_plugin(REPO / "tests" / "sample_plugin"))
    proc = run_cli("--help", env=env, timeout=120, check=True)
    text = " ".join(proc.stdout.split())  # argparse wraps the help text
    assert "--parallel NAME one of: auto, ddp, ddp-fp16, ddp-multigpu, dp, fsdp, single" in text
    assert "csv-rows" in text.split("(loaded: ")[1].split(")")[0].split(", ")
    proc = run_cli("--help", "-p", "no:engine-csv-logger", env=env, timeout=120,
                   check=True)
    assert "ddp-fp16" not in proc.stdout


# ------------------------------------------------------------------ parsing


def test_plugin_args_are_read_before_the_full_parse():
    argv = ["recipe.py", "-p", "a.b", "-pno:console", "epochs=2", "--parallel", "dp"]
    assert plugin_args(argv) == ["a.b", "no:console"]


def test_flags_become_overrides_that_win_over_the_recipe():
    args = build_parser().parse_intermixed_args(
        ["r.py", "epochs=3", "--parallel", "dp", "lr=0.5", "--checkpointer", "dcp",
         "--nproc", "3", "-p", "no:console"])
    job = RecipeJob.from_args(args)
    assert job.recipe == "r.py"
    assert job.overrides == ("epochs=3", "lr=0.5", "parallel=dp", "checkpointer=dcp")
    assert job.plugins == ("no:console",)
    assert job.options["nproc"] == 3 and "recipe" not in job.options


# ------------------------------------------------------------ config groups


def test_a_config_file_applies_checked_overrides_and_the_command_line_wins(
        tiny_recipe, tmp_path, make_plugin_manager):
    pm = make_plugin_manager()
    config = tmp_path / "exp.toml"
    config.write_text('epochs = 3\nlr = 0.5\n[checkpoint]\nkeep_last = 1\n')

    def load(*argv):
        args = build_parser().parse_intermixed_args([str(tiny_recipe), *argv])
        return RecipeJob.from_args(args).load(pm)[1]

    cfg = load("--config", str(config), "epochs=4")
    assert (cfg.epochs, cfg.lr, cfg.checkpoint.keep_last) == (4, 0.5, 1)
    # The same one-line errors as key=value, naming the file.
    for text, message in [
            ("epoch = 3", "unknown config key 'epoch'; did you mean 'epochs'?"),
            ("samples = 'many'", "config key 'samples': 'many' is not an integer"),
            ("epochs = 0", "config key 'epochs': 0 is not allowed; it must be >= 1")]:
        config.write_text(text)
        with pytest.raises(ConfigError) as info:
            load("--config", str(config))
        assert str(info.value).startswith(f"--config {config}: {message}")
    assert load("--config", str(config), "epochs=2").epochs == 2  # the command line's
    with pytest.raises(ConfigError, match="^config key 'epochs': -1 is not allowed"):
        load("--config", str(config), "epochs=-1")  # not the file's fault


def test_version_prints_the_engine_and_torch_versions_without_importing_torch():
    from importlib import metadata

    code = ("import sys; from engine.cli import main; code = main(['--version']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=engine_env())
    assert proc.returncode == 0, proc.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    assert proc.stdout == (f"engine-run {engine.__version__} (torch "
                           f"{metadata.version('torch')}, Python {python})\n")


def test_the_ddp_options_are_the_ddp_plugins_config_group(cifar_recipe):
    proc = run_cli(cifar_recipe, "ddp.find_unused_parameters=true", "--dry-run",
                   timeout=120, check=True)
    assert "ddp.find_unused_parameters = True" in proc.stdout
    assert "ddp.bucket_cap_mb = 25.0" in proc.stdout
    # Without the plugin there is no such group: the usual one-line unknown-key error.
    proc = run_cli(cifar_recipe, "ddp.find_unused_parameters=true", "-p", "no:ddp",
                   "--dry-run", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("engine-run: error: unknown config key "
                           "'ddp.find_unused_parameters' (every key: engine-run RECIPE "
                           "--dry-run -v)\n")
    proc = run_cli(cifar_recipe, "ddp.find_unused=true", "--dry-run", timeout=120)
    assert proc.returncode == 2 and "did you mean 'ddp.find_unused_parameters'?" in (
        proc.stderr)


@attrs.define
class Extra:
    level: int = 1


class GroupPlugin:
    @engine.hookimpl
    def engine_register_config_groups(self):
        return {"extra": Extra}


def test_a_plugins_group_joins_the_config_and_survives_pickling(make_plugin_manager):
    from engine.config import TrainConfig, to_dict, with_groups
    from engine.overrides import apply_overrides

    pm = make_plugin_manager(GroupPlugin())
    assert pm.config_groups["extra"] is Extra and pm.config_group_owners["ddp"] == "ddp"
    assert pm.components_of("ddp") == {"parallel mode": ["ddp"], "config group": ["ddp"]}
    cfg = apply_overrides(with_groups(TrainConfig(epochs=3), pm.config_groups),
                          ["extra.level=4", "ddp.static_graph=true"])
    assert isinstance(cfg, TrainConfig) and cfg.epochs == 3
    assert (cfg.extra.level, cfg.ddp.static_graph) == (4, True)
    assert to_dict(cfg)["extra"] == {"level": 4}
    again = pickle.loads(pickle.dumps(cfg))  # DataLoader workers, deepcopy
    assert again == cfg and type(again) is type(cfg)


def test_a_group_added_twice_names_both_plugins(make_plugin_manager):
    class Twice:
        @engine.hookimpl
        def engine_register_config_groups(self):
            return {"ddp": Extra}

    with pytest.raises(PluginError) as err:
        make_plugin_manager(Twice())
    assert str(err.value).startswith("config group 'ddp' is added twice: by plugin 'ddp' "
                                     "and by plugin 'Twice-")


# ----------------------------------------------------------------- commands


def test_a_plugin_adds_a_command(tmp_path):
    (tmp_path / "hello_command.py").write_text(
        "import engine\n\n\n"
        "def hello(argv):\n"
        "    print('hello', *argv)\n"
        "    return 3\n\n\n"
        "@engine.hookimpl\n"
        "def engine_register_commands():\n"
        "    return {'hello': hello}\n")
    env = engine_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    proc = run_cli("hello", "a", "b", "-p", "hello_command", env=env, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "hello a b -p hello_command\n")
    # The slurm plugin's sbatch is one such command; without the plugin it is gone.
    proc = run_cli("sbatch", "recipes/cifar_ddp.py", "-p", "no:slurm", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("engine-run: error: recipe file 'sbatch' not found; give the "
                           "path of a recipe such as recipes/cifar_ddp.py\n")


# ------------------------------------------------- errors and exit codes

BROKEN_MODE = '''
import engine
from engine.plugins.ddp import DistributedDataParallel


class Broken(DistributedDataParallel):
    name = "broken"

    def wrap(self, model):
        return check_model(model)


def check_model(model):
    raise ValueError("cannot wrap this model")


@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(Broken)
'''

BROKEN_HOOK = '''
import engine


@engine.hookimpl
def engine_run_start(engine):
    {}.pop("missing")
'''

BROKEN_LAUNCHER = '''
import engine
from engine.launcher import Launcher


class Cluster(Launcher):
    name = "cluster"

    def worlds(self):
        return int(self.environ["CLUSTER_RANKS"])


@engine.hookimpl
def engine_register_launchers(registry):
    registry.add(Cluster)
'''


@pytest.fixture
def plugin_env(tmp_path):
    """Write plugin modules into a folder on the workers' PYTHONPATH."""
    folder = tmp_path / "plugins"
    folder.mkdir()

    def write(name: str, text: str, **extra: str) -> dict:
        (folder / f"{name}.py").write_text(text)
        return engine_env(PYTHONPATH=f"{folder}:{REPO}", **extra)

    return write


def test_an_error_in_a_plugins_parallel_mode_names_plugin_and_mode(
        plugin_env, tiny_recipe, tmp_path):
    env = plugin_env("broken_mode", BROKEN_MODE)
    args = (str(tiny_recipe), f"out_dir={tmp_path / 'run'}", "-p", "broken_mode",
            "--parallel", "broken", "--nproc", "2")
    proc = run_cli(*args, env=env)
    assert proc.returncode == 1  # a run failure, not a usage error
    # Both ranks raised it alike: one line (issue 35), not one per rank plus engine-run's.
    assert proc.stderr.splitlines() == [
        "engine-run: error: plugin 'broken_mode' (parallel mode 'broken'): ValueError: "
        f"cannot wrap this model (raised at {env['PYTHONPATH'].split(':')[0]}/"
        "broken_mode.py:14); ENGINE_TRACEBACK=1 or --traceback shows the traceback"], (
        proc.stderr)
    # With the traceback asked for, one rank's, then the line naming the other.
    for shown in (run_cli(*args, "--traceback", env=env),
                  run_cli(*args, env={**env, "ENGINE_TRACEBACK": "1"})):
        assert shown.returncode == 1
        ranks = {line.split("]")[0] for line in shown.stderr.splitlines()
                 if line.startswith("[rank ")}
        assert len(ranks) == 1, shown.stderr  # one rank's traceback
        assert 'broken_mode.py", line 14, in check_model' in shown.stderr
        assert ("] error: plugin 'broken_mode' (parallel mode 'broken'): "
                "ValueError: cannot wrap this model") in shown.stderr
        assert shown.stderr.rstrip().endswith("failed the same way"), shown.stderr
        assert "shows the traceback" not in shown.stderr


def test_an_error_in_a_plugins_hook_names_plugin_and_hook(plugin_env, tiny_recipe,
                                                           tmp_path):
    env = plugin_env("broken_hook", BROKEN_HOOK)
    proc = run_cli(str(tiny_recipe), f"out_dir={tmp_path / 'run'}", "-p", "broken_hook",
                   "--nproc", "1", env=env)
    assert proc.returncode == 1
    assert ("[rank 0] error: plugin 'broken_hook' (hook engine_run_start): KeyError: "
            "'missing' (raised at ") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_error_in_a_plugins_launcher_names_it_in_the_cli_process(plugin_env,
                                                                     tiny_recipe):
    env = plugin_env("cluster_launcher", BROKEN_LAUNCHER)
    proc = run_cli(str(tiny_recipe), "-p", "cluster_launcher", "--launcher", "cluster",
                   "--dry-run", env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith(
        "engine-run: error: plugin 'cluster_launcher' (launcher 'cluster'): KeyError: "
        "'CLUSTER_RANKS' (raised at ")
    assert proc.stderr.count("\n") == 1


def test_usage_and_config_errors_exit_2_in_one_line(tiny_recipe, tmp_path):
    for args in (["--nproc"], [str(tiny_recipe), "epochs=zero"],
                 [str(tmp_path / "missing.py")], [str(tiny_recipe), "-p", "no:nothing"],
                 [str(tiny_recipe), "--parallel", "nope"]):
        proc = run_cli(*args, "--dry-run", timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        # One error line (argparse puts its usage before it).
        assert proc.stderr.splitlines()[-1].startswith("engine-run: error: ")
        assert "Traceback" not in proc.stderr
    # A configuration the workers find wrong is a usage error too (exit 2, not 1).
    proc = run_cli(str(tiny_recipe), f"out_dir={tmp_path / 'run'}", "batch_size=1000",
                   "drop_last=true",
                   "samples=16", "--nproc", "1")
    assert proc.returncode == 2, proc.stderr
    assert "[rank 0] error: the training set has 16 samples" in proc.stderr


def test_a_preempted_run_exits_75_and_resumes(tiny_recipe, tmp_path):
    env = engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_STEP="2",
                     ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    args = (str(tiny_recipe), f"out_dir={tmp_path / 'run'}", "--nproc", "1",
            "-p", "tests.fault_plugin")
    stopped = run_cli(*args, env=env)
    assert stopped.returncode == 75, stopped.stderr
    assert "pre-empted by SIGUSR1: snapshot written" in stopped.stderr
    assert run_cli(*args, env=env).returncode == 0


def test_a_version_pattern_is_one_folder_for_all_ranks_and_overwrite_starts_clean(
        tiny_recipe, tmp_path):
    """Rank 0 fills out_dir's {version}, the other rank takes its answer: filling it
    itself, rank 1 would find version_0 taken (rank 0 creates it) and use version_1."""
    quick = (str(tiny_recipe), "epochs=1", "samples=64")
    run_cli(*quick, f"out_dir={tmp_path / 'version_{version}'}", "--nproc", "2",
            check=True)
    run = tmp_path / "version_0"
    assert [p.name for p in tmp_path.iterdir()] == ["version_0"]
    assert read_summary(run)["world_size"] == 2
    # --no-resume where a run is: refused before any process starts.
    args = (*quick, f"out_dir={run}", "--nproc", "1", "--no-resume")
    refused = run_cli(*args)
    assert refused.returncode == 2 and refused.stderr == (
        f"engine-run: error: --no-resume: {run} holds a run (snapshots and summary.json); "
        "add --overwrite to delete it first, or give another out_dir "
        "(out_dir=.../version_{version} makes a new folder each run)\n")
    fresh = run_cli(*args, "--overwrite", check=True)
    assert "resuming" not in fresh.stdout
    assert read_summary(run)["world_size"] == 1
    # The old run's event file went first: TensorBoard shows one run, not two mixed.
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_a_diverged_run_is_a_run_failure(tiny_recipe, tmp_path):
    proc = run_cli(str(tiny_recipe), f"out_dir={tmp_path / 'run'}", "lr=1e38", "--nproc",
                   "1")
    assert proc.returncode == 1, proc.stderr
    assert "[rank 0] error: the training loss became non-finite" in proc.stderr


# ------------------------------------------------------------ in-process units


@pytest.mark.parametrize("exc, code", [
    (ConfigError("x"), 2), (PluginError("x"), 2), (LaunchError("x"), 2),
    (CheckpointError("x"), 2), (RunError("x"), 1), (WorkerFailed("x", 2), 2),
    (WorkerFailed("x", 3), 1), (PluginCodeError("x"), 1), (ValueError("x"), 1),
    (KeyboardInterrupt(), 130),
])
def test_exit_code_of_each_kind_of_error(exc, code):
    assert exit_code(exc) == code


def test_the_one_line_of_an_error_for_the_summary_and_for_the_user(monkeypatch):
    monkeypatch.delenv("ENGINE_TRACEBACK", raising=False)
    crash, bad = ValueError("boom\n  more detail"), ConfigError("config key 'lr': -1")
    # summary.json: the type and the first line, whatever the error.
    assert (one_line(crash), one_line(bad), one_line(KeyboardInterrupt())) == (
        "ValueError: boom", "ConfigError: config key 'lr': -1", "KeyboardInterrupt")
    # The user's line: an EngineError's own message; plugin code adds the traceback hint.
    assert (error_line(crash), error_line(bad)) == ("ValueError: boom", "config key 'lr': -1")
    assert error_line(PluginCodeError("plugin p raised")) == (
        "plugin p raised; ENGINE_TRACEBACK=1 or --traceback shows the traceback")


def test_an_explained_crash_is_a_run_failure_and_bad_input_a_usage_error(tmp_path):
    # The engine explains a crash with the parallel mode's hint: the run failed (1).
    import types

    from engine.config import TrainConfig, with_groups
    from engine.engine import Engine
    from engine.plugins.ddp import DDPConfig, DistributedDataParallel
    from engine.world import World

    cfg = with_groups(TrainConfig(out_dir=str(tmp_path)), {"ddp": DDPConfig})
    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1)
    eng = Engine(None, types.SimpleNamespace(path=tmp_path / "recipe.py"), cfg, world)
    eng.parallel = DistributedDataParallel(world, cfg)
    explained = eng.explain(RuntimeError("Expected to have finished reduction"))
    assert "; hint: " in str(explained)
    assert exit_code(explained) == 1
    assert exit_code(EngineError("bad input")) == 2


def test_main_prints_a_usage_error_in_one_line(capsys, tmp_path):
    assert main([str(tmp_path / "nope.py"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == (f"engine-run: error: recipe file '{tmp_path / 'nope.py'}' not found; "
                   "give the path of a recipe such as recipes/cifar_ddp.py\n")


def test_a_config_key_given_as_an_option_says_how_keys_are_given(capsys):
    recipe = str(REPO / "tests" / "recipes" / "tiny_resume.py")
    with pytest.raises(SystemExit) as info:
        main([recipe, "--epochs", "3", "--grad-accum-steps=2", "--dry-run"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "engine-run: error: unrecognized arguments: --epochs 3 --grad-accum-steps=2; config "
        "keys are given as key=value (epochs=3 grad_accum_steps=2), and the options are "
        "those of --help")


def test_a_negative_max_restarts_is_a_one_line_error_before_anything_starts(capsys, tmp_path):
    recipe = str(REPO / "tests" / "recipes" / "tiny_resume.py")
    assert main([recipe, f"out_dir={tmp_path / 'run'}", "--max-restarts", "-1"]) == 2
    assert capsys.readouterr().err == ("engine-run: error: --max-restarts -1 must be >= 0 "
                                       "(0: no restart)\n")
    assert not (tmp_path / "run").exists()


def test_only_a_bare_word_can_name_a_plugin_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plugin_command([]) is None
    assert plugin_command(["recipes/x.py"]) is None  # a path, never a command
    assert plugin_command(["sbatch"]) is not None
    (tmp_path / "sbatch").write_text("")  # a file of that name wins: it is a recipe
    assert plugin_command(["sbatch"]) is None
    assert plugin_command(["sbatch", "-p", "no:slurm"]) is None


@pytest.mark.parametrize("groups, message", [
    (["ddp"], "engine_register_config_groups must return a dict of group name to attrs "
              "class, not list"),
    ({"extra": dict}, "adds config group 'extra' as <class 'dict'>, which is not an attrs "
                      "class"),
    ({"two words": Extra}, "adds a config group named 'two words'; a group name is a "
                           "Python identifier"),
])
def test_a_bad_config_group_names_the_plugin(make_plugin_manager, groups, message):
    class Bad:
        @engine.hookimpl
        def engine_register_config_groups(self):
            return groups

    with pytest.raises(PluginError) as err:
        make_plugin_manager(Bad())
    assert str(err.value).startswith('Plugin "Bad-') and message in str(err.value)


def test_a_recipe_changing_a_default_keeps_the_choices_and_dry_run_v_describes_keys(
        tmp_path):
    from engine.testing import TINY_RECIPE
    from tests.conftest import run_cli_here

    recipe = tmp_path / "bf16.py"
    recipe.write_text(TINY_RECIPE.replace(
        "    epochs: int = 2\n",
        "    epochs: int = 2\n    precision: str = \"bf16\"  # bf16 by default here\n"))
    proc = run_cli_here(str(recipe), "precision=fp8", "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr == ("engine-run: error: config key 'precision': 'fp8' is not one "
                           "of: 32, bf16, fp16 (TrainConfig.precision)\n")
    proc = run_cli_here(str(recipe), "--dry-run", "-v")
    assert proc.returncode == 0, proc.stderr
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert any(line.startswith("precision = 'bf16'") and line.endswith(
        "[a string and one of: 32, bf16, fp16]  bf16 by default here") for line in lines)
    assert any(line.startswith("samples = 256") and line.endswith("[an integer]")
               for line in lines)  # a recipe's own key without a comment: its values
    assert any(line.startswith("ddp.bucket_cap_mb = 25.0") for line in lines)

    widened = tmp_path / "fp8.py"
    widened.write_text(TINY_RECIPE.replace(
        "    epochs: int = 2\n", "    epochs: int = 2\n    precision: str = 'fp8'\n"))
    proc = run_cli_here(str(widened), "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and (
        "Config.precision: the default 'fp8' is not one of: 32, bf16, fp16 "
        "(TrainConfig.precision); to change a default, give a value that is") in proc.stderr


def test_an_error_that_names_its_door_is_prefixed_once(tmp_path):
    """The run lock names the door asking for it ("engine-run: out_dir ... is in use"):
    engine-run printed "engine-run: error: engine-run: ..."."""
    from engine import run_lock
    from tests.conftest import run_cli_here

    out = tmp_path / "run"
    with run_lock.holding(str(out), "engine-run"):  # held by this process
        proc = run_cli_here(str(REPO / "tests" / "recipes" / "tiny_regression.py"),
                            f"out_dir={out}", "--nproc", "1")
    assert proc.returncode == 2
    assert proc.stderr == (f"engine-run: error: out_dir {out} is in use by another run "
                           f"(this process, pid {os.getpid()}); wait for it to end, give "
                           "another out_dir, or use out_dir=.../version_{version} for a "
                           "new folder each run\n")
