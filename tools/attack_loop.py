#!/usr/bin/env python3
"""Attack loops of issues 16 and 30, on real 2-process runs of tests/recipes/tiny_resume.py:

- ``--kills N``: SIGKILL the whole run (``kill -9 -- -PGID``: launcher and workers) right
  after it wrote a snapshot, while the next ones are being written (a snapshot every
  step), start it again, and again: after every kill the newest good snapshot must
  verify and load. Kills come in chains of ``--chain`` on one out_dir; each chain then
  runs to the end, and its final weights must equal an uninterrupted run's (a wrong
  resume anywhere in the chain changes them).
- ``--memory-kills N``: the same chains with in-memory snapshots every step
  (``checkpoint.memory_every_steps=1``, disk snapshots at epoch ends) and a snapshot
  made large by ``--ballast-mb`` (tests/ballast_plugin.py), so that much of a step is
  the copy into shared memory: the run SIGKILLed at a random moment after a new memory
  snapshot, started again... After every kill each rank's newest valid buffer must
  load whole (an unusable snapshot otherwise); each chain's final weights must equal
  the uninterrupted run's (a wrong resume otherwise).
- ``--group-signals M``: SIGUSR1 to the whole process group mid-run (what SLURM's
  ``--signal=USR1@90`` without ``B:``, its time-limit SIGTERM and ``kill -- -PGID`` do):
  the run must stop with exit 75 after exactly one pre-emption, nothing killed, no
  traceback; started again it must finish with the uninterrupted run's weights.
- ``--concurrent-starts K``: a second engine-run on the out_dir of a run that is
  training (paused meanwhile, so that it cannot finish first): it must be refused
  (exit 2, one line, no traceback) and the first must finish untouched (the
  uninterrupted run's weights and metrics.csv rows).
- ``--stopped-ranks S``: under each launcher of ``--launchers`` (spawn, torchrun, srun;
  srun only where a SLURM cluster answers), S runs in which a random rank SIGSTOPs
  itself at a random step (tests/fault_plugin.py): the job must end, naming that rank,
  within ``--timeout-s`` + 5 s of the stop (to its last line of output; the launcher's
  own exit comes after it, reported apart).

    python tools/attack_loop.py --kills 200 --group-signals 20
    python tools/attack_loop.py --kills 30 --checkpointer async --group-signals 0
    python tools/attack_loop.py --kills 0 --group-signals 0 --memory-kills 20
    python tools/attack_loop.py --kills 0 --group-signals 0 --concurrent-starts 3 \
        --stopped-ranks 3

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
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "tests" / "recipes" / "tiny_resume.py")
BIN = pathlib.Path(sys.executable).parent
ENGINE_RUN = str(BIN / "engine-run")
#: How each launcher starts the 2 ranks of a stopped-rank run.
LAUNCHES = {
    "spawn": [],
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
    "srun": ["srun", "-N1", "-n2", "-c1"],
}
#: The stopped-rank bound: timeout_s plus this, from the stop to the job's last line.
STOP_SLACK_S = 5.0


class Loop:
    def __init__(self, args, tmp: pathlib.Path):
        self.args, self.tmp = args, tmp
        self.train = [RECIPE, f"epochs={args.epochs}", "checkpoint.every_steps=1",
                      "checkpoint.keep_last=2", f"checkpointer={args.checkpointer}",
                      "--nproc", str(args.nproc), "--threads", "1"]
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
                    "ENGINE_BALLAST_MB": f"{args.ballast_mb:g}",
                    "PYTHONPATH": os.pathsep.join(filter(None, [
                        str(REPO), os.environ.get("PYTHONPATH")]))}
        self.problems: list[str] = []
        self.started = time.monotonic()

    # ------------------------------------------------------------------ runs

    def start(self, out: pathlib.Path, train=None) -> subprocess.Popen:
        # A session of its own: its process group is the run's launcher and workers.
        return subprocess.Popen([ENGINE_RUN, *(train or self.train), f"out_dir={out}"],
                                cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    def finish(self, out: pathlib.Path, train=None) -> subprocess.CompletedProcess:
        return subprocess.run([ENGINE_RUN, *(train or self.train), f"out_dir={out}"],
                              cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=900)

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
        return self.wait_until(proc, lambda: self.latest_pointer(out) not in (None, before),
                               f"{out}: no new snapshot", poll_s=0.05)

    def wait_until(self, proc, condition, problem: str, poll_s: float = 0.02) -> bool:
        """True once ``condition()``; False if the run ended first, or (a problem) if
        600 s went by."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if condition():
                return True
            if proc.poll() is not None:
                return False
            time.sleep(poll_s)
        self.problems.append(f"{problem} within 600 s")
        return False

    def kill_after(self, proc, ready, problem: str, rng) -> str | None:
        """SIGKILL the run's process group (launcher and workers) at a random moment
        within ``--kill-window`` s after ``ready()``; its stdout, or None when it ended
        first."""
        if not self.wait_until(proc, ready, problem):
            proc.communicate(timeout=300)
            return None
        time.sleep(rng.uniform(0.0, self.args.kill_window))
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate(timeout=120)[0]
        # A run that trained its last epoch within the window (its line printed, the
        # kill at most in its teardown) was not killed mid-run: its ranks remove their
        # memory snapshots once their part of the last snapshot is durable, which is no
        # torn buffer (a restart then resumes from a peer's or from disk).
        last = f"epoch {self.args.epochs}/{self.args.epochs} "
        finished = proc.returncode == 0 or any(line.startswith(("done: ", last))
                                               for line in out.splitlines())
        return None if finished else out

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
            moved = lambda: self.latest_pointer(out) not in (None, before)
            if self.kill_after(proc, moved, f"{out}: no new snapshot", rng) is None:
                break  # the run ended (completed) before it could be killed
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

    # ----------------------------------------------------------- memory kills

    def memory_train(self) -> list[str]:
        """tiny_resume with a memory snapshot every step, on disk at epoch ends only,
        made large by the ballast part (tests/ballast_plugin.py)."""
        return [RECIPE, f"epochs={self.args.epochs}", "checkpoint.memory_every_steps=1",
                "checkpoint.keep_last=2", f"checkpointer={self.args.checkpointer}",
                "--nproc", str(self.args.nproc), "--threads", "1",
                "-p", "tests.ballast_plugin"]

    @staticmethod
    def newest_memory_step(out: pathlib.Path) -> int:
        """The newest memory snapshot's step on rank 0 (its header only), -1 if none."""
        from engine.memory import buffer, files

        slots = [buffer.check_slot(p, verify=False)[0]
                 for p in files.buffer_paths(out, 0)]
        return max((s.step for s in slots if s is not None), default=-1)

    def check_memory_buffers(self, where: str, out: pathlib.Path) -> tuple[int, int]:
        """After a kill: every rank's newest valid buffer loads whole (its ballast all of
        its step). Returns (buffers found torn by the kill, unusable ranks)."""
        from engine.memory import buffer, files

        torn = unusable = 0
        for rank in range(self.args.nproc):
            paths = files.buffer_paths(out, rank)
            # A buffer with our magic but no valid snapshot: the kill was in its copy.
            torn += sum(1 for p in paths if buffer.read_info(p)
                        and buffer.check_slot(p)[0] is None)
            slot = buffer.newest(paths)
            try:
                snap = buffer.load_slot(slot)
                ballast = snap["ballast"]
                assert int(snap["step"]) == slot.step == ballast["step"], "steps differ"
                assert bool((ballast["tensor"] == float(slot.step)).all()), "ballast torn"
            except Exception as exc:
                unusable += 1
                self.problems.append(f"{where}: rank {rank}'s newest memory snapshot is "
                                     f"unusable: {type(exc).__name__}: {exc}")
        return torn, unusable

    def memory_kill_chain(self, chain: int, kills_left: int, reference: str) -> int:
        out = self.tmp / f"memory{chain}"
        train, rng = self.memory_train(), random.Random()
        kills = 0
        while kills < min(self.args.chain, kills_left):
            before = self.newest_memory_step(out)
            proc = self.start(out, train)
            moved = lambda: self.newest_memory_step(out) > before
            said = self.kill_after(proc, moved, f"{out}: no new memory snapshot", rng)
            if said is None:
                break  # the run ended (completed) before it could be killed
            self.memory_resumes += "resumed from memory at step" in said
            kills += 1
            torn, unusable = self.check_memory_buffers(f"memory chain {chain}, kill {kills}",
                                                       out)
            self.memory_torn += torn
            self.unusable += unusable
        done = self.finish(out, train)
        self.memory_resumes += "resumed from memory at step" in done.stdout
        if done.returncode != 0:
            self.problems.append(f"memory chain {chain}: the resumed run failed: "
                                 f"{(done.stderr.strip().splitlines() or [''])[-1]}")
        elif self.digest(out) != reference:
            self.wrong_resumes += 1
            self.problems.append(f"memory chain {chain}: final weights differ from the "
                                 "uninterrupted run's (a wrong resume)")
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

    # ------------------------------------------------------- concurrent starts

    def concurrent_start(self, trial: int, reference: str) -> None:
        out = self.tmp / f"concurrent{trial}"
        first = self.start(out)
        if not self.wait_for_new_snapshot(first, out, None):
            self.problems.append(f"concurrent {trial}: the first run ended before the "
                                 "second started")
            first.communicate(timeout=300)
            return
        # The first is paused while the second starts (its lock is held all the same):
        # a short first run could otherwise finish before the second got going.
        os.killpg(first.pid, signal.SIGSTOP)
        try:
            second = subprocess.run([ENGINE_RUN, *self.train, f"out_dir={out}"], cwd=REPO,
                                    env=self.env, capture_output=True, text=True,
                                    timeout=300)
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        lines = second.stderr.strip().splitlines()
        wrong = []
        if second.returncode != 2:
            wrong.append(f"the second exited {second.returncode} (not 2)")
        if not any("is in use by another run" in line for line in lines):
            wrong.append("no line says the out_dir is in use")
        if "Traceback" in second.stderr:
            wrong.append("the second printed a traceback")
        try:
            _, err = first.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            _, err = self.stop(first)
            wrong.append("the first did not end within 900 s")
        if first.returncode != 0:
            wrong.append(f"the first exited {first.returncode}: "
                         f"{(err.strip().splitlines() or [''])[-1]}")
        elif self.digest(out) != reference:
            wrong.append("the first's final weights differ from the uninterrupted run's")
        if sorted(self.logged(out)) != sorted(self.logged(self.tmp / "reference")):
            wrong.append("metrics.csv has other rows than the uninterrupted run's (a "
                         "metric logged twice, or missing)")
        if wrong:
            self.problems.append(f"concurrent {trial}: {'; '.join(wrong)}")

    @staticmethod
    def logged(out: pathlib.Path) -> list[tuple[str, str, str]]:
        """(step, epoch, name) of every row of metrics.csv, in order."""
        try:
            rows = (out / "metrics.csv").read_text().splitlines()[1:]
        except OSError:
            return []
        return [tuple(row.split(",", 3)[:3]) for row in rows]

    # ----------------------------------------------------------- stopped ranks

    def stopped_rank(self, launcher: str, trial: int) -> tuple[float, float] | None:
        """One run under ``launcher`` whose random rank stops itself at a random step:
        (seconds from the stop to the job's last line, to the launcher's exit)."""
        out = self.tmp / f"stopped-{launcher}{trial}"
        marker = self.tmp / f"stopped-{launcher}{trial}.marker"
        rank, step = random.randrange(2), random.randint(2, 5)
        env = {**self.env, "ENGINE_FAULT_ACTION": "stop", "ENGINE_FAULT_STEP": str(step),
               "ENGINE_FAULT_RANK": str(rank), "ENGINE_FAULT_ONCE": str(marker)}
        job_name = f"attack-loop-{os.getpid()}-{trial}"  # srun: for scancel
        launch = [*LAUNCHES[launcher], *(["-J", job_name] if launcher == "srun" else [])]
        cmd = [*launch, ENGINE_RUN, RECIPE, f"out_dir={out}", "epochs=2",
               f"timeout_s={self.args.timeout_s:g}", "-p", "tests.fault_plugin",
               *(["--nproc", "2"] if launcher == "spawn" else [])]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=lambda: lines.extend(
            (time.time(), line) for line in proc.stderr))
        reader.start()
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.problems.append(f"{launcher} {trial}: rank {rank} stopped at step {step}; "
                                 "the job did not end within 300 s")
            return None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # a stopped rank left behind
            if launcher == "srun":  # SLURM's tasks are not in srun's process group
                subprocess.run(["scancel", "--signal=KILL", f"--name={job_name}"],
                               capture_output=True, timeout=60)
            reader.join()
        ended = time.time()
        if not marker.exists():
            self.problems.append(f"{launcher} {trial}: rank {rank} never stopped (exit "
                                 f"{proc.returncode})")
            return None
        stopped = marker.stat().st_mtime
        last_line, end = lines[-1][0] - stopped, ended - stopped
        err = "".join(line for _, line in lines)
        wrong = []
        if proc.returncode == 0:
            wrong.append("exit 0")
        if f"rank(s) {rank} stopped answering" not in err:
            wrong.append(f"rank {rank} is not named")
        if last_line >= self.args.timeout_s + STOP_SLACK_S:
            wrong.append(f"its last line came {last_line:.1f}s after the stop")
        if wrong:
            self.problems.append(f"{launcher} {trial}: rank {rank} stopped at step {step}: "
                                 f"{', '.join(wrong)}")
        return last_line, end

    def stopped_ranks(self) -> list[str]:
        """The stopped-rank attack under every launcher asked for; a line of numbers each."""
        report = []
        for launcher in self.args.launchers.split(","):
            if launcher == "srun" and not slurm_answers():
                report.append("srun: skipped (no SLURM cluster answers here)")
                continue
            times = [t for trial in range(1, self.args.stopped_ranks + 1)
                     if (t := self.stopped_rank(launcher, trial)) is not None]
            print(f"stopped ranks under {launcher}: {len(times)}/{self.args.stopped_ranks} "
                  f"({self.elapsed()}), {len(self.problems)} problem(s)", flush=True)
            if times:
                last, end = zip(*times)
                report.append(
                    f"{launcher}: stop -> last line median {statistics.median(last):.1f}s, "
                    f"max {max(last):.1f}s; -> launcher's exit median "
                    f"{statistics.median(end):.1f}s, max {max(end):.1f}s "
                    f"(timeout_s={self.args.timeout_s:g}, {len(times)} runs)")
        return report

    # ------------------------------------------------------------------ main

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.0f}s"

    def chains(self, what: str, wanted: int, one_chain, reference: str) -> tuple[int, int]:
        """``one_chain(chain, kills left, reference)`` until ``wanted`` kills landed:
        (kills, chains)."""
        kills = chain = 0
        while kills < wanted:
            chain += 1
            got = one_chain(chain, wanted - kills, reference)
            kills += got
            print(f"{what}: {kills}/{wanted} ({self.elapsed()}), "
                  f"{len(self.problems)} problem(s)", flush=True)
            if got == 0:
                self.problems.append(f"{what}, chain {chain}: no kill landed (the run is "
                                     "too short: raise --epochs)")
                break
        return kills, chain

    def run(self) -> int:
        args = self.args
        self.mid_write = self.memory_torn = self.memory_resumes = 0
        self.unusable = self.wrong_resumes = 0
        reference = None
        if args.kills or args.group_signals or args.concurrent_starts or args.memory_kills:
            reference = self.reference()
            print(f"reference run done ({self.elapsed()})", flush=True)
        kills, chain = self.chains("kills", args.kills, self.kill_chain, reference)
        memory_kills, memory_chain = self.chains("memory kills", args.memory_kills,
                                                 self.memory_kill_chain, reference)
        for trial in range(1, args.group_signals + 1):
            self.group_signal(trial, reference)
            print(f"group signals: {trial}/{args.group_signals} ({self.elapsed()}), "
                  f"{len(self.problems)} problem(s)", flush=True)
        for trial in range(1, args.concurrent_starts + 1):
            self.concurrent_start(trial, reference)
            print(f"concurrent starts: {trial}/{args.concurrent_starts} ({self.elapsed()}), "
                  f"{len(self.problems)} problem(s)", flush=True)
        timings = self.stopped_ranks() if args.stopped_ranks else []
        for problem in self.problems:
            print(f"problem: {problem}", flush=True)
        for line in timings:
            print(f"stopped rank, {line}", flush=True)
        print(f"total: {kills} kills in {chain} chain(s) ({self.mid_write} with a snapshot "
              f"being written), {memory_kills} memory kills in {memory_chain} chain(s) "
              f"({self.memory_torn} buffer(s) torn by the kill, {self.unusable} unusable "
              f"snapshot(s), {self.memory_resumes} resume(s) from memory, "
              f"{self.wrong_resumes} wrong resume(s)), "
              f"{args.group_signals} group signals ({args.signal}), "
              f"{args.concurrent_starts} concurrent starts, {args.stopped_ranks} stopped "
              f"rank(s) per launcher, {len(self.problems)} problem(s), {self.elapsed()}",
              flush=True)
        return 0 if not self.problems else 1


