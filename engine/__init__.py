"""A PyTorch training engine: DDP on whatever the machine or cluster offers.

``import engine`` stays cheap: it does not import torch, torchvision or tensorboard.
Those come in when a run needs them.
"""

from __future__ import annotations

import importlib

import pluggy

__version__ = "0.2.0"

#: Decorator for plugin hook implementations (``@engine.hookimpl``).
hookimpl = pluggy.HookimplMarker("engine")

# Names resolved on first use, so that ``import engine`` does not pull in torch.
_LAZY = {
    "TrainConfig": "engine.config",
    "Launcher": "engine.launcher",
    "World": "engine.world",
    "Parallel": "engine.parallel",
    "Checkpointer": "engine.checkpoint",
    "SnapshotStore": "engine.checkpoint",
    "EngineError": "engine.errors",
    "launch": "engine.api",
    "fit": "engine.launching",
    "Context": "engine.api",
    "load_model": "engine.model_io",
}

__all__ = ["__version__", "hookimpl", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
