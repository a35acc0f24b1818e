#!/usr/bin/env python3
"""A synthetic OCT-A data set, laid out as the OCT recipes read it.

    python tools/make_oct_dataset.py /tmp/oct                       # 200 train, 50 val
    python tools/make_oct_dataset.py /tmp/oct --train 24 --val 8 --sizes 64   # for tests

writes ``ROOT/train/<class>/*.png|tif|jpg`` and ``ROOT/val/<class>/...`` with the two
classes ``normal`` and ``disease``. Like real OCT-A en-face angiograms the images are
grayscale, 304x304 or 400x400 pixels, 8- or 16-bit, in a mix of PNG, TIFF and JPEG (JPEG
only 8-bit, as in practice).

Each image is a capillary mesh (thin bright lines along the zero contours of a smooth
random field), a few large vessels, and a dark foveal avascular zone (FAZ) near the
centre, under speckle noise, a random gain and gamma. The classes differ the way
diabetic retinopathy differs from a healthy eye: ``disease`` has a larger FAZ and patches
of capillary dropout. The distributions overlap and the random gain hides the mean
brightness, so a CNN must look at structure, not at one pixel statistic.

Only numpy and Pillow: no torch, so it runs anywhere quickly. The same seed gives the
same files.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

CLASSES = ("normal", "disease")
SPLITS = ("train", "val")
DEFAULT_SIZES = (304, 400)


def smooth_field(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """White noise low-passed by a Gaussian of ``sigma`` pixels, scaled to unit std."""
    noise = rng.standard_normal((size, size))
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    kernel = np.exp(-2.0 * (np.pi * sigma) ** 2 * (fx ** 2 + fy ** 2))
    field = np.fft.irfft2(np.fft.rfft2(noise) * kernel, s=(size, size))
    return field / max(field.std(), 1e-12)


def ridges(field: np.ndarray, width: float) -> np.ndarray:
    """Bright lines where the field crosses zero: a vessel-like mesh in [0, 1]."""
    return np.exp(-(field / width) ** 2)


def oct_image(rng: np.random.Generator, size: int, label: int) -> np.ndarray:
    """One synthetic OCT-A angiogram as float64 in [0, 1]."""
    disease = label == 1
    # Capillaries: density follows the field's correlation length (a fraction of the
    # image, so that small test images keep the same look).
    cap_sigma = size * (0.0095 if disease else 0.008)
    capillaries = ridges(smooth_field(rng, size, cap_sigma), 0.22)
    # Dropout: smooth patches where the capillaries are gone.
    dropout_area = rng.uniform(0.15, 0.35) if disease else rng.uniform(0.0, 0.1)
    patches = smooth_field(rng, size, size * 0.07)
    threshold = np.quantile(patches, 1.0 - dropout_area) if dropout_area > 0 else np.inf
    capillaries *= 1.0 / (1.0 + np.exp((patches - threshold) * 6.0))
    vessels = ridges(smooth_field(rng, size, size * 0.06), 0.08)

    # The foveal avascular zone: an ellipse near the centre without vessels.
    radius = size * (rng.uniform(0.09, 0.16) if disease else rng.uniform(0.055, 0.11))
    cy, cx = size / 2 + rng.normal(0.0, size * 0.03, 2)
    ratio = rng.uniform(0.8, 1.25)
    yy, xx = np.mgrid[0:size, 0:size]
    r = np.sqrt(((yy - cy) * ratio) ** 2 + ((xx - cx) / ratio) ** 2)
    faz = 1.0 / (1.0 + np.exp(-(r - radius) / (size * 0.01)))

    image = (0.55 * capillaries + 0.7 * vessels) * faz
    image += 0.06 * np.abs(rng.standard_normal((size, size)))  # speckle
    image = np.clip(image * rng.uniform(0.65, 1.1), 0.0, 1.0) ** rng.uniform(0.8, 1.25)
    return image


def save(image: np.ndarray, path: pathlib.Path, bits: int) -> None:
    from PIL import Image

    if bits == 16:
        pixels = np.round(image * 65535.0).astype(np.uint16)
    else:
        pixels = np.round(image * 255.0).astype(np.uint8)
    picture = Image.fromarray(pixels)
    if path.suffix == ".jpg":
        picture.save(path, quality=92)
    else:
        picture.save(path)


def choose_format(rng: np.random.Generator, bit_depths, formats) -> tuple[int, str]:
    bits = int(rng.choice(bit_depths))
    usable = [f for f in formats if not (bits == 16 and f == "jpg")] or ["png"]
    return bits, str(rng.choice(usable))


def generate(root, *, train: int = 200, val: int = 50, sizes=DEFAULT_SIZES,
             bit_depths=(8, 16), formats=("png", "tif", "jpg"), disease_fraction: float = 0.5,
             seed: int = 0) -> dict:
    """Write the data set under ``root``; returns counts and the train set's mean/std."""
    root = pathlib.Path(root)
    counts: dict[str, dict[str, int]] = {}
    total = total_sq = pixels = 0.0
    for split_id, (split, n) in enumerate(zip(SPLITS, (train, val))):
        counts[split] = {c: 0 for c in CLASSES}
        for c in CLASSES:
            (root / split / c).mkdir(parents=True, exist_ok=True)
        n_disease = round(n * disease_fraction)
        for index in range(n):
            # One generator per image: any image can be regenerated on its own.
            rng = np.random.default_rng([seed, split_id, index])
            label = 1 if index < n_disease else 0
            size = int(rng.choice(sizes))
            image = oct_image(rng, size, label)
            bits, fmt = choose_format(rng, bit_depths, formats)
            save(image, root / split / CLASSES[label] / f"{split}_{index:05d}.{fmt}", bits)
            counts[split][CLASSES[label]] += 1
            if split == "train":
                total += image.sum()
                total_sq += (image ** 2).sum()
                pixels += image.size
    mean = total / max(pixels, 1)
    std = float(np.sqrt(max(total_sq / max(pixels, 1) - mean ** 2, 0.0)))
    return {"counts": counts, "mean": float(mean), "std": std}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "integers, e.g. 304,400") from None
    if not values or min(values) < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes of at least 16 pixels")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="output folder (train/ and val/ are created in it)")
    p.add_argument("--train", type=int, default=200, help="training images (default 200)")
    p.add_argument("--val", type=int, default=50, help="validation images (default 50)")
    p.add_argument("--sizes", type=_int_list, default=DEFAULT_SIZES,
                   help="square image sizes to draw from (default 304,400)")
    p.add_argument("--bit-depths", default="8,16", help="8, 16 or 8,16 (default)")
    p.add_argument("--formats", default="png,tif,jpg", help="png, tif, jpg (default: all)")
    p.add_argument("--disease-fraction", type=float, default=0.5,
                   help="fraction of the 'disease' class, e.g. 0.2 for an imbalanced set")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    bit_depths = tuple(int(b) for b in args.bit_depths.split(",") if b.strip())
    formats = tuple(f.strip().lower().lstrip(".") for f in args.formats.split(",") if f.strip())
    if not bit_depths or set(bit_depths) - {8, 16}:
        p.error(f"--bit-depths {args.bit_depths!r}: use 8, 16 or 8,16")
    formats = tuple("tif" if f == "tiff" else "jpg" if f == "jpeg" else f for f in formats)
    if not formats or set(formats) - {"png", "tif", "jpg"}:
        p.error(f"--formats {args.formats!r}: use png, tif and/or jpg")
    if args.train < 1 or args.val < 0:
        p.error("--train must be >= 1 and --val >= 0")
    if not 0.0 <= args.disease_fraction <= 1.0:
        p.error(f"--disease-fraction {args.disease_fraction} must lie in [0, 1]")

    result = generate(args.root, train=args.train, val=args.val, sizes=args.sizes,
                      bit_depths=bit_depths, formats=formats,
                      disease_fraction=args.disease_fraction, seed=args.seed)
    for split, per_class in result["counts"].items():
        print(f"{split}: " + ", ".join(f"{n} {c}" for c, n in per_class.items()))
    print(f"wrote {args.root}; train pixel mean {result['mean']:.3f}, std "
          f"{result['std']:.3f} (data.mean={result['mean']:.3f} "
          f"data.std={result['std']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
