"""The engine's protocols are declared, not probed: no module of engine/ asks an object
whether it has a protocol's attribute or method (``getattr(x, "name", default)``,
``hasattr(x, "name")``); the object's class implements the protocol, and the caller
uses it. Read with ast, every engine/**/*.py."""

from __future__ import annotations

import ast
import pathlib

from engine import data

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "engine"

#: The names of the engine's protocols: engine.data.TrainingLoader's (the training
#: loaders, map-style and streamed), and "stream", the flag it replaced.
PROTOCOL_NAMES = ("sized", "padding", "last", "counts_in", "start_epoch",
                  "position_state", "restore", "stream",
                  # a state part's own state (engine.stateful.LocalStateful)
                  "local_state_dict", "memory_state_dict")


def protocol_probes(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: getattr(..., "name")`` for each getattr/hasattr of a protocol name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PROTOCOL_NAMES):
            found.append(f"{filename}:{node.lineno}: {node.func.id}(..., "
                         f"{node.args[1].value!r})")
    return found


def test_no_engine_module_probes_an_object_for_a_protocol_name():
    probes = [probe for path in sorted(ENGINE.rglob("*.py"))
              for probe in protocol_probes(path.read_text(), str(path.relative_to(ENGINE)))]
    assert probes == []


def test_the_scan_knows_every_name_of_the_loader_protocol():
    declared = {name for name in vars(data.TrainingLoader) if not name.startswith("_")}
    assert declared <= set(PROTOCOL_NAMES)
    assert protocol_probes('if getattr(loader, "stream", False):\n    pass\n'
                           'hasattr(loader, "restore")') == [
        "<source>:1: getattr(..., 'stream')", "<source>:3: hasattr(..., 'restore')"]
