"""A run's trained model, back: :func:`load_model` (``engine.load_model``) and :func:`export`
(``engine-run export``, ``tools/ckpt.py export``), from snapshots checked against their
manifest as ``--resume`` checks them, read with ``torch.load(weights_only=True)`` only."""

from __future__ import annotations

import json
import pathlib
import sys

import attrs

from engine.atomic_io import atomic_write, file_checksum
from engine.checkpoint import POINTERS
from engine.config import flatten
from engine.overrides import _as_text, apply_overrides
from engine.errors import CheckpointError, ConfigError, first_line, untrusted_pickle
from engine.launching import _recipe_reference
from engine.recipe import load_recipe, recipe_from_object
from engine.stateful import load_model_state, model_digest, plain_keys

# torch is imported inside the functions: engine-run export and tools/ckpt.py --help without it

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
        return model if self.model_key is None else {**self.obj, self.model_key: model}

    def header(self, key: str):
        """A key of an engine snapshot's header (``config``, ``recipe``), or None."""
        return self.obj.get(key) if self.model_key is not None else None


def resolve(path: pathlib.Path) -> pathlib.Path:
    """A pointer file (``latest``, ``best``), a checkpoints folder or a run folder stands
    for the snapshot its pointer names, as ``--resume`` takes them."""
    path = pathlib.Path(path)
    for pointer in (path, path / "latest", path / "checkpoints" / "latest"):
        if pointer.name in POINTERS and pointer.is_file():
            return pointed(pointer)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / ".metadata").exists():
        raise CheckpointError(f"{path} is a folder but neither a dcp snapshot (no "
                              ".metadata) nor a run or checkpoints folder (no latest pointer)")
    return path


def pointed(pointer: pathlib.Path) -> pathlib.Path:
    """The snapshot beside ``pointer`` that it names (a file not of text: itself)."""
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return pointer
    target = pointer.parent / name
    if not name or pathlib.PurePath(name).name != name or name in (".", ".."):
        raise CheckpointError(f"the pointer {pointer} names {name!r}, not a snapshot in its "
                              "folder; give the snapshot itself, or write its file name there")
    if not target.exists():
        raise CheckpointError(f"{pointer} names {target.name}, which does not exist")
    if target.resolve().parent != pointer.parent.resolve():  # a link to another run's file
        raise CheckpointError(f"{pointer} names {name}, a link to {target.resolve()}, outside "
                              "its folder; give that snapshot itself if it is the one meant")
    return target


def snapshot_of(run, which: str | None = None) -> pathlib.Path:
    """The snapshot ``run`` (a snapshot, a pointer file, a run or checkpoints folder)
    names; ``which``: the folder's ``latest`` (the default) or ``best`` pointer."""
    path = pathlib.Path(run)
    if which is None:
        return resolve(path)
    if which not in POINTERS:
        raise CheckpointError(f"which snapshot: {which!r} is not one of: "
                              f"{', '.join(POINTERS)}")
    for folder in (path, path / "checkpoints"):
        if (folder / which).is_file():
            return resolve(folder / which)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir() or (path / ".metadata").exists():
        raise CheckpointError(f"{path} is not a run folder: {which!r} chooses "
                              "among a run's snapshots; give the run's out_dir, or the "
                              "snapshot without choosing")
    why = (" (the run did not set checkpoint.best_metric, or it ended before a "
           "validation)" if which == "best" else "")
    raise CheckpointError(f"{path} holds no {which} snapshot (no {which} pointer in it or "
                          f"in its checkpoints folder){why}")


def is_tensor_dict(obj) -> bool:
    import torch

    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def why_unloadable(path: pathlib.Path, exc: Exception) -> str:
    """torch.load's errors span many lines; the one that matters, in a sentence."""
    untrusted = untrusted_pickle(path, exc)
    if untrusted:
        return untrusted
    first = first_line(exc, type(exc).__name__)
    if first.startswith("Weights only load failed"):
        first = "not a torch.save file"
    first = first.split(". ")[0]  # torch adds paragraphs of advice
    return f"{path} cannot be loaded (corrupt, truncated or not a torch file): {first}"


def read(path: pathlib.Path, verify: bool = True) -> Checkpoint:
    """The checkpoint at ``path`` (resolved as :func:`resolve` does): an engine snapshot
    of any checkpointer, checked against its manifest (unless not ``verify``), or a plain
    state_dict file (also under ``state_dict`` or ``model_state_dict``)."""
    from engine.plugins.dcp import DCPCheckpointer  # imports torch: lazily
    from engine.plugins.torch_file import TorchFileCheckpointer

    path = resolve(path)
    store = (DCPCheckpointer if path.is_dir() else TorchFileCheckpointer)(path.parent)
    problem = store.verify(path) if verify else None  # --resume's check: the manifest's
    if problem is not None:
        raise CheckpointError(f"snapshot {path} fails its check ({problem}); give "
                              "another snapshot")
    if path.is_dir():
        return Checkpoint(path, store.load(path), "dcp snapshot", "model")
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


WEIGHT_PARTS = ("model", "ema")  # the snapshot parts that hold a whole set of weights


def part_weights(ckpt: Checkpoint, part: str = "model") -> dict:
    """The weights part ``part`` holds, whole (``ema``'s count dropped)."""
    import torch

    if part == "model":
        return ckpt.model
    state = ckpt.obj.get(part) if ckpt.model_key is not None else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{ckpt.path} holds no {part!r} part (a run with "
                              f"{part}.enabled=true writes one); part 'model' is the model")
    tensors = state.get("average", state)
    return {k: v for k, v in tensors.items()
            if k != "n_averaged" and isinstance(v, torch.Tensor)}


