"""The built-in plugins (import name ``engine.plugins``), one module each.

They are registered exactly like third-party plugins: see
``engine.plugin_manager.BUILTIN_PLUGINS``.
"""
