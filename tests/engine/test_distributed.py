"""engine/distributed.py: process-group init with real gloo processes on this machine:
env://, tcp:// and file://, and every way it can go wrong ending in time with a message
that names the master and the ranks that never came."""

from __future__ import annotations

import json
import re
import socket
import textwrap
import time

import pytest

from engine.launcher import free_port
from engine.testing import start_python
from tests.conftest import REPO, engine_env

TIMEOUT_S = 4
#: Start-up of a process that imports torch, on a busy 2-core machine.
STARTUP_SLACK_S = 60
#: How late past its timeout a failing init may end on a loaded 2-core machine. A hang
#: would be far later (the store's own timeout is minutes); 5 s was too tight there.
LATE_S = 15

RANK_SCRIPT = textwrap.dedent("""
    # One process, several inits in a row (starting processes is the slow part):
    # argv[1] is a JSON list of cases, each one World plus a timeout.
    import json, os, pathlib, sys, time
    import torch, torch.distributed as dist
    from engine import distributed
    from engine.errors import LaunchError
    from engine.world import World

    # Start the clock when every process of the test has imported torch: on a busy
    # machine that alone can take longer than the short timeouts tested here.
    ready = pathlib.Path(os.environ["READY_DIR"])
    (ready / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < int(os.environ["READY_COUNT"]):
        assert time.monotonic() < deadline, "the other test processes never started"
        time.sleep(0.05)

    for case in json.loads(sys.argv[1]):
        world = World(rank=case["rank"], local_rank=case["rank"],
                      world_size=case["world_size"], local_world_size=case["world_size"],
                      master_addr=case.get("addr", "127.0.0.1"), master_port=case["port"],
                      init_method=case.get("init", "env://"), host="testhost")
        started = time.monotonic()
        try:
            distributed.init(world, "gloo", case.get("timeout", %(timeout)s))
            total = torch.tensor([float(world.rank + 1)])
            dist.all_reduce(total)
            result = {"ok": True, "sum": total.item()}
        except LaunchError as exc:
            result = {"ok": False, "error": str(exc)}
        result["seconds"] = time.monotonic() - started
        print("RESULT " + json.dumps(result), flush=True)
        if case.get("crash"):
            os._exit(1)  # like a killed job: the file:// rendezvous file stays behind
        distributed.destroy()
""") % {"timeout": TIMEOUT_S}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("distributed") / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


def start_together(script, *processes: list[dict]) -> list:
    """One process per list of cases, side by side (forked from the warm-start server,
    which has torch imported); their inits start once all are up."""
    ready = script.parent / f"ready-{time.monotonic_ns()}"
    ready.mkdir()
    env = engine_env(READY_DIR=str(ready), READY_COUNT=str(len(processes)))
    procs = [start_python([script, json.dumps(cases)], cwd=REPO, env=env)
             for cases in processes]
    for p in procs:
        p.ready_dir = ready
    return procs


def finish(proc) -> list[dict]:
    """One result per case; each has "stderr": everything the process printed there."""
    out, err = proc.communicate(timeout=STARTUP_SLACK_S + 20 * TIMEOUT_S)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {proc.returncode}):\n{out}\n{err}"
    return [dict(json.loads(line[len("RESULT "):]), stderr=err) for line in lines]


#: Longer than distributed.NOTICE_AFTER_S: a rank that waits says so before it gives up.
NOTICED_TIMEOUT_S = 7


