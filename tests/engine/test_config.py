from __future__ import annotations

import json
import pathlib
import sys
from typing import Literal

import attrs
import pytest

from engine.config import TrainConfig, to_dict
from engine.overrides import apply_overrides, convert
from engine.errors import ConfigError


@attrs.define
class Data:
    root: str = "./data"
    source: Literal["auto", "cifar10", "synthetic"] = "auto"
    size: int = 10
    path: pathlib.Path | None = None


@attrs.define
class Config(TrainConfig):
    data: Data = attrs.Factory(Data)
    scales: tuple[float, ...] = (0.5, 1.0)


def test_overrides_convert_by_field_type():
    cfg = apply_overrides(Config(), [
        "epochs=3", "lr=0.5", "data.root=/data", "data.source=synthetic", "drop_last=yes",
        "data.path=/x/y", "scales=0.25,2", "num_workers=auto",
    ])
    assert cfg.epochs == 3 and cfg.lr == 0.5 and cfg.drop_last is True
    assert cfg.data.root == "/data" and cfg.data.source == "synthetic"
    assert cfg.data.path == pathlib.Path("/x/y")
    assert cfg.scales == (0.25, 2.0)
    assert cfg.num_workers == "auto"
    assert apply_overrides(Config(), ["num_workers=3"]).num_workers == 3
    assert apply_overrides(Config(), ["data.path=none"]).data.path is None


def test_a_switched_group_takes_true_or_false_for_its_enabled_field():
    cfg = apply_overrides(Config(), ["compile=true", "compile.regional=Block,Head"])
    assert cfg.compile.enabled is True and cfg.compile.regional == ("Block", "Head")
    assert apply_overrides(cfg, ["compile=false"]).compile.enabled is False
    with pytest.raises(ConfigError, match="config key 'compile.enabled': 'fast' is not "
                                          "true or false"):
        apply_overrides(Config(), ["compile=fast"])


