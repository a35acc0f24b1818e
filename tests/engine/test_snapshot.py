"""Exact resume: a run killed with SIGKILL and started again ends with the same weights
as a run that was never interrupted (bit-identical weights_sha256)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from tests.conftest import REPO, engine_env, read_summary, run_cli
from tests.engine.conftest import RESUME_BASE, RESUME_RECIPE
from tests.engine.memory.test_cost import costs

RECIPE, BASE = RESUME_RECIPE, RESUME_BASE  # the reference fixture's (conftest)
STEPS_PER_EPOCH = 6  # 96 samples, global batch 16
EPOCHS = 3
TORCHRUN = shutil.which("torchrun", path=str(REPO / ".venv" / "bin")) or shutil.which(
    "torchrun")  # ships with torch


def run_object(**names):
    """The run object's names a snapshot layer reads, and where its tier records."""
    from types import SimpleNamespace

    import torch

    ctx = SimpleNamespace(**{"optimizer": None, "device": torch.device("cpu"), **names},
                          memory_record=None)
    ctx.record_memory = lambda record: setattr(ctx, "memory_record", record)
    return ctx

def mid_epoch_step() -> int:
    rng = random.Random()
    candidates = [s for s in range(5, STEPS_PER_EPOCH * EPOCHS)
                  if s % STEPS_PER_EPOCH and s % 4]  # neither an epoch end nor a snapshot
    return rng.choice(candidates)


# Mid-epoch with 2 processes is covered with loader workers (2, 2, "mid"): the case
# without them adds nothing the 1-process case does not show, at two 2-process runs.
def test_snapshot_policy():
    from engine.config import TrainConfig
    from engine.snapshot import SnapshotPolicy

    cfg = TrainConfig(epochs=5)
    cfg.checkpoint.every_steps, cfg.checkpoint.every_epochs = 4, 2
    policy = SnapshotPolicy(cfg, is_rank0=True)
    assert [s for s in range(1, 13) if policy.due_at_step(s)] == [4, 8, 12]
    assert [e for e in range(1, 6) if policy.due_at_epoch_end(e)] == [2, 4, 5]  # and last
    assert not policy.due_by_time()  # every_minutes=0: never
    cfg.checkpoint.every_minutes = 1e-9
    assert SnapshotPolicy(cfg, is_rank0=True).due_by_time()
    assert not SnapshotPolicy(cfg, is_rank0=False).due_by_time()  # rank 0's clock decides


@pytest.mark.parametrize("every_steps, memory_every, first", [
    (4, 3, 1), (4, 3, 6), (0, 5, 1), (6, 0, 8), (0, 0, 1)])
def test_the_snapshot_layer_asks_for_a_snapshot_exactly_at_the_due_steps(
        tmp_path, every_steps, memory_every, first):
    """The loop tells the snapshot layer each step's end (step_ended), which looks no
    further than its next_due step, to cost nothing where no snapshot is due; it must
    still look at every step a disk or memory snapshot is due at, from the run's first
    step or a resumed one, and at every step after a check point's time flag. The loop's
    finish_check, called before any snapshot, answers "pre-empted" here, so that the
    layer's decisions are all that is recorded."""
    from types import SimpleNamespace

    from engine.config import TrainConfig
    from engine.memory import MemoryTier
    from engine.memory.pair import MemorySnapshots
    from engine.snapshot import Snapshots
    from engine.world import World

    cfg = TrainConfig(epochs=1)
    cfg.checkpoint.every_steps = every_steps
    ctx = run_object(cfg=cfg, is_rank0=True)
    memory = (MemoryTier(ctx, MemorySnapshots(
        tmp_path, World(rank=0, local_rank=0, world_size=1, local_world_size=1),
        memory_every, run_id="0" * 32, shm=tmp_path)) if memory_every else None)
    asked = []
    layer = Snapshots(ctx, finish_check=lambda: asked.append(step) or True, memory=memory)
    for step in range(first, 31):
        layer.step_ended(step)
    assert asked == [s for s in range(first, 31) if (every_steps and s % every_steps == 0)
                     or (memory_every and s % memory_every == 0)]
    asked.clear()
    step = 31  # finish_check records it
    layer.step_ended(step, new_best=True)  # a validation's new best: to disk, due or not
    layer.agreed(due_by_time=True, memory_failed=False)  # a check point said so
    for step in (32, 33):
        layer.step_ended(step)
    assert asked == [31, 32, 33]  # until a snapshot to disk is written


