"""engine/registrations.py: what the registration hooks return is checked and kept with
the plugin's name (the registries' and config groups' errors are in
tests/engine/test_plugin_manager.py and tests/engine/test_registry.py)."""

from __future__ import annotations

import pytest

from engine.errors import PluginError
from engine.plugin_manager import build_plugin_manager


def test_the_builtin_loggers_declare_their_files():
    pm = build_plugin_manager()
    assert pm.run_files == {"profile": "profiler", "tensorboard": "tensorboard",
                            "metrics.csv": "csv"}
    assert pm.components_of("csv") == {"run file": ["metrics.csv"]}


def test_a_plugin_left_out_takes_its_run_files_with_it():
    class Logger:
        @staticmethod
        def engine_register_run_files():
            return ["log.jsonl"]

        @staticmethod
        def engine_register_commands():  # called after the run files are kept
            raise RuntimeError("broken")

    assert build_plugin_manager(objects={"jsonl": Logger()}).run_files["log.jsonl"] == "jsonl"
    pm = build_plugin_manager(objects={"jsonl": Logger()}, keep_going=True)
    assert "log.jsonl" not in pm.run_files
    assert [b.info.name for b in pm.broken] == ["jsonl"]


@pytest.mark.parametrize("declared, message", [
    ("metrics.jsonl", "engine_register_run_files must return a list of file or folder "
                      "names, not 'metrics.jsonl'"),
    (["logs/metrics.jsonl"], "declares the run file 'logs/metrics.jsonl'; a run file is the "
                             "name of a file or folder directly inside out_dir"),
    ([".."], "declares the run file '..'"),
])
def test_a_run_file_that_is_not_a_plain_name_is_refused_naming_the_plugin(declared,
                                                                            message):
    class Bad:
        @staticmethod
        def engine_register_run_files():
            return declared

    with pytest.raises(PluginError) as info:
        build_plugin_manager(objects={"bad": Bad()})
    assert str(info.value).startswith('Plugin "bad"') and message in str(info.value)
