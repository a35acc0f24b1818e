"""What the OCT-A recipes share: config, data set, augmentations, model.

The data: ``data.root`` holds ``train/`` and ``val/``, each with one subfolder per
class (the two of a binary task, the same names in both), holding grayscale PNG, TIFF or
JPEG scans, 8- or 16-bit. ``python tools/make_oct_dataset.py DIR`` writes a synthetic
example.

Loading, as the seeds' OCT-A table says it matters:

- 16-bit PNG/TIFF stay 16-bit: scaled to [0, 1] by 65535, not clipped to 8 bits (what
  ``PIL.Image.convert("L")`` or ``ToTensor`` on mode ``I;16`` would do).
- Augmentations suited to en-face OCT-A: random resized crop (most of the field of
  view), horizontal and vertical flips (left and right eyes mirror each other), small
  rotations, intensity jitter (gain and gamma differ between devices and sessions),
  then normalisation with ``data.mean``/``data.std``.
- ``data.balance=true``: class-balanced sampling. The dataset carries
  ``sample_weights``; the engine's training sampler then draws every epoch's order with
  replacement from (seed, epoch), the same on every rank, and gives each rank its share.
- ``data.augment_on=cuda``: the loader workers only read files (JPEGs stay encoded),
  the batch is decoded (``torchvision.io.decode_jpeg`` on the GPU) and augmented
  (``transforms.v2`` on CUDA tensors) when the trainer moves it to the device; for
  jobs with few CPUs per GPU.
- A file that cannot be decoded stops the run with its path (``data.on_bad_file=stop``)
  or is reported with its path and replaced by the next readable sample
  (``data.on_bad_file=skip``; every rank still sees the same number of batches).
"""

from __future__ import annotations

import multiprocessing
import pathlib
import sys
from typing import Literal

import attrs
import torch
from torch import nn

from engine import TrainConfig
from engine.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".tif", ".tiff", ".jpg", ".jpeg")
JPEG_SUFFIXES = (".jpg", ".jpeg")
GENERATOR_HINT = ("for a synthetic example run `python tools/make_oct_dataset.py DIR` "
                  "and pass data.root=DIR")
#: In skip mode, this many unreadable files in a row mean something else is wrong.
MAX_CONSECUTIVE_BAD = 20


@attrs.define
class OctDataConfig:
    root: str = ""  # required: a folder with train/ and val/, one subfolder per class
    image_size: int = 224  # the network's input: square crops of this size
    mean: float = 0.14  # normalisation: pixel mean and std of the training set, in [0, 1]
    std: float = 0.18  # (tools/make_oct_dataset.py prints them for what it writes)
    balance: bool = False  # class-balanced sampling (a weighted draw with replacement)
    on_bad_file: Literal["stop", "skip"] = "stop"  # an unreadable image file
    augment_on: Literal["cpu", "cuda"] = "cpu"  # cuda: decode and augment on the GPU
    max_rotation: float = 10.0  # degrees
    min_crop_scale: float = 0.75  # random resized crop keeps at least this area fraction
    intensity_jitter: float = 0.2  # gain and gamma vary by up to this fraction


@attrs.define
class OctConfig(TrainConfig):
    epochs: int = 10
    batch_size: int = 12  # global, as in the seeds' OCT-A runs
    lr: float = 3e-4
    weight_decay: float = 1e-4
    num_workers: int | Literal["auto"] = "auto"
    # Random augmentation seeded by (seed, epoch, sample): the same whichever worker
    # loads a sample, so a resumed run sees exactly the augmentations of an unbroken one.
    per_sample_seed: bool = True
    log_every: int = 5
    data: OctDataConfig = attrs.Factory(OctDataConfig)


class UnreadableImageError(ConfigError):
    """An image file that cannot be decoded; the message names the file."""

    def __init__(self, message: str):
        # A DataLoader worker's exception reaches the training process as
        # type(exc)("Caught ... in DataLoader worker process N.\nOriginal Traceback...");
        # keep our own line: the user needs the path, not the worker's stack.
        marker = f"{type(self).__name__}: "
        if "\n" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


# ----------------------------------------------------------------------- model


