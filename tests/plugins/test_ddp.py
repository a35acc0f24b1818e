"""plugins/ddp.py on 2 real CPU processes with gloo: equivalence with ``single``, one
all-reduce per optimizer step under gradient accumulation, uneven data, the cfg.ddp
options as torch sees them, and the errors users meet."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.nn import functional as F

from engine.recipe import load_recipe
from engine.testing import run_python
from tests.conftest import engine_env, run_cli
from tests.recipes.tiny_parallel_runs import TINY_RECIPE, probes, run_tiny, summary, weights

#: Largest |single - ddp| weight difference allowed after 24 SGD steps. The two runs see
#: the same samples in every step, but single sums the per-sample gradients of the
#: global batch of 8 in one reduction, while DDP sums 4 on each rank, divides by the
#: world size and adds the two halves in the all-reduce: float32 additions in another
#: order, so the last bit or two differ (measured: 1.2e-7). 1e-5 leaves a wide margin
#: yet catches any real difference (a wrong batch split or scaling is > 1e-3).
EQUIVALENCE_ATOL = 1e-5


def test_ddp_on_two_processes_matches_single_with_the_global_batch(tmp_path):
    common = ("epochs=3", "batch_size=8", "train_size=64")
    run_tiny(tmp_path / "single", "--parallel", "single", *common, nproc=1)
    run_tiny(tmp_path / "ddp", "--parallel", "ddp", *common, nproc=2)
    single, ddp = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    assert [p["steps"] for p in probes(tmp_path / "ddp")] == [24, 24]
    assert probes(tmp_path / "single")[0]["steps"] == 24
    for name in single:
        diff = (single[name] - ddp[name]).abs().max().item()
        assert diff <= EQUIVALENCE_ATOL, f"{name}: {diff}"
    # ...and the two ranks hold the very same weights.
    assert summary(tmp_path / "ddp")["weights_sha256_per_rank"] == [
        summary(tmp_path / "ddp")["weights_sha256"]] * 2


def evaluate(state: dict, val_size: int) -> tuple[float, float]:
    """Loss and accuracy of the final weights over the whole validation set."""
    recipe = load_recipe(TINY_RECIPE).module
    cfg = recipe.Config()
    cfg.model.rank_tally = True  # as trained below (the tally does not touch outputs)
    model = recipe.build_model(cfg)
    model.load_state_dict(state)
    model.eval()
    inputs, targets = recipe.make_data(val_size, seed=2).tensors
    with torch.no_grad():
        outputs = model(inputs)
    return (F.cross_entropy(outputs, targets).item(),
            (outputs.argmax(1) == targets).sum().item() / len(targets))


@pytest.mark.parametrize("drop_last, accum, steps_per_epoch", [
    # 37 samples: 19 per rank (one padded), micro-batch 8/2/2 = 2 -> 10 micro-batches
    # (the last holds 1 sample), grouped in pairs -> 5 optimizer steps.
    (False, 2, 5),
    # micro-batch 8/2 = 4: 19 per rank -> 4 full batches, the short one dropped.
    (True, 1, 4),
])
def test_uneven_data_one_allreduce_per_optimizer_step(tmp_path, drop_last, accum,
                                                      steps_per_epoch):
    out = tmp_path / "run"
    proc = run_tiny(out, "--parallel", "ddp", "epochs=2", "batch_size=8",
                    "train_size=37", "val_size=9", f"grad_accum_steps={accum}",
                    f"drop_last={str(drop_last).lower()}", "model.rank_tally=true")
    assert "error" not in proc.stderr.lower()
    steps = 2 * steps_per_epoch
    for probe in probes(out):
        assert probe["status"] == "completed"
        # The config's defaults, not torch's (gradient_as_bucket_view: on).
        assert probe["ddp"] == {"bucket_bytes_cap": 25 * 1024 * 1024,
                                "gradient_as_bucket_view": True, "static_graph": False,
                                "find_unused_parameters": False,
                                "forward_sync_buffers": True}
        assert probe["steps"] == steps
        # The comm hook sees every gradient all-reduce: one per bucket (the tiny model
        # fits one) and optimizer step, none for the no_sync micro-steps.
        assert (probe["rounds"], probe["buckets"]) == (steps, steps)
    # broadcast_buffers (default on): rank 0's buffers reach rank 1 once per optimizer
    # step, before its first micro-step; rank 1 then adds 2 per micro-step. Without
    # the broadcast it would hold 2 x forwards.
    forwards = steps * accum
    assert [p["tally_after_last_step"] for p in probes(out)] == [forwards, forwards + accum]
    # Validation: 9 samples over 2 ranks (5 + 4), each counted exactly once.
    result = summary(out)
    loss, accuracy = evaluate(weights(out), val_size=9)
    assert result["val_loss"] == pytest.approx(loss, abs=1e-6)
    assert result["val_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_ddp_options_reach_torch(tmp_path):
    out = tmp_path / "run"
    run_tiny(out, "--parallel", "ddp", "epochs=1", "batch_size=8", "train_size=32",
             "ddp.bucket_cap_mb=1", "ddp.gradient_as_bucket_view=false",
             "ddp.static_graph=true", "ddp.find_unused_parameters=true",
             "ddp.broadcast_buffers=false", "model.unused_layer=true",
             "model.rank_tally=true")
    first, second = probes(out)
    assert first["ddp"] == {"bucket_bytes_cap": 1024 * 1024,
                            "gradient_as_bucket_view": False, "static_graph": True,
                            "find_unused_parameters": True,
                            "forward_sync_buffers": False}
    # The unused layer did not break the run (find_unused_parameters), and without
    # buffer broadcasts every rank kept its own tally: 4 steps x (rank + 1).
    assert first["status"] == second["status"] == "completed"
    assert [first["tally_after_last_step"], second["tally_after_last_step"]] == [4, 8]
    assert first["steps"] == 4


def test_unused_parameters_error_names_the_option(tmp_path):
    proc = run_tiny(tmp_path / "run", "--parallel", "ddp", "epochs=1", "train_size=32",
                    "model.unused_layer=true", check=False)
    assert proc.returncode != 0
    hint = ("hint: some parameters received no gradient in the last step; if the model "
            "really leaves parameters unused, set ddp.find_unused_parameters=true")
    # Both ranks fail alike: one line, the launcher's (issue 35 point 4).
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("engine-run: error: RuntimeError: Expected to have finished "
                                "reduction in the prior iteration")
    assert errors[0].endswith(hint)


def test_sync_batchnorm_on_cpu_is_a_clear_error():
    proc = run_cli(TINY_RECIPE, "--parallel", "ddp", "--nproc", "2",
                   "ddp.sync_batchnorm=true", "--dry-run", env=engine_env())
    assert proc.returncode == 2
    version = torch.__version__.split("+")[0]
    assert proc.stderr.strip() == (
        f"engine-run: error: ddp.sync_batchnorm=true needs GPUs: SyncBatchNorm in torch "
        f"{version} synchronises CUDA tensors only; on the CPU set "
        "ddp.sync_batchnorm=false (each process then normalises with the statistics of "
        "its own share of the batch)")


def test_ddp_with_one_process_trains_unwrapped_and_says_so(tmp_path):
    out = tmp_path / "run"
    proc = run_tiny(out, "--parallel", "ddp", "epochs=1", "train_size=16", nproc=1)
    note = ("warning: parallel mode 'ddp' with one process: nothing to synchronise, "
            "training the model unwrapped (as 'single')")
    assert proc.stderr.count(note) == 1
    assert probes(out)[0]["wrappers"] == ["TinyNet"]
    assert summary(out)["parallel"] == "ddp"


def test_dry_run_plan_shows_gloo_and_one_cpu_per_rank():
    proc = run_cli(TINY_RECIPE, "--parallel", "ddp", "--nproc", "2", "--dry-run",
                   env=engine_env(), check=True)
    assert "  backend       gloo" in proc.stdout
    assert "  batch         8 global = 2 processes x 4" in proc.stdout
    world = proc.stdout.split("world:\n", 1)[1].splitlines()
    assert world[0].split()[:5] == ["rank", "local", "node", "host", "device"]
    assert [row.split()[4] for row in world[1:3]] == ["cpu", "cpu"]


# ------------------------------------------------- sync_buffers, on a real group


SYNC_BUFFERS = textwrap.dedent("""
    import os, sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from engine.config import TrainConfig, with_groups
    from engine.plugins.ddp import DDPConfig, DistributedDataParallel
    from engine.world import World


    def worker(rank, ports):
        for broadcast, port in zip((True, False), ports):
            world = World(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                          master_port=port)
            cfg = with_groups(TrainConfig(), {"ddp": DDPConfig})
            cfg.ddp.broadcast_buffers = broadcast
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=2)
            try:
                torch.manual_seed(0)
                mode = DistributedDataParallel(world, cfg)
                model = mode.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                      torch.nn.BatchNorm1d(4)))
                # Each rank normalises its own, different batch: the stats diverge.
                model(torch.randn(8, 4) + rank).sum().backward()
                mode.sync_buffers(model)
                mean = mode.unwrap(model)[1].running_mean
                gathered = [torch.empty_like(mean) for _ in range(2)]
                dist.all_gather(gathered, mean)
                # One write: the two ranks' lines must not interleave.
                os.write(1, f"RESULT {rank} {broadcast} {torch.equal(*gathered)}\\n".encode())
            finally:
                dist.destroy_process_group()


    # Forked from this process, which has run no torch op yet (no thread pools).
    mp.start_processes(worker, args=([int(p) for p in sys.argv[1:3]],), nprocs=2,
                       start_method="fork")
