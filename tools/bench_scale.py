"""Benchmark: how the engine's own costs grow with the number of ranks W, on one machine.

    python tools/bench_scale.py                          # W = 2, 4, ..., 64
    python tools/bench_scale.py --sizes 2,4 --steps 20   # a short look
    python tools/bench_scale.py --sizes 2,4 --parallel fsdp   # the ring (fsdp only)
    python tools/bench_scale.py --markdown table.md --plots docs/images/scale

For each W it runs engine-run once, in a folder of its own: tools/bench_tiny_recipe.py (a
Linear 8 -> 8, 2 samples per rank, ``--threads 1``, gloo, spawn) for ``--steps`` optimizer
steps with a check point every ``--log-every`` steps, a memory snapshot every
``--memory-every`` and a disk snapshot every ``--disk-every``, under ``--max-restarts 1``
(every worker a fork of the warm spare, engine/spares.py). Right after step
``--kill-step`` every rank writes its record and the last rank SIGKILLs itself; the
launcher restarts all W, which resume from the newest snapshot and train to the end: the
time from the kill to the restarted attempt's first step, its resume (the ranks'
agreement on the snapshot) and the steps lost. ``--no-kill``: the run without the kill.

What it measures is recorded by this module itself, loaded into every worker as the
engine's plugin (``-p bench_scale``; its module-level ``engine_*`` functions are hook
implementations, so no other function here may start with ``engine_``). In a worker it
wraps torch.distributed's collectives (calls, the bytes this rank sends and the bytes it
receives, and the wall time of each call, per kind) and a few of the engine's functions
(spans: a check point, a memory snapshot's step path and its background jobs, the rows'
exchange, the ring, a disk snapshot, the resume and its agreement, the health barriers),
and attributes each collective to the innermost span it ran in, else to the engine
function that called it. Nothing in engine/ changes: a span whose function is not there
(a later engine renamed it) is listed as not found, and its collectives go to the
enclosing span. Each worker writes a JSON record (the first attempt's at the kill, the
restarted one's at its end): the engine's phases (engine.phases), the spans, the
collectives, its CPU time, peak RSS, PSS, the peak /dev/shm its memory snapshots held and
its established TCP connections (gloo's pairs, the store's).

Printed: one row per figure, the median over the ranks for each W, the fit of its growth
(constant, log2 W or W: least squares; "constant" where the values stay within 15% of
their mean or none grows, else the growing model of higher R²) and the fitted value at W =
1k, 4k and 16k; then rank 0's collectives per stage and source, and the SLURM hostlist's
expansion timed at 1k, 4k and 16k directly. Figures marked ``(t)`` are wall times: W
processes on a machine with fewer cores slow each other down, so they grow with W for
that reason alone and are not carried to 16k; bytes, counts and CPU seconds per rank are
what the engine itself adds (docs/scale.md).

Not counted: DDP's gradient all-reduce (C++, outside torch.distributed's Python
functions: one model's worth of bytes per step, 288 B here), the TCPStore's traffic of
the rendezvous (C++: gloo's connection set-up), and anything the launcher does.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import pickle
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types

import engine

TOOLS = pathlib.Path(__file__).resolve().parent
RECIPE = TOOLS / "bench_tiny_recipe.py"
PLUGIN = "bench_scale"  # this module, as the engine's -p plugin (tools/ on PYTHONPATH)
RECORDS_ENV = "BENCH_SCALE_RECORDS"  # the folder the workers write their records into
KILL_ENV = "BENCH_SCALE_KILL_STEP"  # kill run: the step after which the last rank dies
SIZES = (2, 4, 8, 16, 32, 64)
AT = (1024, 4096, 16384)  # the extrapolation's W
FLAT = 0.15  # a figure within this fraction of its mean over W is "constant"

# ------------------------------------------------------------------ the plugin side

#: Engine functions timed as spans: label -> (module, attribute, ...). Collectives
#: issued inside one are attributed to it (the innermost, per thread).
SPANS = {
    "check point": ("engine.check_point", "CheckPoint", "start"),
    "check point finished": ("engine.check_point", "CheckPoint", "finish"),
    "memory snapshot": ("engine.memory.tier", "MemoryTier", "save"),
    "exchange": ("engine.memory.background", "Exchanges", "start"),
    "ring": ("engine.memory.ring", "Ring", "copy"),
    "disk snapshot": ("engine.snapshot", "save"),
    "memory tier open": ("engine.memory.tier", "MemoryTier", "open"),
    "resume": ("engine.snapshot", "resume"),
    "resume agreement": ("engine.memory.resume", "agree"),
    "resume complete": ("engine.memory.resume", "complete"),
    "health epoch barrier": ("engine.health", "epoch_barrier"),
    "health roll call": ("engine.health", "missing_ranks"),
}
#: The background thread's jobs (a large state's copy, the rows written, the ring's
#: copy), each timed as "<the span that submitted it> background".
BACKGROUND = ("engine.memory.background", "Background", "submit")
#: torch.distributed functions counted: name -> (index of the argument this rank
#: sends, index of the one it receives into; None: none).
COLLECTIVES = {
    "all_reduce": (0, 0), "broadcast": (0, 0), "reduce": (0, 0),
    "all_gather": (1, 0), "all_gather_into_tensor": (1, 0),
    "reduce_scatter": (1, 0), "reduce_scatter_tensor": (1, 0),
    "all_to_all": (1, 0), "all_to_all_single": (1, 0),
    "gather": (0, 1), "scatter": (1, 0),
    # isend/irecv are counted inside batch_isend_irecv (wrapping them would make torch's
    # P2POp refuse them: it checks the op is torch's own function)
    "send": (0, None), "recv": (None, 0), "batch_isend_irecv": ("p2p", "p2p"),
    "barrier": (None, None), "monitored_barrier": (None, None),
    "all_gather_object": ("object", "objects"), "broadcast_object_list": ("objects", None),
    "gather_object": ("object", None), "scatter_object_list": ("objects", None),
    "new_group": (None, None),
}

_local = threading.local()  # .spans: this thread's open spans, innermost last
_lock = threading.Lock()
#: (stage, where, kind) -> [calls, bytes sent, bytes received, seconds]
_collectives: dict[tuple[str, str, str], list] = {}
#: span label -> [calls, wall seconds, CPU seconds of the calling thread]
_spans: dict[str, list] = {}
_state = {"first_step_at": None, "shm_peak": 0, "missing": [], "resumed_step": None}


def tensor_bytes(value) -> int:
    """The bytes of a tensor, or of the tensors in a list (0 for anything else)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def object_bytes(value) -> int:
    try:
        return len(pickle.dumps(value))
    except Exception:  # an object pickle cannot take: counted as nothing
        return 0


