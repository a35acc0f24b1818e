"""Run folders (engine/run_dir.py): out_dir patterns filled once, and a fresh start in a
folder that holds a run. In-process; the property that every rank of a 2-process run
gets rank 0's folder is tested with a real run in tests/engine/test_cli.py."""

from __future__ import annotations

import datetime
import json
import subprocess

import pytest

from engine.testing import fit
from engine import run_dir
from engine.config import TrainConfig, check
from engine.errors import ConfigError
from engine.plugin_manager import build_plugin_manager
from engine.world import World
from tests.conftest import REPO, run_cli, small_disk

MOMENT = datetime.datetime(2026, 11, 23, 9, 30, 12, tzinfo=datetime.timezone.utc)


def test_version_is_one_more_than_the_highest_and_the_folder_is_claimed(tmp_path):
    pattern = str(tmp_path / "runs" / "version_{version}")
    assert run_dir.resolve(pattern) == str(tmp_path / "runs" / "version_0")
    assert run_dir.resolve(pattern) == str(tmp_path / "runs" / "version_1")
    (tmp_path / "runs" / "version_7").mkdir()
    (tmp_path / "runs" / "version_x").mkdir()  # not of the pattern: ignored
    (tmp_path / "runs" / "notes.txt").write_text("")
    assert run_dir.resolve(pattern) == str(tmp_path / "runs" / "version_8")
    assert run_dir.fixed_part(pattern) == str(tmp_path / "runs")
    assert run_dir.fixed_part("v{version}/a") == "."
    # A path without a placeholder is the run's folder as it is.
    assert run_dir.resolve(str(tmp_path / "fixed")) == str(tmp_path / "fixed")
    assert not (tmp_path / "fixed").exists()


def test_time_is_utc_and_sortable_and_two_runs_in_one_second_do_not_share(tmp_path):
    pattern = str(tmp_path / "{time}")
    first = run_dir.resolve(pattern, now=MOMENT)
    assert first == str(tmp_path / "20261123-093012")
    # Another run in the same second: the folder is taken, so the next second.
    assert run_dir.resolve(pattern, now=MOMENT) == str(tmp_path / "20261123-093013")
    nested = str(tmp_path / "{time}" / "v{version}")
    assert run_dir.resolve(nested, now=MOMENT) == str(tmp_path / "20261123-093012" / "v0")
    assert run_dir.resolve(nested, now=MOMENT) == str(tmp_path / "20261123-093012" / "v1")


def test_a_restarted_job_continues_the_newest_folder_and_resume_picks_its_own(tmp_path):
    pattern = str(tmp_path / "version_{version}")
    for _ in range(3):
        run_dir.resolve(pattern)
    assert run_dir.resolve(pattern, restarted=True) == str(tmp_path / "version_2")
    snapshot = tmp_path / "version_1" / "checkpoints" / "snapshot-e0001.pt"
    assert run_dir.resolve(pattern, resume=str(snapshot)) == str(tmp_path / "version_1")
    # A snapshot from elsewhere: a new version resumes from it.
    assert run_dir.resolve(pattern, resume=str(tmp_path / "other.pt")) == str(
        tmp_path / "version_3")


def test_an_unknown_placeholder_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'out_dir': '.*/run_\{n\}' has the "
                       r"unknown placeholder \{n\}; known: \{version\}, \{time\}$"):
        check(TrainConfig(out_dir=str(tmp_path / "run_{n}")))
    check(TrainConfig(out_dir=str(tmp_path / "run_{version}")))


def fill_with_a_run(out):
    for name in ("checkpoints", "tensorboard"):
        (out / name).mkdir(parents=True)
    (out / "checkpoints" / "snapshot-e0001-s00000006.pt").write_bytes(b"x")
    (out / "tensorboard" / "events.out.tfevents.1.host.1.0").write_bytes(b"x")
    for name in ("metrics.csv", "summary.json", "config.json", "my-notes.txt"):
        (out / name).write_text("{}")


