"""engine/world.py: the checks a world passes before any process group exists, and the
world table."""

from __future__ import annotations

import os

import pytest

from engine.errors import LaunchError
from engine.world import (CpuShare, World, check_init_method, format_world_table,
                          machine_share, share_cpus, usable_cpus, whole_world)


def world(**kw) -> World:
    base = dict(rank=0, local_rank=0, world_size=2, local_world_size=2, host="h0",
                launcher="spawn")
    base.update(kw)
    return World(**base)


@pytest.mark.parametrize("kw, message", [
    (dict(rank=2), "rank 2 is outside world size 2 (spawn); ranks run from 0 to 1"),
    (dict(rank=-1), "rank -1 is outside world size 2"),
    (dict(local_rank=2), "local rank 2 is outside local world size 2 (spawn)"),
    (dict(local_world_size=3), "local world size 3 is larger than world size 2"),
    (dict(world_size=0, local_world_size=0), "world size 0 must be >= 1"),
    (dict(node_rank=1), "node rank 1 is outside 1 node(s) (spawn)"),
    (dict(master_port=70000), "master port 70000 is not a valid TCP port (1-65535)"),
    (dict(init_method="tcp://host"), "init method 'tcp://host' is not one of env://, "
                                     "tcp://HOST:PORT, file:///shared/path"),
])
def test_inconsistent_numbers_are_one_line_errors(kw, message):
    with pytest.raises(LaunchError) as err:
        world(**kw).check()
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("url", ["env://", "tcp://10.0.0.1:29500", "tcp://[::1]:23456",
                                 "file:///shared/rdzv"])
def test_init_methods_accepted(url):
    check_init_method(url)


@pytest.mark.parametrize("url", ["file://relative/path", "tcp://host:0", "udp://h:1", ""])
def test_init_methods_refused(url):
    with pytest.raises(LaunchError, match="file:// needs an absolute path"):
        check_init_method(url)


def test_rendezvous_names_the_store():
    assert world(master_addr="n1", master_port=15001).rendezvous == "n1:15001"
    assert world(init_method="tcp://10.1.1.1:2345").rendezvous == "10.1.1.1:2345"
    assert world(init_method="file:///tmp/x").rendezvous == "file:///tmp/x"


def test_whole_world_from_the_layout_keeps_this_nodes_rows():
    # Node 1 of three uneven nodes (SLURM's "2,1,2"): ranks 2 on node 1.
    mine = world(rank=2, local_rank=0, world_size=5, local_world_size=1, node_rank=1,
                 num_nodes=3, host="gpu02", master_addr="gpu01",
                 layout=(("gpu01", 2), ("gpu02", 1), ("gpu03", 2)))
    table = whole_world([mine])
    assert [(w.rank, w.local_rank, w.node_rank, w.host) for w in table] == [
        (0, 0, 0, "gpu01"), (1, 1, 0, "gpu01"), (2, 0, 1, "gpu02"),
        (3, 0, 2, "gpu03"), (4, 1, 2, "gpu03")]
    assert table[2] is mine


def test_whole_world_without_layout_marks_unknown_hosts():
    mine = world(rank=2, local_rank=0, world_size=4, node_rank=1, num_nodes=2,
                 master_addr="10.0.0.1")
    table = whole_world([mine])
    assert [w.host for w in table] == ["10.0.0.1", "10.0.0.1", "h0", "h0"]
    three = world(rank=0, world_size=6, local_world_size=2, num_nodes=3)
    assert [w.host for w in whole_world([three])] == ["h0", "h0", "?", "?", "?", "?"]


def test_world_table_columns():
    worlds = [world(rank=r, local_rank=r, master_addr="n1", master_port=15000)
              for r in range(2)]
    text = format_world_table(worlds, {0: "cuda:0", 1: "cuda:1"})
    lines = [line.split() for line in text.splitlines()]
    assert lines == [["rank", "local", "node", "host", "device", "master"],
                     ["0", "0", "0", "h0", "cuda:0", "n1:15000"],
                     ["1", "1", "0", "h0", "cuda:1", "n1:15000"]]


# ------------------------------------------------------------------- the CPU rule


def test_the_default_rule_shares_this_machines_cpus_among_the_local_processes(monkeypatch):
    """A launcher that does not say (a third-party one) gets the default: the CPUs this
    process may run on, shared by the processes of its node."""
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    affinity = len(os.sched_getaffinity(0))
    assert world(local_world_size=1, world_size=1).cpu_share() == CpuShare(
        affinity, f"{affinity} CPUs (affinity) for this process")
    two = world(world_size=4, local_world_size=2).cpu_share()
    assert two.count == max(1, affinity // 2)
    assert two.reason == (f"{affinity} CPUs (affinity) shared by 2 local processes = "
                          f"{max(1, affinity // 2)} each")
    # The world knows no scheduler: inside a SLURM allocation the launcher's answer
    # (World.cpus) carries its CPUs (spawn, torchrun and legacy: tests/plugins).
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert world(world_size=4, local_world_size=2).cpu_share() == two


def test_the_launchers_answer_wins_over_the_default():
    mine = CpuShare(7, "7 CPUs (my scheduler) for this process")
    assert world(cpus=mine).cpu_share() is mine


def test_a_share_is_at_least_one_cpu_and_says_where_it_comes_from():
    assert share_cpus(1, "SLURM_CPUS_PER_TASK", 1) == CpuShare(
        1, "1 CPU (SLURM_CPUS_PER_TASK) for this process")
    # More processes than CPUs: each still gets one thread.
    assert share_cpus(2, "affinity", 3) == CpuShare(
        1, "2 CPUs (affinity) shared by 3 local processes = 1 each")
    with pytest.raises(ValueError, match="'count' must be >= 1: 0"):
        CpuShare(0, "a launcher that counted nothing")


def test_usable_cpus_are_the_launchers_allocation_else_the_affinity_mask():
    """The world knows no scheduler: a launcher inside a SLURM allocation passes what
    plugins/slurm_hostlist.py read (tests/plugins/test_slurm_hostlist.py)."""
    assert usable_cpus((12, "SLURM_CPUS_PER_TASK")) == (12, "SLURM_CPUS_PER_TASK")
    assert usable_cpus() == (len(os.sched_getaffinity(0)), "affinity")
    assert machine_share(4, (12, "SLURM_CPUS_PER_TASK")).shared == (12, "SLURM_CPUS_PER_TASK")
