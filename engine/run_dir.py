"""Run folders: ``out_dir`` patterns, and a fresh start in a folder that holds a run.

``out_dir``'s placeholders (``{version}``, ``{time}``) are filled once per run by rank 0,
which claims the folder by creating it, and broadcast (:func:`settle`).
"""

from __future__ import annotations

import datetime
import glob
import itertools
import json
import os
import pathlib
import re
import shutil
from typing import Iterable

from engine import distributed
from engine.checkpoint import config_digest, read_manifest
from engine.errors import ConfigError

#: Each placeholder and what it is filled with (a regular expression: a pattern's folders).
PLACEHOLDERS = {"version": r"\d+", "time": r"\d{8}-\d{6}"}
TIME_FORMAT = "%Y%m%d-%H%M%S"
_FIELD = re.compile(r"\{([^{}]*)\}")
#: What the engine itself writes into a run's out_dir (the plugins declare theirs).
ENGINE_FILES = ("checkpoints", "summary.json", "config.json")


def run_files(pm) -> tuple[str, ...]:
    """The engine's and the plugins' files in out_dir: all ``--overwrite`` removes."""
    return ENGINE_FILES + tuple(name for name in pm.run_files if name not in ENGINE_FILES)


def placeholders(out_dir: str) -> list[str]:
    """The placeholders ``out_dir`` contains; a ConfigError for an unknown one."""
    names = _FIELD.findall(str(out_dir))
    unknown = [n for n in names if n not in PLACEHOLDERS]
    if unknown:
        known = ", ".join(f"{{{n}}}" for n in PLACEHOLDERS)
        raise ConfigError(f"config key 'out_dir': {out_dir!r} has the unknown placeholder "
                          f"{{{unknown[0]}}}; known: {known}")
    return names


def is_pattern(out_dir: str) -> bool:
    return bool(placeholders(out_dir))


def fixed_part(out_dir: str) -> str:
    """The folders of ``out_dir`` before its first placeholder (``runs/cifar`` for
    ``runs/cifar/version_{version}``): what exists before the run, for a SLURM log."""
    parts = pathlib.PurePath(out_dir).parts
    fixed = list(itertools.takewhile(lambda part: not _FIELD.search(part), parts))
    return str(pathlib.PurePath(*fixed)) if fixed else "."


def refuse_unwritable(out_dir: str) -> None:
    """A ConfigError, in the launching process before any worker starts, when the run
    could not write its folder (read-only, another user's, a file): the nearest that exists."""
    path = pathlib.Path(fixed_part(out_dir)).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"out_dir {out_dir!r}: {path} is a file, not a folder; give an "
                          "out_dir that is a folder or is not there yet")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {out_dir!r}: {path} cannot be written (a read-only "
                          "filesystem or no permission); give an out_dir the run can write")


def _regex(pattern: str) -> re.Pattern:
    """``pattern`` (absolute) as a regular expression with one group per placeholder."""
    parts, seen, last = [], set(), 0
    for match in _FIELD.finditer(pattern):
        parts.append(re.escape(pattern[last:match.start()]))
        name = match.group(1)
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>{PLACEHOLDERS[name]})")
        seen.add(name)
        last = match.end()
    parts.append(re.escape(pattern[last:]))
    return re.compile("".join(parts))


def existing(pattern: str) -> list[tuple[dict[str, str], pathlib.Path]]:
    """The folders that match ``pattern``, oldest first (by version, then time)."""
    absolute = str(pathlib.Path(pattern).expanduser().absolute())
    wildcard = "".join(glob.escape(piece) if i % 2 == 0 else "*"
                       for i, piece in enumerate(_FIELD.split(absolute)))
    regex = _regex(absolute)
    found = []
    for path in glob.glob(wildcard):
        match = regex.fullmatch(path)
        if match and os.path.isdir(path):
            found.append((match.groupdict(), pathlib.Path(path)))
    return sorted(found, key=lambda item: (int(item[0].get("version") or -1),
                                           item[0].get("time") or ""))


def _fill(pattern: str, version: int, moment: datetime.datetime) -> str:
    values = {"version": str(version), "time": moment.strftime(TIME_FORMAT)}
    return _FIELD.sub(lambda m: values[m.group(1)], pattern)


def resolve(out_dir: str, *, restarted: bool = False, resume: str | None = None,
            now: datetime.datetime | None = None) -> str:
    """The run's folder for ``out_dir`` (see the module docstring), created when new.
    ``out_dir`` without placeholders is returned as it is. Call it on rank 0 only."""
    if not is_pattern(out_dir):
        return out_dir
    found = existing(out_dir)
    if resume:
        resume_path = pathlib.Path(resume).expanduser().absolute()
        for _, folder in found:
            if folder == resume_path or folder in resume_path.parents:
                return str(folder)
    if restarted and found:
        return str(found[-1][1])
    version = 1 + max((int(v["version"]) for v, _ in found if v.get("version")),
                      default=-1)
    moment = now or datetime.datetime.now(datetime.timezone.utc)
    for _ in range(100):
        path = pathlib.Path(_fill(out_dir, version, moment)).expanduser()
        try:
            # Creating the folder claims it: a run started at the same moment (the same
            # second, or the same next version) gets FileExistsError and takes the next.
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            return str(path)
        except FileExistsError:
            version += 1
            moment += datetime.timedelta(seconds=1)
    raise ConfigError(f"config key 'out_dir': no free folder for {out_dir!r} after 100 "
                      "tries; clean up old runs or use another pattern")


