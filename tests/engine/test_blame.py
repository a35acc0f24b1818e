"""engine/blame.py: which plugin's code raised an exception, in this process (the CLI's
own reports of it, from real runs, are in tests/engine/test_cli.py)."""

from __future__ import annotations

import types

import pytest

from engine.blame import attribute, blame
from engine.errors import ConfigError, PluginCodeError
from engine.launcher import Launcher
from engine.plugin_manager import build_plugin_manager


class BrokenLauncher(Launcher):
    name = "broken"

    def worlds(self):
        return {}["RANK"]  # a plugin's bug: KeyError


def helper_of_the_hook():
    raise ValueError("bad value\nsecond line")


def engine_log(engine, metrics, step):
    helper_of_the_hook()


def engine_register_launchers(registry):
    registry.add(BrokenLauncher)


@pytest.fixture
def pm():
    plugin = types.ModuleType("mine")
    plugin.__file__ = __file__  # this module is the plugin's code
    plugin.engine_log = engine_log
    plugin.engine_register_launchers = engine_register_launchers
    return build_plugin_manager(objects={"mine": plugin})


def raised(call) -> BaseException:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 (what the CLI catches)
        return exc
    raise AssertionError("nothing raised")


def test_a_components_method_is_blamed_on_its_plugin_and_component(pm):
    exc = raised(lambda: pm.launchers.get("broken")().worlds())
    who, where = blame(pm, exc)
    assert who == "plugin 'mine' (launcher 'broken')"
    assert where.startswith(f"{__file__}:")
    blamed = attribute(pm, exc)
    assert isinstance(blamed, PluginCodeError) and blamed.__cause__ is exc
    assert str(blamed) == (f"plugin 'mine' (launcher 'broken'): KeyError: 'RANK' "
                           f"(raised at {where})")


def test_a_helper_called_by_a_hook_is_blamed_on_the_hook(pm):
    exc = raised(lambda: pm.hook.engine_log(engine=None, metrics={}, step=1))
    who, where = blame(pm, exc)
    assert who == "plugin 'mine' (hook engine_log)"
    assert str(attribute(pm, exc)).startswith(
        "plugin 'mine' (hook engine_log): ValueError: bad value (raised at ")


def test_engine_errors_and_code_outside_plugins_are_left_as_they_are(pm):
    own = raised(lambda: {}["x"])
    assert blame(build_plugin_manager(), own) is None  # no plugin's code on the traceback
    assert attribute(build_plugin_manager(), own) is own
    config = ConfigError("batch_size 3 does not split")
    assert attribute(pm, config) is config
    assert attribute(None, own) is own  # no plugin manager yet: nothing to blame