def plain_weights(ckpt: Checkpoint, part: str = "model") -> dict:
    """Part ``part``'s weights (WEIGHT_PARTS) under the plain model's keys, contiguous."""
    weights = {k: v.contiguous() for k, v in plain_keys(part_weights(ckpt, part)).items()}
    if any(k.startswith(PREFIX) for k in weights):
        raise CheckpointError(f"{ckpt.path}: only some keys start with {PREFIX!r}; fix "
                              "the file first (strip-prefix refuses to guess either)")
    return weights


# ----------------------------------------------------------------- the model


def load_model(run, which: str | None = None, *, recipe=None, part: str = "model",
               trust_recipe: bool = False):
    """The model a run trained, ready for inference: the recipe's ``build_model`` called
    with the run's config, the snapshot's weights loaded strictly, in eval mode, on the CPU.

    ``run``: a run's out_dir, its checkpoints folder, a pointer file or a snapshot.
    ``which``: ``"latest"`` (the default) or ``"best"`` (by ``checkpoint.best_metric``),
    for a run or checkpoints folder. ``recipe``: the recipe (a file's path, a module or
    an object, as ``engine.fit`` takes it) when the one the run recorded is not at hand.
    A recorded recipe inside the run folder came with the run: importing it runs its
    code, so only with ``trust_recipe=True``. ``part="ema"``: the ema plugin's weights."""
    ckpt = read(snapshot_of(run, which))
    config = ckpt.header("config") or _run_file(ckpt.path, "config.json").get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{ckpt.path} holds no config and no config.json is beside "
                              "it: not an engine snapshot, so the model cannot be rebuilt "
                              "(engine-run export gives its weights)")
    loaded = _recipe(ckpt, recipe, trust_recipe)
    cfg = run_config(loaded, config, source=str(ckpt.path))
    model = loaded.module.build_model(cfg)
    load_model_state(model, plain_weights(ckpt, part), source=str(ckpt.path))
    return model.eval()


def run_config(recipe, config: dict, source: str = "the run"):
    """The recipe's ``Config`` with a run's resolved config (config.json, a snapshot's
    ``config``) applied as ``--config`` applies a file, the plugins' groups left out."""
    cfg = recipe.make_config()
    ours = {f.name for f in attrs.fields(type(cfg))}
    items = [f"{key}={_as_text(value)}" for key, value in flatten(config).items()
             if key.split(".")[0] in ours]
    try:
        return apply_overrides(cfg, items, checked=False)
    except ConfigError as exc:
        raise ConfigError(f"{source}: its config no longer fits the recipe "
                          f"{recipe.name!r}: {exc}") from None


def _recipe(ckpt: Checkpoint, given, trusted: bool = False):
    """The :class:`~engine.recipe.Recipe`: the one given, else the one the snapshot or
    the run's summary.json recorded, if it is not a file that came with the run."""
    if given is not None:
        given = _recipe_reference(given)  # as engine.fit takes it: a file, module, object
        return load_recipe(given) if isinstance(given, str) else recipe_from_object(given)
    recorded = ckpt.header("recipe") or _run_file(ckpt.path, "summary.json").get("recipe")
    if not isinstance(recorded, str):
        raise CheckpointError(f"{ckpt.path}: no recipe is recorded with it (nor in its "
                              "run's summary.json); pass it: load_model(..., recipe=PATH)")
    if not recorded.endswith(".py"):
        raise CheckpointError(f"{ckpt.path} was trained with a recipe object given to "
                              f"engine.fit ({recorded}), not a file; pass that object: "
                              "load_model(..., recipe=...)")
    if not pathlib.Path(recorded).is_file():
        raise CheckpointError(f"{ckpt.path} was trained with the recipe {recorded}, which "
                              "is not there now; pass where it is: load_model(..., "
                              "recipe=PATH)")
    run = ckpt.path.resolve().parent  # the folder the snapshot came in, or its run's
    run = run.parent if run.name == "checkpoints" else run
    if not trusted and pathlib.Path(recorded).resolve().is_relative_to(run):
        raise CheckpointError(f"{ckpt.path} names the recipe {recorded}, inside the run "
                              f"folder {run}: it came with the run, and importing it runs its"
                              " code; pass load_model(..., trust_recipe=True) or recipe=PATH")
    return load_recipe(recorded)


def _run_file(snapshot: pathlib.Path, name: str) -> dict:
    """``{"config": config.json}``, or summary.json, of a ``<run>/checkpoints/`` snapshot."""
    try:
        data = json.loads((snapshot.parent.parent / name).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {"config": data} if name == "config.json" else data


# ----------------------------------------------------------------- writing


def file_sha256(path: pathlib.Path) -> str:
    """What ``sha256sum`` prints: the identity people compare a shared file by (the
    manifests' faster checksum is for integrity, not for that)."""
    return file_checksum(path, "sha256")


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
    the header's length (8 bytes, little-endian), a JSON header padded with spaces to 8
    bytes, the tensors' bytes in header order (tied weights twice: no aliasing). Written
    here, crash-consistently like every other file, with no run-time dependency."""
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


def export(ckpt: Checkpoint, out: pathlib.Path, part: str = "model") -> str:
    """Write ``ckpt``'s plain weights (part ``part``: the model's, or ema's average) to
    ``out`` (safetensors for a ``.safetensors`` name, else ``torch.save``); returns the
    line that says what was written."""
    check_output(ckpt, out)
    weights = plain_weights(ckpt, part)
    digest = model_digest(weights)
    if out.suffix == ".safetensors":
        # Strings only, as the format asks: where the weights came from.
        sha256 = write_safetensors(weights, out, {"format": "pt", "source": str(ckpt.path),
                                                  "model_digest": digest})
    else:
        sha256 = write_torch(weights, out)
    return f"wrote {out}: {len(weights)} tensors, model digest {digest}, sha256 {sha256}"
