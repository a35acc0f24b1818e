"""Registries of components by name: the errors for taken, unknown and bad names."""

from __future__ import annotations

import pytest

from engine.errors import PluginError
from engine.launcher import Launcher
from engine.registry import Registry
from tests.conftest import QUICK, run_cli


class Fast(Launcher):
    name = "fast"


class Slow(Launcher):
    name = "slow"


@pytest.fixture
def registry():
    registry = Registry("launcher", Launcher)
    registry.current_plugin = "plugin-a"
    registry.add(Fast)
    registry.current_plugin = "plugin-b"
    registry.add(Slow)
    return registry


def test_lookup_membership_and_owners(registry):
    assert registry.get("fast") is Fast
    assert "slow" in registry and "medium" not in registry
    assert registry.names() == ["fast", "slow"] and len(registry) == 2
    assert registry.owner("fast") == "plugin-a"
    assert registry.by_owner("plugin-b") == ["slow"]


def test_a_name_taken_twice_names_both_plugins(registry):
    registry.current_plugin = "plugin-c"

    class AnotherFast(Launcher):
        name = "fast"

    with pytest.raises(PluginError) as err:
        registry.add(AnotherFast)
    assert str(err.value) == ("launcher 'fast' is registered twice: by plugin 'plugin-a' "
                              "and by plugin 'plugin-c'; disable one with -p no:NAME")
    assert registry.get("fast") is Fast  # the first one keeps the name


def test_an_unknown_name_lists_the_registered_ones(registry):
    with pytest.raises(PluginError) as err:
        registry.get("slwo")
    assert str(err.value) == ("launcher 'slwo' is not available (plugin may not be "
                              "installed); did you mean 'slow'? registered: fast, slow")
    with pytest.raises(PluginError) as err:
        Registry("checkpointer").get("dcp")
    assert str(err.value) == ("checkpointer 'dcp' is not available (plugin may not be "
                              "installed); registered: none")


@pytest.mark.parametrize("name", ["", "two words", "-dash-first", "a/b", 3, None])
def test_names_must_be_typeable_on_the_command_line(registry, name):
    bad = type("Bad", (Launcher,), {"name": name, "__module__": "mod"})
    with pytest.raises(PluginError) as err:
        registry.add(bad)
    assert str(err.value) == (
        f"plugin 'plugin-b' registers a launcher named {name!r} (mod.Bad.name); a name is "
        "letters, digits, '-', '_' and '.', starting with a letter or digit")


def test_the_name_comes_from_the_class_only(registry):
    """add(cls) takes the class's own name; the 0.1 form add("name", cls) still works
    when the two agree and is refused when they differ (the name a component reports
    in summary.json and the one typed on the command line would disagree)."""

    class Medium(Launcher):
        name = "medium"

    registry.add("medium", Medium)
    assert registry.get("medium") is Medium
    with pytest.raises(PluginError) as err:
        registry.add("quick", Fast)
    assert str(err.value) == (
        "plugin 'plugin-b' registers launcher 'quick' as tests.engine.test_registry.Fast, "
        "whose name attribute is 'fast'; set name = 'quick' in the class and call "
        "registry.add(cls)")
    with pytest.raises(PluginError) as err:
        registry.add(Fast, "quick")
    assert str(err.value) == (
        "plugin 'plugin-b' passes a separate name 'quick' for launcher "
        "tests.engine.test_registry.Fast; the name comes from the class: call "
        "registry.add(cls)")


def test_components_must_subclass_the_base(registry):
    with pytest.raises(PluginError) as err:
        registry.add(type("Fake", (), {"name": "fake"}))
    assert str(err.value) == ("plugin 'plugin-b' registers launcher 'fake' as <class "
                              "'tests.engine.test_registry.Fake'>, which is not a subclass of "
                              "engine.launcher.Launcher")
    with pytest.raises(PluginError):
        registry.add(Fast(options=None, environ={}))


@pytest.mark.parametrize("args, message", [
    (["--parallel", "sngle"], "parallel mode 'sngle' is not available (plugin may not be "
                              "installed); did you mean 'single'? registered: "),
    (["--checkpointer", "s3"], "checkpointer 's3' is not available (plugin may not be "
                               "installed); registered: "),
    (["--launcher", "mpirun"], "launcher 'mpirun' is not available (plugin may not be "
                               "installed); registered: "),
])
def test_engine_run_names_the_unknown_component_in_one_line(cifar_recipe, args, message):
    proc = run_cli(cifar_recipe, *QUICK, *args, "--dry-run", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"engine-run: error: {message}")
    assert proc.stderr.count("\n") == 1
