"""``engine-run doctor``: what this machine and launcher look like, and what may go wrong.

    engine-run doctor                       # here
    srun -N2 -n2 engine-run doctor          # every task of a SLURM step says what it sees
    torchrun --nproc-per-node 2 $(which engine-run) doctor

Prints the versions, the GPUs, each detection rule's verdict, the chosen launcher's
variables and world, the checks (master, port, threads, interfaces), the broken plugins
and hints for the usual failures. Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys

import engine
from engine import cli, cpu_bf16
from engine.errors import EngineError, LaunchError
from engine.launcher import (LaunchOptions, check_port_free, choose_launcher, detection_order,
                             detects, is_local_address)
from engine.plugin_manager import build_plugin_manager
from engine.plugins.tracking import mlflow_store_problem
from engine.threads import choose_threads
from engine.world import format_world_table, tcp_endpoint

OK, PROBLEM, NOTE = "ok", "PROBLEM", "note"

HINTS = (
    ("unreachable master", "every rank must reach MASTER_ADDR:MASTER_PORT (rank 0's host); "
     "use an address the other nodes resolve (not localhost), open the port in the "
     "firewall, and give init a timeout (timeout_s=...) so a wrong address fails fast"),
    ("NCCL_SOCKET_IFNAME", "on hosts with several networks NCCL may pick one the other "
     "nodes cannot reach; set NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME) to the "
     "interface that connects the nodes, e.g. NCCL_SOCKET_IFNAME=ib0 or eth0"),
    ("port in use", "another job (or an earlier run still shutting down) holds the master "
     "port: pass --master-port PORT / export MASTER_PORT=PORT, or leave it out with "
     "spawn and a free port is picked"),
    ("mismatched world size", "WORLD_SIZE must equal nodes x processes per node on every "
     "node; --nnodes, --nproc / --nproc-per-node and srun's --ntasks must agree, or the "
     "ranks wait for peers that never come (the engine names them after timeout_s)"),
    ("DDP without device_ids", "a process that sees several GPUs must give DDP "
     "device_ids=[local_rank] and call torch.cuda.set_device(local_rank) first, or all "
     "ranks pile onto GPU 0; parallel mode 'ddp' does both (cuda:LOCAL_RANK)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-run doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", default="auto", help="check this launcher (default: detect)")
    p.add_argument("--nproc", type=int, help="processes on this node (spawn, slurm)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--init-method", default="env://")
    p.add_argument("--local-rank", "--local_rank", type=int, dest="local_rank",
                   help=argparse.SUPPRESS)
    p.add_argument("-p", dest="plugins", action="append", default=[], metavar="NAME")
    return p


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    problems = 0

    def line(status: str, text: str) -> None:
        nonlocal problems
        problems += status == PROBLEM
        print(f"  {status:<7} {text}")

    print(f"engine {engine.__version__}, Python {platform.python_version()} on "
          f"{socket.gethostname()} ({platform.system()} {platform.release()})")
    gpus = _torch_section()

    # A broken plugin is one of the problems doctor is for: named, not fatal.
    pm = build_plugin_manager(args.plugins, keep_going=True, 
                              scratch_parser=cli.build_parser())
    print("plugins:")
    line(OK, f"{len(pm.infos)} loaded (engine-run plugins lists them)")
    for broken in pm.broken:
        line(PROBLEM, broken.describe())
    options = LaunchOptions(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                            master_addr=args.master_addr, master_port=args.master_port,
                            init_method=args.init_method, local_rank=args.local_rank,
                            cpu_allocation=pm.hook.engine_cpu_allocation(environ=os.environ))
    environ = dict(os.environ)
    print("launcher detection (first match wins):")
    for cls in detection_order(pm.launchers):
        yes = detects(cls, environ, options)
        why = cls.explain_detection(environ, options) if hasattr(
            cls, "explain_detection") else ""
        print(f"  {cls.name:<9} {cls.priority:>5}  {'yes' if yes else 'no ':<3}  {why}")

    print("checks:")
    try:
        launcher = choose_launcher(pm.launchers, args.launcher, options, environ)
        worlds = launcher.worlds()
    except EngineError as exc:
        line(PROBLEM, str(exc))
        _check_ifname(line)
        _hints()
        return 1
    how = "asked for" if args.launcher != "auto" else "detected"
    line(OK, f"launcher {launcher.name} ({how})")
    world = worlds[0]
    line(OK, f"this node: node {world.node_rank} of {world.num_nodes}, ranks "
             f"{', '.join(str(w.rank) for w in worlds)} of {world.world_size}, local world "
             f"size {world.local_world_size}; master {world.rendezvous} "
             f"({world.init_method})")
    threads, why = choose_threads(world.cpu_share(), world.local_world_size)
    busy = threads < world.cpu_share().count  # the load leaves fewer CPUs than the share
    line(NOTE if busy else OK, f"torch threads: {threads} per process ({why})" + (
        "; the load keeps CPUs busy, and more threads per process would take turns on "
        "them (many times slower)" if busy else ""))
    _check_master(world, line, launcher)
    _check_ifname(line)
    store = mlflow_store_problem(None, environ)  # a run's mlflow.tracking_uri: --dry-run
    if store:
        line(PROBLEM, store)
    if gpus > 1 and world.local_world_size > 1:
        line(NOTE, f"{gpus} GPUs visible to each of {world.local_world_size} local "
                   "processes: each must use its own (parallel mode 'ddp' takes "
                   "cuda:LOCAL_RANK and passes device_ids)")
    if gpus and world.local_world_size > gpus:
        line(PROBLEM, f"{world.local_world_size} processes on this node but only {gpus} "
                      "visible GPU(s); start fewer processes (--nproc) or use more GPUs")

    variables = launcher.variables()
    if variables:
        print(f"variables read by {launcher.name}:")
        for key, value in sorted(variables.items()):
            print(f"  {key}={value}")
    print("world (as computed here):")
    for row in format_world_table(launcher.all_worlds()).splitlines():
        print(f"  {row}")
    _hints()
    return 1 if problems else 0


def _torch_section() -> int:
    """Print torch/CUDA/NCCL versions and the GPUs; return the number of GPUs."""
    try:
        import torch  # here: a broken torch is reported, not fatal
    except Exception as exc:  # a broken install is exactly what doctor is for
        print(f"torch: cannot import ({type(exc).__name__}: {exc})")
        return 0
    cuda = torch.version.cuda or "none (CPU-only build)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    available = torch.cuda.is_available()
    nccl = "-"
    if available:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = "unavailable"
    print(f"torch {torch.__version__}: CUDA build {cuda}, CUDA available: "
          f"{'yes' if available else 'no'}"
          + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
          + f", NCCL {nccl}, gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}")
    count = torch.cuda.device_count() if available else 0
    if count:
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            print(f"  GPU {i}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    else:
        print("  GPUs: none (processes compute on the CPU with gloo)")
    _cpu_line(torch)
    return count


def _cpu_line(torch) -> None:
    """The CPU's vector capability, and what precision=bf16 costs on it."""
    bf16 = {True: "yes", False: "no", None: "unknown"}[cpu_bf16.has_bf16(cpu_bf16.cpu_flags())]
    print(f"  CPU: {torch.backends.cpu.get_cpu_capability()} (torch's kernels), bf16 "
          f"hardware: {bf16}")
    note = cpu_bf16.note_here()
    if note:
        print(f"  {NOTE:<7} {note}")


