#!/usr/bin/env python3
"""Look into checkpoints and convert them.

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
:func:`write_safetensors`): it is a documented header and the raw bytes, and so the
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

from engine.atomic_io import atomic_write, file_checksum
from engine.checkpoint import add_module_prefix, model_digest, plain_keys
from engine.errors import CheckpointError, untrusted_pickle

PREFIX = "module."
#: Where the model weights sit inside a container dict, in the order they are looked for.
MODEL_KEYS = ("model", "state_dict", "model_state_dict")


# -------------------------------------------------------------------- reading


class Checkpoint:
    """A loaded checkpoint: the whole object, where its model weights are, its format."""

    def __init__(self, path: pathlib.Path, obj, fmt: str, model_key: str | None):
        self.path = path
        self.obj = obj
        self.format = fmt
        self.model_key = model_key  # None: the object is the state_dict itself

    @property
    def model(self) -> dict:
        return self.obj if self.model_key is None else self.obj[self.model_key]

    def with_model(self, model: dict):
        if self.model_key is None:
            return model
        return {**self.obj, self.model_key: model}


def resolve(path: pathlib.Path) -> pathlib.Path:
    """A pointer file (``checkpoints/latest``, ``checkpoints/best``), a checkpoints folder
    or a run folder stands for the snapshot its pointer names, as ``--resume`` takes them."""
    from engine.checkpoint import follow_pointer

    path = follow_pointer(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / ".metadata").exists():
        pointer = path / "latest"
        if not pointer.is_file():
            raise CheckpointError(f"{path} is a folder but neither a dcp snapshot (no "
                                  ".metadata) nor a checkpoints folder (no latest pointer)")
        target = path / pointer.read_text().strip()
        if not target.exists():
            raise CheckpointError(f"{pointer} names {target.name}, which does not exist")
        return target
    return path


def is_tensor_dict(obj) -> bool:
    import torch

    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def why_unloadable(path: pathlib.Path, exc: Exception) -> str:
    """torch.load's errors span many lines; the one that matters, in a sentence."""
    untrusted = untrusted_pickle(path, exc)
    if untrusted:
        return untrusted
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.startswith("Weights only load failed"):
        first = "not a torch.save file"
    first = first.split(". ")[0]  # torch adds paragraphs of advice
    return f"{path} cannot be loaded (corrupt, truncated or not a torch file): {first}"


def read(path: pathlib.Path) -> Checkpoint:
    path = resolve(path)
    if path.is_dir():
        from engine.plugins.dcp import DCPCheckpointer

        return Checkpoint(path, DCPCheckpointer(path.parent).load(path), "dcp snapshot",
                          "model")
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(why_unloadable(path, exc)) from None
    if is_tensor_dict(obj):
        return Checkpoint(path, obj, "state_dict", None)
    if isinstance(obj, dict):
        for key in MODEL_KEYS:
            if is_tensor_dict(obj.get(key)):
                fmt = "engine snapshot" if "engine_version" in obj else f"dict with {key!r}"
                return Checkpoint(path, obj, fmt, key)
        keys = ", ".join(map(str, list(obj)[:8]))
        raise CheckpointError(f"{path} holds a dict without model weights (keys: {keys}); "
                              f"expected a state_dict or one under {', '.join(MODEL_KEYS)}")
    raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state_dict")


# -------------------------------------------------------------------- inspect


def file_sha256(path: pathlib.Path) -> str:
    """What ``sha256sum`` prints: the identity people compare a shared file by (the
    manifests' faster checksum is for integrity, not for that)."""
    return file_checksum(path, "sha256")


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
    rows.append(("digest", f"{m['digest']}  (engine.checkpoint.model_digest, without "
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
    info = describe(read(pathlib.Path(args.path)))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print_text(info)
    return 0 if info["manifest"] in ("ok", "none") else 1


# ----------------------------------------------------------------- converting


def write_torch(obj, out: pathlib.Path) -> str:
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: torch.save(obj, f))
    return file_sha256(out)


#: torch dtype -> safetensors dtype name (the format's documented list).
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}


def write_safetensors(weights: dict, out: pathlib.Path, metadata: dict[str, str]) -> str:
    """``weights`` in the safetensors format (https://huggingface.co/docs/safetensors):
    8 bytes little-endian header length, a JSON header (each tensor's dtype, shape and
    byte range; ``__metadata__`` strings), padded with spaces to 8 bytes, then the
    tensors' bytes, little-endian, in header order. Every tensor gets bytes of its own
    (tied weights are stored twice: the format has no aliasing)."""
    import torch

    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; export on a "
                              "little-endian machine or write a .pt file")
    header: dict = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name, tensor in weights.items():
        dtype = str(tensor.dtype).replace("torch.", "")
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name}: dtype {dtype} has no safetensors name; write "
                                  "a .pt file instead")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        blob = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + blob.numel()]}
        blobs.append(blob)
        offset += blob.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(f):
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            if blob.numel():
                f.write(memoryview(blob.numpy()))

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)
    return file_sha256(out)


def check_output(ckpt: Checkpoint, out: pathlib.Path) -> None:
    if out.resolve() == ckpt.path.resolve():
        raise CheckpointError(f"{out}: write to another file, not over the input "
                              "(a snapshot's manifest would no longer match it)")
    if out.is_dir():
        raise CheckpointError(f"{out} is a folder; give a file name, e.g. {out}/model.pt")


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


def part_weights(ckpt: Checkpoint, name: str) -> dict:
    """The weights a snapshot part holds, keyed as the model's: ``ema``'s average
    (AveragedModel's state: ``module.``-prefixed keys and a count), whole whatever the
    parallel mode and checkpointer (a dcp snapshot's shards are joined by the reader)."""
    import torch

    if name == "model":
        return ckpt.model
    state = ckpt.obj.get(name) if ckpt.model_key is not None else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{ckpt.path} holds no {name!r} part (a run with "
                              f"{name}.enabled=true writes one); --part model exports the model")
    tensors = state.get("average", state)
    return {k: v for k, v in tensors.items()
            if k != "n_averaged" and isinstance(v, torch.Tensor)}


def cmd_export(args) -> int:
    ckpt = read(pathlib.Path(args.input))
    out = pathlib.Path(args.output)
    check_output(ckpt, out)
    weights = {k: v.contiguous() for k, v in plain_keys(part_weights(ckpt, args.part)).items()}
    if any(k.startswith(PREFIX) for k in weights):
        raise CheckpointError(f"{ckpt.path}: only some keys start with {PREFIX!r}; fix "
                              "the file first (strip-prefix refuses to guess either)")
    if out.suffix == ".safetensors":
        # Strings only, as the format asks: where the weights came from.
        metadata = {"format": "pt", "source": str(ckpt.path),
                    "model_digest": model_digest(weights)}
        sha256 = write_safetensors(weights, out, metadata)
    else:
        sha256 = write_torch(weights, out)
    print(f"wrote {out}: {len(weights)} tensors, model digest {model_digest(weights)}, "
          f"sha256 {sha256}")
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