def payload(spec, args: tuple, kwargs: dict) -> int:
    """The bytes the argument ``spec`` names: an index (tensors), "object" (the
    first argument's pickle), "objects" (a list of objects' pickles)."""
    if spec is None or spec == "p2p":  # batch_isend_irecv: counted by its ops (counted)
        return 0
    if spec == "object":
        return object_bytes(args[1] if len(args) > 1 else kwargs.get("obj"))
    if spec == "objects":
        return sum(object_bytes(o) for o in (args[0] if args else
                                             kwargs.get("object_list", [])) or [])
    return tensor_bytes(args[spec]) if len(args) > spec else 0


def where_called() -> str:
    """The innermost open span of this thread, else ``module:function`` of the first
    caller outside torch, this module and engine.distributed's thin wrappers."""
    spans = getattr(_local, "spans", None)
    if spans:
        return spans[-1]
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("torch") or module in (__name__, "engine.distributed")):
            return f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def stage() -> str:
    """start-up (before the first optimizer step ended), training, or end."""
    from engine import phases

    if phases.elapsed(until=phases.TRAINING_ENDS) is not None:
        return "end"
    return "start-up" if _state["first_step_at"] is None else "training"


#: Point-to-point calls counted where the memory ring makes them (its module's name for
#: torch.distributed: torch's own isend/irecv stay unwrapped, see COLLECTIVES).
RING_P2P = {"isend": (0, None), "irecv": (None, 0)}


