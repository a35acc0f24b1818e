"""The checkpointer interface, and the state-dict helpers the core, the checkpointers
and tools/ckpt.py share.

Words (used the same way in the code, the docs and the messages):

- a **snapshot** is the whole training state that an exact resume needs: model,
  optimizer, scheduler, grad scaler, epoch/step/position, RNG states, config. The core
  captures and restores it (:mod:`engine.snapshot`); on disk it is one file or folder
  (``snapshot-e0002-s00001564.pt``) under ``<out_dir>/checkpoints/``.
- a **checkpointer** (a plugin: torch-file, async, dcp) is storage only: it saves a
  snapshot dict, lists the saved ones, verifies and loads them back. It never sees the
  Engine, a model or an optimizer.
- **checkpoint** on its own names that storage side: the ``checkpoint.*`` config group
  (when to save, how many to keep), the ``checkpoints/`` folder, :class:`CheckpointError`.

State-dict helpers:

- :func:`model_digest`: the sha256 of a state_dict, the same on every machine.
- :func:`load_model_state`: accepts keys with or without DDP's ``module.`` prefix and
  reports a mismatch as the missing and unexpected keys.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import ClassVar

from engine.errors import CheckpointError


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


# ----------------------------------------------------------- the checkpointer


class Checkpointer:
    """Storage for snapshots under ``directory``: save, list, verify, load. No Engine.

    A snapshot reaches :meth:`save` as a dict of tensors and plain Python values
    (loadable with ``torch.load(weights_only=True)``), and :meth:`load` gives the same
    dict back. The core (:mod:`engine.snapshot`) decides what goes in and what to do
    with it. Constructed as ``Checkpointer(directory, cfg, world)``: ``cfg.checkpoint``
    says how many to keep and which is best, ``world`` which rank this is.
    """

    name: ClassVar[str] = ""
    #: True when every rank takes part in save and load (sharded formats); otherwise
    #: only rank 0 saves, and every rank loads.
    all_ranks: ClassVar[bool] = False
    #: True when the snapshot's "model" and "optimizer" entries are to be in the form of
    #: torch.distributed.checkpoint.state_dict.get_state_dict (keyed by parameter name,
    #: sharded tensors left sharded) instead of ``module.state_dict()`` /
    #: ``optimizer.state_dict()``. :meth:`load` then gets a ``template`` of that form to
    #: load into, since a sharded format reads each rank's part in place.
    distributed_state_dict: ClassVar[bool] = False

    def __init__(self, directory: pathlib.Path, cfg=None, world=None):
        self.directory = pathlib.Path(directory)
        self.cfg = cfg
        self.world = world

    def save(self, state: dict, *, epoch: int, step: int, metrics: dict | None = None
             ) -> pathlib.Path:
        """Store ``state`` durably; returns its path (durable once :meth:`wait` returns)."""
        raise NotImplementedError

    def load(self, path: pathlib.Path, *, map_location=None, template: dict | None = None
             ) -> dict:
        """The snapshot dict stored at ``path``. ``template``: see
        :attr:`distributed_state_dict`; formats that store the dict as it is ignore it."""
        raise NotImplementedError

    def latest(self) -> pathlib.Path | None:
        """The newest snapshot that passes its integrity check, or None."""
        raise NotImplementedError

    def best(self) -> pathlib.Path | None:
        """The best snapshot by ``cfg.checkpoint.best_metric``, or None (no metric set,
        none saved yet, or a format that does not keep one)."""
        return None

    def verify(self, path: pathlib.Path) -> str | None:
        """What is wrong with the snapshot at ``path`` (None: nothing, or a format that
        cannot tell); ``--resume PATH`` asks before loading."""
        return None

    def wait(self) -> None:
        """Block until every save started so far is durable."""

    def close(self) -> None:
        self.wait()