def auto_layers(tmp_path, ranks: int = 2):
    """A snapshot layer per rank at memory_every_steps=auto, each with its real memory
    tier (nothing written: the loop's finish_check answers "pre-empted"), and the steps
    each layer asked for a snapshot at."""
    from types import SimpleNamespace

    from engine.config import TrainConfig
    from engine.memory import MemoryTier
    from engine.memory.pair import MemorySnapshots
    from engine.snapshot import Snapshots
    from engine.world import World

    cfg = TrainConfig(epochs=1)
    assert cfg.checkpoint.memory_every_steps == "auto"  # the default
    layers, asked = [], [[] for _ in range(ranks)]
    for rank in range(ranks):
        ctx = run_object(cfg=cfg, is_rank0=rank == 0, options={},
                         state=SimpleNamespace(step=0))
        memory = MemoryTier(ctx, MemorySnapshots(
            tmp_path, World(rank=rank, local_rank=rank, world_size=ranks,
                            local_world_size=ranks), 1, run_id="0" * 32, shm=tmp_path))
        layers.append(Snapshots(ctx, memory=memory, finish_check=lambda r=rank: asked[r].append(
            layers[r].ctx.state.step) or True))
    return layers, asked


def test_auto_probes_what_the_clocks_do_not_see_with_one_window_paused(tmp_path):
    """What a snapshot's clocks miss (a background copy taking the step's CPUs) is
    measured once: after the first snapshot's window, a window with a snapshot at every
    step, then one with the tier paused (no snapshot asked for); their difference per
    step, beyond the clocks, counts with every snapshot from then on. Until then auto
    proposes nothing."""
    from engine.memory.cost import PAUSED, agreed_interval

    (layer,), (asked,) = auto_layers(tmp_path, ranks=1)
    step = 0

    def window(seconds, steps=10):
        nonlocal step
        for step in range(step + 1, step + steps + 1):
            layer.ctx.state.step = step
            if step >= layer.next_due:
                layer.step_ended(step)
        return layer.check_flags(window_s=seconds, window_steps=steps)

    assert agreed_interval(window(1.0)[2:]) is None  # the first snapshot's window
    assert (layer.memory.cost.hidden_s, layer.memory.every_steps) == (None, 1)
    assert agreed_interval(window(2.0)[2:]) is None  # 0.2 s a step, a snapshot each
    assert (layer.memory.cost.hidden_s, layer.memory.every_steps) == (None, PAUSED)
    assert layer.ctx.memory_record["every_steps"] == 1  # not the pause's
    window(1.0)  # paused: 0.1 s a step
    assert asked == list(range(1, 21))  # nothing asked for in the paused window
    assert layer.memory.every_steps == 1
    assert layer.memory.cost.hidden_s == pytest.approx(0.1)  # no clock saw any of it
    window(1.0)
    assert asked == [*range(1, 21), *range(31, 41)]  # every step again
    # Windows at a snapshot every step: 0.2 s a step, their clocks' 0.001 s taken out;
    # without the probe's 0.1 s per snapshot too, a step is 0.1 s.
    costs(layer.memory.cost, snapshot_s=0.001, step_s=0.2)
    assert layer.memory.cost.per_step() == pytest.approx(0.1)
    # (0.001 + 0.1) / (2% of 0.1 s) = 50.5 steps: 64.
    assert layer.memory.cost.every_steps(1) == 64
    assert layer.memory.cost.record(64, True)["snapshot_s"] == pytest.approx(0.101)


def test_ranks_that_propose_different_intervals_take_the_longest_at_the_same_step(tmp_path):
    """memory_every_steps=auto on two ranks whose snapshots cost differently: each
    proposes its own interval in the check point's flags, the all-reduce sums them, and
    both take the longest at the same step, then ask for snapshots at the same steps
    (a memory snapshot is a collective). As intervals change, the steps between two
    snapshots are never more than the longer interval of the two (what a crash loses)."""
    layers, asked = auto_layers(tmp_path)
    costs(layers[0].memory.cost, snapshot_s=0.001, step_s=0.1)  # 1%: every step
    costs(layers[1].memory.cost, snapshot_s=0.02, step_s=0.1)   # 20%: every 16 steps
    step = 0
    schedule = {}  # the step -> the interval in force when it was asked

    def train(until):
        nonlocal step
        for step in range(step + 1, until + 1):
            for layer in layers:
                layer.ctx.state.step = step
                if step >= layer.next_due:
                    layer.step_ended(step)
            schedule[step] = layers[0].memory.every_steps

    def agree():
        flags = [layer.check_flags(window_s=0.0, window_steps=0) for layer in layers]
        sums = [sum(values) for values in zip(*flags)]  # what the all-reduce gives each
        for layer in layers:
            layer.agree_on(sums)

    train(20)
    agree()
    assert [layer.memory.every_steps for layer in layers] == [16, 16]
    assert [layer.ctx.memory_record["every_steps"] for layer in layers] == [16, 16]
    train(70)
    assert asked[0] == asked[1] == [*range(1, 21), 32, 48, 64]
    # Rank 1's snapshots grow cheaper, dearer, then nearly free: 4, 32, then 1.
    for snapshot_s, every, until in ((0.006, 4, 100), (0.05, 32, 200), (0.001, 1, 230)):
        costs(layers[1].memory.cost, snapshot_s=snapshot_s, step_s=0.1)
        agree()
        first, before = step + 1, list(asked[0])
        train(until)
        # From the step after the agreement, at the new interval's multiples.
        assert asked[0] == asked[1]
        assert asked[0][len(before):] == [s for s in range(first, until + 1) if s % every == 0]
    for before, after in zip(asked[0], asked[0][1:]):
        assert after - before <= max(schedule[before], schedule[after]), (before, after)


