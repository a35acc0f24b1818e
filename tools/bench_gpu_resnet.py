"""Benchmark on GPUs: images/s of the engine against a hand-written loop, torchvision
ResNet-18 on CIFAR-10-shaped data at global batch 512, and what channels_last and
bf16 autocast gain.

    python tools/bench_gpu_resnet.py                     # one process per visible GPU
    python tools/bench_gpu_resnet.py --nproc 1 --steps 200 --reps 5
    python tools/bench_gpu_resnet.py --cpu-smoke         # tiny run on the CPU: checks
                                                         # the plumbing, measures nothing

Variants: ``fp32`` (NCHW), ``channels_last``, ``bf16`` (autocast), ``channels_last+bf16``.
For each, both sides train the same model (seed 0, same random CIFAR-shaped tensors,
same DistributedSampler order) for two epochs of ``--steps`` steps; only the second
epoch is timed (the first one warms up cuDNN, the allocator and the DataLoader
workers), between two ``torch.cuda.synchronize()`` calls. The hand-written side is the
PyTorch DDP tutorial's loop with NCCL (plain for one process), pinned memory and
non_blocking copies; the engine side runs this file as a recipe through the
``Engine`` class (``parallel=ddp``, or ``single`` for one process) and is timed by a
small plugin at ``engine_epoch_start`` / ``engine_epoch_end`` (there is no validation
set, so nothing else happens in between but the epoch's one metric reduction).
Sessions interleave the variants and sides, rotating their order every round.

Printed: images/s of each side, engine / hand-written (target >= 0.99), and each
variant's gain over fp32 through the engine.

``--modes single,dp,ddp`` adds the seeds' question, at the same global batch and fp32:
is DDP (one process per GPU, default settings) ever slower than DataParallel or than
one GPU? Each mode runs through the engine (``--parallel MODE``) and by hand (a plain
loop, ``nn.DataParallel`` over every visible GPU, DDP with one NCCL process per GPU).
With one GPU every engine mode trains the unwrapped model, while the hand-written
DataParallel and DDP still pay for their wrappers.

channels_last needs no engine option: this recipe's ``build_model`` converts the
model (``cfg.channels_last``), the engine's ``.to(device)`` keeps the memory format,
and cuDNN then runs the convolutions channels-last (the first one converts the NCHW
input). bf16 is the engine's ``precision=bf16``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import attrs

from engine import TrainConfig, hookimpl
from engine.classification import eval_step, train_step  # (inputs, targets) batches

REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {  # name: (channels_last, precision)
    "fp32": (False, "32"),
    "channels_last": (True, "32"),
    "bf16": (False, "bf16"),
    "channels_last+bf16": (True, "bf16"),
}
HAND = "hand-written"
ENGINE = "engine"
MODES = ("single", "dp", "ddp")  # --modes: parallel modes at fp32, same global batch


# ----------------------------------------------------------- this file as a recipe


@attrs.define
class Config(TrainConfig):
    epochs: int = 2
    batch_size: int = 512
    lr: float = 0.1
    momentum: float = 0.9
    steps: int = 50  # optimizer steps per epoch
    image_size: int = 32
    channels_last: bool = False
    out_dir: str = "runs/bench_gpu_resnet"


def build_model(cfg: Config):
    import torch
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=10)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def build_optimizer(cfg: Config, model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def make_train_set(samples: int, image_size: int):
    """CIFAR-10-shaped random tensors (normalised images, 10 classes)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    images = torch.randn(samples, 3, image_size, image_size, generator=g)
    return torch.utils.data.TensorDataset(images, torch.randint(0, 10, (samples,),
                                                                generator=g))


def build_datasets(cfg: Config, ctx):
    return make_train_set(cfg.steps * cfg.batch_size, cfg.image_size), None


