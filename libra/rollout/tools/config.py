"""Config of the tools and their sandbox: the `tools` section of `LibraConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SandboxConfig:
    """The pool of sandboxed Python workers that runs model-written code."""

    num_workers: int = 2
    """Long-lived worker processes; each runs one call at a time in a fresh fork."""
    timeout_s: float = 10.0
    """Wall-clock limit of one call (a call may ask for less)."""
    cpu_time_s: float = 10.0
    """RLIMIT_CPU of one call, in CPU seconds (rounded up to whole seconds)."""
    memory_mb: int = 1024
    """RLIMIT_AS of one call (address space, so it includes the interpreter's ~30 MB)."""
    max_processes: int = 32
    """RLIMIT_NPROC of one call under its private uid, counting the worker itself."""
    max_output_bytes: int = 65536
    """stdout + stderr kept per call; a call printing more is stopped (status failure)."""
    max_file_bytes: int = 16 * 1024 * 1024
    """RLIMIT_FSIZE: the largest file a call may write."""
    tmpfs_mb: int = 64
    """Size of the private directory (a tmpfs on /tmp in the worker's mount namespace)."""
    uid_base: int = 61000
    """First of the uids the workers run as (one per worker, taken under a lock file so pools of
    different processes never share one). Only used when running as root."""
    uid_range: int = 1000
    """How many uids from `uid_base` may be taken."""
    python_executable: str | None = None
    """Interpreter of the workers (default: the one running Libra, so the venv's packages can be
    imported by sandboxed code)."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"tools.sandbox.num_workers must be >= 1, got {self.num_workers}")
        for name in ("timeout_s", "cpu_time_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"tools.sandbox.{name} must be > 0, got {getattr(self, name)}")
        if self.memory_mb < 64:
            raise ValueError(
                f"tools.sandbox.memory_mb must be >= 64 (the interpreter needs it), got {self.memory_mb}"
            )
        if self.max_processes < 2:
            raise ValueError(
                f"tools.sandbox.max_processes must be >= 2 (worker + call), got {self.max_processes}"
            )
        for name in ("max_output_bytes", "max_file_bytes", "tmpfs_mb", "uid_range"):
            if getattr(self, name) < 1:
                raise ValueError(f"tools.sandbox.{name} must be >= 1, got {getattr(self, name)}")
        if not 1000 <= self.uid_base <= 2**31 - self.uid_range:
            raise ValueError(
                f"tools.sandbox.uid_base must be a non-system uid (>= 1000), got {self.uid_base}"
            )


@dataclass
class CustomToolConfig:
    """A tool registered from the config: a Python callable or a remote endpoint."""

    name: str = ""
    """The name the model calls it by."""
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema of the arguments."""
    callable: str | None = None
    """`package.module:function` taking the arguments dict and returning a str or a ToolResult
    (sync or async)."""
    endpoint: str | None = None
    """`http://host:port/path` (POST of the arguments as JSON; the reply is JSON
    `{"content": str, "status": "success"|"failure"|"timeout"}` or plain text) or
    `grpc://host:port` (service `libra.v1.ToolService`, see protos/libra/v1/tools.proto)."""
    timeout_s: float = 10.0
    """Per-call limit; an exceeded call returns status timeout."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"tools.custom[].name must be a non-empty identifier, got {self.name!r}")
        if (self.callable is None) == (self.endpoint is None):
            raise ValueError(f"tools.custom[{self.name}]: set exactly one of callable and endpoint")
        if self.callable is not None and ":" not in self.callable:
            raise ValueError(
                f"tools.custom[{self.name}].callable must look like 'package.module:function', "
                f"got {self.callable!r}"
            )
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://", "grpc://")):
            raise ValueError(
                f"tools.custom[{self.name}].endpoint must start with http://, https:// or grpc://, "
                f"got {self.endpoint!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"tools.custom[{self.name}].timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class ToolsConfig:
    """Which tools the agent loop offers the model, and their limits."""

    enabled: list[str] = field(default_factory=lambda: ["python", "calculator"])
    """Built-in tools to offer: `python` (sandboxed interpreter), `calculator`, `retrieve`."""
    max_result_chars: int = 4000
    """Tool results are cut to this many characters before they are shown to the model."""
    retrieval_corpus: str | None = None
    """JSONL collection for `retrieve`: one `{"id", "text"|"contents", "title"?}` per line."""
    retrieval_top_k: int = 3
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    custom: list[CustomToolConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        known = {"python", "calculator", "retrieve"}
        unknown = [name for name in self.enabled if name not in known]
        if unknown:
            raise ValueError(f"tools.enabled has unknown tools {unknown}; built-in tools are {sorted(known)}")
        if "retrieve" in self.enabled and not self.retrieval_corpus:
            raise ValueError("tools.retrieval_corpus must be set when 'retrieve' is in tools.enabled")
        if self.max_result_chars < 16:
            raise ValueError(f"tools.max_result_chars must be >= 16, got {self.max_result_chars}")
        if self.retrieval_top_k < 1:
            raise ValueError(f"tools.retrieval_top_k must be >= 1, got {self.retrieval_top_k}")
        names = list(self.enabled) + [c.name for c in self.custom]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tools: duplicate tool names {duplicates} (tools.enabled and tools.custom)")
