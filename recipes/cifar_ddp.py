"""CIFAR-10 with the seeds' small CNN (conv 3-6-16, fc 120-84-10), SGD, global batch 64.

    engine-run recipes/cifar_ddp.py                      # DDP on what the machine has
    engine-run recipes/cifar_ddp.py epochs=10 data.root=/data/cifar

data.source: ``auto`` uses CIFAR-10 when it is under data.root or can be downloaded,
otherwise (with one warning) a synthetic CIFAR-shaped set that the network can learn;
``cifar10`` insists on the real set; ``synthetic`` never looks for it.
"""

from __future__ import annotations

import pathlib
import pickle
import socket
from typing import Literal

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches
from engine.errors import ConfigError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
DOWNLOAD_TIMEOUT_S = 20


@attrs.define
class DataConfig:
    root: str = "./data"
    source: Literal["auto", "cifar10", "synthetic"] = "auto"
    download: bool = True  # try to download CIFAR-10 when it is not under root
    # Training samples of the synthetic set (val: a fifth); checked when set, so that a
    # run without samples is refused before any worker starts.
    synthetic_size: int = attrs.field(default=10000, validator=attrs.validators.ge(1))


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 64
    lr: float = 0.001
    momentum: float = 0.9
    out_dir: str = "runs/cifar_ddp"
    data: DataConfig = attrs.Factory(DataConfig)


class Net(nn.Module):
    """The network of the seeds (the PyTorch CIFAR tutorial's)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def build_model(cfg: Config) -> nn.Module:
    return Net()


def build_optimizer(cfg: Config, model: nn.Module):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


# ----------------------------------------------------------------------- data


def cifar_present(root: pathlib.Path) -> bool:
    folder = root / CIFAR_FOLDER
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    return all((folder / name).is_file() for name in names)


def prepare_data(cfg: Config, ctx) -> None:
    """Local rank 0 only: unpack or download CIFAR-10 when it is not there yet."""
    if cfg.data.source == "synthetic":
        return
    root = pathlib.Path(cfg.data.root)
    if cifar_present(root):
        return
    from torchvision.datasets.utils import download_and_extract_archive, extract_archive

    if (root / CIFAR_ARCHIVE).is_file():
        extract_archive(str(root / CIFAR_ARCHIVE), str(root))
        return
    if not cfg.data.download:
        return
    from torchvision.datasets import CIFAR10

    # Without a network the download fails fast (DNS) or, behind a black hole, would
    # wait forever: bound it.
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename,
                                     md5=CIFAR10.tgz_md5)
    except Exception as exc:  # no network, proxy, disk: build_datasets decides what to do
        ctx.download_error = f"{type(exc).__name__}: {exc}"
    finally:
        socket.setdefaulttimeout(previous)


def download_failure(cfg: Config, ctx) -> str:
    """Why CIFAR-10 was not downloaded, as prepare_data found (on a local rank 0)."""
    if not cfg.data.download:
        return "data.download=false"
    return getattr(ctx, "download_error", None) or "local rank 0's download failed"


def build_datasets(cfg: Config, ctx):
    root = pathlib.Path(cfg.data.root)
    if cfg.data.source != "synthetic" and cifar_present(root):
        return cifar10(root, train=True), cifar10(root, train=False)
    if cfg.data.source == "cifar10":
        raise ConfigError(
            f"data.source=cifar10 but CIFAR-10 is not under {str(root)!r} "
            f"({download_failure(cfg, ctx)}): put the python version there "
            f"({root / CIFAR_FOLDER}/data_batch_1..5, test_batch, batches.meta, or "
            f"{root / CIFAR_ARCHIVE}), or set data.root"
        )
    if cfg.data.source == "auto":
        ctx.warn(f"CIFAR-10 is not under {str(root)!r} and could not be downloaded "
                 f"({download_failure(cfg, ctx)}); training on a synthetic CIFAR-shaped "
                 f"set of {cfg.data.synthetic_size} images instead (data.source=cifar10 to "
                 "insist on the real one)")
    return synthetic_cifar(cfg.data.synthetic_size, seed=1234)


def cifar10(root: pathlib.Path, train: bool):
    import torchvision.transforms as T
    from torchvision.datasets import CIFAR10

    class LocalCIFAR10(CIFAR10):
        # torchvision checks the md5 of the official files; a file that is present
        # is enough here (a copy you prepared yourself loads too). Downloads are still
        # checked against the official archive's md5 in prepare_data.
        def _check_integrity(self) -> bool:
            return cifar_present(pathlib.Path(self.root))

        def _load_meta(self) -> None:
            with open(pathlib.Path(self.root) / self.base_folder / self.meta["filename"],
                      "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    transform = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    return LocalCIFAR10(str(root), train=train, transform=transform, download=False)


def synthetic_cifar(train_size: int, seed: int):
    """Ten classes, each a smooth colour pattern of its own, under heavy noise and a
    random shift: a small CNN learns it within an epoch or two, but not at once."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(40, 40),
                              mode="bilinear", align_corners=False)

    def make(n: int):
        labels = torch.randint(0, 10, (n,), generator=g)
        dx, dy = torch.randint(0, 9, (2, n), generator=g)
        images = torch.empty(n, 3, 32, 32)
        for i in range(n):
            images[i] = templates[labels[i], :, dy[i]:dy[i] + 32, dx[i]:dx[i] + 32]
        images += 1.5 * torch.randn(n, 3, 32, 32, generator=g)
        return TensorDataset(images, labels)

    return make(train_size), make(max(1, train_size // 5))
