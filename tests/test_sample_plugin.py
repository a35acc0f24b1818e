"""A third-party plugin package (tests/sample_plugin: distribution engine-csv-logger
0.3.1, the CSV logger csv-rows and the parallel mode ddp-fp16), installed with pip into a
throwaway folder and found through its entry points, with no change to the engine."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys

import pytest

import engine
from engine.plugin_manager import DISABLE_AUTOLOAD_ENV
from engine.testing import (TINY_RECIPE, install_plugin, run_recipe,  # noqa: F401 (fixtures)
                            tiny_recipe)
from tests.conftest import QUICK, REPO, engine_env, read_summary, run_cli

SAMPLE = REPO / "tests" / "sample_plugin"


@pytest.fixture(scope="module")
def sample(install_plugin):
    """Environment variables under which the installed sample package is visible."""
    return install_plugin(SAMPLE)


def plugin_lines(env: dict, *args: str) -> list[str]:
    return run_cli("plugins", *args, env=engine_env(**env), timeout=120,
                   check=True).stdout.splitlines()


def test_plugins_lists_both_with_version_and_distribution(sample):
    lines = plugin_lines(sample)
    csv_at = lines.index("csv-rows 0.3.1 (distribution engine-csv-logger, entry point; module "
                         "engine_csv_logger:plugin)")
    assert lines[csv_at + 1] == "  hooks: engine_addoption, engine_log, engine_run_end"
    fp16_at = lines.index("ddp-fp16 0.3.1 (distribution engine-csv-logger, entry point; "
                          "module engine_csv_logger.compressed_ddp)")
    assert lines[fp16_at + 1: fp16_at + 3] == ["  hooks: engine_register_parallel",
                                               "  parallel mode: ddp-fp16"]


def test_a_run_logs_to_csv_with_the_plugins_parallel_mode(sample, cifar_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(cifar_recipe, *QUICK, f"out_dir={out}", "--nproc", "2", "--parallel",
            "ddp-fp16", env=engine_env(**sample), check=True)
    summary = read_summary(out)
    assert summary["parallel"] == "ddp-fp16"
    assert len(set(summary["weights_sha256_per_rank"])) == 1
    with open(out / "rows.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "name", "value"]
    # 512 samples, global batch 64: 8 steps, logged every 4, then the epoch's metrics.
    assert [int(r[0]) for r in rows[1:] if r[1] == "train/loss"] == [4, 8]
    assert [int(r[0]) for r in rows[1:] if r[1] == "train/epoch_loss"] == [8]
    (val_accuracy,) = [r for r in rows if r[1] == "val/accuracy"]
    assert val_accuracy[0] == "8" and float(val_accuracy[2]) == summary["val_accuracy"]


def test_autoload_off_and_disabling_by_distribution(sample):
    lines = plugin_lines({**sample, DISABLE_AUTOLOAD_ENV: "1"})
    assert not any(line.startswith(("csv-rows ", "ddp-fp16 ")) for line in lines)
    assert lines[-1] == ("installed, not loaded: csv-rows (engine-csv-logger 0.3.1), ddp-fp16 "
                         f"(engine-csv-logger 0.3.1), mlflow (ddp-engine {engine.__version__}), "
                         f"wandb (ddp-engine {engine.__version__}); load one with -p NAME")
    lines = plugin_lines({**sample, DISABLE_AUTOLOAD_ENV: "1"}, "-p", "csv-rows")
    assert ("csv-rows 0.3.1 (distribution engine-csv-logger, -p; module "
            "engine_csv_logger:plugin)") in lines
    lines = plugin_lines(sample, "-p", "no:engine-csv-logger")
    assert not any(line.startswith(("csv-rows ", "ddp-fp16 ")) for line in lines)
    assert "disabled: engine-csv-logger (-p no:engine-csv-logger)" in lines


@pytest.mark.parametrize("requirement, error", [
    ("engine-csv-logger>=0.3,<1", None),
    ("csv-rows==0.3.*", None),
    ("engine-csv-logger>=0.4", "engine-csv-logger>=0.4 (have 0.3.1)"),
])
def test_required_plugins_of_a_recipe(sample, tmp_path, requirement, error):
    recipe = tmp_path / "needs_csv.py"
    recipe.write_text(TINY_RECIPE + f"\nREQUIRED_PLUGINS = [{requirement!r}]\n")
    proc = run_cli(str(recipe), "--dry-run", env=engine_env(**sample), timeout=120)
    if error is None:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == 2
        assert proc.stderr == f"engine-run: error: Missing required plugins: {error}\n"


@pytest.mark.slow
def test_the_plugin_authors_own_tests_pass_with_engine_testing(sample, tmp_path):
    # The package as its author has it (without the conftest that keeps the engine's
    # run from collecting it); its tests opt in to engine.testing with pytest_plugins.
    project = tmp_path / "engine-csv-logger"
    shutil.copytree(SAMPLE, project, ignore=shutil.ignore_patterns("__pycache__"))
    (project / "conftest.py").unlink()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                          cwd=project, env=engine_env(**sample), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_the_docs_install_plugin_example_runs(install_plugin, run_recipe):  # noqa: F811
    """docs/plugins.md said install_plugin returns a PYTHONPATH string; it returns an
    environment dict, and following the doc ended in a TypeError. Its example, run as
    written from the sample package's tests folder."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "plugins.md").read_text(),
                        re.S)
    (example,) = [b for b in blocks if "def test_installed_it_is_found_by_its_entry_points"
                  in b]
    namespace = {"__file__": str(SAMPLE / "tests" / "test_example.py")}
    exec(compile(example, "docs/plugins.md (install_plugin example)", "exec"), namespace)
    namespace["test_installed_it_is_found_by_its_entry_points"](install_plugin, run_recipe)
