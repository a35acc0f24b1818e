"""engine/checkpoint.py: the storage-only checkpointer interface, held by every
built-in checkpointer (save / latest / load round trip, a corrupt newest snapshot
skipped for the previous good one, no Engine anywhere), the snapshot store they are
built on (pointer resolution for --resume, the one place that knows the layout), and
the state-dict helpers. engine.testing's checkpointer contract runs against each
built-in in tests/plugins/test_checkpointer_contract.py."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

from engine.checkpoint import Checkpointer, SnapshotStore
from engine.config import TrainConfig
from engine.plugin_manager import build_plugin_manager
from engine.plugins.torch_file import TorchFileCheckpointer
from engine.testing import corrupt_snapshot as corrupt

REPO = pathlib.Path(__file__).resolve().parents[2]

BUILT_IN = ("torch-file", "async", "dcp")
#: As parameters: the async checkpointer starts a writer process (seconds): not in the
#: quick loop.
CHECKPOINTERS = [pytest.param(name, marks=pytest.mark.slow) if name == "async" else name
                 for name in BUILT_IN]


def built_in_checkpointers() -> dict[str, type]:
    registry = build_plugin_manager([]).checkpointers
    return {name: registry.get(name) for name in BUILT_IN}


def snapshot_for(step: int) -> dict:
    """A snapshot-shaped dict whose every tensor holds ``step``: easy to check whole.
    The optimizer is keyed by parameter name, the form every format stores."""
    return {"model": {"fc.weight": torch.full((6, 4), float(step)),
                      "fc.bias": torch.full((6,), float(step))},
            "optimizer": {"state": {"fc.weight": {"momentum_buffer":
                                                  torch.full((6, 4), float(step))}},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9,
                                            "params": ["fc.weight", "fc.bias"]}]},
            "epoch": step, "step": step, "config": {"lr": 0.1}}


def assert_is(loaded: dict, step: int) -> None:
    assert (loaded["epoch"], loaded["step"], loaded["config"]) == (step, step, {"lr": 0.1})
    for name, tensor in snapshot_for(step)["model"].items():
        assert torch.equal(loaded["model"][name], tensor), name


@pytest.fixture(params=CHECKPOINTERS)
def checkpointer(request, tmp_path):
    made = built_in_checkpointers()[request.param](tmp_path / "checkpoints", TrainConfig())
    yield made
    made.close()


def test_save_latest_load_round_trip(checkpointer):
    assert checkpointer.latest() is None
    first = checkpointer.save(snapshot_for(1), epoch=1, step=1, metrics={"val/loss": 2.0})
    second = checkpointer.save(snapshot_for(2), epoch=2, step=2, metrics={"val/loss": 1.0})
    checkpointer.wait()
    assert first != second and checkpointer.latest() == second
    assert_is(checkpointer.load(second), 2)
    assert_is(checkpointer.load(first, map_location="cpu"), 1)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupt_newest_snapshot_is_reported_and_the_previous_good_one_used(
        checkpointer, how, capsys):
    first = checkpointer.save(snapshot_for(1), epoch=1, step=1)
    second = checkpointer.save(snapshot_for(2), epoch=2, step=2)
    checkpointer.wait()
    corrupt(second, how)
    assert checkpointer.latest() == first
    err = capsys.readouterr().err
    assert f"snapshot {second} is unusable: " in err
    assert ("differs from the manifest (corrupt)" if how == "flip" else "(truncated?)") in err
    # What --resume PATH asks (engine.snapshot): the same check, by path.
    assert checkpointer.verify(first) is None
    assert checkpointer.verify(second) is not None
    assert_is(checkpointer.load(first), 1)


def test_a_snapshot_saved_again_under_its_name_replaces_the_old_one_whole(checkpointer):
    checkpointer.save(snapshot_for(1), epoch=3, step=7)
    path = checkpointer.save(snapshot_for(2), epoch=3, step=7)
    checkpointer.wait()
    assert checkpointer.latest() == path
    assert_is(checkpointer.load(path), 2)


def test_the_interface_is_storage_only():
    """save(state, epoch, step, metrics) / load(path) / latest() / wait() / close():
    no member takes the engine, and the engine-side methods are gone."""
    allowed = {"self", "state", "epoch", "step", "metrics", "path", "map_location",
               "template"}
    for cls in (Checkpointer, *built_in_checkpointers().values()):
        for member in ("save", "load", "latest", "wait", "close"):
            params = set(inspect.signature(getattr(cls, member)).parameters)
            assert params <= allowed, f"{cls.__name__}.{member} takes {params - allowed}"
        assert not hasattr(cls, "save_snapshot") and not hasattr(cls, "restore_snapshot")


def test_listing_and_resume_resolution_are_the_interface_not_duck_typing():
    """The core calls snapshots() and resolve() on any checkpointer: the interface has
    them (a checkpointer without pointers answers with the path given), and
    engine.snapshot neither probes for them nor knows the pointer files."""
    bare = Checkpointer(pathlib.Path("nowhere"))
    assert bare.snapshots() == [] and bare.resolve("runs/x") == pathlib.Path("runs/x")
    assert bare.verify(pathlib.Path("x.pt")) is None and bare.best() is None
    source = (REPO / "engine" / "snapshot.py").read_text()
    assert "getattr(eng.checkpointer" not in source and "POINTERS" not in source


def test_the_file_checkpointers_are_stores_importing_nothing_private_from_each_other():
    for cls in built_in_checkpointers().values():
        assert issubclass(cls, SnapshotStore), cls
    for name in ("torch_file", "async_file", "dcp"):
        tree = ast.parse((REPO / "plugins" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "engine.plugins."):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"plugins/{name}.py imports {private} from {node.module}"


def test_resume_takes_a_pointer_file_or_a_run_folder_as_the_snapshot_it_names(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    snapshot = folder / "snapshot-e0002-s00000012.pt"
    snapshot.write_bytes(b"x")
    (folder / "latest").write_text(snapshot.name + "\n")
    (folder / "best").write_text("snapshot-e0001-s00000006.pt\n")
    store = TorchFileCheckpointer(folder)
    for given in (folder / "latest", folder, tmp_path / "run"):
        assert store.resolve(str(given)) == snapshot
    assert store.resolve(str(folder / "best")) == folder / "snapshot-e0001-s00000006.pt"
    assert store.resolve(str(snapshot)) == snapshot  # a snapshot is itself
    assert store.resolve(str(tmp_path / "nope")) == tmp_path / "nope"
    # A file that merely has a pointer's name but is not one: taken as given.
    (tmp_path / "latest").write_bytes(b"\xff\xfe")
    assert store.resolve(str(tmp_path / "latest")) == tmp_path / "latest"