# ------------------------------------------------------------------- the two sides


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hand_written(rank: int, world_size: int, port: int, variant: str, mode: str,
                 args) -> float:
    """The DDP tutorial's loop (``mode`` ddp; single: no wrapper; dp: nn.DataParallel
    over every visible GPU); returns the second epoch's images/s."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    channels_last, precision = VARIANTS[variant]
    cfg = Config(batch_size=args.batch, steps=args.steps, image_size=args.image_size,
                 channels_last=channels_last)
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if mode == "ddp":  # also with one process: what a hand-written DDP script runs
        dist.init_process_group("gloo" if args.cpu_smoke else "nccl",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    train_set = make_train_set(cfg.steps * cfg.batch_size, cfg.image_size)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    if mode == "ddp":
        model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)
    elif mode == "dp" and device.type == "cuda":
        model = torch.nn.DataParallel(model)
    optimizer = build_optimizer(cfg, model)
    criterion = torch.nn.CrossEntropyLoss()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
    pin = device.type == "cuda"
    loader = DataLoader(train_set, batch_size=cfg.batch_size // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=pin,
                        persistent_workers=args.workers > 0)
    seconds = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        synchronize(device)
        start = time.perf_counter()
        for inputs, labels in loader:
            inputs = inputs.to(device, non_blocking=pin)
            labels = labels.to(device, non_blocking=pin)
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=precision == "bf16"):
                loss = criterion(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        synchronize(device)
        seconds = time.perf_counter() - start  # the last epoch's
    if mode == "ddp":
        dist.destroy_process_group()
    return cfg.steps * cfg.batch_size / seconds


class EpochTimer:
    """Times the engine's epochs between synchronisations, like the hand-written side."""

    def __init__(self):
        self.seconds: list[float] = []
        self.start = 0.0

    @staticmethod
    def _sync(ctx):
        synchronize(ctx.device)

    @hookimpl
    def engine_epoch_start(self, ctx, epoch):
        self._sync(ctx)
        self.start = time.perf_counter()

    @hookimpl
    def engine_epoch_end(self, ctx, epoch, metrics):
        self._sync(ctx)
        self.seconds.append(time.perf_counter() - self.start)


def through_engine(rank: int, world_size: int, port: int, variant: str, mode: str,
                   out_dir: str, args) -> float:
    from engine.overrides import apply_overrides
    from engine.engine import Engine
    from engine.plugin_manager import build_plugin_manager
    from engine.recipe import load_recipe
    from engine.world import World

    channels_last, precision = VARIANTS[variant]
    pm = build_plugin_manager(autoload=False)
    timer = EpochTimer()
    pm.register_object(timer, "bench-epoch-timer")
    recipe = load_recipe(__file__)
    cfg = apply_overrides(recipe.make_config(), [
        f"parallel={mode}", f"batch_size={args.batch}",
        f"steps={args.steps}", f"image_size={args.image_size}",
        f"channels_last={channels_last}", f"precision={precision}",
        f"num_workers={args.workers}", f"out_dir={out_dir}", "checkpoint.every_epochs=0",
    ])
    world = World(rank=rank, local_rank=rank, world_size=world_size,
                  local_world_size=world_size, master_port=port)
    Engine(pm, recipe, cfg, world, {}).run()
    return cfg.steps * cfg.batch_size / timer.seconds[-1]


# ------------------------------------------------------------------------ session


def session_worker(rank: int, world_size: int, schedule: list, ports: list, args,
                   results_path: str) -> None:
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for item, port in zip(schedule, ports):
        round_index, table, variant, mode, side = item
        with tempfile.TemporaryDirectory() as out_dir:
            if side == HAND:
                images_per_s = hand_written(rank, world_size, port, variant, mode, args)
            else:
                images_per_s = through_engine(rank, world_size, port, variant, mode,
                                              out_dir, args)
        if rank == 0:
            with open(results_path, "a") as f:
                f.write(json.dumps({"round": round_index, "table": table,
                                    "variant": variant, "mode": mode, "side": side,
                                    "images_per_s": images_per_s}) + "\n")


def mode_processes(mode: str, nproc: int) -> int:
    """single and dp run one process; ddp one per GPU."""
    return nproc if mode == "ddp" else 1


