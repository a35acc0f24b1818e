#!/usr/bin/env python3
"""Look into checkpoints and convert them. (A run's weights for inference come from
the installed command ``engine-run export RUN OUT.safetensors [--which best]``, and its
model from ``engine.load_model(RUN)``; export here is the same code.)

    python tools/ckpt.py inspect PATH [--json]       keys, shapes, dtypes, epoch/step,
                                                     sha256, model digest, manifest check
    python tools/ckpt.py strip-prefix IN OUT         drop DDP's "module." from the keys
    python tools/ckpt.py add-prefix IN OUT           add "module." to every key
    python tools/ckpt.py export IN OUT               plain model weights for inference
                                                     (OUT.safetensors: in safetensors)
    python tools/ckpt.py export IN OUT --part ema    the EMA's averaged weights instead

PATH/IN may be an engine snapshot (torch-file or async: ``snapshot-*.pt``), a dcp
snapshot directory (``snapshot-*.dcp``), a pointer file (``checkpoints/latest``,
``checkpoints/best``) or a checkpoints or run folder (the snapshot its ``latest`` names,
as ``--resume`` takes them), or a plain state_dict file with or without ``module.`` keys (also
inside ``{"state_dict": ...}`` or ``{"model_state_dict": ...}``, as other tools save it).

The seeds' "dict names" problem: a model saved from inside DDP has every key prefixed
with ``module.``, and the plain model refuses it (and the other way round).
strip-prefix/add-prefix rewrite the keys of the model weights only and keep everything
else in the file; export writes just the weights, without the prefix, loadable with
``model.load_state_dict(torch.load(OUT, weights_only=True))`` (torch.compile's
``_orig_mod.``, from a model compiled with ``torch.compile(model)`` by an older engine or
another tool, is dropped too); an OUT ending in
``.safetensors`` is written in the safetensors format instead, which the ecosystem uses
to share weights (no pickle at all), loadable with
``safetensors.torch.load_file(OUT)``. We write that format ourselves (see
:func:`engine.model_io.write_safetensors`): it is a documented header and the raw bytes, and so the
file is written crash-consistently like every other, with no run-time dependency.

Only ``torch.load(weights_only=True)`` is used: a file that needs arbitrary pickled
objects is refused, not executed. Output files are written crash-consistently
(temp file, fsync, rename). The sha256 printed for a file is that of its bytes, as
``sha256sum`` shows it. Exit status: 0 ok, 1 ``inspect`` found a manifest
mismatch, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from engine.errors import CheckpointError
# The reading and writing are the package's (engine-run export and engine.load_model
# use them too); this script adds inspect and the prefix conversions.
from engine.model_io import (PREFIX, Checkpoint, check_output, export, file_sha256, read,
                             write_torch)
from engine.stateful import add_module_prefix, model_digest, plain_keys


# -------------------------------------------------------------------- inspect


def manifest_check(path: pathlib.Path) -> str:
    """"ok", "none" or what is wrong, from the engine's manifest next to ``path``."""
    from engine.checkpoint import manifest_path
    from engine.plugins.dcp import DCPCheckpointer
    from engine.plugins.torch_file import TorchFileCheckpointer

    if not manifest_path(path).exists():
        return "none"
    store = DCPCheckpointer if path.is_dir() else TorchFileCheckpointer
    problem = store(path.parent).problem(path)
    return "ok" if problem is None else problem


def describe(ckpt: Checkpoint) -> dict:
    path = ckpt.path
    model = ckpt.model
    info: dict = {"path": str(path), "format": ckpt.format}
    if path.is_dir():
        files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
                 for p in sorted(path.iterdir()) if p.is_file()}
        info["size"] = sum(f["size"] for f in files.values())
        info["files"] = files
    else:
        info["size"] = path.stat().st_size
        info["sha256"] = file_sha256(path)
    info["manifest"] = manifest_check(path)
    obj = ckpt.obj
    if ckpt.model_key is not None:
        for key in ("epoch", "step", "batch_in_epoch", "epochs_completed", "world_size",
                    "engine_version"):
            if key in obj:
                info[key] = obj[key]
        info["keys"] = sorted(map(str, obj))
    prefixed = [k for k in model if k.startswith(PREFIX)]
    info["model"] = {
        "key": ckpt.model_key,
        "tensors": len(model),
        "values": sum(t.numel() for t in model.values()),
        "digest": model_digest(plain_keys(model)),
        "module_prefix": "all" if len(prefixed) == len(model) else
                         ("some" if prefixed else "none"),
        "entries": {k: {"dtype": str(t.dtype).replace("torch.", ""),
                        "shape": list(t.shape)} for k, t in model.items()},
    }
    optimizer = obj.get("optimizer") if isinstance(obj, dict) else None
    if isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict):
        kinds = sorted({name for s in optimizer["state"].values() if isinstance(s, dict)
                        for name in s})
        info["optimizer"] = {"param_states": len(optimizer["state"]), "buffers": kinds}
    return info