def counted(kind: str, fn):
    sends, receives = {**COLLECTIVES, **RING_P2P}[kind]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        sent = payload(sends, args, kwargs) if kind != "broadcast_object_list" else 0
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        received = payload(receives, args, kwargs)
        if kind == "batch_isend_irecv":  # the ops' tensors: sent by isend, received by irecv
            import torch.distributed as dist

            def nbytes(op):
                return op.tensor.numel() * op.tensor.element_size()

            sent = sum(nbytes(op) for op in args[0] if op.op is dist.isend)
            received = sum(nbytes(op) for op in args[0] if op.op is dist.irecv)
        if kind == "broadcast_object_list":  # the source sends, the others receive
            import torch.distributed as dist

            size = payload("objects", args, kwargs)
            src = kwargs.get("src", args[1] if len(args) > 1 else 0)
            sent, received = (size, 0) if dist.get_rank() == src else (0, size)
        key = (stage(), where_called(), kind)
        with _lock:
            row = _collectives.setdefault(key, [0, 0, 0, 0.0])
            row[0] += 1
            row[1] += sent
            row[2] += received
            row[3] += seconds
        return result

    return wrapper


def timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        spans = _local.__dict__.setdefault("spans", [])
        spans.append(label)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.pop()
            with _lock:
                row = _spans.setdefault(label, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += time.perf_counter() - start
                row[2] += time.thread_time() - cpu

    return wrapper


def background_jobs(submit):
    """Background.submit, each job timed as a span of its own: "<span> background",
    the span that submitted it (the ring's copy: "ring background")."""

    @functools.wraps(submit)
    def wrapper(self, job):
        spans = getattr(_local, "spans", None) or ["memory snapshot"]
        return submit(self, timed(f"{spans[-1]} background", job))

    return wrapper


def patch(path: tuple, wrap) -> bool:
    """Replace the function at (module, [class,] name) by ``wrap(function)``; False
    where the module, class or name is not there."""
    import importlib

    try:
        owner = importlib.import_module(path[0])
        for name in path[1:-1]:
            owner = getattr(owner, name)
        raw = vars(owner)[path[-1]]
    except (ImportError, AttributeError, KeyError):
        return False
    if isinstance(raw, classmethod):
        setattr(owner, path[-1], classmethod(wrap(raw.__func__)))
    else:
        setattr(owner, path[-1], wrap(raw))
    return True


def instrument() -> None:
    """Wrap the collectives and spans, once per process (a fork inherits them)."""
    if _state.get("instrumented"):
        return
    _state["instrumented"] = True
    import torch.distributed as dist

    for kind in COLLECTIVES:
        if hasattr(dist, kind):
            setattr(dist, kind, counted(kind, getattr(dist, kind)))
    for label, path in SPANS.items():
        if not patch(path, functools.partial(timed, label)):
            _state["missing"].append(label)
    try:
        from engine.memory import ring
    except ImportError:
        _state["missing"].append("ring")
    else:
        ring.dist = types.SimpleNamespace(**{**vars(dist), **{
            kind: counted(kind, getattr(dist, kind)) for kind in RING_P2P}})
    if not patch(BACKGROUND, background_jobs):
        _state["missing"].append("memory snapshot background")


@engine.hookimpl
def engine_register_run_files():
    """Fires as each process builds its plugin manager: in a worker (torch.distributed
    imported: a spawned worker, a warm spare, a fork of a launcher that imported torch
    after loading its plugins) the collectives and spans are wrapped before its first
    collective; never in a launching process before torch (it runs no collective and
    must not pay for torch's import)."""
    if RECORDS_ENV in os.environ and "torch.distributed" in sys.modules:
        instrument()
    return []


def shm_bytes(ctx) -> int:
    """The /dev/shm this rank's memory snapshots hold now (its buffers, fsdp: the
    copies it holds of its predecessor's), in allocated blocks."""
    memory = ctx.snapshots.memory
    if memory is None:
        return 0
    pair = memory.pair
    paths = [*pair.paths, *(pair.ring.paths if pair.ring is not None else ())]
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def proportional_set_size() -> int:
    """This process's PSS (its share of the pages it shares with the other ranks:
    torch's libraries), what W ranks together take: /proc/self/smaps_rollup; 0 where
    there is none."""
    try:
        for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tcp_connections() -> int:
    """This process's established TCP connections (gloo's pairs of every group, the
    store's): its sockets' inodes (/proc/self/fd), found in /proc/self/net/tcp{,6}."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            mine.add(link[len("socket:["):-1])
    established = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        established += sum(f[3] == "01" and f[9] in mine for f in map(str.split, lines))
    return established


@engine.hookimpl
def engine_run_start(ctx):
    _state["resumed_step"] = ctx.state.step


@engine.hookimpl
def engine_train_step_end(ctx, step):
    if _state["first_step_at"] is None:
        _state["first_step_at"] = time.monotonic()
    if ctx.cfg.checkpoint.memory_every_steps:
        _state["shm_peak"] = max(_state["shm_peak"], shm_bytes(ctx))
    kill_step = os.environ.get(KILL_ENV)
    if kill_step and step == int(kill_step) and ctx.world.restart_count == 0:
        # Every rank's record of the first attempt (none ends by itself), then the
        # last rank dies: the launcher restarts them all.
        write_record(ctx)
        if ctx.world.rank == ctx.world.world_size - 1:
            path = pathlib.Path(os.environ[RECORDS_ENV]) / "kill.json"
            path.write_text(json.dumps({"killed_at": time.monotonic(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)


@engine.hookimpl
def engine_run_end(ctx, summary):
    write_record(ctx, summary.get("resume"))


def write_record(ctx, resume=None) -> None:
    """This rank's record, into the folder the bench named: a{attempt}.rank{rank}.json."""
    from engine import phases

    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        "rank": ctx.world.rank, "world_size": ctx.world.world_size,
        "restart": ctx.world.restart_count,
        "steps": ctx.state.step - (_state["resumed_step"] or 0),
        "training_s": phases.training_time(),
        "first_step_at": _state["first_step_at"], "resumed_step": _state["resumed_step"],
        "resume": resume,
        "phases": [list(row) for row in phases.rows()],
        "spans": _spans, "missing_spans": _state["missing"],
        "collectives": [[*key, *row] for key, row in _collectives.items()],
        "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
        "shm_peak_bytes": _state["shm_peak"], "pss_bytes": proportional_set_size(),
        "tcp_connections": tcp_connections(),
    }
    folder = pathlib.Path(os.environ[RECORDS_ENV])
    name = f"a{ctx.world.restart_count}.rank{ctx.world.rank}.json"
    # Whole or not at all: the launcher may stop this rank mid-write (the kill's restart).
    (folder / f".{name}").write_text(json.dumps(record))
    os.replace(folder / f".{name}", folder / name)