def test_auto_audits_the_interval_by_paired_windows_until_it_is_within_budget(tmp_path):
    """What the snapshots cost the steps around them (caches, page faults, a copy taking
    the step's CPUs) no clock sees, and the probe at a snapshot every step may miss it:
    under auto, after AUDIT_AFTER windows at an interval, every rank pauses the next
    window, and the step time with the snapshots against without is their measured
    share. Here (injected) the clocks say 1% a snapshot and the probe found nothing, so
    the estimate asks for every step, while each snapshot costs the steps 12% of one on
    rank 1 (0.5% on rank 0): the audits rule out 1, 2 and 4 in turn (12, 6, 3%), and
    both ranks take 8 (1.5%) at the same step, where it stays; when the snapshots grow
    cheap, audits far under the budget bring it back. Both ranks snapshot at the same
    steps throughout, none in the paused windows."""
    from engine.memory.cost import AUDIT_AFTER, MEMORY_BUDGET, PAUSED

    layers, asked = auto_layers(tmp_path)
    for layer in layers:
        costs(layer.memory.cost, snapshot_s=0.001, step_s=0.1)  # 1%, hidden 0: every step
    share = (0.005, 0.12)  # what a snapshot costs rank 0's and rank 1's steps
    step, window, paused, taken = 0, 8, set(), []

    def run_window():
        nonlocal step
        every = layers[0].memory.every_steps
        assert [layer.memory.every_steps for layer in layers] == [every] * 2
        first = step + 1
        for step in range(first, first + window):
            for layer in layers:
                layer.ctx.state.step = step
                if step >= layer.next_due:
                    layer.step_ended(step)
        if every == PAUSED:
            paused.update(range(first, step + 1))
        flags = [layer.check_flags(  # 0.1 s a step, and what the snapshots cost it
            window_s=window * 0.1 * (1 + (0 if every == PAUSED else cost / every)),
            window_steps=window) for layer, cost in zip(layers, share)]
        sums = [sum(values) for values in zip(*flags)]  # what the all-reduce gives each
        for layer in layers:
            layer.agree_on(sums)
        if layers[0].memory.cost.interval != (taken[-1][1] if taken else 1):
            taken.append((step, layers[0].memory.cost.interval))

    for _ in range(4 * (AUDIT_AFTER + 2) + 2 * (AUDIT_AFTER + 1)):
        run_window()
    # Each interval: a window part at the old one (not counted), AUDIT_AFTER windows,
    # one paused; then the next, at the same check point on both ranks.
    assert [every for _, every in taken] == [2, 4, 8]
    assert [layer.memory.cost.interval for layer in layers] == [8, 8]
    assert layers[1].memory.cost.measured == pytest.approx(0.12 / 8)  # <= MEMORY_BUDGET
    assert layers[1].memory.cost.measured <= MEMORY_BUDGET
    assert layers[1].ctx.memory_record["measured_percent"] == pytest.approx(1.5)
    # Rank 1's snapshots grow cheap (0.8% each): an audit far under the budget (a
    # quarter) lets the longest interval ruled out in again: 4, 2 (0.4%), then 1 (0.8%).
    share = (0.005, 0.008)
    for _ in range(3 * (AUDIT_AFTER + 2) + 2 * (AUDIT_AFTER + 1)):
        run_window()
    assert [every for _, every in taken] == [2, 4, 8, 4, 2, 1]
    assert layers[1].memory.cost.measured == pytest.approx(0.008)
    assert asked[0] == asked[1] and not paused & set(asked[0])
    # Snapshots at each interval's multiples from the check point that took it on.
    schedule = [(0, 1), *taken]
    for (since, every), (until, _) in zip(schedule, [*taken, (step, None)]):
        assert [s for s in asked[0] if since < s <= until] == [
            s for s in range(since + 1, until + 1) if s % every == 0 and s not in paused]


