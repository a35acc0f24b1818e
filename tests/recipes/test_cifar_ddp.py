"""The main job, end to end: recipes/cifar_ddp.py on 2 CPU processes with gloo."""

from __future__ import annotations

import json
import pickle
import socket
import tarfile

import numpy as np
import pytest
import torch

from engine.checkpoint import model_digest
from engine.errors import ConfigError
from engine.testing import fit, make_engine, make_plugin_manager, tiny_recipe  # noqa: F401 (fixtures)
from tests.conftest import QUICK, read_summary, run_cli


def test_two_process_ddp_run_agrees_on_weights(cifar_recipe, tmp_path):
    # The README's main command, through the installed engine-run script.
    out = tmp_path / "run"
    proc = run_cli(cifar_recipe, *QUICK, "data.source=auto", f"data.root={tmp_path}",
                   "data.download=false", f"out_dir={out}", "--nproc", "2", check=True,
                   script=True)
    summary = read_summary(out)
    assert summary["status"] == "completed"
    assert (summary["world_size"], summary["launcher"], summary["parallel"]) == (
        2, "spawn", "ddp")
    for key in ("epochs_completed", "train_loss", "train_epoch_loss", "val_loss",
                "val_accuracy", "samples_per_sec", "wall_time_s", "weights_sha256"):
        assert summary[key] is not None, key
    # Both ranks computed the digest of their own weights: DDP kept them identical.
    assert summary["weights_sha256_per_rank"] == [summary["weights_sha256"]] * 2
    # The final snapshot holds exactly those weights, without DDP's module. prefix.
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    snap = torch.load(latest, weights_only=True)
    assert not any(k.startswith("module.") for k in snap["model"])
    assert model_digest(snap["model"]) == summary["weights_sha256"]
    # Rank-0-only output: the synthetic-data warning appears once, not once per rank.
    assert proc.stderr.count("synthetic CIFAR-shaped set") == 1
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_loss_falls_on_the_synthetic_set(cifar_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(cifar_recipe, "data.source=synthetic", "data.synthetic_size=4096", "epochs=3",
            f"out_dir={out}", "--nproc", "2", check=True)
    manifests = sorted((out / "checkpoints").glob("*.pt.json"))
    metrics = [json.loads(m.read_text())["metrics"] for m in manifests]
    assert len(metrics) == 3
    losses = [m["val/loss"] for m in metrics]
    assert losses[0] > losses[1] > losses[2], losses
    assert metrics[-1]["val/accuracy"] > 0.3  # chance is 0.1


def write_cifar_format(root, images_per_batch: int = 20) -> None:
    """A small data set in CIFAR-10's own python format (pickled dicts, uint8 rows; the
    official files come from Python 2, so their keys unpickle as str)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, images_per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))


def test_real_cifar_format_is_loaded(cifar_recipe, tmp_path):
    write_cifar_format(tmp_path / "data")
    out = tmp_path / "run"
    proc = run_cli(cifar_recipe, "data.source=cifar10", f"data.root={tmp_path / 'data'}",
                   "epochs=1", f"out_dir={out}", "--nproc", "2", check=True)
    # 100 training images, 50 per rank, 32 per micro-batch: 2 steps.
    assert read_summary(out)["global_step"] == 2
    assert "synthetic" not in proc.stderr


def test_cifar_archive_is_unpacked_by_local_rank_zero(cifar_recipe, tmp_path):
    staging = tmp_path / "staging"
    write_cifar_format(staging)
    root = tmp_path / "data"
    root.mkdir()
    with tarfile.open(root / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(staging / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    out = tmp_path / "run"
    run_cli(cifar_recipe, "data.source=auto", f"data.root={root}", "epochs=1",
            f"out_dir={out}", "--nproc", "2", check=True)
    assert (root / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert read_summary(out)["global_step"] == 2


def test_missing_cifar_with_source_cifar10_says_where_to_put_it(cifar_recipe, tmp_path):
    proc = run_cli(cifar_recipe, "data.source=cifar10", f"data.root={tmp_path}",
                   "data.download=false", f"out_dir={tmp_path / 'run'}", "--nproc", "1")
    assert proc.returncode == 2
    assert (f"data.source=cifar10 but CIFAR-10 is not under '{tmp_path}' "
            "(data.download=false)") in proc.stderr
    assert "data_batch_1..5" in proc.stderr


@pytest.mark.slow  # torchvision's import alone takes seconds
def test_a_failed_download_says_why(cifar_recipe, make_engine, tmp_path, monkeypatch,
                                    capsys):
    from torchvision.datasets import CIFAR10

    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The download itself runs and fails (connection refused), on any machine, network
    # or none.
    monkeypatch.setattr(CIFAR10, "url", f"http://127.0.0.1:{port}/cifar-10-python.tar.gz")
    root = f"data.root={tmp_path / 'data'}"
    eng = make_engine(root, "data.synthetic_size=16", recipe=cifar_recipe)
    eng.recipe.module.prepare_data(eng.cfg, eng)
    eng.recipe.module.build_datasets(eng.cfg, eng)  # data.source=auto: synthetic
    warning = capsys.readouterr().err
    assert "could not be downloaded (URLError: " in warning
    assert "Connection refused" in warning
    # data.source=cifar10 refuses to go on, and says why as well.
    eng = make_engine(root, "data.source=cifar10", recipe=cifar_recipe)
    eng.recipe.module.prepare_data(eng.cfg, eng)
    with pytest.raises(ConfigError, match=r"is not under .* \(URLError: .*Connection refused"):
        eng.recipe.module.build_datasets(eng.cfg, eng)


def test_dry_run_prints_config_and_plan_without_training(cifar_recipe, tmp_path):
    out = tmp_path / "run"
    proc = run_cli(cifar_recipe, "--dry-run", "epochs=7", f"out_dir={out}", check=True)
    assert "  epochs = 7" in proc.stdout
    for line in ("launcher      spawn", "parallel      ddp", "batch         64 global = "
                 "2 processes x 32", "backend       gloo", f"output dir    {out}"):
        assert line in proc.stdout, line
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (("batch_size=63",), "batch_size 63 (global) does not split evenly over 2 processes; "
                         "choose a multiple of 2, e.g. batch_size=62"),
    (("epochz=1",), "unknown config key 'epochz'; did you mean 'epochs'?"),
    (("--parallel", "hsdp"), "parallel mode 'hsdp' is not available (plugin may not be "
                             "installed); did you mean 'fsdp'? registered: ddp, ddp-multigpu, "
                             "dp, fsdp, single"),
    (("--launcher", "mpi"), "launcher 'mpi' is not available (plugin may not be installed)"),
    (("--checkpointer", "s3"), "checkpointer 's3' is not available"),
])
def test_bad_input_fails_before_training_with_one_line(cifar_recipe, tmp_path, args, message):
    proc = run_cli(cifar_recipe, *args, f"out_dir={tmp_path / 'run'}", "--dry-run")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_missing_recipe_is_named(tmp_path):
    proc = run_cli(str(tmp_path / "nope.py"))
    assert proc.returncode == 2
    assert f"engine-run: error: recipe file '{tmp_path / 'nope.py'}' not found" in proc.stderr


def test_logged_loss_is_a_mean_per_micro_batch_with_accumulation(cifar_recipe, tmp_path):
    """With grad_accum_steps=2 every optimizer step has two micro-batch losses; the
    logged loss must be their mean (not their sum), like the epoch's train_loss."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run_cli(cifar_recipe, *QUICK, "log_every=1", "grad_accum_steps=2", "lr=1e-6",
            f"out_dir={out}", "--nproc", "2", check=True)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/loss")]
    epoch_loss = read_summary(out)["train_epoch_loss"]
    # lr is tiny, so every window's loss is close to the epoch mean (~2.3 for 10 classes).
    assert all(abs(value - epoch_loss) < 0.2 for value in logged), (logged, epoch_loss)


def test_a_synthetic_set_without_samples_is_refused_before_any_worker(cifar_recipe,
                                                                       tmp_path):
    """data.synthetic_size=0 failed in the workers, and left summary.json and a lock
    file in out_dir: now the config refuses it in the launching process."""
    import engine

    with pytest.raises(ConfigError) as info:
        fit(cifar_recipe, nproc=1, out_dir=str(tmp_path / "run"),
            **{"data.source": "synthetic", "data.synthetic_size": 0})
    assert str(info.value) == ("config key 'data.synthetic_size': '0' is not allowed: "
                               "'synthetic_size' must be >= 1: 0")
    assert not (tmp_path / "run").exists()
