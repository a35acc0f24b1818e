#!/usr/bin/env python3
"""Attack loops of issue 16, on real 2-process runs of tests/recipes/tiny_resume.py:

- ``--kills N``: SIGKILL the whole run (``kill -9 -- -PGID``: launcher and workers) right
  after it wrote a snapshot, while the next ones are being written (a snapshot every
  step), start it again, and again: after every kill the newest good snapshot must
  verify and load. Kills come in chains of ``--chain`` on one out_dir; each chain then
  runs to the end, and its final weights must equal an uninterrupted run's (a wrong
  resume anywhere in the chain changes them).
- ``--group-signals M``: SIGUSR1 to the whole process group mid-run (what SLURM's
  ``--signal=USR1@90`` without ``B:``, its time-limit SIGTERM and ``kill -- -PGID`` do):
  the run must stop with exit 75 after exactly one pre-emption, nothing killed, no
  traceback; started again it must finish with the uninterrupted run's weights.

    python tools/attack_loop.py --kills 200 --group-signals 20
    python tools/attack_loop.py --kills 30 --checkpointer async --group-signals 0

One line per problem and a progress line per chain / trial (so a loop stopped early still
says how far it got), then the totals. Exit status 0 when nothing went wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
ENGINE_RUN = str(pathlib.Path(sys.executable).parent / "engine-run")


class Loop:
    def __init__(self, args, tmp: pathlib.Path):
        self.args, self.tmp = args, tmp
        self.train = [RECIPE, f"epochs={args.epochs}", "checkpoint.every_steps=1",
                      "checkpoint.keep_last=2", f"checkpointer={args.checkpointer}",
                      "--nproc", str(args.nproc), "--threads", "1"]
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO), os.environ.get("PYTHONPATH")]))}
        self.problems: list[str] = []
        self.started = time.monotonic()

    # ------------------------------------------------------------------ runs

    def start(self, out: pathlib.Path) -> subprocess.Popen:
        # A session of its own: its process group is the run's launcher and workers.
        return subprocess.Popen([ENGINE_RUN, *self.train, f"out_dir={out}"], cwd=REPO,
                                env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def finish(self, out: pathlib.Path) -> subprocess.CompletedProcess:
        return subprocess.run([ENGINE_RUN, *self.train, f"out_dir={out}"], cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=900)

    def reference(self) -> str:
        out = self.tmp / "reference"
        proc = self.finish(out)
        if proc.returncode != 0:
            sys.exit(f"the uninterrupted reference run failed: {proc.stderr[-2000:]}")
        return self.digest(out)

    @staticmethod
    def digest(out: pathlib.Path) -> str | None:
        try:
            return json.loads((out / "summary.json").read_text()).get("weights_sha256")
        except (OSError, ValueError):
            return None

    @staticmethod
    def latest_pointer(out: pathlib.Path) -> str | None:
        try:
            return (out / "checkpoints" / "latest").read_text().strip()
        except OSError:
            return None

    def wait_for_new_snapshot(self, proc, out: pathlib.Path, before: str | None) -> bool:
        """True once ``latest`` moved past ``before``; False if the run ended first."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            now = self.latest_pointer(out)
            if now is not None and now != before:
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.05)
        self.problems.append(f"{out}: no new snapshot within 600 s")
        return False

    @staticmethod
    def stop(proc) -> tuple[str, str]:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        return out, err

    # ----------------------------------------------------------------- kills

    def kill_chain(self, chain: int, kills_left: int, reference: str) -> int:
        from engine.config import TrainConfig
        from engine.plugins.torch_file import TorchFileCheckpointer

        out = self.tmp / f"kills{chain}"
        rng = random.Random()
        kills = mid_write = 0
        while kills < min(self.args.chain, kills_left):
            before = self.latest_pointer(out)
            proc = self.start(out)
            if not self.wait_for_new_snapshot(proc, out, before):
                proc.communicate(timeout=300)
                break  # the run ended (completed) before it could be killed
            time.sleep(rng.uniform(0.0, self.args.kill_window))
            with contextlib.suppress(ProcessLookupError):  # gone already
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=120)
            kills += 1
            folder = out / "checkpoints"
            mid_write += any(n.startswith(".") for n in os.listdir(folder))
            reader = TorchFileCheckpointer(folder, TrainConfig())
            latest = reader.latest()
            try:
                snap = reader.load(latest)
                int(snap["step"])
            except Exception as exc:
                self.problems.append(f"chain {chain}, kill {kills}: latest {latest} does not "
                                     f"load: {type(exc).__name__}: {exc}")
        done = self.finish(out)
        if done.returncode != 0:
            self.problems.append(f"chain {chain}: the resumed run failed: "
                                 f"{(done.stderr.strip().splitlines() or [''])[-1]}")
        elif self.digest(out) != reference:
            self.problems.append(f"chain {chain}: final weights differ from the "
                                 "uninterrupted run's (a wrong resume)")
        self.mid_write += mid_write
        return kills

    # ----------------------------------------------------------- group signals

    def group_signal(self, trial: int, reference: str) -> None:
        out = self.tmp / f"signal{trial}"
        proc = self.start(out)
        if not self.wait_for_new_snapshot(proc, out, None):
            self.problems.append(f"signal {trial}: the run ended before the signal")
            proc.communicate(timeout=300)
            return
        time.sleep(random.uniform(0.0, 0.5))
        os.killpg(proc.pid, getattr(signal, self.args.signal))
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            _, err = self.stop(proc)
            self.problems.append(f"signal {trial}: the run did not stop within 300 s")
            return
        said = [line for line in err.splitlines() if "pre-empted" in line]
        wrong = []
        if proc.returncode != 75:
            wrong.append(f"exit {proc.returncode} (not 75)")
        if len(said) != 1:
            wrong.append(f"{len(said)} pre-emption lines")
        if "killed by" in err or "Traceback" in err:
            wrong.append("a worker was killed or raised")
        if wrong:
            last = (err.strip().splitlines() or [""])[-1]
            self.problems.append(f"signal {trial}: {', '.join(wrong)}; last line: {last}")
            return
        done = self.finish(out)
        if done.returncode != 0 or self.digest(out) != reference:
            self.problems.append(f"signal {trial}: the resumed run failed or its weights "
                                 f"differ (exit {done.returncode})")

    # ------------------------------------------------------------------ main

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.0f}s"

    def run(self) -> int:
        args = self.args
        self.mid_write = 0
        reference = self.reference()
        print(f"reference run done ({self.elapsed()})", flush=True)
        kills = chain = 0
        while kills < args.kills:
            chain += 1
            got = self.kill_chain(chain, args.kills - kills, reference)
            kills += got
            print(f"kills: {kills}/{args.kills} ({self.elapsed()}), "
                  f"{len(self.problems)} problem(s)", flush=True)
            if got == 0:
                self.problems.append(f"chain {chain}: no kill landed (the run is too short: "
                                     "raise --epochs)")
                break
        for trial in range(1, args.group_signals + 1):
            self.group_signal(trial, reference)
            print(f"group signals: {trial}/{args.group_signals} ({self.elapsed()}), "
                  f"{len(self.problems)} problem(s)", flush=True)
        for problem in self.problems:
            print(f"problem: {problem}", flush=True)
        print(f"total: {kills} kills in {chain} chain(s) ({self.mid_write} with a snapshot "
              f"being written), {args.group_signals} group signals ({args.signal}), "
              f"{len(self.problems)} problem(s), {self.elapsed()}", flush=True)
        return 0 if not self.problems else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--group-signals", type=int, default=20)
    p.add_argument("--chain", type=int, default=10,
                   help="kills on one out_dir before it runs to the end and is compared")
    p.add_argument("--kill-window", type=float, default=0.3,
                   help="seconds after a new snapshot within which the kill falls")
    p.add_argument("--signal", default="SIGUSR1", choices=["SIGUSR1", "SIGTERM"])
    p.add_argument("--checkpointer", default="torch-file", choices=["torch-file", "async"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8, help="of the tiny recipe (6 steps each)")
    args = p.parse_args(argv)
    if args.kills < 0 or args.group_signals < 0 or args.chain < 1:
        p.error("--kills and --group-signals must be >= 0, --chain >= 1")
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="attack-loop-") as tmp:
        return Loop(args, pathlib.Path(tmp)).run()


if __name__ == "__main__":
    sys.exit(main())
