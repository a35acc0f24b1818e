"""engine/model_io.py: engine.load_model and engine-run export on a real completed run
(the session's 2-process reference run of tests/recipes/tiny_resume.py), and, on
snapshots the torch-file store writes here, the choice of best or latest, the run's
overrides in the rebuilt model, the recipe the run recorded, and the one-line errors.
The fsdp runs (torch-file and dcp snapshots) are loaded in tests/plugins/test_fsdp.py,
the language model (its sample regenerated) in tests/recipes/test_char_lm.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import engine
from engine.checkpoint import model_digest
from engine.config import to_dict
from engine.errors import CheckpointError
from engine.plugins.torch_file import TorchFileCheckpointer
from tests.conftest import run_cli_here

RECIPE = '''\
import attrs
from torch import nn
from engine import TrainConfig


@attrs.define
class Config(TrainConfig):
    width: int = 3


def build_model(cfg):
    return nn.Sequential(nn.Linear(2, cfg.width), nn.ReLU(), nn.Linear(cfg.width, 1))


def build_datasets(cfg, ctx):
    raise AssertionError("load_model builds the model only")


def build_optimizer(cfg, model):
    raise AssertionError("load_model builds the model only")


def train_step(batch, ctx):
    raise AssertionError("load_model builds the model only")
'''


def test_the_reference_run_loads_with_its_trained_weights_and_exports(reference,
                                                                      tmp_path):
    """A completed 2-process DDP run: the model from its folder has exactly the weights
    the workers ended with (summary.json's digest, taken from the live model), and
    engine-run export writes the same weights under the same keys."""
    from safetensors.torch import load_file

    digest = reference[2]
    run = reference.folders[2]
    model = engine.load_model(run)
    assert not model.training  # ready for inference
    assert model_digest(model.state_dict()) == digest
    assert engine.load_model(run / "checkpoints" / "latest").state_dict().keys() == (
        model.state_dict().keys())

    out = tmp_path / "model.safetensors"
    proc = run_cli_here("export", str(run), str(out))
    assert proc.returncode == 0, proc.stderr
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert proc.stdout.startswith(f"wrote {out}: 4 tensors, model digest {digest}, ")
    assert proc.stdout.endswith(f" (from {latest})\n")
    weights = load_file(out)
    assert sorted(weights) == sorted(model.state_dict())  # plain keys: no module.
    assert model_digest(weights) == digest


@pytest.fixture
def run(tmp_path):
    """A run folder as the engine leaves it, written by the torch-file store: a recipe
    file, config.json and summary.json, snapshots of a model trained with width=5 (the
    recipe's default is 3) at epochs 1-3, the best by val/loss at epoch 2."""
    from engine.recipe import load_recipe

    recipe = tmp_path / "recipes" / "widths.py"
    recipe.parent.mkdir()
    recipe.write_text(RECIPE)
    loaded = load_recipe(recipe)
    cfg = loaded.make_config()
    cfg.width = 5
    cfg.checkpoint.best_metric = "val/loss"
    folder = tmp_path / "run"
    store = TorchFileCheckpointer(folder / "checkpoints", cfg)
    models = {}
    for epoch, loss in ((1, 0.9), (2, 0.2), (3, 0.5)):
        torch.manual_seed(epoch)
        models[epoch] = loaded.module.build_model(cfg)
        store.save({"engine_version": engine.__version__, "config": to_dict(cfg),
                    "recipe": str(recipe), "model": models[epoch].state_dict()},
                   epoch=epoch, step=epoch, metrics={"val/loss": loss})
    (folder / "config.json").write_text(json.dumps(to_dict(cfg)))
    (folder / "summary.json").write_text(json.dumps({"recipe": str(recipe)}))
    return folder, recipe, models


def test_best_or_latest_with_the_runs_own_width(run):
    folder, _, models = run
    x = torch.randn(7, 2)
    for which, epoch in ((None, 3), ("latest", 3), ("best", 2)):
        model = engine.load_model(folder, which)
        assert model[0].out_features == 5  # the run's width=5, not the recipe's 3
        assert model_digest(model.state_dict()) == model_digest(models[epoch].state_dict())
        torch.testing.assert_close(model(x), models[epoch].eval()(x), rtol=0, atol=0)
    # A snapshot itself, or its checkpoints folder.
    snapshot = next((folder / "checkpoints").glob("snapshot-e0002-*.pt"))
    assert model_digest(engine.load_model(snapshot).state_dict()) == model_digest(
        models[2].state_dict())
    assert engine.load_model(folder / "checkpoints", "best")[0].out_features == 5


def test_the_recipe_from_summary_json_or_given(run, tmp_path):
    """A snapshot written before snapshots recorded their recipe: the run's
    summary.json names it. A recipe moved away: refused in one line; given: used."""
    folder, recipe, models = run
    snapshot = next((folder / "checkpoints").glob("snapshot-e0003-*.pt"))
    state = torch.load(snapshot, weights_only=True)
    del state["recipe"]
    older = folder / "checkpoints" / "older.pt"
    torch.save(state, older)
    assert model_digest(engine.load_model(older).state_dict()) == model_digest(
        models[3].state_dict())

    moved = tmp_path / "elsewhere.py"
    shutil.move(recipe, moved)
    with pytest.raises(CheckpointError) as info:
        engine.load_model(folder)
    assert str(info.value) == (
        f"{snapshot} was trained with the recipe {recipe}, which is not there now; pass "
        "where it is: load_model(..., recipe=PATH)")
    assert engine.load_model(folder, recipe=str(moved))[0].out_features == 5


@pytest.mark.parametrize("case", ["bad-which", "no-best", "which-of-a-snapshot",
                                  "plain-weights", "missing"])
def test_bad_input_is_one_line(case, run, tmp_path):
    folder, _, _ = run
    which = None
    if case == "bad-which":
        target, which = folder, "newest"
        expected = "which snapshot: 'newest' is not one of: latest, best"
    elif case == "no-best":
        (folder / "checkpoints" / "best").unlink()
        target, which = folder, "best"
        expected = (f"{folder} holds no best snapshot (no best pointer in it or in its "
                    "checkpoints folder) (the run did not set checkpoint.best_metric, or "
                    "it ended before a validation)")
    elif case == "which-of-a-snapshot":
        target, which = next((folder / "checkpoints").glob("*.pt")), "best"
        expected = (f"{target} is not a run folder: 'best' chooses among a run's "
                    "snapshots; give the run's out_dir, or the snapshot without choosing")
    elif case == "plain-weights":
        target = tmp_path / "weights.pt"
        torch.save({"0.weight": torch.ones(5, 2)}, target)
        expected = (f"{target} holds no config and no config.json is beside it: not an "
                    "engine snapshot, so the model cannot be rebuilt (engine-run export "
                    "gives its weights)")
    else:
        target = tmp_path / "nothing"
        expected = f"{target}: no such file or directory"
    with pytest.raises(CheckpointError) as info:
        engine.load_model(target, which)
    assert str(info.value) == expected


def test_a_snapshot_with_a_flipped_weight_byte_is_refused_as_resume_refuses_it(run,
                                                                               tmp_path):
    """One byte of a weight flipped in the latest snapshot: torch.load reads it without
    a word, so export wrote (and load_model returned) the wrong weights with exit 0;
    now both check its manifest first, as --resume does."""
    folder, _, models = run
    snapshot = next((folder / "checkpoints").glob("snapshot-e0003-*.pt"))
    data = bytearray(snapshot.read_bytes())
    weight = models[3][0].weight.detach().numpy().tobytes()
    at = data.find(weight)
    assert at > 0 and data.find(weight, at + 1) < 0
    data[at + 5] ^= 0x10
    snapshot.write_bytes(bytes(data))
    problem = TorchFileCheckpointer(snapshot.parent).verify(snapshot)
    expected = f"snapshot {snapshot} fails its check ({problem}); give another snapshot"
    with pytest.raises(CheckpointError) as info:
        engine.load_model(folder)
    assert str(info.value) == expected
    out = tmp_path / "model.pt"
    proc = run_cli_here("export", str(folder), str(out))
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2, "", f"engine-run: error: {expected}\n")
    assert not out.exists()


@pytest.mark.parametrize("absolute", [False, True])
def test_a_pointer_that_leaves_its_folder_is_refused_naming_what_it_points_at(
        run, tmp_path, absolute):
    """A latest pointer naming a snapshot outside the checkpoints folder: the run folder
    was said to have no pointer, the checkpoints folder loaded the file it named."""
    folder, _, _ = run
    pointer = folder / "checkpoints" / "latest"
    shutil.copy(pointer.parent / pointer.read_text().strip(), tmp_path / "elsewhere.pt")
    name = str(tmp_path / "elsewhere.pt") if absolute else "../../elsewhere.pt"
    pointer.write_text(name + "\n")
    expected = (f"the pointer {pointer} names {name!r}, not a snapshot in its folder; "
                "give the snapshot itself, or write its file name there")
    for given, which in ((folder, None), (folder / "checkpoints", None), (pointer, None),
                         (folder, "latest")):
        with pytest.raises(CheckpointError) as info:
            engine.load_model(given, which)
        assert str(info.value) == expected


def test_export_best_and_a_bad_choice_from_the_command_line(run, tmp_path):
    folder, _, models = run
    out = tmp_path / "best.pt"
    proc = run_cli_here("export", str(folder), str(out), "--which", "best")
    assert proc.returncode == 0, proc.stderr
    assert model_digest(torch.load(out, weights_only=True)) == model_digest(
        models[2].state_dict())
    (folder / "checkpoints" / "best").unlink()
    proc = run_cli_here("export", str(folder), str(out), "--which", "best")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.startswith(f"engine-run: error: {folder} holds no best snapshot")
    assert proc.stderr.count("\n") == 1


def test_a_latest_snapshot_linked_to_another_runs_file_is_refused(run, tmp_path):
    """The file latest names is a symbolic link to another run's snapshot: load_model
    and engine-run export refuse it in one line naming where it points."""
    from engine.commands import export

    folder, _, _ = run
    other = tmp_path / "other.pt"
    pointer = folder / "checkpoints" / "latest"
    shutil.copy(pointer.parent / pointer.read_text().strip(), other)
    (pointer.parent / "linked.pt").symlink_to(other)
    pointer.write_text("linked.pt\n")
    expected = (f"{pointer} names linked.pt, a link to {other.resolve()}, outside its "
                "folder; give that snapshot itself if it is the one meant")
    for call in (lambda: engine.load_model(folder),
                 lambda: export.main([str(folder), str(tmp_path / "out.pt")])):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value) == expected
    assert not (tmp_path / "out.pt").exists()
    assert engine.load_model(other, recipe=str(tmp_path / "recipes" / "widths.py"))


def test_a_recipe_that_came_inside_the_run_folder_is_imported_only_when_trusted(run):
    """A run folder naming a recipe file inside itself (someone else's run, with its
    code): load_model refuses to import it unless told trust_recipe=True."""
    folder, recipe, _ = run
    shipped = folder / "recipe.py"
    shipped.write_text(RECIPE.replace("width: int = 3", "width: int = 5"))
    snapshot = folder / "checkpoints" / (folder / "checkpoints" / "latest").read_text().strip()
    state = torch.load(snapshot, weights_only=True)
    TorchFileCheckpointer(folder / "checkpoints").save(
        {**state, "recipe": str(shipped)}, epoch=4, step=4, metrics={})
    latest = folder / "checkpoints" / (folder / "checkpoints" / "latest").read_text().strip()
    with pytest.raises(CheckpointError) as info:
        engine.load_model(folder)
    assert str(info.value) == (
        f"{latest} names the recipe {shipped}, inside the run folder {folder.resolve()}: "
        "it came with the run, and importing it runs its code; pass "
        "load_model(..., trust_recipe=True) or recipe=PATH")
    assert engine.load_model(folder, trust_recipe=True)[0].out_features == 5
    assert engine.load_model(folder, recipe=str(recipe))[0].out_features == 5