@pytest.fixture(scope="module")
def window(script, tmp_path_factory):
    """The independent cases below in one start of five processes (starting processes
    that import torch is the slow part, and the timeouts run side by side): two ranks
    that meet by env://, tcp:// and file://, then disagree about the world size; ranks
    0 and 1 of a world of 3 whose rank 2 never comes; one rank that meets a closed
    master port, an unresolvable master and a taken port. Returns each one's results."""
    meet = [f"tcp://127.0.0.1:{free_port()}", f"file://{tmp_path_factory.mktemp('rdzv')}/f"]
    ports = {name: free_port() for name in ("meet", "disagree", "never", "closed")}
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        names = ["meet0", "meet1", "never0", "never1", "master"]
        processes = start_together(script, *[
            [dict(rank=r, world_size=2, port=ports["meet"], init=init)
             for init in ["env://", *meet]] +
            [dict(rank=r, world_size=2 + r, port=ports["disagree"])] for r in range(2)], *[
            [dict(rank=r, world_size=3, port=ports["never"], timeout=NOTICED_TIMEOUT_S)]
            for r in range(2)], [
            dict(rank=1, world_size=2, port=ports["closed"], timeout=NOTICED_TIMEOUT_S),
            dict(rank=1, world_size=2, port=29500, addr="no-such-host.invalid"),
            dict(rank=0, world_size=2, port=taken)])
        results = dict(zip(names, map(finish, processes)))
    return results, dict(ports, taken=taken)


def test_two_ranks_meet_by_env_tcp_and_file(window):
    results, _ = window
    for rank in ("meet0", "meet1"):
        assert [(r["ok"], r.get("sum")) for r in results[rank][:3]] == [(True, 3.0)] * 3, \
            results[rank]


def test_a_rank_that_never_comes_is_named_in_time(window):
    found, ports = window
    results, port = [found["never0"][0], found["never1"][0]], ports["never"]
    message = (f"rank 2 of 3 never joined the rendezvous at 127.0.0.1:{port} within "
               f"{NOTICED_TIMEOUT_S}s (timeout_s); check that every rank was started")
    assert results[0]["error"].startswith(f"rank 0: {message}")
    assert results[1]["error"].startswith(f"rank 1: rank 0 reports: {message}")
    for r in results:
        print(f"rank failed {r['seconds']:.1f}s into a {NOTICED_TIMEOUT_S}s timeout")
        assert r["seconds"] < NOTICED_TIMEOUT_S + LATE_S, r
    # A few seconds into the wait, each said what it waits for and until when.
    assert_waiting_line(results[0]["stderr"],
                        f"rank 0: waiting for rank 2 of 3 to join the rendezvous at "
                        f"127.0.0.1:{port}")
    assert_waiting_line(results[1]["stderr"],
                        f"rank 1: waiting for rank 0 to complete the rendezvous at "
                        f"127.0.0.1:{port}")
    # Rank 0 printed the world table as it saw it.
    table = results[0]["stderr"].split("world (as rank 0 saw it when init failed):\n")[1]
    assert [line.split()[:5] for line in table.splitlines()[:4]] == [
        ["rank", "local", "node", "host", "device"], ["0", "0", "0", "testhost", "cpu"],
        ["1", "1", "0", "testhost", "cpu"], ["2", "2", "0", "testhost", "cpu"]]


def test_a_master_that_is_not_there_fails_in_time_and_says_where(window):
    results, ports = window
    unreachable, unresolvable, port_taken = results["master"]
    closed, taken = ports["closed"], ports["taken"]
    assert unreachable["error"].startswith(
        f"rank 1: cannot reach the master at 127.0.0.1:{closed} within "
        f"{NOTICED_TIMEOUT_S}s (last attempt: Connection refused)")
    print(f"unreachable: {unreachable['seconds']:.1f}s, unresolvable: "
          f"{unresolvable['seconds']:.1f}s")
    assert NOTICED_TIMEOUT_S - 0.5 < unreachable["seconds"] < NOTICED_TIMEOUT_S + LATE_S
    # It did not wait in silence: a few seconds in, it said where and until when.
    assert_waiting_line(unreachable["stderr"], f"rank 1: waiting for the master at "
                                               f"127.0.0.1:{closed} (Connection refused)")
    assert unresolvable["error"].startswith(
        "rank 1: the master address 'no-such-host.invalid' does not resolve")
    assert unresolvable["seconds"] < TIMEOUT_S + LATE_S
    assert port_taken["error"] == (
        f"rank 0: master port {taken} on testhost is already in use; choose another with "
        "--master-port PORT or MASTER_PORT=PORT")


