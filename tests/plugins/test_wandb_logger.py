"""The W&B logger without a process: enabled without wandb, one line naming the extra.
tests/plugins/test_loggers_run.py checks a real run's offline files, read with
:func:`records` below; tests/engine/test_imports.py that a disabled one imports nothing."""

from __future__ import annotations

import struct
import sys

import pytest

from engine.config import with_groups
from engine.overrides import apply_overrides
from engine.errors import PluginError
from engine.plugins.wandb_logger import WandbConfig, WandbLogger
from engine.testing import make_engine, make_plugin_manager, tiny_recipe  # noqa: F401 (fixtures)


def records(path) -> list:
    """The records of a ``.wandb`` file as wandb's protobuf ``Record``s. wandb has no
    Python reader any more (its Go core writes the file): the format is LevelDB's log
    (32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type) after a
    7-byte file header ``:W&B``, 0xBEE1, version."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a .wandb file"
    found, parts, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length, kind) == (0, 0):  # the padding at the end of a block
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            found.append(record)
            parts = b""
    return found


def test_enabled_without_the_package_is_one_line_naming_the_extra(make_engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import fails
    eng = make_engine()
    # Refused with the config checks, in the launching process, before any worker starts.
    with pytest.raises(PluginError) as info:
        apply_overrides(with_groups(eng.cfg, {"wandb": WandbConfig}),
                        ["wandb.enabled=true", "wandb.mode=offline"])
    assert str(info.value).startswith("wandb.enabled=true needs the wandb package, which is "
                                      "not installed")
    assert 'install it with pip install -e ".[wandb]"' in str(info.value)
    assert "\n" not in str(info.value)
