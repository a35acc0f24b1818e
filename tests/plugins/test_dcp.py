"""The ``dcp`` checkpointer: torch.distributed.checkpoint, saved and loaded by all ranks.

The first tests drive the checkpointer in one process (real files); the others run
recipes/cifar_ddp.py with ``--checkpointer dcp``, saving with 2 processes and resuming
with 1, and the other way round.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.checkpoint import manifest_path, model_digest
from engine.config import CheckpointConfig, TrainConfig
from engine.errors import CheckpointError
from engine.plugins.dcp import DCPCheckpointer
from tests.conftest import QUICK, read_summary, run_cli

ONE_THREAD = ("--threads", "1")  # the thread count changes a convolution's last bits


def trained(seed: int = 0):
    """A small model and an SGD optimizer with momentum after two steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        model(torch.randn(5, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return model, {"model": model_state, "optimizer": optimizer_state, "epoch": 1,
                   "step": 2, "batch_in_epoch": 0, "world_size": 1,
                   "rng": [{"torch": torch.get_rng_state()}], "metrics": {"val/loss": 0.5},
                   "engine_version": "test"}


def test_save_writes_a_verified_directory_and_load_reads_it_back(tmp_path):
    model, state = trained()
    ck = DCPCheckpointer(tmp_path)
    path = ck.save(state, epoch=1, step=2, metrics={"val/loss": 0.5})
    assert path == tmp_path / "snapshot-e0001-s00000002.dcp"
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp",
                                                       "train_state.pt"]
    manifest = json.loads(manifest_path(path).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "train_state.pt"]
    assert (manifest["epoch"], manifest["step"], manifest["world_size"]) == (1, 2, 1)
    assert ck.problem(path) is None and ck.latest() == path
    assert (tmp_path / "latest").read_text().strip() == path.name
    # The small parts are one weights_only file; the tensors are DCP's.
    rest = torch.load(path / "train_state.pt", weights_only=True)
    assert "model" not in rest and rest["step"] == 2 and rest["metrics"] == {"val/loss": 0.5}

    loaded = ck.load(path)
    assert model_digest(loaded["model"]) == model_digest(model.state_dict())
    # The optimizer state is keyed by parameter name, momentum included.
    momentum = loaded["optimizer"]["state"]["0.weight"]["momentum_buffer"]
    assert torch.equal(momentum, state["optimizer"]["state"]["0.weight"]["momentum_buffer"])
    assert loaded["optimizer"]["param_groups"][0]["params"] == [
        "0.weight", "0.bias", "2.weight", "2.bias"]
    assert loaded["epoch"] == 1 and torch.equal(loaded["rng"][0]["torch"],
                                                state["rng"][0]["torch"])


def test_latest_skips_corrupt_truncated_and_uncommitted_snapshots(tmp_path, capsys):
    _, state = trained()
    ck = DCPCheckpointer(tmp_path)
    good = ck.save(state, epoch=1, step=2)
    corrupt = ck.save(state, epoch=1, step=4)
    data = corrupt / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert ck.latest() == good
    assert (f"warning: snapshot {corrupt} is unusable: __0_0.distcp: xxh3_128 differs from "
            "the manifest (corrupt); trying the previous one") in capsys.readouterr().err

    truncated = ck.save(state, epoch=1, step=6)
    size = (truncated / ".metadata").stat().st_size
    with open(truncated / ".metadata", "r+b") as f:
        f.truncate(size - 10)
    assert ck.latest() == good
    assert (f"{truncated} is unusable: .metadata has {size - 10} bytes, the manifest says "
            f"{size} (truncated?)") in capsys.readouterr().err

    # A save that died before its manifest: the directory is there, but never counts.
    uncommitted = ck.save(state, epoch=1, step=8)
    manifest_path(uncommitted).unlink()
    assert ck.latest() == good
    assert "its manifest is missing or unreadable" in capsys.readouterr().err


def test_keep_last_prunes_directories_and_a_crashed_staging_one(tmp_path):
    _, state = trained()
    cfg = TrainConfig(checkpoint=CheckpointConfig(keep_last=2))
    ck = DCPCheckpointer(tmp_path, cfg)
    ck.save(state, epoch=1, step=1)
    (tmp_path / ".staging-snapshot-e0001-s00000002.dcp").mkdir()  # a save that crashed
    for step in (2, 3):
        ck.save(state, epoch=1, step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "snapshot-e0001-s00000002.dcp", "snapshot-e0001-s00000002.dcp.json",
        "snapshot-e0001-s00000003.dcp", "snapshot-e0001-s00000003.dcp.json"]
    # Saving under an existing name (same epoch and step) replaces it whole.
    again = ck.save(state, epoch=1, step=3)
    assert ck.problem(again) is None and ck.latest() == again


def test_load_of_something_else_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"is not a dcp snapshot \(no \.metadata in it\)$"):
        DCPCheckpointer(tmp_path).load(tmp_path)


