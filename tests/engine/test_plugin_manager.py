"""The plugin manager: built-ins, entry points, -p, -p no:, autoload off, REQUIRED_PLUGINS
and every start-up error message.

Plugins here are real modules written to a folder on sys.path, and real installed
distributions (dist-info folders, found by importlib.metadata like pip-installed ones).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import engine
from tests.conftest import engine_env
from engine.cli import build_parser
from engine.errors import ConfigError, PluginError
from engine.plugin_manager import (BUILTIN_PLUGINS, DISABLE_AUTOLOAD_ENV, ESSENTIAL_PLUGINS,
                                   build_plugin_manager, require_plugins)
from engine.testing import write_distribution

LOGGER = """
import engine

__version__ = "2.5"
calls = []

@engine.hookimpl
def engine_log(engine, metrics, step):
    calls.append((step, metrics))
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for plugin modules and distributions; autoload as default."""
    monkeypatch.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


@pytest.fixture
def write_module(site, tmp_path):
    """write_module(source) -> a module name unique to this test (sys.modules caches)."""
    count = iter(range(100))

    def write(source: str) -> str:
        name = f"plug_{tmp_path.name.replace('-', '_')}_{next(count)}"
        (site / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def hook_plugins(pm, hook: str) -> list[str]:
    return [impl.plugin_name for impl in getattr(pm.hook, hook).get_hookimpls()]


# ----------------------------------------------------------------- built-ins


def test_builtins_load_in_order_with_their_components(site):
    pm = build_plugin_manager()
    builtin = [name for name, _ in BUILTIN_PLUGINS]
    assert list(pm.infos)[: len(builtin)] == builtin
    for name in builtin:
        info = pm.infos[name]
        assert (info.source, info.version) == ("built-in", engine.__version__)
    assert pm.launchers.owner("spawn") == "spawn"
    assert pm.parallel_modes.owner("single") == "single"
    assert pm.parallel_modes.owner("ddp") == "ddp"
    assert pm.checkpointers.owner("torch-file") == "torch-file"
    assert {"console", "tensorboard"} <= set(hook_plugins(pm, "engine_log"))


def test_building_the_plugin_manager_does_not_import_torch():
    code = ("import sys; from engine.plugin_manager import build_plugin_manager; "
            "build_plugin_manager(); print(sorted(m for m in ('torch', 'tensorboard', "
            "'torchvision') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=engine_env(), text=True,
                         capture_output=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ -p no:NAME


def test_no_name_disables_a_plugin_and_its_hooks(site):
    pm = build_plugin_manager(["no:tensorboard"])
    assert "tensorboard" not in pm.infos
    assert "tensorboard" not in hook_plugins(pm, "engine_log")
    assert "console" in hook_plugins(pm, "engine_log")
    assert pm.disabled == ["tensorboard"]


@pytest.mark.parametrize("name", sorted(ESSENTIAL_PLUGINS))
def test_essential_plugins_refuse_to_be_disabled(site, name):
    with pytest.raises(PluginError) as err:
        build_plugin_manager([f"no:{name}"])
    assert str(err.value) == (f'Plugin "{name}" is essential and cannot be disabled '
                              "(essential: single, spawn, torch-file)")


def test_disabling_an_unknown_name_is_an_error_with_a_suggestion(site):
    with pytest.raises(PluginError) as err:
        build_plugin_manager(["no:tensorbord"])
    message = str(err.value)
    assert message.startswith('-p no:tensorbord: no plugin or distribution is named '
                              '"tensorbord"; did you mean \'tensorboard\'? plugins: ')
    assert "console" in message and "\n" not in message


# ------------------------------------------------------------------ -p MODULE


def test_p_module_adds_a_plugin_with_its_hooks_and_components(site, write_module):
    name = write_module(LOGGER + """
from engine.parallel import Parallel

class Mine(Parallel):
    name = "mine"

