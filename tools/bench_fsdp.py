"""Benchmark: the engine's ``fsdp`` against a hand-written FSDP2 loop and against ``ddp``,
on 2 gloo processes on the CPU; and what activation checkpointing saves.

    python tools/bench_fsdp.py                          # cifar, 50 steps, 5 rounds
    python tools/bench_fsdp.py --reps 9 --size 6400 --threads 1
    python tools/bench_fsdp.py --activations-only       # activation memory only
    python tools/bench_fsdp.py --workload char_lm       # the language model: section 1
    python tools/bench_fsdp.py --workload char_lm --set grad_clip_norm=none
    python tools/bench_fsdp.py --device cuda --size 25600 --batch 256   # one GPU, bf16
    python tools/bench_fsdp.py --snapshots --workload char_lm --set model.width=512

``--device cuda``: section 2 alone, on one GPU (1 process, NCCL), both sides with
``--precision`` (default bf16: FSDP2's MixedPrecisionPolicy, parameters gathered and
computed in bf16, gradients reduced in fp32, under bf16 autocast as the engine's
``precision=bf16`` runs), batches copied from pinned memory; each side's loop ends
with the device done (the hand-written one synchronizes; the engine takes its loop
time after reading the losses). Reported in samples/s. Sections 1 and 3 run on the
CPU only (2 processes; no processes).

Workloads are tools/bench_overhead.py's (``--workload cifar``: recipes/cifar_ddp.py's
net, SGD with momentum, synthetic CIFAR-shaped data, global batch 64; ``--size 3200``
= 50 steps, one epoch).

1. Equivalence and memory (one run each of engine ``ddp`` and ``fsdp``, a probe plugin
   recording every step's loss and, right before the last optimizer step, the bytes
   this rank holds of parameters, gradients and optimizer state; a DTensor counts its
   local shard): the losses compared with torch.testing.assert_close's defaults and
   for bit-identity (as the fp32 tensors they were: Python floats would get float64's
   tolerances); fsdp's bytes per rank / ddp's (target <= 0.55). ``--workload char_lm``
   (recipes/char_lm.py, units its Block) runs this section only.
2. Speed, interleaved (a warm-up round, then ``--reps`` rounds, the order rotating
   every round): the engine's fsdp against a hand-written FSDP2 loop on the same model,
   data and seed (``fully_shard`` on each parameter-holding child then the root, as the
   engine's default units; DistributedSampler; zero_grad / forward / loss / backward /
   step). Loop wall seconds (each side times its own loop); ratio engine / hand-written
   (target <= 1.02); final weights compared by the digest of the full state dict
   gathered on rank 0 (engine.checkpoint.model_digest).
   In the warm-up round the hand-written side also times a DCP snapshot of its
   sharded state: how long ``dcp.save`` and ``dcp.async_save`` (a gloo group of its
   own) block the loop.
3. Activation memory (one process, no processes needed): the bytes autograd keeps for
   backward after one forward of the workload's model, without and with
   ``activation_checkpointing`` of the given classes (torch's saved-tensor hooks count
   every tensor saved for backward, once per storage).
4. ``--snapshots`` (alone): the engine's fsdp with a snapshot every ``--snapshot-every``
   steps by ``dcp`` and by ``dcp-async``, and without snapshots while training,
   interleaved as in 2: the median time one snapshot blocked the loop, by the engine's
   own clock of its snapshots (engine.phases, the ``-v`` table's "snapshots while
   training" row over the snapshots taken), and the loop's seconds. The staging copy
   and, for dcp-async, the wait for the previous snapshot's commit are what blocks.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import engine
from engine import phases

TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import bench_overhead as overhead  # noqa: E402  (the workloads and the engine side)

HAND = "hand-written FSDP2"
#: bench_overhead's workloads and recipes/char_lm.py (``--workload char_lm``: section 1
#: alone, the engine's fsdp against its ddp; a hand-written loop of its own steps,
#: scheduler and clipping would be another engine). Its size is training windows of
#: the library text (400 kB of it), 64 validation windows, no generated sample.
WORKLOADS = {**overhead.WORKLOADS, "char_lm": (
    overhead.REPO / "recipes" / "char_lm.py",
    lambda size: [f"data.train_windows={size}", "data.max_chars=400000",
                  "data.val_windows=64", "sample_chars=0"], None, 1600, 32)}


# ------------------------------------------------------------------ the probe plugin


def state_bytes(module, optimizer) -> dict:
    """Bytes this rank holds of parameters, gradients and optimizer state (a DTensor:
    its local shard only)."""
    import torch
    from torch.distributed.tensor import DTensor

    def size(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(module.parameters())
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor))}


# This module is also the probe plugin (-p bench_fsdp): its module-level engine_*
# functions are hook implementations, so no other function here may start with engine_.
_probe: dict = {"losses": []}


@engine.hookimpl
def engine_run_start(ctx):
    _probe.clear()  # one probe per run (a session's process runs several)
    _probe["losses"] = []


@engine.hookimpl
def engine_before_optimizer_step(ctx, step, optimizer):
    _probe["bytes"] = state_bytes(ctx.module, optimizer)  # the last step's stays


@engine.hookimpl
def engine_train_step_end(ctx, step, loss):
    _probe["losses"].append(loss.item())  # a host sync per step: the probe run only


@engine.hookimpl
def engine_run_end(ctx, summary):
    # Rank 0's (the larger shard when they differ), in the run's folder: rank 0's.
    if ctx.world.rank == 0:
        (pathlib.Path(ctx.cfg.out_dir) / "probe.json").write_text(json.dumps(_probe))


# ------------------------------------------------------------------- the two sides


def dcp_save_seconds(model, optimizer, directory: str) -> dict:
    """How long a DCP save of the sharded state (each rank its shards) blocks the loop:
    ``dcp.save``, and ``dcp.async_save``, which blocks only while it stages (copies)
    the state and returns a future for the write. On the CPU it is given a gloo group
    of its own (torch's advice for async checkpointing: the write's collectives then
    never interleave with training's on the default group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=f"{directory}/save")
    saved = time.perf_counter() - start
    group = dist.new_group(backend="gloo")
    timings = []
    for attempt in range(2):  # the first pays for setting the writer up: the second counts
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=f"{directory}/async{attempt}",
                                process_group=group)
        blocking = time.perf_counter() - start
        future.result()
        timings.append((blocking, time.perf_counter() - start))
    return {"save_s": saved, "first_async_blocking_s": timings[0][0],
            "async_blocking_s": timings[1][0], "async_total_s": timings[1][1]}