def holds_a_run(out_dir) -> list[str]:
    """What in ``out_dir`` shows a run was there: snapshots, a summary.json (not of a run
    that failed before its first step)."""
    path = pathlib.Path(out_dir)
    shown = ["snapshots"] if any(path.glob("checkpoints/*")) else []
    if (summary := path / "summary.json").exists() and not _failed_before_training(summary):
        shown.append("summary.json")
    return shown


def _failed_before_training(summary: pathlib.Path) -> bool:
    """A summary.json of a failed (or interrupted) run at step 0 (unreadable: a run)."""
    record = _json(summary) or {}
    return record.get("status") in ("failed", "interrupted") and record.get("global_step") == 0


def completed_run(out_dir) -> tuple[dict, dict] | None:
    """(summary, config) of the completed run ``out_dir`` holds, or None; a ConfigError
    when summary.json's counts are not counts."""
    if is_pattern(out_dir):
        return None
    summary, config = (_json(pathlib.Path(out_dir) / name)
                       for name in ("summary.json", "config.json"))
    if summary is None or config is None or summary.get("status") != "completed":
        return None
    for key in ("epochs_completed", "global_step"):
        value = summary.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ConfigError(f"{pathlib.Path(out_dir) / 'summary.json'}: {key!r} is "
                              f"{value!r}, not a count; fix it, or start over with "
                              "--no-resume --overwrite")
    agrees = _snapshot_agrees(pathlib.Path(out_dir), summary, config)
    return (summary, config) if agrees else None


def _snapshot_agrees(out_dir: pathlib.Path, summary: dict, config: dict) -> bool:
    """Whether the newest snapshot's manifest (if any) records the epochs, steps and config
    summary.json and config.json say: an edited file is not believed."""
    try:
        name = (out_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return True
    manifest = read_manifest(out_dir / "checkpoints" / name)
    said = (summary.get("epochs_completed"), summary.get("global_step"), config_digest(config))
    return manifest is None or said == (manifest.get("epoch"), manifest.get("step"),
                                        manifest.get("config") or said[2])  # older: none


def _json(path: pathlib.Path) -> dict | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def refuse_smoke_over_a_run(out_dir: str) -> None:
    """A ConfigError when the smoke run's folder holds a run that was not one (no
    limit_batches in its config.json): a smoke run replaces only an earlier smoke run."""
    shown = holds_a_run(out_dir)  # none for a pattern: not a folder
    if shown and not (_json(pathlib.Path(out_dir) / "config.json") or {}).get(
            "limit_batches"):
        raise ConfigError(f"smoke run: {out_dir} holds a run ({' and '.join(shown)}) that "
                          "was not a smoke run (no limit_batches in its config.json), which "
                          "the smoke run would replace; move it, or give another out_dir")


def refuse_fresh_start(out_dir: str, asked: str = "--no-resume",
                       overwrite: str = "add --overwrite") -> None:
    """A fresh start (``asked``: the door's spelling) without ``overwrite``: a ConfigError
    when ``out_dir`` holds a run."""
    if is_pattern(out_dir):
        return  # a new folder anyway
    shown = holds_a_run(out_dir)
    if shown:
        raise ConfigError(
            f"{asked}: {out_dir} holds a run ({' and '.join(shown)}); {overwrite} "
            "to delete it first, or give another out_dir (out_dir=.../version_{version} "
            "makes a new folder each run)")


def clear(out_dir, files: Iterable[str]) -> list[str]:
    """Remove the run's ``files`` (:func:`run_files`) from ``out_dir``; the names removed."""
    removed = []
    for name in files:
        path = pathlib.Path(out_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def settle(cfg, world, options: dict, files: Iterable[str]) -> None:
    """Decide the run's folder on rank 0 (fill the pattern, or with ``--no-resume
    --overwrite`` clear the old ``files``) and set every rank's ``cfg.out_dir``: collective."""
    decision: str | BaseException | None = None
    if world.rank == 0:
        try:
            # A restart continues its folder, unless --no-resume: two runs never share one.
            restarted = world.restart_count > 0 and not options.get("no_resume")
            decision = resolve(cfg.out_dir, restarted=restarted,
                               resume=options.get("resume"))
            if options.get("no_resume") and options.get("overwrite") and \
                    not is_pattern(cfg.out_dir):
                removed = clear(decision, files)
                if removed:
                    print(f"overwrite: removed {', '.join(removed)} from {decision}",
                          flush=True)
        except (ConfigError, OSError) as exc:
            decision = exc if isinstance(exc, ConfigError) else ConfigError(
                f"config key 'out_dir': cannot prepare {cfg.out_dir}: {exc}")
    decision = distributed.broadcast_object(decision)
    if isinstance(decision, BaseException):
        raise decision
    cfg.out_dir = decision