# ------------------------------------------------------------------ the runs


def overrides(world_size: int, args) -> list[str]:
    return [f"max_steps={args.steps}", f"batch_size={2 * world_size}",
            f"train_size={2 * world_size * (args.steps + 5)}", "epochs=1",
            f"log_every={args.log_every}",
            f"checkpoint.memory_every_steps={args.memory_every}",
            f"checkpoint.every_steps={args.disk_every}", "checkpoint.every_epochs=1"]


def run_engine(world_size: int, kind: str, folder: pathlib.Path, args) -> dict:
    """One engine-run of ``world_size`` ranks: its workers' records, the launch time
    (time.monotonic), the kill (kill runs), its exit status and wall seconds."""
    records = folder / kind
    records.mkdir(parents=True)
    env = {**os.environ, RECORDS_ENV: str(records), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TOOLS),
                                                       os.environ.get("PYTHONPATH")]))}
    # --max-restarts: the spawn launcher's warm spares start every attempt's workers
    # (forks of one process that imported torch, the plugins and the recipe once).
    command = [sys.executable, "-m", "engine", str(RECIPE), "--nproc", str(world_size),
               "--threads", "1", "-p", PLUGIN, "--no-resume", "--max-restarts", "1",
               "--parallel", args.parallel, *overrides(world_size, args),
               f"out_dir={folder / (kind + '-run')}"]
    if kind == "kill":
        env[KILL_ENV] = str(args.kill_step)
    launched = time.monotonic()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.monotonic() - launched
    if done.returncode != 0:
        print(f"W={world_size} {kind}: engine-run exited {done.returncode}:\n"
              f"{done.stderr[-2000:]}", file=sys.stderr)
    found = sorted(records.glob("a*.rank*.json"))
    kill = records / "kill.json"
    disk = sorted((folder / (kind + "-run") / "checkpoints").glob("*.pt"))
    return {"world_size": world_size, "kind": kind, "launched_at": launched, "wall_s": wall,
            "returncode": done.returncode,
            "records": [json.loads(p.read_text()) for p in found],
            "kill": json.loads(kill.read_text()) if kill.exists() else None,
            "disk_snapshot_bytes": disk[-1].stat().st_size if disk else 0}


