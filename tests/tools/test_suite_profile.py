"""tools/suite_profile.py and the recorder it reads (tests/profiling.py): the kinds of
process named from command lines, and the tables summed from the records."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO
from tests.profiling import IN_PROCESS, kind

_spec = importlib.util.spec_from_file_location("suite_profile",
                                               REPO / "tools" / "suite_profile.py")
suite_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_profile)

PY = "/venv/bin/python3"


@pytest.mark.parametrize("command, parent, of_worker, expected", [
    (f"{PY} -c from engine.testing.warm_start import serve; serve()", "", True, "warm-start server"),
    (f"{PY} -c from engine.testing.warm_start import serve; serve()", "warm-start server", False,
     "forked run (warm start) and its workers"),
    (f"{PY} /venv/bin/torchrun --standalone /venv/bin/engine-run r.py", "", True,
     "torchrun agent"),
    (f"{PY} -u /venv/bin/engine-run r.py", "torchrun agent", False, "torchrun worker"),
    (f"{PY} -m torch.distributed.launch --use_env x.py", "", True, "legacy launch"),
    (f"{PY} -u x.py --local-rank=0", "legacy launch", False, "legacy launch worker"),
    (f"{PY} -c import engine.testing as t; t.save_until_killed(*sys.argv[1:])", "", True,
     "killed writer (checkpointer contract)"),
    (f"{PY} /venv/bin/engine-run r.py", "", True, "engine-run (fresh interpreter)"),
    (f"{PY} -m engine r.py", "", True, "engine-run (fresh interpreter)"),
    (f"{PY} tools/bench_startup.py", "", True, "other Python (tools, scripts, pip)"),
    ("srun -N 2 engine-run r.py", "", True, "other (srun/sbatch clients, shells)"),
])
def test_kinds_are_named_from_the_command_and_the_parent(command, parent, of_worker,
                                                         expected):
    assert kind(command, parent, "", False, of_worker) == expected


def test_an_async_writer_is_a_child_of_its_fork_server_with_the_same_command():
    server = f"{PY} -B -c from multiprocessing.forkserver import main; main(9, 11)"
    assert kind(server, "forked run (warm start) and its workers", "x", False, False) == \
        "fork server of the async checkpointer"
    assert kind(server, "fork server of the async checkpointer", server, False, False) == \
        "async checkpointer writer (forked)"


def test_a_task_of_a_slurm_job_is_one_whatever_it_runs():
    assert kind(f"{PY} -u /venv/bin/engine-run r.py", "", "", True, False) == \
        "SLURM job (srun tasks, batch scripts)"


def record(test, worker, start, wall, kinds, outcome="passed"):
    return {"test": test, "worker": worker, "start": start, "wall_s": wall,
            "outcome": outcome, "own_cpu_s": kinds.get(IN_PROCESS, 0.0),
            "reaped_cpu_s": 1.0, "forked_cpu_s": 0.0,
            "kinds": {k: {"processes": 1, "cpu_s": v} for k, v in kinds.items()}}


def test_the_tables_sum_kinds_workers_and_modules(tmp_path, capsys):
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in [
        record("tests/a.py::t1", "gw0", 100.0, 10.0, {"torchrun worker": 6.0, IN_PROCESS: 1.0}),
        record("tests/a.py::t2", "gw0", 110.0, 5.0, {"torchrun worker": 2.0}),
        record("test_inner.py::t", "gw0", 110.0, 99.0, {"torchrun worker": 99.0}),
    ]) + "\n")
    (tmp_path / "gw1.jsonl").write_text(json.dumps(
        record("tests/b.py::t", "gw1", 101.0, 30.0, {"SLURM job (srun tasks, batch scripts)":
                                                      4.0}, outcome="error")) + "\n")
    assert suite_profile.main([str(tmp_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 tests failed or erred" in out and "tests/b.py::t" in out
    assert "3 tests; sampled every 0.1 s: 13 s in all, 4 s of them in SLURM jobs" in out
    lines = out.splitlines()
    torchrun = next(line.split() for line in lines if line.startswith("torchrun worker"))
    assert torchrun[2:6] == ["2", "8.0", "62%", "2"]  # the inner pytest's record left out
    gw1 = next(line.split() for line in lines if line.startswith("gw1"))
    assert gw1[1:4] == ["1", "30.0", "31.0"]  # ended 31 s after the first test (gw0's) began
    assert "tests/b.py" in out and "tests/a.py" in out


def test_no_records_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no records in .*ENGINE_TEST_PROFILE="):
        suite_profile.main([str(tmp_path)])
