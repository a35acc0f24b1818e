"""The OCT-A recipes end to end on a small generated data set, and their data pipeline:
16-bit loading, class-balanced distributed sampling, bad files, bad layouts, the
decode-on-the-device path (on the CPU here; on CUDA when there is one)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import pytest
import torch
from PIL import Image

from engine.data import ResumableDistributedSampler
from engine.errors import ConfigError
from tests.conftest import REPO, engine_env, read_summary, run_cli

OCT_DDP = str(REPO / "recipes" / "oct_ddp.py")
OCT_DP = str(REPO / "recipes" / "oct_dp.py")
#: A run of a few seconds: 32 px crops of 48/64 px images, one or two epochs.
SMALL = ("data.image_size=32", "log_every=1")

sys.path.insert(0, str(REPO / "recipes"))
import oct_common  # noqa: E402  (the recipes' shared module, as they import it)


def generate(root, **kwargs):
    spec = importlib.util.spec_from_file_location("make_oct_dataset",
                                                  REPO / "tools" / "make_oct_dataset.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    kwargs = {"train": 24, "val": 8, "sizes": (48, 64), **kwargs}
    tool.generate(root, **kwargs)
    return root


@pytest.fixture(scope="module")
def oct_data(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("oct"))


#: A plugin that writes each rank's digest of its parameters (BatchNorm statistics are
#: per rank by design between forwards; the parameters must be identical).
PARAMS_PLUGIN = '''
import hashlib, json, pathlib, engine

@engine.hookimpl
def engine_run_end(engine, summary):
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode()); h.update(p.detach().cpu().numpy().tobytes())
    path = pathlib.Path(engine.cfg.out_dir) / f"params-rank{engine.world.rank}.json"
    path.write_text(json.dumps({"sha256": h.hexdigest()}))
'''


def test_two_process_ddp_run_on_generated_scans(oct_data, tmp_path):
    """The main job: 2 processes, loader workers, class-balanced sampling, and a corrupt
    file that data.on_bad_file=skip reports with its path and replaces."""
    root = tmp_path / "oct"
    shutil.copytree(oct_data, root)
    victim = corrupt_one(root)
    (tmp_path / "params_probe.py").write_text(PARAMS_PLUGIN)
    out = tmp_path / "run"
    proc = run_cli(OCT_DDP, f"data.root={root}", *SMALL, "epochs=2", "num_workers=1",
                   "data.balance=true", "data.on_bad_file=skip", f"out_dir={out}",
                   "--nproc", "2", "-p", "params_probe",
                   env=engine_env(PYTHONPATH=str(tmp_path)), check=True)
    summary = read_summary(out)
    assert (summary["status"], summary["world_size"], summary["parallel"]) == (
        "completed", 2, "ddp")
    # 24 images, global batch 12: 2 optimizer steps per epoch on both ranks, the
    # unreadable sample replaced rather than dropped.
    assert (summary["epochs_completed"], summary["global_step"]) == (2, 4)
    assert 0.0 <= summary["data_wait_fraction"] <= 1.0
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_loss"] > 0
    params = [json.loads((out / f"params-rank{r}.json").read_text())["sha256"] for r in (0, 1)]
    assert params[0] == params[1]
    assert proc.stdout.count("% waiting") == 2  # the console's data-wait report per epoch
    config = json.loads((out / "config.json").read_text())
    assert config["batch_size"] == 12 and config["data"]["balance"] is True
    # Balanced draws with replacement may or may not pick the bad file; when they do,
    # it is reported with its path and counted.
    for line in proc.stderr.splitlines():
        if "skipped unreadable image" in line:
            assert f"skipped unreadable image {victim} (" in line
            assert "skip(s) in train/ so far" in line


def test_dp_recipe_runs_as_one_process(oct_data, tmp_path):
    out = tmp_path / "run"
    run_cli(OCT_DP, f"data.root={oct_data}", *SMALL, "epochs=1", f"out_dir={out}",
            "--nproc", "1", check=True)
    summary = read_summary(out)
    assert (summary["status"], summary["world_size"], summary["global_step"]) == (
        "completed", 1, 2)
    assert summary["parallel"] == "dp"


def test_the_plan_shows_the_loader_settings_auto_chose(oct_data):
    # 6 CPUs for 2 local processes: 3 each, 1 kept for training, 2 workers.
    proc = run_cli(OCT_DDP, f"data.root={oct_data}", "--launcher", "spawn", "--nproc", "2",
                   "--dry-run", env=engine_env(SLURM_CPUS_PER_TASK="6"), check=True)
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("num_workers  "))
    assert "2 per process, persistent" in line
    assert "6 CPUs (SLURM_CPUS_PER_TASK) shared by 2 local processes = 3 each" in line


# --------------------------------------------------------------- bad input


def test_missing_data_root_says_so_and_points_to_the_generator(tmp_path):
    proc = run_cli(OCT_DDP, *SMALL, f"out_dir={tmp_path}", "--nproc", "1")
    assert proc.returncode != 0
    assert "data.root is required: set data.root=DIR" in proc.stderr
    assert "python tools/make_oct_dataset.py DIR" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_data_root_without_train_and_val_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data.root '.*empty' has no train/ folder; .*"
                                          r"tools/make_oct_dataset.py DIR"):
        (tmp_path / "empty").mkdir()
        oct_common.find_classes(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"data.root '.*nowhere' is not a folder"):
        oct_common.find_classes(tmp_path / "nowhere")


def test_class_folders_that_differ_between_train_and_val_stop_before_training(
        oct_data, tmp_path):
    root = tmp_path / "oct"
    shutil.copytree(oct_data, root)
    (root / "val" / "disease").rename(root / "val" / "dr")
    proc = run_cli(OCT_DDP, f"data.root={root}", *SMALL, f"out_dir={tmp_path / 'run'}",
                   "--nproc", "1")
    assert proc.returncode != 0
    assert ("differ between train/ (disease, normal) and val/ (dr, normal); both need the "
            "same class subfolders") in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # no training step was taken


def test_layout_errors_name_the_problem(tmp_path):
    root = tmp_path / "oct"
    for split in ("train", "val"):
        for name in ("a", "b", "c"):
            (root / split / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"has 3 class folders \(a, b, c\); the OCT "
                                          r"recipes are binary: give exactly 2"):
        oct_common.find_classes(root)
    shutil.rmtree(root / "train" / "c")
    shutil.rmtree(root / "val" / "c")
    with pytest.raises(ConfigError, match=r"'.*train/a' holds no images"):
        oct_common.find_classes(root)


@contextlib.contextmanager
def _corrupt_copy():
    with tempfile.TemporaryDirectory() as tmp:
        root = generate(pathlib.Path(tmp) / "oct", train=8, val=2, sizes=(32,),
                        formats=("png",))
        yield root, corrupt_one(root)


def corrupt_one(root) -> str:
    """Truncate one training PNG to half its size; return its path."""
    victim = sorted((root / "train" / "normal").glob("*.png"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return str(victim)


def test_a_corrupt_file_stops_the_run_with_its_path(oct_data, tmp_path):
    root = tmp_path / "oct"
    shutil.copytree(oct_data, root)
    victim = corrupt_one(root)
    proc = run_cli(OCT_DDP, f"data.root={root}", *SMALL, "epochs=1", "num_workers=1",
                   f"out_dir={tmp_path / 'run'}", "--nproc", "2", timeout=180)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if f"cannot read image {victim}" in l]
    assert lines, proc.stderr
    # One line from the DataLoader worker's exception, not the worker's traceback.
    assert lines[0].startswith("[rank ") and "data.on_bad_file=skip" in lines[0]
    assert "Original Traceback" not in proc.stderr


def test_skip_mode_reports_and_counts_the_bad_file():
    """In a DataLoader worker as in the training process: the next readable sample
    stands in, the file is reported once, the skips are counted."""
    with _corrupt_copy() as (root, victim):
        _, samples = oct_common.find_classes(root)
        dataset = oct_common.OctFolder(samples["train"], lambda image: image, split="train",
                                       rank=0, on_bad_file="skip")
        bad = next(i for i, (path, _) in enumerate(samples["train"]) if path == victim)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1,
                                             timeout=60, collate_fn=list)
        seen = [label for batch in loader for _, label in batch]
        assert len(seen) == len(samples["train"])  # nothing dropped
        assert dataset.skipped.value == 1  # counted across the worker process
        image, label = dataset[bad]  # in this process: the next sample stands in
        assert label == samples["train"][bad + 1][1]
        assert dataset.skipped.value == 2


# ----------------------------------------------------------------- loading


@pytest.mark.parametrize("suffix", [".png", ".tif"])
def test_16_bit_images_keep_their_16_bits(tmp_path, suffix):
    values = np.array([[0, 1, 255, 256], [4095, 32768, 65534, 65535]], dtype=np.uint16)
    path = tmp_path / f"scan{suffix}"
    Image.fromarray(values).save(path)
    image = oct_common.load_image(str(path))
    assert image.shape == (1, 2, 4) and image.dtype == torch.float32
    expected = torch.from_numpy(values.astype(np.float32) / 65535.0)
    assert torch.equal(image[0], expected)  # 1 and 256 stay distinct, nothing clips at 255


@pytest.mark.parametrize("suffix", [".png", ".tif", ".jpg"])
def test_8_bit_images_scale_by_255(tmp_path, suffix):
    values = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (16, 1))
    path = tmp_path / f"scan{suffix}"
    Image.fromarray(values).save(path, **({"quality": 100} if suffix == ".jpg" else {}))
    image = oct_common.load_image(str(path))
    assert image.shape == (1, 16, 16)
    tolerance = 3 / 255 if suffix == ".jpg" else 0.0
    assert torch.allclose(image[0], torch.from_numpy(values / 255.0).float(), atol=tolerance)


def test_rgb_scans_become_one_gray_channel(tmp_path):
    path = tmp_path / "rgb.png"
    Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8)).save(path)
    image = oct_common.load_image(str(path))
    assert image.shape == (1, 8, 8) and torch.allclose(image, torch.tensor(200 / 255.0))


def test_the_model_takes_one_channel_and_predicts_two_classes():
    model = oct_common.build_model(oct_common.OctConfig())
    assert model.conv1.in_channels == 1
    assert model(torch.zeros(2, 1, 32, 32)).shape == (2, 2)  # any size: the pool adapts


def test_training_transform_gives_normalised_crops_of_the_configured_size():
    data = oct_common.OctDataConfig(image_size=40, mean=0.5, std=0.25)
    image = torch.full((1, 64, 80), 0.5)
    train = oct_common.make_transform(data, train=True)(image)
    val = oct_common.make_transform(data, train=False)(image)
    assert train.shape == val.shape == (1, 40, 40)
    assert torch.allclose(val, torch.zeros_like(val), atol=1e-6)  # (0.5 - 0.5) / 0.25


# -------------------------------------------------- class-balanced sampling


class Labels(torch.utils.data.Dataset):
    def __init__(self, targets):
        self.targets = targets
        self.sample_weights = oct_common.class_balanced_weights(targets)

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return index


def test_balanced_sampling_draws_both_classes_equally_and_shards_across_ranks():
    targets = [0] * 800 + [1] * 200  # 4:1 imbalance
    dataset = Labels(targets)
    samplers = [ResumableDistributedSampler(dataset, num_replicas=2, rank=r, seed=3,
                                            weights=dataset.sample_weights) for r in (0, 1)]
    for s in samplers:
        s.set_epoch(5)
    shares = [list(s) for s in samplers]
    assert [len(s) for s in shares] == [500, 500]
    drawn = [targets[i] for share in shares for i in share]
    assert 0.44 < sum(drawn) / len(drawn) < 0.56  # about half minority class, not a fifth
    # Every rank drew from the same global order: the same (seed, epoch) gives the same
    # draws on another "rank" object, another epoch gives others.
    again = ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=3,
                                        weights=dataset.sample_weights)
    again.set_epoch(5)
    assert list(again) == shares[1]
    again.set_epoch(6)
    assert list(again) != shares[1]
    # A resumed epoch continues exactly where it stopped.
    again.set_epoch(5, start_index=123)
    assert list(again) == shares[1][123:]


# ------------------------------------------------ decode and augment on device


def test_device_decoding_gives_what_the_cpu_path_gives(oct_data):
    """The decode-on-the-GPU path, run on the CPU: JPEG bytes decoded by torchvision,
    PNG/TIFF pixels moved, then the same (deterministic, validation) transform."""
    _, samples = oct_common.find_classes(oct_data)
    every = samples["train"] + samples["val"]
    mixed = [s for s in every if s[0].endswith(".jpg")][:2] + \
            [s for s in every if not s[0].endswith(".jpg")][:2]
    assert len(mixed) == 4
    data = oct_common.OctDataConfig(image_size=32)
    transform = oct_common.make_transform(data, train=False)
    on_device = oct_common.OctFolder(mixed, transform, split="val", rank=0,
                                     on_bad_file="stop", decode_on_device=True)
    on_cpu = oct_common.OctFolder(mixed, transform, split="val", rank=0, on_bad_file="stop")
    batch, labels = on_device.collate_fn([on_device[i] for i in range(4)])
    assert isinstance(batch, oct_common.EncodedBatch)
    assert labels.tolist() == [label for _, label in mixed]
    images = batch.pin_memory().to("cpu") if torch.cuda.is_available() else batch.to("cpu")
    expected = torch.stack([on_cpu[i][0] for i in range(4)])
    assert images.shape == expected.shape == (4, 1, 32, 32)
    # libjpeg in torchvision and in Pillow may round differently: a gray level or two.
    assert torch.allclose(images, expected, atol=2.5 / 255 / data.std)


def test_a_truncated_jpeg_is_caught_before_it_reaches_the_device(tmp_path):
    path = tmp_path / "scan.jpg"
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:-20])
    dataset = oct_common.OctFolder([(str(path), 0)], None, split="train", rank=0,
                                   on_bad_file="stop", decode_on_device=True)
    with pytest.raises(oct_common.UnreadableImageError,
                       match=f"cannot read image {path} .*start or end marker"):
        dataset[0]


# Marked cuda: it depends on the CUDA situation too (it skips where there is CUDA).
@pytest.mark.cuda
def test_augment_on_cuda_without_cuda_is_a_clear_error(oct_data, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_cli(OCT_DDP, f"data.root={oct_data}", *SMALL, "data.augment_on=cuda",
                   f"out_dir={tmp_path}", "--nproc", "1")
    assert proc.returncode != 0
    assert ("data.augment_on=cuda needs a CUDA device, but this process computes on cpu; "
            "use data.augment_on=cpu") in proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_and_augment_on_the_gpu_end_to_end(oct_data, tmp_path):
    out = tmp_path / "run"
    run_cli(OCT_DDP, f"data.root={oct_data}", *SMALL, "epochs=1", "data.augment_on=cuda",
            "num_workers=1", f"out_dir={out}", "--nproc", "1",
            env=engine_env(CUDA_VISIBLE_DEVICES="0"), check=True)
    summary = read_summary(out)
    assert (summary["status"], summary["global_step"]) == ("completed", 2)
