"""A checkpointer plugin in one file: each snapshot one gzip-compressed torch.save.

    engine-run recipes/cifar_ddp.py -p gzip_store checkpointer=gzip

(with this file's folder on PYTHONPATH; or installed, with an ``engine.plugins`` entry
point). The store base does everything but the format: the manifest with its checksum,
the ``latest`` and ``best`` pointers, pruning to ``checkpoint.keep_last``, falling back
past a damaged snapshot, ``--resume`` of a folder, and cleaning up after killed writes.
"""

from __future__ import annotations

import gzip
import io

import engine
from engine.checkpoint import SnapshotStore


class GzipStore(SnapshotStore):
    name = "gzip"
    suffix = ".pt.gz"

    def write(self, path, state):
        import torch

        def compressed(fileobj):
            # mtime=0: the same snapshot gives the same bytes.
            with gzip.GzipFile(fileobj=fileobj, mode="wb", compresslevel=1, mtime=0) as gz:
                torch.save(state, gz)

        # A temp file, fsynced and renamed; returns its size and checksum.
        return self.write_file(path, compressed)

    def read(self, path, *, map_location=None, template=None):
        import torch

        with gzip.open(path, "rb") as f:
            data = io.BytesIO(f.read())  # torch.load seeks; a gzip stream cannot
        return torch.load(data, map_location=map_location, weights_only=True)


@engine.hookimpl
def engine_register_checkpointers(registry):
    registry.add(GzipStore)
