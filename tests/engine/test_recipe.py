from __future__ import annotations

import pytest

from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.recipe import load_recipe, recipe_from_object

GOOD = '''
import attrs, torch
from engine import TrainConfig
from engine.classification import eval_step, train_step  # (inputs, targets) batches

@attrs.define
class Config(TrainConfig):
    width: int = 4

def build_model(cfg):
    return torch.nn.Linear(cfg.width, 2)

def build_datasets(cfg, ctx):
    return None, None

def build_optimizer(cfg, model):
    return torch.optim.SGD(model.parameters(), lr=cfg.lr)
'''


def test_loads_a_recipe_and_its_config(tmp_path):
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    recipe = load_recipe(path)
    assert recipe.name == "good"
    assert recipe.make_config().width == 4
    assert recipe.optional("build_scheduler") is None


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"recipe file '.*nope\.py' not found"):
        load_recipe(tmp_path / "nope.py")


def test_a_recipe_that_raises_names_file_and_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import os\n\nx = 1\nraise ValueError('bad value here')\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert str(info.value) == f"recipe '{path}' line 4: ValueError: bad value here"


def test_a_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "syntax.py"
    path.write_text("x = 1\ndef f(:\n")
    with pytest.raises(ConfigError, match=rf"recipe '{path}' line 2: SyntaxError"):
        load_recipe(path)


def test_an_import_error_deep_in_the_recipe_names_its_line(tmp_path):
    path = tmp_path / "imports.py"
    path.write_text("import attrs\nimport no_such_module_xyz\n")
    with pytest.raises(ConfigError, match=r"line 2: ModuleNotFoundError: No module named"):
        load_recipe(path)


def test_missing_factories_are_listed(tmp_path):
    path = tmp_path / "partial.py"
    path.write_text("def build_model(cfg):\n    pass\n")
    with pytest.raises(ConfigError, match="does not define Config, build_datasets, "
                                          "build_optimizer"):
        load_recipe(path)


def test_config_must_subclass_train_config(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(GOOD.replace("class Config(TrainConfig)", "class Config"))
    with pytest.raises(ConfigError, match="Config must be an attrs class that subclasses "
                                          "engine.TrainConfig"):
        load_recipe(path)


def test_a_recipe_without_steps_is_told_what_to_define(tmp_path):
    path = tmp_path / "no_steps.py"
    path.write_text(GOOD.replace(
        "from engine.classification import eval_step, train_step  # (inputs, targets) "
        "batches\n", ""))
    with pytest.raises(ConfigError) as error:
        load_recipe(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"recipe {str(path)!r} defines no "
                                                       "train_step: define train_step(batch")
    assert message.endswith("from engine.classification import eval_step, train_step")

    class WithoutEval:
        Config, build_model, build_datasets, build_optimizer = (
            TrainConfig, None, None, None)
        train_step = staticmethod(lambda batch, ctx: None)

    with pytest.raises(ConfigError, match="'WithoutEval' returns a validation set but "
                                          "defines no eval_step: define"):
        recipe_from_object(WithoutEval).check_eval_step()
