"""engine/streaming.py: iterable datasets, on real 2-process runs of tests/recipes/tiny_stream.py.

Its stream has 45 items over 2 ranks (and 2 workers each in the stateful runs): the
ranks' parts differ in length. Each run records the sample ids it trained on per rank.
The runs without state split it unevenly (rank 0 34 items, rank 1 11): rank 1 trains
padding for whole log windows, and is killed while it pads.

Every run also validates on a stream of 23 items every 5 steps (split like the training
one: 12 and 11 items per rank, or 18 and 5), so each kill falls after a validation
mid-epoch: the training stream must go on as without it, and every validation must
count each of the 23 items exactly once.
"""

from __future__ import annotations

import collections
import csv
import json
import textwrap

import pytest
import torch

from engine import streaming
from engine.testing import run_python
from tests.conftest import REPO, engine_env, read_summary, run_cli

RECIPE = str(REPO / "tests" / "recipes" / "tiny_stream.py")
SIZE, EPOCHS = 45, 2
VAL_SIZE = 23
ARGS = (RECIPE, f"data.size={SIZE}", f"epochs={EPOCHS}", "checkpoint.every_steps=3",
        f"data.val_size={VAL_SIZE}", "val_every_steps=5")
# mid-epoch 2 (12 steps an epoch); the snapshot before it: step 15, after a validation
KILL_STEP = 16
# data.uneven: 17 steps an epoch (rank 0's 34 items), rank 1's 11 items in its first 6;
# killed in epoch 2's padding, after the snapshot of step 27
UNEVEN, UNEVEN_KILL_STEP = ("data.uneven=true",), 28


def consumed(out) -> dict[int, collections.Counter]:
    """Per epoch, how often each sample was trained on: each process's lines up to the
    step the next process resumed from (a killed process trained past its last
    snapshot; the resumed one trains those steps again, and they count once)."""
    segments = []  # per process: [(epoch, step, id)]
    for rank in (0, 1):
        lines = (out / f"consumed-rank{rank}.txt").read_text().split("\n")
        for line in lines:
            if line == "start":
                segments.append((rank, []))
            elif line:
                segments[-1][1].append(tuple(map(int, line.split())))
    counts = collections.defaultdict(collections.Counter)
    for rank in (0, 1):
        mine = [records for r, records in segments if r == rank]
        for records, after in zip(mine, mine[1:] + [None]):
            resumed_at = after[0][1] if after else float("inf")
            for epoch, step, sample in records:
                if step < resumed_at:
                    counts[epoch][sample] += 1
    return counts


def assert_exactly_once(out, size: int = SIZE) -> None:
    counts = consumed(out)
    assert sorted(counts) == list(range(EPOCHS))
    for epoch, seen in counts.items():
        assert set(seen) == set(range(size)), f"epoch {epoch}: missing {set(range(size)) - set(seen)}"
        assert max(seen.values()) == 1, f"epoch {epoch}: twice: {[s for s, n in seen.items() if n > 1]}"


def assert_validated_every_item_once(out, steps) -> None:
    """Each validation (metrics.csv, across the kill) over all 23 items, each once: their
    count, mean id and mean squared id are those of 0..22 (recipe's eval_metrics)."""
    with open(out / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["name"].startswith("val/")]
    want = {"val/items": VAL_SIZE, "val/id": (VAL_SIZE - 1) / 2,
            "val/id_sq": sum(i * i for i in range(VAL_SIZE)) / VAL_SIZE}
    validated = collections.defaultdict(dict)
    for row in rows:
        validated[int(row["step"])][row["name"]] = float(row["value"])
    assert sorted(validated) == steps
    assert all(metrics == want for metrics in validated.values()), validated


def kill_then(out, tmp, *extra, step: int = KILL_STEP) -> None:
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(step),
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp / "once"))
    killed = run_cli(*ARGS, *extra, f"out_dir={out}", "--nproc", "2",
                     "-p", "tests.fault_plugin", env=env)
    assert killed.returncode != 0 and (tmp / "once").exists(), killed.stderr[-2000:]