@pytest.mark.clock  # the costs are injected: rank 1's 0.3 s dwarfs the machine's noise
def test_two_ranks_whose_snapshots_cost_differently_snapshot_at_the_same_steps(
        reference, tmp_path):
    """memory_every_steps=auto (the default) on 2 gloo processes, rank 1's snapshots made
    dear (its ballast part takes 0.3 s more: tests/ballast_plugin.py): from every step,
    both ranks take rank 1's long interval at the same step and snapshot at the same
    steps, though rank 0's own costs ask for a short one; summary.json says the interval
    and what a snapshot costs; the weights are those of the run without (snapshots
    never change what a step computes)."""
    from engine.memory.cost import MEMORY_BUDGET, shortest

    out, record = tmp_path / "run", tmp_path / "record"
    record.mkdir()
    env = engine_env(ENGINE_BALLAST_MB="0.001", ENGINE_BALLAST_SLOW="1:0.3",
                     ENGINE_BALLAST_RECORD=str(record))
    run_cli(RECIPE, "epochs=3", "log_every=2", "checkpoint.every_steps=0", f"out_dir={out}",
            "checkpoint.memory_every_steps=auto", "--nproc", "2", "-p",
            "tests.ballast_plugin", env=env, check=True)
    summary = read_summary(out)
    measured = [json.loads((record / f"memory-r{r}.json").read_text()) for r in (0, 1)]
    assert summary["memory_snapshots"] == measured[0]
    every = summary["memory_snapshots"]["every_steps"]
    assert summary["memory_snapshots"]["auto"] and measured[1]["every_steps"] == every
    own = [shortest(m["snapshot_s"] / (MEMORY_BUDGET * m["step_s"])) for m in measured]
    # 0.3 s a snapshot against a tiny step: rank 1's asks for the longest (>= 32 where
    # its step is under 0.47 s); rank 0's own clocks see little, but its steps wait for
    # rank 1's snapshots, which the probe's paused window shows: it may ask as much,
    # and never more (the agreed interval is the longer of the two).
    assert own[0] <= every == own[1] >= 32, measured
    steps = [(record / f"steps-r{r}").read_text().split() for r in (0, 1)]
    # Both ranks snapshotted (the part's state_dict) at the same steps: every step (1-3),
    # none in the probe's paused window (from the check point at step 4), every step
    # again at step 6 (in memory, then to disk at the epoch's end, where the ranks agree
    # on the interval); then only the disk snapshots at the epochs' ends (6 steps each).
    assert steps[0] == steps[1] == ["1", "2", "3", "6", "6", "12", "18"], steps
    assert summary["weights_sha256"] == reference[2]


@pytest.mark.parametrize("nproc, workers, where", [
    (1, 0, "epoch"),
    (2, 0, "epoch"),
    (1, 0, "mid"),
    (1, 2, "mid"),
    (2, 2, "mid"),
])
def test_killed_run_resumes_to_identical_weights(reference, tmp_path, nproc, workers, where):
    out = tmp_path / "run"
    fault = {"ENGINE_FAULT_ACTION": "kill", "ENGINE_FAULT_RANK": str(nproc - 1),
             "ENGINE_FAULT_ONCE": str(tmp_path / "fault-done")}
    if where == "epoch":
        fault["ENGINE_FAULT_EPOCH"] = "1"  # right after epoch 0's snapshot
    else:
        fault["ENGINE_FAULT_STEP"] = str(mid_epoch_step())
    # From disk: the memory tier off, not left to auto's clock (which once took a memory
    # snapshot on a loaded machine); test_memory_resume.py resumes from memory.
    args = (RECIPE, *BASE, f"num_workers={workers}", f"out_dir={out}", "--nproc", str(nproc),
            "checkpoint.memory_every_steps=0", "-p", "tests.fault_plugin")
    killed = run_cli(*args, env=engine_env(**fault))
    assert killed.returncode != 0, f"the fault was not injected: {fault}\n{killed.stderr}"
    # Rank 0 records the failure when it notices the lost rank before it is stopped.
    assert not (out / "summary.json").exists() or read_summary(out)["status"] == "failed"

    resumed = run_cli(*args, env=engine_env(**fault), check=True)
    assert "resuming from " in resumed.stdout, resumed.stdout
    summary = read_summary(out)
    assert summary["epochs_completed"] == EPOCHS
    assert summary["global_step"] == STEPS_PER_EPOCH * EPOCHS
    assert summary["weights_sha256"] == reference[nproc], (
        f"resume after a kill ({fault}) changed the final weights")


