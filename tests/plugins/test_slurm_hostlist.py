"""plugins/slurm_hostlist.py: SLURM's compressed node lists and task counts, read in Python and
checked against ``scontrol show hostnames`` where SLURM is installed."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from engine.errors import LaunchError
from engine.plugins import slurm_hostlist as slurm

EXPANSIONS = [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
    ("r[1-2]n[08-10]", ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]),
    ("x[009-011]", ["x009", "x010", "x011"]),
    ("node-[7],login.cluster", ["node-7", "login.cluster"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
]


@pytest.mark.parametrize("nodelist, hosts", EXPANSIONS)
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.slurm  # with SLURM opted out (ENGINE_TEST_NO_SLURM=1) it may skip
@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not "
                    "installed (tools/slurm_cluster.sh install)")
@pytest.mark.parametrize("nodelist, hosts", EXPANSIONS)
def test_scontrol_agrees(nodelist, hosts):
    assert slurm.scontrol_hostnames(nodelist) == hosts


@pytest.mark.parametrize("nodelist, problem", [
    ("", "it is empty"),
    ("a[1-", "a '[' is never closed"),
    ("a[3-1]", "range '3-1' in 'a[3-1]' runs backwards"),
    ("a[x]", "'x' in 'a[x]' is not a number or a range N-M"),
    ("n[1-2]]", "']' without '[' at position 6"),
    ("[1-2]", "starts with a bracket, not a host name"),
    ("a,,b", "empty entry"),
    ("a[]", "empty brackets in 'a[]'"),
    ("a b", "'a b' (from 'a b') is not a host name"),
])
def test_bad_nodelists_say_why(nodelist, problem):
    with pytest.raises(slurm.NodelistError) as err:
        slurm.expand_nodelist(nodelist)
    assert problem in str(err.value)


def test_hostnames_error_names_the_variable(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol to fall back on
    with pytest.raises(LaunchError) as err:
        slurm.hostnames("gpu[01-", "SLURM_STEP_NODELIST")
    assert str(err.value) == (
        "SLURM_STEP_NODELIST='gpu[01-' does not parse as a SLURM node list: a '[' is never "
        "closed (expected e.g. 'gpu[01-03,07],cpu5')")


def fake_scontrol(folder, output: str) -> None:
    """A stand-in for scontrol on PATH (the SLURM tool, not the code under test)."""
    path = folder / "scontrol"
    path.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_scontrol_is_the_fallback_for_forms_the_parser_refuses(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, "weird1\\nweird2\\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm.hostnames("weird[1-2]{x}") == ["weird1", "weird2"]


def test_scontrol_wins_a_disagreement_with_a_warning(tmp_path, monkeypatch, capsys):
    fake_scontrol(tmp_path, "n2\\nn1\\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm.hostnames("n[1-2]") == ["n2", "n1"]
    assert "scontrol show hostnames gives n2 n1, the parser here n1 n2" in (
        capsys.readouterr().err)


def test_scontrol_garbage_is_ignored(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, "a]\\n")  # what SLURM 22.05 prints for "a[1-"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(LaunchError, match="does not parse"):
        slurm.hostnames("a[1-")


@pytest.mark.parametrize("text, counts", [
    ("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2]),
])
def test_tasks_per_node(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


def test_tasks_per_node_that_does_not_parse():
    with pytest.raises(LaunchError, match=r"SLURM_TASKS_PER_NODE='2\(3\)' does not parse"):
        slurm.expand_tasks_per_node("2(3)")


def test_master_port_from_the_job_id():
    assert slurm.master_port_for_job("123456") == 15000 + 3456
    assert slurm.master_port_for_job("7") == 15007
    port = slurm.master_port_for_job("abc")
    assert 15000 <= port < 25000 and port == slurm.master_port_for_job("abc")


def test_the_cpus_of_each_task_are_those_the_job_asked_for():
    """SLURM_CPUS_PER_TASK, which every process of the allocation sees: what spawn,
    torchrun and legacy share inside one (their tests), and the slurm launcher's task."""
    assert slurm.allocated_cpus({"SLURM_CPUS_PER_TASK": "12"}) == (12, "SLURM_CPUS_PER_TASK")
    for unasked in ({}, {"SLURM_CPUS_PER_TASK": ""}, {"SLURM_CPUS_PER_TASK": "0"}):
        assert slurm.allocated_cpus(unasked) is None
