"""engine/activation_checkpointing.py: the named blocks recompute their activations in
backward, with the same RNG draws, so training is bit-identical to the run without it;
under fsdp too, in a real 2-process run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import activation_checkpointing
from engine.errors import ConfigError
from tests.conftest import read_summary
from tests.recipes.tiny_parallel_runs import run_tiny


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)  # recomputed in backward: must draw the same mask

    def forward(self, x):
        return self.drop(torch.tanh(self.fc(x)))


def train(spec: str) -> tuple[list[float], dict, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 2))
    model = activation_checkpointing.apply(model, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    losses = []
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), model


def test_checkpointed_blocks_train_bit_identically_and_keep_their_state_dict_keys():
    plain_losses, plain_state, _ = train("")
    losses, state, model = train("Block")
    assert [type(m).__name__ for m in model][:2] == ["CheckpointWrapper"] * 2
    assert losses == plain_losses
    assert list(state) == list(plain_state)  # no _checkpoint_wrapped_module. in keys
    for name in state:
        assert torch.equal(state[name], plain_state[name]), name


def test_a_class_that_matches_nothing_is_one_line():
    with pytest.raises(ConfigError, match="activation_checkpointing: Blok matches no "
                       "submodule of Sequential; its submodule classes are: Block, "):
        activation_checkpointing.apply(nn.Sequential(Block()), "Blok")


def test_under_fsdp_on_two_processes_the_weights_are_those_without_it(tmp_path):
    # val_size=17: rank 0 validates 3 batches, rank 1 only 2 (fsdp's forward gathers
    # parameters: the ranks must not wait for each other's forwards there).
    common = ("--parallel", "fsdp", "fsdp.shard=Linear", "epochs=1", "val_size=17")
    run_tiny(tmp_path / "plain", *common)
    run_tiny(tmp_path / "ac", *common, "activation_checkpointing=Linear")
    assert (read_summary(tmp_path / "ac")["weights_sha256"]
            == read_summary(tmp_path / "plain")["weights_sha256"])
    assert (read_summary(tmp_path / "ac")["train_loss"]
            == read_summary(tmp_path / "plain")["train_loss"])
    assert read_summary(tmp_path / "ac")["val_loss"] is not None