def test_a_resume_keeps_the_default_threads_of_the_run_it_resumes(reference, tmp_path):
    """The default threads follow the machine's load (ENGINE_LOAD_AVERAGE stands for it):
    killed at 2 threads, resumed where the load would give 1, the run goes on at 2 and
    ends on the uninterrupted run's weights."""
    out = tmp_path / "run"
    fault = {"ENGINE_FAULT_ACTION": "kill", "ENGINE_FAULT_EPOCH": "1",
             "ENGINE_FAULT_ONCE": str(tmp_path / "fault-done")}
    args = (RECIPE, *BASE, f"out_dir={out}", "--nproc", "1",
            "checkpoint.memory_every_steps=0", "-p", "tests.fault_plugin")
    assert run_cli(*args, env=engine_env(**fault)).returncode != 0
    resumed = run_cli(*args, env=engine_env(**fault, ENGINE_LOAD_AVERAGE="1.5"), check=True)
    assert ("threads: 2 per process, as the interrupted run had (the default is 1 now; "
            "--threads N sets it)") in resumed.stdout, resumed.stdout
    assert read_summary(out)["weights_sha256"] == reference[1]


def test_resume_message_says_from_where(tmp_path):
    out = tmp_path / "run"
    args = (RECIPE, *BASE, "epochs=1", f"out_dir={out}", "--nproc", "1")
    first = run_cli(*args, check=True)
    assert "resuming" not in first.stdout  # nothing to resume: it simply starts
    again = run_cli(*args[:-3], "epochs=2", f"out_dir={out}", "--nproc", "1", check=True)
    latest = (out / "checkpoints" / "snapshot-e0001-s00000006.pt")
    assert f"resuming from {latest}: the end of epoch 1, step 6" in again.stdout
    assert read_summary(out)["global_step"] == 12


def test_no_resume_starts_fresh_and_resume_path_picks_a_snapshot(tmp_path, reference):
    out = tmp_path / "run"
    keep_all = (*BASE, "checkpoint.keep_last=0")
    run_cli(RECIPE, *keep_all, f"out_dir={out}", "--nproc", "1", check=True)
    fresh = run_cli(RECIPE, *keep_all, f"out_dir={out}", "--nproc", "1", "--no-resume",
                    "--overwrite", check=True)
    assert "resuming" not in fresh.stdout
    assert read_summary(out)["weights_sha256"] == reference[1]

    early = out / "checkpoints" / "snapshot-e0002-s00000012.pt"
    assert early.exists()
    other = tmp_path / "other"
    chosen = run_cli(RECIPE, *BASE, f"out_dir={other}", "--nproc", "1", "--resume",
                     str(early), check=True)
    assert f"resuming from {early}: the end of epoch 2, step 12" in chosen.stdout
    assert read_summary(other)["weights_sha256"] == reference[1]


def test_resume_from_a_missing_path_is_an_error(tmp_path):
    proc = run_cli(RECIPE, f"out_dir={tmp_path}", "--nproc", "1", "--resume",
                   str(tmp_path / "nope.pt"))
    assert proc.returncode != 0
    assert f"--resume '{tmp_path / 'nope.pt'}': no such snapshot" in proc.stderr


# torchrun --max-restarts resuming a killed worker from a disk snapshot to identical
# weights: tests/engine/test_memory_resume.py, whose one torchrun run resumes from memory
# and then, killed at an epoch's start, from disk.


# ------------------------------------------------- resuming with a changed config

TINY = str(REPO / "tests" / "recipes" / "tiny_parallel_recipe.py")  # no scheduler


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """out_dirs that hold one finished epoch: of a recipe without an LR scheduler
    (tiny_parallel_recipe, lr 0.05) and of one with a scheduler (tiny_resume)."""
    runs = {}
    for name, recipe, extra in (("plain", TINY, ()), ("scheduled", RECIPE, BASE)):
        out = tmp_path_factory.mktemp(name)
        run_cli(recipe, *extra, "epochs=1", f"out_dir={out}", "--nproc", "1", check=True)
        runs[name] = out
    return runs


def resume_changed(one_epoch, tmp_path, name: str, *args: str):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(one_epoch[name], out)
    recipe, extra = (TINY, ()) if name == "plain" else (RECIPE, BASE)
    return out, run_cli(recipe, *extra, f"out_dir={out}", "--nproc", "1", *args)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def test_a_changed_batch_size_or_seed_refuses_the_resume_naming_each_key(one_epoch, tmp_path):
    out, proc = resume_changed(one_epoch, tmp_path, "plain", "epochs=2", "batch_size=16",
                               "seed=7", "grad_accum_steps=2")
    assert proc.returncode != 0
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert "the config changed batch_size 8 -> 16, grad_accum_steps 1 -> 2, seed 0 -> 7" \
        in errors[0]
    assert "--resume-anyway" in errors[0] and "--no-resume" in errors[0]
    assert "epochs" not in errors[0]  # a key that may change is not listed
    assert not (out / "checkpoints" / "snapshot-e0002-s00000016.pt").exists()
    # config.json still describes the run the snapshots belong to.
    assert json.loads((out / "config.json").read_text())["batch_size"] == 8