# ------------------------------------------------------------------ the figures


def span(record: dict, label: str) -> float | None:
    """The wall seconds of one call of span ``label`` (the mean), None where none ran."""
    row = record["spans"].get(label)
    return row[1] / row[0] if row else None


def collective_sum(record: dict, index: int, where=None, stage_=None) -> float:
    """Column ``index`` (3: calls, 4: bytes sent, 5: received, 6: seconds) of the
    record's collectives, over those in span/caller ``where`` and ``stage_``."""
    return sum(row[index] for row in record["collectives"]
               if (where is None or row[1] == where) and (stage_ is None or row[0] == stage_))


def phase(record: dict, name: str, column: int = 1) -> float | None:
    values = [row[column] for row in record["phases"] if row[0] == name]
    return values[0] if values else None


def startup_cpu(record: dict) -> float | None:
    """The worker's CPU seconds from its start to its first step (its phases up to
    the training loop, not the launcher's "command set-up")."""
    names = [row[0] for row in record["phases"]]
    if "resume, run-start hooks" not in names:
        return None
    return sum(row[2] for row in record["phases"][:names.index("resume, run-start hooks") + 1]
               if row[0] != "command set-up")


def per_call(record: dict, where: str, index: int) -> float | None:
    calls = (record["spans"].get(where) or [0])[0]
    return collective_sum(record, index, where) / calls if calls else None


#: figure -> (unit, is it a wall time, how one rank's record gives it). A function
#: of (record, run) -> value or None (not measured in that run).
FIGURES = {
    "start-up to first step": ("s", True, lambda r, run: r["first_step_at"]
                               - run["launched_at"] if r["first_step_at"] else None),
    "  worker start": ("s", True, lambda r, run: phase(r, "worker start")),
    "  imports, plugins, recipe": ("s", True,
                                   lambda r, run: phase(r, "imports, plugins, recipe")),
    "  process group (rendezvous)": ("s", True, lambda r, run: phase(r, "process group")),
    "  data, model": ("s", True, lambda r, run: phase(r, "data, model")),
    "  resume, run-start hooks": ("s", True,
                                  lambda r, run: phase(r, "resume, run-start hooks")),
    "start-up CPU (worker's phases)": ("s", False, lambda r, run: startup_cpu(r)),
    "start-up collectives": ("calls", False,
                             lambda r, run: collective_sum(r, 3, stage_="start-up")),
    "start-up collective bytes received": ("B", False,
                                           lambda r, run: collective_sum(r, 5, stage_="start-up")),
    "step (training wall / steps)": ("s", True, lambda r, run: r["training_s"]
                                     / max(r["steps"], 1) if r["training_s"] else None),
    "check point": ("s", True, lambda r, run: (span(r, "check point") or 0)),
    "check point collective bytes": ("B", False, lambda r, run: per_call(r, "check point", 4)),
    "memory snapshot (step path)": ("s", True, lambda r, run: span(r, "memory snapshot")),
    "memory snapshot (step path) CPU": ("s", False, lambda r, run: (
        r["spans"]["memory snapshot"][2] / r["spans"]["memory snapshot"][0])
        if r["spans"].get("memory snapshot") else None),
    "memory snapshot (background job)": ("s", True,
                                         lambda r, run: span(r, "memory snapshot background")),
    "exchange: bytes received per snapshot": (
        "B", False, lambda r, run: (collective_sum(r, 5, "exchange")
                                    / r["spans"]["memory snapshot"][0])
        if r["spans"].get("memory snapshot") else None),
    "exchange: bytes sent per snapshot": (
        "B", False, lambda r, run: (collective_sum(r, 4, "exchange")
                                    / r["spans"]["memory snapshot"][0])
        if r["spans"].get("memory snapshot") else None),
    "ring: bytes sent per snapshot": ("B", False, lambda r, run: per_call(
        r, "ring background", 4)),
    "ring: sends and receives per snapshot": ("calls", False, lambda r, run: per_call(
        r, "ring background", 3)),
    "ring copy (background job)": ("s", True, lambda r, run: span(r, "ring background")),
    "disk snapshot": ("s", True, lambda r, run: span(r, "disk snapshot")),
    "disk snapshot collective bytes": ("B", False,
                                       lambda r, run: per_call(r, "disk snapshot", 5)),
    "disk snapshot file": ("B", False, lambda r, run: run["disk_snapshot_bytes"]),
    "collectives per training step": ("calls", False, lambda r, run: collective_sum(
        r, 3, stage_="training") / max(r["steps"], 1)),
    "CPU per rank (whole run)": ("s", False, lambda r, run: r["cpu_s"]),
    "peak RSS per rank": ("B", False, lambda r, run: r["peak_rss_bytes"]),
    "PSS per rank at the end": ("B", False, lambda r, run: r["pss_bytes"]),
    "peak /dev/shm per rank": ("B", False, lambda r, run: r["shm_peak_bytes"]),
    "TCP connections per rank": ("connections", False,
                                 lambda r, run: r.get("tcp_connections")),
}
#: Figures of the kill run (its restarted attempt's records).
KILL_FIGURES = {
    "kill to first new step": ("s", True, lambda r, run: r["first_step_at"]
                               - run["kill"]["killed_at"] if r["first_step_at"] else None),
    "restart: resume": ("s", True, lambda r, run: span(r, "resume")),
    "restart: resume agreement": ("s", True, lambda r, run: span(r, "resume agreement")),
    "restart: agreement bytes received": ("B", False,
                                          lambda r, run: collective_sum(r, 5, "resume agreement")),
    "restart: resume collective bytes received": (
        "B", False, lambda r, run: sum(collective_sum(r, 5, w) for w in (
            "resume", "resume agreement", "resume complete", "memory tier open"))),
    "restart: steps lost": ("steps", False,
                            lambda r, run: run["kill"]["step"] - r["resumed_step"]),
}


