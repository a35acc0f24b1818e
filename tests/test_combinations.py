"""The feature-combination matrix (issue 40, tools/combinations.py): every row either
trains, is SIGKILLed, restarts and ends with the weights of an uninterrupted run, or is
refused before any worker starts with its one line; and docs/combinations.md is the
matrix's table.

Cost: one killed-and-restarted command per row (``--max-restarts 1``: the restart is in
the same command), and one uninterrupted plain run per distinct arithmetic (parallel
mode, precision, compile, accumulation; the other features off: they must change no
weight), shared by the rows alike in it."""

from __future__ import annotations

import importlib.util
import itertools
import re

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli


def load_matrix():
    spec = importlib.util.spec_from_file_location("combinations", REPO / "tools" /
                                                  "combinations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


matrix = load_matrix()
ROWS = matrix.rows()
REFUSED = matrix.refused_rows()
TIMEOUT_S = 240


def run_row(out, row, *extra: str, env=None):
    return run_cli(REPO / matrix.RECIPE, f"out_dir={out}", *matrix.arguments(row),
                   *matrix.COMMON, *extra, env=env, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """weights_sha256 of a row's uninterrupted plain run (matrix.plain: the features
    that change what a step computes, the others off), made on first use."""
    found = {}
    root = tmp_path_factory.mktemp("references")

    def reference(row) -> str:
        plain = matrix.plain(row)
        key = label(plain)
        if key not in found:
            out = root / key
            proc = run_row(out, plain)
            assert proc.returncode == 0, proc.stderr
            found[key] = read_summary(out)["weights_sha256"]
        return found[key]

    return reference


def label(row) -> str:
    """A row's test id: fsdp-bf16-regional-ac-ema-accum2-dcp-async-memory."""
    words = [row["parallel"], row["precision"], {"off": "eager"}.get(row["compile"],
                                                                      row["compile"])]
    for name, word in (("activation_checkpointing", "ac"), ("ema", "ema"),
                       ("memory tier", "memory")):
        if row[name] == "on":
            words.append(word)
    if row["grad_accum_steps"] != "1":
        words.append(f"accum{row['grad_accum_steps']}")
    return "-".join([*words, row["checkpointer"]])


@pytest.mark.parametrize("row", ROWS, ids=label)
def test_a_row_killed_on_every_rank_restarts_and_ends_with_the_uninterrupted_weights(
        row, references, tmp_path):
    out = tmp_path / "run"
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(matrix.KILLED_AFTER),
                       ENGINE_FAULT_RANK="all", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    proc = run_row(out, row, "--max-restarts", "1", "-p", "tests.fault_plugin", env=fault)
    assert proc.returncode == 0, proc.stderr
    assert "restarting" in proc.stderr, "the fault was not injected"
    tier, step = matrix.resumed_at(row)
    if tier == "memory":
        assert f"resumed from memory at step {step} " in proc.stdout, proc.stdout
    else:
        assert re.search(rf"^resuming from .*: epoch 1, step {step}, .*\(restart 1\)",
                         proc.stdout, re.M), proc.stdout
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"]) == ("completed", matrix.STEPS)
    assert summary["weights_sha256"] == references(row)


def test_under_fsdp_a_rank_whose_memory_is_wiped_resumes_from_its_peers_copy(
        references, tmp_path):
    """fsdp with the memory tier: rank 1 deletes its buffers and the copies it holds of
    rank 0's (engine/memory_ring.py), and is SIGKILLed after step 6 (its node replaced),
    before its step-6 snapshot. Rank 0 holds a copy of rank 1's step-5 snapshot (its
    shards) and sends it: every rank resumes from memory at step 5, and ends with the
    uninterrupted weights (those of a run handed rank 0's shards, or anything but rank
    1's own, would not be). The plain fsdp reference is the matrix's own."""
    row = {**matrix.plain({**ROWS[0], "parallel": "fsdp"}), "memory tier": "on"}
    out = tmp_path / "run"
    fault = engine_env(ENGINE_FAULT_ACTION="kill-wiping-memory", ENGINE_FAULT_RANK="1",
                       ENGINE_FAULT_STEP=str(matrix.KILLED_AFTER),
                       ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    proc = run_row(out, row, "--max-restarts", "1", "-p", "tests.fault_plugin", env=fault)
    assert proc.returncode == 0, proc.stderr
    assert "restarting" in proc.stderr, "the fault was not injected"
    step = matrix.KILLED_AFTER - 1
    assert re.search(rf"^resumed from memory at step {step} \(rank\(s\) 1 had no copy: sent "
                     r"by rank 0; 1 step lost\): epoch 1", proc.stdout, re.M), proc.stdout
    summary = read_summary(out)
    assert summary["resume"]["tier"] == "peer", summary["resume"]
    assert (summary["resume"]["step"], summary["resume"]["source_rank"]) == (step, 0)
    assert (summary["status"], summary["global_step"]) == ("completed", matrix.STEPS)
    assert summary["weights_sha256"] == references(row)


if REFUSED:  # none now: a parametrization over nothing is a skip, which fails the suite
    @pytest.mark.parametrize("row, message", REFUSED, ids=[label(r) for r, _ in REFUSED])
    def test_a_refused_row_is_one_line_before_any_worker_starts(row, message, tmp_path):
        out = tmp_path / "run"
        proc = run_row(out, row)
        assert proc.returncode == 2 and proc.stderr.strip() == (
            f"engine-run: error: {message}"), proc.stderr
        assert not out.exists()  # refused before the run folder was made: no worker ran


def test_every_pair_of_values_is_in_a_row_and_no_row_holds_a_refused_pair():
    names = list(matrix.FACTORS)
    refused = {((a, va), (b, vb)) for a, va, b, vb, _ in matrix.REFUSED}
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(matrix.FACTORS[a], matrix.FACTORS[b]):
            pair = ((a, va), (b, vb))
            where = ROWS if pair not in refused else [r for r, _ in REFUSED]
            assert any(r[a] == va and r[b] == vb for r in where), pair
    for row in ROWS:
        assert not any(row[a] == va and row[b] == vb for (a, va), (b, vb) in refused), row
    assert matrix.rows() == ROWS  # deterministic


def test_the_docs_table_is_the_matrix():
    assert matrix.DOC.read_text() == matrix.table(), (
        "docs/combinations.md is stale: run python tools/combinations.py --write")