def test_resume_anyway_loads_and_warns_listing_the_changed_keys(one_epoch, tmp_path):
    out, proc = resume_changed(one_epoch, tmp_path, "plain", "epochs=2", "batch_size=16",
                               "--resume-anyway")
    assert proc.returncode == 0, proc.stderr
    assert "resuming from " in proc.stdout
    assert "warning: --resume-anyway: resuming " in proc.stderr
    assert "the config changed batch_size 8 -> 16;" in proc.stderr
    summary = read_summary(out)
    assert (summary["epochs_completed"], summary["global_step"]) == (2, 8 + 4)


def test_keys_that_may_change_resume_without_a_word(one_epoch, tmp_path):
    out, proc = resume_changed(one_epoch, tmp_path, "plain", "epochs=2", "log_every=1",
                               "num_workers=1", "timeout_s=120", "checkpoint.keep_last=5",
                               "checkpoint.every_steps=3", "ddp.bucket_cap_mb=30",
                               "mlflow.experiment=other", "wandb.project=other")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    assert read_summary(out)["global_step"] == 16


def test_a_changed_lr_without_a_scheduler_is_applied_with_a_warning(one_epoch, tmp_path):
    import torch

    out, proc = resume_changed(one_epoch, tmp_path, "plain", "epochs=2", "lr=0.1")
    assert proc.returncode == 0, proc.stderr
    assert "lr changed since " in proc.stderr and ": 0.05 -> 0.1, applied to every " \
        "optimizer param group" in proc.stderr, proc.stderr
    final = torch.load(out / "checkpoints" / "snapshot-e0002-s00000016.pt", weights_only=True)
    assert [g["lr"] for g in final["optimizer"]["param_groups"]] == [0.1]
    assert final["config"]["lr"] == 0.1


def test_a_changed_lr_with_a_scheduler_refuses_the_resume(one_epoch, tmp_path):
    _, proc = resume_changed(one_epoch, tmp_path, "scheduled", "epochs=2", "lr=0.5")
    assert proc.returncode != 0
    assert "the config changed lr 0.05 -> 0.5, which would mix two runs" in proc.stderr


def test_a_corrupt_snapshot_is_refused_by_resume_and_skipped_by_latest(one_epoch, tmp_path):
    """Issue 16, defect 3: ``--resume`` of a bit-flipped snapshot loaded without a word
    and training went on from damaged weights. With every snapshot unusable, the run
    says in one line that it starts over."""
    from tests.engine.test_checkpoint import corrupt

    out = tmp_path / "run"
    import shutil

    shutil.copytree(one_epoch["plain"], out)
    (only,) = (out / "checkpoints").glob("snapshot-*.pt")
    corrupt(only)
    refused = run_cli(TINY, "epochs=2", f"out_dir={out}", "--nproc", "1", "--resume",
                      str(only))
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [
        f"[rank 0] error: --resume {str(only)!r}: the snapshot fails its check (xxh3_128 "
        "differs from the manifest (corrupt)); resume from another snapshot"], refused.stderr

    fresh = run_cli(TINY, "epochs=1", f"out_dir={out}", "--nproc", "1", check=True)
    assert "resuming" not in fresh.stdout
    assert (f"warning: none of the 1 snapshot(s) in {out / 'checkpoints'} is usable (see "
            "above): training restarts from step 0") in fresh.stderr


def test_keys_only_an_older_snapshot_or_this_config_has_do_not_matter(one_epoch, tmp_path):
    import torch

    source = one_epoch["plain"] / "checkpoints" / "snapshot-e0001-s00000008.pt"
    snap = torch.load(source, weights_only=True)
    snap["config"]["removed_long_ago"] = 1
    del snap["config"]["per_sample_seed"]
    old = tmp_path / "old.pt"
    torch.save(snap, old)
    out = tmp_path / "run"
    proc = run_cli(TINY, "epochs=2", f"out_dir={out}", "--nproc", "1", "--resume", str(old))
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {old}" in proc.stdout and "warning" not in proc.stderr


# ------------------------------------------------- another number of processes

ELASTIC = str(REPO / "tests" / "recipes" / "tiny_elastic.py")


def batches_seen(out) -> list[tuple[float, list[int]]]:
    """(mean loss, sample indices) of every micro-batch the runs in ``out`` trained on."""
    seen = []
    for record in sorted(out.glob("batches-rank*.txt")):
        for line in record.read_text().splitlines():
            _start, _step, _epoch, loss, indices = line.split()
            seen.append((float(loss), [int(i) for i in indices.split(",")]))
    return seen