def test_no_resume_is_refused_where_a_run_is_and_overwrite_clears_only_its_files(tmp_path):
    out = tmp_path / "run"
    run_dir.refuse_fresh_start(str(out))  # nothing there: fine
    fill_with_a_run(out)
    with pytest.raises(ConfigError) as info:
        run_dir.refuse_fresh_start(str(out))
    assert str(info.value) == (
        f"--no-resume: {out} holds a run (snapshots and summary.json); add --overwrite to "
        "delete it first, or give another out_dir (out_dir=.../version_{version} makes a "
        "new folder each run)")
    run_dir.refuse_fresh_start(str(tmp_path / "version_{version}"))  # a new one anyway

    cfg = TrainConfig(out_dir=str(out))
    files = run_dir.run_files(build_plugin_manager())
    run_dir.settle(cfg, World(0, 0, 1, 1), {"no_resume": True, "overwrite": True}, files)
    assert sorted(p.name for p in out.iterdir()) == ["my-notes.txt"]
    assert run_dir.holds_a_run(out) == []


def test_a_failed_run_that_trained_nothing_does_not_hold_a_run(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text('{"status": "failed", "global_step": 0}')
    assert run_dir.holds_a_run(tmp_path) == []  # a recipe whose build_model raised
    run_dir.refuse_fresh_start(str(tmp_path))
    for trained in ('{"status": "failed", "global_step": 3}', '{"status": "completed"}',
                    "{not json"):
        summary.write_text(trained)
        assert run_dir.holds_a_run(tmp_path) == ["summary.json"]


class JsonLinesLogger:
    """A third-party logger that writes metrics.jsonl and declares it."""

    @staticmethod
    def engine_register_run_files():
        return ["metrics.jsonl"]


def test_overwrite_removes_the_files_the_loaded_plugins_declare(tmp_path):
    """The engine's files and each plugin's (engine_register_run_files): a logger turned
    off leaves its file, a third-party logger's is removed with the rest."""
    out = tmp_path / "run"
    fill_with_a_run(out)
    (out / "metrics.jsonl").write_text("{}")
    pm = build_plugin_manager(["no:csv"], objects={"jsonl": JsonLinesLogger()})
    assert run_dir.run_files(pm) == ("checkpoints", "summary.json", "config.json",
                                     "profile", "tensorboard", "metrics.jsonl")
    assert pm.components_of("jsonl") == {"run file": ["metrics.jsonl"]}
    assert run_dir.clear(out, run_dir.run_files(pm)) == [
        "checkpoints", "summary.json", "config.json", "tensorboard", "metrics.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "my-notes.txt"]


def test_settle_fills_the_pattern_on_rank_0(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path / "v{version}"))
    run_dir.settle(cfg, World(0, 0, 1, 1), {}, run_dir.ENGINE_FILES)
    assert cfg.out_dir == str(tmp_path / "v0")
    again = TrainConfig(out_dir=str(tmp_path / "v{version}"))
    run_dir.settle(again, World(0, 0, 1, 1, restart_count=1), {}, run_dir.ENGINE_FILES)
    assert again.out_dir == str(tmp_path / "v0")  # torchrun/SLURM restart: resumes
    afresh = TrainConfig(out_dir=str(tmp_path / "v{version}"))
    run_dir.settle(afresh, World(0, 0, 1, 1, restart_count=1), {"no_resume": True},
                   run_dir.ENGINE_FILES)
    assert afresh.out_dir == str(tmp_path / "v1")  # a restart that starts afresh: new


def test_an_out_dir_on_a_read_only_filesystem_is_one_line_before_any_worker(tmp_path):
    """A run whose folder was remounted read-only: refused in the launching process with
    exit 2, instead of a worker's OSError traceback at its first write."""
    with small_disk(tmp_path / "disk", "8m") as disk:
        recipe = str(REPO / "tests" / "recipes" / "tiny_regression.py")
        out = disk / "run"
        run_cli(recipe, "epochs=1", f"out_dir={out}", "--nproc", "1", check=True)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        again = run_cli(recipe, "epochs=2", f"out_dir={out}", "--nproc", "2")
        assert again.returncode == 2, again.stderr
        assert again.stderr.strip().splitlines()[-1] == (
            f"engine-run: error: out_dir '{out}': {out} cannot be written (a read-only "
            "filesystem or no permission); give an out_dir the run can write")
        assert "[rank" not in again.stderr  # no worker started


def a_run(folder, limit_batches: int = 0, **summary) -> dict:
    """A run's files, as a completed run leaves them; returns their bytes by name."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "snapshot-e0002-s00000010.pt").write_bytes(b"weights")
    (folder / "summary.json").write_text(json.dumps(
        {"status": "completed", "epochs_completed": 2, "global_step": 10, **summary}))
    (folder / "config.json").write_text(json.dumps({"epochs": 2,
                                                    "limit_batches": limit_batches}))
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


TINY = str(REPO / "tests" / "recipes" / "tiny_regression.py")


def test_a_smoke_run_replaces_only_an_earlier_smoke_runs_folder(tmp_path):
    """smoke=true where out_dir-smoke holds a completed real run replaced it without a
    word; now refused in the launching process, the run left as it was. A folder
    whose config.json says it was a smoke run is replaced as before."""
    smoke = tmp_path / "run-smoke"
    files = a_run(smoke)
    with pytest.raises(ConfigError) as info:
        fit(TINY, nproc=1, out_dir=str(tmp_path / "run"), smoke=True)
    assert str(info.value) == (
        f"smoke run: {smoke} holds a run (snapshots and summary.json) that was not a "
        "smoke run (no limit_batches in its config.json), which the smoke run would "
        "replace; move it, or give another out_dir")
    assert {p.relative_to(smoke): p.read_bytes() for p in smoke.rglob("*")
            if p.is_file()} == files
    a_run(tmp_path / "earlier-smoke", limit_batches=2)
    assert run_dir.refuse_smoke_over_a_run(str(tmp_path / "earlier-smoke")) is None


def test_a_smoke_folder_that_is_a_file_is_said_to_be_a_file(tmp_path):
    (tmp_path / "run-smoke").write_text("notes")
    with pytest.raises(ConfigError) as info:
        fit(TINY, nproc=1, out_dir=str(tmp_path / "run"), smoke=True)
    assert str(info.value) == (
        f"out_dir '{tmp_path / 'run-smoke'}': {tmp_path / 'run-smoke'} is a file, not a "
        "folder; give an out_dir that is a folder or is not there yet")


@pytest.mark.parametrize("bad", [{"epochs_completed": "two"}, {"global_step": [10]}])
def test_a_summary_with_counts_that_are_not_counts_is_one_line(tmp_path, bad):
    """A rerun into a completed run's folder reads its summary.json in the launching
    process: a ValueError traceback there before."""
    a_run(tmp_path / "run", **bad)
    [(key, value)] = bad.items()
    with pytest.raises(ConfigError) as info:
        fit(TINY, nproc=1, out_dir=str(tmp_path / "run"), epochs=2)
    assert str(info.value) == (
        f"{tmp_path / 'run' / 'summary.json'}: {key!r} is {value!r}, not a count; fix "
        "it, or start over with --no-resume --overwrite")


def test_a_completed_run_whose_files_disagree_with_its_snapshot_is_not_believed(tmp_path):
    """summary.json's counts or config.json edited after the run: the newest snapshot's
    manifest (epoch, step, config digest) says otherwise, so the launching process does
    not answer "already complete" from them (the resume answers from the snapshot)."""
    from engine.plugins.torch_file import TorchFileCheckpointer

    config = {"epochs": 2, "lr": 0.1, "seed": 0}
    TorchFileCheckpointer(tmp_path / "checkpoints").save({"config": config}, epoch=2, step=20)
    summary = {"status": "completed", "epochs_completed": 2, "global_step": 20}

    def files(summary, config):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        (tmp_path / "config.json").write_text(json.dumps(config, indent=1))
        return run_dir.completed_run(str(tmp_path))

    assert files(summary, config) == (summary, config)
    assert files({**summary, "epochs_completed": 5}, {**config, "epochs": 5}) is None
    assert files({**summary, "global_step": 30}, config) is None
    assert files(summary, {**config, "lr": 0.01}) is None
