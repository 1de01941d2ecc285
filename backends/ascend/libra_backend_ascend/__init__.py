"""Libra's ascend backend (a plugin: entry point `ascend` in the group `libra.backends`)."""

from libra_backend_ascend.backend import AscendBackend

__all__ = ["AscendBackend"]
