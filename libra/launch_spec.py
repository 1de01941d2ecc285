"""Launch specs: what a worker process needs from whoever starts it, as one typed dataclass per
role (`TrainRankSpec` beside the train rank's `main()`, `InstanceSpec` beside the rollout
instance's), carried across the process boundary as a single JSON argument.

`to_argv` and `from_argv` are the one round trip: the starter never hand-builds a command line, the
worker never parses a blob whose writer lives elsewhere, and every config section the worker
needs (the control plane's TLS settings, the backend's options) travels with it. The token does
not: it stays in the environment (LIBRA_TOKEN), never on a command line.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, ClassVar, Self

SPEC_FLAG = "--spec"


class ArgvSpec:
    """Mixin of a frozen dataclass that describes how to start one worker process."""

    module: ClassVar[str]
    """The worker's module: started as `python -m <module> --spec JSON`."""

    def to_argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", self.module, SPEC_FLAG, json.dumps(encode(self), separators=(",", ":"))]

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> Self:
        """The spec from a worker's arguments (`sys.argv[1:]`); ValueError naming the field that
        is missing or wrong."""
        argv = list(argv)
        if len(argv) != 2 or argv[0] != SPEC_FLAG:
            raise ValueError(f"python -m {cls.module} takes exactly `{SPEC_FLAG} JSON`, got {argv[:3]}")
        try:
            raw = json.loads(argv[1])
        except json.JSONDecodeError as e:
            raise ValueError(f"{SPEC_FLAG}: not JSON ({e})") from None
        return decode(cls, raw, cls.__name__)


def encode(value: Any) -> Any:
    """JSON-ready form of a dataclass tree (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    return value


def decode(kind: Any, raw: Any, where: str) -> Any:
    """`raw` (from `encode` and JSON) as type `kind`; ValueError naming `where` otherwise."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return decode(inner, raw, where)
    if origin is typing.Literal:
        if raw not in args:
            raise ValueError(f"{where}: {raw!r} is not one of {list(args)}")
        return raw
    if dataclasses.is_dataclass(kind):
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
        hints = typing.get_type_hints(kind)
        fields = {f.name: f for f in dataclasses.fields(kind) if f.init}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{where} has no field(s) {unknown}")
        return kind(**{name: decode(hints[name], value, f"{where}.{name}") for name, value in raw.items()})
    if origin in (tuple, list):
        if not isinstance(raw, list):
            raise ValueError(f"{where} must be a list, got {type(raw).__name__}")
        item = args[0] if args else Any
        values = [decode(item, v, f"{where}[{i}]") for i, v in enumerate(raw)]
        return tuple(values) if origin is tuple else values
    if origin is dict:
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
        return {k: decode(args[1] if args else Any, v, f"{where}.{k}") for k, v in raw.items()}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{where}: {raw!r} is not one of {[m.value for m in kind]}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if kind is Any or (isinstance(kind, type) and isinstance(raw, kind)):
        return raw
    raise ValueError(f"{where} must be {getattr(kind, '__name__', kind)}, got {raw!r}")
