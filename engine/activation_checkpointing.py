"""Activation checkpointing (``activation_checkpointing=Block,...``): the named blocks
keep no activations for backward; backward runs their forward again to get them.

torch's own wrapper does it (``checkpoint_wrapper``, non-reentrant
``torch.utils.checkpoint``), with the RNG state restored around the recomputation, so
dropout draws the same masks twice: losses and weights are those of the run without it.
Applied to the bare model before the parallel wrap (torchtitan's order), so it works
alike for every mode; torch's hooks strip ``_checkpoint_wrapped_module.`` from
``state_dict()`` keys, so snapshots keep the plain model's keys.
"""

from __future__ import annotations

import functools

from engine.parallel import parse_class_names, select_blocks


def apply(model, spec: str):
    """Wrap every submodule of ``model`` whose class is named in ``spec`` (comma
    separated) for activation checkpointing, in place; returns ``model``. An empty
    ``spec`` leaves it untouched; a name that matches nothing is a ConfigError."""
    names = parse_class_names(spec)
    if not names:
        return model
    # torch.distributed's wrapper: only when asked (worker_setup imports this module)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    blocks = {id(m) for _, m in select_blocks(model, names, "activation_checkpointing")}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                preserve_rng_state=True)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: id(m) in blocks)
    return model
