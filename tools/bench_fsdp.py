"""Benchmark: the engine's ``fsdp`` against a hand-written FSDP2 loop and against ``ddp``,
on 2 gloo processes on the CPU; and what activation checkpointing saves.

    python tools/bench_fsdp.py                          # cifar, 50 steps, 5 rounds
    python tools/bench_fsdp.py --reps 9 --size 6400 --threads 1
    python tools/bench_fsdp.py --activations-only       # activation memory only

Workloads are tools/bench_overhead.py's (``--workload cifar``: recipes/cifar_ddp.py's
net, SGD with momentum, synthetic CIFAR-shaped data, global batch 64; ``--size 3200``
= 50 steps, one epoch).

1. Equivalence and memory (one run each of engine ``ddp`` and ``fsdp``, a probe plugin
   recording every step's loss and, right before the last optimizer step, the bytes
   this rank holds of parameters, gradients and optimizer state; a DTensor counts its
   local shard): the losses compared with torch.testing.assert_close's defaults and
   for bit-identity; fsdp's bytes per rank / ddp's (target <= 0.55).
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
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import engine

TOOLS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import bench_overhead as overhead  # noqa: E402  (the workloads and the engine side)

HAND = "hand-written FSDP2"


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


_probe: dict = {"losses": []}


@engine.hookimpl
def engine_run_start(engine):
    _probe.clear()  # one probe per run (a session's process runs several)
    _probe["losses"] = []


@engine.hookimpl
def engine_before_optimizer_step(engine, step, optimizer):
    _probe["bytes"] = state_bytes(engine.module, optimizer)  # the last step's stays


@engine.hookimpl
def engine_train_step_end(engine, step, loss):
    _probe["losses"].append(loss.item())  # a host sync per step: the probe run only


@engine.hookimpl
def engine_run_end(engine, summary):
    # Rank 0's (the larger shard when they differ), in the run's folder: rank 0's.
    if engine.world.rank == 0:
        (pathlib.Path(engine.cfg.out_dir) / "probe.json").write_text(json.dumps(_probe))


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
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from engine.checkpoint import model_digest
    from engine.recipe import load_recipe

    recipe_path, _, make_train_set, _, _ = overhead.WORKLOADS[args.workload]
    recipe = load_recipe(recipe_path)
    train_set = make_train_set(recipe.module, args.size)
    cfg = recipe.make_config()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    torch.manual_seed(args.seed)
    model = recipe.module.build_model(cfg)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    optimizer = recipe.module.build_optimizer(cfg, model)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch // world_size, sampler=sampler)
    sampler.set_epoch(0)
    start = time.perf_counter()
    overhead.train_steps(model, optimizer, loader)
    elapsed = time.perf_counter() - start
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    holder = [model_digest(full) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    saves = dcp_save_seconds(model, optimizer, args.dcp_dir) if measure_saves else {}
    dist.destroy_process_group()
    return elapsed, holder[0], saves


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str, log_path: str) -> None:
    log = open(f"{log_path}.rank{rank}", "a")  # the engine's progress, out of the table
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    for (round_index, variant), port in zip(schedule, ports):
        with tempfile.TemporaryDirectory() as out_dir:
            record = {"round": round_index, "variant": variant}
            if variant == HAND:
                record["seconds"], record["digest"], record["saves"] = hand_written_fsdp(
                    rank, world_size, port, args, measure_saves=round_index == 0)
            else:
                mode, probed = variant.split("+")[0], variant.endswith("+probe")
                run_args = argparse.Namespace(**{**vars(args), "plugin": (
                    args.plugin + ["bench_fsdp"] if probed else args.plugin)})
                seconds, _, record["digest"], _, _ = overhead.through_engine(
                    mode, rank, world_size, port, out_dir, run_args)
                record["seconds"] = seconds
                if probed and rank == 0:
                    record.update(json.loads((pathlib.Path(out_dir) / "probe.json"
                                              ).read_text()))
        if rank == 0:
            with open(results_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def run_session(schedule: list, args, log_path: str) -> list[dict]:
    import torch.multiprocessing as mp

    from engine.launcher import free_port, start_method

    ports = [free_port() for _ in schedule]
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        results_path = f.name
    try:
        mp.start_processes(session_worker, nprocs=2, start_method=start_method(),
                           args=(2, schedule, ports, args, results_path, log_path))
        lines = pathlib.Path(results_path).read_text().splitlines()
    finally:
        os.unlink(results_path)
    return [json.loads(line) for line in lines]


def interleaved(reps: int) -> list:
    variants, schedule = [HAND, "fsdp"], []
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

    recipe_path, _, make_train_set, _, _ = overhead.WORKLOADS[args.workload]
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


def report(probe_runs: list[dict], timed: list[dict], memory: dict, args) -> dict:
    import torch

    result: dict = {"activation_bytes": memory}
    if probe_runs:
        ddp, fsdp = (next(r for r in probe_runs if r["variant"] == f"{m}+probe")
                     for m in ("ddp", "fsdp"))
        try:
            torch.testing.assert_close(fsdp["losses"], ddp["losses"])
            close = True
        except AssertionError:
            close = False
        total = {m: sum(r["bytes"].values()) for m, r in (("ddp", ddp), ("fsdp", fsdp))}
        result.update(steps=len(fsdp["losses"]), losses_close=close,
                      losses_bit_identical=fsdp["losses"] == ddp["losses"],
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
        result["dcp_saves"] = next(r["saves"] for r in timed if r["variant"] == HAND)
    return result


def print_report(result: dict, args) -> None:
    print(f"{args.workload}: {args.size} samples, global batch {args.batch}, 2 gloo "
          f"processes, {args.threads} thread(s) each")
    if "bytes_ratio" in result:
        same = "bit-identical" if result["losses_bit_identical"] else (
            f"not bit-identical (max |difference| {result['max_loss_difference']:.2e})")
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
    if result.get("dcp_saves"):
        saves = result["dcp_saves"]
        print(f"dcp snapshot of the sharded state (rank 0): save blocks "
              f"{saves['save_s'] * 1000:.1f} ms; async_save blocks "
              f"{saves['async_blocking_s'] * 1000:.1f} ms (written after "
              f"{saves['async_total_s'] * 1000:.1f} ms; the first one blocked "
              f"{saves['first_async_blocking_s'] * 1000:.1f} ms)")
    memory = result["activation_bytes"]
    if len(memory) > 1:
        none, ac = memory["none"], memory[args.checkpoint]
        print(f"activation memory of one forward (batch {args.batch}): {none} bytes "
              f"saved for backward; with activation_checkpointing={args.checkpoint}: {ac} "
              f"({ac / none:.2f}x, {none - ac} bytes saved)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="counted rounds (plus 1 warm-up)")
    p.add_argument("--workload", choices=sorted(overhead.WORKLOADS), default="cifar")
    p.add_argument("--size", type=int, default=3200, help="training samples, one epoch")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--checkpoint", default="Conv2d,Linear",
                   help="activation_checkpointing classes for the activation measurement")
    p.add_argument("--activations-only", action="store_true",
                   help="only the activation memory (no processes)")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.plugin, args.set = [], []
    return args


def main(argv=None) -> int:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark, also on a GPU machine
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        str(TOOLS), os.environ.get("PYTHONPATH")]))  # workers load -p bench_fsdp
    args = parse_args(argv)
    probe_runs, timed = [], []
    with tempfile.NamedTemporaryFile(prefix="bench_fsdp-", suffix=".log", delete=False) as log:
        log_path = log.name
    if not args.activations_only:
        args.dcp_dir = tempfile.mkdtemp(prefix="bench_fsdp-dcp-")  # one for all ranks
        probe_runs = run_session([(0, "ddp+probe"), (0, "fsdp+probe")], args, log_path)
        timed = run_session(interleaved(args.reps), args, log_path)
        shutil.rmtree(args.dcp_dir, ignore_errors=True)
    result = report(probe_runs, timed, activation_memory(args), args)
    print_report(result, args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    ok = args.activations_only or (result["losses_close"] and result["weights_identical"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
