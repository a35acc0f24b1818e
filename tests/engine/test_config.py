from __future__ import annotations

import pathlib
from typing import Literal

import attrs
import pytest

from engine.config import TrainConfig, apply_overrides, convert, to_dict
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


@pytest.mark.parametrize("override, message", [
    ("epoch=3", "unknown config key 'epoch'; did you mean 'epochs'?"),
    ("data.rot=/x", "unknown config key 'data.rot' ('data' has no field 'rot')"),
    ("epochs=three", "config key 'epochs': 'three' is not an integer"),
    ("lr=fast", "config key 'lr': 'fast' is not a number"),
    ("data.source=imagenet",
     "config key 'data.source': 'imagenet' is not one of: auto, cifar10, synthetic"),
    ("precision=fp8", "config key 'precision': 'fp8' is not one of: 32, bf16, fp16"),
    ("drop_last=maybe", "config key 'drop_last': 'maybe' is not true or false"),
    ("data=x", "config key 'data' is a group; set one of its fields, e.g. data.root=..."),
    ("epochs", "override 'epochs' is not of the form key=value"),
    ("epochs=0", "config key 'epochs': 0 is not allowed; it must be >= 1"),
    ("init_method=http://x", "config key 'init_method': 'http://x' is not allowed"),
])
def test_bad_override_is_one_clear_line(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), [override])
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_unknown_key_lists_known_keys():
    with pytest.raises(ConfigError, match="known keys: .*data.root"):
        apply_overrides(Config(), ["nope=1"])


def test_convert_rejects_what_does_not_fit():
    with pytest.raises(ValueError):
        convert("x", int)
    assert convert("OFF", bool) is False


def test_to_dict_is_plain_data():
    d = to_dict(apply_overrides(Config(), ["data.path=/p"]))
    assert d["data"]["path"] == "/p"
    assert d["checkpoint"]["best_mode"] == "max"  # a nested group: a plain dict
    assert d["scales"] == [0.5, 1.0]


def test_an_out_dir_that_is_a_file_is_one_clear_line(tmp_path):
    """Issue 16, defect 6: a FileExistsError traceback in every worker before."""
    from engine.config import check

    afile = tmp_path / "notes.txt"
    afile.write_text("")
    with pytest.raises(ConfigError, match="^config key 'out_dir': '.*notes.txt' cannot be "
                       "the run's folder: it is a file; give a folder"):
        check(TrainConfig(out_dir=str(afile)))
    with pytest.raises(ConfigError, match=r"\(.*notes.txt is not a folder\)"):
        check(TrainConfig(out_dir=str(afile / "run")))
    check(TrainConfig(out_dir=str(tmp_path / "new" / "run")))  # created later: fine
