"""engine-run's command line: options listed from the registries, the argument parsing,
error lines and exit codes (real ``engine-run`` subprocesses where the process's exit
is what is tested)."""

from __future__ import annotations

import pytest

import engine
from engine.cli import WorkerJob, build_parser, plugin_args
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
