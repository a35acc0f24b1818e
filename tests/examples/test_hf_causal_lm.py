"""examples/hf_causal_lm.py: a transformers causal LM (a tiny GPT-2 from its config) on
a ``datasets`` dataset, map-style from ``save_to_disk`` and streamed from local JSON
Lines files, on real runs with the hub and the network off.

The streaming runs have 2 processes and 2 files of different lengths: each process
streams its own file (split_dataset_by_node), so rank 1 runs out of data several log
windows before rank 0 and trains padding until the epoch ends. A run SIGKILLed mid-epoch
2 resumes from every worker's datasets state to the weights of a run never interrupted.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli

RECIPE = str(REPO / "examples" / "hf_causal_lm.py")
TINY = ("model.layers=1", "model.heads=2", "model.width=16", "model.context=15",
        "batch_size=8", "log_every=2", "data.group_records=1000",
        "-p", "tests.examples.hf_imports")  # the workers inherit transformers' import
# Windows of 16 bytes; records of 31 bytes + end-of-text: 2 windows each. File 0 has 40
# records (80 windows: 20 micro-batches of 4 on rank 0), file 1 has 16 (8 on rank 1).
STEPS_PER_EPOCH, EPOCHS, KILL_STEP = 20, 2, 31  # the snapshot before the kill: step 30


def record(i: int) -> dict:
    return {"text": f"record {i:03d} of a tiny corpus."[:31].ljust(31, ".")}


def hf_env(tmp, **extra) -> dict:
    """Hub and datasets offline, every cache in ``tmp``: no network, no ~/.cache."""
    return engine_env(HF_HOME=str(tmp / "hf-home"), HF_DATASETS_CACHE=str(tmp / "hf-cache"),
                      HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # Imported here, not with the module: every pytest worker collects this module, and
    # datasets (pyarrow, pandas) costs seconds of CPU to import; one worker runs it.
    import datasets

    tmp = tmp_path_factory.mktemp("hf-data")
    records = [record(i) for i in range(56)]
    for k, part in enumerate((records[:40], records[40:])):
        (tmp / f"train-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (tmp / "val.jsonl").write_text("".join(json.dumps(record(900 + i)) + "\n"
                                           for i in range(8)))
    datasets.disable_progress_bars()
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(records),
        "validation": datasets.Dataset.from_list([record(900 + i) for i in range(8)]),
    }).save_to_disk(str(tmp / "disk"))
    return tmp


def streaming_args(data, out) -> tuple:
    return (RECIPE, *TINY, f"epochs={EPOCHS}", f"data.files={data / 'train-*.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}", "num_workers=1",
            "checkpoint.every_steps=10", f"out_dir={out}", "--nproc", "2")


@pytest.fixture(scope="module")
def streamed(data, tmp_path_factory):
    """2 processes streaming: a whole run, and one killed (rank 1, while it trains
    padding) after step 31 of 40, then resumed."""
    tmp = tmp_path_factory.mktemp("hf-stream")
    whole = run_cli(*streaming_args(data, tmp / "whole"), env=hf_env(tmp), check=True)
    fault = hf_env(tmp, ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(KILL_STEP),
                   ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp / "killed-once"))
    args = (*streaming_args(data, tmp / "half"), "-p", "tests.fault_plugin")
    killed = run_cli(*args, env=fault)
    assert killed.returncode != 0 and (tmp / "killed-once").exists(), killed.stderr[-2000:]
    resumed = run_cli(*args, env=fault, check=True)
    return tmp, whole, resumed


def test_a_streamed_dataset_trains_every_window_and_pads_the_shorter_rank(streamed):
    tmp, whole, _ = streamed
    summary = read_summary(tmp / "whole")
    assert summary["status"] == "completed"
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH  # rank 0's longer part
    # Every window of both files each epoch: 112 windows of 15 predicted tokens (the
    # padding batches count nothing), and a finite loss over the windows where rank 1
    # trained padding only.
    assert "hf_causal_lm: streaming 2 file(s)" in whole.stdout
    assert summary["val_loss"] == pytest.approx(summary["val_loss"])  # not NaN
    assert math.isfinite(summary["val_loss"])  # a number (approx(None) == None), finite
    assert "non-finite" not in whole.stderr


def test_a_streamed_run_killed_mid_epoch_resumes_to_the_same_weights(streamed):
    tmp, _, resumed = streamed
    assert "resuming from " in resumed.stdout and "epoch 2, step 30" in resumed.stdout
    assert "skips" not in resumed.stderr  # the datasets state, not a replay
    whole, half = read_summary(tmp / "whole"), read_summary(tmp / "half")
    assert half["global_step"] == whole["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert half["weights_sha256"] == whole["weights_sha256"]


def test_a_saved_to_disk_dataset_trains_with_validation(data, tmp_path):
    proc = run_cli(RECIPE, *TINY, "epochs=1", f"data.disk={data / 'disk'}",
                   f"out_dir={tmp_path / 'run'}", "--nproc", "1", env=hf_env(tmp_path),
                   check=True)
    assert "hf_causal_lm: 112 training windows of 16 tokens" in proc.stdout
    assert "16 validation" in proc.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["global_step"] == 14  # 112 windows, batch 8
    assert summary["val_perplexity"] < 257  # learnt something: below a uniform guess
