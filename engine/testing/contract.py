"""What the engine relies on from a checkpointer, as tests (:class:`CheckpointerContract`)
with their helpers, and from a state part (:func:`assert_state_part`)."""

from __future__ import annotations

import functools
import importlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from engine.config import TrainConfig
from engine.testing.processes import engine_env, group_processes

# torch is imported inside the functions that use it: engine.testing loads without it.


def contract_state(step: int, numel: int = 24) -> dict:
    """A snapshot-shaped dict whose every tensor holds ``step`` (easy to check whole):
    "model" and "optimizer" keyed by parameter name, as a sharded format gets them, and
    the plain values the rest of a snapshot holds. ``numel``: the size of the model's
    largest tensor (four bytes each)."""
    import torch

    value = float(step)
    return {"model": {"fc.weight": torch.full((numel,), value),
                      "fc.bias": torch.full((6,), value),
                      "norm.num_batches_tracked": torch.tensor(step)},
            "optimizer": {"state": {"fc.weight": {"momentum_buffer":
                                                  torch.full((numel,), -value)}},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                            "params": ["fc.weight", "fc.bias"]}]},
            "epoch": step, "step": step, "engine_version": "contract",
            "config": {"lr": 0.1, "data": {"source": "synthetic", "sizes": [8, 16]}},
            "progress": {"epoch_loss": None, "history": [0.5, value]},
            "rng": {"torch": torch.full((16,), step % 256, dtype=torch.uint8)},
            "half": torch.full((2, 3), value, dtype=torch.bfloat16),
            "empty": torch.empty(0, 5)}


def assert_same_snapshot(loaded, expected, where: str = "snapshot") -> None:
    """``loaded`` holds exactly ``expected``: the same keys, tensors of the same dtype,
    shape and values, the same plain values."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), f"{where}: {type(loaded).__name__}, not a tensor"
        assert (loaded.dtype, loaded.shape) == (expected.dtype, expected.shape), (
            f"{where}: {loaded.dtype} {tuple(loaded.shape)}, expected {expected.dtype} "
            f"{tuple(expected.shape)}")
        assert torch.equal(loaded.cpu(), expected), f"{where}: other values"
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and set(loaded) == set(expected), (
            f"{where}: keys {sorted(map(str, loaded))}, expected {sorted(map(str, expected))}")
        for key, value in expected.items():
            assert_same_snapshot(loaded[key], value, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(loaded, (list, tuple)) and len(loaded) == len(expected), (
            f"{where}: {loaded!r}, expected {expected!r}")
        for i, (got, value) in enumerate(zip(loaded, expected)):
            assert_same_snapshot(got, value, f"{where}[{i}]")
    else:
        assert loaded == expected, f"{where}: {loaded!r}, expected {expected!r}"


def assert_state_part(part) -> None:
    """A state part as the engine uses it, without a process group: ``Stateful``; the state
    a memory snapshot takes of it (``local_state_dict()``, else ``state_dict()``) needs no
    collective and goes through the memory tier's codec and ``load_state_dict`` unchanged."""
    from engine import shm_codec
    from engine.stateful import SnapshotParts

    parts = SnapshotParts()
    parts.add("part", part)  # Stateful, or the engine's one-line error
    state = parts.local_state_dict()["part"]
    skeleton, tensors, _, _ = shm_codec.encode(state)
    by_offset = {offset: tensor for offset, tensor in tensors}
    part.load_state_dict(shm_codec.decode(skeleton, lambda offset, dtype, shape: (
        by_offset[offset].detach().cpu().clone().reshape(shape))))
    assert_same_snapshot(parts.local_state_dict()["part"], state, "its state after a load")


def corrupt_snapshot(path, how: str = "flip") -> None:
    """Flip one byte in the middle of the snapshot at ``path`` (its largest file when it
    is a folder); or, with ``how="truncate"``, cut its last byte off."""
    path = pathlib.Path(path)
    target = max(path.iterdir(), key=lambda p: p.stat().st_size) if path.is_dir() else path
    data = bytearray(target.read_bytes())
    if how == "truncate":
        del data[-1]
    else:
        data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def contract_config(keep_last: int = 0, best_metric: str = "", best_mode: str = "max"):
    """A TrainConfig whose ``checkpoint`` group holds these values."""
    cfg = TrainConfig()
    cfg.checkpoint.keep_last = keep_last
    cfg.checkpoint.best_metric = best_metric
    cfg.checkpoint.best_mode = best_mode
    return cfg