@pytest.fixture(scope="module")
def skipping(tmp_path_factory):
    """A stream without state_dict, split unevenly, killed mid-epoch while rank 1 pads;
    resumes refused at another world size and another num_workers; then resumed (by
    skipping) with the same."""
    tmp = tmp_path_factory.mktemp("skipping")
    out = tmp / "run"
    kill_then(out, tmp, *UNEVEN, step=UNEVEN_KILL_STEP)
    other_world = run_cli(*ARGS, *UNEVEN, f"out_dir={out}", "--nproc", "1")
    other_workers = run_cli(*ARGS, *UNEVEN, f"out_dir={out}", "--nproc", "2", "num_workers=1")
    resumed = run_cli(*ARGS, *UNEVEN, f"out_dir={out}", "--nproc", "2", check=True)
    return out, other_world, other_workers, resumed


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """A stream with state_dict, 2 loader workers per process, killed mid-epoch and
    resumed from its workers' states."""
    tmp = tmp_path_factory.mktemp("exact")
    out = tmp / "run"
    extra = ("data.stateful=true", "num_workers=2")
    kill_then(out, tmp, *extra)
    resumed = run_cli(*ARGS, *extra, f"out_dir={out}", "--nproc", "2", check=True)
    return out, resumed


def test_a_stateful_stream_with_workers_trains_every_sample_once_per_epoch_across_a_kill(
        exact):
    out, resumed = exact
    assert "resuming from " in resumed.stdout and "epoch 2, step 15" in resumed.stdout
    assert "skips" not in resumed.stderr  # its state, not a replay
    assert_exactly_once(out)  # also: the validation at step 15 left the stream's position
    assert_validated_every_item_once(out, [5, 10, 12, 15, 20, 24])
    summary = read_summary(out)
    assert summary["global_step"] == 24  # 12 steps an epoch: rank 0's 12 batches
    # Waiting for the other ranks' end-of-data flags is not waiting for data (it read
    # over 100% in a short first epoch).
    assert 0 <= summary["data_wait_fraction"] < 1


def test_a_stream_without_state_resumes_by_skipping_with_a_one_line_notice(skipping):
    """Also: a rank that trains padding for whole log windows logs no NaN loss, and a
    resume where that rank was padding pads with the batch the snapshot kept."""
    out, _, _, resumed = skipping
    assert "epoch 2, step 27" in resumed.stdout
    notices = [line for line in resumed.stderr.splitlines() if "skips the" in line]
    assert notices == ["warning: the training stream has no state_dict/load_state_dict: "
                       "the resume skips the 20 samples per process the epoch already "
                       "consumed by reading them again (their loading time; exact only if "
                       "the stream yields the same items in the same order again)"]
    assert_exactly_once(out)
    # the validation stream shards itself too: 18 items on rank 0, 5 on rank 1
    assert_validated_every_item_once(out, [5, 10, 15, 17, 20, 25, 30, 34])
    assert read_summary(out)["global_step"] == 34


def test_an_epochs_loss_counts_no_padding_micro_batch(skipping):
    # Epoch 1: rank 1 pads from step 7 to 17. Its loss, the mean over every rank's real
    # micro-batches, is a weighted mean of its windows' (train/loss): within their range.
    # Counted with the padding it read 0.77 against windows of 0.85 to 1.27.
    from engine.plugins.csv_logger import read_metrics

    scalars, _ = read_metrics(skipping[0])
    windows = [value for step, value in scalars["train/loss"] if step <= 17]
    [(_, epoch_loss)] = [row for row in scalars["train/epoch_loss"] if row[0] == 17]
    assert min(windows) <= epoch_loss <= max(windows), (epoch_loss, windows)


def test_a_stream_resume_at_another_world_size_or_workers_is_refused_in_one_line(skipping):
    _, other_world, other_workers, _ = skipping
    for proc, says in ((other_world, "with 2 processes; this run has 1: the items each "
                                     "rank consumed are not a prefix of the stream"),
                       (other_workers, "num_workers=0; this run has num_workers=1: skipping "
                                       "the consumed samples replays each worker's part")):
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if says in line]
        assert errors and all("Traceback" not in line for line in proc.stderr.splitlines())
        assert "epoch 2/2" not in proc.stdout  # refused before training


# ------------------------------------------------------------- a custom loop (ctx.loader)

