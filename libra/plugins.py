"""Loading a user's code named in the config as `package.module:attribute` (a custom tool's
callable, a reward function): one loader, errors that name the config field and the spec."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def load_object(spec: str, field: str) -> Any:
    """Imports `package.module:attribute` (dotted attributes allowed: `module:Class.method`);
    ValueError naming `field` and `spec` when it is malformed or not there."""
    module_name, colon, attribute = spec.partition(":")
    if not module_name or not colon or not attribute:
        raise ValueError(f"{field} must be 'package.module:attribute', got {spec!r}")
    # A user's module next to where the job was started is found as with `python -m` (the
    # console script's own folder is on the path instead).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for name in attribute.split("."):
            target = getattr(target, name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field} {spec!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    return target


def load_callable(spec: str, field: str) -> Any:
    """`load_object`, which must be callable."""
    target = load_object(spec, field)
    if not callable(target):
        raise ValueError(f"{field} {spec!r} is not callable (it is a {type(target).__name__})")
    return target
