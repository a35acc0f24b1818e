"""engine/token_shards.py: shards written from text and read back as windows, bad input,
and (on real runs of tests/recipes/tiny_shards.py) every window exactly once per epoch
across a SIGKILL at 2 processes and a resume at 1 and at 3."""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import sys

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.token_shards import INDEX, WRITE_HINT, TokenShards, write_shards
from tests.conftest import REPO, engine_env, read_summary, run_cli, run_cli_here

SEQ_LEN = 7  # windows of 8 tokens
# 350 bytes in shards of 100 tokens: 12 windows in each of the first three (4 tokens
# left over each), 6 in the last: 42 windows, 7 global batches of 6.
TEXT = "".join(f"{i:04d} tokens for a shard test\n" for i in range(20))[:350]
WINDOWS = 42


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "a.txt").write_text(TEXT[:123])
    (tmp / "b.txt").write_text(TEXT[123:])
    write_shards([tmp / "a.txt", tmp / "b.txt"], tmp / "out", shard_tokens=100,
                 block_chars=16)  # many blocks: their cuts must not show
    return tmp / "out"


def test_windows_are_each_shards_consecutive_tokens_and_never_span_two(shards):
    windows = TokenShards(shards, SEQ_LEN)
    data = TEXT.encode()
    expected = [data[shard * 100 + k * 8:shard * 100 + k * 8 + 8]
                for shard in range(4) for k in range(min(12, (len(data) - shard * 100) // 8))]
    assert len(windows) == len(expected) == WINDOWS
    for i, tokens in enumerate(expected):
        inputs, targets = windows[i]
        assert bytes(inputs.tolist()) == tokens[:-1] and bytes(targets.tolist()) == tokens[1:]
    assert windows.tokens == 350 and windows.vocab_size == 256
    index = json.loads((shards / INDEX).read_text())
    assert index["dtype"] == "uint16" and [s["tokens"] for s in index["shards"]] == [100] * 3 + [50]
    with pytest.raises(IndexError):
        windows[WINDOWS]


def test_a_pickled_dataset_carries_no_memory_map(shards):
    windows = TokenShards(shards, SEQ_LEN)
    windows[0]  # opens the maps in this process
    copy = pickle.loads(pickle.dumps(windows))  # what a spawned loader worker gets
    assert copy._maps is None and bytes(copy[41][0].tolist()) == bytes(windows[41][0].tolist())


def test_bad_shard_folders_are_refused_in_one_line(shards, tmp_path):
    def refusal(folder, seq_len=SEQ_LEN) -> str:
        with pytest.raises(ConfigError) as caught:
            TokenShards(folder, seq_len)
        assert "\n" not in str(caught.value)
        return str(caught.value)

    assert "does not exist; write one with: engine-run shards" in refusal(tmp_path / "none")
    assert f"has no {INDEX}" in refusal(tmp_path)
    assert "no window of seq_len + 1 = 101 tokens fits" in refusal(shards, 100)
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    np.save(broken / "shard-00001.npy", np.zeros(7, np.uint16))
    assert "shard-00001.npy holds (7,) uint16, the index says (100,) uint16" in refusal(broken)
    (broken / INDEX).write_text("{}")
    assert "is not a token-shard index" in refusal(broken)


def damage(index: dict, how: str) -> None:
    if how.startswith("no "):
        key = how[3:]
        del (index["shards"][1] if key == "file" else index)[key]
    elif how == "a file elsewhere":
        index["shards"][1]["file"] = "../shard-00001.npy"
    else:
        index["shards"][1]["tokens"] = "100"


@pytest.mark.parametrize("how, says", [
    ("no shards", 'has no "shards" (a list of shards)'),
    ("no vocab_size", 'has no "vocab_size" (a vocabulary size)'),
    ("no file", 'in shard 1: has no "file" (a file name in the folder)'),
    ("a file elsewhere",
     "in shard 1: has \"file\" '../shard-00001.npy', not a file name in the folder"),
    ("tokens as text", "in shard shard-00001.npy: has \"tokens\" '100', not a count")])
def test_a_damaged_index_is_one_line_naming_what_is_wrong(shards, tmp_path, how, says):
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    index = json.loads((broken / INDEX).read_text())
    damage(index, how)
    (broken / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError) as caught:
        TokenShards(broken, SEQ_LEN)
    assert str(caught.value) == f"token shards: {broken / INDEX} {says}; {WRITE_HINT}"
    assert "\n" not in str(caught.value)


def test_a_token_id_beyond_the_vocabulary_is_refused_at_open(shards, tmp_path):
    """Checked once per shard when the dataset opens it, not per window: before, the
    id reached the model's embedding as an IndexError traceback in training."""
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    tokens = np.load(broken / "shard-00002.npy")
    tokens[57] = 256  # the bytes tokenizer's vocabulary is 0..255
    np.save(broken / "shard-00002.npy", tokens)
    with pytest.raises(ConfigError) as caught:
        TokenShards(broken, SEQ_LEN)
    assert str(caught.value) == (
        f"token shards: {broken / 'shard-00002.npy'} holds token id 256, not below the "
        f"vocabulary size 256 of its {INDEX}; write it again with the tokenizer it names")


def test_a_failed_shards_command_leaves_the_folders_shards_as_they_were(shards, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(shards, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "bad.bin").write_bytes(b"a line\n" * 100 + b"\xff\xfe\n")
    proc = run_cli_here("shards", str(tmp_path / "bad.bin"), "--out", str(out),
                        "--shard-tokens", "100")  # a shard is written before the error
    assert proc.returncode == 2 and "bad.bin is not UTF-8 text" in proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.bin", "out"]


def test_the_shards_command_writes_a_folder_and_refuses_bad_input(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("héllo\n" * 50)  # 7 bytes a line
    proc = run_cli_here("shards", str(text), "--out", str(tmp_path / "s"),
                        "--shard-tokens", "128", check=True)
    assert proc.stdout == (f"wrote {tmp_path / 's'}: 3 shards, 350 tokens (uint16), "
                           "tokenizer bytes (vocabulary 256)\n")
    assert bytes(TokenShards(tmp_path / "s", 6)[0][0].tolist()) == "héllo\n".encode()[:6]
    (tmp_path / "bad.bin").write_bytes(b"\xff\xfe\x00")
    for args, says in ((["bad.bin"], "bad.bin is not UTF-8 text"),
                       (["missing.txt"], "missing.txt: no such file; give UTF-8 text files"),
                       (["t.txt", "--shard-tokens", "1"], "--shard-tokens must be >= 2")):
        proc = run_cli_here("shards", *[str(tmp_path / a) if a.endswith(("bin", "txt")) else a
                                        for a in args], "--out", str(tmp_path / "x"))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert says in proc.stderr


def test_without_the_tokenizers_package_a_tokenizer_file_is_refused_in_one_line(
        tmp_path, monkeypatch):
    (tmp_path / "t.txt").write_text("a b\n")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers fails
    proc = run_cli_here("shards", str(tmp_path / "t.txt"), "--out", str(tmp_path / "s"),
                        "--tokenizer", "tokenizer.json")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert ("--tokenizer tokenizer.json: a tokenizer file needs the tokenizers package "
            "(pip install tokenizers); or use --tokenizer bytes") in proc.stderr


def test_a_hugging_face_tokenizer_file_gives_its_ids(tmp_path):
    """The tokenizers package (in the dev extras): its ids, uint16 for a small
    vocabulary and uint32 beyond 65,536; a file that is no tokenizer.json is one line."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    text = tmp_path / "t.txt"
    text.write_text("a b a b w70000\n" * 20)

    for size, dtype in ((4, "uint16"), (70_001, "uint32")):
        vocab = {"[UNK]": 0, "a": 1, "b": 2, **{f"w{i}": i for i in range(3, size)}}
        tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer.save(str(tmp_path / "tokenizer.json"))
        run_cli_here("shards", str(text), "--out", str(tmp_path / "s"),
                     "--tokenizer", str(tmp_path / "tokenizer.json"), check=True)
        windows = TokenShards(tmp_path / "s", 4)
        last = 70_000 if size > 70_000 else 0  # w70000, or unknown
        assert windows.vocab_size == size and windows.dtype == dtype
        assert windows[0][0].tolist() == [1, 2, 1, 2] and windows[0][1].tolist()[-1] == last
    proc = run_cli_here("shards", str(text), "--out", str(tmp_path / "s"),
                        "--tokenizer", str(text))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"--tokenizer {text}: not a Hugging Face tokenizer.json" in proc.stderr


# ---------------------------------------------- real runs: another number of processes

RECIPE = str(REPO / "tests" / "recipes" / "tiny_shards.py")
EPOCHS, KILL_STEP = 2, 11  # 7 steps an epoch: mid-epoch 2; the snapshot before it: 10


def consumed(out) -> dict[int, collections.Counter]:
    """Per epoch, how often each window was trained on: the killed processes' batches up
    to the step the resumed ones started from (they trained past their last snapshot,
    and those steps were trained again), and every batch of the resumed ones."""
    records = [line.split() for path in out.glob("windows-rank*.txt")
               for line in path.read_text().splitlines()]
    resumed_at = max(int(start) for start, *_ in records)
    counts = collections.defaultdict(collections.Counter)
    for start, step, epoch, windows in records:
        if int(start) == resumed_at or int(step) <= resumed_at:
            counts[int(epoch)].update(map(int, windows.split(",")))
    return counts, resumed_at


@pytest.fixture(scope="module")
def resumed(shards, tmp_path_factory):
    """42 windows, global batch 6, checkpoint every 2 steps: 2 processes SIGKILLed after
    step 11 (rank 1), then the run resumed at 1 and at 3 processes."""
    tmp = tmp_path_factory.mktemp("runs")
    args = (RECIPE, f"shards={shards}", "checkpoint.every_steps=2", "-p", "tests.fault_plugin")
    env = engine_env(ENGINE_FAULT_ACTION="kill", ENGINE_FAULT_STEP=str(KILL_STEP),
                     ENGINE_FAULT_RANK="1", ENGINE_FAULT_ONCE=str(tmp / "once"))
    killed = run_cli(*args, f"out_dir={tmp / 'killed'}", "--nproc", "2", env=env)
    assert killed.returncode != 0 and (tmp / "once").exists(), killed.stderr[-2000:]
    runs = {}
    for nproc in (1, 3):
        out = tmp / f"resumed{nproc}"
        shutil.copytree(tmp / "killed", out)
        runs[nproc] = (out, run_cli(*args, f"out_dir={out}", "--nproc", str(nproc),
                                    env=env, check=True))
    return runs


@pytest.mark.parametrize("nproc", [1, 3])
def test_every_window_once_per_epoch_across_a_kill_at_2_processes_and_a_resume(resumed, nproc):
    out, proc = resumed[nproc]
    assert "resuming from " in proc.stdout
    counts, resumed_at = consumed(out)
    assert 7 < resumed_at < 14  # mid-epoch 2
    assert sorted(counts) == list(range(EPOCHS))
    for epoch, seen in counts.items():
        assert set(seen) == set(range(WINDOWS)), f"epoch {epoch}: missing {set(range(WINDOWS)) - set(seen)}"
        assert max(seen.values()) == 1, f"epoch {epoch}: twice: {[w for w, n in seen.items() if n > 1]}"
    assert read_summary(out)["global_step"] == EPOCHS * 7


def test_the_windows_are_shuffled_by_seed_and_epoch(resumed):
    """The killed run's first epoch is one batch order, not the shards' order."""
    out, _ = resumed[1]
    rank0 = [line.split() for path in out.glob("windows-rank0-*.txt")
             for line in path.read_text().splitlines() if line.startswith("0 ")]
    first = [int(w) for _, _, epoch, ws in rank0 if epoch == "0" for w in ws.split(",")]
    assert len(first) == WINDOWS // 2 and first != sorted(first)


def test_a_resume_on_rewritten_shards_says_so_in_one_warning_line(tmp_path, capsys):
    """TokenShards is a state part: a snapshot keeps its index's sha256, and restoring it
    into the shards written again from other text of the same length (the index records
    each shard's checksum) warns, in one line; the same shards restore silently."""
    (tmp_path / "a.txt").write_text("the first text\n" * 20)
    write_shards([tmp_path / "a.txt"], tmp_path / "out", shard_tokens=100)
    saved = TokenShards(tmp_path / "out", 7).state_dict()
    TokenShards(tmp_path / "out", 7).load_state_dict(saved)
    assert capsys.readouterr().err == ""
    (tmp_path / "a.txt").write_text("the other text\n" * 20)
    write_shards([tmp_path / "a.txt"], tmp_path / "out", shard_tokens=100)
    rewritten = TokenShards(tmp_path / "out", 7)
    rewritten.load_state_dict(saved)
    assert capsys.readouterr().err == (
        f"warning: token shards {tmp_path / 'out'}: {INDEX} changed since the snapshot "
        f"(sha256 {saved['index_sha256'][:12]}, now {rewritten.index_sha256[:12]}): the "
        "resume reads other tokens; write them back, or --no-resume to train on these\n")
