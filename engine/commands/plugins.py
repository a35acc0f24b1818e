"""``engine-run plugins``: every loaded plugin, its version and origin, its hooks and the
components it registers."""

from __future__ import annotations

import argparse


def main(argv) -> int:
    from engine.cli import plugin_args
    from engine.plugin_manager import build_plugin_manager

    parser = argparse.ArgumentParser(prog="engine-run plugins",
                                     description="List the loaded plugins.")
    parser.add_argument("-p", dest="plugins", action="append", default=[], metavar="NAME")
    parser.parse_args(argv)
    pm = build_plugin_manager(plugin_args(argv))
    for name, info in pm.infos.items():
        origin = "built-in" if info.source == "built-in" else f"from {info.source}"
        print(f"{name} {info.version} ({origin}; module {info.module})")
        hooks = pm.hooks_of(name)
        print(f"  hooks: {', '.join(hooks) if hooks else '-'}")
        for kind, names in pm.components_of(name).items():
            print(f"  {kind}: {', '.join(names)}")
    return 0
