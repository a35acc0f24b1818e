"""engine-run's command line: options listed from the registries, the argument parsing,
error lines and exit codes (real ``engine-run`` subprocesses where the process's exit
is what is tested)."""

from __future__ import annotations

import pickle

import attrs
import pytest

import engine
from engine.cli import WorkerJob, build_parser, plugin_args
from engine.errors import PluginError
from engine.parallel import Parallel
from engine.testing import TINY_RECIPE, install_plugin, make_plugin_manager  # noqa: F401
from tests.conftest import REPO, engine_env, run_cli


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
        "one of: auto, ddp, ddp-multigpu, dp, sharded, single (default: detect)")
    assert option_help(parser, "launcher") == (
        "one of: auto, legacy, slurm, spawn, torchrun (default: detect)")
    assert option_help(parser, "checkpointer") == (
        "one of: async, dcp, torch-file (default: torch-file)")
    assert "ShardedPlugin" in option_help(parser, "plugins")
    # Without a plugin manager (a parser built for parsing alone) nothing is listed.
    assert option_help(build_parser(), "parallel") == (
        "a registered parallel mode (default: detect)")


def test_help_lists_an_installed_plugins_components(install_plugin):
    env = engine_env(**install_plugin(REPO / "tests" / "sample_plugin"))
    proc = run_cli("--help", env=env, timeout=120, check=True)
    text = " ".join(proc.stdout.split())  # argparse wraps the help text
    assert "--parallel NAME one of: auto, ddp, ddp-fp16, ddp-multigpu, dp, single" in text
    assert "csv" in text.split("(loaded: ")[1].split(")")[0].split(", ")
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
    job = WorkerJob.from_args(args)
    assert job.recipe_path == "r.py"
    assert job.overrides == ("epochs=3", "lr=0.5", "parallel=dp", "checkpointer=dcp")
    assert job.plugins == ("no:console",)
    assert job.options["nproc"] == 3 and "recipe" not in job.options


# ------------------------------------------------------------ config groups


def test_the_ddp_options_are_the_ddp_plugins_config_group(cifar_recipe):
    proc = run_cli(cifar_recipe, "ddp.find_unused_parameters=true", "--dry-run",
                   timeout=120, check=True)
    assert "ddp.find_unused_parameters = True" in proc.stdout
    assert "ddp.bucket_cap_mb = 25.0" in proc.stdout
    # Without the plugin there is no such group: the usual one-line unknown-key error.
    proc = run_cli(cifar_recipe, "ddp.find_unused_parameters=true", "-p", "no:ddp",
                   "--dry-run", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("engine-run: error: unknown config key "
                                  "'ddp.find_unused_parameters'; known keys: ")
    assert proc.stderr.count("\n") == 1 and "ddp.bucket_cap_mb" not in proc.stderr
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
    from engine.config import TrainConfig, apply_overrides, to_dict, with_groups

    pm = make_plugin_manager(GroupPlugin())
    assert pm.config_groups["extra"] is Extra and pm.config_group_owners["ddp"] == "ddp"
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
