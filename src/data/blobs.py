"""Small learnable classification images for tests of the trainer ("blobs").

Class ``k`` of ``K`` is an oriented grating at angle ``k * pi / K`` under a Gaussian envelope at a random
position, with a random wavelength, phase and contrast, a class-independent random colour mix over the
channels, and Gaussian noise. A small CNN separates the classes within a few epochs; a linear model on the
pixels cannot (the phase and position are random), so the data exercises convolutions. With many classes
(an ImageNet head's 1000) neighbouring angles overlap: such a set has the right shapes for a throughput run,
not a learnable task.

Datasets: ``inputs`` float32 ``(M, C, H, W)``, ``labels`` int64 ``(M,)``, one sample per chunk.
Deterministic from the seed (sample ``i`` uses ``SeedSequence(seed, spawn_key=(i,))``).
"""
from __future__ import annotations

import json
import math

import numpy as np

FORMAT = "lbannpy-blobs"
VERSION = 1


class BlobsDataError(ValueError):
    """Generator parameters that cannot produce a data set."""


def check_params(size: int, samples: int, classes: int, channels: int, noise: float, seed: int) -> None:
    if size < 4:
        raise BlobsDataError(f"--size must be at least 4 pixels, got {size}")
    if samples < 1:
        raise BlobsDataError(f"--samples must be at least 1, got {samples}")
    if not 2 <= classes <= 1000:
        raise BlobsDataError(f"--classes must be between 2 and 1000, got {classes}")
    if channels < 1:
        raise BlobsDataError(f"--channels must be at least 1, got {channels}")
    if noise < 0:
        raise BlobsDataError(f"--noise must be non-negative, got {noise}")
    if seed < 0:
        raise BlobsDataError(f"--seed must be non-negative, got {seed}")


def generate_sample(index: int, size: int, classes: int, channels: int, noise: float,
                    seed: int) -> tuple[np.ndarray, int]:
    """Sample ``index``: image ``(channels, size, size)`` float32 and its class."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(index,)))
    label = int(rng.integers(classes))
    theta = label * math.pi / classes + rng.normal(0.0, 0.05)
    wavelength = size * rng.uniform(0.15, 0.3)          # pixels
    phase = rng.uniform(0.0, 2 * math.pi)
    cy, cx = rng.uniform(0.3, 0.7, 2) * size
    sigma = size * rng.uniform(0.2, 0.35)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    along = (xx - cx) * math.cos(theta) + (yy - cy) * math.sin(theta)
    envelope = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * sigma * sigma))
    pattern = rng.uniform(0.7, 1.3) * envelope * np.cos(2 * math.pi * along / wavelength + phase)
    mix = rng.uniform(0.5, 1.0, channels) * rng.choice([-1.0, 1.0], channels)
    img = mix[:, None, None] * pattern[None] + rng.normal(0.0, noise, (channels, size, size))
    return img.astype(np.float32), label


def write_blobs(path: str, size: int = 32, samples: int = 256, classes: int = 4, channels: int = 3,
                noise: float = 0.3, seed: int = 0) -> dict:
    """Write the data set to ``path``; returns a summary dict (with the class counts)."""
    import h5py

    check_params(size, samples, classes, channels, noise, seed)
    params = {"size": size, "samples": samples, "classes": classes, "channels": channels,
              "noise": noise, "seed": seed}
    counts = np.zeros(classes, dtype=np.int64)
    with h5py.File(path, "w") as fh:
        fh.attrs["format"] = FORMAT
        fh.attrs["version"] = VERSION
        fh.attrs["generator"] = "blobs"
        fh.attrs["params"] = json.dumps(params, sort_keys=True)
        fh.attrs["num_classes"] = classes
        dx = fh.create_dataset("inputs", shape=(samples, channels, size, size), dtype=np.float32,
                               chunks=(1, channels, size, size), track_times=False)
        labels = np.empty(samples, dtype=np.int64)
        for i in range(samples):
            img, labels[i] = generate_sample(i, size, classes, channels, noise, seed)
            dx.write_direct(img, dest_sel=np.s_[i])
            counts[labels[i]] += 1
        fh.create_dataset("labels", data=labels, track_times=False)
    return {"path": path, "samples": samples, "size": size, "channels": channels, "classes": classes,
            "class_counts": counts.tolist()}
