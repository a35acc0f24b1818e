"""The set-up steps a worker runs, shared by every door that trains: engine-run's and
engine.fit's Engine, the custom loop's Context (engine.api) and tune-workers. One place,
so that the doors cannot drift apart (a custom loop's ``activation_checkpointing`` was
silently ignored while the Engine applied it).
"""

from __future__ import annotations


def prepare_model(model, cfg, parallel, device, say):
    """``model`` on ``device`` with the model transforms in torchtitan's order:
    activation checkpointing (``activation_checkpointing``), torch.compile (``compile.*``),
    then the parallel mode's wrap (DDP, fully_shard...); returns the wrapped model.
    ``say``: how the run prints a line (rank 0's)."""
    from engine import activation_checkpointing
    from engine.compile import compile_model

    model = model.to(device)
    model = activation_checkpointing.apply(model, cfg.activation_checkpointing)
    model = compile_model(model, cfg.compile, say)
    return parallel.wrap(model)