@pytest.mark.parametrize("override, message", [
    ("epoch=3", "unknown config key 'epoch'; did you mean 'epochs'?"),
    ("data.rot=/x", "unknown config key 'data.rot' ('data' has no field 'rot')"),
    ("epochs=three", "config key 'epochs': 'three' is not an integer"),
    ("lr=fast", "config key 'lr': 'fast' is not a number"),
    ("data.source=imagenet",
     "config key 'data.source': 'imagenet' is not one of: auto, cifar10, synthetic"),
    ("precision=fp8", "config key 'precision': 'fp8' is not one of: 32, bf16, fp16"),
    ("drop_last=maybe", "config key 'drop_last': 'maybe' is not true or false"),
    ("compile.mode=fastest", "config key 'compile.mode': 'fastest' is not one of: default, "
     "reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
    ("data=x", "config key 'data' is a group; set one of its fields, e.g. data.root=..."),
    ("epochs", "override 'epochs' is not of the form key=value"),
    ("epochs=0", "config key 'epochs': 0 is not allowed; it must be >= 1"),
    ("init_method=http://x", "config key 'init_method': 'http://x' is not allowed"),
    ("timeout_s=0", "config key 'timeout_s': 0.0 must be > 0 (the seconds any wait for "
     "another rank may take)"),
    ("checkpoint.keep_last=-1", "config key 'checkpoint.keep_last': -1 must be >= 0 (0 keeps "
     "every snapshot)"),
    ("checkpoint.every_steps=-5", "config key 'checkpoint.every_steps': -5 must be >= 0 (0 "
     "never by step count)"),
    ("checkpoint.memory_every_steps=foo", "config key 'checkpoint.memory_every_steps': "
     "'foo' is not an integer or one of: auto"),
    ("checkpoint.memory_every_steps=-1", "config key 'checkpoint.memory_every_steps': -1 "
     "must be >= 0 (0 no in-memory snapshots) or auto"),
])
def test_bad_override_is_one_clear_line(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [override])
    text = str(info.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("override, message", [
    ("epoch=1", "unknown config key 'epoch'; did you mean 'epochs'? "),
    ("lrr=1", "unknown config key 'lrr'; did you mean 'lr'? "),
    ("checkpoint.keep_lats=1", "unknown config key 'checkpoint.keep_lats' ('checkpoint' has "
     "no field 'keep_lats'); did you mean 'checkpoint.keep_last'? "),
    # Nothing close in a group: its own keys, which are few.
    ("data.zzz=1", "unknown config key 'data.zzz' ('data' has no field 'zzz'); 'data' has: "
     "root, source, size, path "),
    ("nope=1", "unknown config key 'nope' "),
])
def test_an_unknown_key_names_the_closest_and_where_every_key_is(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [override])
    assert str(info.value) == message + "(every key: engine-run RECIPE --dry-run -v)"


def test_the_memory_interval_is_auto_by_default_or_the_integer_given():
    assert Config().checkpoint.memory_every_steps == "auto"
    for text, value in (("auto", "auto"), ("0", 0), ("1", 1), ("250", 250)):
        cfg = apply_overrides(Config(), [f"checkpoint.memory_every_steps={text}"])
        assert cfg.checkpoint.memory_every_steps == value


def test_convert_rejects_what_does_not_fit():
    with pytest.raises(ValueError):
        convert("x", int)
    assert convert("OFF", bool) is False


def test_to_dict_is_plain_data():
    d = to_dict(apply_overrides(Config(), ["data.path=/p"]))
    assert d["data"]["path"] == "/p"
    assert d["checkpoint"]["best_mode"] == "auto"  # a nested group: a plain dict
    assert d["scales"] == [0.5, 1.0]


def test_an_out_dir_that_is_a_file_is_one_clear_line(tmp_path):
    """Not a FileExistsError traceback in every worker."""
    from engine.config import check

    afile = tmp_path / "notes.txt"
    afile.write_text("")
    with pytest.raises(ConfigError, match="^config key 'out_dir': '.*notes.txt' cannot be "
                       "the run's folder: it is a file; give a folder"):
        check(TrainConfig(out_dir=str(afile)))
    with pytest.raises(ConfigError, match=r"\(.*notes.txt is not a folder\)"):
        check(TrainConfig(out_dir=str(afile / "run")))
    check(TrainConfig(out_dir=str(tmp_path / "new" / "run")))  # created later: fine


# ------------------------------------------------------------------ config files

TOML = """
epochs = 3
"data.root" = "/data"
[data]
source = "synthetic"
path = "/x/y"
[checkpoint]
keep_last = 1
"""
YAML = """
epochs: 3
data.root: /data
data: {source: synthetic, path: /x/y}
checkpoint:
  keep_last: 1
"""
JSON = ('{"epochs": 3, "data.root": "/data", "data": {"source": "synthetic", '
        '"path": "/x/y"}, "checkpoint": {"keep_last": 1}}')


@pytest.mark.parametrize("suffix, text", [(".toml", TOML), (".yaml", YAML), (".json", JSON)])
def test_a_config_file_holds_the_same_overrides_nested_or_dotted(tmp_path, suffix, text):
    from engine.overrides import load_config_file

    path = tmp_path / f"exp{suffix}"
    path.write_text(text)
    cfg = apply_overrides(Config(), load_config_file(str(path)))
    assert (cfg.epochs, cfg.data.root, cfg.data.source) == (3, "/data", "synthetic")
    assert cfg.data.path == pathlib.Path("/x/y") and cfg.checkpoint.keep_last == 1


@pytest.mark.parametrize("name, text, message", [
    ("bad.toml", "epochs = [", "--config {path}: not valid TOML: "),
    ("bad.json", "{", "--config {path}: not valid JSON: "),
    ("list.json", "[1]", "--config {path}: the file must hold a table of keys (key = "
                         "value), not a list"),
    ("exp.ini", "", "--config {path}: use a .toml, .yaml/.yml or .json file"),
    ("missing.toml", None, "--config {path}: cannot read it: No such file or directory"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, name, text, message):
    from engine.overrides import load_config_file

    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config_file(str(path))
    assert str(info.value).startswith(message.format(path=path))
    assert "\n" not in str(info.value)


def test_yaml_without_pyyaml_says_what_to_install(tmp_path, monkeypatch):
    from engine.overrides import load_config_file

    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    (tmp_path / "exp.yml").write_text("epochs: 3\n")
    with pytest.raises(ConfigError, match=r"^--config .*exp.yml: reading YAML needs PyYAML "
                       r"\(pip install pyyaml\); or give a .toml or .json file$"):
        load_config_file(str(tmp_path / "exp.yml"))


def test_a_runs_config_json_reproduces_it_elsewhere(tmp_path):
    """config.json as the engine writes it (engine/context.py): every key comes back but
    where the run wrote and how it was launched."""
    from engine.overrides import NOT_REPRODUCED, load_config_file

    run = tmp_path / "runs" / "version_3"
    run.mkdir(parents=True)
    old = apply_overrides(Config(), [f"out_dir={run}", "launcher=torchrun", "epochs=5",
                                     "data.path=/p", "scales=2", "grad_clip_norm=1.5",
                                     "num_workers=auto", "init_method=tcp://h:1"])
    (run / "config.json").write_text(json.dumps(to_dict(old), indent=1))
    overrides = load_config_file(str(run / "config.json"))
    assert not {o.partition("=")[0] for o in overrides} & set(NOT_REPRODUCED)
    again = apply_overrides(Config(), overrides)
    assert again == attrs.evolve(old, out_dir="runs/default", launcher="auto",
                                 init_method="env://")
    # A hand-written JSON file's out_dir is applied like any key.
    (tmp_path / "mine.json").write_text(json.dumps({"out_dir": str(run)}))
    assert load_config_file(str(tmp_path / "mine.json")) == [f"out_dir={run}"]


def test_groups_say_which_of_their_keys_a_resume_may_change():
    from engine.config import resume_safe, with_groups
    from engine.plugin_manager import build_plugin_manager

    cfg = with_groups(TrainConfig(), build_plugin_manager().config_groups)
    assert resume_safe(cfg, "checkpoint.keep_last") and resume_safe(cfg, "early_stopping.metric")
    assert resume_safe(cfg, "ddp.bucket_cap_mb")  # the plugin's RESUME_SAFE set...
    assert not resume_safe(cfg, "ddp.sync_batchnorm")  # ...leaves out the arithmetic
    assert resume_safe(cfg, "mlflow.experiment") and resume_safe(cfg, "wandb.project")
    assert not resume_safe(cfg, "batch_size") and not resume_safe(cfg, "nosuch.key")


@attrs.define
class ChangesDefaults(TrainConfig):
    precision: str = "bf16"  # re-declared to change the default, as a str
    num_workers: int = 2  # narrowed: the recipe's own type applies too


def test_a_redeclared_field_keeps_the_base_fields_choices():
    """precision=fp8 once trained as fp16 and exited 0: the re-declaration as str had
    dropped TrainConfig's choices."""
    from engine.overrides import check_redeclared

    check_redeclared(ChangesDefaults)  # its defaults are allowed values
    cfg = apply_overrides(ChangesDefaults(), ["precision=fp16", "num_workers=3"])
    assert (cfg.precision, cfg.num_workers) == ("fp16", 3)
    with pytest.raises(ConfigError) as error:
        apply_overrides(ChangesDefaults(), ["precision=fp8"])
    assert str(error.value) == ("config key 'precision': 'fp8' is not one of: 32, bf16, "
                                "fp16 (TrainConfig.precision)")
    with pytest.raises(ConfigError, match="'auto' is not an integer"):
        apply_overrides(ChangesDefaults(), ["num_workers=auto"])


def test_a_redeclared_default_the_base_refuses_is_one_line_saying_how():
    from engine.overrides import check_redeclared

    @attrs.define
    class Widened(TrainConfig):
        precision: str = "fp8"

    with pytest.raises(ConfigError) as error:
        check_redeclared(Widened)
    assert str(error.value) == (
        "Widened.precision: the default 'fp8' is not one of: 32, bf16, fp16 "
        "(TrainConfig.precision); to change a default, give a value that is (e.g. "
        "precision: Literal['32', 'bf16', 'fp16'] = ...)")


def test_described_config_lists_allowed_values_and_the_declarations_comment():
    from engine.overrides import format_config

    lines = format_config(ChangesDefaults(), describe=True)
    (precision,) = [line for line in lines if line.startswith("precision = ")]
    assert precision.split(None, 3)[3] == (
        "[a string and one of: 32, bf16, fp16]  re-declared to change the default, as a str")
    (metric,) = [line for line in lines if line.startswith("early_stopping.metric = ")]
    assert metric.endswith('[a string]  e.g. "val/loss": a metric of the epoch (see the '
                           'console line)')
    assert all(" [" in line for line in lines)
    described = [line for line in lines if "]  " in line]
    assert len(described) == len(lines), [line for line in lines if "]  " not in line]
