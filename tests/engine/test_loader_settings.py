"""engine/loader_settings.py: what ``num_workers=auto`` becomes, and why."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from engine import data, loader_settings
from engine.launcher import LaunchOptions
from engine.loader_settings import choose
from engine.plugins.slurm import SlurmLauncher
from engine.world import World, share_cpus


def shared(cpus, local):
    """What the default rule answers on a machine with ``cpus`` CPUs (affinity)."""
    return share_cpus(cpus, "affinity", local)


def auto(cpus, local, device="cpu", timeout_s=300.0):
    return choose("auto", cpus=shared(cpus, local), device_type=device, timeout_s=timeout_s)


def test_this_machine_one_cpu_per_process_still_gets_a_worker():
    """2 CPUs, 2 processes: the worker shares its process's CPU, so that loading
    overlaps the step instead of stopping it (docs/data.md has the measurement)."""
    settings = auto(cpus=2, local=2)
    assert (settings.num_workers, settings.persistent_workers, settings.prefetch_factor,
            settings.timeout_s, settings.pin_memory) == (1, True, 4, 300.0, False)
    assert settings.reason == ("auto: 2 CPUs (affinity) shared by 2 local processes = 1 "
                               "each; 1 worker shares it with training, overlapping the two")
    # More processes than CPUs: still one each.
    assert auto(cpus=4, local=8, device="cuda").num_workers == 1


def test_no_workers_means_no_worker_options():
    """torch refuses prefetch_factor and timeout without workers."""
    settings = choose(0, cpus=shared(2, 2), device_type="cpu", timeout_s=300)
    assert (settings.num_workers, settings.persistent_workers, settings.prefetch_factor,
            settings.timeout_s) == (0, False, None, 0.0)
    assert settings.describe() == (
        "0 per process, loading in the training process (as configured; auto would choose "
        "1 from 2 CPUs (affinity) shared by 2 local processes = 1 each)")


def test_cpus_are_shared_by_the_local_processes_and_one_stays_with_training():
    settings = auto(cpus=16, local=4, device="cuda", timeout_s=120)
    assert settings.num_workers == 3  # 16 / 4 = 4 each, minus the training process
    assert settings.persistent_workers and settings.pin_memory
    assert settings.prefetch_factor == 2  # 3 workers x 2 >= 4 batches in flight
    assert settings.timeout_s == 120.0
    assert auto(cpus=4, local=1).prefetch_factor == 2
    assert auto(cpus=2, local=1).prefetch_factor == 4  # one worker: a deeper queue


def test_auto_is_capped():
    settings = auto(cpus=128, local=1)
    assert settings.num_workers == loader_settings.MAX_AUTO_WORKERS
    assert settings.reason.endswith(f", capped at {loader_settings.MAX_AUTO_WORKERS}")


def test_pinned_memory_only_for_cuda_and_only_where_workers_load():
    assert not auto(cpus=8, local=1, device="cpu").pin_memory
    assert auto(cpus=8, local=1, device="cuda").pin_memory
    # The training thread would pin each batch itself, with an OpenMP pool that then
    # spins on every CPU (loader_settings.pinned).
    assert not choose(0, cpus=shared(8, 1), device_type="cuda", timeout_s=60).pin_memory


def test_the_seeds_oct_node_both_slurm_layouts_give_the_same_answer():
    """60 CPUs and 4 GPUs per node, as in the seeds' best OCT-A run: one task per node
    that starts 4 processes, or one task per GPU with 15 CPUs each. The slurm launcher's
    worlds carry the share, as they do in a real step."""
    step = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NODEID": "1",
            "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_JOB_NAME": "train", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    per_node = {**step, "SLURM_CPUS_PER_TASK": "60", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    per_gpu = {**step, "SLURM_CPUS_PER_TASK": "15", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
               "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
               "CUDA_VISIBLE_DEVICES": "1"}
    a = SlurmLauncher(LaunchOptions(), per_node).worlds()
    b = SlurmLauncher(LaunchOptions(), per_gpu).worlds()
    assert (len(a), len(b)) == (4, 1)  # the lone task starts one process per GPU
    a, b = (choose("auto", cpus=w.cpu_share(), device_type="cuda", timeout_s=300)
            for w in (a[0], b[0]))
    assert a.num_workers == b.num_workers == 14
    assert "60 CPUs (SLURM_CPUS_PER_TASK) shared by 4 local processes = 15 each" in a.reason
    assert "15 CPUs (SLURM_CPUS_PER_TASK) for this process" in b.reason


def test_an_explicit_value_is_kept_and_compared_with_auto():
    settings = choose(3, cpus=shared(8, 2), device_type="cpu", timeout_s=60)
    assert (settings.num_workers, settings.persistent_workers, settings.timeout_s) == (
        3, True, 60.0)
    assert settings.reason == ("as configured; auto would choose 3 from 8 CPUs (affinity) "
                               "shared by 2 local processes = 4 each")
    crowded = choose(8, cpus=shared(8, 2), device_type="cpu", timeout_s=60)
    assert crowded.reason.endswith("= 4 each; 8 workers compete for 4 CPUs")


def test_describe_is_what_the_plan_prints():
    assert auto(cpus=8, local=2).describe() == (
        "3 per process, persistent, prefetch 2 batches each, timeout 300s "
        "(auto: 8 CPUs (affinity) shared by 2 local processes = 4 each, 1 kept for training)")
    assert auto(cpus=2, local=1, device="cuda").describe() == (
        "1 per process, persistent, prefetch 4 batches each, timeout 300s, pinned memory "
        "(auto: 2 CPUs (affinity) for this process, 1 kept for training)")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_settings_build_a_working_loader(workers):
    """torch refuses prefetch_factor or timeout without workers: the kwargs must fit."""
    settings = choose(workers, cpus=shared(4, 1), device_type="cpu", timeout_s=60)
    dataset = TensorDataset(torch.arange(10.0), torch.arange(10))
    world = World(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                  num_nodes=1, master_addr="127.0.0.1", master_port=29500,
                  init_method="env://", launcher="spawn")
    loader = data.train_loader(dataset, micro_batch=4, world=world, seed=0, drop_last=False,
                               **settings.loader_kwargs())
    assert (loader.num_workers, loader.timeout) == (workers, settings.timeout_s)
    assert loader.persistent_workers == (workers > 0)
    for epoch in range(2):  # persistent workers serve a second epoch
        data.start_epoch(loader, epoch)
        values = sorted(v for batch, _ in loader for v in batch.tolist())
        assert values == [float(v) for v in range(10)]
