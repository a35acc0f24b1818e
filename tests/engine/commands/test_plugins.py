"""``engine-run plugins``: what is loaded, its version and origin, hooks and components;
what is disabled, and what is installed but not loaded."""

from __future__ import annotations

import textwrap

import pytest

import engine
from engine.plugin_manager import BUILTIN_PLUGINS, DISABLE_AUTOLOAD_ENV
from engine.testing import write_distribution
from tests.conftest import engine_env, run_cli

V = engine.__version__


@pytest.fixture
def site(tmp_path):
    """A folder with an installed distribution providing the plugin "shout"."""
    write_distribution(tmp_path, "engine-shout", "4.1.0", {"shout": "shout_logger"},
                       files={"shout_logger.py": textwrap.dedent("""
                           __version__ = "4.1.0"

                           def engine_log(engine, metrics, step):
                               print(metrics)
                           """)})
    return tmp_path


def plugins(*args: str, **env: str) -> list[str]:
    proc = run_cli("plugins", *args, env=engine_env(**env), timeout=120, check=True)
    return proc.stdout.splitlines()


def test_lists_every_builtin_with_version_hooks_and_components():
    lines = plugins()
    for name, module in BUILTIN_PLUGINS:
        assert f"{name} {V} (built-in; module {module})" in lines
    spawn = lines.index(f"spawn {V} (built-in; module engine.plugins.spawn)")
    assert lines[spawn + 1: spawn + 3] == ["  hooks: engine_register_launchers",
                                           "  launcher: spawn"]
    assert "  checkpointer: torch-file" in lines
    assert not any(line.startswith(("disabled:", "installed, not loaded")) for line in lines)


def test_an_installed_plugin_shows_its_distribution_and_version(site):
    lines = plugins(PYTHONPATH=str(site))
    at = lines.index("shout 4.1.0 (distribution engine-shout, entry point; "
                     "module shout_logger)")
    assert lines[at + 1] == "  hooks: engine_log"


def test_disabled_and_not_autoloaded_plugins_are_reported(site):
    lines = plugins("-p", "no:tensorboard", PYTHONPATH=str(site),
                    **{DISABLE_AUTOLOAD_ENV: "1"})
    assert not any(line.startswith(("tensorboard ", "shout ")) for line in lines)
    assert lines[-3:-1] == [
        "disabled: tensorboard (-p no:tensorboard)",
        f"entry-point autoload: off ({DISABLE_AUTOLOAD_ENV} is set)"]
    # mlflow and wandb: this repository's own optional loggers (its entry points); any
    # other plugin installed in this environment is listed too.
    listed, _, rest = lines[-1].removeprefix("installed, not loaded: ").partition("; ")
    assert rest == "load one with -p NAME", lines[-1]
    assert {"shout (engine-shout 4.1.0)", f"mlflow (ddp-engine {V})",
            f"wandb (ddp-engine {V})"} <= set(listed.split(", ")), lines[-1]
    lines = plugins("-p", "shout", PYTHONPATH=str(site), **{DISABLE_AUTOLOAD_ENV: "1"})
    assert "shout 4.1.0 (distribution engine-shout, -p; module shout_logger)" in lines


def test_an_editable_install_under_pip_target_is_listed_once_as_broken(tmp_path):
    """pip install -e --target leaves a .pth that Python never reads there (not a site
    folder): the entry point's module cannot be imported. It was listed both as
    "installed, not loaded" and as "broken"."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "edit_logger.py").write_text("def engine_log(engine, metrics, step):\n    pass\n")
    site = tmp_path / "target"
    write_distribution(site, "engine-edit", "1.0", {"edit": "edit_logger"},
                       files={"__editable__.engine_edit-1.0.pth": f"{source}\n"})
    proc = run_cli("plugins", env=engine_env(PYTHONPATH=str(site)), timeout=120)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert not any(line.startswith("installed, not loaded") for line in lines), lines
    (broken,) = [line for line in lines if line.startswith("broken: ")]
    assert broken.startswith('broken: plugin "edit" (distribution engine-edit 1.0) is broken')
    assert "edit_logger" in broken


def test_a_module_given_with_p_is_listed_as_such(site):
    lines = plugins("-p", "shout_logger", "-p", "no:shout", PYTHONPATH=str(site))
    assert "shout_logger 4.1.0 (-p; module shout_logger)" in lines


def test_errors_are_one_line():
    proc = run_cli("plugins", "-p", "no:torch-file", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ('engine-run: error: Plugin "torch-file" is essential and cannot '
                           "be disabled (essential: single, spawn, torch-file)\n")