def slurm_answers() -> bool:
    """Whether srun can start a job here: SLURM installed and a node idle or mixed."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True,
                                text=True, timeout=15).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in ("idle", "mix") for state in states)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--group-signals", type=int, default=20)
    p.add_argument("--memory-kills", type=int, default=0,
                   help="kills with in-memory snapshots every step, much of it the copy")
    p.add_argument("--ballast-mb", type=float, default=32,
                   help="--memory-kills: MB per rank added to the snapshot")
    p.add_argument("--chain", type=int, default=10,
                   help="kills on one out_dir before it runs to the end and is compared")
    p.add_argument("--kill-window", type=float, default=0.3,
                   help="seconds after a new snapshot within which the kill falls")
    p.add_argument("--signal", default="SIGUSR1", choices=["SIGUSR1", "SIGTERM"])
    p.add_argument("--checkpointer", default="torch-file", choices=["torch-file", "async"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--epochs", type=int, default=8, help="of the tiny recipe (6 steps each)")
    p.add_argument("--concurrent-starts", type=int, default=0)
    p.add_argument("--stopped-ranks", type=int, default=0, help="runs per launcher")
    p.add_argument("--launchers", default="spawn,torchrun,srun",
                   help="comma-separated, of: " + ", ".join(LAUNCHES))
    p.add_argument("--timeout-s", type=float, default=4.0,
                   help="the stopped-rank runs' timeout_s")
    args = p.parse_args(argv)
    if min(args.kills, args.group_signals, args.concurrent_starts, args.stopped_ranks,
           args.memory_kills, args.ballast_mb) < 0:
        p.error("--kills, --memory-kills, --ballast-mb, --group-signals, "
                "--concurrent-starts and --stopped-ranks must be >= 0")
    if args.chain < 1 or args.timeout_s <= 0:
        p.error("--chain must be >= 1 and --timeout-s > 0")
    unknown = set(args.launchers.split(",")) - set(LAUNCHES)
    if unknown:
        p.error(f"--launchers: unknown {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(LAUNCHES)}")
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="attack-loop-") as tmp:
        return Loop(args, pathlib.Path(tmp)).run()


if __name__ == "__main__":
    sys.exit(main())