#: How the contract's killed writer starts: a new interpreter (no OpenMP pool forked
#: from pytest's, which can deadlock a forked child) that imports the contract class.
_KILLED_WRITER = ("import sys, torch; torch.set_num_threads(1); import engine.testing as t; "
                  "t.save_until_killed(*sys.argv[1:])")


def save_until_killed(contract: str, directory: str, numel: str) -> None:
    """The writer that the contract kills: ``contract`` (``module:Class``) makes the
    checkpointer, which saves :func:`contract_state` of steps 2, 3, ... until killed."""
    module, _, qualname = contract.partition(":")
    cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    checkpointer = cls().make_checkpointer(pathlib.Path(directory), contract_config())
    step = 1
    while True:
        step += 1
        checkpointer.save(contract_state(step, int(numel)), epoch=step, step=step)
        checkpointer.wait()


def _in_flight(directory: pathlib.Path) -> list[str]:
    """Writes under way (or killed): temp files and staging folders, named ".*"."""
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def _wait_until_group_is_gone(group: int, timeout: float = 60) -> None:
    """Until process group ``group`` has no live process (zombies count as gone): one
    SIGKILLed in an fsync lives on, and its temp file would pass for a live writer's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_processes(group):
            return
        time.sleep(0.01)
    raise AssertionError(f"processes of the killed writer still run after {timeout:g} s")


class CheckpointerContract:
    """What the engine relies on from a checkpointer, as tests. Subclass it in a test
    module and name your class; pytest runs every check against it::

        class TestMyStore(CheckpointerContract):
            checkpointer_class = MyStore

    The checks are the ``test_`` methods below (docs/plugins.md, "Testing a plugin",
    lists them).

    Override :meth:`make_checkpointer` when the class needs more than
    ``(directory, cfg)``. The killed write runs in a new process that imports the test
    class by its module and name, so define it at the top level of a test module
    pytest can import by name (a rootdir-relative module, as pytest's importlib and
    prepend modes give). A check that does not apply to a class (a format that keeps
    no ``best``) is overridden in the subclass with a ``pytest.skip`` saying why.
    """

    #: The checkpointer class under test.
    checkpointer_class: type | None = None
    #: Elements (four bytes each) of the killed writer's largest tensor: a write that lasts.
    killed_write_numel: int = 8 << 20

    def make_checkpointer(self, directory: pathlib.Path, cfg):
        """A checkpointer of the class under test, storing in ``directory``."""
        return self.checkpointer_class(directory, cfg)

    @pytest.fixture
    def open_checkpointer(self, tmp_path):
        """``open_checkpointer(keep_last=0, best_metric="", best_mode="max",
        directory=None)``: one in ``tmp_path/checkpoints``, closed after the test."""
        made = []

        def open_(keep_last: int = 0, best_metric: str = "", best_mode: str = "max",
                  directory=None):
            checkpointer = self.make_checkpointer(
                pathlib.Path(directory or tmp_path / "checkpoints"),
                contract_config(keep_last, best_metric, best_mode))
            made.append(checkpointer)
            return checkpointer

        yield open_
        for checkpointer in made:
            checkpointer.close()

    # ---------------------------------------------------------------- checks

    def test_save_latest_load_round_trip(self, open_checkpointer):
        ck = open_checkpointer()
        assert ck.latest() is None and ck.snapshots() == []
        first = ck.save(contract_state(1), epoch=1, step=10, metrics={"val/loss": 2.0})
        second = ck.save(contract_state(2), epoch=1, step=20, metrics={"val/loss": 1.0})
        ck.wait()
        assert first != second and ck.snapshots() == [first, second]
        assert ck.latest() == second
        assert ck.verify(first) is None and ck.verify(second) is None
        assert_same_snapshot(ck.load(second), contract_state(2))
        assert_same_snapshot(ck.load(first, map_location="cpu"), contract_state(1))
        next_run = open_checkpointer()
        assert next_run.latest() == second and next_run.snapshots() == [first, second]
        assert_same_snapshot(next_run.load(second), contract_state(2))

    def test_a_snapshot_saved_again_under_its_name_replaces_the_old_one_whole(
            self, open_checkpointer):
        ck = open_checkpointer()
        ck.save(contract_state(1), epoch=3, step=7)
        path = ck.save(contract_state(2), epoch=3, step=7)
        ck.wait()
        assert ck.snapshots() == [path] and ck.latest() == path
        assert_same_snapshot(ck.load(path), contract_state(2))

    def test_keep_last_prunes_the_oldest(self, open_checkpointer):
        ck = open_checkpointer(keep_last=2)
        paths = [ck.save(contract_state(step), epoch=step, step=step) for step in (1, 2, 3, 4)]
        ck.wait()
        assert ck.snapshots() == paths[2:]
        assert not any(path.exists() for path in paths[:2])
        assert ck.latest() == paths[3]
        assert_same_snapshot(ck.load(paths[2]), contract_state(3))

    @pytest.mark.parametrize("mode, values, best_index", [
        ("max", [0.2, 0.9, 0.4, 0.5, 0.3], 1), ("min", [0.5, 0.1, 0.4, 0.3, 0.2], 1)])
    def test_best_is_pointed_at_and_never_pruned(self, open_checkpointer, mode, values,
                                                 best_index):
        ck = open_checkpointer(keep_last=2, best_metric="val/score", best_mode=mode)
        assert ck.best() is None
        paths = [ck.save(contract_state(step), epoch=step, step=step,
                         metrics={"val/score": value})
                 for step, value in enumerate(values, start=1)]
        ck.wait()
        best = paths[best_index]
        assert ck.best() == best
        assert ck.snapshots() == [best, *paths[-2:]]
        assert ck.latest() == paths[-1]
        assert_same_snapshot(ck.load(best), contract_state(best_index + 1))

    def test_resolve_takes_a_pointer_or_a_folder_for_the_snapshot_it_names(
            self, open_checkpointer):
        ck = open_checkpointer(best_metric="val/score")
        best = ck.save(contract_state(1), epoch=1, step=1, metrics={"val/score": 1.0})
        latest = ck.save(contract_state(2), epoch=2, step=2, metrics={"val/score": 0.0})
        ck.wait()
        folder = ck.directory
        for given in (folder / "latest", folder, folder.parent):
            assert ck.resolve(str(given)) == latest, given
        assert ck.resolve(str(folder / "best")) == best
        assert ck.resolve(str(best)) == best  # a snapshot is itself
        missing = folder.parent / "nope"
        assert ck.resolve(str(missing)) == missing

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_verify_reports_a_damaged_snapshot_and_latest_skips_it(self, open_checkpointer,
                                                                     how):
        ck = open_checkpointer()
        first = ck.save(contract_state(1), epoch=1, step=1)
        second = ck.save(contract_state(2), epoch=2, step=2)
        ck.wait()
        corrupt_snapshot(second, how)
        problem = ck.verify(second)
        assert isinstance(problem, str) and problem, problem
        assert ck.verify(first) is None
        assert ck.latest() == first
        assert_same_snapshot(ck.load(first), contract_state(1))

    def test_a_write_killed_half_way_leaves_the_previous_snapshot_usable(
            self, open_checkpointer, tmp_path):
        """A real writer process, SIGKILLed (with its process group: a store's helper
        processes too) as soon as its write has put something in the folder, up to
        three times until one kill leaves the write unfinished."""
        ck = open_checkpointer()
        first = ck.save(contract_state(1), epoch=1, step=1)
        ck.close()
        env = engine_env({"PYTHONPATH": os.pathsep.join(filter(None, sys.path))})
        contract = f"{type(self).__module__}:{type(self).__qualname__}"
        for _ in range(3):
            before = set(os.listdir(ck.directory))
            proc = subprocess.Popen(
                [sys.executable, "-c", _KILLED_WRITER, contract, str(ck.directory),
                 str(self.killed_write_numel)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            try:
                deadline = time.monotonic() + 120
                while set(os.listdir(ck.directory)) == before:  # the write has begun
                    assert proc.poll() is None, f"the writer exited:\n{proc.communicate()[1]}"
                    assert time.monotonic() < deadline, "no write started in 120 s"
                    time.sleep(0.001)
                os.killpg(proc.pid, signal.SIGKILL)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=60)
            _wait_until_group_is_gone(proc.pid)
            unfinished = _in_flight(ck.directory)
            next_run = open_checkpointer()
            chosen = next_run.latest()
            assert chosen is not None
            if unfinished:  # the kill landed inside the write: it never counted
                assert chosen == first, (chosen, unfinished)
            loaded = next_run.load(chosen)
            assert_same_snapshot(loaded, contract_state(loaded["step"], loaded["model"][
                "fc.weight"].numel()))
            assert _in_flight(ck.directory) == [], "the next start left leftovers"
            if unfinished:
                return
        pytest.fail("three kills, each after its write had finished: make "
                    "killed_write_numel larger")

    def test_close_may_be_called_twice(self, open_checkpointer, tmp_path):
        ck = open_checkpointer()
        path = ck.save(contract_state(1), epoch=1, step=1)
        ck.close()
        ck.close()
        assert ck.latest() == path
        unused = open_checkpointer(directory=tmp_path / "unused")
        unused.close()
        unused.close()
        assert not (tmp_path / "unused").exists(), "closing one that never saved wrote"
