# This folder is a separate package with its own tests, which run the way its author
# would run them: installed, in a subprocess (tests/test_sample_plugin.py). The engine's
# own test run must not collect them directly.
collect_ignore = ["tests"]