def print_text(info: dict) -> None:
    rows = [("path", info["path"]), ("format", info["format"]),
            ("bytes", str(info["size"]))]
    if "sha256" in info:
        rows.append(("sha256", info["sha256"]))
    for name, f in info.get("files", {}).items():
        rows.append(("file", f"{name}  {f['size']} bytes  sha256 {f['sha256']}"))
    rows.append(("manifest", info["manifest"]))
    if "epoch" in info:
        from engine.stateful import TrainState

        rows.append(("position", TrainState(  # epochs counted from 1, as the console
            epoch=info["epoch"], step=info.get("step"),
            batch_in_epoch=info.get("batch_in_epoch") or 0).position()))
    if "world_size" in info:
        rows.append(("saved by", f"{info['world_size']} process(es), engine "
                                 f"{info.get('engine_version', '?')}"))
    m = info["model"]
    rows.append(("model", f"{m['tensors']} tensors, {m['values']} values, "
                          f"module. prefix: {m['module_prefix']}"))
    rows.append(("digest", f"{m['digest']}  (engine.stateful.model_digest, without "
                           "module.)"))
    if "optimizer" in info:
        o = info["optimizer"]
        rows.append(("optimizer", f"state for {o['param_states']} parameters: "
                                  f"{', '.join(o['buffers']) or 'no buffers'}"))
    for label, value in rows:
        print(f"{label:<10}{value}")
    width = max(map(len, m["entries"]), default=0)
    for name, e in m["entries"].items():
        shape = "x".join(map(str, e["shape"])) or "scalar"
        print(f"  {name:<{width}}  {e['dtype']:<9} {shape}")


def cmd_inspect(args) -> int:
    info = describe(read(pathlib.Path(args.path), verify=False))  # it reports the check
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print_text(info)
    return 0 if info["manifest"] in ("ok", "none") else 1


# ----------------------------------------------------------------- converting


def cmd_strip_prefix(args) -> int:
    ckpt = read(pathlib.Path(args.input))
    out = pathlib.Path(args.output)
    check_output(ckpt, out)
    if ckpt.path.is_dir():
        raise CheckpointError(f"{ckpt.path} is a dcp snapshot, whose keys never carry "
                              "module.; use export to get a plain weights file")
    model = ckpt.model
    prefixed = [k for k in model if k.startswith(PREFIX)]
    if not prefixed:
        raise CheckpointError(f"{ckpt.path}: no key starts with {PREFIX!r}; nothing to "
                              "strip (the keys already suit the plain model)")
    if len(prefixed) < len(model):
        plain = next(k for k in model if not k.startswith(PREFIX))
        raise CheckpointError(f"{ckpt.path}: only {len(prefixed)} of {len(model)} keys "
                              f"start with {PREFIX!r} (e.g. not {plain!r}); refusing to "
                              "guess")
    sha256 = write_torch(ckpt.with_model(plain_keys(model)), out)
    print(f"wrote {out}: {len(model)} keys without {PREFIX!r}, sha256 {sha256}")
    return 0


def cmd_add_prefix(args) -> int:
    ckpt = read(pathlib.Path(args.input))
    out = pathlib.Path(args.output)
    check_output(ckpt, out)
    if ckpt.path.is_dir():
        raise CheckpointError(f"{ckpt.path} is a dcp snapshot; export it first, then add "
                              "the prefix to the exported file")
    model = ckpt.model
    if all(k.startswith(PREFIX) for k in model):
        raise CheckpointError(f"{ckpt.path}: every key already starts with {PREFIX!r}")
    sha256 = write_torch(ckpt.with_model(add_module_prefix(model)), out)
    print(f"wrote {out}: {len(model)} keys with {PREFIX!r}, sha256 {sha256}")
    return 0


def cmd_export(args) -> int:
    print(export(read(pathlib.Path(args.input)), pathlib.Path(args.output), args.part))
    return 0


# ------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckpt.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("inspect", help="keys, shapes, dtypes, epoch/step, sha256, digest")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(run=cmd_inspect)
    for name, run, text in (("strip-prefix", cmd_strip_prefix, "drop module. from keys"),
                            ("add-prefix", cmd_add_prefix, "add module. to keys"),
                            ("export", cmd_export, "plain model weights for inference "
                                                   "(.safetensors: in that format)")):
        s = sub.add_parser(name, help=text)
        s.add_argument("input")
        s.add_argument("output")
        if name == "export":
            s.add_argument("--part", default="model", choices=("model", "ema"),
                           help="the snapshot part whose weights to write (default: model)")
        s.set_defaults(run=run)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CheckpointError as exc:
        print(f"ckpt.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output folder that cannot be written, a full disk
        print(f"ckpt.py: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