@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(Mine)
""")
    # No other logger (autoload off: the repository's own mlflow and wandb loggers too).
    pm = build_plugin_manager(["no:console", "no:tensorboard", "no:csv", name],
                              autoload=False)
    info = pm.infos[name]
    assert (info.source, info.version, info.module) == ("-p", "2.5", name)
    assert pm.parallel_modes.owner("mine") == name
    assert hook_plugins(pm, "engine_log") == [name]
    pm.hook.engine_log(engine=None, metrics={"a": 1.0}, step=7)
    assert sys.modules[name].calls == [(7, {"a": 1.0})]


def test_p_finds_a_module_in_the_working_directory(tmp_path, monkeypatch):
    # engine-run's sys.path starts with its script's folder, not the working directory
    # (python -m and python script.py differ): -p found no ./module.py there.
    work = tmp_path / "work"
    work.mkdir()
    name = f"plug_cwd_{tmp_path.name.replace('-', '_')}"
    (work / f"{name}.py").write_text(LOGGER)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(work))])
    pm = build_plugin_manager([name], autoload=False)
    assert pm.infos[name].source == "-p" and name in hook_plugins(pm, "engine_log")
    assert sys.path[-1] == str(work)  # last: an installed module of the name still wins


def test_the_same_module_asked_for_twice_is_loaded_once(site, write_module):
    name = write_module(LOGGER)
    pm = build_plugin_manager([name, name, "engine.plugins.console"])
    assert hook_plugins(pm, "engine_log").count(name) == 1
    # console is a built-in already: -p with its module path adds nothing.
    assert len(hook_plugins(pm, "engine_log")) == len(build_plugin_manager().hook
                                                      .engine_log.get_hookimpls()) + 1


def test_a_module_that_fails_to_import_is_named(site, write_module):
    name = write_module("raise RuntimeError('no licence key')\n")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == f'Error importing plugin "{name}": RuntimeError: no licence key'
    with pytest.raises(PluginError) as err:
        build_plugin_manager(["no_such_plugin_module"])
    assert str(err.value) == ('Error importing plugin "no_such_plugin_module": '
                              "ModuleNotFoundError: No module named 'no_such_plugin_module'")


# --------------------------------------------------------------- entry points


def test_entry_points_autoload_unless_the_environment_turns_it_off(site, write_module,
                                                                   monkeypatch):
    module = write_module(LOGGER)
    write_distribution(site, "engine-fancy", "1.2.0", {"fancy": module})
    pm = build_plugin_manager()
    info = pm.infos["fancy"]
    assert (info.source, info.distribution, info.version) == (
        "entry point", "engine-fancy", "1.2.0")
    assert "fancy" in hook_plugins(pm, "engine_log")

    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    pm = build_plugin_manager()
    assert "fancy" not in pm.infos and not pm.autoload
    # Found, not loaded (other installed plugins may be found beside it).
    assert "fancy" in [ep.name for ep in pm.entry_points]
    # -p NAME loads one entry point by its name, with its distribution and version.
    pm = build_plugin_manager(["fancy"])
    assert (pm.infos["fancy"].source, pm.infos["fancy"].version) == ("-p", "1.2.0")

    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "0")
    assert "fancy" in build_plugin_manager().infos


def test_an_entry_point_may_name_an_object_in_a_module(site, write_module):
    module = write_module("""
import engine

class Logger:
    @engine.hookimpl
    def engine_log(self, engine, metrics, step):
        pass

