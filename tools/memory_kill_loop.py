#!/usr/bin/env python3
"""The 20-kill loop of issue 26: one worker of a 2-process run under
``torchrun --standalone --nproc-per-node 2 --max-restarts 3`` SIGKILLed at a random step,
``--kills`` times, with in-memory snapshots every ``--memory-every-steps`` steps. Each
time: the final weights must equal an uninterrupted run's (bit-identical
weights_sha256), the steps recomputed must be <= memory_every_steps, and the time from
the kill to the first step the restarted workers finish is measured.

    python tools/memory_kill_loop.py                          # 20 kills, tiny_resume
    python tools/memory_kill_loop.py --kills 5 --memory-every-steps 3 --seed 1
    python tools/memory_kill_loop.py --launcher spawn          # engine-run --max-restarts
    python tools/memory_kill_loop.py --recipe recipes/cifar_ddp.py --epochs 1 \\
        data.source=synthetic data.synthetic_size=2048

How it measures: this module is also the runs' plugin (``-p memory_kill_loop``, tools/
on PYTHONPATH). Its step-end hook appends ``time step restart`` to
``<out_dir>/steps-rank<R>.txt`` at every optimizer step; on the chosen rank and step of
the first start it writes the time to ``<out_dir>/killed`` and SIGKILLs its own process
(in the step-end hook: after the step, before that step's memory snapshot). Steps
recomputed: the furthest step the first start finished minus the step the restart
resumed at (its first step - 1), checked against summary.json's ``resume.steps_lost``.
Kill -> first new step: the earliest time a restarted worker finished a step, minus the
kill's time; split into kill -> the first restarted worker process started (torchrun's
detection and its start of the workers), -> its set-up done, the resume included
(``engine_run_start``: Python, torch and the engine started, the snapshot agreed on and
loaded), and the first step; the last line gives the median end of each of the
restarted workers' start-up phases (engine/phases.py: worker start, imports, process
group, data and model...) after the kill.

``--wipe 3``: the third kill also deletes the killed rank's memory snapshots (under fsdp
the copies it holds of its predecessor's too, engine/memory/ring.py): a node lost with
its memory, which must resume from a peer's copy (summary.json's tier ``peer``):
``python tools/memory_kill_loop.py --kills 5 --launcher spawn --wipe 3 parallel=fsdp``.

``--launcher spawn``: ``engine-run --nproc 2 --max-restarts 3`` instead, whose workers
are forks of a warm spare (engine/spares.py) that replace every worker after a failure.

One line per kill, then the totals. Exit status 0 when every kill passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
PLUGIN = pathlib.Path(__file__).stem
KILL_STEP, KILL_RANK = "MEMORY_KILL_LOOP_STEP", "MEMORY_KILL_LOOP_RANK"
WIPE = "MEMORY_KILL_LOOP_WIPE"  # set: the killed rank's memory goes with it (--wipe)

# ------------------------------------------------------------------ the runs' plugin

try:
    import engine as _engine
except ImportError:  # the tool itself needs no engine import
    _engine = None

def process_started() -> float:
    """When this process started (time.time()'s clock, to 10 ms): /proc's start time
    in clock ticks since boot, against the uptime."""
    ticks = int(pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


if _engine is not None:
    @_engine.hookimpl
    def engine_run_start(ctx):
        """A restarted worker's times: its process start, and its set-up (resume
        included) done."""
        if ctx.world.restart_count:
            with open(ctx.out_dir / f"started-rank{ctx.world.rank}.txt", "a") as f:
                f.write(f"{process_started()!r} {time.time()!r}\n")
            from engine import phases

            # The worker's start-up phases, on time.time()'s clock: where the time goes.
            shift = time.time() - time.monotonic()
            with open(ctx.out_dir / f"phases-rank{ctx.world.rank}.json", "w") as f:
                json.dump([(name, wall + shift) for name, wall, _, pid in phases._marks
                           if pid == os.getpid()], f)

    @_engine.hookimpl
    def engine_train_step_end(ctx, step, loss):
        rank, restart = ctx.world.rank, ctx.world.restart_count
        now = time.time()
        with open(ctx.out_dir / f"steps-rank{rank}.txt", "a") as f:
            f.write(f"{now!r} {step} {restart}\n")
        if (restart == 0 and str(step) == os.environ.get(KILL_STEP)
                and str(rank) == os.environ.get(KILL_RANK)):
            if os.environ.get(WIPE):  # a node lost with its memory: its buffers, and
                # under fsdp the copies it holds of its predecessor's, once the snapshot
                # before this step has gone out (its copy to the successor, its rows)
                memory = ctx.snapshots.memory.pair  # the tier's buffers
                memory.finish()
                ring = memory.ring
                for path in [*memory.paths, *(ring.paths if ring is not None else ())]:
                    path.unlink(missing_ok=True)
            (ctx.out_dir / "killed").write_text(f"{time.time()!r}\n")
            os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------ the loop


def steps_seen(out: pathlib.Path, ranks: str = "*") -> list[tuple[float, int, int]]:
    """(time, step, restart) of every step the ranks finished, in time order."""
    seen = []
    for path in out.glob(f"steps-rank{ranks}.txt"):
        for line in path.read_text().splitlines():
            when, step, restart = line.split()
            seen.append((float(when), int(step), int(restart)))
    return sorted(seen)


class KillLoop:
    def __init__(self, args, tmp: pathlib.Path):
        self.args, self.tmp = args, tmp
        self.rng = random.Random(args.seed)
        if args.launcher == "torchrun":
            start = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                     "--max-restarts", "3", str(BIN / "engine-run")]
        else:  # engine-run's own launcher restarts the workers (--max-restarts)
            start = [str(BIN / "engine-run"), "--nproc", "2", "--max-restarts", "3"]
        self.train = [*start, args.recipe, f"epochs={args.epochs}",
                      f"checkpoint.memory_every_steps={args.memory_every_steps}",
                      *args.overrides, "-p", PLUGIN]
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH")]))}
        self.problems: list[str] = []

    def run_once(self, out: pathlib.Path, **env: str) -> dict | None:
        proc = subprocess.run([*self.train, f"out_dir={out}"], cwd=REPO,
                              env={**self.env, **env}, capture_output=True, text=True,
                              timeout=self.args.timeout_s)
        try:
            summary = json.loads((out / "summary.json").read_text())
        except (OSError, ValueError):
            summary = None
        if proc.returncode != 0 or summary is None:
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            self.problems.append(f"{out.name}: exit {proc.returncode}: {last}")
            return None
        return summary

    def kill(self, trial: int, reference: str, total_steps: int) -> dict | None:
        out = self.tmp / f"kill{trial}"
        step, rank = self.rng.randint(2, total_steps - 1), self.rng.randrange(2)
        wiped = trial in self.args.wipe
        summary = self.run_once(out, **{KILL_STEP: str(step), KILL_RANK: str(rank),
                                        **({WIPE: "1"} if wiped else {})})
        if summary is None:
            return None
        if not (out / "killed").exists():
            self.problems.append(f"kill {trial}: rank {rank} was not killed at step {step}")
            return None
        killed_at = float((out / "killed").read_text())
        seen = steps_seen(out)
        reached = max(s for _, s, restart in seen if restart == 0)
        first = next((t, s) for t, s, restart in seen if restart > 0)
        resumed_at = first[1] - 1
        started, set_up = min(tuple(map(float, line.split())) for path in out.glob(
            "started-rank*.txt") for line in path.read_text().splitlines())
        result = {"step": step, "rank": rank, "wiped": wiped,
                  "resume": summary.get("resume") or {},
                  "recomputed": reached - resumed_at, "kill_to_step_s": first[0] - killed_at,
                  "kill_to_process_s": started - killed_at,
                  "kill_to_set_up_s": set_up - killed_at,
                  "identical": summary["weights_sha256"] == reference,
                  "phases": self.phases_after(out, killed_at)}
        self.check(trial, result)
        return result

    @staticmethod
    def phases_after(out: pathlib.Path, killed_at: float) -> dict[str, float]:
        """Seconds from the kill to the end of each start-up phase of the restarted
        workers (engine/phases.py), the later rank's: the first step needs them all."""
        ends: dict[str, float] = {}
        for path in out.glob("phases-rank*.json"):
            for name, when in json.loads(path.read_text()):
                ends[name] = max(ends.get(name, 0.0), when - killed_at)
        return ends

    def check(self, trial: int, r: dict) -> None:
        wrong = []
        if not r["identical"]:
            wrong.append("final weights differ from the uninterrupted run's")
        if r["recomputed"] > self.args.memory_every_steps:
            wrong.append(f"{r['recomputed']} steps recomputed > memory_every_steps")
        if r["wiped"] and r["resume"].get("tier") != "peer":
            wrong.append(f"its memory wiped, it resumed from {r['resume'].get('tier')}, "
                         "not from a peer's copy")
        if r["resume"].get("steps_lost") != r["recomputed"]:
            wrong.append(f"summary.json says {r['resume'].get('steps_lost')} steps lost, "
                         f"the steps say {r['recomputed']}")
        if wrong:
            self.problems.append(f"kill {trial} (rank {r['rank']} at step {r['step']}): "
                                 + "; ".join(wrong))

    def main(self) -> int:
        args, started = self.args, time.monotonic()
        reference_out = self.tmp / "reference"
        summary = self.run_once(reference_out)
        if summary is None:
            print(f"the uninterrupted run failed: {self.problems[-1]}")
            return 1
        reference, total_steps = summary["weights_sha256"], summary["global_step"]
        times = [t for t, _, _ in steps_seen(reference_out, ranks="0")]
        step_s = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
        print(f"uninterrupted: {total_steps} steps, a step every {step_s * 1000:.0f} ms "
              f"(median), {time.monotonic() - started:.0f}s", flush=True)
        results = []
        for trial in range(1, args.kills + 1):
            r = self.kill(trial, reference, total_steps)
            if r is not None:
                results.append(r)
                tier = r["resume"].get("tier")
                print(f"kill {trial}/{args.kills}: rank {r['rank']} at step {r['step']}"
                      f"{' (its memory wiped)' if r['wiped'] else ''} -> "
                      f"resumed from {tier} at step {r['resume'].get('step')}, "
                      f"{r['recomputed']} step(s) recomputed, kill -> first new step "
                      f"{r['kill_to_step_s']:.2f}s (new worker process "
                      f"{r['kill_to_process_s']:.2f}s, set up and resumed "
                      f"{r['kill_to_set_up_s']:.2f}s), weights "
                      f"{'identical' if r['identical'] else 'DIFFER'}", flush=True)
            else:
                print(f"kill {trial}/{args.kills}: failed ({self.problems[-1]})", flush=True)
        for problem in self.problems:
            print(f"problem: {problem}")
        def spread(key: str) -> str:
            values = [r[key] for r in results] or [float("nan")]
            return f"median {statistics.median(values):.2f}s max {max(values):.2f}s"

        tiers = {}
        for r in results:
            tiers[r["resume"].get("tier")] = tiers.get(r["resume"].get("tier"), 0) + 1
        print(f"total: {args.kills} kills (memory_every_steps={args.memory_every_steps}, "
              f"{pathlib.Path(args.recipe).name}, {total_steps} steps), "
              f"{sum(r['identical'] for r in results)}/{args.kills} bit-identical, steps "
              f"recomputed max {max((r['recomputed'] for r in results), default=0)}, "
              f"kill -> first new step {spread('kill_to_step_s')} (-> new worker "
              f"process {spread('kill_to_process_s')}, -> set up and resumed "
              f"{spread('kill_to_set_up_s')}), resumed from "
              f"{', '.join(f'{t} {n}' for t, n in sorted(tiers.items(), key=str))}, "
              f"{len(self.problems)} problem(s), {time.monotonic() - started:.0f}s",
              flush=True)
        # Where the time goes: the median end of each phase after the kill, in order.
        names = list(dict.fromkeys(n for r in results for n in r["phases"]))
        ends = [(n, statistics.median(r["phases"][n] for r in results if n in r["phases"]))
                for n in names]
        ends.append(("first new step", statistics.median(
            [r["kill_to_step_s"] for r in results] or [float("nan")])))
        print("where the time goes (median seconds after the kill at which each phase of "
              "the restarted workers ended, the later rank's): " + ", ".join(
                  f"{n} {t:.2f}" for n, t in ends), flush=True)
        return 0 if not self.problems and len(results) == args.kills else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--wipe", type=lambda text: {int(k) for k in text.split(",") if k},
                   default=set(), metavar="K,...",
                   help="these kills (1 = the first) also delete the killed rank's memory "
                        "snapshots, and under fsdp the copies it holds: a node lost with "
                        "its memory, which must resume from a peer's copy")
    p.add_argument("--launcher", choices=("torchrun", "spawn"), default="torchrun",
                   help="who restarts the workers: torchrun --max-restarts 3, or "
                        "engine-run's spawn launcher with --max-restarts 3")
    p.add_argument("--memory-every-steps", type=int, default=1)
    p.add_argument("--recipe", default=str(REPO / "tests" / "recipes" / "tiny_resume.py"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=None, help="of the kills' steps and ranks")
    p.add_argument("--timeout-s", type=float, default=600, help="per run")
    p.add_argument("overrides", nargs="*", help="more config overrides (key=value)")
    args = p.parse_args(argv)
    if args.kills < 1 or args.memory_every_steps < 1 or args.epochs < 1:
        p.error("--kills, --memory-every-steps and --epochs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="memory-kill-loop-") as tmp:
        return KillLoop(args, pathlib.Path(tmp)).main()


if __name__ == "__main__":
    sys.exit(main())
