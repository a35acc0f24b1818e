"""Setting a config from text: ``key=value`` overrides by dotted path, converted with the
field's annotation and checked (a problem is one ConfigError naming the key, the value
and what fits); --config files read into overrides; --dry-run -v's list of every key.
"""

from __future__ import annotations

import ast
import difflib
import enum
import functools
import inspect
import io
import json
import pathlib
import re
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal

import attrs

from engine.config import all_keys, check, flatten
from engine.errors import ConfigError, first_line

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def field_types(cls: type) -> dict[str, Any]:
    """An attrs class's annotations, resolved (``from __future__ import annotations``)."""
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:
        raise ConfigError(f"cannot resolve the field types of {cls.__qualname__}: {exc}") from exc


def declared_first(cls: type, name: str) -> tuple[type, Any]:
    """The class that first declared field ``name`` among ``cls``'s bases, and its type
    there. A recipe's Config that re-declares an inherited field to change its default
    (``precision: str = "bf16"``) must not lose the base's choices: every value is
    checked against this type too."""
    for klass in reversed(cls.__mro__):
        if attrs.has(klass) and name in klass.__dict__.get("__annotations__", {}):
            return klass, field_types(klass)[name]
    return cls, field_types(cls)[name]


def check_redeclared(cls: type) -> None:
    """A config class's re-declared fields: their defaults must be values the first
    declaration allows. One line naming the field and how to change a default."""
    for field in attrs.fields(cls):
        base, base_tp = declared_first(cls, field.name)
        if (base is cls or isinstance(field.default, attrs.Factory) or attrs.has(base_tp)
                or fits(field.default, base_tp)):
            continue
        raise ConfigError(
            f"{cls.__name__}.{field.name}: the default {field.default!r} is not "
            f"{_describe(base_tp)} ({base.__qualname__}.{field.name}); to change a default, "
            f"give a value that is (e.g. {field.name}: "
            f"{repr(base_tp).replace('typing.', '')} = ...)")


def fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` is one that an override of type ``tp`` could produce."""
    if value is None:
        return tp is type(None) or type(None) in typing.get_args(tp) or tp is Any
    try:
        return convert(str(value).lower() if isinstance(value, bool) else str(value),
                       tp) == value
    except (ValueError, TypeError):
        return False


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if origin in (tuple, list):
        return "a comma-separated list"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of: " + ", ".join(m.name for m in tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             pathlib.Path: "a path"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def convert(value: str, tp: Any) -> Any:
    """Convert the override text ``value`` to type ``tp``; ValueError if it does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == value:
                return choice
        raise ValueError
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and value.lower() in _NONE:
            return None
        # Literal choices first so "auto" in `int | Literal["auto"]` wins over int parsing.
        for arg in sorted(args, key=lambda a: typing.get_origin(a) is not Literal):
            if arg is type(None):
                continue
            try:
                return convert(value, arg)
            except ValueError:
                continue
        raise ValueError
    if origin in (tuple, list):
        args = typing.get_args(tp)
        item_tp = args[0] if args else str
        items = [convert(v.strip(), item_tp) for v in value.split(",") if v.strip()]
        return tuple(items) if origin is tuple else items
    if tp is bool and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if tp in (int, float, str, pathlib.Path):
        return tp(value)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp[value]
        except KeyError:
            raise ValueError from None
    raise ValueError


#: Where every key is listed (the unknown-key error points there, not at ~70 keys).
EVERY_KEY = "every key: engine-run RECIPE --dry-run -v"


class UnknownKey(ConfigError):
    """A key the config does not have: one line with the closest keys (within the group
    it names, when it names one: else the group's keys, which are few) and where every
    key is listed. ``key`` is the key given, ``close`` the closest keys, best first."""

    def __init__(self, cfg: Any, key: str, here: str, part: str):
        group = _group(cfg, here) if here else cfg
        prefix = f"{here}." if here else ""
        known = all_keys(group)
        self.key = key
        self.close = [prefix + name for name in
                      difflib.get_close_matches(key[len(prefix):], known, n=3, cutoff=0.6)]
        if len(self.close) == 1:
            hint = f"; did you mean {self.close[0]!r}?"
        elif self.close:
            hint = f"; did you mean one of {', '.join(map(repr, self.close))}?"
        elif here:
            hint = f"; {here!r} has: {', '.join(known)}"
        else:
            hint = ""
        super().__init__(f"unknown config key {key!r}"
                         + (f" ({here!r} has no field {part!r})" if here else "")
                         + f"{hint} ({EVERY_KEY})")


def _group(cfg: Any, dotted: str) -> Any:
    """The group ``cfg.a.b`` that ``"a.b"`` names."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def apply_override(cfg: Any, key: str, text: str) -> None:
    """Set ``key`` (a dotted path) on ``cfg`` from the override text, converted and checked."""
    target = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in attrs.fields(type(target))]
        if part not in names:
            raise UnknownKey(cfg, key, ".".join(parts[:i]), part)
        if i == len(parts) - 1:
            break
        target = getattr(target, part)
        if not attrs.has(type(target)):
            raise ConfigError(f"config key {key!r}: {'.'.join(parts[: i + 1])!r} is a "
                              "value, not a group")
    name = parts[-1]
    current = getattr(target, name)
    if attrs.has(type(current)):
        if "enabled" in attrs.fields_dict(type(current)):
            # A group switched on and off (compile, ema): GROUP=true is GROUP.enabled=true.
            return apply_override(cfg, f"{key}.enabled", text)
        raise ConfigError(f"config key {key!r} is a group; set one of its fields, e.g. "
                          f"{all_keys(current, key + '.')[0]}=...")
    tp = field_types(type(target))[name]
    base, base_tp = declared_first(type(target), name)
    try:
        value = convert(text, tp)
    except (ValueError, TypeError):
        raise ConfigError(f"config key {key!r}: {text!r} is not {_describe(tp)}") from None
    if base_tp != tp and not fits(value, base_tp):
        # A recipe re-declared the field (another default): read as the base declares it.
        raise ConfigError(f"config key {key!r}: {text!r} is not {_describe(base_tp)} "
                          f"({base.__qualname__}.{name})")
    field = attrs.fields_dict(type(target))[name]
    try:
        # attrs classes run a field's validator on setattr too (attrs.define's default).
        setattr(target, name, value)
        if field.validator is not None:
            field.validator(target, field, value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config key {key!r}: {text!r} is not allowed: {exc}") from None


def apply_overrides(cfg: Any, overrides: list[str], checked: bool = True) -> Any:
    """Apply ``key=value`` items in order; then (``checked``) the cross-field checks."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. "
                              "epochs=3, data.root=/data)")
        apply_override(cfg, key.strip(), text)
    if checked:
        check(cfg)
    return cfg


# ------------------------------------------------------------------ config files

#: Keys a run's own config.json does not set when it is given to --config: where the
#: run wrote and how its processes started belong to that run, not to the experiment
#: (its out_dir would resume or clobber the old run, its launcher may be torchrun's).
NOT_REPRODUCED = ("out_dir", "launcher", "init_method")


def load_config_file(path: str) -> list[str]:
    """The overrides (``key=value``) a ``--config`` file holds: TOML, YAML or JSON, by
    its suffix; nested tables and dotted keys both name a field. A run's own config.json
    (its out_dir is the folder it sits in) leaves out :data:`NOT_REPRODUCED`."""
    file = pathlib.Path(path).expanduser()
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ConfigError(f"--config {path}: use a .toml, .yaml/.yml or .json file")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = _parse(text, suffix, path)
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error class
        first = first_line(exc, type(exc).__name__)
        kind = {".json": "JSON", ".toml": "TOML"}.get(suffix, "YAML")
        raise ConfigError(f"--config {path}: not valid {kind}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a table of keys "
                          f"(key = value), not a {type(data).__name__}")
    if _is_runs_own(data, file):
        data = {k: v for k, v in data.items() if k not in NOT_REPRODUCED}
    return [f"{key}={_as_text(value)}" for key, value in flatten(data).items()]


def _parse(text: str, suffix: str, path: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".toml":
        try:
            # The parsers are imported for the format read: tomli and PyYAML are optional
            # packages (a clear error when missing), and PyYAML is slow to import.
            import tomllib
        except ImportError:  # Python 3.10: the same parser as a package
            try:
                import tomli as tomllib  # optional: see above
            except ImportError:
                raise ConfigError(f"--config {path}: reading TOML on Python < 3.11 needs "
                                  "tomli (pip install tomli); or give a .json file") from None
        return tomllib.loads(text)
    try:
        import yaml  # optional: see above
    except ImportError:
        raise ConfigError(f"--config {path}: reading YAML needs PyYAML (pip install "
                          "pyyaml); or give a .toml or .json file") from None
    return yaml.safe_load(text)


def _is_runs_own(data: dict, file: pathlib.Path) -> bool:
    out_dir = data.get("out_dir")
    return isinstance(out_dir, str) and (
        pathlib.Path(out_dir).expanduser().absolute() == file.parent.absolute())


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_as_text(v) for v in value)
    return str(value)


def format_config(cfg: Any, prefix: str = "", describe: bool = False) -> list[str]:
    """``key = value`` per key; ``describe`` (``--dry-run -v``): then the values it allows
    and the one-line description its declaration's comment gives."""
    lines = []
    for f in attrs.fields(type(cfg)):
        value = getattr(cfg, f.name)
        if attrs.has(type(value)):
            lines.extend(format_config(value, f"{prefix}{f.name}.", describe))
        elif describe:
            about = field_descriptions(type(cfg)).get(f.name, "")
            lines.append(f"{f'{prefix}{f.name} = {value!r}':<36} [{allowed(type(cfg), f.name)}]"
                         + (f"  {about}" if about else ""))
        else:
            lines.append(f"{prefix}{f.name} = {value!r}")
    return lines


def allowed(cls: type, name: str) -> str:
    """What an override of ``name`` may be (a re-declared field: both declarations)."""
    tp = field_types(cls)[name]
    _, base_tp = declared_first(cls, name)
    both = [tp] if base_tp == tp else [tp, base_tp]
    return " and ".join(_describe(t) for t in both)


@functools.lru_cache(maxsize=None)
def field_descriptions(cls: type) -> dict[str, str]:
    """One line per field, from the comments of the classes' source: the comment at the
    end of the field's line, else the comment lines right above it (first sentence).
    Bases first: a re-declaration with a comment of its own replaces the base's."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if attrs.has(klass):
            found.update(_field_comments(klass))
    return found


def _field_comments(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # made at run time (a plugin group added to it)
        return {}
    comments = {tok.start[0]: (tok.string.lstrip("#").strip(), tok.line[:tok.start[1]].strip())
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    described = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text, code_before = comments.get(node.end_lineno, ("", ""))
        if not code_before:  # no comment at the end of the line: the lines above
            above, line = [], node.lineno - 1
            while line in comments and not comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            text = " ".join(above)
        if text:  # the first sentence ("e.g. x" is none's end)
            described[node.target.id] = re.split(r"(?<!e\.g)(?<!i\.e)\. ", text)[0]
    return described