def test_a_pickled_global_in_the_train_state_is_named_and_not_trusted(tmp_path):
    """Issue 16, defect 6, for dcp's own file: torch's advice to load it with
    weights_only=False (which would run the pickled code) is replaced by a refusal."""
    from engine.plugins.dcp import TRAIN_STATE, _train_state

    torch.save({"epoch": 1, "x": shutil.rmtree}, tmp_path / TRAIN_STATE)
    with pytest.raises(CheckpointError) as refused:
        _train_state(tmp_path, required=True)
    assert str(refused.value).startswith(f"{tmp_path / TRAIN_STATE} is not trusted: it holds "
                                         "a pickled Python object (")
    assert "weights_only=False" not in str(refused.value)


# ----------------------------------------------------------- through engine-run


def run(recipe, out, nproc: int, epochs: int, checkpointer: str = "dcp"):
    return run_cli(recipe, *QUICK, f"epochs={epochs}", f"out_dir={out}", "--nproc",
                   str(nproc), "--checkpointer", checkpointer, *ONE_THREAD, check=True)


@pytest.fixture(scope="module")
def two_then_one(tmp_path_factory):
    """One epoch on 2 processes, then the second epoch resumed on 1."""
    from tests.conftest import REPO

    recipe = str(REPO / "recipes" / "cifar_ddp.py")
    out = tmp_path_factory.mktemp("dcp-two-then-one")
    run(recipe, out, nproc=2, epochs=1)
    first = read_summary(out)
    proc = run(recipe, out, nproc=1, epochs=2)
    return out, first, proc


@pytest.mark.timeout(900)  # the first test of the module pays for two_then_one's two runs
def test_two_processes_save_shards_that_both_wrote(two_then_one):
    out, first, _ = two_then_one
    snap = out / "checkpoints" / "snapshot-e0001-s00000008.dcp"
    names = sorted(p.name for p in snap.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]
    # DDP's replicated tensors are written once, the work spread over both ranks.
    assert min((snap / n).stat().st_size for n in ("__0_0.distcp", "__1_0.distcp")) > 10_000
    manifest = json.loads(manifest_path(snap).read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == names
    assert DCPCheckpointer(snap.parent).problem(snap) is None
    loaded = DCPCheckpointer(snap.parent).load(snap)
    assert model_digest(loaded["model"]) == first["weights_sha256"]
    assert len(loaded["rng"]) == 2 and loaded["step"] == 8


def test_one_process_resumes_what_two_saved(two_then_one):
    out, _, proc = two_then_one
    checkpoints = out / "checkpoints"
    assert (f"resuming from {checkpoints / 'snapshot-e0001-s00000008.dcp'}: the end of "
            "epoch 1, step 8") in proc.stdout
    assert "was written by 2 processes, this run has 1: RNG states are not restored" \
        in proc.stderr
    summary = read_summary(out)
    assert (summary["world_size"], summary["epochs_completed"], summary["global_step"]) == (
        1, 2, 16)
    final = checkpoints / "snapshot-e0002-s00000016.dcp"
    assert (checkpoints / "latest").read_text().strip() == final.name
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "train_state.pt"]
    assert model_digest(DCPCheckpointer(checkpoints).load(final)["model"]) == \
        summary["weights_sha256"]


@pytest.mark.timeout(900)  # two runs
def test_two_processes_resume_what_one_saved(cifar_recipe, tmp_path):
    out = tmp_path / "run"
    run(cifar_recipe, out, nproc=1, epochs=1)
    proc = run(cifar_recipe, out, nproc=2, epochs=2)
    assert (f"resuming from {out / 'checkpoints' / 'snapshot-e0001-s00000008.dcp'}: "
            "the end of epoch 1, step 8") in proc.stdout
    summary = read_summary(out)
    assert (summary["world_size"], summary["epochs_completed"], summary["global_step"]) == (
        2, 2, 16)
    # Both ranks loaded the same weights and stayed together.
    assert summary["weights_sha256_per_rank"] == [summary["weights_sha256"]] * 2


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs (and two_then_one's, if run alone)
def test_dcp_restores_what_torch_file_restores(two_then_one, cifar_recipe, tmp_path):
    """The same 2-then-1 story with torch-file ends with bit-identical weights: dcp
    restored the model, the momentum and the train state exactly."""
    dcp_out, _, _ = two_then_one
    out = tmp_path / "torch-file"
    run(cifar_recipe, out, nproc=2, epochs=1, checkpointer="torch-file")
    run(cifar_recipe, out, nproc=1, epochs=2, checkpointer="torch-file")
    assert read_summary(out)["weights_sha256"] == read_summary(dcp_out)["weights_sha256"]
    shutil.rmtree(out)
