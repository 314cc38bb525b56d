"""Loads the flashverify pytest plugin (``verify/plugin.py``) when running from a checkout whose package
is not installed; an installed package registers it itself (entry point ``pytest11``)."""

from importlib.metadata import entry_points

if not any(ep.name == "flashverify" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["verify.plugin"]
