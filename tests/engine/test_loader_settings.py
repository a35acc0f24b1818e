"""engine/loader_settings.py: what ``num_workers=auto`` becomes, and why."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import TensorDataset

from engine import data, loader_settings
from engine.loader_settings import choose, cpus_per_process, slurm_tasks_on_this_node
from engine.world import World

NO_SLURM: dict[str, str] = {}


def auto(cpus, local, device="cpu", environ=NO_SLURM, timeout_s=300.0):
    return choose("auto", local_world_size=local, device_type=device, timeout_s=timeout_s,
                  environ=environ, cpus=cpus)


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
    settings = choose(0, local_world_size=2, device_type="cpu", timeout_s=300,
                      environ=NO_SLURM, cpus=2)
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


def test_pinned_memory_only_for_cuda():
    assert not auto(cpus=8, local=1, device="cpu").pin_memory
    assert auto(cpus=8, local=1, device="cuda").pin_memory


def test_the_seeds_oct_node_both_slurm_layouts_give_the_same_answer():
    """60 CPUs and 4 GPUs per node, as in the seeds' best OCT-A run: one task per node
    that starts 4 processes, or one task per GPU with 15 CPUs each."""
    per_node = {"SLURM_CPUS_PER_TASK": "60", "SLURM_STEP_ID": "0",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"}
    per_gpu = {"SLURM_CPUS_PER_TASK": "15", "SLURM_STEP_ID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}
    a = auto(cpus=60, local=4, device="cuda", environ=per_node)
    b = auto(cpus=15, local=4, device="cuda", environ=per_gpu)
    assert a.num_workers == b.num_workers == 14
    assert "60 CPUs (SLURM_CPUS_PER_TASK) shared by 4 local processes = 15 each" in a.reason
    assert "15 CPUs (SLURM_CPUS_PER_TASK) for this process" in b.reason


def test_slurm_tasks_per_node_are_read_for_this_node():
    step = {"SLURM_STEP_ID": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert [slurm_tasks_on_this_node({**step, "SLURM_NODEID": str(n)})
            for n in range(4)] == [2, 2, 2, 1]
    assert slurm_tasks_on_this_node({"SLURM_STEP_TASKS_PER_NODE": "2"}) is None  # no step
    assert slurm_tasks_on_this_node({"SLURM_STEP_ID": "0"}) is None
    assert slurm_tasks_on_this_node({**step, "SLURM_STEP_TASKS_PER_NODE": "junk"}) is None


def test_slurm_cpus_are_read_from_the_environment(monkeypatch):
    """The real lookup: SLURM_CPUS_PER_TASK wins over the affinity mask."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert cpus_per_process(2) == (3, "6 CPUs (SLURM_CPUS_PER_TASK) shared by 2 local "
                                      "processes = 3 each")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    affinity = len(os.sched_getaffinity(0))
    assert cpus_per_process(1) == (affinity, f"{affinity} CPUs (affinity) for this process")


def test_an_explicit_value_is_kept_and_compared_with_auto():
    settings = choose(3, local_world_size=2, device_type="cpu", timeout_s=60,
                      environ=NO_SLURM, cpus=8)
    assert (settings.num_workers, settings.persistent_workers, settings.timeout_s) == (
        3, True, 60.0)
    assert settings.reason == ("as configured; auto would choose 3 from 8 CPUs (affinity) "
                               "shared by 2 local processes = 4 each")
    crowded = choose(8, local_world_size=2, device_type="cpu", timeout_s=60,
                     environ=NO_SLURM, cpus=8)
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
    settings = choose(workers, local_world_size=1, device_type="cpu", timeout_s=60,
                      environ=NO_SLURM, cpus=4)
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