def build_model(cfg: OctConfig) -> nn.Module:
    """torchvision's ResNet-18 (no pretrained weights: nothing is downloaded), with a
    one-channel first convolution for grayscale scans and a two-class head."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=2)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def build_optimizer(cfg: OctConfig, model: nn.Module):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


# ------------------------------------------------------------------------ files


def find_classes(root: pathlib.Path) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """The class names and, per split, the (path, label) samples in a stable order (the
    same on every rank). Every layout problem is a ConfigError before training starts."""
    if not str(root) or str(root) == ".":
        raise ConfigError("data.root is required: set data.root=DIR, a folder with train/ "
                          "and val/ holding one subfolder per class; " + GENERATOR_HINT)
    if not root.is_dir():
        raise ConfigError(f"data.root {str(root)!r} is not a folder; it should hold train/ "
                          "and val/ with one subfolder per class; " + GENERATOR_HINT)
    layouts: dict[str, list[str]] = {}
    samples: dict[str, list[tuple[str, int]]] = {}
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise ConfigError(f"data.root {str(root)!r} has no {split}/ folder; it should "
                              "hold train/ and val/ with one subfolder per class; "
                              + GENERATOR_HINT)
        layouts[split] = sorted(p.name for p in folder.iterdir()
                                if p.is_dir() and not p.name.startswith("."))
    if layouts["train"] != layouts["val"]:
        raise ConfigError(
            f"the class folders of {str(root)!r} differ between train/ "
            f"({', '.join(layouts['train']) or 'none'}) and val/ "
            f"({', '.join(layouts['val']) or 'none'}); both need the same class subfolders")
    classes = layouts["train"]
    if len(classes) != 2:
        raise ConfigError(
            f"{str(root / 'train')!r} has {len(classes)} class folders "
            f"({', '.join(classes) or 'none'}); the OCT recipes are binary: give exactly 2")
    for split in ("train", "val"):
        samples[split] = []
        for label, name in enumerate(classes):
            files = sorted(p for p in (root / split / name).iterdir()
                           if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
            if not files:
                raise ConfigError(f"{str(root / split / name)!r} holds no images "
                                  f"({', '.join(IMAGE_SUFFIXES)})")
            samples[split].extend((str(p), label) for p in files)
    return classes, samples


def load_image(path: str) -> torch.Tensor:
    """A grayscale image as float32 1xHxW in [0, 1], scaled by its bit depth."""
    import numpy as np
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()  # decode now: a truncated file fails here, not later
            if image.mode in ("I;16", "I;16L", "I;16B", "I;16N"):
                pixels, full_scale = np.asarray(image), 65535.0
            elif image.mode == "I":  # 32-bit integers: how some readers give 16-bit PNGs
                pixels, full_scale = np.asarray(image), 65535.0
                if pixels.min() < 0 or pixels.max() > 65535:
                    raise ValueError(f"32-bit pixel values {pixels.min()}..{pixels.max()} "
                                     "do not fit 16 bits")
            elif image.mode == "F":
                raise ValueError("floating-point images are not supported; save 8- or "
                                 "16-bit integers")
            else:  # L, P, RGB, LA...: 8 bits per channel, to one gray channel
                pixels, full_scale = np.asarray(image.convert("L")), 255.0
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError... by format
        raise OSError(f"{type(exc).__name__}: {exc}") from exc
    tensor = torch.from_numpy(pixels.astype(np.float32))
    return (tensor / full_scale).unsqueeze(0)


def read_jpeg_bytes(path: str) -> torch.Tensor:
    """The encoded file, checked for JPEG's start and end markers (a truncated file
    lacks the end marker), for decoding on the GPU."""
    data = pathlib.Path(path).read_bytes()
    if len(data) < 4 or data[:2] != b"\xff\xd8" or data.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        raise OSError("not a complete JPEG file (start or end marker missing)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# ------------------------------------------------------------------- transforms


class IntensityJitter:
    """Random gain and gamma: OCT devices and sessions differ in both."""

    def __init__(self, amount: float):
        self.amount = amount

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.amount <= 0:
            return image
        gain, gamma = (1.0 + (torch.rand(2) * 2.0 - 1.0) * self.amount).tolist()
        return (image.clamp(0.0, 1.0) ** gamma * gain).clamp(0.0, 1.0)


def make_transform(data: OctDataConfig, train: bool):
    """Float 1xHxW in [0, 1] -> normalised 1 x image_size x image_size (CPU or CUDA)."""
    from torchvision.transforms import v2

    size = data.image_size
    if train:
        steps = [
            # Crop and resize first: rotating the smaller image is cheaper.
            v2.RandomResizedCrop(size, scale=(data.min_crop_scale, 1.0), ratio=(0.9, 1.1),
                                 antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomVerticalFlip(),
            v2.RandomRotation(data.max_rotation),
            IntensityJitter(data.intensity_jitter),
        ]
    else:
        steps = [v2.Resize((size, size), antialias=True)]
    return v2.Compose([*steps, v2.Normalize([data.mean], [data.std])])


# -------------------------------------------------------------------- datasets


class OctFolder(torch.utils.data.Dataset):
    """``(image, label)`` samples of one split. With ``decode_on_device`` an "image" is
    the file as read (JPEG bytes, or pixels for PNG/TIFF), batched by
    :class:`EncodedCollate`, and :meth:`EncodedBatch.to` decodes and augments it."""

    def __init__(self, samples: list[tuple[str, int]], transform, *, split: str, rank: int,
                 on_bad_file: str, decode_on_device: bool = False):
        self.samples = samples
        self.targets = [label for _, label in samples]
        self.transform = transform
        self.split = split
        self.rank = rank
        self.on_bad_file = on_bad_file
        self.decode_on_device = decode_on_device
        if decode_on_device:
            # The loaders use a dataset's collate_fn (engine/data.py).
            self.collate_fn = EncodedCollate(transform)
        # Counts skips across this rank's loader workers (shared memory).
        self.skipped = multiprocessing.Value("i", 0)
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        for attempt in range(MAX_CONSECUTIVE_BAD + 1):
            path, label = self.samples[(index + attempt) % len(self.samples)]
            try:
                return self._read(path), label
            except OSError as exc:
                if self.on_bad_file == "stop":
                    raise UnreadableImageError(
                        f"cannot read image {path} ({exc}); fix or remove the file, or set "
                        "data.on_bad_file=skip to skip unreadable images") from None
                self._report_skip(path, exc)
        raise UnreadableImageError(
            f"{MAX_CONSECUTIVE_BAD + 1} unreadable images in a row in {self.split}/, the "
            f"last {path}; is data.root right?")

    def _read(self, path: str):
        if not self.decode_on_device:
            return self.transform(load_image(path))
        if path.lower().endswith(JPEG_SUFFIXES):
            return path, read_jpeg_bytes(path)
        return path, load_image(path)

    def _report_skip(self, path: str, exc: BaseException) -> None:
        with self.skipped.get_lock():
            self.skipped.value += 1
            count = self.skipped.value
        if path not in self._reported:  # once per file and loader process
            self._reported.add(path)
            print(f"warning: [rank {self.rank}] skipped unreadable image {path} ({exc}); "
                  f"{count} skip(s) in {self.split}/ so far", file=sys.stderr, flush=True)


class EncodedBatch:
    """A batch of files as read, decoded and augmented where it is moved to:
    ``batch.to(device)`` returns the normalised float tensor, as a batch of tensors'
    ``.to`` would. The trainer calls exactly that."""

    def __init__(self, items: list[tuple[str, torch.Tensor]], transform):
        self.items = items
        self.transform = transform

    def __len__(self) -> int:
        return len(self.items)

    def pin_memory(self) -> "EncodedBatch":
        return EncodedBatch([(p, t.pin_memory()) for p, t in self.items], self.transform)

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        device = torch.device(device)
        images: list[torch.Tensor | None] = [None] * len(self.items)
        jpegs = [i for i, (path, _) in enumerate(self.items)
                 if path.lower().endswith(JPEG_SUFFIXES)]
        if jpegs:
            try:
                decoded = decode_jpeg([self.items[i][1] for i in jpegs],
                                      mode=ImageReadMode.GRAY, device=device)
            except RuntimeError as exc:
                paths = ", ".join(self.items[i][0] for i in jpegs)
                reason = (str(exc).strip().splitlines() or ["failed"])[0]
                raise UnreadableImageError(
                    f"cannot decode the JPEG files of this batch on {device} ({reason}); "
                    f"one of: {paths}") from None
            for i, image in zip(jpegs, decoded):
                images[i] = image.float() / 255.0
        for i, (_, pixels) in enumerate(self.items):
            if images[i] is None:
                images[i] = pixels.to(device, non_blocking=non_blocking)
        return torch.stack([self.transform(image) for image in images])


class EncodedCollate:
    """(file as read, label) samples -> (EncodedBatch, labels)."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, samples):
        labels = torch.tensor([label for _, label in samples])
        return EncodedBatch([item for item, _ in samples], self.transform), labels


def build_oct_datasets(cfg: OctConfig, ctx):
    """The recipes' ``build_datasets``: checks the layout, returns (train, val)."""
    data = cfg.data
    _, samples = find_classes(pathlib.Path(data.root))
    on_device = data.augment_on == "cuda"
    if on_device and ctx.device.type != "cuda":
        raise ConfigError(f"data.augment_on=cuda needs a CUDA device, but this process "
                          f"computes on {ctx.device.type}; use data.augment_on=cpu")
    datasets = []
    for split in ("train", "val"):
        datasets.append(OctFolder(
            samples[split], make_transform(data, train=split == "train"), split=split,
            rank=ctx.world.rank, on_bad_file=data.on_bad_file, decode_on_device=on_device))
    train, val = datasets
    if data.balance:
        train.sample_weights = class_balanced_weights(train.targets)
    return train, val


def class_balanced_weights(targets: list[int]) -> torch.Tensor:
    """One weight per sample, 1 / (its class's count): each class is drawn equally often."""
    labels = torch.tensor(targets)
    counts = torch.bincount(labels).double()
    return 1.0 / counts[labels]