def test_ranks_that_disagree_about_the_world_size(window):
    found, _ = window
    results = [found["meet0"][3], found["meet1"][3]]
    message = ("the ranks disagree about the world size: rank 0 has 2, rank 1 has 3 "
               "(check WORLD_SIZE / --nnodes / --nproc on every node)")
    assert results[0]["error"] == f"rank 0: {message}"
    assert results[1]["error"] == f"rank 1: rank 0 reports: {message}"


def assert_waiting_line(stderr: str, waiting_for: str) -> None:
    """Exactly one line says what the rank waits for, and until when: within the wait."""
    lines = [line for line in stderr.splitlines() if line.startswith(waiting_for)]
    assert len(lines) == 1, stderr
    match = re.fullmatch(r", until (\d\d):(\d\d):(\d\d) \S+ \(timeout_s=(\S+)\)",
                         lines[0][len(waiting_for):])
    assert match, lines[0]
    assert match.group(4) == f"{NOTICED_TIMEOUT_S:g}"
    hours, minutes, seconds = map(int, match.group(1, 2, 3))
    until = (hours * 60 + minutes) * 60 + seconds
    now = time.localtime()
    # Signed, midnight aside. A rank that rank 0's failure released before its own
    # deadline ends before its "until", which may then still be ahead (by its timeout
    # at most): a rank that started waiting a moment after rank 0.
    ago = ((now.tm_hour * 60 + now.tm_min) * 60 + now.tm_sec - until + 43200) % 86400 - 43200
    assert -NOTICED_TIMEOUT_S - 1 <= ago < STARTUP_SLACK_S, (lines[0],
                                                             time.strftime("%H:%M:%S"))


def test_stale_file_rendezvous_from_a_crashed_run_does_not_break_the_next(script, tmp_path):
    rdzv = tmp_path / "rdzv"
    case = dict(world_size=2, port=1, init=f"file://{rdzv}")
    crashed = [finish(p)[0] for p in start_together(
        script, *[[dict(case, rank=r, crash=True)] for r in range(2)])]
    assert all(r["ok"] for r in crashed), crashed
    assert rdzv.exists()  # the crashed run left its keys behind
    # The next run: rank 1 starts first and reads the dead run's session; it must wait
    # for the live one instead of joining the dead one. The store is append-only: once
    # the dead session's "rank 1 joined" key is in the file twice, the live rank 1 has
    # joined the dead session and is polling it (the case under test) when rank 0 starts.
    joined_dead = re.compile(rb"engine/[0-9a-f]{16}/rank/1")
    assert len(joined_dead.findall(rdzv.read_bytes())) == 1
    (late,) = start_together(script, [dict(case, rank=1, timeout=60)])
    deadline = time.monotonic() + STARTUP_SLACK_S
    while len(joined_dead.findall(rdzv.read_bytes())) < 2:
        assert late.poll() is None, finish(late)
        assert time.monotonic() < deadline, "rank 1 never joined the dead run's session"
        time.sleep(0.05)
    (early,) = start_together(script, [dict(case, rank=0, timeout=60)])
    results = [finish(early)[0], finish(late)[0]]
    assert [(r["ok"], r.get("sum")) for r in results] == [(True, 3.0), (True, 3.0)], results


@pytest.mark.parametrize("raw, plain", [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
     "closed by peer [127.0.0.1]:52421. This is typically caused by a remote worker "
     "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️",
     "Connection closed by peer [127.0.0.1]:52421"),
    ("DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Broken pipe",
     "DistBackendError: Broken pipe"),
    ("Socket Timeout", "Socket Timeout"),
])
def test_gloos_text_loses_its_source_file_and_advice(raw, plain):
    from engine.distributed import gloo_text

    assert gloo_text(raw) == plain
