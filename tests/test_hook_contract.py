"""The hook contract that third-party plugins rely on.

Fails when a hook in engine/hookspecs.py lacks a test, a section in docs/plugins.md, a
kind or a version note, or when a released hook lost or reordered an argument.
"""

from __future__ import annotations

import inspect
import re

import pytest

from engine import hookspecs
from engine.plugin_manager import EnginePluginManager
from tests.conftest import REPO

SPECS = {name: spec for name, spec in vars(hookspecs).items()
         if name.startswith("engine_") and inspect.isfunction(spec)}

#: The hooks and arguments as released. Never edit a line: a hook may only gain
#: arguments after these (implementations may leave them out), each with a note
#: "``argument`` since X.Y." in its docstring. Add new hooks (and their version) here.
RELEASED = {
    "0.1": {
        "engine_register_launchers": ("registry",),
        "engine_register_parallel": ("registry",),
        "engine_register_checkpointers": ("registry",),
        "engine_addoption": ("parser",),
        "engine_run_start": ("engine",),
        "engine_epoch_start": ("engine", "epoch"),
        "engine_train_step_end": ("engine", "step", "loss"),
        "engine_log": ("engine", "metrics", "step"),
        "engine_epoch_end": ("engine", "epoch", "metrics"),
        "engine_run_end": ("engine", "summary"),
        "engine_exception": ("engine", "exc"),
    },
    "0.2": {
        "engine_register_config_groups": (),
        "engine_register_commands": (),
        "engine_before_optimizer_step": ("engine", "step", "optimizer"),
        "engine_register_state": ("engine", "parts"),
        "engine_validation_start": ("engine", "epoch"),
        "engine_validation_end": ("engine", "epoch", "metrics"),
        "engine_requeue": ("engine",),
        "engine_register_run_files": (),
    },
    "0.3": {
        "engine_cpu_allocation": ("environ",),
    },
}
FIRST_RELEASE = {name: (version, args) for version, hooks in RELEASED.items()
                 for name, args in hooks.items()}

KINDS = ("registration", "historic", "notification", "first result")


def arguments(name: str) -> list[str]:
    return list(inspect.signature(SPECS[name]).parameters)


def kind_of(name: str) -> str:
    match = re.search(r"^Kind: ([a-z ]+)\.", inspect.getdoc(SPECS[name]), re.M)
    assert match, f"{name}: the docstring has no line 'Kind: ...'"
    return match.group(1)


@pytest.fixture(scope="module")
def guide() -> str:
    return (REPO / "docs" / "plugins.md").read_text()


def test_every_hook_has_been_released_or_is_listed_here():
    assert set(SPECS) == set(FIRST_RELEASE), (
        "add new hooks to RELEASED with the version that adds them; never remove one")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_released_arguments_stay_in_order_and_new_ones_are_noted(name):
    version, released = FIRST_RELEASE[name]
    current = arguments(name)
    assert tuple(current[: len(released)]) == released, (
        f"{name} changed released arguments: {released} -> {tuple(current)}")
    doc = inspect.getdoc(SPECS[name])
    assert re.search(rf"^Since {re.escape(version)}\.$", doc, re.M), (
        f"{name}: the docstring must say 'Since {version}.' on a line of its own")
    for added in current[len(released):]:
        assert re.search(rf"``{added}`` since \d+\.\d+\.", doc), (
            f"{name}: argument {added!r} needs a note '``{added}`` since X.Y.'")
    assert all(p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD
               for p in inspect.signature(SPECS[name]).parameters.values())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_stated_kind_matches_the_spec(name):
    kind = kind_of(name)
    assert kind in KINDS
    opts = getattr(EnginePluginManager().hook, name).spec.opts
    assert opts.get("historic", False) == (kind == "historic")
    assert opts.get("firstresult", False) == (kind == "first result")
    assert name.startswith("engine_register_") == (kind == "registration")


def documented_arguments(name: str) -> list[str]:
    """The arguments as docs/plugins.md writes them: the run object as ``ctx``, where
    the spec still has ``engine`` (its name up to release 0.2.0, passed too) first."""
    current = arguments(name)
    if "ctx" not in current:
        return current
    return [("ctx" if a == "engine" else a) for a in current if a != "ctx"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_is_in_the_plugin_guide(guide, name):
    signature = f"{name}({', '.join(documented_arguments(name))})"
    heading = f"### `{signature}`\n"
    assert heading in guide, f"docs/plugins.md needs a section {heading.strip()!r}"
    section = guide.split(heading, 1)[1].split("\n#", 1)[0]
    assert f"Kind: {kind_of(name)}." in section
    assert f"Since {FIRST_RELEASE[name][0]}." in section
    order = guide.split("## Hooks in the order they fire", 1)[1].split("###", 1)[0]
    assert name in order or name.startswith("engine_register_"), (
        f"{name} is missing from the order of hooks in docs/plugins.md")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_is_exercised_by_a_test(name):
    """An implementation (``def engine_x(``) or a call (``hook.engine_x(``) in a test
    module other than this one."""
    pattern = re.compile(rf"(def |hook\.){name}\(")
    users = [path.relative_to(REPO) for path in sorted((REPO / "tests").rglob("test_*.py"))
             if path.name != "test_hook_contract.py" and pattern.search(path.read_text())]
    assert users, f"no test implements or calls {name}"