def figures(runs: list[dict]) -> dict[str, dict[int, float]]:
    """figure -> {W: the median over the ranks} from the runs' records (the kill run's:
    its restarted attempt's)."""
    table: dict[str, dict[int, float]] = {}
    for run in runs:
        first = [r for r in run["records"] if r["restart"] == 0]
        parts = [(first, FIGURES)]
        if run["kill"] is not None:
            parts.append(([r for r in run["records"] if r["restart"] >= 1], KILL_FIGURES))
        for records, wanted in parts:
            add_figures(table, run, records, wanted)
    return table


def add_figures(table: dict, run: dict, records: list[dict], wanted: dict) -> None:
    for name, (_, _, get) in wanted.items():
        values = [v for v in (get(r, run) for r in records) if v is not None]
        if values:
            table.setdefault(name, {})[run["world_size"]] = statistics.median(values)


def fit(points: dict[int, float]) -> dict:
    """The growth of ``points`` ({W: value}): least squares of value = a + b f(W) for f
    = log2 W and f = W, with R²; "constant" (b = 0, a the mean) where every value is
    within FLAT of the mean or neither grows, else the growing model of higher R²."""
    ws = sorted(points)
    ys = [points[w] for w in ws]
    mean = sum(ys) / len(ys)
    fits = {"constant": {"a": mean, "b": 0.0, "r2": None}}
    for model, f in (("log W", math.log2), ("W", float)):
        xs = [f(w) for w in ws]
        mx = sum(xs) / len(xs)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - mean) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        a = mean - b * mx
        total = sum((y - mean) ** 2 for y in ys)
        residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
        fits[model] = {"a": a, "b": b, "r2": 1 - residual / total if total else 1.0}
    # Growing models only (a figure that falls with W is noise, or sharing: the
    # constant); of equal R² (two points fit both exactly), W, the larger at scale.
    growing = [m for m in ("W", "log W") if fits[m]["b"] > 0]
    flat = all(abs(y - mean) <= FLAT * abs(mean) for y in ys) or not growing
    best = "constant" if flat else max(growing, key=lambda m: round(fits[m]["r2"], 9))
    return {"model": best, **fits[best], "fits": fits}