plugin = Logger()
""")
    write_distribution(site, "engine-obj", "0.1", {"obj": f"{module}:plugin"})
    pm = build_plugin_manager()
    assert pm.get_plugin("obj") is sys.modules[module].plugin
    assert pm.infos["obj"].module == f"{module}:plugin"


def test_no_distribution_disables_all_its_entry_points(site, write_module):
    write_distribution(site, "engine-pair", "3.0",
                       {"one": write_module(LOGGER), "two": write_module(LOGGER)})
    assert {"one", "two"} <= set(build_plugin_manager().infos)
    pm = build_plugin_manager(["no:engine-pair"])
    assert not {"one", "two"} & set(pm.infos)


def test_a_broken_entry_point_is_named(site):
    write_distribution(site, "engine-broken", "1.0", {"broken": "gone_module_xyz"})
    with pytest.raises(PluginError) as err:
        build_plugin_manager()
    assert str(err.value) == ('Error importing plugin "broken": ModuleNotFoundError: '
                              "No module named 'gone_module_xyz'")
    # ... and can be switched off by name until it is fixed.
    assert "broken" not in build_plugin_manager(["no:broken"]).infos


def test_an_entry_point_named_like_a_builtin_names_both(site, write_module):
    module = write_module(LOGGER)
    write_distribution(site, "engine-console2", "1.0", {"console": module})
    with pytest.raises(PluginError) as err:
        build_plugin_manager()
    assert str(err.value) == (
        'two plugins are named "console": engine.plugins.console (built-in) and '
        f"{module} (distribution engine-console2 1.0); uninstall one, or disable a "
        "distribution with -p no:DISTRIBUTION")
    assert "console" in build_plugin_manager(["no:engine-console2"]).infos


# ---------------------------------------------------------- bad hook functions


def test_an_unknown_hook_names_plugin_hook_and_the_likely_one(site, write_module):
    name = write_module("def engine_lgo(engine, metrics, step):\n    pass\n")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == (f'Plugin "{name}" implements unknown hook "engine_lgo"; '
                              "did you mean 'engine_log'?")


def test_a_decorated_hook_with_a_misspelt_prefix_is_refused(site, write_module):
    # pluggy validates only names with the project's prefix: egnine_run_end would be
    # accepted and never called.
    name = write_module("""
import engine

@engine.hookimpl
def egnine_run_end(engine, summary):
    pass
""")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == (f'Plugin "{name}" implements unknown hook "egnine_run_end"; '
                              "did you mean 'engine_run_end'?")

    class Logger:
        @engine.hookimpl(specname="engine_lg")
        def write_row(self, engine, metrics, step):
            pass

    with pytest.raises(PluginError) as err:
        build_plugin_manager(objects={"rows": Logger()})
    assert str(err.value) == ('Plugin "rows" implements unknown hook "engine_lg" (function '
                              "write_row); did you mean 'engine_log'?")


def test_an_argument_the_hook_lacks_names_plugin_hook_and_argument(site, write_module):
    name = write_module("def engine_log(engine, metrics, step, colour):\n    pass\n")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == (
        f'Plugin "{name}" implements hook "engine_log" with argument(s) colour that the '
        "hook does not provide; it provides: ctx, metrics, step")


def test_methods_are_checked_without_self(site):
    class Logger:
        @engine.hookimpl
        def engine_epoch_end(self, engine, epochs):
            pass

    with pytest.raises(PluginError) as err:
        build_plugin_manager(objects={"my-logger": Logger()})
    assert str(err.value) == (
        'Plugin "my-logger" implements hook "engine_epoch_end" with argument(s) epochs '
        "that the hook does not provide; it provides: ctx, epoch, metrics")


def test_an_implementation_may_take_fewer_arguments(site):
    seen = []

    class StepsOnly:
        @engine.hookimpl
        def engine_log(self, step):
            seen.append(step)

    pm = build_plugin_manager(["no:console", "no:tensorboard", "no:csv"], autoload=False,
                              objects={"steps": StepsOnly()})
    pm.hook.engine_log(engine=None, metrics={}, step=3)
    assert seen == [3]


# ------------------------------------------------------------- registrations


def test_a_component_name_taken_twice_names_both_plugins(site, write_module):
    name = write_module("""
import engine
from engine.parallel import Parallel

class MyDDP(Parallel):
    name = "ddp"

@engine.hookimpl
def engine_register_parallel(registry):
    registry.add(MyDDP)
