"""Errors the user can act on, and the exit codes of ``engine-run``.

The CLI prints an :class:`EngineError` as one line, without a traceback (set
``ENGINE_TRACEBACK=1`` or pass ``--traceback`` to see it), and exits with the error's
``exit_code``: 0 completed, 1 failed, 2 usage or configuration, 75 pre-empted
(sysexits' ``EX_TEMPFAIL``: a wrapper script can tell "run me again" from "done" and
"broken"), 130 interrupted (docs/configuration.md has the table).
"""

from __future__ import annotations

import os
import re
import sys

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130

#: Set to 1 to print the traceback of every error (``engine-run --traceback`` sets it).
TRACEBACK_ENV = "ENGINE_TRACEBACK"


class EngineError(Exception):
    """A problem with the user's input or environment; the message says what is wrong
    and what would be right."""

    exit_code = EXIT_USAGE


class ConfigError(EngineError):
    """A bad recipe, a bad override or an inconsistent configuration."""


class PluginError(EngineError):
    """A plugin that fails to import, implements an unknown hook, or registers a
    component under a name that is already taken."""


class LaunchError(EngineError):
    """Missing or inconsistent launcher variables, an unusable port, an init timeout."""


class CheckpointError(EngineError):
    """A checkpoint that is missing, corrupt or does not match the model."""


class RunError(EngineError):
    """The run started and then failed: a worker died or raised, a collective failed,
    the loss became non-finite."""

    exit_code = EXIT_FAILED


class PeerFailed(RunError):
    """A collective failed because another rank failed first (the roll call named no
    rank that stopped answering): that rank's error is the one to read. A worker the
    engine spawned leaves it unprinted; the launcher's last line names the first one."""


class WorkerFailed(RunError, LaunchError):
    """A worker process exited with an error (it printed its own message) or was
    killed. ``exit_code`` is the worker's own when it said why (1 or 2), else 1."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED, *, failure: str = "",
                 restartable: bool = False):
        super().__init__(message)
        self.exit_code = exit_code if exit_code in (EXIT_FAILED, EXIT_USAGE) else EXIT_FAILED
        #: Which worker failed and how, in a few words ("worker rank 1 was killed by
        #: SIGKILL"), where the launcher that started it knows.
        self.failure = failure
        #: Whether starting the workers again may help (spawn --max-restarts): killed by
        #: a signal, or exited with 1 (the run failed); not a usage or configuration
        #: error (exit 2, which a restart would meet again), an interrupt (130), nor a
        #: failure after the launcher was asked to stop (a forwarded SIGTERM or SIGUSR1:
        #: pre-emption).
        self.restartable = restartable


class Interrupted(KeyboardInterrupt, SystemExit):
    """Ctrl-C ended the run; the message says what became of the workers. A
    KeyboardInterrupt, so that it passes every ``except Exception``; a SystemExit with
    code 130, so that a script that does not catch it ends as engine-run does."""

    code = EXIT_INTERRUPTED


class PluginCodeError(RunError):
    """An unexpected exception inside a plugin's code; the message names the plugin and
    the component or hook, and where it was raised."""


def exit_code(exc: BaseException) -> int:
    """The exit status for a run that ended with ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, EngineError):
        return exc.exit_code
    return EXIT_FAILED


def traceback_wanted() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def traceback_hint(exc: BaseException) -> str:
    """For an error in plugin code, how to see where it came from."""
    if isinstance(exc, PluginCodeError) and not traceback_wanted():
        return f"; {TRACEBACK_ENV}=1 or --traceback shows the traceback"
    return ""


def first_line(exc: BaseException, default: str = "") -> str:
    """The first line of an exception's message (``default`` when it has none): the
    one helper for it, so that every one-line report cuts a message the same way."""
    return (str(exc).strip().splitlines() or [default])[0]


def one_line(exc: BaseException) -> str:
    """``ValueError: the first line of its message`` (summary.json's ``error``)."""
    first = first_line(exc)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


#: The messages this process has warned about (:func:`warn`'s default ``said``).
_warned: set[str] = set()


def warn(message: str, *, said: set[str] | None = _warned) -> None:
    """``warning: MESSAGE`` on stderr: the engine's one way to warn. ``said`` is the
    policy: the messages already said, each said once (a warning repeated every epoch
    or every save would bury the output): this process's by default, or a run's or a
    parallel mode's own set; None says it every time (a snapshot found unusable twice
    is said twice). Which ranks warn is the caller's to decide (rank 0 for the run)."""
    if said is not None:
        if message in said:
            return
        said.add(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


#: The name code written before :func:`warn` imports (its default policy: once a process).
warn_once = warn


def error_line(exc: BaseException) -> str:
    """The error as the user reads it, on the launcher's last line and after
    ``error:``: an EngineError's own message (it says what is wrong and what would be
    right), anything else as :func:`one_line`."""
    if isinstance(exc, EngineError):
        return f"{exc}{traceback_hint(exc)}"
    return one_line(exc)


#: The global a ``torch.load(weights_only=True)`` refused, in torch's wordings: "Unsupported
#: global: GLOBAL os.system was not an allowed global by default" (torch 2.4-2.5),
#: "Trying to load unsupported GLOBAL posix.system whose module posix is blocked" (2.6+).
_REFUSED_GLOBAL = re.compile(r"\bGLOBAL ([\w.]+)")


def untrusted_pickle(path, exc: BaseException) -> str | None:
    """One line for a file that ``torch.load(weights_only=True)`` refused because it
    holds a pickled Python object (a global to import and call: code, possibly
    hostile), naming that global; None for any other load error. torch's own text
    recommends weights_only=False, which would run it."""
    match = _REFUSED_GLOBAL.search(str(exc))
    if match is None:
        return None
    return (f"{path} is not trusted: it holds a pickled Python object ({match.group(1)}), "
            "which torch.load(weights_only=True) refused to import; a snapshot or state_dict "
            "holds only tensors and plain values, so the file was not loaded")