def predict(fitted: dict, world_size: int) -> float:
    f = {"constant": lambda w: 0.0, "log W": math.log2, "W": float}[fitted["model"]]
    return fitted["a"] + fitted["b"] * f(world_size)


def human(value: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.0f} B"
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    return f"{value:.3g}"


def rows(table: dict[str, dict[int, float]]) -> list[dict]:
    """One row per figure: its values per W, the fit and the fitted value at AT."""
    units = {name: spec for name, spec in {**FIGURES, **KILL_FIGURES}.items()}
    out = []
    for name, points in table.items():
        unit, is_time, _ = units[name]
        fitted = fit(points)
        out.append({"figure": name, "unit": unit, "time": is_time, "values": points,
                    "fit": fitted, "at": {w: predict(fitted, w) for w in AT}})
    return out


def markdown(result_rows: list[dict], sizes: list[int]) -> str:
    head = (["figure (per rank, median)"] + [f"W={w}" for w in sizes]
            + ["growth"] + [f"W={w // 1024}k" for w in AT])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result_rows:
        name = r["figure"].strip() + (" (t)" if r["time"] else "")
        cells = [human(r["values"][w], r["unit"]) if w in r["values"] else "-" for w in sizes]
        model = r["fit"]["model"]
        if model != "constant":
            model += f" (R² {r['fit']['r2']:.2f})"
        # A wall time measured with W processes on a few cores grows with W for that
        # reason alone: its fit is shown, not carried to 16k (docs/scale.md models it).
        extrapolated = ["-" if r["time"] else human(r["at"][w], r["unit"]) for w in AT]
        lines.append("| " + " | ".join([name, *cells, model, *extrapolated]) + " |")
    return "\n".join(lines)


def hostlist_seconds(ranks_per_node: int = 8) -> dict[int, dict[str, float]]:
    """The SLURM hostlist's expansion (plugins/slurm_hostlist.py, what each task of a
    slurm launch parses at its start) timed at W = AT directly, W / ranks_per_node
    nodes: a range ("gpu[00001-02048]") and the worst case, every other node ("gpu00001,
    gpu00003,..." as SLURM writes a fragmented allocation: one item per node). Best of
    3, seconds."""
    import timeit

    from engine.plugins import slurm_hostlist

    out = {}
    for world_size in AT:
        nodes = world_size // ranks_per_node
        lists = {"range": f"gpu[00001-{nodes:05d}]",
                 "fragmented": ",".join(f"gpu{2 * i + 1:05d}" for i in range(nodes))}
        out[world_size] = {kind: min(timeit.repeat(
            functools.partial(slurm_hostlist.expand_nodelist, text), number=1, repeat=3))
            for kind, text in lists.items()}
    return out


def breakdown(runs: list[dict]) -> dict[tuple[str, str, str], dict[int, list]]:
    """Rank 0's collectives in each run's first attempt, per (stage, where, kind): {W: [calls,
    bytes sent, bytes received]}, where the bytes and counts grow (or do not) with W."""
    out: dict[tuple[str, str, str], dict[int, list]] = {}
    for run in runs:
        for record in run["records"]:
            if record["rank"] == 0 and record["restart"] == 0:
                for stage_, where, kind, calls, sent, received, _ in record["collectives"]:
                    out.setdefault((stage_, where, kind), {})[run["world_size"]] = [
                        calls, sent, received]
    return out


