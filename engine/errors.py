"""Errors the user can act on: the CLI prints them as one line, without a traceback."""

from __future__ import annotations


class EngineError(Exception):
    """A problem with the user's input or environment; the message says what is wrong
    and what would be right."""


class ConfigError(EngineError):
    """A bad recipe, a bad override or an inconsistent configuration."""


class PluginError(EngineError):
    """A plugin that fails to import, implements an unknown hook, or registers a
    component under a name that is already taken."""


class LaunchError(EngineError):
    """Missing or inconsistent launcher variables, an unusable port, an init timeout."""


class CheckpointError(EngineError):
    """A checkpoint that is missing, corrupt or does not match the model."""