def rotated(items: list, shift: int) -> list:
    shift %= max(1, len(items))
    return items[shift:] + items[:shift]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, help="processes, one GPU each (default: all "
                   "visible GPUs)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per epoch")
    p.add_argument("--batch", type=int, default=512, help="global batch")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers per process")
    p.add_argument("--reps", type=int, default=3, help="interleaved rounds")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="the variant table (empty: none)")
    p.add_argument("--modes", default="", help="also a table of parallel modes at fp32, "
                   f"e.g. {','.join(MODES)}")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny run on the CPU with gloo that checks the plumbing")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if not variants and not modes:
        p.error("nothing to measure: give --variants or --modes")

    import torch

    if args.cpu_smoke:
        nproc = args.nproc or 1
    elif not torch.cuda.is_available():
        print("bench_gpu_resnet: no CUDA device visible (torch.cuda.is_available() is "
              "False); run it on a GPU machine, or use --cpu-smoke to check the plumbing "
              "on the CPU", file=sys.stderr)
        return 2
    else:
        nproc = args.nproc or torch.cuda.device_count()
        if nproc > torch.cuda.device_count():
            p.error(f"--nproc {nproc}: only {torch.cuda.device_count()} GPUs are visible")
    if args.batch % nproc:
        p.error(f"--batch {args.batch} does not split over {nproc} processes")

    # A measurement is (variant, mode) on one side, made once for both tables (fp32 at
    # the default mode is a line of each). One session (a set of processes) per round
    # and process count; inside a round the measurements run back to back in an order
    # that rotates from round to round.
    default_mode = "ddp" if nproc > 1 else "single"
    keys = [("variants", v, default_mode) for v in variants]
    keys += [("modes", "fp32", m) for m in modes]
    measured: dict[tuple, tuple] = {}
    for key in keys:
        measured.setdefault(key[1:], key)
    items = [(*key, side) for key in measured.values() for side in (HAND, ENGINE)]
    results = []
    for round_index in range(args.reps):
        by_nproc: dict[int, list] = {}
        for table, variant, mode, side in rotated(items, round_index):
            by_nproc.setdefault(mode_processes(mode, nproc), []).append(
                (round_index, table, variant, mode, side))
        for processes, schedule in rotated(sorted(by_nproc.items()), round_index):
            results += run_session(processes, schedule, args)

    def median(key, side):  # key: (table, variant, mode); the table does not matter
        return statistics.median(r["images_per_s"] for r in results
                                 if (r["variant"], r["mode"], r["side"]) == (*key[1:], side))

    where = "CPU smoke test (not a measurement)" if args.cpu_smoke else (
        f"{nproc} x {torch.cuda.get_device_name(0)}")
    print(f"ResNet-18, {args.image_size}x{args.image_size} images, global batch "
          f"{args.batch}, {args.steps} steps timed, median of {args.reps} rounds; {where}")
    # Each table: its first column, (label, key) per line, the key the last column
    # compares the engine with, and that column's name in the JSON and on screen.
    tables = []
    if variants:
        tables.append(("variant", [(v, ("variants", v, default_mode)) for v in variants],
                       ("variants", "fp32", default_mode) if "fp32" in variants else None,
                       "gain", "gain vs fp32"))
    if modes:
        tables.append(("mode", [(m, ("modes", "fp32", m)) for m in modes],
                       ("modes", "fp32", "single") if "single" in modes else None,
                       "vs_single", "engine vs single"))
    rows = []
    for column, lines, base_key, versus, versus_header in tables:
        base = median(base_key, ENGINE) if base_key else None
        print(f"\n{column:<20} {'processes':>9} {'hand img/s':>11} {'engine img/s':>13} "
              f"{'ratio':>7} {versus_header:>17}")
        for label, key in lines:
            hand, eng = median(key, HAND), median(key, ENGINE)
            processes = mode_processes(key[2], nproc)
            rows.append({column: label, "processes": processes, "hand": hand,
                         "engine": eng, "ratio": eng / hand,
                         versus: eng / base if base else None})
            shown = f"{eng / base:.3f}" if base else "-"
            print(f"{label:<20} {processes:>9} {hand:>11.0f} {eng:>13.0f} "
                  f"{eng / hand:>7.3f} {shown:>17}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def run_session(processes: int, schedule: list, args) -> list[dict]:
    """Runs ``schedule`` in ``processes`` spawned processes; returns rank 0's results."""
    import torch.multiprocessing as mp

    from engine.launcher import free_port, start_method

    ports = [free_port() for _ in schedule]
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        results_path = f.name
    try:
        # spawn, as engine-run's launcher; ENGINE_START_METHOD=fork forks (the smoke test)
        mp.start_processes(session_worker, nprocs=processes, start_method=start_method(),
                           args=(processes, schedule, ports, args, results_path))
        return [json.loads(line) for line in
                pathlib.Path(results_path).read_text().splitlines()]
    finally:
        os.unlink(results_path)


if __name__ == "__main__":
    sys.exit(main())