LOOP = textwrap.dedent("""
    import json
    import sys

    import torch

    import engine


    class Stream(torch.utils.data.IterableDataset):
        \"\"\"Items (i, features) of 0..size-1, split unevenly by the stream itself: rank 1
        takes i % 4 == 3 (7 of 30), rank 0 the rest; its position is its state.\"\"\"
        shards_itself = True

        def __init__(self, size, rank):
            self.size, self.rank, self.position = size, rank, 0

        def set_epoch(self, epoch):
            self.position = 0

        def __iter__(self):
            while self.position < self.size:
                i, self.position = self.position, self.position + 1
                if (i % 4 == 3) == (self.rank == 1):
                    yield i, torch.full((4,), i / 30)

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]


    def work(ctx, stop_at):
        model = torch.nn.Linear(4, 1)
        model, optimizer = ctx.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = ctx.loader(Stream(30, ctx.rank), batch_size=4)
        val = ctx.loader(Stream(23, ctx.rank), batch_size=4, train=False)
        sums = []
        with open(f"{ctx.out_dir}/consumed-rank{ctx.rank}.txt", "a") as f:
            f.write("start\\n")
            for epoch in ctx.epochs(2):
                for ids, x in loader:
                    if not loader.padding:  # the engine's: it trains nothing
                        f.writelines(f"{epoch} {ctx.state.step} {i}\\n" for i in ids.tolist())
                    f.flush()
                    optimizer.zero_grad()
                    loss = model(x).pow(2).mean() * (0.0 if loader.padding else 1.0)
                    loss.backward()
                    optimizer.step()
                    if ctx.state.step == 5:  # rank 1 pads from its 5th batch
                        ctx.save()
                    if ctx.state.step == stop_at:
                        raise RuntimeError("stopped")
                ids = [i for batch, _ in val for i in batch.tolist()]
                sums.append(ctx.reduce({"n": len(ids), "sum": sum(ids)}, op="sum"))
        return {"steps": ctx.state.step, "val": sums}


    if __name__ == "__main__":
        config = engine.TrainConfig(out_dir=sys.argv[1])
        try:
            engine.launch(work, 7, nproc=2, config=config)
        except engine.EngineError as exc:
            print(f"ERROR {exc}", flush=True)
        print("RESULT " + json.dumps(engine.launch(work, 0, nproc=2, config=config)))
""")


@pytest.fixture(scope="module")
def custom_loop(tmp_path_factory):
    """A custom loop (engine.launch) on a stateful stream split unevenly, stopped after
    a snapshot taken while rank 1 pads, then resumed."""
    tmp = tmp_path_factory.mktemp("custom_loop")
    (tmp / "loop.py").write_text(LOOP)
    out = tmp / "run"
    proc = run_python([str(tmp / "loop.py"), str(out)], cwd=tmp, timeout=300, check=True,
                      env=engine_env(ENGINE_START_METHOD="fork"))
    return out, proc


def test_a_custom_loop_trains_a_stream_exactly_once_across_a_resume_and_validates_it(
        custom_loop):
    out, proc = custom_loop
    assert "ERROR " in proc.stdout and "stopped" in proc.stdout
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["steps"] == 2 * 12  # rank 0's 23 items: 12 micro-batches of 2
    assert_exactly_once(out, size=30)
    # every item of the validation stream once over the ranks, 18 + 5
    assert result["val"] == [{"n": 23.0, "sum": float(sum(range(23)))}] * 2


# ------------------------------------------------------------------ in-process parts

class Items(torch.utils.data.IterableDataset):
    def __init__(self, n, shards_itself=False):
        self.n = n
        if shards_itself:
            self.shards_itself = True

    def __iter__(self):
        return iter(range(self.n))


def test_each_rank_and_worker_takes_every_consumers_th_item_unless_the_stream_shards_itself():
    assert [list(streaming.ShardedStream(Items(7), rank, 2)) for rank in (0, 1)] == \
        [[0, 2, 4, 6], [1, 3, 5]]
    assert list(streaming.ShardedStream(Items(5, shards_itself=True), 1, 2)) == [0, 1, 2, 3, 4]
    # two workers on rank 1 of 2: consumers 2 and 3 of 4
    loader = torch.utils.data.DataLoader(streaming.ShardedStream(Items(11), 1, 2),
                                         batch_size=None, num_workers=2)
    assert sorted(loader) == [2, 3, 6, 7, 10]


class Positioned(Items):
    """Items whose position is their state (it does not go back by itself)."""

    def __init__(self, n):
        super().__init__(n)
        self.position = 0

    def __iter__(self):
        while self.position < self.n:
            self.position += 1
            yield self.position - 1

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_validation_stream_gives_each_rank_its_part_from_the_start_every_time():
    from types import SimpleNamespace

    from engine import data

    def loaders(stream, workers=0):
        return [streaming.val_loader(stream, batch=2, num_workers=workers, pin_memory=False,
                                     world=SimpleNamespace(rank=rank, world_size=2))
                for rank in (0, 1)]

    for stream in (Items(11), Positioned(11)):
        ranks = loaders(stream)
        parts = [[x for batch in loader for x in batch.tolist()] for loader in ranks]
        assert parts == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]
        # again: from the stream's start (a stateful stream from its first state)
        assert [[x for batch in loader for x in batch.tolist()] for loader in ranks] == parts
    # one batch's samples for the names check: the rank's first, else the stream's
    assert [data.first_val_samples(loader) for loader in loaders(Items(3))] == [[0, 2], [1]]
    assert [data.first_val_samples(loader) for loader in loaders(Items(1))] == [[0], [0]]


