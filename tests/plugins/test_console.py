"""plugins/console.py: the epoch lines, the data-wait report and hint, the progress bar,
and the progress lines that stand in for it where stderr is not a terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
import threading

import pytest

from engine.plugins.console import DATA_BOUND, data_wait_text, duration_text
from tests.conftest import ENGINE_RUN, REPO, engine_env, read_summary, run_cli, run_cli_here

#: A recipe whose data loading can be made slow (a sleep per sample) or whose model can
#: be made heavy, to put a run on either side of the data-bound threshold.
RECIPE = '''
import time

import attrs
import torch
from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches


@attrs.define
class Config(TrainConfig):
    epochs: int = 1
    batch_size: int = 8
    samples: int = 48
    delay_s: float = 0.0  # sleep per sample loaded
    width: int = 8
    depth: int = 1
    log_every: int = 1
    val_samples: int = 0


class Samples(torch.utils.data.Dataset):
    def __init__(self, n, delay_s):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.full((4,), float(i % 2)), i % 2


def build_model(cfg):
    layers = [torch.nn.Linear(4, cfg.width)]
    for _ in range(cfg.depth):
        layers += [torch.nn.ReLU(), torch.nn.Linear(cfg.width, cfg.width)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(cfg.width, 2))


def build_datasets(cfg, ctx):
    val = Samples(cfg.val_samples, 0) if cfg.val_samples else None
    return Samples(cfg.samples, cfg.delay_s), val


def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=0.01)
'''


def write_recipe(tmp_path) -> str:
    path = tmp_path / "console_probe.py"
    path.write_text(RECIPE)
    return str(path)


def test_the_wording_on_both_sides_of_the_threshold():
    assert data_wait_text(0.63) == "data-bound: 63% waiting"
    assert data_wait_text(0.04) == "data wait: 4% waiting"
    assert data_wait_text(DATA_BOUND) == "data wait: 30% waiting"  # "more than" 30%


#: A progress line: step, the epochs done, the last logged loss, throughput and ETA.
PROGRESS_LINE = re.compile(r"step (\d+)/(\d+)  epochs (\d+\.\d\d)/(\d+)  loss (\d+\.\d{4})  "
                           r"samples/s (\d+)  eta (\d+s|\d+m\d\ds|\d+h\d\dm|\?)")


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """One data-bound run with its output captured (stderr a pipe, not a terminal, as
    under nohup or SLURM) and a progress line due at every log interval."""
    folder = tmp_path_factory.mktemp("logged")
    recipe = write_recipe(folder)
    out = folder / "run"
    # 20 ms of sleep per sample against a 4-to-8 linear model: nearly all waiting.
    proc = run_cli(recipe, "delay_s=0.02", "console.progress_every_s=0.01", f"out_dir={out}",
                   "--nproc", "1", check=True)
    return recipe, out, proc


def test_a_data_bound_run_says_so_with_a_hint_and_summary_json_agrees(logged_run):
    recipe, out, proc = logged_run
    summary = read_summary(out)
    wait = summary["data_wait_fraction"]
    assert wait > 0.5
    # The whole time from the command's start, and its start-up share (the worker's own
    # wall_time_s once stood for the command's).
    done = re.fullmatch(r"done: 1 epoch in (\d+\.\d)s \(start-up (\d+\.\d)s\), "
                        r"results in (.*)", proc.stdout.splitlines()[-1])
    assert done, proc.stdout
    total, start_up = float(done[1]), float(done[2])
    assert 0 < start_up < total and total >= round(summary["wall_time_s"], 1) - 0.1
    epoch_line = next(l for l in proc.stdout.splitlines() if l.startswith("epoch 1/1"))
    assert epoch_line.endswith(f"data-bound: {wait:.0%} waiting")
    assert (f"hint: the training waits for data (num_workers=0 per process); measure "
            f"better settings with `engine-run tune-workers {recipe}`, or give the job "
            "more CPUs (SLURM: --cpus-per-task)") in proc.stdout


def test_without_a_terminal_progress_lines_replace_the_bar(logged_run):
    _, out, proc = logged_run
    lines = [PROGRESS_LINE.fullmatch(line) for line in proc.stderr.splitlines()
             if line.startswith("step ")]
    assert all(lines) and len(lines) >= 3, proc.stderr
    steps = [int(line[1]) for line in lines]
    assert steps == sorted(set(steps)) and steps[-1] <= 6  # 48 samples, batch 8: 6 steps
    for line in lines:
        step = int(line[1])
        assert (line[2], line[4]) == ("6", "1")  # of the run's 6 steps and 1 epoch
        assert line[3] == f"{step / 6:.2f}"
        assert 0.3 < float(line[5]) < 1.5  # two classes: a loss near ln 2
        assert int(line[6]) > 0
    assert "%|" not in proc.stderr and "\r" not in proc.stderr  # no bar in the log
    assert "step " not in proc.stdout  # the epoch and done lines stay on stdout


def test_the_interval_is_a_described_key_and_a_negative_one_is_refused(tmp_path):
    recipe = write_recipe(tmp_path)
    proc = run_cli_here(recipe, "--dry-run", "-v", check=True)
    assert re.search(r"^  console\.progress_every_s = 30\.0 +\[a number\]  Where stderr is "
                     r"not a terminal .*: a progress line every this many seconds instead of "
                     r"the bar \(0: none\)$", proc.stdout, re.M), proc.stdout
    proc = run_cli_here(recipe, "console.progress_every_s=-1", "--dry-run")
    assert (proc.returncode, proc.stderr) == (2, (
        "engine-run: error: config key 'console.progress_every_s': '-1' is not allowed: "
        "give the seconds between two progress lines, or 0 for none\n"))


def test_durations_read_as_an_eta():
    assert [duration_text(s) for s in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s",
                                                                  "2h07m"]


def test_a_compute_bound_run_gets_no_hint(tmp_path):
    recipe = write_recipe(tmp_path)
    out = tmp_path / "run"
    # In-memory samples against five 512-wide layers on a batch of 64: mostly compute.
    proc = run_cli(recipe, "samples=256", "batch_size=64", "width=512", "depth=4",
                   f"out_dir={out}", "--nproc", "1", check=True)
    wait = read_summary(out)["data_wait_fraction"]
    assert wait < DATA_BOUND
    assert f"data wait: {wait:.0%} waiting" in proc.stdout
    assert "hint:" not in proc.stdout


def test_a_step_validation_reads_as_an_epoch_line(tmp_path):
    """val/accuracy is ``val acc 50.00%`` in a validation's line inside an epoch as in the
    epoch's line (it was ``val accuracy 0.5000`` there), and one epoch is "1 epoch"."""
    recipe = write_recipe(tmp_path)
    proc = run_cli(recipe, "samples=32", "val_samples=8", "val_every_steps=2",
                   f"out_dir={tmp_path / 'run'}", "--nproc", "1", check=True)
    lines = proc.stdout.splitlines()
    step = next(line for line in lines if line.startswith("step 2 "))
    epoch = next(line for line in lines if line.startswith("epoch 1/1"))
    assert re.fullmatch(r"step 2 \(epoch 1/1\)  val loss \d\.\d{4}  val acc \d+\.\d\d%", step)
    assert re.search(r"  val loss \d\.\d{4}  val acc \d+\.\d\d%  ", epoch), epoch
    assert lines[-1].startswith("done: 1 epoch in "), lines