""")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == (f"parallel mode 'ddp' is registered twice: by plugin 'ddp' "
                              f"and by plugin '{name}'; disable one with -p no:NAME")
    # Disabling the built-in lets the plugin provide "ddp".
    pm = build_plugin_manager(["no:ddp", name])
    assert pm.parallel_modes.owner("ddp") == name


def test_a_registration_hook_that_raises_is_named(site, write_module):
    name = write_module("""
def engine_register_launchers(registry):
    raise KeyError("SLURM_JOB_ID")
""")
    with pytest.raises(PluginError) as err:
        build_plugin_manager([name])
    assert str(err.value) == (f'Plugin "{name}" failed in engine_register_launchers: '
                              "KeyError: 'SLURM_JOB_ID'")


# ------------------------------------------------------------ broken plugins

#: A plugin module broken in each way a run refuses, and the run's one-line error
#: ({module}: the module's name).
BROKEN = {
    "missing import": ("import gone_module_xyz\n", 'Error importing plugin "bad": '
                       "ModuleNotFoundError: No module named 'gone_module_xyz'"),
    "syntax error": ("def engine_log(engine, metrics, step)\n    pass\n",
                     'Error importing plugin "bad": SyntaxError: expected \':\' ({module}.py, '
                     "line 1)"),
    "raises at import": ("raise RuntimeError('no licence key')\n",
                         'Error importing plugin "bad": RuntimeError: no licence key'),
    "misspelt hook": ("import engine\n@engine.hookimpl\ndef egnine_log(engine):\n    pass\n",
                      'Plugin "bad" implements unknown hook "egnine_log"; did you mean '
                      "'engine_log'?"),
    "bad argument": ("def engine_log(engine, colour):\n    pass\n",
                     'Plugin "bad" implements hook "engine_log" with argument(s) colour that '
                     "the hook does not provide; it provides: ctx, metrics, step"),
    # Its launcher is registered before engine_register_parallel raises: it goes too.
    "registration raises": ("""
from engine.launcher import Launcher

class Mine(Launcher):
    name = "mine"

def engine_register_launchers(registry):
    registry.add(Mine)

def engine_register_parallel(registry):
    raise KeyError("SLURM_JOB_ID")
""", "Plugin \"bad\" failed in engine_register_parallel: KeyError: 'SLURM_JOB_ID'"),
    "config group": ("""
import attrs

@attrs.define
class Group:
    every: int = 1

def engine_register_config_groups():
    return {"fine": Group, "not fine": Group}