def hand_written_fsdp(rank: int, world_size: int, port: int, args,
                      measure_saves: bool = False) -> tuple[float, str, dict]:
    """FSDP2 as its tutorial writes it. Returns (loop seconds, digest of the full
    weights, the DCP save timings when asked, after the timed loop)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from engine.checkpoint import model_digest
    from engine.recipe import load_recipe

    recipe_path, _, make_train_set, _, _ = WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    train_set = make_train_set(recipe.module, args.size)
    cfg = recipe.make_config()
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)
    torch.manual_seed(args.seed)
    model = recipe.module.build_model(cfg).to(device)
    bf16 = args.precision == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 else None)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = recipe.module.build_optimizer(cfg, model)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch // world_size, sampler=sampler,
                        pin_memory=cuda)
    sampler.set_epoch(0)
    clock = overhead.LoopCPUClock(loader)  # the engine's loop is timed by the same
    # The engine's precision=bf16 also autocasts (the loss then in fp32): so does this
    # side, so that both compute the same.
    with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext():
        overhead.train_steps(model, optimizer, on_device(clock, device) if cuda else clock)
    elapsed = clock.wall_seconds
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    holder = [model_digest(full) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    saves = dcp_save_seconds(model, optimizer, args.dcp_dir) if measure_saves else {}
    dist.destroy_process_group()
    return elapsed, holder[0], saves


def on_device(loader, device):
    """The loader's batches copied to ``device`` (from pinned memory, asynchronously)."""
    for inputs, labels in loader:
        yield (inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True))


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    log = open(f"{log_path}.rank{rank}", "a")  # the engine's progress, out of the table
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for (round_index, variant), port in zip(schedule, ports):
        with tempfile.TemporaryDirectory() as out_dir:
            record = {"round": round_index, "variant": variant}
            if args.device == "cuda":
                import torch  # the parent leaves CUDA uninitialized: it may fork
                record["gpu"] = torch.cuda.get_device_name(rank)
            if variant == HAND:
                record["seconds"], record["digest"], record["saves"] = hand_written_fsdp(
                    rank, world_size, port, args,
                    measure_saves=round_index == 0 and args.device == "cpu")
            else:
                mode, probed = variant.split("+")[0], variant.endswith("+probe")
                checkpointer = variant.split("@")[1] if "@" in variant else None
                run_args = argparse.Namespace(**{**vars(args), "plugin": (
                    args.plugin + ["bench_fsdp"] if probed else args.plugin),
                    "set": [f"precision={args.precision}", *snapshot_overrides(
                        checkpointer, args), *args.set]})
                snapshots_before = phases.carved(phases.SNAPSHOTS)
                seconds, _, record["digest"], _, _ = overhead.through_engine(
                    mode.split("@")[0], rank, world_size, port, out_dir, run_args, WORKLOADS)
                record["seconds"] = seconds
                if checkpointer is not None:  # the engine's own clock of its snapshots
                    wall, _, saves = (after - before for after, before in zip(
                        phases.carved(phases.SNAPSHOTS), snapshots_before))
                    record.update(snapshot_blocking_s=wall / max(saves, 1), snapshots=saves)
                if probed and rank == 0:
                    record.update(json.loads((pathlib.Path(out_dir) / "probe.json"
                                              ).read_text()))
        if rank == 0:
            with open(results_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def snapshot_overrides(checkpointer: str | None, args) -> list[str]:
    """Section 4's runs: a snapshot every ``--snapshot-every`` steps with
    ``checkpointer``; the other runs take none while training (only the final one,
    after the timed loop)."""
    if checkpointer is None:
        return []
    return [f"checkpointer={checkpointer}", f"checkpoint.every_steps={args.snapshot_every}"]


def run_session(schedule: list, args, log_path: str, nprocs: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    from engine.launcher import free_port, start_method

    ports = [free_port() for _ in schedule]
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        results_path = f.name
    try:
        mp.start_processes(session_worker, nprocs=nprocs, start_method=start_method(),
                           args=(nprocs, schedule, ports, args, results_path, log_path))
        lines = pathlib.Path(results_path).read_text().splitlines()
    finally:
        os.unlink(results_path)
    return [json.loads(line) for line in lines]


#: Section 4's variants: the engine's fsdp with a snapshot every few steps by each DCP
#: checkpointer, and without any while training.
SNAPSHOT_VARIANTS = ["fsdp", "fsdp@dcp", "fsdp@dcp-async"]


def interleaved(reps: int, variants: list | None = None) -> list:
    variants, schedule = variants or [HAND, "fsdp"], []
    for round_index in range(reps + 1):  # round 0: warm-up, not counted
        shift = round_index % len(variants)
        schedule += [(round_index, v) for v in variants[shift:] + variants[:shift]]
    return schedule


# ---------------------------------------------------------------- activation memory


def saved_for_backward_bytes(model, inputs) -> int:
    """Bytes autograd keeps for backward after ``model(inputs)`` (each storage once)."""
    import torch

    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs).sum().backward()
    return sum(storages.values())


def activation_memory(args) -> dict:
    import torch

    from engine import activation_checkpointing
    from engine.recipe import load_recipe

    recipe_path, _, make_train_set, _, _ = WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    inputs = make_train_set(recipe.module, args.batch)[: args.batch][0]
    result = {}
    for spec in ("", args.checkpoint):
        torch.manual_seed(args.seed)
        model = activation_checkpointing.apply(
            recipe.module.build_model(recipe.make_config()), spec)
        result[spec or "none"] = saved_for_backward_bytes(model, inputs)
    return result


# ------------------------------------------------------------------------ report


def report(probe_runs: list[dict], timed: list[dict], memory: dict, args,
           snapshot_runs: list[dict] = ()) -> dict:
    import torch

    result: dict = {"activation_bytes": memory}
    if probe_runs:
        ddp, fsdp = (next(r for r in probe_runs if r["variant"] == f"{m}+probe")
                     for m in ("ddp", "fsdp"))
        try:  # as the fp32 tensors they were (Python floats get float64's tolerances)
            torch.testing.assert_close(torch.tensor(fsdp["losses"], dtype=torch.float32),
                                       torch.tensor(ddp["losses"], dtype=torch.float32))
            close = True
        except AssertionError:
            close = False
        total = {m: sum(r["bytes"].values()) for m, r in (("ddp", ddp), ("fsdp", fsdp))}
        differing = [i for i, (a, b) in enumerate(zip(fsdp["losses"], ddp["losses"]), 1)
                     if a != b]
        result.update(steps=len(fsdp["losses"]), losses_close=close,
                      losses_bit_identical=not differing,
                      first_differing_step=differing[0] if differing else None,
                      differing_steps=len(differing),
                      max_loss_difference=max(abs(a - b) for a, b in
                                              zip(fsdp["losses"], ddp["losses"])),
                      bytes_per_rank={"ddp": ddp["bytes"], "fsdp": fsdp["bytes"]},
                      bytes_ratio=total["fsdp"] / total["ddp"])
    if timed:
        counted = [r for r in timed if r["round"] > 0]
        hand = {r["round"]: r["seconds"] for r in counted if r["variant"] == HAND}
        eng = {r["round"]: r["seconds"] for r in counted if r["variant"] == "fsdp"}
        result.update(
            hand_s=statistics.median(hand.values()), engine_s=statistics.median(eng.values()),
            paired_ratio=statistics.median(eng[k] / hand[k] for k in hand),
            weights_identical=len({r["digest"] for r in timed}) == 1)
        result["ratio"] = result["engine_s"] / result["hand_s"]
        result["samples_per_s"] = {"hand": args.size / result["hand_s"],
                                   "engine": args.size / result["engine_s"]}
        result["dcp_saves"] = next(r["saves"] for r in timed if r["variant"] == HAND)
        result["gpu"] = timed[0].get("gpu")
    if snapshot_runs:
        result["engine_snapshots"] = snapshot_report(snapshot_runs, args)
    return result


def snapshot_report(runs: list[dict], args) -> dict:
    """Section 4: per checkpointer, the median time one snapshot blocked the engine's
    loop (its own clock: engine.phases) and the loop's seconds, against no snapshots."""
    counted = [r for r in runs if r["round"] > 0]

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in counted if r["variant"] == variant)

    savers = [v for v in SNAPSHOT_VARIANTS if "@" in v]
    return {"every_steps": args.snapshot_every,
            "loop_s": {v: median(v, "seconds") for v in SNAPSHOT_VARIANTS},
            "blocking_s": {v.split("@")[1]: median(v, "snapshot_blocking_s") for v in savers},
            "snapshots": {v.split("@")[1]: next(r["snapshots"] for r in counted
                                                if r["variant"] == v) for v in savers}}


