"""Registries of components chosen by name (launchers, parallel modes, checkpointers).

They are filled by the registration hooks. Unlike a dict, a registry refuses a name that
is already taken (naming both plugins), and a lookup of an unknown name lists what is
registered.
"""

from __future__ import annotations

from typing import Any

from engine.errors import PluginError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind  # "launcher", "parallel mode", "checkpointer"
        self._entries: dict[str, Any] = {}
        self._owners: dict[str, str] = {}
        # Set by the plugin manager while it calls one plugin's registration hook.
        self.current_plugin = "<unknown>"

    def add(self, name: str, component: Any) -> None:
        if name in self._entries:
            raise PluginError(
                f"{self.kind} {name!r} is registered twice: by plugin "
                f"{self._owners[name]!r} and by plugin {self.current_plugin!r}; "
                f"disable one with -p no:NAME"
            )
        self._entries[name] = component
        self._owners[name] = self.current_plugin

    def get(self, name: str) -> Any:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none"
            raise PluginError(
                f"{self.kind} {name!r} is not available (plugin may not be installed); "
                f"registered: {known}"
            ) from None

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def items(self):
        return self._entries.items()

    def by_owner(self, plugin_name: str) -> list[str]:
        return [n for n, owner in self._owners.items() if owner == plugin_name]

    def __contains__(self, name: str) -> bool:
        return name in self._entries
