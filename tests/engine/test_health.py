"""No hangs: when one rank raises, dies or hangs, the others stop in bounded time and
the message names the rank."""

from __future__ import annotations

import re
import time

from tests.conftest import REPO, engine_env, read_summary, run_cli
from tests.plugins.launch_runs import LATE_S

RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")


def run_with_fault(tmp_path, action: str, *extra: str, step: int = 3, rank: int = 1,
                   **env: str):
    env = engine_env(ENGINE_FAULT_ACTION=action, ENGINE_FAULT_STEP=str(step),
                     ENGINE_FAULT_RANK=str(rank), **env)
    started = time.monotonic()
    proc = run_cli(RECIPE, f"out_dir={tmp_path}", "--nproc", "2", "-p", "tests.fault_plugin",
                   *extra, env=env, timeout=200)
    return proc, time.monotonic() - started


def test_a_rank_that_raises_is_named_and_the_run_stops(tmp_path):
    proc, _ = run_with_fault(tmp_path, "raise")
    assert proc.returncode != 0
    assert ("[rank 1] error: plugin 'tests.fault_plugin' (hook engine_train_step_end): "
            "RuntimeError: injected failure on rank 1") in proc.stderr
    assert "(rank 1) exited with code 1" in proc.stderr
    # Rank 0's own collective error (gloo's "Connection closed by peer") is an echo of
    # rank 1's: not printed (issue 29).
    assert "[rank 0]" not in proc.stderr, proc.stderr
    # Rank 0 records the failure when it notices the lost rank before it is stopped.
    assert (not (tmp_path / "summary.json").exists()
            or read_summary(tmp_path)["status"] == "failed")


def test_a_rank_that_dies_is_named(tmp_path):
    proc, _ = run_with_fault(tmp_path, "kill")
    assert proc.returncode != 0
    assert "worker with local rank 1 (rank 1) was killed by SIGKILL" in proc.stderr


def test_a_hung_rank_is_named_within_the_collective_timeout(tmp_path):
    proc, elapsed = run_with_fault(tmp_path, "hang", "timeout_s=4")
    assert proc.returncode != 0
    # Rank 0 gives up after the 4 s collective timeout and names the silent rank...
    assert "[rank 0] error: rank 0: a collective operation failed at step" in proc.stderr
    assert "rank(s) 1 stopped answering (timeout 4s)" in proc.stderr
    # gloo's text, less its source file and advice, in summary.json as on the console.
    said = re.search(r"^\[rank 0\] error: (.*)$", proc.stderr, re.M)[1]
    assert re.search(r"\(timeout 4s\): Timed out waiting 4000ms for \w+ operation to "
                     r"complete$", said), said
    assert read_summary(tmp_path)["error"] == f"RunError: {said}"
    # ...the launcher's last line names it too, as the one it had to terminate...
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "worker with local rank 1 (rank 1) was still running 2s after that and was "
        "terminated")
    # ...and the whole run ends: start-up, the timeout, the roll call and the launcher's
    # two grace periods (2 s each: SIGTERM, then SIGKILL), nowhere near "forever".
    assert elapsed < 4 + 2 + 2 * 2 + 60, elapsed


def test_a_stopped_rank_0_is_named_and_the_job_ends_within_the_timeout(tmp_path):
    """With rank 0 stopped (SIGSTOP), rank 1 must not wait in the roll call (a side
    group without a timeout waits torch's default), nor the launcher for the stopped
    process: the job ends within the timeout."""
    marker = tmp_path / "stopped"
    proc, _ = run_with_fault(tmp_path, "stop", "timeout_s=4", rank=0,
                             ENGINE_FAULT_ONCE=str(marker))
    ended = time.time()
    assert proc.returncode == 1
    assert "rank 1: a collective operation failed at step 3: rank(s) 0 stopped answering" \
        in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "worker with local rank 0 (rank 0) stopped answering: its process was stopped "
        "(SIGSTOP or a debugger), so it was killed"), proc.stderr
    # The fault plugin wrote the marker just before stopping: timeout_s + LATE_S from
    # there (a wait without the timeout would be torch's default, 30 minutes).
    print(f"ended {ended - marker.stat().st_mtime:.1f}s after the stop (timeout_s=4)")
    assert ended - marker.stat().st_mtime < 4 + LATE_S