def print_report(result: dict, args) -> None:
    if args.device == "cuda":
        print(f"{args.workload}: {args.size} samples, batch {args.batch}, 1 process on "
              f"{result['gpu']} (NCCL), precision {args.precision}")
    else:
        print(f"{args.workload}: {args.size} samples, global batch {args.batch}, 2 gloo "
              f"processes, {args.threads} thread(s) each")
    if "bytes_ratio" in result:
        same = "bit-identical" if result["losses_bit_identical"] else (
            f"not bit-identical: {result['differing_steps']} steps differ from step "
            f"{result['first_differing_step']} on, by at most "
            f"{result['max_loss_difference']:.2e}")
        print(f"losses fsdp vs ddp over {result['steps']} steps: "
              f"{'assert_close passes' if result['losses_close'] else 'DIFFER'}, {same}")
        for mode, parts in result["bytes_per_rank"].items():
            print(f"  {mode:<5} bytes per rank: " + ", ".join(
                f"{k} {v}" for k, v in parts.items()) + f" = {sum(parts.values())}")
        print(f"fsdp / ddp bytes per rank: {result['bytes_ratio']:.3f} (target <= 0.55)")
    if "ratio" in result:
        print(f"loop seconds (medians of {args.reps} interleaved rounds): hand-written "
              f"FSDP2 {result['hand_s']:.3f}, engine fsdp {result['engine_s']:.3f}; ratio "
              f"{result['ratio']:.3f}, paired {result['paired_ratio']:.3f} (target <= "
              f"1.02); final weights {'identical' if result['weights_identical'] else 'DIFFERENT'}")
        rate = result["samples_per_s"]
        print(f"samples/s: hand-written FSDP2 {rate['hand']:.0f}, engine fsdp "
              f"{rate['engine']:.0f}")
    if result.get("dcp_saves"):
        saves = result["dcp_saves"]
        print(f"dcp snapshot of the sharded state (rank 0): save blocks "
              f"{saves['save_s'] * 1000:.1f} ms; async_save blocks "
              f"{saves['async_blocking_s'] * 1000:.1f} ms (written after "
              f"{saves['async_total_s'] * 1000:.1f} ms; the first one blocked "
              f"{saves['first_async_blocking_s'] * 1000:.1f} ms)")
    if "engine_snapshots" in result:
        snaps = result["engine_snapshots"]
        loop = snaps["loop_s"]
        print(f"engine fsdp, a snapshot every {snaps['every_steps']} steps (medians of "
              f"{args.reps} interleaved rounds; the engine's own clock of its snapshots):")
        for checkpointer, blocking in snaps["blocking_s"].items():
            print(f"  {checkpointer:<9} blocks {blocking * 1000:.1f} ms per snapshot "
                  f"({snaps['snapshots'][checkpointer]} snapshots); loop "
                  f"{loop['fsdp@' + checkpointer]:.3f} s against {loop['fsdp']:.3f} s "
                  "without snapshots")
    memory = result["activation_bytes"]
    if memory:
        none, ac = memory["none"], memory[args.checkpoint]
        print(f"activation memory of one forward (batch {args.batch}): {none} bytes "
              f"saved for backward; with activation_checkpointing={args.checkpoint}: {ac} "
              f"({ac / none:.2f}x, {none - ac} bytes saved)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="cifar")
    p.add_argument("--size", type=int,
                   help="training samples, one epoch (default: 3200; char_lm 1600)")
    p.add_argument("--batch", type=int, help="global batch (default: 64; char_lm 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--checkpoint", default="Conv2d,Linear",
                   help="activation_checkpointing classes for the activation measurement")
    p.add_argument("--activations-only", action="store_true",
                   help="only the activation memory (no processes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: engine against hand-written on one GPU only (see above)")
    p.add_argument("--precision", choices=("32", "bf16"),
                   help="both sides' precision (default: bf16 on cuda, 32 on the CPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the engine's runs, e.g. grad_clip_norm=none "
                        "(repeatable; the hand-written loop has no such knobs)")
    p.add_argument("--snapshots", action="store_true",
                   help="only section 4: how long the engine's dcp and dcp-async snapshots "
                        "block its fsdp loop (2 CPU processes)")
    p.add_argument("--snapshot-every", type=int, default=10, metavar="STEPS",
                   help="section 4's checkpoint.every_steps (default 10)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "32")
    *_, size, batch = WORKLOADS["char_lm"] if args.workload == "char_lm" else (3200, 64)
    args.size, args.batch = args.size or size, args.batch or batch
    if args.workload == "char_lm" and (args.device == "cuda" or args.activations_only):
        p.error("--workload char_lm compares fsdp with ddp on 2 CPU processes only: "
                "leave out --device cuda and --activations-only")
    if args.snapshots and (args.device == "cuda" or args.activations_only):
        p.error("--snapshots measures on 2 CPU processes: leave out --device cuda and "
                "--activations-only")
    if args.device == "cuda" and args.activations_only:
        p.error("--activations-only measures on the CPU: leave out --device cuda")
    args.plugin = []
    return args


def require_cuda() -> None:
    """Exits with a one-line error when no GPU is visible."""
    import torch

    if not torch.cuda.is_available():  # without initializing CUDA: the workers may fork
        sys.exit("error: --device cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); run on a GPU machine or "
                 "leave out --device")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(TOOLS), os.environ.get("PYTHONPATH")]))  # workers load -p bench_fsdp
    probe_runs, timed, snapshot_runs = [], [], []
    with tempfile.NamedTemporaryFile(prefix="bench_fsdp-", suffix=".log", delete=False) as log:
        log_path = log.name
    if args.device == "cuda":  # the speed comparison alone, one process
        require_cuda()
        timed = run_session(interleaved(args.reps), args, log_path, nprocs=1)
    elif args.snapshots:
        snapshot_runs = run_session(interleaved(args.reps, SNAPSHOT_VARIANTS), args, log_path)
    elif not args.activations_only:
        args.dcp_dir = tempfile.mkdtemp(prefix="bench_fsdp-dcp-")  # one for all ranks
        probe_runs = run_session([(0, "ddp+probe"), (0, "fsdp+probe")], args, log_path)
        if args.workload != "char_lm":  # no hand-written side of its own
            timed = run_session(interleaved(args.reps), args, log_path)
        shutil.rmtree(args.dcp_dir, ignore_errors=True)
    lm = args.workload == "char_lm"
    memory = (activation_memory(args) if args.device == "cpu" and not lm
              and not args.snapshots else {})
    result = report(probe_runs, timed, memory, args, snapshot_runs)
    print_report(result, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    if args.device == "cuda":  # cuDNN's backward kernels need not repeat bit for bit
        return 0
    if args.snapshots:  # one weights digest: every checkpointer trained the same
        return 0 if len({r["digest"] for r in snapshot_runs}) == 1 else 1
    ok = args.activations_only or (result["losses_close"] and result.get(
        "weights_identical", True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