def test_a_batch_counts_the_samples_of_its_first_tensor():
    assert streaming.batch_samples((torch.arange(3), torch.zeros(3, 4))) == 3
    assert streaming.batch_samples({"ids": torch.zeros(1, 5)}) == 1
    assert streaming.batch_samples("text") == 0


def test_a_hugging_face_stream_that_does_not_say_it_shards_itself_is_refused_with_workers():
    """datasets' IterableDataset splits itself over loader workers (its files): under the
    engine's item rule too, most items would be lost."""
    from types import SimpleNamespace

    from engine.errors import ConfigError

    datasets = pytest.importorskip("datasets")
    stream = datasets.Dataset.from_dict({"x": list(range(8))}).to_iterable_dataset(num_shards=4)
    world = SimpleNamespace(rank=0, world_size=1)
    with pytest.raises(ConfigError, match="splits itself over the 2 loader workers: split it "
                                          "over the processes too") as caught:
        streaming.StreamLoader(stream, micro_batch=2, world=world, num_workers=2,
                               pin_memory=False, drop_last=False)
    assert "\n" not in str(caught.value)
    stream.shards_itself = True  # what examples/hf_causal_lm.py says
    loader = streaming.StreamLoader(stream, micro_batch=2, world=world, num_workers=2,
                                    pin_memory=False, drop_last=False)
    loader.start_epoch(0)
    assert sorted(x for batch in loader.loader for x in batch["x"].tolist()) == list(range(8))


BROKEN = textwrap.dedent("""
    from tests.recipes.tiny_stream import *  # noqa: F401,F403 (the recipe, but its data)
    from tests.recipes import tiny_stream


    class CorruptItem(ValueError):
        pass


    class Broken(tiny_stream.Stream):
        def __iter__(self):
            for n, one in enumerate(super().__iter__()):
                if n == 5:
                    raise CorruptItem("item 5 of the stream is corrupt")
                yield one


    def build_datasets(cfg, ctx):
        return Broken(cfg.data.size), None
""")


def test_a_stream_that_raises_in_a_loader_worker_is_named_on_the_last_line(tmp_path):
    """The recipe's exception, type and message, ends the run's output and is its
    summary's error, not torch's "Caught CorruptItem in DataLoader worker process 0";
    the worker's traceback is still printed once."""
    (tmp_path / "broken.py").write_text(BROKEN)
    out = tmp_path / "run"
    proc = run_cli(str(tmp_path / "broken.py"), f"out_dir={out}", "num_workers=1",
                   "epochs=1", "checkpoint.memory_every_steps=0", "--nproc", "2")
    assert proc.returncode != 0
    said = "CorruptItem: item 5 of the stream is corrupt"
    last = proc.stderr.rstrip().splitlines()[-1]
    assert f"exited with code 1: {said}; rank " in last, proc.stderr[-3000:]
    assert proc.stderr.count("Original Traceback") == 1
    assert read_summary(out)["error"] == said


class Raising(torch.utils.data.IterableDataset):
    def __init__(self, exc):
        self.exc = exc

    def __iter__(self):
        yield torch.zeros(1)
        raise self.exc


class TwoArguments(Exception):
    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


@pytest.mark.parametrize("exc, said", [
    (KeyError("missing"), "KeyError: 'missing'"),
    (TwoArguments("no shard", "s3://b"), "RuntimeError: tests.engine.test_streaming."
                                         "TwoArguments: no shard at s3://b")])
def test_a_loader_workers_exception_is_raised_as_the_stream_raised_it(exc, said):
    """A KeyError keeps its quotes; a type torch could not make again with its message
    (it raised a RuntimeError) keeps its name in the message."""
    from types import SimpleNamespace

    from engine.errors import one_line

    loader = streaming.StreamLoader(Raising(exc), micro_batch=1, num_workers=1,
                                    world=SimpleNamespace(rank=0, world_size=1),
                                    pin_memory=False, drop_last=False)
    loader.start_epoch(0)
    with pytest.raises(Exception) as caught:
        list(loader)
    assert one_line(caught.value) == said
    assert "in DataLoader worker process 0" in str(caught.value.__cause__)
