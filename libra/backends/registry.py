"""Backends by name: the built-in `cpu`, plus plugins registered under the entry-point group
`libra.backends` (`libra-backend-cuda`, `libra-backend-ascend`, or a third party's).

`cpu` is registered here directly as well as in libra's own package metadata, so it works from a
source checkout that was never installed; a plugin cannot shadow it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from libra.backends.base import Backend
from libra.backends.cpu import CpuBackend

ENTRY_POINT_GROUP = "libra.backends"

_BUILTIN: dict[str, Callable[..., Backend]] = {"cpu": CpuBackend}


def available_backends() -> list[str]:
    """Names `get_backend` accepts, sorted. A name being listed does not mean the hardware is
    here: ask `get_backend(name).availability()`."""
    return sorted(_BUILTIN.keys() | _plugin_entry_points().keys())


def get_backend(name: str, **options: object) -> Backend:
    """A new backend instance; `options` are keyword arguments of its constructor (e.g. cpu's
    `num_devices`). Raises ValueError for an unknown name or option."""
    factory = _find_factory(name)
    _check_options(name, factory, options)
    backend = factory(**options)
    if not isinstance(backend, Backend):
        raise TypeError(f"backend {name!r} ({factory!r}) does not implement the Backend protocol")
    return backend


def _find_factory(name: str) -> Callable[..., Backend]:
    if name in _BUILTIN:
        return _BUILTIN[name]
    plugin = _plugin_entry_points().get(name)
    if plugin is None:
        known = ", ".join(available_backends())
        raise ValueError(f"unknown backend {name!r}; known backends: {known}")
    try:
        return plugin.load()
    except Exception as exc:  # an ImportError, or anything the plugin's import raises
        raise RuntimeError(f"backend {name!r} (entry point {plugin.value}) failed to import: {exc}") from exc


def _plugin_entry_points() -> dict[str, EntryPoint]:
    # Not cached: it is called once per process in practice, and a plugin installed while the
    # process runs (tests, notebooks) then shows up.
    found: dict[str, EntryPoint] = {}
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, entry_point)
    return found


def _check_options(name: str, factory: Callable[..., Backend], options: dict[str, object]) -> None:
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(options.keys() - parameters.keys())
    if unknown:
        accepted = ", ".join(parameters) or "none"
        raise ValueError(f"backend {name!r} has no option(s) {', '.join(unknown)}; its options: {accepted}")