def test_every_way_gloo_reports_a_lost_peer_counts_as_a_failed_collective():
    """The messages of real runs with a rank stopped or killed: after the first
    timeout, gloo fails a collective started earlier (a check point's all-reduce) with
    "Application timeout caused pair closure"; unrecognised, the surviving rank printed
    a traceback and never named (nor, under torchrun or srun, ended) the stopped rank."""
    from engine.health import is_collective_failure

    for text in ("Application timeout caused pair closure",
                 "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv",
                 "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1"):
        assert is_collective_failure(RuntimeError(text)), text
    assert not is_collective_failure(RuntimeError("grad can be implicitly created only "
                                                  "for scalar outputs"))


def test_a_closed_connection_is_an_echo_and_a_timeout_is_a_roll_call():
    """A CI run: rank 1 raised, and rank 0's collective failed with "Connection reset by
    peer"; its roll call then waited 2 s for rank 1, still on its way out, named it as
    one that stopped answering, and rank 0's echo was printed. A closed connection
    needs no roll call: the peer's own error names it."""
    from engine.health import peer_is_gone

    for text in ("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:61617: "
                 "Connection reset by peer",
                 "[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1",
                 "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Broken pipe"):
        assert peer_is_gone(RuntimeError(text)), text
    for text in ("Application timeout caused pair closure",
                 "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv"):
        assert not peer_is_gone(RuntimeError(text)), text


RELEASE_PROBE = """
import sys
import torch.distributed as dist
from engine import distributed, health
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
health.gloo_group("memory ring", 30.0)
distributed.destroy()
print(not health._GROUPS, dist.is_initialized())
"""


def test_destroy_releases_the_side_group_before_the_world_group(tmp_path):
    """A side group still referenced at interpreter exit was torn down in C++
    finalisation, where gloo aborted the process (SIGABRT) after a finished
    run. The loop that shows it is tools/exit_loop.py; this checks the teardown order's
    outcome: nothing of the side group is left when destroy() returns."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", RELEASE_PROBE, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (0, ["True", "False"]), proc.stderr



def test_the_roll_call_meets_on_the_store_and_names_a_rank_that_does_not_come(tmp_path):
    """The roll call and the epoch barrier need no group of their own: the ranks meet on
    the store they met on at the start, and a meeting's keys go at the next. Every rank
    there: none missing, on every rank. A
    rank that does not come within rank 0's bound is named, on rank 0 and on the ranks
    that came; the epoch barrier raises with its name."""
    from tests.engine.memory.test_memory_snapshot import forked_ranks

    forked_ranks(3, _roll_call_rank, str(tmp_path / "store"), 3)


def _roll_call_rank(store: str, world_size: int, rank: int) -> None:
    import json

    import pytest
    import torch.distributed as dist

    from engine import distributed, health
    from engine.errors import RunError

    dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                            world_size=world_size)
    health.prepare(dist.FileStore(store + ".health", world_size))
    assert health.missing_ranks() == []
    health.epoch_barrier(30.0)
    health.epoch_barrier(30.0)
    # The first barrier's keys are gone (one per rank and epoch would pile up): each rank's
    # own at the second, rank 0's post once every rank had come to the second.
    assert not health._STORE.check([f"epoch/1/{rank}"])
    if rank == 0:
        assert not health._STORE.check(["epoch/1/missing"]) and health._STORE.check(
            ["epoch/2/missing"])
    if rank == 2:  # stays away from the next roll call; sees what rank 0 posted
        health._STORE.wait(["roll_call/2/missing"])
        assert json.loads(health._STORE.get("roll_call/2/missing")) == [2]
    else:
        assert health.missing_ranks(timeout_s=2.0) == [2]  # the others wait 2 s more
        with pytest.raises(RunError, match=r"rank\(s\) 2 did not reach the end of the epoch"):
            health.epoch_barrier(2.0)
    distributed.destroy()
    assert health._STORE is None
