"""Checkpointer ``torch-file`` (the default): one torch.save file per snapshot, by rank 0.

Layout under ``<out_dir>/checkpoints/``::

    snapshot-e0002-s00001564.pt        the snapshot (torch.save, weights_only-loadable)
    snapshot-e0002-s00001564.pt.json   its manifest: size, xxh3_128, epoch, step, metrics
    latest                             the file name of the newest good snapshot
    best                               the best one by cfg.checkpoint.best_metric, if set

The file is written through :func:`engine.atomic_io.atomic_write`, which checksums the
bytes as they go (xxh3-128; manifests of older versions hold a sha256, still checked)
and fsyncs it before its rename. Everything else (manifest, pointers, one fsync of the
folder per save, pruning, ``latest()`` falling back past a snapshot that fails its
check, clean-up of what killed writes leave) is :class:`engine.checkpoint.SnapshotStore`'s.
``load()`` checks the file against its manifest too, unless this process has just
verified the same unchanged file (``latest()`` then ``load()`` hashes it once).
Storage only: the snapshot dict comes from and goes back to engine.snapshot.
"""

from __future__ import annotations

import pathlib

import engine
from engine.checkpoint import SnapshotStore

# torch is imported inside the functions that use it: the plugin manager loads every
# built-in plugin without torch (engine-run plugins; a run's launching process).


def save_without_crc32(state: dict, fileobj) -> None:
    """torch.save, minus the CRC32 of every record in its zip container: the manifest's
    checksum already covers the whole file, torch.load never checks the CRC, and on a
    busy CPU computing both made a save much slower than it needs to be."""
    import torch
    import torch.serialization as serialization

    if not hasattr(serialization, "set_crc32_options"):  # torch < 2.4
        torch.save(state, fileobj)
        return
    previous = serialization.get_crc32_options()
    serialization.set_crc32_options(False)
    try:
        torch.save(state, fileobj)
    finally:
        serialization.set_crc32_options(previous)


class TorchFileCheckpointer(SnapshotStore):
    name = "torch-file"
    suffix = ".pt"

    def write(self, path: pathlib.Path, state: dict) -> dict:
        return self.write_file(path, lambda f: save_without_crc32(state, f))

    def read(self, path, *, map_location=None, template=None):
        import torch

        return torch.load(path, map_location=map_location, weights_only=True)


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(TorchFileCheckpointer)