def test_a_run_stopped_mid_epoch_at_2_processes_resumes_at_1_and_3_seeing_each_sample_once(
        tmp_path):
    """36 samples, global batch 6: pre-empted with 2 processes (signalled after step 1;
    the ranks stop at the check point after the one that saw it: step 2, 12 samples
    consumed), resumed with 1 and with 3. Over the epoch every sample is trained on
    exactly once; the epoch's loss is the mean over all its batches, the stopped run's
    included; the data wait is the slowest rank's (rank 2 loads slowly)."""
    import shutil

    stopped = tmp_path / "stopped"
    # Without memory snapshots: one at step 1 (auto's first steps) would finish that
    # step's check point at once, and the ranks would stop there (6 samples).
    base = (ELASTIC, "slow_rank=2", "slow_s=0.05", "checkpoint.memory_every_steps=0", "-p",
            "tests.fault_plugin")
    fault = engine_env(ENGINE_FAULT_ACTION="signal", ENGINE_FAULT_STEP="1",
                       ENGINE_FAULT_RANK="1")
    first = run_cli(*base, f"out_dir={stopped}", "--nproc", "2", env=fault)
    assert read_summary(stopped)["status"] == "preempted", first.stderr
    assert sum(len(i) for _, i in batches_seen(stopped)) == 12
    for nproc in (1, 3):
        out = tmp_path / f"resumed{nproc}"
        shutil.copytree(stopped, out)
        resumed = run_cli(*base, f"out_dir={out}", "--nproc", str(nproc), check=True)
        assert "resuming from " in resumed.stdout
        seen = batches_seen(out)
        indices = [i for _, batch in seen for i in batch]
        assert sorted(indices) == list(range(36)), (nproc, sorted(indices))
        summary = read_summary(out)
        assert summary["global_step"] == 6
        # Every micro-batch holds 6 / nproc samples: weigh the stopped run's (3 each).
        weighted = sum(loss * len(batch) for loss, batch in seen) / 36
        assert summary["train_epoch_loss"] == pytest.approx(weighted, rel=1e-5)
        if nproc == 3:  # rank 2 slept 0.05 s for each of its 8 samples; rank 0 did not
            metrics = summary["metrics"]
            elapsed = 6 * 4 / metrics["train/epoch_samples_per_sec"]  # 4 steps of 6 samples
            assert metrics["train/data_wait_fraction"] * elapsed >= 0.4, metrics


# ------------------------------------------------- library mode: ctx.save() mid-epoch


def step_loop(ctx, total_steps: int, stop_at: int | None = None):
    """The step-based loop of docs/library.md: a snapshot every 3 steps, mid-epoch (5
    steps per epoch); ``stop_at`` leaves right after that step's snapshot, as a killed
    run would have left it. Returns the sample indices trained on and the weights."""
    import torch

    from engine.checkpoint import model_digest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 2))
    model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1,
                                                       momentum=0.9))
    inputs = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    dataset = torch.utils.data.TensorDataset(inputs, (inputs[:, 0] > 0).long(),
                                             torch.arange(40))
    loader = ctx.loader(dataset, batch_size=8)
    ctx.resume()
    seen, epoch = [], ctx.state.epoch
    while ctx.state.step < total_steps:
        ctx.set_epoch(epoch)  # the snapshot's epoch starts where it stopped
        for x, y, index in loader:
            seen += [(epoch, i) for i in index.tolist()]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if ctx.state.step % 3 == 0:
                ctx.save()
            if ctx.state.step in (total_steps, stop_at):
                return {"seen": seen, "weights": model_digest(ctx.module.state_dict())}
        epoch += 1


def test_a_mid_epoch_ctx_save_resumes_a_step_loop_at_that_position(tmp_path):
    import engine

    def cfg(name):
        return engine.TrainConfig(out_dir=str(tmp_path / name))

    straight = engine.launch(step_loop, 12, nproc=1, config=cfg("straight"))
    stopped = engine.launch(step_loop, 12, 6, nproc=1, config=cfg("stopped"))
    resumed = engine.launch(step_loop, 12, nproc=1, config=cfg("stopped"))
    # Step 6 is the first batch of epoch 1: the resumed run starts at its second.
    assert resumed["seen"][0] == straight["seen"][6 * 8]
    assert stopped["seen"] + resumed["seen"] == straight["seen"]
    assert resumed["weights"] == straight["weights"]


# ------------------------------------------------- torchrun elastic: agents leave and join


def wait_for(condition, what: str, timeout: float = 240):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def winning_batches(out) -> dict[int, list[int]]:
    """Epoch -> the sample indices of every step that counts: a step trained again
    after a resume counts from the latest process that trained it (the largest start
    step), the lost ones' work is discarded as the resume discarded it."""
    by_step: dict[int, dict[int, list]] = {}
    for record in out.glob("batches-rank*.txt"):
        for line in record.read_text().splitlines():
            start, step, epoch, _loss, indices = line.split()
            by_step.setdefault(int(step), {}).setdefault(int(start), []).append(
                (int(epoch), [int(i) for i in indices.split(",")]))
    epochs: dict[int, list[int]] = {}
    for starts in by_step.values():
        for epoch, indices in starts[max(starts)]:
            epochs.setdefault(epoch, []).extend(indices)
    return epochs