""", 'Plugin "bad" adds a config group named \'not fine\'; a group name is a Python '
     "identifier"),
    "commands raise": ("def engine_register_commands():\n    raise OSError('no sbatch')\n",
                       'Plugin "bad" failed in engine_register_commands: OSError: no sbatch'),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_broken_plugin_stops_a_run_or_is_left_out_and_named(site, write_module,
                                                              monkeypatch, how):
    source, error = BROKEN[how]
    module = write_module(source)
    error = error.format(module=module)
    write_distribution(site, "engine-bad", "1.0", {"bad": module})
    with pytest.raises(PluginError) as err:
        build_plugin_manager().commands()  # what a run does (commands: plugin commands)
    assert str(err.value) == error

    pm = build_plugin_manager(keep_going=True)  # --help, doctor, plugins
    assert [b.error for b in pm.broken] == [error]
    assert pm.broken[0].describe() == (
        f'plugin "bad" (distribution engine-bad 1.0) is broken and was left out: {error}; '
        f"to disable it: -p no:bad, or {DISABLE_AUTOLOAD_ENV}=1 (no installed plugin "
        "loads), or pip uninstall engine-bad")
    # Nothing of it stays behind; the built-ins and every other installed entry point
    # (this repository's optional loggers, any third party's) are all there.
    others = [ep.name for ep in pm.entry_points if ep.name != "bad"]
    assert list(pm.infos) == [name for name, _ in BUILTIN_PLUGINS] + others
    assert not pm.has_plugin("bad") and "bad" not in pm.commands()
    assert not [r for r in (pm.launchers, pm.parallel_modes, pm.checkpointers)
                if r.by_owner("bad")]
    assert set(pm.config_groups) == set(build_plugin_manager(["no:bad"]).config_groups)
    # Both ways the message offers let a run start.
    build_plugin_manager(["no:bad"]).commands()
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    build_plugin_manager().commands()


def test_a_plugin_whose_options_fail_is_left_out_before_help_needs_them(site,
                                                                       write_module):
    raises = write_module("def engine_addoption(parser):\n    raise ValueError('no')\n")
    taken = write_module("def engine_addoption(parser):\n"
                         "    parser.add_argument('--nproc')\n")
    fine = write_module("def engine_addoption(parser):\n"
                        "    parser.add_argument('--fine-every')\n")
    pm = build_plugin_manager([raises, taken, fine], keep_going=True,
                              scratch_parser=build_parser())
    assert [b.error for b in pm.broken] == [
        f'Plugin "{raises}" failed in engine_addoption: ValueError: no',
        f'Plugin "{taken}" failed in engine_addoption: ArgumentError: argument --nproc: '
        "conflicting option string: --nproc"]
    assert fine in pm.infos and not {raises, taken} & set(pm.infos)


def test_a_second_plugin_of_a_taken_name_is_left_out_not_the_first(site, write_module):
    write_distribution(site, "engine-console2", "1.0", {"console": write_module(LOGGER)})
    pm = build_plugin_manager(keep_going=True)
    assert [b.error for b in pm.broken] == [str(pytest.raises(
        PluginError, build_plugin_manager).value)]
    assert pm.infos["console"].source == "built-in" and pm.has_plugin("console")


def test_a_broken_p_module_is_left_out_with_its_own_advice(site, write_module):
    name = write_module("raise RuntimeError('no licence key')\n")
    pm = build_plugin_manager([name], keep_going=True)
    assert [b.describe() for b in pm.broken] == [
        f'plugin "{name}" is broken and was left out: Error importing plugin "{name}": '
        f"RuntimeError: no licence key; to disable it: leave out -p {name}"]


# ------------------------------------------------------------ REQUIRED_PLUGINS


@pytest.fixture
def fancy(site, write_module):
    write_distribution(site, "engine-fancy", "1.2.0", {"fancy": write_module(LOGGER)})


@pytest.mark.parametrize("requirement", [
    "fancy", "engine-fancy", "engine_fancy>=1.2", "Engine.Fancy>=1.1,<2", "fancy~=1.1",
    "fancy==1.2.*", "fancy!=1.3", "console", f"tensorboard=={engine.__version__}"])
def test_requirements_met_by_plugin_or_distribution_name(fancy, requirement):
    require_plugins(build_plugin_manager(), [requirement])


def test_missing_plugins_are_listed_with_the_reason(fancy, monkeypatch):
    with pytest.raises(PluginError) as err:
        require_plugins(build_plugin_manager(["no:tensorboard"]),
                        ["engine-fancy>=1.3", "wandb-engine", "fancy", "tensorboard"])
    assert str(err.value) == (
        "Missing required plugins: engine-fancy>=1.3 (have 1.2.0), wandb-engine (not "
        "installed), tensorboard (disabled with -p no:tensorboard)")
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")
    with pytest.raises(PluginError) as err:
        require_plugins(build_plugin_manager(), ["fancy>=1"])
    assert str(err.value) == (
        "Missing required plugins: fancy>=1 (installed (engine-fancy 1.2.0) but not "
        f"loaded because {DISABLE_AUTOLOAD_ENV} is set; add -p fancy)")


def test_a_malformed_requirement_is_a_config_error(site):
    with pytest.raises(ConfigError) as err:
        require_plugins(build_plugin_manager(), ["fancy>>1"])
    assert str(err.value) == (
        "REQUIRED_PLUGINS entry 'fancy>>1' is not a requirement; write a plugin or "
        "distribution name with an optional version specifier, e.g. "
        "'engine-csv-logger>=0.3'")


def test_a_recipe_with_missing_plugins_stops_engine_run(tmp_path):
    from engine.testing import TINY_RECIPE

    recipe = tmp_path / "needs_plugins.py"
    recipe.write_text(TINY_RECIPE + '\nREQUIRED_PLUGINS = ["engine-mlflow>=2", "console"]\n')
    proc = subprocess.run([sys.executable, "-m", "engine", str(recipe), "--dry-run"],
                          env=engine_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("engine-run: error: Missing required plugins: engine-mlflow>=2 "
                           "(not installed)\n")


class OldNamePlugin:
    """A plugin written before 0.3: it asks for the run object as ``engine``."""

    def __init__(self):
        self.got = []

    @engine.hookimpl
    def engine_log(self, engine, metrics, step):
        self.got.append(("log", engine, step))

    @engine.hookimpl
    def engine_epoch_start(self, engine, epoch):
        self.got.append(("epoch_start", engine, epoch))


class NewNamePlugin(OldNamePlugin):
    @engine.hookimpl
    def engine_log(self, ctx, metrics, step):
        self.got.append(("log", ctx, step))

    @engine.hookimpl
    def engine_epoch_start(self, ctx, epoch):
        self.got.append(("epoch_start", ctx, epoch))


def test_the_run_objects_old_hook_argument_name_works_with_one_warning(capfd):
    """``engine`` became ``ctx`` in 0.3: a plugin asking for ``engine`` gets the same
    object, with one warning at registration naming ``ctx``; a caller passing either
    name reaches both kinds of plugin; the built-in plugins ask for ``ctx``."""
    old, new, run = OldNamePlugin(), NewNamePlugin(), object()
    pm = build_plugin_manager(["no:console", "no:tensorboard", "no:csv"], autoload=False,
                              objects={"old-name-plugin": old, "new-name-plugin": new})
    err = capfd.readouterr().err
    assert err.count("warning:") == 1, err
    assert ('warning: plugin "old-name-plugin" asks for the run object as "engine" (in '
            'engine_epoch_start, engine_log): the argument is "ctx" now, the same object; '
            '"engine" works until 0.4.0') in err
    pm.hook.engine_log(ctx=run, metrics={}, step=3)
    pm.hook.engine_epoch_start(engine=run, epoch=1)  # a caller written before 0.3
    assert old.got == new.got == [("log", run, 3), ("epoch_start", run, 1)]
    builtin = build_plugin_manager(autoload=False)
    asking_engine = [(impl.plugin_name, caller.name)
                     for caller in vars(builtin.hook).values()
                     for impl in caller.get_hookimpls() if "engine" in impl.argnames]
    assert asking_engine == []
    assert "asks for the run object" not in capfd.readouterr().err


@pytest.mark.parametrize("rank_variable", ["RANK", "SLURM_PROCID"])
def test_the_old_name_warning_is_rank_0s_where_another_tool_starts_the_ranks(
        capfd, monkeypatch, rank_variable):
    """Under torchrun or srun every rank registers the plugins: rank 0 alone says it
    (engine-run's own workers never do: their launcher said it)."""
    def register(rank: str) -> None:
        monkeypatch.setenv(rank_variable, rank)
        name, plugin = f"old-name-plugin-{rank_variable}-{rank}", OldNamePlugin()
        pm = build_plugin_manager(["no:console", "no:tensorboard", "no:csv"],
                                  autoload=False, objects={name: plugin})
        assert pm.get_plugin(name) is plugin  # registered: a silence that means something

    register("0")  # the same registration on rank 0 says it
    assert "asks for the run object" in capfd.readouterr().err
    register("1")
    assert "asks for the run object" not in capfd.readouterr().err
