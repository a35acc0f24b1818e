"""tools/make_oct_dataset.py: layout, formats, bit depths, determinism, learnable classes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO

TOOL = REPO / "tools" / "make_oct_dataset.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("make_oct_dataset", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(root), *args],
                          capture_output=True, text=True, timeout=120)


def test_writes_the_layout_the_recipes_read(tmp_path):
    proc = make(tmp_path, "--train", "30", "--val", "10", "--sizes", "48,64",
                "--disease-fraction", "0.2")
    assert proc.returncode == 0, proc.stderr
    assert "train: 24 normal, 6 disease" in proc.stdout
    assert "val: 8 normal, 2 disease" in proc.stdout
    assert "data.mean=" in proc.stdout and "data.std=" in proc.stdout
    files = {split: sorted((tmp_path / split).rglob("*.*")) for split in ("train", "val")}
    assert {p.parent.name for p in files["train"]} == {"normal", "disease"}
    assert len(files["train"]) == 30 and len(files["val"]) == 10
    every = files["train"] + files["val"]
    assert {p.suffix for p in every} == {".png", ".tif", ".jpg"}
    modes, sizes = set(), set()
    for path in every:
        with Image.open(path) as image:
            modes.add((path.suffix, image.mode))
            sizes.add(image.size)
            if image.mode == "I;16":
                # Real 16-bit content, not 8-bit values in a 16-bit container.
                assert np.asarray(image).max() > 255
    assert sizes <= {(48, 48), (64, 64)} and len(sizes) == 2
    assert (".png", "I;16") in modes and (".tif", "I;16") in modes
    assert (".png", "L") in modes and (".jpg", "L") in modes
    assert (".jpg", "I;16") not in modes  # JPEG stays 8-bit, as in practice


def test_default_sizes_are_oct_a_sizes(tmp_path):
    assert make(tmp_path, "--train", "6", "--val", "0").returncode == 0
    sizes = {Image.open(p).size for p in (tmp_path / "train").rglob("*.*")}
    assert sizes <= {(304, 304), (400, 400)}


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    tool = load_tool()
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        tool.generate(tmp_path / name, train=4, val=2, sizes=(32,), seed=seed)
    def contents(name):
        return {p.relative_to(tmp_path / name): p.read_bytes()
                for p in sorted((tmp_path / name).rglob("*.*"))}
    assert contents("a") == contents("b")
    assert contents("a") != contents("c")


def test_classes_differ_in_structure_not_in_one_pixel_statistic():
    """A larger avascular zone and capillary dropout make 'disease': the dark centre
    separates the classes on average, while the image mean (hidden by a random gain)
    separates them much less well than a CNN must."""
    tool = load_tool()
    size, n = 64, 40
    yy, xx = np.mgrid[0:size, 0:size]
    centre = np.hypot(yy - size / 2, xx - size / 2) < 0.12 * size
    stats = {0: [], 1: []}
    for label in (0, 1):
        for i in range(n):
            image = tool.oct_image(np.random.default_rng([5, label, i]), size, label)
            assert image.min() >= 0.0 and image.max() <= 1.0
            stats[label].append((image.mean(), image[centre].mean()))
    normal, disease = np.array(stats[0]), np.array(stats[1])
    assert disease[:, 1].mean() < 0.8 * normal[:, 1].mean()  # the larger dark FAZ

    def best_threshold_accuracy(a, b):
        values = np.concatenate([a, b])
        return max(max((a > t).mean() + (b <= t).mean(), (a <= t).mean() + (b > t).mean())
                   / 2 for t in values)

    assert best_threshold_accuracy(normal[:, 0], disease[:, 0]) < 0.8


@pytest.mark.parametrize("args, message", [
    (("--bit-depths", "12"), "--bit-depths '12'"),
    (("--formats", "bmp"), "--formats 'bmp'"),
    (("--sizes", "8"), "at least 16 pixels"),
    (("--disease-fraction", "1.5"), "must lie in [0, 1]"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    proc = make(tmp_path / "out", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