def run_on_a_terminal(args, env, timeout=240) -> str:
    """Run engine-run with stderr on a pseudo-terminal (tqdm draws its bar only on a
    terminal); returns what the terminal showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    shown = bytearray()

    def read():
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the other side closed
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([ENGINE_RUN, *args], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=slave, timeout=timeout)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    assert proc.returncode == 0, shown.decode(errors="replace")
    return shown.decode(errors="replace")


def test_the_progress_bar_shows_loss_speed_and_data_wait(tmp_path):
    recipe = write_recipe(tmp_path)
    out = tmp_path / "run"
    shown = run_on_a_terminal([recipe, "delay_s=0.01", "epochs=2", f"out_dir={out}",
                               "console.progress_every_s=0.01", "--nproc", "1",
                               "checkpoint.memory_every_steps=0"],
                              env=engine_env())
    wait = read_summary(out)["data_wait_fraction"]  # the last epoch's
    assert "console_probe:" in shown and ("step/s" in shown or "s/step" in shown)
    assert "loss=" in shown and "samples/s=" in shown
    assert f"data_wait={wait:.0%}" in shown
    # On a terminal the bar is the progress: no plain lines, however often they were due.
    assert not PROGRESS_LINE.search(shown)


def test_progress_lines_count_to_max_steps_where_it_ends_the_run(tmp_path):
    """6 steps in the epoch, max_steps=4: the lines say 'of 4' (an ETA of the steps left
    until 4), not of the epochs' 6."""
    proc = run_cli(write_recipe(tmp_path), "delay_s=0.02", "console.progress_every_s=0.01",
                   "max_steps=4", f"out_dir={tmp_path / 'run'}", "--nproc", "1", check=True)
    lines = [PROGRESS_LINE.fullmatch(line) for line in proc.stderr.splitlines()
             if line.startswith("step ")]
    assert lines and all(lines), proc.stderr
    assert {line[2] for line in lines} == {"4"}
    assert all(int(line[1]) <= 4 for line in lines)
