"""examples/gzip_store.py: the checkpointer backend of docs/plugins.md, one file that
subclasses the store base. The docs show this very file, it passes engine.testing's
checkpointer contract, and a real run stores its snapshots with it and resumes from one
to the weights of a run that was never interrupted."""

from __future__ import annotations

import re

from engine.testing import CheckpointerContract
from examples.gzip_store import GzipStore
from tests.conftest import REPO, read_summary, run_cli

EXAMPLE = REPO / "examples" / "gzip_store.py"
RECIPE = str(REPO / "tests" / "recipes" / "tiny_regression.py")


def test_the_docs_show_this_very_file():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "plugins.md").read_text(),
                        re.S)
    (shown,) = [block for block in blocks if "class GzipStore(SnapshotStore)" in block]
    assert shown == EXAMPLE.read_text()


class TestGzipStore(CheckpointerContract):
    checkpointer_class = GzipStore


def run(out, *args: str):
    return run_cli(RECIPE, f"out_dir={out}", "--nproc", "2", "-p", "examples.gzip_store",
                   "checkpointer=gzip", *args, check=True)


def test_a_run_stores_its_snapshots_with_it_and_resumes_exactly(tmp_path):
    half = tmp_path / "half"
    run(half, "epochs=1")
    checkpoints = half / "checkpoints"
    first = checkpoints / "snapshot-e0001-s00000008.pt.gz"
    assert (checkpoints / "latest").read_text().strip() == first.name
    assert first.read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic: the example wrote it
    assert (checkpoints / f"{first.name}.json").is_file()

    resumed = run(half, "epochs=3")
    assert f"resuming from {first}: the end of epoch 1, step 8" in resumed.stdout
    whole = tmp_path / "whole"
    run(whole, "epochs=3")
    assert read_summary(half)["global_step"] == read_summary(whole)["global_step"] == 24
    assert read_summary(half)["weights_sha256"] == read_summary(whole)["weights_sha256"]
    assert (checkpoints / "latest").read_text().strip() == "snapshot-e0003-s00000024.pt.gz"