def _check_master(world, line, launcher) -> None:
    if world.init_method.startswith("file://"):
        path = world.init_method[len("file://"):]
        folder = os.path.dirname(path) or "/"
        status = OK if os.path.isdir(folder) else PROBLEM
        line(status, f"file:// rendezvous folder {folder} "
                     f"{'exists' if status == OK else 'does not exist'}")
        return
    host, port = tcp_endpoint(world)
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, port)})
    except OSError as exc:
        line(PROBLEM, f"master address {host!r} does not resolve ({exc}); fix "
                      "--master-addr / MASTER_ADDR")
        return
    line(OK, f"master address {host} resolves to {', '.join(addresses)}")
    if world.world_size > 1 and world.num_nodes > 1 and any(
            a.startswith("127.") or a == "::1" for a in addresses) and world.node_rank != 0:
        line(NOTE, f"{host} is a loopback address: other machines cannot reach it")
    if launcher.port_held_by_starter:
        line(OK, f"port {port}: " + (
            f"{launcher.name} picked it and holds it for rank 0's rendezvous store"
            if launcher.spawns else
            f"{launcher.name}'s agent holds it (the rendezvous store)"))
    elif world.rank == 0 and is_local_address(host):
        try:
            check_port_free(host, port)
            line(OK, f"master port {port} is free on this host")
        except LaunchError as exc:
            line(PROBLEM, str(exc))


def _check_ifname(line) -> None:
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(var)
        if not value:
            continue
        try:
            names = [name for _, name in socket.if_nameindex()]
        except OSError:
            names = []
        # NCCL accepts prefixes ("eth" matches eth0) and ^excludes; check the plain ones.
        wanted = [v for v in value.split(",") if v and not v.startswith(("^", "="))]
        unknown = [v for v in wanted if not any(n.startswith(v) for n in names)]
        if unknown:
            line(PROBLEM, f"{var}={value}: no interface matches {', '.join(unknown)} "
                          f"(interfaces here: {', '.join(names) or 'none'})")
        else:
            line(OK, f"{var}={value} matches an interface here")


def _hints() -> None:
    print("hints for the usual failures:")
    for title, text in HINTS:
        print(f"  {title}: {text}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
