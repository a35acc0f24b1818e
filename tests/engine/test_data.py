"""engine/data.py in-process: batches to the device, the batch split, the samplers'
orders (resumable, sharded, weighted) and per-sample seeding."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from engine import data
from engine.errors import CheckpointError, ConfigError
from engine.world import World

Pair = collections.namedtuple("Pair", "inputs targets")


def test_to_device_moves_nested_batches_and_keeps_their_shape():
    batch = {"image": torch.ones(2, 3), "parts": [torch.zeros(2), (torch.ones(1), 5)],
             "pair": Pair(torch.ones(2), torch.zeros(2)), "name": "a"}
    moved = data.to_device(batch, torch.device("meta"))
    assert moved["image"].device.type == "meta"
    assert isinstance(moved["parts"], list) and isinstance(moved["parts"][1], tuple)
    assert moved["parts"][0].device.type == moved["parts"][1][0].device.type == "meta"
    assert moved["parts"][1][1] == 5 and moved["name"] == "a"  # not tensors: unchanged
    assert type(moved["pair"]) is Pair and moved["pair"].targets.device.type == "meta"
    assert batch["image"].device.type == "cpu"  # the input is not modified


def test_to_device_on_the_same_device_returns_the_same_tensors():
    inputs, targets = torch.ones(2), torch.zeros(2)
    moved = data.to_device([inputs, targets], torch.device("cpu"))
    assert moved[0] is inputs and moved[1] is targets


class Encoded:
    """A recipe's own batch type: decoded where it is moved to (as the OCT recipe's)."""

    def __init__(self, raw):
        self.raw = raw

    def to(self, device, non_blocking=False):
        return (self.raw.float() / 255).to(device, non_blocking=non_blocking)


def test_to_device_calls_the_to_of_a_recipes_own_batch_type():
    # (Encoded batch, labels), as the OCT recipe's GPU decoding collates them: the model
    # gets what Encoded.to returns (it got the Encoded object itself, and failed in conv2d).
    moved = data.to_device((Encoded(torch.full((2,), 255, dtype=torch.uint8)),
                            torch.zeros(2)), torch.device("meta"))
    assert isinstance(moved[0], torch.Tensor) and moved[0].device.type == "meta"
    assert moved[0].dtype == torch.float32


def test_split_batch_is_exact_or_names_a_good_batch_size():
    assert data.split_batch(64, 2, 2) == 16
    with pytest.raises(ConfigError, match=r"batch_size 63 \(global\) does not split evenly "
                                          r"over 2 processes; .* e\.g\. batch_size=62"):
        data.split_batch(63, 2, 1)
    with pytest.raises(ConfigError, match="grad_accum_steps=4 .* a multiple of 8"):
        data.split_batch(12, 2, 4)


@pytest.mark.parametrize("weights", [None, [1.0] * 10 + [5.0] * 10])
def test_resumed_sampler_yields_the_rest_of_the_uninterrupted_order(weights):
    dataset = TensorDataset(torch.arange(20))
    full = data.ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=3,
                                            weights=weights)
    full.set_epoch(4)
    order = list(full)
    resumed = data.ResumableDistributedSampler(dataset, num_replicas=2, rank=1, seed=3,
                                               weights=weights)
    resumed.set_epoch(4, start_index=3)
    assert list(resumed) == order[3:] and len(resumed) == len(order) - 3


def test_unweighted_sampler_order_equals_torchs_distributed_sampler():
    dataset = TensorDataset(torch.arange(21))
    ours = data.ResumableDistributedSampler(dataset, num_replicas=2, rank=0, seed=1)
    torchs = DistributedSampler(dataset, num_replicas=2, rank=0, seed=1)
    ours.set_epoch(2)
    torchs.set_epoch(2)
    assert list(ours) == list(torchs)


def test_shard_sampler_counts_every_sample_once_without_padding():
    shards = [list(data.ShardSampler(11, 3, rank)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(11))
    assert [len(data.ShardSampler(11, 3, rank)) for rank in range(3)] == [4, 4, 3]


def test_seeded_samples_depend_on_seed_epoch_and_index_only_and_restore_the_rngs():
    class Noise(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(()).item(), random.random()

    samples = data.SeededSamples(Noise(), seed=7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = samples[(1, 2)]
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left alone
    assert samples[(1, 2)] == first
    assert samples[(2, 2)] != first and samples[(1, 3)] != first


def test_start_epoch_reseeds_the_loader_and_skips_what_was_consumed():
    dataset = TensorDataset(torch.arange(16).float())
    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1)
    loader = data.train_loader(dataset, micro_batch=4, world=world, seed=0, num_workers=0,
                               pin_memory=False, drop_last=False)
    data.start_epoch(loader, 1)
    whole = [b[0].tolist() for b in loader]
    data.start_epoch(loader, 1, start_index=8)
    assert [b[0].tolist() for b in loader] == whole[2:]
    assert loader.generator.initial_seed() == 0 * 1_000_003 + 1


def test_batches_per_epoch():
    assert data.batches_per_epoch(10, 4, drop_last=False) == 3
    assert data.batches_per_epoch(10, 4, drop_last=True) == 2


def global_stream(dataset, world_size: int, epoch: int, start_sample: int, weights=None):
    """What the ranks of ``world_size`` take from ``start_sample`` on, put back in the
    global order (rank r's j-th sample is entry j * world_size + r)."""
    shares = []
    for rank in range(world_size):
        sampler = data.ResumableDistributedSampler(dataset, num_replicas=world_size,
                                                   rank=rank, seed=3, weights=weights)
        sampler.set_epoch(epoch, start_sample=start_sample)
        shares.append(list(sampler))
        assert len(sampler) == len(shares[-1])
    return [share[j] for j in range(len(shares[0])) for share in shares]


@pytest.mark.parametrize("size", [36, 37])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_resume_at_another_world_size_continues_the_same_global_order(size, weighted):
    """Stopped 12 samples into the epoch with 2 processes, resumed with 1, 2 or 3: the
    ranks go on with the same global order (a permutation, or a weighted draw) from
    sample 12, padded to equal shares as an uninterrupted run is. Unweighted, every
    sample of the epoch is seen once, padding aside."""
    dataset = TensorDataset(torch.arange(size))
    weights = [1.0] * (size - 10) + [5.0] * 10 if weighted else None
    order = global_stream(dataset, 1, epoch=4, start_sample=0, weights=weights)
    assert len(order) == size
    assert global_stream(dataset, 2, 4, 0, weights)[:12] == order[:12]
    for world_size in (1, 2, 3):
        rest = global_stream(dataset, world_size, 4, start_sample=12, weights=weights)
        padding = -(size - 12) % world_size
        assert len(rest) == size - 12 + padding
        assert rest[:size - 12] == order[12:]
        if not weighted:
            assert sorted(order[:12] + rest[:size - 12]) == list(range(size))


def test_a_position_converts_to_batches_of_another_world_size_or_says_why_not():
    assert data.samples_consumed(4, 3, 2, dataset_size=36) == 24
    assert data.samples_consumed(7, 3, 2, dataset_size=37) == 37  # the padded end
    assert data.batches_at(24, micro_batch=2, world_size=3, dataset_size=36) == 4
    assert data.batches_at(37, micro_batch=2, world_size=3, dataset_size=37) == 7  # past it
    with pytest.raises(CheckpointError, match="stopped 24 samples into the epoch, which is "
                                              "not a whole number of global batches of 10"):
        data.batches_at(24, micro_batch=5, world_size=2, dataset_size=36)


def test_a_training_loader_counts_the_batches_it_hands_out():
    from engine.stateful import TrainState

    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1)
    loader = data.train_loader(TensorDataset(torch.arange(10)), micro_batch=4, world=world,
                               seed=0, num_workers=0, pin_memory=False, drop_last=False)
    loader.counts_in = state = TrainState()
    data.start_epoch(loader, 0)
    whole = [b[0].tolist() for b in loader]
    assert state.batch_in_epoch == 3
    state.batch_in_epoch = 0
    next(iter(loader))
    assert state.batch_in_epoch == 1  # handed out: the loop body may save now
    data.start_epoch(loader, 0, start_sample=4)
    assert [b[0].tolist() for b in loader] == whole[1:]
