"""Checkpoint plumbing shared by the checkpoint plugins.

- :func:`atomic_write`: temp file in the same directory, fsync, rename, fsync of the
  directory. A crash at any moment leaves either the old file or the new one.
- :func:`model_digest`: the sha256 of a state_dict, the same on every machine.
- :func:`load_model_state`: accepts keys with or without DDP's ``module.`` prefix and
  reports a mismatch as the missing and unexpected keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pathlib
from typing import Any, Callable, ClassVar

from engine.errors import CheckpointError


def fsync_directory(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter(io.RawIOBase):
    """A file wrapper that hashes and counts what is written through it.

    sha256 costs about as much CPU as writing the bytes (``tools/bench_checkpoint.py
    --breakdown``), so a large write is hashed on a helper thread while this thread
    writes the same bytes to the file. Both release the GIL: with a core to spare, the
    hash hides behind the write instead of adding to it. Call :meth:`stop` when done.
    """

    #: Smaller writes are hashed inline: not worth a hand-off to the thread.
    PARALLEL_BYTES = 1 << 20

    def __init__(self, raw):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._helper = None  # a one-thread pool, started by the first large write

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self.PARALLEL_BYTES:
            if self._helper is None:
                from concurrent.futures import ThreadPoolExecutor  # 30 ms: not at import

                self._helper = ThreadPoolExecutor(1, thread_name_prefix="sha256")
            hashing = self._helper.submit(self.sha256.update, view)
            try:
                n = self.raw.write(view)
            finally:
                hashing.result()  # the caller may reuse its buffer once we return
        else:
            self.sha256.update(view)
            n = self.raw.write(view)
        self.size += view.nbytes
        return view.nbytes if n is None else n

    def flush(self) -> None:
        self.raw.flush()

    def stop(self) -> None:
        """End the helper thread (the writer stays usable, hashing inline)."""
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None


def atomic_write(path: pathlib.Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write ``path`` through ``write(fileobj)`` crash-consistently.

    Returns (size, sha256) of what was written. On any error (a full disk included) the
    temp file is removed and the previous ``path``, if any, is untouched.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as raw:
            writer = HashingWriter(raw)
            try:
                write(writer)
            finally:
                writer.stop()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return writer.size, writer.sha256.hexdigest()


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ state dicts


def model_digest(state_dict: dict) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, keys sorted.

    Tensors are moved to the CPU and made contiguous first, so the digest does not
    depend on the device or the memory layout.
    """
    import torch

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            digest.update(f"{name}={tensor!r};".encode())
            continue
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def strip_module_prefix(state_dict: dict) -> dict:
    """Remove DDP/DataParallel's ``module.`` prefix when every key carries it."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def add_module_prefix(state_dict: dict) -> dict:
    return {k if k.startswith("module.") else f"module.{k}": v for k, v in state_dict.items()}


def load_model_state(model, state_dict: dict, source: str = "checkpoint") -> None:
    """Load into a plain or DDP/DP-wrapped model, with or without ``module.`` keys."""
    target = getattr(model, "module", model)
    state_dict = strip_module_prefix(state_dict)
    expected = set(target.state_dict())
    given = set(state_dict)
    missing = sorted(expected - given)
    unexpected = sorted(given - expected)
    if missing or unexpected:
        def some(keys):
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")

        parts = []
        if missing:
            parts.append(f"missing keys: {some(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {some(unexpected)}")
        raise CheckpointError(f"{source} does not match the model; " + "; ".join(parts))
    try:
        target.load_state_dict(state_dict)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = next((line.strip() for line in first[1:] if line.strip()), first[0])
        raise CheckpointError(f"{source} does not match the model: {detail}") from None


# ------------------------------------------------------------------- plugin base


class Checkpointer:
    """Writes and reads snapshots under ``directory``.

    A snapshot is a dict of tensors and plain Python values (loadable with
    ``torch.load(weights_only=True)``).
    """

    name: ClassVar[str] = ""
    #: True when every rank takes part in save and load (sharded formats).
    all_ranks: ClassVar[bool] = False

    def __init__(self, directory: pathlib.Path, cfg=None, world=None):
        self.directory = pathlib.Path(directory)
        self.cfg = cfg
        self.world = world

    def save(self, state: dict, *, epoch: int, step: int, metrics: dict | None = None
             ) -> pathlib.Path:
        raise NotImplementedError

    def load(self, path: pathlib.Path, map_location=None) -> dict:
        raise NotImplementedError

    def latest(self) -> pathlib.Path | None:
        """The newest snapshot that passes its integrity check, or None."""
        raise NotImplementedError

    def wait(self) -> None:
        """Block until every save started so far is durable."""

    # The engine calls these two. The defaults suit checkpointers that store the
    # snapshot dict as it is; a sharded format overrides them to work with the model
    # and optimizer directly (see plugins/dcp.py).

    def save_snapshot(self, eng, state: dict, *, epoch: int, step: int,
                      metrics: dict | None = None) -> pathlib.Path | None:
        """Called on every rank with the snapshot dict (engine.snapshot.capture);
        by default only rank 0 writes, unless ``all_ranks``."""
        if self.all_ranks or eng.is_rank0:
            return self.save(state, epoch=epoch, step=step, metrics=metrics)
        return None

    def restore_snapshot(self, eng, path: pathlib.Path) -> None:
        """Load ``path`` into the engine's model, optimizer and train state."""
        from engine import snapshot

        # Onto the CPU: load_state_dict copies into the model's and optimizer's devices,
        # and the RNG states must stay CPU tensors (a GPU resume crashed restoring them).
        snapshot.restore(eng, self.load(path, map_location="cpu"), source=str(path))

    def close(self) -> None:
        self.wait()