""")


def test_sync_buffers_makes_batchnorm_statistics_equal():
    """Two gloo processes forked from one warm interpreter (engine.testing.run_python),
    not spawned: the same real group, without two torch imports."""
    from engine.launcher import free_port

    proc = run_python(["-c", SYNC_BUFFERS, str(free_port()), str(free_port())],
                      env=engine_env(), timeout=240, check=True)
    equal = {line for line in proc.stdout.splitlines() if line.startswith("RESULT ")}
    # broadcast_buffers=true: rank 0's statistics everywhere. false: the user asked for
    # per-rank buffers, so they are left alone.
    assert equal == {"RESULT 0 True True", "RESULT 1 True True", "RESULT 0 False False",
                     "RESULT 1 False False"}, proc.stdout + proc.stderr


def test_unused_parameter_hints_cover_torchs_variants():
    from engine.plugins.ddp import DistributedDataParallel

    mode = DistributedDataParallel(world=None, cfg=None)
    base = "Expected to have finished reduction in the prior iteration before starting"
    assert "ddp.find_unused_parameters=true" in mode.explain(RuntimeError(base))
    assert "ddp.static_graph=false" in mode.explain(RuntimeError(
        base + " ... this is not compatible with static_graph set to True."))
    assert "every output" in mode.explain(RuntimeError(
        base + " Since `find_unused_parameters=True` is enabled, this likely means"))
    assert "CUDA_VISIBLE_DEVICES" in mode.explain(RuntimeError(
        "NCCL error: invalid usage, Duplicate GPU detected : rank 1 and rank 0 both on "
        "CUDA device 1000"))
    assert mode.explain(ValueError("something else")) is None


def test_reduce_per_tensor_makes_a_resume_at_three_processes_bit_identical(tmp_path):
    """At 3 processes DDP's all-reduce sums each value in an order set by its place in the
    bucket, and DDP lays the buckets out anew after a first step, so a killed run resumed
    from its snapshot ended on other weights than the uninterrupted run (by rounding).
    ddp.reduce_per_tensor=true: bit-identical; without it the resume says so."""
    from tests.engine.conftest import RESUME_BASE, RESUME_RECIPE
    from tests.conftest import read_summary

    args = (RESUME_RECIPE, *RESUME_BASE, "epochs=2", "batch_size=12", "size=72",
            "ddp.reduce_per_tensor=true", "--nproc", "3", "--threads", "1")
    run_cli(*args, f"out_dir={tmp_path / 'whole'}", check=True)
    out = tmp_path / "killed"
    fault = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_RANK="1",
                       ENGINE_FAULT_EPOCH="1", ENGINE_FAULT_ONCE=str(tmp_path / "once"))
    killed = (*args, f"out_dir={out}", "checkpoint.memory_every_steps=0", "-p",
              "tests.fault_plugin")
    assert run_cli(*killed, env=fault).returncode != 0
    resumed = run_cli(*killed, env=fault, check=True)
    assert "resuming from " in resumed.stdout and "not bit for bit" not in resumed.stdout
    assert read_summary(out)["weights_sha256"] == read_summary(
        tmp_path / "whole")["weights_sha256"]


def test_a_resume_at_three_processes_without_reduce_per_tensor_says_so():
    from types import SimpleNamespace

    from engine.plugins.ddp import DDPConfig, DistributedDataParallel, resumed_in_another_order

    def ctx(world_size, resumed="snapshot.pt", per_tensor=False, parallel=None):
        return SimpleNamespace(
            resumed_from=resumed, world=SimpleNamespace(world_size=world_size),
            parallel=parallel or object.__new__(DistributedDataParallel),
            cfg=SimpleNamespace(ddp=DDPConfig(reduce_per_tensor=per_tensor)))

    line = resumed_in_another_order(ctx(3))
    assert line.startswith("resumed at 3 processes: DDP's first step after a resume sums")
    assert "ddp.reduce_per_tensor=true makes resumes bit-identical" in line
    # Two processes sum two values: the same either way. A fresh start, the option on, or
    # another parallel mode: nothing to say.
    for quiet in (ctx(2), ctx(3, resumed=None), ctx(3, per_tensor=True),
                  ctx(4, parallel=object())):
        assert resumed_in_another_order(quiet) is None
