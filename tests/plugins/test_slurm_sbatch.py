"""``engine-run sbatch``: the batch script for the seeds' two layouts, and bad input.
(tests/plugins/test_slurm.py submits a generated script to the real cluster.)"""

from __future__ import annotations

import subprocess

import pytest

from engine.cli import main
from tests.conftest import REPO

RECIPE = str(REPO / "recipes" / "cifar_ddp.py")


def sbatch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["sbatch", *args])
    out, err = capsys.readouterr()
    return code, out, err


def directives(script: str) -> dict[str, str]:
    found = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            found[key] = value
    return found


def srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


def test_one_task_per_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, err = sbatch(capsys, RECIPE, "epochs=5", "--nodes", "2", "--gpus-per-node",
                             "4", "--cpus-per-task", "16", "--time", "04:00:00")
    assert code == 0
    assert directives(script) == {
        "job-name": "cifar_ddp", "nodes": "2", "ntasks-per-node": "4", "cpus-per-task": "16",
        "gres": "gpu:4", "time": "04:00:00", "chdir": str(tmp_path),
        "output": "runs/cifar_ddp/slurm-%j.out", "open-mode": "append",
        "signal": "USR1@90", "requeue": ""}
    engine_run = srun_line(script).split()[2]
    assert engine_run.endswith("/engine-run") and engine_run.startswith("/")
    assert srun_line(script) == (f"srun --kill-on-bad-exit=1 {engine_run} {RECIPE} epochs=5 "
                                 "--launcher slurm")
    # Printing writes nothing, not even the log folder: the script says to create it.
    assert not (tmp_path / "runs").exists()
    assert "# Submit with: mkdir -p runs/cifar_ddp && sbatch THIS_FILE\n" in script
    assert err == ("note: the log folder runs/cifar_ddp does not exist yet and SLURM does "
                   "not create it: submit with `mkdir -p runs/cifar_ddp && sbatch THIS_FILE`\n")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert script.startswith("#!/bin/bash\n# cifar_ddp: 2 node(s) x 4 process(es) = 8 ranks")


def test_one_task_per_node(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, _ = sbatch(capsys, RECIPE, "out_dir=/tmp/some where", "--nodes", "2",
                             "--gpus-per-node", "4", "--cpus-per-task", "16", "--layout",
                             "task-per-node", "--signal-seconds", "120", "--", "--threads",
                             "4")
    assert code == 0
    found = directives(script)
    assert (found["ntasks-per-node"], found["cpus-per-task"], found["gres"]) == (
        "1", "16", "gpu:4")
    assert found["signal"] == "USR1@120"
    assert found["output"] == "/tmp/some where/slurm-%j.out"
    assert srun_line(script).endswith(
        f"{RECIPE} 'out_dir=/tmp/some where' --launcher slurm --nproc 4 --threads 4")


def test_cpu_only_and_no_signal(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "cifar_ddp").mkdir(parents=True)
    code, script, err = sbatch(capsys, RECIPE, "--nodes", "3", "--signal-seconds", "0",
                               "--procs-per-node", "2")
    assert code == 0
    assert "# Submit with: sbatch THIS_FILE\n" in script and err == ""  # the folder exists
    found = directives(script)
    assert "gres" not in found and "signal" not in found and "requeue" not in found
    assert found["ntasks-per-node"] == "2"


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes 0 must be >= 1"),
    (["--nodes", "1", "--layout", "per-gpu"],
     "--layout 'per-gpu' is not one of: task-per-gpu, task-per-node"),
    (["--nodes", "1", "--gpus-per-node", "4", "--procs-per-node", "8"],
     "--procs-per-node 8 is more than --gpus-per-node 4; parallel mode ddp needs one GPU "
     "per process"),
    (["--nodes", "1", "--cpus-per-task", "0"], "--cpus-per-task 0 must be >= 1"),
    (["--nodes", "1", "epochz=3"], "unknown config key 'epochz'"),
])
def test_bad_input_is_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = sbatch(capsys, RECIPE, *args)
    assert code == 2 and out == ""
    assert err.startswith(f"engine-run: error: {message}")
    assert err.count("\n") == 1


def test_a_run_folder_pattern_logs_to_its_fixed_parent(capsys, tmp_path, monkeypatch):
    """out_dir=runs/x/version_{version} is filled when the job starts (every requeue of
    the job continues the newest version): SLURM's log cannot go there, nor into a folder
    literally named version_{version}."""
    monkeypatch.chdir(tmp_path)
    code, script, _ = sbatch(capsys, RECIPE, "out_dir=runs/x/version_{version}",
                             "--nodes", "1")
    assert code == 0
    assert directives(script)["output"] == "runs/x/slurm-%j.out"
    assert "'out_dir=runs/x/version_{version}'" in srun_line(script)
