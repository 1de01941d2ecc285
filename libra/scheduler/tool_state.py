"""Tool-return states: the causal signal C-MLFQ learns from.

A tool return becomes a state of three parts: the tool type, the size class of its payload
(small / medium / large by token bounds of `CmlfqConfig`), and the execution status
(success / failure / timeout), which `infer_status` reads from whatever the tool produced. The
C++ core sees a state as one 64-bit key: a stable 56-bit hash of the tool type, then 4 bits of
size class and 4 of status. Hashing (not a table of ids assigned on first sight) makes keys
identical across controllers, restarts and checkpoints, so trees merge and restore without a
side table.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libra.trajectory import ToolStatus

if TYPE_CHECKING:
    from libra.scheduler.config import CmlfqConfig


class SizeClass(enum.IntEnum):
    SMALL = 0
    MEDIUM = 1
    LARGE = 2


@dataclass(frozen=True, slots=True)
class ToolReturnState:
    tool: str
    size_class: SizeClass
    status: ToolStatus
    key: int = field(init=False, repr=False, compare=False)
    """The packed key the C++ core compares (computed once)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", encode_state(self.tool, self.size_class, self.status))

    @classmethod
    def of(cls, tool: str, status: ToolStatus, payload_tokens: int, config: CmlfqConfig) -> ToolReturnState:
        """The state of a tool return whose result, as appended to the context, is `payload_tokens` long."""
        return cls(tool, size_class_of(payload_tokens, config), status)


@functools.lru_cache(maxsize=4096)
def tool_type_id(tool: str) -> int:
    """Stable 56-bit id of a tool type (BLAKE2b); a collision between two of a run's few tools
    has odds around 1e-15."""
    return int.from_bytes(hashlib.blake2b(tool.encode(), digest_size=7).digest(), "little")


def encode_state(tool: str, size_class: SizeClass, status: ToolStatus) -> int:
    return (tool_type_id(tool) << 8) | (int(size_class) << 4) | int(status)


def size_class_of(payload_tokens: int, config: CmlfqConfig) -> SizeClass:
    if payload_tokens <= config.small_payload_max_tokens:
        return SizeClass.SMALL
    if payload_tokens <= config.medium_payload_max_tokens:
        return SizeClass.MEDIUM
    return SizeClass.LARGE


# Status inference. Tools report outcomes in many shapes: raised exceptions, result dicts with a
# status word, exit codes or error fields, or plain text with a Python traceback. Explicit signals
# (exception types, status words, exit codes) win over reading text. Timeouts are told apart
# from other failures because they predict a different future (a retry with a smaller input,
# not a fix of the code).

_TRACEBACK = "Traceback (most recent call last)"
_TIMEOUT_TEXT = re.compile(r"timed?[ _-]?out|TimeoutError|TimeoutExpired|deadline exceeded", re.IGNORECASE)
_STATUS_WORDS = {
    **dict.fromkeys(("success", "succeeded", "ok", "completed", "done"), ToolStatus.SUCCESS),
    **dict.fromkeys(("error", "failed", "failure", "exception", "crashed", "killed"), ToolStatus.FAILURE),
    **dict.fromkeys(("timeout", "timed_out", "timedout", "timed out"), ToolStatus.TIMEOUT),
}
_EXIT_CODE_FIELDS = ("returncode", "exit_code", "exit_status")
_EXIT_CODE_TIMEOUT = 124
"""What coreutils `timeout` exits with when it kills the command."""
_ERROR_FIELDS = ("error", "exception", "traceback")
_OUTPUT_FIELDS = ("output", "stdout", "stderr", "content", "result")


def infer_status(result: object) -> ToolStatus:
    """Success, failure or timeout of a tool call, from what the tool returned or raised: an
    exception, a mapping (or dataclass, or object with attributes) of result fields, text, or None."""
    if isinstance(result, BaseException):
        timed_out = isinstance(result, TimeoutError | subprocess.TimeoutExpired)
        return ToolStatus.TIMEOUT if timed_out or "Timeout" in type(result).__name__ else ToolStatus.FAILURE
    if result is None:
        return ToolStatus.SUCCESS
    if isinstance(result, bytes):
        result = result.decode(errors="replace")
    if isinstance(result, str):
        return _status_of_text(result)
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        result = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    elif not isinstance(result, Mapping) and hasattr(result, "__dict__"):
        result = vars(result)
    if isinstance(result, Mapping):
        return _status_of_fields(result)
    return ToolStatus.SUCCESS


def _status_of_fields(fields: Mapping) -> ToolStatus:
    if fields.get("timed_out") is True or fields.get("timeout") is True:
        return ToolStatus.TIMEOUT
    status = fields.get("status", fields.get("state"))
    if isinstance(status, str) and status.strip().lower() in _STATUS_WORDS:
        return _STATUS_WORDS[status.strip().lower()]
    if fields.get("success") is False or fields.get("ok") is False:
        return ToolStatus.FAILURE
    for name in _EXIT_CODE_FIELDS:
        code = fields.get(name)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            return ToolStatus.TIMEOUT if code == _EXIT_CODE_TIMEOUT else ToolStatus.FAILURE
    for name in _ERROR_FIELDS:
        error = fields.get(name)
        if isinstance(error, BaseException):
            return infer_status(error)
        if error:
            return _status_of_error_text(str(error))
    for name in _OUTPUT_FIELDS:
        output = fields.get(name)
        if isinstance(output, str) and _TRACEBACK in output:
            return _status_of_traceback(output)
    return ToolStatus.SUCCESS


def _status_of_text(text: str) -> ToolStatus:
    if _TRACEBACK in text:
        return _status_of_traceback(text)
    head = text.lstrip()[:200].lower()
    if head.startswith(("timeout", "timed out")):
        return ToolStatus.TIMEOUT
    if head.startswith(("error", "exception", "fatal")):
        return _status_of_error_text(head)
    return ToolStatus.SUCCESS


def _status_of_traceback(text: str) -> ToolStatus:
    """The first unindented line after the (last) traceback's frames names the exception."""
    frames_and_after = text.rsplit(_TRACEBACK, 1)[1].splitlines()[1:]
    exception_line = next((line for line in frames_and_after if line and not line[0].isspace()), "")
    return _status_of_error_text(exception_line)


def _status_of_error_text(text: str) -> ToolStatus:
    return ToolStatus.TIMEOUT if _TIMEOUT_TEXT.search(text) else ToolStatus.FAILURE