class Agents:
    """torchrun agents on loopback, one per "node" (--nproc-per-node 1, c10d rendezvous
    on a free port, --max-restarts 3), each in a session of its own, its output in
    ``<tmp_path>/<name>.log``; ``with agents:`` kills what is left at the end."""

    def __init__(self, tmp_path, nnodes: str, *engine_args: str):
        from engine.launch_env import free_port

        self.tmp_path, self.nnodes, self.engine_args = tmp_path, nnodes, engine_args
        # Below the ephemeral ports: no connection can take it before agent a binds it.
        self.port = free_port()
        self.procs, self.logs = {}, {}

    def start(self, name: str, is_host: bool = False) -> None:
        import subprocess

        from tests.conftest import ENGINE_RUN

        self.logs[name] = self.tmp_path / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            [TORCHRUN, "--nnodes", self.nnodes, "--nproc-per-node", "1",
             "--max-restarts", "3", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "agents",
             "--monitor-interval", "1", "--rdzv-conf",
             f"is_host={int(is_host)},last_call_timeout=1,join_timeout=120,"
             # A dead agent leaves the rendezvous after 8 s without a heartbeat, not 3 x 5 s.
             # A live agent's heartbeats can be 3 s apart (sent when the last one is an
             # interval old, seen through a 1 s cache): 2 s expelled agent a (seen here).
             "keep_alive_interval=1,keep_alive_max_attempt=8",
             ENGINE_RUN, *self.engine_args],
            # torch's shared rendezvous store gives a node that joins in a later round no
            # MASTER_ADDR (the round's rank 0 cached it from round 0): the opt-out builds
            # it every round.
            env=engine_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), cwd=REPO,
            stdout=open(self.logs[name], "w"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def workers(self, name: str) -> list[int]:
        return children(self.procs[name].pid)

    def kill(self, name: str) -> list[int]:
        """The "node" goes: its agent, then its workers (whose pids it returns)."""
        import os
        import signal

        workers = self.workers(name)
        self.procs[name].kill()
        self.procs[name].wait(timeout=30)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        return workers

    def wait(self, *names: str, timeout: float) -> None:
        for name in names:
            assert self.procs[name].wait(timeout=timeout) == 0, self.said()

    def said(self) -> str:
        return "".join(path.read_text() for path in self.logs.values())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        import os
        import signal

        for agent in self.procs.values():
            if agent.poll() is None:
                for pid in children(agent.pid):
                    os.kill(pid, signal.SIGKILL)
                agent.kill()


def test_torchrun_elastic_goes_on_after_an_agent_dies_and_grows_when_one_joins(tmp_path):
    """Two torchrun agents on loopback (--nnodes 1:2); one is killed with its worker
    mid-epoch: the other restarts at 1 process from the last snapshot; a new agent
    joins: both restart at 2 processes from the snapshot the SIGTERM wrote. The run
    finishes, every sample of every epoch is trained on once, and the log says each
    change of the world size. ``<out_dir>/hold`` (tiny_elastic) paces the phases."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "hold").write_text("8")  # wait before step 8: the step-5 snapshot is written
    agents = Agents(tmp_path, "1:2", ELASTIC, f"out_dir={out}", "epochs=2", "size=60",
                    "checkpoint.every_steps=5", "checkpoint.memory_every_steps=0")

    def holding() -> set:
        return {p.name for p in out.glob("holding-*")}

    with agents:
        agents.start("a", is_host=True)
        agents.start("b")
        wait_for(lambda: len(holding()) == 2, "2 processes to reach step 8")
        first = holding()
        agents.kill("b")
        (out / "hold").write_text("13")  # a's worker steps on, finds b gone
        wait_for(lambda: holding() - first and "this run has 1" in agents.said(),
                 "agent a to go on alone")
        agents.start("c")
        wait_for(lambda: "this run has 2" in agents.said(), "agent c to join")
        (out / "hold").unlink()
        agents.wait("a", "c", timeout=300)
    log = agents.said()
    assert "was written by 2 processes, this run has 1" in log, log
    assert "was written by 1 processes, this run has 2" in log, log
    summary = read_summary(out)
    assert (summary["status"], summary["world_size"], summary["global_step"]) == (
        "completed", 2, 20)
    for epoch, indices in winning_batches(out).items():
        assert sorted(indices) == list(range(60)), (epoch, sorted(indices))