def breakdown_markdown(table: dict, sizes: list[int]) -> str:
    """The breakdown as a table: calls and bytes received per W, the growth of the
    bytes received."""
    head = ["stage", "where (span, else caller)", "collective"] + [
        f"W={w}: calls, sent / received" for w in sizes] + ["received grows as"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (stage_, where, kind), per_w in sorted(table.items()):
        cells = [f"{per_w[w][0]}, {human(per_w[w][1], 'B')} / {human(per_w[w][2], 'B')}"
                 if w in per_w else "-" for w in sizes]
        received = {w: v[2] for w, v in per_w.items()}
        growth = fit(received)["model"] if len(received) > 1 and any(received.values()) \
            else "-"
        lines.append("| " + " | ".join([stage_, where, kind, *cells, growth]) + " |")
    return "\n".join(lines)


def plot(result_rows: list[dict], folder: pathlib.Path) -> list[pathlib.Path]:
    """One PNG per figure (its points and the chosen fit), where matplotlib is
    installed; [] (said once) where not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for r in result_rows:
        ws = sorted(r["values"])
        fig, ax = plt.subplots(figsize=(4, 2.8), dpi=80)
        ax.plot(ws, [r["values"][w] for w in ws], "o", label="measured")
        dense = [ws[0] + (ws[-1] - ws[0]) * i / 50 for i in range(51)]
        ax.plot(dense, [predict(r["fit"], w) for w in dense], "-",
                label=f"fit: {r['fit']['model']}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("W (ranks)")
        ax.set_ylabel(r["unit"])
        ax.set_title(r["figure"].strip() + (" (wall, contended)" if r["time"] else ""),
                     fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / (slug(r["figure"]) + ".png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


# ------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="comma-separated numbers of ranks (default 2,4,8,16,32,64)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--memory-every", type=int, default=4)
    p.add_argument("--disk-every", type=int, default=6)
    p.add_argument("--log-every", type=int, default=3, help="steps between check points")
    p.add_argument("--kill-step", type=int, default=9,
                   help="kill run: the last rank dies right after this step")
    p.add_argument("--no-kill", action="store_true", help="no kill run")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="fsdp: each rank's snapshot its shards, and the ring")
    p.add_argument("--timeout", type=float, default=600, help="seconds per engine-run")
    p.add_argument("--json", metavar="PATH", help="also write the runs and rows here")
    p.add_argument("--markdown", metavar="PATH", help="also write the table here")
    p.add_argument("--plots", metavar="FOLDER", help="one PNG per figure here")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(w) for w in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: expected numbers of ranks, e.g. 2,4,8")
    if min(args.sizes) < 2:
        p.error("--sizes: every W must be >= 2 (one rank has no collectives)")
    if not 0 < args.kill_step < args.steps:
        p.error(f"--kill-step {args.kill_step}: must be between 1 and --steps - 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_scale-") as tmp:
        for world_size in args.sizes:
            kind = "plain" if args.no_kill else "kill"
            folder = pathlib.Path(tmp) / f"w{world_size}"
            run = run_engine(world_size, kind, folder, args)
            print(f"W={world_size:<3} {kind:<6} {run['wall_s']:6.1f}s  exit "
                  f"{run['returncode']}  {len(run['records'])} record(s)", flush=True)
            runs.append(run)
            shutil.rmtree(pathlib.Path(tmp) / f"w{world_size}", ignore_errors=True)
    result = rows(figures(runs))
    missing = sorted({m for run in runs for r in run["records"] for m in r["missing_spans"]})
    print(f"\nper rank, median over the ranks; (t): wall time, distorted by {os.cpu_count()} "
          f"CPU(s) shared by W processes; growth fitted over W = {args.sizes}, "
          f"extrapolated to {', '.join(map(str, AT))}; {time.monotonic() - started:.0f}s")
    table = markdown(result, args.sizes)
    print(table)
    details = breakdown_markdown(breakdown(runs), args.sizes)
    print("\nrank 0's collectives (first attempt), per stage and where they come from")
    print(details)
    hosts = hostlist_seconds()
    print("\nthe SLURM hostlist's expansion at W ranks (8 per node), measured directly: "
          + "; ".join(f"W={w}: range {t['range'] * 1e3:.2f} ms, fragmented "
                      f"{t['fragmented'] * 1e3:.2f} ms" for w, t in hosts.items()))
    if missing:
        print(f"spans not found in this engine (not measured): {', '.join(missing)}")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n\n" + details + "\n")
    if args.plots:
        written = plot(result, pathlib.Path(args.plots))
        print(f"{len(written)} plot(s) in {args.plots}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"runs": runs, "rows": result,
                                                       "hostlist_s": hosts},
                                                      indent=1, default=str))
    return 0 if all(run["returncode"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
